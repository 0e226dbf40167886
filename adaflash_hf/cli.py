"""The `adaflash` command: `train` (OPD training from a YAML recipe, TRL's parser) and `online` (serve a prompt
stream with online adaptation). The demo and the benchmark are the separate demo distribution's own command,
`adaflash-demo`; this module imports nothing of it.

The model loading, prompt-stream reading and online serving below are public so that other commands (the demo's)
reuse them instead of keeping copies: `add_model_arguments`, `load_models`, `read_stream`, `add_online_arguments`,
`run_online` and `parse_command_line`. They raise `CommandError` for bad input; `main` turns it into an exit.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import TrlParser

from .chat import render_prompt
from .modeling import AdaFlashDrafter
from .utils import CommandError, read_jsonl, write_json_atomic

__all__ = ["CommandError", "main"]


def add_model_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--target``, ``--drafter``, ``--tokenizer``, ``--dtype``, ``--device`` and ``--max-new-tokens``.
    ``required=False`` lets a command that has default models (the demo's) leave them out."""
    parser.add_argument("--target", required=required, help="target model id or path")
    parser.add_argument("--drafter", required=required, help="AdaFlash or DFlash drafter id or path for that target")
    parser.add_argument("--tokenizer", help="tokenizer id or path (default: the target's)")
    parser.add_argument("--dtype", default="float32", help="float32 (exact), bfloat16 or float16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens per request (default 128)")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CommandError(f"--dtype {name} is not a torch dtype: use float32, bfloat16 or float16")
    return dtype


def load_models(args) -> tuple:
    """``(target, tokenizer, drafter)`` from ``--target``, ``--drafter`` and ``--tokenizer``; the tokenizer pads on
    the left, as batched generation needs."""
    if args.target is None or args.drafter is None:
        raise CommandError("give both --target and --drafter (an AdaFlash or DFlash drafter trained for that target)")
    dtype = torch_dtype(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or args.target))
    tokenizer.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=dtype).to(args.device).eval()
    drafter = AdaFlashDrafter.from_pretrained(str(args.drafter), dtype=dtype).to(args.device).eval()
    return target, tokenizer, drafter


def read_stream(path: str | Path) -> list[dict]:
    """The rows of a JSONL prompt stream: ``prompt`` (plain text, the user's turn) and optional ``domain``."""
    try:
        rows = read_jsonl(path)
    except OSError as error:
        raise CommandError(f"cannot read the prompt stream {path}: {error.strerror}") from None
    except ValueError as error:
        raise CommandError(f"{error}: write one JSON object per line") from None
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise CommandError(
                f'{path}: row {number} has no `prompt` text; write one object per line, like {{"prompt": "...", '
                '"domain": "code"}'
            )
    if not rows:
        raise CommandError(f"{path} holds no prompts; write one JSON object with a `prompt` per line")
    return rows


# ---------------------------------------------------------------------------------------------- online


def add_online_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving and adaptation flags of `run_online` (the stream's source is the command's own)."""
    parser.add_argument("--num-requests", type=int, default=256, help="serve at most this many requests")
    parser.add_argument("--serve-batch-size", type=int, default=1, help="prompts per generate() call")
    parser.add_argument("--mode", default="drafter", choices=["drafter", "domain_adapters"])
    parser.add_argument("--swap-dir", default="runs/online", help="buffer, versions and metrics.jsonl")
    parser.add_argument("--resume", action="store_true", help="continue the buffer and versions in --swap-dir")
    # Defaults suit the demo's short responses; the reference (8B, 2k-token responses) uses 128 samples per round,
    # 2 epochs, lr 3e-4 and 512 anchors.
    parser.add_argument("--train-threshold", type=int, default=32, help="samples per training round")
    parser.add_argument("--buffer-epochs", type=int, default=4, help="passes over a round's samples")
    parser.add_argument("--train-batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--num-anchors", type=int, default=16, help="blocks per sequence (512 for 2k tokens)")
    # Small rounds can retrain the length head into predicting no drafts at all (BENCHMARKS.md §7), after which the
    # adaptive policy stops drafting; keep it as shipped, or train it more slowly.
    parser.add_argument(
        "--train-length-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="retrain the drafter's length head in each round (--no-train-length-head keeps it as it is)",
    )
    parser.add_argument(
        "--length-head-learning-rate", type=float, help="the length head's rate in each round (default: OPDConfig's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--background", action="store_true", help="train in a background thread (default: rounds run between requests)"
    )
    parser.add_argument("--compare", action="store_true", help="also serve the stream without adaptation")
    parser.add_argument("--json", help="write the per-version and per-domain summary here")
    parser.add_argument("--plot", help="write the acceptance-vs-version PNG here")


def check_online_arguments(args) -> None:
    """What can fail before any model loads: a missing matplotlib, a --swap-dir in use."""
    from .online.metrics import pyplot

    if args.plot:
        pyplot()  # raises naming the extra to install, before the stream is served rather than after
    root = Path(args.swap_dir)
    if root.exists() and any(root.iterdir()) and not args.resume:
        raise CommandError(
            f"{root} is not empty: pass --resume to continue its buffer and versions, or choose another --swap-dir"
        )


def run_online(args, target, tokenizer, drafter, rows: list[dict], title: str = "") -> int:
    """Serves the stream ``rows`` (``prompt``, optional ``domain``) through an `OnlineGenerator` (adapted, and with
    --compare also not adapted), then prints acceptance per drafter version and writes a summary and a plot."""
    # online serving trains with TRL's trainers, which only this verb (and `train`) needs to import
    from .online import OnlineConfig, online_summary, pair_with_baseline, plot_acceptance, serve_stream
    from .training import OPDConfig

    rows = rows[: args.num_requests]
    texts = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    domains = [row.get("domain") for row in rows]
    print(f"stream: {len(texts)} requests", file=sys.stderr)
    root = Path(args.swap_dir)
    training_args = OPDConfig(
        output_dir=str(root / ".runs"),
        per_device_train_batch_size=args.train_batch_size,
        gradient_accumulation_steps=1,
        learning_rate=args.learning_rate,
        train_length_head=args.train_length_head,
        num_anchors=args.num_anchors,
        bf16=True,  # autocast in the trainer thread only; the drafter's weights keep their dtype
        use_cpu=args.device == "cpu",
        seed=args.seed,
        # OPDConfig's own default unless given, so the two cannot drift apart
        **(
            {}
            if args.length_head_learning_rate is None
            else {"length_head_learning_rate": args.length_head_learning_rate}
        ),
    )
    config = OnlineConfig(
        swap_dir=str(root),
        mode=args.mode,
        train_threshold=args.train_threshold,
        buffer_epochs=args.buffer_epochs,
        training_args=training_args,
        background=args.background,
    )
    generate = dict(max_new_tokens=args.max_new_tokens or 128, do_sample=False)
    runs = {}
    for label, adapt in (("adapted", True), ("not adapted", False))[: 2 if args.compare else 1]:
        served = copy.deepcopy(drafter)  # each run adapts (or wraps, for domain adapters) its own copy
        run_config = replace(config, swap_dir=str(root / label.replace(" ", "_")))
        with tqdm(total=len(texts), desc=f"online ({label})", unit="request", file=sys.stderr) as progress:
            server = serve_stream(
                target,
                served,
                tokenizer,
                texts,
                run_config,
                domains,
                args.serve_batch_size,
                adapt,
                progress,
                **generate,
            )
        runs[label] = server.metrics.rows()
        print(f"\n{label}: {json.dumps(server.status)}")
    summary = {label: online_summary(rows) for label, rows in runs.items()}
    if args.compare:
        pair_with_baseline(summary["adapted"]["by_version"], runs["adapted"], runs["not adapted"])
    for label, entry in summary.items():
        print(f"\n{label}\n| version | requests | acceptance length | not adapted, same requests | verify | tok/s |")
        print("|---|---|---|---|---|---|")
        for row in entry["by_version"]:
            print(
                f"| {row['version']} | {row['requests']} | {row['mean_acceptance_length']:.2f} | "
                f"{_optional(row.get('not_adapted_same_requests'))} | "
                f"{row['mean_verify_length']:.2f} | {row['tokens_per_s']:.0f} |"
            )
        print("| domain | first quarter | last quarter |\n|---|---|---|")
        for domain, (first, last) in entry["by_domain"].items():
            print(f"| {domain} | {first:.2f} | {last:.2f} |")
    if args.json:
        write_json_atomic(args.json, summary, indent=2)
    if args.plot:
        print(f"wrote {plot_acceptance(runs, args.plot, title=title)}")
    return 0


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def online(args) -> int:
    """`adaflash online`: the user's target, drafter and prompt stream."""
    check_online_arguments(args)
    rows = read_stream(args.prompts)
    target, tokenizer, drafter = load_models(args)
    return run_online(args, target, tokenizer, drafter, rows)


# ---------------------------------------------------------------------------------------------- entry


class _SubCommandParser(TrlParser):
    """A sub-command's parser. A dataclass-backed one (``train``, TRL's ``make_parser(subparsers)``) also reads
    ``field=value`` overrides of its fields: argparse hands each sub-command only its own arguments, so another
    sub-command's values (a path holding ``=``) are never rewritten."""

    def parse_known_args(self, args=None, namespace=None):
        if self.dataclass_types and args is not None:
            from .training.cli import field_names, field_overrides

            args = field_overrides(list(args), field_names(self.dataclass_types))
        return super().parse_known_args(args, namespace)


def command_parser(prog: str, description: str) -> tuple[TrlParser, argparse._SubParsersAction]:
    """A top-level parser whose sub-commands are `TrlParser`s, so a dataclass-backed one reads a YAML ``--config``
    and ``field=value`` overrides, as TRL's own scripts do."""
    parser = TrlParser(prog=prog, description=description)
    return parser, parser.add_subparsers(dest="command", required=True, parser_class=_SubCommandParser)


def parse_command_line(parser: TrlParser, argv: list[str]) -> argparse.Namespace:
    """Parses ``argv`` with `command_parser`'s parser; a recipe key or argument that no field takes is one error."""
    try:
        (namespace,) = parser.parse_args_and_config(list(argv))
    except ValueError as error:  # TrlParser's: arguments or recipe keys that no field takes
        parser.error(str(error))
    return namespace


def build_parser() -> TrlParser:
    from .training.cli import make_parser

    parser, commands = command_parser("adaflash", "AdaFlash speculative decoding for transformers")
    make_parser(commands)
    online_parser = commands.add_parser(
        "online", help="serve a prompt stream with online adaptation (hot-swapped drafter versions)"
    )
    add_model_arguments(online_parser)
    online_parser.add_argument(
        "--prompts", required=True, help="JSONL stream: one request per line, `prompt` and optional `domain`"
    )
    add_online_arguments(online_parser)
    online_parser.set_defaults(func=online)
    return parser


def run_command(parser: TrlParser, argv: list[str] | None) -> int:
    """Parses and runs a sub-command; bad input (`CommandError`, or a recipe's ``ValueError``) exits with its
    message instead of a traceback."""
    namespace = parse_command_line(parser, sys.argv[1:] if argv is None else argv)
    try:
        return namespace.func(namespace)
    except CommandError as error:
        parser.exit(2, f"{parser.prog} {namespace.command}: error: {error}\n")


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    # `python -m adaflash_hf.cli` runs this file as `__main__`; the commands raise `adaflash_hf.cli.CommandError`,
    # which only the imported module's `main` catches.
    from adaflash_hf.cli import main as imported_main

    sys.exit(imported_main())
