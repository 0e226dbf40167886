"""The draft head's dtype and kernel: a bfloat16 copy of a float32 target's LM head projects the drafts when it is
measured faster, a float32 head runs the fastest kernel, each measured per number of projected positions, and output
stays exactly the target's (greedy identity here; sampling in test_generate_sampling.py)."""

import threading

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf.generation import draft_head, verify_layout
from adaflash_hf.generation.draft_head import DraftHead
from adaflash_hf.generation.profile import HEAD_KERNEL_TRIALS, RuntimeProfile

PROMPTS = [[0, 5, 9, 33, 17, 4, 80], [0, 44, 8], [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 101, 3, 9]]


def _batch(prompts):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    return ids, mask


@pytest.mark.parametrize("dtype_name", ["bfloat16", "auto", "same", "float16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_identical_with_every_draft_head_dtype(dtype_name, batch):
    target = tiny_target()
    ids, mask = _batch(PROMPTS[:batch])
    config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=2, eos_token_id=None)
    reference = target.generate(ids, attention_mask=mask, generation_config=config)
    config.adaflash_draft_head_dtype = dtype_name
    # the oracle reads each row's reference at the row's own positions: its tokens without the left padding
    unpadded = [row[ids.shape[1] - len(prompt) :] for row, prompt in zip(reference.tolist(), PROMPTS)]
    for drafter in (tiny_drafter(target), oracle_drafter(target, unpadded)):
        with adaflash_hf.record_stats() as stats:
            out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
        assert torch.equal(out, reference)
    assert stats.mean_acceptance_length > 4  # the oracle's drafts survive the half-precision projection


def test_requested_dtype_is_used_and_logits_are_float32():
    head = tiny_target().get_output_embeddings()
    projector = DraftHead(head, dtype_name="bfloat16")
    hidden = torch.randn(2, 7, head.weight.shape[1])
    logits = projector(hidden)
    assert projector.dtype(14) == torch.bfloat16 and logits.dtype == torch.float32
    expected = torch.nn.functional.linear(hidden.bfloat16(), head.weight.bfloat16()).float()
    torch.testing.assert_close(logits, expected)
    assert DraftHead(head, dtype_name="same").dtype(14) == torch.float32


def _fake_timing(monkeypatch, seconds) -> list:
    """Replaces the clock of the head's trials: a projection of ``n`` positions by option ``o`` (``"bfloat16"``, or
    the float32 kernel that ran: ``"linear"`` where none rerouted the product) takes ``seconds(n, o)``. Returns the
    options each timed call ran."""
    ran, used = [], []
    for name, real in verify_layout.KERNELS.items():
        if real is not None:

            def product(flat, weight, name=name, real=real):
                used.append(name)
                return real(flat, weight)

            monkeypatch.setitem(verify_layout.KERNELS, name, product)

    def timed(head, hidden, dtype, vocab, profile, kernel):
        used.clear()
        logits = draft_head._project(head, hidden, dtype, vocab, profile, kernel)
        ran.append("bfloat16" if dtype == torch.bfloat16 else (used[0] if used else "linear"))
        return logits, seconds(hidden.shape[0] * hidden.shape[1], ran[-1])

    monkeypatch.setattr(draft_head, "_timed", timed)
    return ran


def _decide(projector, hidden) -> int:
    """Calls ``projector`` until its choice for ``hidden``'s positions is made; returns the timed calls."""
    calls = 0
    while projector.dtype(hidden.shape[0] * hidden.shape[1]) is None:
        projector(hidden)
        assert projector.timed_kernel
        calls += 1
        assert calls <= 5 * HEAD_KERNEL_TRIALS
    return calls


def test_auto_measures_in_use_once_per_head_and_refreshes_the_copy(monkeypatch):
    head = tiny_target().get_output_embeddings()
    ran = _fake_timing(monkeypatch, lambda n, option: 0.1 if option == "bfloat16" else 1.0)
    profile = RuntimeProfile()
    first, second = DraftHead(head, profile=profile), DraftHead(head, profile=profile)
    hidden = torch.ones(1, 3, head.weight.shape[1])
    while first.dtype(3) is None:
        first(hidden)
        # only the bfloat16 copy's trial keeps its step out of the planner's timings; a float32 kernel's is a trial
        assert first.timed_kernel and first.timed_dtype == (ran[-1] == "bfloat16")
        second(hidden)  # a second head of the same weight and profile shares the measurement
    assert first.dtype(3) == second.dtype(3) == torch.bfloat16
    # the options take turns: each is timed TRIALS times, none more
    assert sorted(ran) == sorted(["linear", "transposed", "onednn", "bfloat16"] * HEAD_KERNEL_TRIALS)
    first(hidden)
    assert len(ran) == 4 * HEAD_KERNEL_TRIALS and not first.timed_dtype  # decided: no more trials
    before = first(torch.ones(1, 3, head.weight.shape[1]))
    with torch.no_grad():
        head.weight.mul_(2.0)  # an in-place change (training) must not leave a stale copy in use
    after = first(torch.ones(1, 3, head.weight.shape[1]))
    torch.testing.assert_close(after, 2 * before, rtol=2e-2, atol=2e-2)


def test_auto_chooses_per_number_of_projected_positions(monkeypatch):
    """A projection streams the whole matrix whatever its positions, so a probe's block of 15 costs little more than
    one draft: bfloat16 timed on blocks must not be compared with float32 timed on single drafts, as a choice by
    time per position did (with these timings, one choice for every count is wrong for one of them)."""
    head = tiny_target(seed=4).get_output_embeddings()

    def seconds(n, option):  # float32 wins at one position, bfloat16 at 15
        return {"bfloat16": 6.0}.get(option, 4.0 if n == 1 else 12.0) if n in (1, 15) else 1.0

    _fake_timing(monkeypatch, seconds)
    projector = DraftHead(head, profile=RuntimeProfile(), layout="linear")
    one, block = torch.ones(1, 1, head.weight.shape[1]), torch.ones(1, 15, head.weight.shape[1])
    for _ in range(4 * HEAD_KERNEL_TRIALS):  # interleaved, as a call's drafted steps and probes come
        for hidden in (one, block):
            projector(hidden)
    assert projector.dtype(1) == torch.float32 and projector.dtype(15) == torch.bfloat16


def test_auto_trials_shared_by_concurrent_generations_decide_once(monkeypatch):
    head = tiny_target(seed=5).get_output_embeddings()
    projector = DraftHead(head, layout="linear")  # two options: float32 and bfloat16
    hidden = torch.ones(1, 2, head.weight.shape[1])
    _fake_timing(monkeypatch, lambda n, option: 0.1 if option == "bfloat16" else 1.0)
    for _ in range(2 * HEAD_KERNEL_TRIALS - 1):  # one bfloat16 trial short of a decision
        projector(hidden)
    timed, barrier = draft_head._timed, threading.Barrier(2)

    def together(*args):
        barrier.wait(timeout=30)  # both threads chose their option before either records its time
        return timed(*args)

    monkeypatch.setattr(draft_head, "_timed", together)
    errors = []

    def call():
        try:
            projector(hidden)
        except Exception as error:  # noqa: BLE001 - the thread's error is the test's result
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and projector.dtype(2) == torch.bfloat16  # both completed the trials; one decided


def test_auto_keeps_float32_where_bfloat16_is_not_clearly_faster(monkeypatch):
    head = tiny_target(seed=3).get_output_embeddings()
    # bfloat16 is the fastest option, but by less than its 20%; the transposed kernel wins by its 10%
    _fake_timing(monkeypatch, lambda n, option: {"bfloat16": 0.82, "transposed": 0.85}.get(option, 1.0))
    projector = DraftHead(head)
    hidden = torch.ones(1, 5, head.weight.shape[1])
    _decide(projector, hidden)
    assert projector.dtype(5) == torch.float32  # within 20%: not worth a copy
    assert projector.profile.head_kernels.chosen(projector._choice_key(5)) == "transposed"


@pytest.mark.parametrize("name", ["bool", "int8", "complex64", "float8_e4m3fn", "fp8ish"])
def test_dtypes_the_head_cannot_compute_in_are_one_clear_error(name):
    target = tiny_target()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, adaflash_draft_head_dtype=name)
    with pytest.raises(ValueError, match=f"adaflash_draft_head_dtype={name!r} is not a dtype the draft head"):
        target.generate(torch.tensor([[0, 5, 9]]), generation_config=config, assistant_model=tiny_drafter(target))


@pytest.mark.parametrize("name", ["float16", "torch.bfloat16", "half", "same", "auto"])
def test_floating_dtypes_and_their_aliases_stay_exact(name):
    target = tiny_target()
    ids = torch.tensor([[0, 5, 9, 33]])
    expected = target.generate(ids, max_new_tokens=10, do_sample=False)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, adaflash_draft_head_dtype=name)
    out = target.generate(ids, generation_config=config, assistant_model=tiny_drafter(target))
    assert torch.equal(out, expected)


def test_a_float32_head_keeps_the_fastest_kernel_for_each_number_of_positions(monkeypatch):
    head = tiny_target(seed=7).get_output_embeddings()
    # two positions: the transposed product is the fast one; eight: none beats linear by the margin
    seconds = {(2, "linear"): 1.0, (2, "transposed"): 0.2, (2, "onednn"): 0.9}
    seconds |= {(8, "linear"): 1.0, (8, "transposed"): 0.95, (8, "onednn"): 1.0, (8, "blocked"): 1.2}
    ran = _fake_timing(monkeypatch, lambda n, option: seconds[(n, option)])
    profile = RuntimeProfile()
    projector = DraftHead(head, dtype_name="same", profile=profile)
    for positions in (2, 8):
        hidden = torch.randn(1, positions, head.weight.shape[1])
        reference = torch.nn.functional.linear(hidden, head.weight)
        trials = 0
        while profile.head_kernels.chosen(projector._choice_key(positions)) is None:
            torch.testing.assert_close(projector(hidden), reference)  # every kernel: the same products
            trials += 1
            assert projector.timed_kernel and not projector.timed_dtype and trials <= 4 * HEAD_KERNEL_TRIALS
        assert projector(hidden) is not None and not projector.timed_kernel  # decided: no more trials
    assert profile.head_kernels.chosen(projector._choice_key(2)) == "transposed"
    assert profile.head_kernels.chosen(projector._choice_key(8)) == "linear"  # 5% faster is within the margin
    assert set(ran) == {"linear", "transposed", "onednn", "blocked"}  # blocked only where it may win: 4+ tokens
    assert ran.count("blocked") == HEAD_KERNEL_TRIALS and "blocked" not in ran[: 3 * HEAD_KERNEL_TRIALS]


@pytest.mark.parametrize("case", ["linear layout", "kernel named", "bfloat16 head"])
def test_the_head_times_no_kernel_where_none_is_to_be_chosen(monkeypatch, case):
    head = tiny_target(seed=8).get_output_embeddings()
    ran = _fake_timing(monkeypatch, lambda n, option: {}[option])
    layout = {"linear layout": "linear", "kernel named": "transposed"}.get(case, "auto")
    projector = DraftHead(head, dtype_name="bfloat16" if case == "bfloat16 head" else "same", layout=layout)
    hidden = torch.randn(1, 2, head.weight.shape[1])
    for _ in range(3):
        projector(hidden)
        assert not projector.timed_kernel
    assert ran == [] and projector.profile.head_kernels.timings == {}
