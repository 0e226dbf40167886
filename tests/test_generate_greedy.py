"""Lossless greedy `target.generate(assistant_model=drafter)` at batch 1: token-identical to plain greedy."""

import threading

import pytest
import torch
from helpers import FAMILIES, oracle_drafter, tiny_drafter, tiny_target
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import adaflash_hf

PROMPTS = [[0, 5, 9, 33, 17, 4, 80], [0, 44], [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 101, 3, 9]]


def plain(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), do_sample=False, **kwargs)


def speculative(target, drafter, prompt, **kwargs):
    with adaflash_hf.record_stats() as stats:
        out = target.generate(torch.tensor([prompt]), do_sample=False, assistant_model=drafter, **kwargs)
    return out, stats


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equality_across_families_random_and_oracle_drafters(family):
    target = tiny_target(family)
    for prompt, new in zip(PROMPTS, (40, 17, 33)):
        reference = plain(target, prompt, max_new_tokens=new)
        random_out, _ = speculative(target, tiny_drafter(target), prompt, max_new_tokens=new)
        assert torch.equal(random_out, reference)
        full, stats = speculative(target, oracle_drafter(target, [reference[0]]), prompt, max_new_tokens=new)
        assert torch.equal(full, reference)
        assert stats.mean_acceptance_length > 4  # full acceptance: 8 tokens a step except at the budget's end
        partial, stats = speculative(
            target, oracle_drafter(target, [reference[0]], corrupt=lambda row, anchor: {3}), prompt, max_new_tokens=new
        )
        assert torch.equal(partial, reference)
        assert set(stats.steps[0].accepted) == {2}  # drafts 1-2 accepted, draft 3 rejected


def test_acceptance_patterns_are_exact_per_step():
    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=40)
    corrupt = {7: {1}, 8: {5}, 13: {2, 6}}  # anchor position -> rejected drafts
    drafter = oracle_drafter(target, [reference[0]], corrupt=lambda row, anchor: corrupt.get(anchor, ()))
    out, stats = speculative(target, drafter, PROMPTS[0], max_new_tokens=40)
    assert torch.equal(out, reference)
    assert [s.accepted[0] for s in stats.steps[:4]] == [0, 4, 1, 7]
    assert [s.emitted[0] for s in stats.steps[:4]] == [1, 5, 2, 8]
    assert stats.emitted_tokens == 39  # 40 new tokens, the first from the prefill


def test_eos_inside_an_accepted_block_stops_exactly_there():
    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=40, eos_token_id=None)
    generated = reference[0, len(PROMPTS[0]) :].tolist()
    eos = next(t for i, t in enumerate(generated) if i >= 4 and t not in generated[:i])  # first occurrence mid-stream
    expected = plain(target, PROMPTS[0], max_new_tokens=40, eos_token_id=eos)
    out, stats = speculative(
        target, oracle_drafter(target, [reference[0]]), PROMPTS[0], max_new_tokens=40, eos_token_id=eos
    )
    assert torch.equal(out, expected) and out[0, -1] == eos
    assert stats.steps[-1].accepted[0] > stats.steps[-1].emitted[0] - 1  # the block went past EOS and was cut


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 9])
def test_budget_smaller_than_a_block(new_tokens):
    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=new_tokens)
    out, _ = speculative(
        target,
        oracle_drafter(target, [plain(target, PROMPTS[0], max_new_tokens=30)[0]]),
        PROMPTS[0],
        max_new_tokens=new_tokens,
    )
    assert torch.equal(out, reference) and out.shape[1] == len(PROMPTS[0]) + new_tokens


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_inside_a_block():
    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=40)
    stop = int(reference[0, len(PROMPTS[0]) + 5])
    criteria = StoppingCriteriaList([StopOnToken(stop)])
    expected = plain(target, PROMPTS[0], max_new_tokens=40, stopping_criteria=criteria)
    out, _ = speculative(
        target,
        oracle_drafter(target, [reference[0]]),
        PROMPTS[0],
        max_new_tokens=40,
        stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]),
    )
    assert torch.equal(out, expected) and out.shape[1] < reference.shape[1]


def test_stop_strings_inside_a_block(word_tokenizer):
    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=40)
    new = reference[0, len(PROMPTS[0]) :].tolist()
    stop = word_tokenizer.convert_ids_to_tokens(new[6]) + word_tokenizer.convert_ids_to_tokens(new[7])
    kwargs = dict(max_new_tokens=40, stop_strings=[stop], tokenizer=word_tokenizer)
    expected = plain(target, PROMPTS[0], **kwargs)
    out, _ = speculative(target, oracle_drafter(target, [reference[0]]), PROMPTS[0], **kwargs)
    assert torch.equal(out, expected) and out.shape[1] < reference.shape[1]


def test_attention_mask_given_or_absent_and_left_padding():
    target = tiny_target()
    drafter_ref = plain(target, PROMPTS[0], max_new_tokens=30)
    ids = torch.tensor([PROMPTS[0]])
    for mask in (None, torch.ones_like(ids)):
        out = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            assistant_model=oracle_drafter(target, [drafter_ref[0]]),
        )
        assert torch.equal(out, drafter_ref)
    padded = torch.tensor([[2, 2, 2] + PROMPTS[0]])
    mask = torch.tensor([[0, 0, 0] + [1] * len(PROMPTS[0])])
    expected = target.generate(padded, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = target.generate(
        padded,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        assistant_model=oracle_drafter(target, [drafter_ref[0]], corrupt=lambda r, a: {4}),
    )
    assert torch.equal(out, expected)


def test_return_dict_with_scores_and_logits():
    target = tiny_target()
    kwargs = dict(max_new_tokens=20, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = plain(target, PROMPTS[0], **kwargs)
    out, _ = speculative(
        target, oracle_drafter(target, [expected.sequences[0]], corrupt=lambda r, a: {5}), PROMPTS[0], **kwargs
    )
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 20 and len(out.logits) == 20
    for ours, theirs in zip(out.scores + out.logits, expected.scores + expected.logits):
        assert torch.allclose(ours, theirs, atol=1e-4)


class ChunkRecorder:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamers_receive_accepted_chunks(word_tokenizer, capsys):
    from transformers import TextIteratorStreamer, TextStreamer

    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=30)
    drafter = oracle_drafter(target, [reference[0]], corrupt=lambda r, a: {6})
    recorder = ChunkRecorder()
    target.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=30, do_sample=False, assistant_model=drafter, streamer=recorder
    )
    assert recorder.ended and recorder.chunks[0] == PROMPTS[0]
    assert sum(recorder.chunks[1:], []) == reference[0, len(PROMPTS[0]) :].tolist()
    assert max(len(c) for c in recorder.chunks[1:]) == 6  # several tokens per step

    expected_text = word_tokenizer.decode(reference[0, len(PROMPTS[0]) :])
    target.generate(
        torch.tensor([PROMPTS[0]]),
        max_new_tokens=30,
        do_sample=False,
        assistant_model=drafter,
        streamer=TextStreamer(word_tokenizer, skip_prompt=True),
    )
    assert capsys.readouterr().out.strip() == expected_text.strip()

    streamer = TextIteratorStreamer(word_tokenizer, skip_prompt=True)
    thread = threading.Thread(
        target=target.generate,
        kwargs=dict(
            inputs=torch.tensor([PROMPTS[0]]),
            max_new_tokens=30,
            do_sample=False,
            assistant_model=drafter,
            streamer=streamer,
        ),
    )
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text.strip() == expected_text.strip()


def test_drafter_in_another_dtype_stays_lossless():
    target = tiny_target()
    drafter = tiny_drafter(target).to(torch.bfloat16)
    out, stats = speculative(target, drafter, PROMPTS[0], max_new_tokens=25)
    assert torch.equal(out, plain(target, PROMPTS[0], max_new_tokens=25)) and stats.verification_steps > 0


def test_generation_config_attributes_choose_the_policy():
    target = tiny_target()
    reference = plain(target, PROMPTS[0], max_new_tokens=30)
    config = GenerationConfig(
        max_new_tokens=30, do_sample=False, adaflash_length_policy="confidence", adaflash_confidence_threshold=0.5
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(
            torch.tensor([PROMPTS[0]]),
            generation_config=config,
            assistant_model=oracle_drafter(target, [reference[0]]),
        )
    assert torch.equal(out, reference)
    assert all(length <= 8 for s in stats.steps for length in s.candidate_lengths)
