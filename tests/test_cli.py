"""The library's `adaflash` command: `train` registered as TRL's scripts register theirs, `online` on the user's
target, drafter and stream, and bad input as one clear exit. (`train` end to end: tests/test_training_tools.py; the
demo's command: tests/test_demo_cli.py.)"""

import json
import sys

import pytest
import torch
from synthetic import prompts

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.cli import CommandError, build_parser, load_models, main, parse_command_line, read_stream


def _stream(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_commands_are_train_and_online(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{train,online}" in out and "demo" not in out and "bench" not in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--teacher_model_name_or_path" in out and "--new_drafter" in out and "--lora_r" in out  # TRL's fields


def test_field_overrides_are_read_by_train_only():
    # `online`'s values are left as they are, even when they look like an override of a training field
    parser = build_parser()
    args = parse_command_line(parser, ["online", "--target", "t", "--drafter", "d", "--prompts", "max_steps=3.jsonl"])
    assert args.prompts == "max_steps=3.jsonl" and args.command == "online"
    args = parse_command_line(parser, ["train", "max_steps=3", "--learning_rate", "1e-4", "use_cpu=true"])
    assert (args.max_steps, args.learning_rate, args.command) == (3, 1e-4, "train")


def test_online_adapts_a_user_drafter_on_a_user_stream_and_compares(synthetic_checkpoints, tmp_path, capsys):
    target, drafter = synthetic_checkpoints
    stream = _stream(tmp_path / "stream.jsonl", [{"prompt": p, "domain": "synthetic"} for p in prompts(10)])
    swap, summary, plot = tmp_path / "swap", tmp_path / "summary.json", tmp_path / "online.png"
    args = ["online", "--target", target, "--drafter", drafter, "--prompts", stream, "--num-requests", "8"]
    args += ["--train-threshold", "4", "--max-new-tokens", "16", "--train-batch-size", "4", "--buffer-epochs", "1"]
    args += ["--num-anchors", "4", "--compare", "--swap-dir", str(swap), "--json", str(summary), "--plot", str(plot)]
    assert main(args) == 0
    assert "stream: 8 requests" in capsys.readouterr().err
    result = json.loads(summary.read_text())
    assert [row["version"] for row in result["adapted"]["by_version"]] == [0, 1]  # v2 is published after the last
    assert [row["version"] for row in result["not adapted"]["by_version"]] == [0]
    first = result["adapted"]["by_version"][0]  # version 0 served the same requests with the same drafter in both
    assert first["not_adapted_same_requests"] == pytest.approx(first["mean_acceptance_length"])
    assert result["adapted"]["requests"] == result["not adapted"]["requests"] == 8
    assert set(result["adapted"]["by_domain"]) == {"synthetic"}
    assert plot.stat().st_size > 0 and (swap / "adapted" / "published" / "drafter" / "LATEST.json").exists()

    with pytest.raises(SystemExit) as exit_info:  # the swap directory is in use
        main(args)
    assert exit_info.value.code == 2 and "is not empty: pass --resume" in capsys.readouterr().err


def test_online_can_keep_the_length_head_as_shipped(synthetic_checkpoints, tmp_path):
    # --no-train-length-head: a round retrains the drafter but publishes the length head it started from, while
    # the default retrains it (the real target's small rounds collapsed it; BENCHMARKS.md §7)
    target, drafter_dir = synthetic_checkpoints
    stream = _stream(tmp_path / "stream.jsonl", [{"prompt": p} for p in prompts(8)])
    shipped = AdaFlashDrafter.from_pretrained(drafter_dir)

    def published(swap):
        latest = json.loads((swap / "adapted" / "published" / "drafter" / "LATEST.json").read_text())
        drafter = AdaFlashDrafter.from_pretrained(swap / "adapted" / "published" / "drafter" / latest["directory"])
        return drafter.thresh_head_two_model.state_dict(), drafter.layers.state_dict()

    for flag, changed in (("--no-train-length-head", False), ("--train-length-head", True)):
        swap = tmp_path / flag
        args = ["online", "--target", target, "--drafter", drafter_dir, "--prompts", stream, "--swap-dir", str(swap)]
        args += ["--train-threshold", "4", "--max-new-tokens", "16", "--train-batch-size", "4", "--buffer-epochs"]
        args += ["1", "--num-anchors", "4", flag, "--length-head-learning-rate", "1e-2"]
        assert main(args) == 0
        head, layers = published(swap)
        same_head = all(torch.equal(v, shipped.thresh_head_two_model.state_dict()[k]) for k, v in head.items())
        assert same_head is not changed, flag
        assert not all(torch.equal(v, shipped.layers.state_dict()[k]) for k, v in layers.items()), flag


@pytest.mark.parametrize(
    "content, problem",
    [
        ('{"prompt": "fine"}\nnot json\n', r"line 2 is not valid JSON"),
        ('{"prompt": "fine"}\n{"text": "no prompt"}\n', r"row 2 has no `prompt` text"),
        ('{"prompt": " "}\n', r"row 1 has no `prompt` text"),
        ("\n", r"holds no prompts"),
    ],
)
def test_a_bad_stream_is_one_error_naming_the_row(tmp_path, capsys, content, problem):
    path = tmp_path / "stream.jsonl"
    path.write_text(content)
    with pytest.raises(CommandError, match=problem):
        read_stream(path)
    with pytest.raises(SystemExit) as exit_info:  # before any model loads: the paths below do not exist
        main(["online", "--target", "nowhere", "--drafter", "nowhere", "--prompts", str(path)])
    assert exit_info.value.code == 2
    assert "adaflash online: error:" in capsys.readouterr().err


def test_load_models_raises_instead_of_exiting():
    args = build_parser().parse_args(["online", "--target", "t", "--drafter", "d", "--prompts", "p"])
    args.drafter = None
    with pytest.raises(CommandError, match="give both --target and --drafter"):
        load_models(args)
    args.drafter, args.dtype = "d", "float33"
    with pytest.raises(CommandError, match="--dtype float33 is not a torch dtype"):
        load_models(args)


def test_plot_without_matplotlib_names_the_extra_before_serving(monkeypatch, tmp_path):
    stream = _stream(tmp_path / "stream.jsonl", [{"prompt": "step1 n1"}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without matplotlib raises
    args = ["online", "--target", "t", "--drafter", "d", "--prompts", stream, "--plot", str(tmp_path / "online.png")]
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'adaflash-hf\[plot\]'"):
        main([*args, "--swap-dir", str(tmp_path / "swap")])
    assert not (tmp_path / "swap").exists()  # nothing was served
