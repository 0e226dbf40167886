"""The kernel of small verification forwards (`verify_layout.py`): every kernel computes what `linear` computes, the
choice is measured per token count and kept, its timing steps are told to the planner as trials, and greedy output
is plain decoding's with every kernel, on several families."""

import pytest
import torch
from helpers import TickingClock, oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD, PROMPTS, left_pad
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf.generation import planner as planner_module
from adaflash_hf.generation import verify_layout
from adaflash_hf.generation.draft_head import DraftHead
from adaflash_hf.generation.measured import MeasuredChoice
from adaflash_hf.generation.planner import VerificationPlanner
from adaflash_hf.generation.profile import LAYOUT_TRIALS, RuntimeProfile, profile_for
from adaflash_hf.generation.verify_layout import BLOCK_ROWS, KERNELS, VerifyLayout, linear, routed, routed_linears

ROUTED = [name for name, product in KERNELS.items() if product is not None]


@pytest.mark.parametrize("kernel", ROUTED)
@pytest.mark.parametrize("shape", [(3, 16), (2, 3, 16), (1, 1, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
# fewer rows than two blocks, whole blocks only, and whole blocks with the rest
@pytest.mark.parametrize("rows", [24, 2 * BLOCK_ROWS, 3 * BLOCK_ROWS + 5])
def test_every_kernel_computes_linear(kernel, shape, with_bias, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, rows, bias=with_bias)
    x = torch.randn(*shape)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    out = linear(x, layer.weight, layer.bias, kernel)
    with routed(routed_linears(layer), kernel):
        through_the_layer = layer(x)
    assert out.shape == expected.shape == through_the_layer.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected)
    assert torch.equal(through_the_layer, out)  # the routed layer runs exactly this product
    # a different summation order, not a different computation: the loop relies on this being the same product
    torch.testing.assert_close(
        out, (layer.weight @ x.reshape(-1, 16).T).T.reshape(expected.shape) + (0 if not with_bias else layer.bias)
    )


def test_the_blocked_kernel_takes_a_weight_it_cannot_view_in_blocks_as_linear_does():
    torch.manual_seed(0)
    x, weight = torch.randn(4, 3 * BLOCK_ROWS), torch.randn(3 * BLOCK_ROWS, 3 * BLOCK_ROWS).t()  # not contiguous
    out = linear(x, weight, None, "blocked")
    assert torch.equal(out, torch.nn.functional.linear(x, weight)) and out.is_contiguous()


def test_kernels_leave_other_dtypes_and_other_layers_alone(monkeypatch):
    x, weight = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight, None, "transposed"), torch.nn.functional.linear(x, weight))  # bit for bit
    calls = []
    monkeypatch.setitem(KERNELS, "transposed", lambda flat, w: calls.append(w) or torch.mm(w, flat.t()).t())

    class Scaled(torch.nn.Linear):  # a subclass with its own forward computes what it says, not a bare product
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.Linear(16, 16).to(torch.bfloat16), Scaled(16, 16), torch.nn.Linear(16, 8)
    )
    wrapped = model[3]
    wrapped.forward = lambda x, layer=wrapped: torch.nn.Linear.forward(layer, x)  # as a hook library wraps a layer
    assert routed_linears(model) == [model[0], model[3]]
    with routed(routed_linears(model), "transposed"):
        assert "forward" in model[0].__dict__ and model[3].forward is not None
        model[0](torch.randn(3, 16))
        model[2](torch.randn(3, 16))
        model[3](torch.randn(3, 16))
    assert [w is model[0].weight for w in calls] == [True]  # the wrapped layer kept its own forward
    assert "forward" not in model[0].__dict__ and "forward" in model[3].__dict__  # each left as it was found


def test_a_routed_layer_is_restored_when_the_forward_fails():
    layer = torch.nn.Linear(16, 8)
    with pytest.raises(RuntimeError), routed(routed_linears(layer), "onednn"):
        layer(torch.randn(3, 5))
    assert "forward" not in layer.__dict__
    with routed(routed_linears(layer), "linear"):
        assert "forward" not in layer.__dict__  # the model's own kernel: nothing to reroute


def test_the_layout_reroutes_only_the_thread_that_entered_it(monkeypatch):
    # a server may run plain generate() in one thread while another verifies: only the verifying thread is rerouted
    import threading

    calls = []
    monkeypatch.setitem(KERNELS, "transposed", lambda flat, w: calls.append(threading.get_ident()) or flat @ w.t())
    layer = torch.nn.Linear(16, 24)
    x = torch.randn(3, 16)
    inside, done = threading.Event(), threading.Event()

    def verifying():
        with routed(routed_linears(layer), "transposed"):
            layer(x)
            inside.set()
            done.wait(timeout=30)  # stays routed while the other thread computes

    thread = threading.Thread(target=verifying)
    thread.start()
    assert inside.wait(timeout=30)
    layer(x)  # this thread, while the other one is routing the layer
    done.set()
    thread.join()
    assert calls == [thread.ident]


def test_measured_choice_alternates_and_keeps_the_candidate_only_when_clearly_faster():
    choice = MeasuredChoice("a", ("b",), trials=2, margin=0.9)
    seen = []
    for _ in range(4):
        option = choice.next_trial("fast")
        seen.append(option)
        choice.record("fast", option, {"a": 1.0, "b": 0.5}[option])
    assert seen == ["a", "b", "a", "b"] and choice.chosen("fast") == "b"
    for _ in range(4):
        option = choice.next_trial("close")
        choice.record("close", option, {"a": 1.0, "b": 0.95}[option])
    assert choice.chosen("close") == "a"  # within the margin: the baseline stays
    choice.clear()
    assert choice.chosen("fast") is None and choice.chosen("close") is None and choice.timings == {}


def test_measured_choice_times_only_the_candidates_of_a_key():
    choice = MeasuredChoice("a", ("b", "c"), trials=1, margin=0.9, candidates_for=lambda key: ("c",) if key else ())
    assert choice.next_trial(0) == "a"
    choice.record(0, "a", 1.0)
    assert choice.chosen(0) == "a"  # nothing to time against the baseline
    seen = []
    for _ in range(2):
        seen.append(choice.next_trial(1))
        choice.record(1, seen[-1], {"a": 1.0, "c": 0.5}[seen[-1]])
    assert seen == ["a", "c"] and choice.chosen(1) == "c"


def test_measured_choice_rotates_through_every_option_and_keeps_the_fastest():
    choice = MeasuredChoice("a", ("b", "c"), trials=2, margin=0.9)
    seen = []
    for _ in range(6):
        option = choice.next_trial(4)
        seen.append(option)
        choice.record(4, option, {"a": 1.0, "b": 0.8, "c": 0.6}[option])
    assert seen == ["a", "b", "c"] * 2 and choice.chosen(4) == "c"
    for _ in range(6):
        option = choice.next_trial(5)
        choice.record(5, option, {"a": 1.0, "b": 0.95, "c": 1.2}[option])
    assert choice.chosen(5) == "a"  # the fastest candidate within the margin: the baseline stays


def test_measured_choice_times_a_candidate_far_slower_than_the_baseline_no_more():
    choice = MeasuredChoice("a", ("b", "c"), trials=2, margin=0.9, drop=1.25)
    seen = []
    while choice.chosen(4) is None:
        option = choice.next_trial(4)
        seen.append(option)
        choice.record(4, option, {"a": 1.0, "b": 2.2, "c": 0.6}[option])
    assert seen == ["a", "b", "c", "a", "c"] and choice.chosen(4) == "c"  # b's one trial showed it out of reach
    seen = []
    while choice.chosen(5) is None:  # slower, but not far: timed as often as the others, and not kept
        option = choice.next_trial(5)
        seen.append(option)
        choice.record(5, option, {"a": 1.0, "b": 1.2, "c": 1.1}[option])
    assert seen == ["a", "b", "c"] * 2 and choice.chosen(5) == "a"
    # a thread that was handed b before another thread's timing dropped it: its timing is let go, not an error
    assert choice.next_trial(6) == "a"
    choice.record(6, "a", 1.0)
    late = choice.next_trial(6)
    choice.record(6, late, 2.2)
    choice.record(6, late, 2.0)
    assert late not in choice.timings[6]


def test_each_token_count_times_only_the_kernels_that_can_win_there():
    assert verify_layout.kernels_for(3) == ("transposed", "onednn")  # linear streams the weight: no blocks
    assert verify_layout.kernels_for(4) == verify_layout.kernels_for(16) == ("transposed", "onednn", "blocked")
    assert verify_layout.kernels_for(32) == ("onednn",)


def test_token_counts_are_measured_each_up_to_16_then_per_power_of_two():
    assert [verify_layout.measured_key(m) for m in (0, 1, 2, 3, 15, 16)] == [None, 1, 2, 3, 15, 16]
    assert [verify_layout.measured_key(m) for m in (17, 32, 33, 100, 128, 129, 512, 513)] == [
        32,
        32,
        64,
        128,
        128,
        256,
        512,
        None,
    ]


def test_a_larger_forward_shares_its_power_of_twos_measurement_without_the_transposed_product(monkeypatch):
    target = tiny_target()
    clock = iter(range(1000))
    monkeypatch.setattr(verify_layout.time, "perf_counter", lambda: next(clock))
    profile = RuntimeProfile()
    layout = VerifyLayout(target, "auto", profile)
    timed = []
    for tokens in [40, 48, 64, 33]:  # linear and oneDNN x 2 trials, all under the key 64
        assert layout.layout(tokens)[1]
        with layout.forward(tokens) as trial:
            assert trial
        timed.append(profile.layouts.chosen(64) or "measuring")
    assert timed == ["measuring"] * 3 + ["linear"]  # decided after 2 + 2 trials: the transposed product is not timed
    assert layout.layout(45) == ("linear", False) and profile.layouts.chosen(64) == "linear"
    assert layout.layout(65)[1] is True  # the next power of two is measured on its own


def test_layout_is_measured_per_token_count_and_kept(monkeypatch):
    target = tiny_target()
    clock = iter(range(1000))
    monkeypatch.setattr(verify_layout.time, "perf_counter", lambda: next(clock))  # every forward "takes" 1 s
    profile = RuntimeProfile()
    layout = VerifyLayout(target, "auto", profile)
    assert layout.layout(0) == ("linear", False) and layout.layout(513) == ("linear", False)  # not measured
    trials, options = [], 1 + len(verify_layout.kernels_for(3))
    for _ in range(options * LAYOUT_TRIALS):
        with layout.forward(3) as trial:
            trials.append(trial)
    assert trials == [True] * (options * LAYOUT_TRIALS)
    assert layout.layout(3) == ("linear", False)  # equal times: linear kept, no more trials
    assert layout.layout(4)[1] is True  # another token count is measured on its own
    assert profile.layouts.chosen(3) == "linear" and profile.to_dict()["layouts"] == [[3, "linear"]]
    profile.reset()
    assert layout.layout(3)[1] is True  # reset: measured again
    assert VerifyLayout(target, "linear", profile).layout(3) == ("linear", False)
    assert VerifyLayout(target, "transposed", profile).layout(3) == ("transposed", False)
    assert VerifyLayout(target, "onednn", profile).layout(16) == ("onednn", False)
    assert VerifyLayout(target, "onednn", profile).layout(128) == ("onednn", False)
    bfloat16 = VerifyLayout(target.to(torch.bfloat16), "transposed", profile)
    assert bfloat16.layout(3) == ("linear", False)  # CPU float32 only


@pytest.mark.parametrize("name", ["auto", *KERNELS])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_greedy_output_is_identical_with_every_kernel(monkeypatch, name, batch, family):
    target = tiny_target(family)
    prompts = PROMPTS[:batch]
    ids, mask = left_pad(prompts)
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    reference = target.generate(ids, attention_mask=mask, generation_config=config)
    unpadded = [row[ids.shape[1] - len(p) :] for row, p in zip(reference.tolist(), prompts)]
    rerouted = []
    original = verify_layout._routed_forward

    def spy(module, kernel, thread, x):
        rerouted.append(kernel)
        return original(module, kernel, thread, x)

    monkeypatch.setattr(verify_layout, "_routed_forward", spy)
    config.adaflash_verify_layout = name
    # blocks of 2 at batch 3 and of 4 at batch 1 verify 2-7 tokens a forward; the oracle's corrupted drafts make
    # rejections, so the loop crops and continues from every accepted length
    block = 4 if batch == 1 else 2
    for drafter in (
        tiny_drafter(target, block_size=block),
        oracle_drafter(target, unpadded, corrupt=lambda row, anchor: {anchor % 3 + 1}, block_size=block),
    ):
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
        assert torch.equal(out, reference)
    assert any(rerouted) == (name != "linear")


def test_layout_trials_are_told_to_the_planner_as_trials(monkeypatch):
    target = tiny_target()
    marked, trials = [], []
    monkeypatch.setattr(VerificationPlanner, "trial", lambda self: marked.append(True))
    layout = VerifyLayout.layout

    def counted(self, tokens):
        chosen = layout(self, tokens)
        trials.append(chosen[1])
        return chosen

    monkeypatch.setattr(VerifyLayout, "layout", counted)
    # no kernel trials of the draft head's product either (test_draft_head.py): every mark is a layout trial
    monkeypatch.setattr(DraftHead, "_choice_key", lambda self, positions: (self._key, positions, False, False))
    config = GenerationConfig(
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD,
        adaflash_length_policy="fixed",
        adaflash_draft_head_dtype="same",  # no dtype trials: every mark is a layout trial
    )
    reference = target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    drafter = oracle_drafter(target, reference.tolist(), block_size=3)
    target.generate(torch.tensor([PROMPTS[0]]), assistant_model=drafter, generation_config=config)
    assert any(trials) and marked == []  # the fixed policy has no planner: nothing to keep out
    profile_for(target, drafter).layouts.clear()  # the planned call measures its widths anew
    config.adaflash_length_policy = "planned"
    trials.clear()
    # the planner's clock ticks once a reading: a drafted step of the oracle's 3 tokens costs two plain steps, so
    # drafting pays whatever the machine's load (the kernels' own trials still time the real forwards)
    monkeypatch.setattr(planner_module, "time", TickingClock())
    with adaflash_hf.record_stats() as stats:
        target.generate(torch.tensor([PROMPTS[0]]), assistant_model=drafter, generation_config=config)
    assert max(step.verify_width for step in stats.steps) > 1
    # every forward that timed a kernel, and only those, priced only what nothing timed priced (planner tests)
    assert 0 < len(marked) == sum(trials) <= 2 * len(KERNELS) * LAYOUT_TRIALS


def test_bad_layout_name_is_one_clear_error():
    target = tiny_target()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, adaflash_verify_layout="fast")
    with pytest.raises(ValueError, match="adaflash_verify_layout='fast' is not one of 'auto', 'linear', 'transposed'"):
        target.generate(torch.tensor([[0, 5, 9]]), generation_config=config, assistant_model=tiny_drafter(target))


def test_transformers_loop_refuses_the_transposed_layout():
    target = tiny_target()
    config = GenerationConfig(
        max_new_tokens=4, do_sample=False, adaflash_verify_layout="transposed", adaflash_decoding_loop="transformers"
    )
    with pytest.raises(ValueError, match="adaflash_verify_layout='transposed' needs adaflash_hf's loop"):
        target.generate(torch.tensor([[0, 5, 9]]), generation_config=config, assistant_model=tiny_drafter(target))
