"""The benchmark harness on tiny models: every method runs, records are complete, fp32 greedy outputs identical; a
batch size a domain cannot fill pools the small domains; the results name the machine."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_drafter, tiny_target

import adaflash_hf
from adaflash_demo.bench.harness import METHODS, run_benchmark, speedup_interval
from adaflash_demo.bench.step_trace import step_line
from adaflash_hf.generation.profile import profile_for
from adaflash_hf.machine import machine_summary


def test_harness_records_every_usable_method(word_tokenizer):
    target = tiny_target()
    target.generation_config.pad_token_id = 2
    drafter = tiny_drafter(target, use_length_head=True, length_head_bottleneck_dim=16)
    ar_draft = tiny_target(num_hidden_layers=1, seed=3)
    word_tokenizer.padding_side = "left"
    prompts = {"letters": ["abcabcab", "hello world", "xyz", "aaaa"], "digits": ["0123", "999", "4242", "12"]}
    records = run_benchmark(
        target,
        word_tokenizer,
        prompts,
        drafter=drafter,
        ar_draft=ar_draft,
        methods=METHODS,
        batch_sizes=(1, 2),
        max_new_tokens=12,
    )
    seen = {(r.method, r.batch_size, r.domain) for r in records}
    for domain in prompts:
        assert {(m, 1, domain) for m in METHODS} <= seen
        assert {(m, 2, domain) for m in ("plain", "adaflash_fixed", "adaflash_adaptive")} <= seen
        assert ("native_dflash", 2, domain) not in seen  # transformers' assisted loop is batch 1
    for record in records:
        assert record.identical_fraction == 1.0 and record.dtype == "float32"
        assert record.tokens_per_s > 0 and not math.isnan(record.speedup)
        assert record.calls == 4 // record.batch_size  # every batch of the domain timed once
        assert record.speedup_low <= record.speedup <= record.speedup_high
        assert 0 < record.prefill_seconds < record.seconds
        assert record.decode_speedup_low <= record.decode_speedup <= record.decode_speedup_high
    plain = next(r for r in records if r.method == "plain" and r.batch_size == 1)
    assert plain.speedup == 1.0 and abs(plain.mean_acceptance_length - 1.0) < 1e-9 and plain.decode_speedup == 1.0
    fixed = next(r for r in records if r.method == "adaflash_fixed" and r.batch_size == 1)
    assert fixed.verified_per_emitted > 2  # a random drafter: 8 tokens verified per step, ~1 emitted
    assert fixed.padding_fraction == 0.0 and math.isnan(plain.padding_fraction)  # one row pads nothing
    assert math.isnan(fixed.copied_fraction)
    # a share of the accepted drafts where a step merged n-gram paths; nan where the planner found none worth verifying
    # (on tiny models, a matter of their timings: merging itself is tested in test_ngram.py)
    copied = [r.copied_fraction for r in records if r.method in ("adaflash_hybrid", "adaflash_lookup")]
    assert copied and all(math.isnan(c) or 0.0 <= c <= 1.0 for c in copied)
    adaptive = [r for r in records if r.method == "adaflash_adaptive" and r.batch_size == 2]
    assert all(0.0 <= r.padding_fraction < 1.0 for r in adaptive)
    # where our loop's time went: every step of every call by its kind
    assert plain.steps_by_kind == {}
    # the whole block wherever the row's token budget leaves room for drafts: plain steps only at the budget's end
    assert set(fixed.steps_by_kind) == {"drafted", "plain"}
    assert fixed.steps_by_kind["plain"]["steps"] <= 4 < fixed.steps_by_kind["drafted"]["steps"]
    for record in records:
        if record.method.startswith("adaflash_"):
            kinds = record.steps_by_kind
            assert kinds and set(kinds) <= {"plain", "probe", "drafted", "paths"}
            # every token but each row's first (the prefill's) was committed by one of the steps
            assert sum(entry["emitted_tokens"] for entry in kinds.values()) == record.emitted_tokens - 4


def test_prompts_read_in_groups_are_prefill_not_verification(monkeypatch, word_tokenizer):
    """The forward counter leaves every forward that reads a prompt out of the verification counts, however many
    forwards the loop reads it in (`adaflash_prefill`), and times them all as the prefill."""
    from adaflash_demo.bench.harness import ForwardCounter, method_config
    from adaflash_hf.generation import prefill

    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 0)
    target = tiny_target()
    target.generation_config.pad_token_id = 2
    drafter = tiny_drafter(target)
    word_tokenizer.padding_side = "left"
    inputs = word_tokenizer(["a long prompt of many words here", "ab"], return_tensors="pt", padding=True)
    counter = ForwardCounter(target)
    for mode, forwards in (("ragged", 2), ("padded", 1)):
        config, kwargs = method_config(target, "adaflash_fixed", 6, drafter)
        config.adaflash_prefill = mode
        with counter.counting(), adaflash_hf.record_stats() as stats:
            target.generate(**inputs, generation_config=config, **kwargs)
        assert stats.calls[0].prefill_forwards == forwards
        assert counter.row_forwards == sum(len(step.rows) for step in stats.steps)
        assert counter.processed_tokens == sum(len(step.rows) * step.verify_width for step in stats.steps)
        assert 0 < counter.prefill_seconds
        assert 0 < counter.step_seconds and counter.step_seconds <= sum(step.target_time_s for step in stats.steps)
        # one gap between each two decoding forwards, none from a prompt's forwards
        assert len(counter.gaps) == len(stats.steps) - 1 and all(gap > 0 for gap in counter.gaps)


def test_report_table_and_plots(tmp_path, word_tokenizer):
    from adaflash_demo.bench.report import markdown_table, plot_records, step_kinds_table, summary_tables

    target = tiny_target()
    target.generation_config.pad_token_id = 2
    word_tokenizer.padding_side = "left"
    records = run_benchmark(
        target,
        word_tokenizer,
        {"x": ["abc", "de"]},
        drafter=tiny_drafter(target),
        methods=("plain", "adaflash_fixed"),
        batch_sizes=(1, 2),
        max_new_tokens=6,
    )
    table = markdown_table(records)
    assert table.count("\n") == 1 + len(records) and "| adaflash_fixed | 2 | x | float32 |" in table
    kinds = step_kinds_table(records).splitlines()
    assert kinds[0].startswith("| batch | method | plain: steps / time | probe: steps / time | drafted: ")
    fixed = next(r for r in records if r.method == "adaflash_fixed" and r.batch_size == 1)
    drafted = fixed.steps_by_kind["drafted"]
    share = drafted["seconds"] / sum(entry["seconds"] for entry in fixed.steps_by_kind.values())
    assert len(kinds) == 4  # batch 1 and 2 of adaflash_fixed
    assert kinds[2].startswith("| 1 | adaflash_fixed | ") and f"| {drafted['steps']} / {share:.0%} |" in kinds[2]
    assert kinds[2].endswith("| - | - |")  # the fixed block predicts nothing
    summary = summary_tables(records).splitlines()
    assert summary[0] == "| method | x | mean speedup | pooled |" and summary[3].startswith("| plain | ")
    assert summary[3].endswith("| 1.00x | 1.00x |")
    fixed_at_two = next(r for r in records if r.method == "adaflash_fixed" and r.batch_size == 2)
    plain_at_two = next(r for r in records if r.method == "plain" and r.batch_size == 2)
    pooled = (fixed_at_two.emitted_tokens / fixed_at_two.seconds) / (
        plain_at_two.emitted_tokens / plain_at_two.seconds
    )
    expected = (
        f"| 2 | adaflash_fixed | {fixed_at_two.tokens_per_s:.1f} | {fixed_at_two.speedup:.2f}x | {pooled:.2f}x |"
    )
    assert any(line.startswith(expected) for line in summary)
    paths = plot_records(records, tmp_path)
    assert [p.name for p in paths] == ["acceptance_per_domain.png", "throughput_vs_batch.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_step_timing_on_a_tiny_shape(capsys):
    import json

    from adaflash_demo.bench.step_timing import main

    main(
        [
            "--shape",
            "tiny",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "18",
        ]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(r["steps"] == 17 and r["drafter_ms_per_step"] > 0 and r["target_ms_per_step"] > 0 for r in rows)


def test_methods_keep_their_policy_when_the_targets_generation_config_comes_from_its_model_config(word_tokenizer):
    """GGUF-loaded targets (the demo's SmolLM2) carry `_from_model_config=True`, which made GenerationConfig drop the
    `adaflash_length_policy` of every method: all of them ran the drafter's default policy."""
    target = tiny_target()
    target.generation_config.pad_token_id = 2
    target.generation_config._from_model_config = True
    drafter = tiny_drafter(target)
    # the drafter's own default: about one draft a step, which every method would run if its policy were dropped
    drafter.config.length_policy, drafter.config.confidence_threshold = "confidence", 0.01
    word_tokenizer.padding_side = "left"
    prompts = {"letters": ["abcabcab", "hello world"]}
    records = run_benchmark(
        target, word_tokenizer, prompts, drafter=drafter, methods=("plain", "adaflash_fixed"), max_new_tokens=12
    )
    fixed = next(r for r in records if r.method == "adaflash_fixed")
    assert fixed.verified_per_emitted > 4  # 8-token blocks, a random drafter: about 8 verified per emitted token


def test_linear_suffix_runs_a_method_without_the_measured_verification_layout(word_tokenizer):
    from adaflash_demo.bench.harness import method_kwargs

    target = tiny_target()
    target.generation_config.pad_token_id = 2
    drafter = tiny_drafter(target)
    assert method_kwargs("adaflash_planned_linear", drafter) == {
        "assistant_model": drafter,
        "adaflash_length_policy": "planned",
        "adaflash_verify_layout": "linear",
    }
    assert method_kwargs("adaflash_tree16_linear", drafter)["adaflash_tree_budget"] == 16
    assert method_kwargs("adaflash_fixed_onednn", drafter)["adaflash_verify_layout"] == "onednn"
    planned_tree = method_kwargs("adaflash_planned_tree16", drafter)
    assert planned_tree["adaflash_length_policy"] == "planned" and planned_tree["adaflash_tree_budget"] == 16
    assert method_kwargs("adaflash_lookup") == {"prompt_lookup_num_tokens": 10, "adaflash_ngram": True}
    hybrid = method_kwargs("adaflash_hybrid", drafter)
    assert hybrid["adaflash_ngram"] and hybrid["adaflash_length_policy"] == "planned"
    assert (
        "adaflash_tree_budget" not in hybrid
        and method_kwargs("adaflash_hybrid24", drafter)["adaflash_tree_budget"] == 24
    )
    word_tokenizer.padding_side = "left"
    records = run_benchmark(
        target,
        word_tokenizer,
        {"letters": ["abcabcab", "hello world"]},
        drafter=drafter,
        methods=("plain", "adaflash_fixed_linear", "adaflash_fixed"),
        max_new_tokens=12,
    )
    assert {r.method for r in records} == {"plain", "adaflash_fixed_linear", "adaflash_fixed"}
    assert all(r.identical_fraction == 1.0 for r in records)


def test_a_batch_size_a_domain_cannot_fill_pools_the_small_domains_or_is_refused():
    from adaflash_demo.bench.harness import plan_batches

    prompts = {"big": [f"b{i}" for i in range(4)], "x": ["x0", "x1", "x2"], "y": ["y0"]}
    plan = plan_batches(prompts, (1, 4))
    assert [(g.domain, g.batch_size, len(g.batches)) for g in plan] == [
        ("big", 1, 4),
        ("x", 1, 3),
        ("y", 1, 1),
        ("big", 4, 1),
        ("pooled(x+y)", 4, 1),
    ]
    pooled = plan[-1]
    assert pooled.pooled_from == ("x", "y") and pooled.prompts == ["x0", "y0", "x1", "x2"]  # interleaved
    assert "the 4 prompts of x, y are pooled, interleaved, into 'pooled(x+y)' (1 batch of 4)" in pooled.describe()
    # at batch 3 `x` fills a batch but `y` alone cannot: every domain joins the pool, and the prompts a last partial
    # batch would need are left out, from every domain alike
    three = plan_batches(prompts, (3,))
    assert [g.domain for g in three] == ["pooled(big+x+y)"]
    assert three[0].batches == [["b0", "x0", "y0"], ["b1", "x1", "b2"]] and "2 left out" in three[0].describe()
    with pytest.raises(ValueError, match=r"batch size 9 cannot be filled: big 4, x 3, y 1 prompts, 8 even pooled"):
        plan_batches(prompts, (1, 9))  # nothing is planned when any batch size fails: no run stops half-way
    with pytest.raises(ValueError, match="batch size 0"):
        plan_batches(prompts, (0,))


def test_a_pooled_batch_size_is_measured_not_reported_as_zero(word_tokenizer):
    from adaflash_demo.bench.report import summary_tables

    # the symptom: 16 prompts a domain at batch 32 gave rows of 0.00 tok/s and nan
    target = tiny_target()
    target.generation_config.pad_token_id = 2
    word_tokenizer.padding_side = "left"
    records = run_benchmark(
        target,
        word_tokenizer,
        {"letters": ["abcabcab", "hello world"], "digits": ["0123", "999"]},
        drafter=tiny_drafter(target),
        methods=("plain", "adaflash_fixed"),
        batch_sizes=(1, 4),
        max_new_tokens=6,
    )
    groups = {(r.domain, r.batch_size) for r in records}
    assert groups == {("letters", 1), ("digits", 1), ("pooled(letters+digits)", 4)}
    assert all(r.tokens_per_s > 0 and r.identical_fraction == 1.0 for r in records)
    assert all(r.emitted_tokens > 0 and not math.isnan(r.speedup) for r in records)
    summary = summary_tables(records)
    assert summary.splitlines()[0] == "| method | digits | letters | mean speedup | pooled |"  # no batch-1 column
    assert "| 4 | adaflash_fixed | " in summary
    # without batch 1, no per-domain table of no columns: the sweep alone
    assert summary_tables([r for r in records if r.batch_size == 4]).startswith("| batch | method | tokens/s |")


def test_results_json_carries_the_machine_and_older_files_still_read(tmp_path):
    import json
    from dataclasses import asdict

    from adaflash_demo.bench.harness import BenchRecord
    from adaflash_demo.bench.report import markdown_report, read_results, write_results
    from adaflash_hf.machine import machine_info

    record = BenchRecord("plain", 1, "code", "float32", 20.0, 1.0, 1.0, 1.0, 1.0, 64, 3.2)
    machine = machine_info()
    write_results(tmp_path / "new.json", [record], machine)
    payload = json.loads((tmp_path / "new.json").read_text())
    assert payload["machine"] == machine and payload["records"][0]["method"] == "plain"
    read_machine, (read_record,) = read_results(tmp_path / "new.json")
    assert read_machine == machine and read_record.tokens_per_s == 20.0 and read_record.emitted_tokens == 64
    # a file of before the machine was recorded: a bare list, without padding_fraction
    old = {key: value for key, value in asdict(record).items() if key != "padding_fraction"}
    (tmp_path / "old.json").write_text(json.dumps([old]))
    old_machine, (old_record,) = read_results(tmp_path / "old.json")
    assert old_machine is None and old_record.method == "plain" and math.isnan(old_record.padding_fraction)
    assert markdown_report([old_record], None).startswith("Machine: not recorded\n\n| method |")
    assert markdown_report([record], machine).splitlines()[0] == "Machine: " + machine_summary(machine)


def test_speedup_interval_is_a_paired_bootstrap_over_batches():
    plain = [(64, 1.0), (64, 2.0), (60, 1.5), (64, 1.2)]
    # the same work, twice as fast on every batch: no spread at all
    lo, hi = speedup_interval([(t, s / 2) for t, s in plain], plain)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    # noisy pairs: the interval holds the group's ratio and widens with the noise
    noisy = [(t, s * f) for (t, s), f in zip(plain, (0.9, 1.1, 0.95, 1.05))]

    def speed(calls):
        return sum(t for t, _ in calls) / sum(s for _, s in calls)

    point = speed(noisy) / speed(plain)
    lo, hi = speedup_interval(noisy, plain)
    assert lo < point < hi and hi - lo > 0.05
    louder = [(t, s * f) for (t, s), f in zip(plain, (0.7, 1.3, 0.8, 1.2))]
    lo2, hi2 = speedup_interval(louder, plain)
    assert hi2 - lo2 > hi - lo
    # one batch, or calls that do not pair up: no interval
    assert all(math.isnan(x) for x in speedup_interval(plain[:1], plain[:1]))
    assert all(math.isnan(x) for x in speedup_interval(plain[:3], plain))


def test_the_ngram_cost_script_runs(capsys):
    from adaflash_demo.bench import ngram_cost

    assert ngram_cost.main(["--lengths", "64,128", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and '"index_step_us"' in lines[-1]


def test_the_forward_dtype_script_times_each_dtype_of_the_target():
    from adaflash_demo.bench import forward_dtype

    loaded = []

    def load(dtype):
        loaded.append(dtype)
        return tiny_target().to(dtype)

    results = forward_dtype.measure(load, ["float32", "bfloat16"], [0, 1], batch_size=2, length=8, repeats=2)
    assert loaded == [torch.float32, torch.bfloat16] and list(results) == ["float32", "bfloat16"]
    assert all(ms > 0 for ms in results.values())


def test_the_step_trace_writes_one_character_per_step_and_each_drafted_width_under_it():
    steps = [
        SimpleNamespace(kind="plain", accepted=[0], verify_width=1),
        SimpleNamespace(kind="probe", accepted=[0], verify_width=1),
        SimpleNamespace(kind="drafted", accepted=[3], verify_width=5),
        SimpleNamespace(kind="drafted", accepted=[12], verify_width=16),
    ]
    assert step_line(steps) == (".p39", "  59")


def _bench_the_drafting_methods(tokenizer, drafter=None):
    """Runs plain, the planner and the hybrid on a tiny pair; returns ``(target, drafter)``."""
    target = tiny_target()
    target.generation_config.pad_token_id = 2
    tokenizer.padding_side = "left"
    drafter = tiny_drafter(target) if drafter is None else drafter(target)
    run_benchmark(
        target,
        tokenizer,
        {"x": ["abc", "de"]},
        drafter=drafter,
        methods=("plain", "adaflash_planned", "adaflash_hybrid"),
        max_new_tokens=6,
    )
    return target, drafter


def test_each_method_that_drafts_learns_on_its_own_copy_of_the_drafter(word_tokenizer, monkeypatch):
    # one method's measured costs and rates must not price another's steps (one runtime profile per drafter object)
    monkeypatch.setenv("ADAFLASH_HF_PROFILE_DIR", "off")
    target, drafter = _bench_the_drafting_methods(word_tokenizer)
    assert not profile_for(target, drafter).cost_table(target.device, target.dtype).step_s  # the original ran nothing


def test_with_a_profile_folder_each_methods_copy_keeps_a_file_of_its_own(word_tokenizer, monkeypatch, tmp_path):
    # the copies' files share a name (keyed by the drafter's configuration): in one folder, a copy first used after
    # another method's call would start from what that call saved
    monkeypatch.setenv("ADAFLASH_HF_PROFILE_DIR", str(tmp_path))
    shared = []

    def drafter(target):
        profile_for(target, tiny_drafter(target)).save(force=True)  # a file of the drafter's configuration
        shared.extend(tmp_path.glob("*.json"))
        shared[0].write_text("not json")  # a copy that read it would warn and rewrite it
        return tiny_drafter(target)

    _bench_the_drafting_methods(word_tokenizer, drafter)
    assert len(shared) == 1 and shared[0].read_text() == "not json"
    for method in ("adaflash_planned", "adaflash_hybrid"):
        (own,) = (tmp_path / method).glob("*.json")
        assert own.name == shared[0].name and json.loads(own.read_text())["profile"]["cost_tables"]


def test_the_hybrid_bounds_price_what_each_step_would_commit():
    from adaflash_demo.bench.hybrid_bound import StepCosts, fixed_time, least_time

    # a plain step 1 s, the draft 0.2 s, a forward of k tokens 1 + 0.1 (k - 1) s
    rows = [{"batch_size": 1, "k": k, "target_ms": 1000 + 100 * (k - 1), "drafter_ms": 200} for k in (1, 2, 4, 8)]
    costs = StepCosts(rows)
    assert costs.forward(3) == pytest.approx(1.2) and costs.forward(10) == pytest.approx(1.9)
    # 5 tokens (the prefill's first, then 4): at the first the drafts match 3, later nothing; a copied path of 4
    # tokens matches 4 at the first, nothing later. The last step's token is the target's own, so 3 accepted tokens
    # reach the end from the first
    trace = {"a_dr": [3, 0, 0, 0], "paths": [[[4, 4]], [], [], []], "prefill_s": 0.0}
    assert least_time(trace, costs, 16, True, 10) == pytest.approx(1.3)  # the path's 3 tokens, no draft
    assert least_time(trace, costs, 16, True, 0) == pytest.approx(0.2 + 1.3)  # 3 drafts
    assert least_time(trace, costs, 16, False, 0) == pytest.approx(4.0)  # plain steps only
    # a fixed width of 2 with no paths: a draft and 2 tokens while there is room (2 tokens, then 1), then a plain step
    assert fixed_time(trace, costs, 2, 0) == pytest.approx(2 * 1.3 + 1.0)
    assert fixed_time(trace, costs, 1, 10) == pytest.approx(1.3)  # copying alone: the path verified at once


def test_a_pooled_ab_mixes_the_domains_in_every_batch_and_names_each_switchs_values():
    from adaflash_demo.bench.batch_objective import SWITCHES, interleaved, variants
    from adaflash_hf.generation import planner

    assert interleaved([["a1", "a2"], ["b1"], ["c1", "c2", "c3"]]) == ["a1", "b1", "c1", "a2", "c2", "c3"]
    for switch, labels in SWITCHES.items():
        assert isinstance(getattr(planner, switch), bool)  # a switch the A/B sets on and off
        chosen = variants(["adaflash_planned"], switch)
        assert [(value, name.endswith(f"({label})")) for (name, _, value), label in zip(chosen, labels)] == [
            (True, True),
            (False, True),
        ]


def test_the_projection_ab_switches_the_planners_projection_and_the_heads_kernel_and_restores_them():
    from adaflash_demo.bench import rate_prior
    from adaflash_demo.bench.kernels import FunctionMode
    from adaflash_hf.generation import verify_layout
    from adaflash_hf.generation.draft_head import DraftHead
    from adaflash_hf.generation.planner import CostTable, VerificationPlanner

    planner = VerificationPlanner(CostTable(), 16, 1, torch.device("cpu"), length_head=True, probe_first=False)
    cap = torch.tensor([15])
    before = rate_prior.variants(["planner before section 35"])["planner before section 35"][1]
    try:
        rate_prior._set(before)
        assert planner.projected([0], torch.tensor([0.1]), cap) is cap  # the whole block projected
        head = DraftHead(torch.nn.Linear(8, 32, bias=False))
        assert head._choice_key(3)[2:] == (True, False)  # the dtype measured, no kernel
        assert isinstance(verify_layout.routed([], "onednn"), FunctionMode)  # and section 36's routing undone
    finally:
        rate_prior._set(rate_prior.SHIPPED)
    assert VerificationPlanner.projected is rate_prior.METHODS["projected"]
    assert DraftHead._choice_key is rate_prior.METHODS["_choice_key"]
    assert verify_layout.routed is rate_prior.METHODS["routed"]
    assert planner.projected([0], torch.tensor([0.1]), cap).tolist() == [1]  # no width measured: one draft


def test_the_attention_ab_switches_the_loops_grouped_query_attention_and_restores_it():
    import contextlib

    from adaflash_demo.bench import rate_prior
    from adaflash_hf.generation import attention, decoding

    assert decoding.grouped_query_attention is attention.grouped_query_attention
    try:
        rate_prior._set(rate_prior.variants(["planner before section 44"])["planner before section 44"][1])
        assert decoding.grouped_query_attention is contextlib.nullcontext  # transformers' sdpa as it is
    finally:
        rate_prior._set(rate_prior.SHIPPED)
    assert decoding.grouped_query_attention is attention.grouped_query_attention


def test_the_kernel_bench_times_the_loops_attention_unless_asked_for_the_copies():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from adaflash_demo.bench.kernels import COPIES_SUFFIX, MODE_SUFFIX, FunctionMode, kernel_context
    from adaflash_hf.generation.attention import gqa_sdpa_attention

    layer = torch.nn.Linear(4, 4)
    for kernel in ("linear", "transposed", "onednn" + MODE_SUFFIX):
        with kernel_context([layer], kernel):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is gqa_sdpa_attention
            assert ("forward" in layer.__dict__) is (kernel == "transposed")  # routed as the loop routes it
            assert isinstance(torch.overrides._get_current_function_mode(), FunctionMode) is kernel.endswith(
                MODE_SUFFIX
            )
    for kernel in ("linear" + COPIES_SUFFIX, "transposed" + COPIES_SUFFIX):
        with kernel_context([layer], kernel):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
            assert ("forward" in layer.__dict__) is kernel.startswith("transposed")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward and "forward" not in layer.__dict__
