"""The benchmark harness on tiny models: every method runs, records are complete, fp32 greedy outputs identical."""

import math

from helpers import tiny_drafter, tiny_target

from adaflash_demo.bench.harness import METHODS, run_benchmark


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
    plain = next(r for r in records if r.method == "plain" and r.batch_size == 1)
    assert plain.speedup == 1.0 and abs(plain.mean_acceptance_length - 1.0) < 1e-9
    fixed = next(r for r in records if r.method == "adaflash_fixed" and r.batch_size == 1)
    assert fixed.verified_per_emitted > 2  # a random drafter: 8 tokens verified per step, ~1 emitted
    assert fixed.padding_fraction == 0.0 and math.isnan(plain.padding_fraction)  # one row pads nothing
    adaptive = [r for r in records if r.method == "adaflash_adaptive" and r.batch_size == 2]
    assert all(0.0 <= r.padding_fraction < 1.0 for r in adaptive)


def test_a_domain_with_fewer_prompts_than_a_batch_has_no_record_at_that_size(word_tokenizer):
    target = tiny_target()
    target.generation_config.pad_token_id = 2
    word_tokenizer.padding_side = "left"
    prompts = {"three": ["abcabcab", "hello world", "xyz"], "one": ["0123"]}
    records = run_benchmark(target, word_tokenizer, prompts, methods=("plain",), batch_sizes=(1, 2), max_new_tokens=4)
    assert sorted((r.domain, r.batch_size) for r in records) == [("one", 1), ("three", 1), ("three", 2)]
    assert all(r.tokens_per_s > 0 for r in records)


def test_report_table_and_plots(tmp_path, word_tokenizer):
    from adaflash_demo.bench.report import markdown_table, plot_records, summary_tables

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
    summary = summary_tables(records).splitlines()
    assert summary[0] == "| method | x | mean speedup |" and summary[3].startswith("| plain | ")
    fixed_at_two = next(r for r in records if r.method == "adaflash_fixed" and r.batch_size == 2)
    expected = f"| 2 | adaflash_fixed | {fixed_at_two.tokens_per_s:.1f} | {fixed_at_two.speedup:.2f}x |"
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
    planned_tree = method_kwargs("adaflash_planned_tree16", drafter)
    assert planned_tree["adaflash_length_policy"] == "planned" and planned_tree["adaflash_tree_budget"] == 16
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
