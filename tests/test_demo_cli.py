"""The demo distribution's own command, `adaflash-demo`: `demo` and `bench` on a user's prompt file (every prompt
runs unless a limit is given) and on --target/--drafter (the synthetic checkpoints, seconds), `online` on the real
target's shipped streams, and `demo` on the real target itself (the README's main job, shortened)."""

import json
import math
from pathlib import Path

import pytest
from synthetic import prompts

from adaflash_demo.cli import chosen_prompts, main
from adaflash_demo.demo import read_prompt_file, stream_prompts
from adaflash_hf.cli import CommandError
from adaflash_hf.machine import machine_info, machine_summary


def _prompt_file(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_demo_runs_every_prompt_of_a_file_and_says_how_many(synthetic_checkpoints, tmp_path, capsys):
    # five prompts in one domain: the default limit of the shipped prompts (4) must not cut the user's file
    target, drafter = synthetic_checkpoints
    rows = [{"prompt": p, "domain": "mine"} for p in prompts(5)] + [{"prompt": prompts(1, seed=1)[0]}]
    path, out = _prompt_file(tmp_path / "prompts.jsonl", rows), tmp_path / "demo.jsonl"
    args = ["demo", "--target", target, "--drafter", drafter, "--prompts", path, "--max-new-tokens", "12"]
    assert main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"prompts: 6 from {path} (mine 5, custom 1)" in printed.err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["domain"], r["n"], r["identical"]) for r in records] == [("mine", 5, 5), ("custom", 1, 1)]
    keys = {"domain", "identical", "n", "mean_acceptance_length", "plain_tokens_per_s", "adaflash_tokens_per_s"}
    assert all(keys | {"speedup", "speedup_low", "speedup_high", "machine"} == set(r) for r in records)
    assert "outputs identical to plain generate(): 6/6" in printed.out
    # each speedup with its interval: a bootstrap over five calls brackets the point, one call has none
    mine, custom = records
    assert mine["speedup_low"] <= mine["speedup"] <= mine["speedup_high"]
    assert math.isnan(custom["speedup_low"]) and math.isnan(custom["speedup_high"])
    assert f"{mine['speedup']:.2f}x | [{mine['speedup_low']:.2f}, {mine['speedup_high']:.2f}] |" in printed.out
    assert f"{custom['speedup']:.2f}x | - |" in printed.out
    assert "each speedup is over 1-5 calls a domain" in printed.out
    # the machine, above the table and in every record
    machine = records[0]["machine"]
    assert machine == machine_info() and all(r["machine"] == machine for r in records)
    assert f"machine: {machine_summary(machine)}\n\n| domain |" in printed.out

    assert main([*args, "--prompts-per-domain", "2", "--json", str(out)]) == 0  # a limit given: it applies
    assert f"prompts: 3 from {path} (mine 2, custom 1)" in capsys.readouterr().err
    assert [r["n"] for r in map(json.loads, out.read_text().splitlines())] == [2, 1]

    # repeats serve every prompt again: twice the outputs, each compared with plain generate()'s, and an interval
    assert main([*args, "--prompts-per-domain", "2", "--repeats", "2", "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["n"], r["identical"]) for r in records] == [(4, 4), (2, 2)]
    assert not math.isnan(records[1]["speedup_low"])
    assert "each speedup is over 2-4 calls a domain" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats 0: give at least 1" in capsys.readouterr().err


def test_bench_serves_a_whole_prompt_file_in_batches_per_domain(synthetic_checkpoints, tmp_path, capsys):
    target, drafter = synthetic_checkpoints
    path = _prompt_file(tmp_path / "prompts.jsonl", [{"prompt": p, "domain": "mixed"} for p in prompts(4)])
    out = tmp_path / "out.json"
    args = ["bench", "--target", target, "--drafter", drafter, "--prompts", path, "--quick"]
    args += ["--methods", "plain,adaflash_fixed,adaflash_planned", "--batch-sizes", "1,4", "--max-new-tokens", "12"]
    assert main([*args, "--json", str(out), "--markdown", str(tmp_path / "out.md")]) == 0
    printed = capsys.readouterr()
    assert f"prompts: 4 from {path} (mixed 4)" in printed.err
    results = json.loads(out.read_text())
    records = results["records"]
    assert {(r["domain"], r["batch_size"]) for r in records} == {("mixed", 1), ("mixed", 4)}
    assert {r["method"] for r in records} == {"plain", "adaflash_fixed", "adaflash_planned"}
    assert all(r["identical_fraction"] == 1.0 for r in records)
    # the machine: in the JSON, heading the printed report and the markdown file
    assert results["machine"] == machine_info()
    header = f"Machine: {machine_summary(results['machine'])}"
    markdown = (tmp_path / "out.md").read_text()
    assert markdown.startswith(header + "\n\n| method |") and "| adaflash_planned |" in markdown
    assert printed.out.startswith(header)


def test_bench_refuses_a_batch_size_no_pool_of_prompts_can_fill_before_loading_anything(tmp_path, capsys):
    path = _prompt_file(tmp_path / "prompts.jsonl", [{"prompt": p, "domain": "mixed"} for p in prompts(4)])
    args = ["bench", "--target", "never-loaded", "--drafter", "never-loaded", "--prompts", path]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--batch-sizes", "1,8"])
    assert exit_info.value.code == 2
    assert "batch size 8 cannot be filled: mixed 4 prompts, 4 even pooled; give smaller batch sizes" in (
        capsys.readouterr().err
    )


def test_without_a_file_the_shipped_prompts_are_limited_and_a_user_target_gets_generic_ones(capsys):
    class Args:
        prompts, target, prompts_per_domain = None, None, None

    shipped = chosen_prompts(Args, default_per_domain=4)
    assert list(shipped) == ["chat", "code", "docs", "shell", "math", "changelog"]
    assert {len(texts) for texts in shipped.values()} == {4}
    assert "prompts: 24 from the shipped held-out prompts" in capsys.readouterr().err
    Args.prompts_per_domain = 100  # never more than the 16 the recipe measured on
    assert {len(texts) for texts in chosen_prompts(Args, default_per_domain=4).values()} == {16}
    Args.target, Args.prompts_per_domain = "some/model", None
    assert list(chosen_prompts(Args, default_per_domain=4)) == ["chat"]
    Args.prompts_per_domain = 0
    with pytest.raises(CommandError, match="--prompts-per-domain 0"):
        chosen_prompts(Args, default_per_domain=4)


def test_a_bad_prompt_file_exits_naming_the_row(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"domain": "code"}\n')
    with pytest.raises(CommandError, match="row 2 has no `prompt` text"):
        read_prompt_file(path)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--prompts", str(path), "--max-new-tokens", "4"])
    assert exit_info.value.code == 2 and "adaflash-demo demo: error:" in capsys.readouterr().err


def test_the_real_targets_streams_are_shipped_and_disjoint():
    changelog = stream_prompts("changelog")
    assert len(changelog) == 256 and {row["domain"] for row in changelog} == {"changelog"}
    heldout = {row["prompt"] for row in stream_prompts("code")}
    assert len(heldout) == 32 and not heldout & {row["prompt"] for row in changelog}
    mixed = stream_prompts("all")
    assert [row["domain"] for row in mixed[:5]] == ["code", "docs", "shell", "math", "changelog"]
    with pytest.raises(ValueError, match="unknown domain 'prose'"):
        stream_prompts("prose")


def test_online_refuses_a_user_target_without_its_stream(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["online", "--target", "t", "--drafter", "d", "--swap-dir", str(tmp_path / "swap")])
    assert "--target needs a --prompts stream" in capsys.readouterr().err


def test_recipe_is_a_sub_command_with_the_recipes_fields(capsys):
    with pytest.raises(SystemExit):
        main(["recipe", "--help"])
    assert "--work_dir" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["recipe", "--stages", "nope"])
    assert exit_info.value.code == 2 and "Unknown stage(s) ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", [None, "smollm2-chat-drafter"])
def test_demo_on_the_real_target_is_identical_to_plain_generate(drafter, tmp_path, capsys):
    """The README's main job, shortened: SmolLM2-135M-Instruct (converted from its GGUF file on first use, into the
    usual cache) with a shipped drafter (the default, or the chat one by its name), one held-out prompt per domain."""
    out = tmp_path / "demo.jsonl"
    named = [] if drafter is None else ["--drafter", drafter]
    assert main(["demo", *named, "--prompts-per-domain", "1", "--max-new-tokens", "24", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "SmolLM2-135M-Instruct" in printed.err and f"{drafter or 'smollm2-drafter'}/drafter" in printed.err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["domain"] for r in records] == ["chat", "code", "docs", "shell", "math", "changelog"]
    assert all(r["identical"] == r["n"] == 1 for r in records)
    assert "outputs identical to plain generate(): 6/6" in printed.out


def test_shipped_drafters_are_named_and_share_the_held_out_prompts():
    from adaflash_demo import demo
    from adaflash_hf import AdaFlashConfig

    assert demo.drafter_path(None) == demo.DRAFTER_DIR / "drafter"
    assert demo.drafter_path("my/own/drafter") == Path("my/own/drafter")
    blocks = {
        name: AdaFlashConfig.from_pretrained(demo.drafter_path(name)).block_size for name in demo.SHIPPED_DRAFTERS
    }
    assert blocks == {"smollm2-drafter": 16, "smollm2-chat-drafter": 8}
    # the demo serves the default folder's prompts whichever drafter runs: both ship the same held-out prompts
    for name in demo.SHIPPED_DRAFTERS:
        assert demo.shipped_prompts(data_dir=demo.DATA_DIR / name) == demo.shipped_prompts(), name
