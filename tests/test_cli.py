"""The `adaflash` command end to end: on the toy world (fast), and `adaflash demo` on the real target."""

import argparse
import json
import sys

import pytest
import torch

from adaflash_hf.cli import main


def test_demo_runs_on_the_toy_world_with_identical_outputs(capsys):
    assert main(["demo", "--world", "toy", "--prompts-per-domain", "1", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "| domain | identical | acceptance length |" in out
    for domain in ("code", "prose", "man", "math"):
        assert f"| {domain} | 1/1 |" in out
    assert "outputs identical to plain generate(): 4/4" in out and "mean speedup" in out


def test_demo_serves_a_prompt_file_and_writes_one_record_per_domain(tmp_path, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "demo.jsonl"
    rows = [{"prompt": "def add(a, b):", "domain": "mine"}, {"prompt": "The quick brown fox"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["demo", "--world", "toy", "--prompts", str(prompts), "--max-new-tokens", "12", "--json", str(out)]
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["domain"] for r in records] == ["mine", "custom"]
    keys = {"domain", "identical", "n", "mean_acceptance_length", "plain_tokens_per_s", "adaflash_tokens_per_s"}
    assert all(keys | {"speedup"} == set(r) for r in records)
    assert all(r["identical"] == r["n"] == 1 for r in records)


@pytest.mark.parametrize(
    "line, problem",
    [("not json", "is not JSON"), ('{"domain": "code"}', "has no `prompt` text"), ('{"prompt": " "}', "no `prompt`")],
)
def test_demo_names_the_bad_line_of_a_prompt_file(tmp_path, line, problem):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(SystemExit, match=f"prompts.jsonl:2 .*{problem}"):
        main(["demo", "--world", "toy", "--prompts", str(prompts), "--max-new-tokens", "4"])


def test_bench_quick_writes_records(tmp_path, capsys):
    path = tmp_path / "out.json"
    args = [
        "bench",
        "--world",
        "toy",
        "--quick",
        "--methods",
        "plain,adaflash_fixed,adaflash_adaptive,adaflash_planned",
        "--batch-sizes",
        "1,2",
        "--prompts-per-domain",
        "2",
        "--max-new-tokens",
        "12",
        "--json",
        str(path),
    ]
    assert main(args) == 0
    records = json.loads(path.read_text())
    keys = {
        "method",
        "batch_size",
        "domain",
        "dtype",
        "tokens_per_s",
        "speedup",
        "mean_acceptance_length",
        "verified_per_emitted",
        "identical_fraction",
    }
    assert all(keys <= set(r) for r in records)
    assert {r["batch_size"] for r in records} == {1, 2}
    assert {r["method"] for r in records} == {"plain", "adaflash_fixed", "adaflash_adaptive", "adaflash_planned"}
    assert all(r["identical_fraction"] == 1.0 for r in records if r["dtype"] == "float32")


def test_bench_serves_a_prompt_file_in_batches_per_domain(tmp_path):
    prompts, path = tmp_path / "prompts.jsonl", tmp_path / "out.json"
    texts = ("def add(a, b):", "The quick brown fox", "ls -l", "2 + 2")
    rows = [{"prompt": text, "domain": "mixed"} for text in texts]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["bench", "--world", "toy", "--prompts", str(prompts), "--methods", "plain,adaflash_planned"]
    assert main([*args, "--batch-sizes", "4", "--max-new-tokens", "12", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {(r["domain"], r["batch_size"]) for r in records} == {("mixed", 4)}
    assert all(r["identical_fraction"] == 1.0 for r in records)


def test_online_adapts_on_the_unseen_stream_and_compares_with_the_baseline(tmp_path, capsys):
    swap, summary, plot = tmp_path / "swap", tmp_path / "summary.json", tmp_path / "online.png"
    args = ["online", "--world", "toy", "--num-requests", "8", "--train-threshold", "4", "--max-new-tokens", "20"]
    args += ["--train-batch-size", "4", "--buffer-epochs", "1", "--num-anchors", "4", "--compare"]
    args += ["--swap-dir", str(swap), "--json", str(summary), "--plot", str(plot)]
    assert main(args) == 0
    result = json.loads(summary.read_text())
    assert [row["version"] for row in result["adapted"]["by_version"]] == [0, 1]  # v2 is published after the last
    assert [row["version"] for row in result["not adapted"]["by_version"]] == [0]
    first = result["adapted"]["by_version"][0]  # version 0 served the same requests with the same drafter in both
    assert first["not_adapted_same_requests"] == pytest.approx(first["mean_acceptance_length"])
    assert result["adapted"]["requests"] == result["not adapted"]["requests"] == 8
    assert set(result["adapted"]["by_domain"]) == {"changelog"}
    assert plot.stat().st_size > 0 and (swap / "adapted" / "published" / "drafter" / "LATEST.json").exists()

    with pytest.raises(SystemExit, match="is not empty: pass --resume"):
        main(args)


def test_online_can_keep_the_length_head_as_shipped(tmp_path):
    # --no-train-length-head: a round retrains the drafter but publishes the length head it started from, while
    # the default retrains it (the real target's small rounds collapsed it; BENCHMARKS.md)
    from adaflash_demo.world import world_artifact
    from adaflash_hf import AdaFlashDrafter

    def published_head(swap):
        latest = json.loads((swap / "adapted" / "published" / "drafter" / "LATEST.json").read_text())
        drafter = AdaFlashDrafter.from_pretrained(swap / "adapted" / "published" / "drafter" / latest["directory"])
        return drafter.thresh_head_two_model.state_dict(), drafter.layers.state_dict()

    shipped = AdaFlashDrafter.from_pretrained(world_artifact("drafter"))
    heads = {}
    for flag in ("--no-train-length-head", "--train-length-head"):
        swap = tmp_path / flag
        args = ["online", "--world", "toy", "--num-requests", "8", "--train-threshold", "4", "--max-new-tokens", "20"]
        args += ["--train-batch-size", "4", "--buffer-epochs", "1", "--num-anchors", "4", "--swap-dir", str(swap)]
        assert main(args + [flag, "--length-head-learning-rate", "1e-2"]) == 0
        heads[flag] = published_head(swap)
    for flag, changed in (("--no-train-length-head", False), ("--train-length-head", True)):
        head, layers = heads[flag]
        same_head = all(torch.equal(v, shipped.thresh_head_two_model.state_dict()[k]) for k, v in head.items())
        assert same_head is not changed, flag
        assert not all(torch.equal(v, shipped.layers.state_dict()[k]) for k, v in layers.items()), flag


def test_online_serves_a_prompt_file_and_names_a_bad_line(tmp_path, capsys):
    from adaflash_demo.world import load_stream

    rows = [{"prompt": row["prompt"], "domain": "custom"} for row in load_stream("man")[:3]]
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["online", "--world", "toy", "--prompts", str(stream), "--max-new-tokens", "8"]
    args += ["--swap-dir", str(tmp_path / "a")]
    assert main(args) == 0
    assert "| custom |" in capsys.readouterr().out

    stream.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(SystemExit, match="line 1 has no `prompt` field"):
        main(["online", "--world", "toy", "--prompts", str(stream), "--swap-dir", str(tmp_path / "b")])


def test_the_real_targets_stream_is_its_unseen_domain_through_the_chat_template():
    from synthetic import synthetic_tokenizer

    from adaflash_demo.demo import stream_prompts
    from adaflash_hf import cli

    args = argparse.Namespace(prompts=None, target=None, world="smollm2", domain="changelog", num_requests=300)
    texts, domains = cli._stream(args)
    assert len(texts) == 256 and set(domains) == {"changelog"}  # the shipped stream, not the toy world's
    heldout = {row["prompt"] for row in stream_prompts("code")}
    assert len(heldout) == 32 and not heldout & set(texts)
    mixed = stream_prompts("all")
    assert [row["domain"] for row in mixed[:5]] == ["code", "docs", "shell", "math", "changelog"]
    with pytest.raises(SystemExit, match="unknown domain 'prose'"):
        cli._stream(argparse.Namespace(**{**vars(args), "domain": "prose"}))
    tokenizer = synthetic_tokenizer()
    tokenizer.chat_template = None
    assert cli._as_requests(tokenizer, ["a b"]) == ["a b"]  # no template: as it is (the toy world)
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<assistant>"
    assert cli._as_requests(tokenizer, ["a b"]) == ["<user>a b<assistant>"]


def test_plot_without_matplotlib_names_the_extra_before_serving(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without matplotlib raises
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'adaflash-hf\[plot\]'"):
        main(["online", "--plot", str(tmp_path / "online.png"), "--swap-dir", str(tmp_path / "swap")])
    assert not (tmp_path / "swap").exists()  # nothing was served


def test_demo_on_the_real_target_is_identical_to_plain_generate(tmp_path, capsys):
    """The README's main job, shortened: SmolLM2-135M-Instruct (converted from its GGUF file on first use, into the
    usual cache) with the shipped drafter, one held-out prompt per domain."""
    out = tmp_path / "demo.jsonl"
    assert main(["demo", "--prompts-per-domain", "1", "--max-new-tokens", "24", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "SmolLM2-135M-Instruct" in printed.err and "smollm2-drafter" in printed.err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["domain"] for r in records] == ["code", "docs", "shell", "math", "changelog"]
    assert all(r["identical"] == r["n"] == 1 for r in records)
    assert "outputs identical to plain generate(): 5/5" in printed.out
