"""Batch > 1: ragged acceptance with cache holes; every row equals that row generated alone by plain generate()."""

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from test_generate_sampling import NEW, PROMPT, SAMPLING, exact_joint, p_value

import adaflash_hf

PROMPTS = [
    [0, 5, 9, 33, 17, 4, 80],
    [0, 44],
    [0, 7, 7, 7, 7, 7, 101, 3, 9, 12, 5],
    [0, 61, 62],
    [0, 99, 98, 97, 96],
    [0, 12],
    [0, 3, 30, 31, 32, 33],
    [0, 120, 8, 8],
]
PAD = 2


def left_pad(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def alone(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), do_sample=False, **kwargs)[0, len(prompt) :].tolist()


def rows_of(out, prompts):
    width = max(map(len, prompts))
    return [row[width:].tolist() for row in out]


def common_token(references, not_before=4):
    """The most frequent token that no row produces among its first `not_before` tokens."""
    counts = torch.bincount(torch.tensor(sum(references, [])), minlength=128)
    counts[torch.tensor(sum((r[:not_before] for r in references), []), dtype=torch.long)] = -1
    return int(counts.argmax())


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("batch_size", [2, 3, 8])
def test_every_row_equals_plain_greedy_alone(family, batch_size):
    target = tiny_target(family)
    prompts = PROMPTS[:batch_size]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = common_token(free)  # rows hit it at different steps, some never
    references = [alone(target, p, max_new_tokens=30, eos_token_id=eos) for p in prompts]
    assert len({len(r) for r in references}) > 1 or batch_size == 2
    ids, mask = left_pad(prompts)
    full_refs = [p + r for p, r in zip(prompts, free)]
    drafters = {
        "random": tiny_drafter(target),
        "oracle": oracle_drafter(target, full_refs, corrupt=lambda row, anchor: {1 + (row + anchor) % 7}),
    }
    for name, drafter in drafters.items():
        with adaflash_hf.record_stats() as stats:
            out = target.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=30,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=PAD,
                assistant_model=drafter,
            )
        for got, want in zip(rows_of(out, prompts), references):
            assert got[: len(want)] == want, name
            assert all(t == PAD for t in got[len(want) :]), name
        if name == "oracle":
            per_step = {tuple(s.accepted) for s in stats.steps if len(s.rows) > 1}
            assert any(len(set(a)) > 1 for a in per_step)  # rows really accept different numbers per step
            rows = [stats.calls[0].row(i) for i in range(batch_size)]
            assert [r["emitted_tokens"] + 1 for r in rows] == [len(r) for r in references]


def test_holes_are_compacted_and_stay_exact(monkeypatch):
    from adaflash_hf.generation import cache

    monkeypatch.setattr(cache, "COMPACT_FRACTION", 0.05)
    compactions = []
    original = cache.TargetCache.compact
    monkeypatch.setattr(cache.TargetCache, "compact", lambda self: (compactions.append(1), original(self)))
    target = tiny_target()
    prompts = PROMPTS[:4]
    references = [alone(target, p, max_new_tokens=40, eos_token_id=None) for p in prompts]
    drafter = oracle_drafter(
        target, [p + r for p, r in zip(prompts, references)], corrupt=lambda row, anchor: {row + 1}
    )
    ids, mask = left_pad(prompts)
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD,
        assistant_model=drafter,
    )
    assert rows_of(out, prompts) == references
    assert compactions


def test_finished_rows_leave_the_batch():
    target = tiny_target()
    prompts = PROMPTS[:3]
    budgets = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = budgets[1][3]  # row 1 ends after 4 tokens
    ids, mask = left_pad(prompts)
    with adaflash_hf.record_stats() as stats:
        target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=PAD,
            assistant_model=tiny_drafter(target),
        )
    steps = [stats.calls[0].row(i)["steps"] for i in range(3)]
    assert steps[1] <= 3 < max(steps)  # row 1 stopped costing verification after its EOS
    assert 1 not in stats.steps[-1].rows


def test_batched_speculative_sampling_matches_plain_sampling_per_row():
    """Rows of the tested prompt share the batch with longer prompts, so they are left-padded and verify ragged."""
    target = tiny_target(vocab_size=12, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=11)
    torch.manual_seed(7)
    other = [0, 3, 4, 5, 6, 7, 8, 9, 10]
    ids, mask = left_pad([PROMPT, other] * 400)
    samples = []
    for _ in range(4):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, assistant_model=drafter, **SAMPLING)
        samples += [tuple(row[-NEW:].tolist()) for row in out[::2]]
    assert p_value(samples, exact_joint(target)) > 1e-3
