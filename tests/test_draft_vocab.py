"""A reduced draft vocabulary (`AdaFlashConfig.draft_vocab`): drafts only ever come from it, output stays exactly the
target's (greedy identity at batch 1 and 3, sampling chi-square with a negative control), it survives save/load in
the official format without touching the official keys, and the builder ranks by frequency."""

import json

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from test_generate_sampling import NEW, PROMPT, SAMPLING, VOCAB, exact_joint, p_value
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.generation.draft_head import DraftHead
from adaflash_hf.training import build_draft_vocab
from adaflash_hf.training.draft_vocab import coverage

PROMPTS = [[0, 5, 9, 33, 17, 4, 80], [0, 44, 8], [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 101, 3, 9]]


def _batch(prompts):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    return ids, mask


def test_draft_head_projects_only_the_draft_vocabulary():
    head = tiny_target().get_output_embeddings()
    vocab = [1, 4, 9, 50, 127]
    hidden = torch.randn(2, 3, head.weight.shape[1])
    logits = DraftHead(head, dtype_name="same", vocab=vocab)(hidden)
    full = head(hidden).float()
    outside = torch.ones(head.weight.shape[0], dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[..., outside]).all()
    torch.testing.assert_close(logits[..., vocab], full[..., vocab])
    assert set(logits.argmax(-1).flatten().tolist()) <= set(vocab)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_identical_and_drafts_stay_in_the_vocabulary(batch):
    target = tiny_target()
    ids, mask = _batch(PROMPTS[:batch])
    config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=2, eos_token_id=None)
    reference = target.generate(ids, attention_mask=mask, generation_config=config)
    unpadded = [row[ids.shape[1] - len(prompt) :] for row, prompt in zip(reference.tolist(), PROMPTS)]
    written = sorted({t for row in unpadded for t in row})
    missing = written[::3]  # a third of the tokens the target writes cannot be drafted
    partial = sorted(set(range(target.config.vocab_size)) - set(missing))
    acceptance = {}
    for name, vocab in (("all", None), ("written", written), ("partial", partial)):
        for drafter in (tiny_drafter(target, draft_vocab=vocab), oracle_drafter(target, unpadded, draft_vocab=vocab)):
            with adaflash_hf.record_stats() as stats:
                out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
            assert torch.equal(out, reference), name
        acceptance[name] = stats.mean_acceptance_length  # the oracle's
    # An oracle whose every token is in the vocabulary accepts as much as without one; one missing tokens, less.
    assert acceptance["written"] == acceptance["all"] > 4
    assert acceptance["partial"] < acceptance["all"]


def test_drafts_of_a_generate_call_come_from_the_vocabulary(monkeypatch):
    from adaflash_hf.generation import candidate_generator

    target = tiny_target()
    vocab = list(range(0, 128, 2))
    drafted = []
    original = candidate_generator.AdaFlashCandidateGenerator.draft

    def spy(self, *args, **kwargs):
        drafts = original(self, *args, **kwargs)
        drafted.extend(drafts.tokens.flatten().tolist())
        return drafts

    monkeypatch.setattr(candidate_generator.AdaFlashCandidateGenerator, "draft", spy)
    ids, mask = _batch(PROMPTS)
    for do_sample in (False, True):
        target.generate(
            ids,
            attention_mask=mask,
            assistant_model=tiny_drafter(target, draft_vocab=vocab),
            max_new_tokens=20,
            do_sample=do_sample,
            pad_token_id=2,
        )
    assert drafted and set(drafted) <= set(vocab)


def test_sampling_with_a_draft_vocabulary_is_exact_and_the_test_can_fail():
    """Drafts are sampled from the drafter's distribution over its vocabulary (zero elsewhere) and accepted against
    it: the output is the target's processed distribution, including tokens the drafter can never propose."""
    target = tiny_target(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=VOCAB - 1, draft_vocab=[0, 3, 4, 5, 7, 8])
    joint = exact_joint(target)
    torch.manual_seed(1357)
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(30):
            out = target.generate(torch.tensor([PROMPT] * 50), assistant_model=drafter, max_new_tokens=NEW, **SAMPLING)
            samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    assert sum(sum(s.accepted) for s in stats.steps) > 0
    assert any(set(cell) - {0, 3, 4, 5, 7, 8} for cell in samples)  # tokens outside the vocabulary still appear
    assert p_value(samples, joint) > 1e-3
    # Negative control: the wrong implementation, output restricted to the draft vocabulary (plain sampling with the
    # other tokens suppressed), fails the same test.
    torch.manual_seed(1357)
    outside = sorted(set(range(VOCAB)) - {0, 3, 4, 5, 7, 8})
    out = target.generate(torch.tensor([PROMPT] * 1500), max_new_tokens=NEW, suppress_tokens=outside, **SAMPLING)
    restricted = [tuple(row[len(PROMPT) :].tolist()) for row in out]
    assert p_value([cell for cell in restricted if cell in joint], joint) < 1e-3


def test_draft_vocabulary_survives_save_and_load_outside_the_official_keys(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab=[1, 2, 3, 10, 99])
    drafter.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["adaflash_config"]["draft_vocab"] == [1, 2, 3, 10, 99]
    assert "draft_vocab" not in raw["dflash_config"] and "draft_vocab_size" not in raw
    loaded = AdaFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab == [1, 2, 3, 10, 99]
    native = tmp_path / "native"
    drafter.save_pretrained(native, save_format="adaflash")
    assert AdaFlashDrafter.from_pretrained(native).config.draft_vocab == [1, 2, 3, 10, 99]


@pytest.mark.parametrize(
    ("vocab", "message"),
    [
        ([5, 3, 9], "strictly ascending"),
        ([1, 1, 2], "strictly ascending"),
        ([1, 200], "outside the target vocab"),
        ([4], "at least 2"),
    ],
)
def test_bad_draft_vocabulary_is_one_clear_error(vocab, message):
    target = tiny_target()
    # transformers' strict config validation wraps the ValueError; the message is ours
    with pytest.raises(Exception, match=message):
        AdaFlashConfig.from_target_config(target.config, mask_token_id=127, target_layer_ids=[0], draft_vocab=vocab)


def test_build_draft_vocab_ranks_by_frequency_and_keeps_what_it_must():
    answers = [[5, 5, 5, 7, 7, 9], [7, 5, 11, 9, 1]]
    assert build_draft_vocab(answers, 2) == [5, 7]  # 5 and 7: four and three times
    assert build_draft_vocab(answers, 3) == [5, 7, 9]  # 9 (twice) before 11 and 1 (once)
    assert build_draft_vocab(answers, 4, always=[0]) == [0, 5, 7, 9]
    assert build_draft_vocab(answers, 5) == [1, 5, 7, 9, 11]  # 1 and 11 tie: the smaller id first, both fit
    assert build_draft_vocab(answers, 100) == [1, 5, 7, 9, 11]
    assert coverage(answers, [5, 7]) == 7 / 11
    with pytest.raises(ValueError, match="at least 2"):
        build_draft_vocab(answers, 1)
