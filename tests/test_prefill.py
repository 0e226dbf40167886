"""The prompt read in groups of rows of similar length (`prefill.py`): the grouping is the cheapest, the cache and the
features it leaves are the padded forward's, and generate() with it stays exact."""

import itertools
import random

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from test_generate_batched import PAD, alone, left_pad, rows_of
from transformers import DynamicCache, GenerationConfig

import adaflash_hf
from adaflash_hf.generation import prefill
from adaflash_hf.generation.decoding import _prefill_positions


def cost(spans, lengths, forward_tokens):
    return sum(len(rows) * max(lengths[r] for r in rows) + forward_tokens for rows in spans)


def partitions(items):
    """Every set partition of ``items``."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        yield [[first]] + smaller
        for i in range(len(smaller)):
            yield smaller[:i] + [[first] + smaller[i]] + smaller[i + 1 :]


def test_groups_are_the_cheapest_of_all_partitions():
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.choice([3, 10, 40, 41, 200, 512]) for _ in range(rng.randint(1, 6))]
        forward_tokens = rng.choice([0, 8, 32, 400])
        spans = prefill.groups(lengths, forward_tokens)
        assert sorted(itertools.chain(*spans)) == list(range(len(lengths)))
        best = min(cost(p, lengths, forward_tokens) for p in partitions(list(range(len(lengths)))))
        assert cost(spans, lengths, forward_tokens) == best


def test_groups_keep_one_forward_unless_splitting_pays_for_it():
    assert prefill.groups([100, 98, 97, 100]) == [[0, 3, 1, 2]]  # 6 padded tokens save less than a forward
    assert prefill.groups([514, 30, 500, 28]) == [[0, 2], [1, 3]]
    assert prefill.groups([7]) == [[0]]


PROMPTS = [list(range(3, 40)), [0, 44], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [0, 61, 62]]


def padded_and_ragged(target, prompts, layers):
    ids, mask = left_pad(prompts)
    positions = _prefill_positions(mask, *ids.shape, ids.device)

    def features(hidden):
        return torch.cat([hidden[i] for i in layers], dim=-1)

    padded = DynamicCache(config=target.config)
    with torch.no_grad():
        out = target(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=padded, output_hidden_states=layers,
            logits_to_keep=1,
        )  # fmt: skip
        ragged = DynamicCache(config=target.config)
        spans = prefill.groups(mask.sum(-1).tolist(), forward_tokens=0)
        assert len(spans) > 1
        logits, context = prefill.ragged_prefill(target, ids, mask, positions, ragged, layers, features, spans)
    return mask, (out.logits, features(out.hidden_states), padded), (logits, context, ragged)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_ragged_prefill_leaves_what_the_padded_forward_leaves(family):
    target = tiny_target(family)
    mask, (logits, context, cache), (r_logits, r_context, r_cache) = padded_and_ragged(target, PROMPTS, [1, 2])
    real = mask.bool()
    torch.testing.assert_close(r_logits, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r_context[real], context[real], rtol=1e-4, atol=1e-5)
    assert not r_context[~real].any()
    assert r_cache.get_seq_length() == cache.get_seq_length() == mask.shape[1]
    for ours, theirs in zip(r_cache.layers, cache.layers):
        for name in ("keys", "values"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.shape == b.shape
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], rtol=1e-4, atol=1e-5)
            assert not a.transpose(1, 2)[~real].any()  # padding columns are zero, masked later as padding is


def test_a_broken_negative_control_is_caught():
    """The same comparison sees rows read at the wrong positions (the check above can fail; a shift would not do:
    rotary attention depends on differences of positions only)."""
    target = tiny_target("llama")
    ids, mask = left_pad(PROMPTS)
    positions = _prefill_positions(mask, *ids.shape, ids.device)
    with torch.no_grad():
        out = target(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(), logits_to_keep=1
        )
        shifted, _ = prefill.ragged_prefill(
            target, ids, mask, positions * 2, DynamicCache(), [0], lambda h: h[0], [[0], [1, 2, 3]]
        )
    assert not torch.allclose(shifted, out.logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode, forwards", [("ragged", 3), ("padded", 1), ("auto", 3)])
def test_generate_reads_the_prompt_in_groups_and_stays_exact(monkeypatch, mode, forwards):
    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 4)  # prompts of 37, 12, 3 and 2 tokens: three groups
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    references = [alone(target, p, max_new_tokens=12, eos_token_id=None) for p in PROMPTS]
    ids, mask = left_pad(PROMPTS)
    config = GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD, adaflash_prefill=mode
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
    assert rows_of(out, PROMPTS) == references
    assert stats.calls[0].prefill_forwards == forwards and stats.calls[0].prefill_time_s > 0


def test_a_returned_cache_is_read_as_plain_decoding_reads_it(monkeypatch):
    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 0)
    target = tiny_target("qwen3")
    ids, mask = left_pad(PROMPTS)
    config = GenerationConfig(
        max_new_tokens=6, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True, adaflash_prefill="ragged"
    )
    with adaflash_hf.record_stats() as stats:
        target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=tiny_drafter(target))
    assert stats.calls[0].prefill_forwards == 1  # its padding columns are plain decoding's, not zeros


def test_a_right_padded_batch_is_read_in_one_forward(monkeypatch):
    """Groups read each row's last columns: with right padding they would drop a row's tokens, so the batch is read
    as plain decoding reads it, and the output is the padded forward's."""
    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 0)
    target = tiny_target("qwen3")
    width = max(map(len, PROMPTS))
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in PROMPTS])
    assert not prefill.ragged_applies("ragged", DynamicCache(), mask, False, ids.device)
    assert prefill.ragged_applies("ragged", DynamicCache(), *left_pad(PROMPTS)[1:], False, ids.device)
    outputs = {}
    for mode in ("ragged", "padded"):
        config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=PAD, adaflash_prefill=mode)
        with adaflash_hf.record_stats() as stats:
            outputs[mode] = target.generate(
                ids, attention_mask=mask, generation_config=config, assistant_model=tiny_drafter(target)
            )
        assert stats.calls[0].prefill_forwards == 1
    assert torch.equal(outputs["ragged"], outputs["padded"])


def test_an_unknown_prefill_mode_is_refused_with_the_choices():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="adaflash_prefill='rows' is not one of 'auto', 'ragged', 'padded'"):
        target.generate(
            torch.tensor([[0, 5, 9]]),
            generation_config=GenerationConfig(max_new_tokens=2, adaflash_prefill="rows"),
            assistant_model=tiny_drafter(target),
        )


def test_context_groups_apply_where_the_prompts_read_does():
    valid = torch.tensor([[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 1]], dtype=torch.bool)
    cpu, empty = torch.device("cpu"), DynamicCache()
    # row 2 stopped after its first step (a hole): its length counts from its first token on
    assert prefill.context_groups("ragged", valid, empty, cpu) == prefill.groups([2, 6, 3])
    assert prefill.context_groups("auto", valid, empty, cpu) == prefill.groups([2, 6, 3])
    every = [[0, 1, 2]]
    assert prefill.context_groups("padded", valid, empty, cpu) == every
    assert prefill.context_groups("auto", valid, empty, torch.device("meta")) == every  # measured on CPUs only
    assert prefill.context_groups("ragged", None, empty, cpu) == [[0]]  # nothing masked: one row or no padding
    assert prefill.context_groups("ragged", torch.ones(3, 6, dtype=torch.bool), empty, cpu) == every
    read = DynamicCache()
    read.update(torch.zeros(3, 1, 2, 4), torch.zeros(3, 1, 2, 4), 0)
    assert prefill.context_groups("ragged", valid, read, cpu) == every  # read before: not the call's first read


def first_reads(monkeypatch, mode, family="qwen3", lay_out=None):
    """A call's first two drafts at batch 4 (the prompts' features and a plain step's, in which row 3 had stopped),
    its context read per ``mode``; returns both drafts and the drafter's cache after them."""
    from adaflash_hf.generation import candidate_generator
    from adaflash_hf.generation.candidate_generator import AdaFlashCandidateGenerator

    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 0)  # prompts of 37, 2, 12 and 3 tokens: one group each
    if lay_out is not None:
        monkeypatch.setattr(candidate_generator, "lay_out", lay_out)
    target = tiny_target(family)
    drafter = tiny_drafter(target, use_length_head=True)
    config = GenerationConfig(max_length=128, do_sample=False, adaflash_draft_head_dtype="same", adaflash_prefill=mode)
    ids, mask = left_pad(PROMPTS)
    positions = _prefill_positions(mask, *ids.shape, ids.device)
    generator = AdaFlashCandidateGenerator(target, drafter, config)
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        context = generator.context_features(out.hidden_states)
        step = torch.tensor([True, True, True, False])  # row 3's plain-step column holds no token
        generator.add_context(context[:, :-1], positions[:, :-1], mask[:, :-1].bool())
        generator.add_context(context[:, -1:], positions[:, -1:], (mask[:, -1].bool() & step)[:, None])
        anchors, lengths = ids[:, -1], torch.full((4,), ids.shape[1])
        budget = torch.full((4,), 7)
        first = generator.draft(anchors, positions[:, -1] + 1, ids, lengths, budget)
        generator.add_context(context[:, -2:], positions[:, -1:] + torch.tensor([[1, 2]]))
        second = generator.draft(anchors, positions[:, -1] + 3, ids, lengths, budget)
    return first, second, generator


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_drafters_first_read_in_groups_drafts_what_the_padded_read_drafts(monkeypatch, family):
    grouped = []
    real = prefill.lay_out
    first, second, ours = first_reads(
        monkeypatch,
        "ragged",
        family,
        lambda cache, parts, *shape: grouped.append(len(parts)) or real(cache, parts, *shape),
    )
    assert grouped == [4]
    p_first, p_second, padded = first_reads(monkeypatch, "padded", family)
    for got, want in ((first, p_first), (second, p_second)):  # the second reads the laid-out cache
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.length_prediction, want.length_prediction, rtol=1e-4, atol=1e-5)
        assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(ours.cache_mask, padded.cache_mask)
    valid = ours.cache_mask
    for mine, theirs in zip(ours.cache.layers, padded.cache.layers):
        for name in ("keys", "values"):
            a, b = getattr(mine, name).transpose(1, 2), getattr(theirs, name).transpose(1, 2)
            assert a.shape == b.shape
            torch.testing.assert_close(a[valid], b[valid], rtol=1e-4, atol=1e-5)
            assert not a[~valid].any()  # columns no row read are zero, masked as padding is


def test_a_first_read_laid_out_one_column_off_is_caught(monkeypatch):
    """The negative control: the same comparison sees a group's context laid out one column off (the next draft
    reads it)."""
    real = prefill.lay_out

    def shifted(cache, parts, batch, length):
        for _, _, own, _ in parts:
            for layer in own.layers:
                layer.keys, layer.values = layer.keys.roll(1, dims=2), layer.values.roll(1, dims=2)
        real(cache, parts, batch, length)

    _, second, _ = first_reads(monkeypatch, "ragged", lay_out=shifted)
    _, p_second, _ = first_reads(monkeypatch, "padded")
    assert not torch.allclose(second.logits, p_second.logits, rtol=1e-4, atol=1e-4)


def test_generate_with_grouped_first_reads_stays_exact(monkeypatch):
    """Greedy, a drafter that drafts on every step (the fixed policy) and one that never agrees with the target:
    every call's first draft reads the prompts in groups, and the output is plain decoding's."""
    from adaflash_hf.generation import candidate_generator

    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 4)
    reads = []
    real = prefill.lay_out
    monkeypatch.setattr(
        candidate_generator,
        "lay_out",
        lambda cache, parts, *shape: reads.append(len(parts)) or real(cache, parts, *shape),
    )
    target = tiny_target("qwen3")
    references = [alone(target, p, max_new_tokens=12, eos_token_id=None) for p in PROMPTS]
    ids, mask = left_pad(PROMPTS)
    for policy in ("fixed", "planned"):
        config = GenerationConfig(
            max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD, adaflash_length_policy=policy
        )
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=tiny_drafter(target))
        assert rows_of(out, PROMPTS) == references
    assert reads and all(groups == 3 for groups in reads)
