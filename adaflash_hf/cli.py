"""The `adaflash` command: `demo`, `bench`, `train` and `online`."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .modeling import AdaFlashDrafter
from .utils import read_jsonl

DEMO_INSTALL = "pip install ./demo"  # run in a clone of the repository; `make install` does it too
GENERIC_PROMPTS = {
    "chat": [
        "Explain in a few sentences why the sky is blue.",
        "Write a Python function that returns the n-th Fibonacci number.",
        "A farmer has 12 cows and buys 7 more, then sells 5. How many cows does he have?",
    ]
}


def _add_model_args(parser):
    parser.add_argument("--target", help="target model id or path (default: the demo's, see --world)")
    parser.add_argument("--drafter", help="AdaFlash/DFlash drafter id or path (default: the demo's, see --world)")
    parser.add_argument("--tokenizer", help="tokenizer id or path (default: the target's)")
    parser.add_argument(
        "--world",
        choices=["smollm2", "toy"],
        default="smollm2",
        help="the demo's target without --target: smollm2 (SmolLM2-135M-Instruct with the shipped drafter) or toy "
        "(the first round's 8M-parameter world)",
    )
    parser.add_argument("--dtype", default="float32", help="float32 (exact), bfloat16 or float16")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 128; 64 with --quick)")


def _cuda() -> bool:
    return torch.cuda.is_available()


def demo_package(verb: str, module: str):
    """Imports ``adaflash_demo.<module>``: the demo world and benchmark ship in the separate ``adaflash-demo``
    distribution, so the library installs without their weights and data."""
    try:
        return importlib.import_module(f"adaflash_demo.{module}")
    except ModuleNotFoundError as error:
        if error.name not in ("adaflash_demo", f"adaflash_demo.{module}"):
            raise
        sys.exit(
            f"`adaflash {verb}` needs the demo distribution `adaflash-demo`, which is not installed: run "
            f"`{DEMO_INSTALL}` in a clone of the adaflash-hf repository (or `make install`)"
            + ("." if verb == "bench" else ", or pass --target and --drafter.")
        )


def load_models(args):
    """Target, tokenizer, drafter, optional AR draft model and prompts (chat-rendered text by domain), from the
    demo (``--world smollm2``: the real target, the default; ``--world toy``: the first round's toy world) or from
    --target/--drafter."""
    dtype = getattr(torch, args.dtype)
    ar_draft = None
    if args.target is None and args.world == "smollm2":
        real, demo_module = demo_package(args.command, "smollm2"), demo_package(args.command, "demo")
        try:
            target, tokenizer = real.load_target(dtype=dtype)
            drafter_path = args.drafter or demo_module.DRAFTER_DIR / "drafter"
            prompts = demo_module.shipped_prompts(getattr(args, "prompts_per_domain", None) or 10_000)
        except FileNotFoundError as error:
            sys.exit(f"{error} Or pass --target and --drafter.")
        target = target.to(args.device)
        prompts = demo_module.chat_texts(tokenizer, prompts)
        print(f"target: {real.TARGET_NAME}\ndrafter: {drafter_path}", file=sys.stderr)
    else:
        if args.target is None:
            world = demo_package(args.command, "world")
            try:
                target_path, tokenizer_path = world.world_artifact("target"), world.world_artifact("tokenizer")
                drafter_path = args.drafter or world.world_artifact("drafter")
                prompts = world.prompts_by_domain()
            except FileNotFoundError as error:
                sys.exit(f"{error} Or pass --target and --drafter.")
            tokenizer_path = args.tokenizer or tokenizer_path
            if args.command == "bench":
                ar_draft = world.load_world_model("ar_draft", dtype).to(args.device)
        else:
            if args.drafter is None:
                sys.exit("--target needs --drafter (an AdaFlash or z-lab DFlash drafter for that target)")
            target_path, drafter_path, tokenizer_path = args.target, args.drafter, args.tokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or target_path))
        tokenizer.padding_side = "left"
        target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype).to(args.device).eval()
        if args.target is not None:
            prompts = _chat_prompts(tokenizer)
    drafter = AdaFlashDrafter.from_pretrained(str(drafter_path), dtype=dtype).to(args.device).eval()
    if args.command in ("demo", "bench") and args.prompts:  # `online --prompts` is a stream, read by online()
        demo_module = demo_package(args.command, "demo")
        try:
            prompts = demo_module.chat_texts(tokenizer, demo_module.read_prompt_file(args.prompts))
        except (OSError, demo_module.PromptFileError) as error:
            sys.exit(str(error))
    return target, tokenizer, drafter, ar_draft, prompts


def _chat_prompts(tokenizer) -> dict[str, list[str]]:
    return {domain: _as_requests(tokenizer, prompts) for domain, prompts in GENERIC_PROMPTS.items()}


# ---------------------------------------------------------------------------------------------- demo


def demo(args) -> int:
    """Plain generate() against AdaFlash (``--method``, the planner by default), prompt by prompt at batch 1: one
    answer per domain, then per domain whether every output is identical, the acceptance length and both speeds."""
    harness, demo_module = demo_package("demo", "bench.harness"), demo_package("demo", "demo")
    method = args.method or demo_module.DEMO_METHOD
    target, tokenizer, drafter, _, prompts = load_models(args)
    print(f"method: {method} against plain generate()", file=sys.stderr)
    chosen = {domain: texts[: args.prompts_per_domain] for domain, texts in prompts.items()}
    samples = {}  # the last AdaFlash answer per domain, shown as an example

    def keep_sample(domain, ran, rows):
        if ran == method:
            samples[domain] = rows[-1]

    with tqdm(total=sum(map(len, chosen.values())), desc="demo", unit="prompt", file=sys.stderr) as progress:
        records = harness.run_benchmark(
            target,
            tokenizer,
            chosen,
            drafter=drafter,
            methods=("plain", method),
            max_new_tokens=args.max_new_tokens or 128,
            progress=progress,
            on_output=keep_sample,
        )
    for domain, texts in chosen.items():
        answer = tokenizer.decode(samples[domain], skip_special_tokens=True)
        print(f"\n[{domain}] ...{texts[-1][-200:]!s}\n  -> {answer[:300]!s}")
    summary = demo_module.demo_records(records, {domain: len(texts) for domain, texts in chosen.items()}, method)
    print("\n" + demo_module.markdown(summary))
    speedups = [r.speedup for r in summary]
    print(
        f"\nmean speedup {sum(speedups) / len(speedups):.2f}x ({args.dtype}, {target.device}, batch 1, greedy); "
        f"outputs identical to plain generate(): {sum(r.identical for r in summary)}/{sum(r.n for r in summary)}"
    )
    if args.json:
        Path(args.json).write_text("".join(json.dumps(asdict(r)) + "\n" for r in summary))
    return 0


# ---------------------------------------------------------------------------------------------- bench


def bench(args) -> int:
    """All methods side by side; writes JSON records, a markdown table and PNG plots."""
    harness, report = demo_package("bench", "bench.harness"), demo_package("bench", "bench.report")
    target, tokenizer, drafter, ar_draft, prompts = load_models(args)
    quick = {"batch_sizes": "1,8", "prompts_per_domain": 8, "max_new_tokens": 64}
    full = {"batch_sizes": "1,8,32", "prompts_per_domain": 16, "max_new_tokens": 128}
    for name, default in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    chosen = {d: texts[: args.prompts_per_domain] for d, texts in prompts.items()}
    steps = sum(len(t) // b for t in chosen.values() for b in batch_sizes) * args.repeats
    with tqdm(total=steps, desc="bench", unit="batch", file=sys.stderr) as progress:
        records = harness.run_benchmark(
            target,
            tokenizer,
            chosen,
            drafter=drafter,
            ar_draft=ar_draft,
            methods=args.methods.split(",") if args.methods else harness.METHODS,
            batch_sizes=batch_sizes,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            progress=progress,
        )
    table = report.markdown_table(records) + "\n\n" + report.summary_tables(records)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(harness.records_as_dicts(records), indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        for path in report.plot_records(records, args.plots):
            print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------------- online


def _stream(args) -> tuple[list[str], list[str | None]]:
    """Prompts and domain tags of the simulated stream: a JSONL file, or the demo world's stream files
    (``--domain all`` interleaves every domain's stream)."""
    if args.prompts:
        rows = read_jsonl(args.prompts)
        missing = [i for i, row in enumerate(rows) if "prompt" not in row]
        if missing:
            sys.exit(f"{args.prompts}: line {missing[0] + 1} has no `prompt` field (rows: prompt, optional domain)")
    elif args.target is None and args.world == "smollm2":
        try:
            rows = demo_package("online", "demo").stream_prompts(args.domain)
        except (ValueError, FileNotFoundError) as error:
            sys.exit(str(error))
    else:
        world = demo_package("online", "world")
        names = [*world.DOMAINS, world.UNSEEN_DOMAIN] if args.domain == "all" else [args.domain]
        streams = [world.load_stream(name) for name in names]
        rows = [row for group in zip(*streams) for row in group]  # round-robin: a mixed-domain stream
    rows = rows[: args.num_requests]
    return [row["prompt"] for row in rows], [row.get("domain") for row in rows]


def _as_requests(tokenizer, texts: list[str]) -> list[str]:
    """Stream prompts as the target reads them: through its chat template when it has one (the real target; a
    --target with a template), as they are otherwise (the toy world's plain-text streams)."""
    if tokenizer.chat_template is None:
        return texts
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        for t in texts
    ]


def online(args) -> int:
    """Serves a prompt stream through an `OnlineAdapter` (adapted, and with --compare also not adapted), then
    prints acceptance per drafter version and writes metrics, a summary and a plot."""
    # online serving trains with TRL, which only this verb (and `train`) needs to import
    from .online import OnlineConfig, online_summary, pair_with_baseline, plot_acceptance, serve_stream
    from .online.metrics import pyplot
    from .training import OPDConfig

    if args.plot:
        pyplot()  # fail before serving the stream, not after, when the optional matplotlib is missing
    root = Path(args.swap_dir)
    if root.exists() and any(root.iterdir()) and not args.resume:
        sys.exit(
            f"{root} is not empty: pass --resume to continue its buffer and versions, or choose another --swap-dir"
        )
    target, tokenizer, drafter, _, _ = load_models(args)
    texts, domains = _stream(args)
    texts = _as_requests(tokenizer, texts)
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
            adapter = serve_stream(
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
        runs[label] = adapter.metrics.rows()
        print(f"\n{label}: {json.dumps(adapter.status)}")
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
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        print(f"wrote {plot_acceptance(runs, args.plot, title=args.domain if not args.prompts else '')}")
    return 0


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ---------------------------------------------------------------------------------------------- entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash", description="AdaFlash speculative decoding for transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    demo_parser = commands.add_parser(
        "demo", help="plain generate() vs AdaFlash, on the demo world (pip install ./demo) or --target/--drafter"
    )
    _add_model_args(demo_parser)
    demo_parser.add_argument("--prompts-per-domain", type=int, default=4)
    demo_parser.add_argument(
        "--prompts", help="JSONL of your own prompts: one object per line, `prompt` (plain text) and `domain`"
    )
    demo_parser.add_argument("--json", help="write one JSON record per domain here")
    demo_parser.add_argument(
        "--method",
        choices=["adaflash_planned", "adaflash_adaptive", "adaflash_fixed", "adaflash_confidence", "adaflash_tree"],
        help="the AdaFlash length policy shown against plain generate() (default: adaflash_planned)",
    )
    demo_parser.set_defaults(func=demo)

    bench_parser = commands.add_parser("bench", help="all methods side by side (needs: pip install ./demo)")
    _add_model_args(bench_parser)
    bench_parser.add_argument("--methods", help="comma-separated subset of the methods")
    bench_parser.add_argument("--batch-sizes", help="comma-separated (default 1,8,32; 1,8 with --quick)")
    bench_parser.add_argument("--prompts-per-domain", type=int, help="default 32; 8 with --quick")
    bench_parser.add_argument("--repeats", type=int, default=1)
    bench_parser.add_argument(
        "--prompts", help="JSONL of your own prompts (as for demo); batches are formed per `domain`"
    )
    bench_parser.add_argument(
        "--quick", action="store_true", help="reduced defaults: batch 1 and 8, 8 prompts, 64 tokens"
    )
    bench_parser.add_argument("--json", help="write the records here")
    bench_parser.add_argument("--markdown", help="write the table here")
    bench_parser.add_argument("--plots", help="write PNG plots into this folder")
    bench_parser.set_defaults(func=bench)

    # Listed here for `adaflash --help` only: `main` hands every argument after `train` to TRL's parser.
    commands.add_parser(
        "train",
        add_help=False,
        help="OPD training from a YAML recipe (trainers/*.yaml), with field=value overrides; --help lists the fields",
    )

    online_parser = commands.add_parser(
        "online", help="serve a prompt stream with online adaptation (hot-swapped drafter versions)"
    )
    _add_model_args(online_parser)
    source = online_parser.add_mutually_exclusive_group()
    source.add_argument("--prompts", help="JSONL stream: one request per line, `prompt` and optional `domain`")
    source.add_argument(
        "--domain",
        default="changelog",
        help="the world's stream: changelog (unseen in training, default), a trained domain (smollm2: code, docs, "
        "shell, math, their held-out prompts; toy: code, prose, man, math), or all (mixed)",
    )
    online_parser.add_argument("--num-requests", type=int, default=256)
    online_parser.add_argument("--serve-batch-size", type=int, default=1, help="prompts per generate() call")
    online_parser.add_argument("--mode", default="drafter", choices=["drafter", "domain_adapters"])
    online_parser.add_argument("--swap-dir", default="runs/online", help="buffer, versions and metrics.jsonl")
    online_parser.add_argument("--resume", action="store_true", help="continue the buffer and versions in --swap-dir")
    # Defaults suit the demo world's short responses; the reference (8B, 2k-token responses) uses 128 samples per
    # round, 2 epochs, lr 3e-4 and 512 anchors.
    online_parser.add_argument("--train-threshold", type=int, default=32, help="samples per training round")
    online_parser.add_argument("--buffer-epochs", type=int, default=4, help="passes over a round's samples")
    online_parser.add_argument("--train-batch-size", type=int, default=8)
    online_parser.add_argument("--learning-rate", type=float, default=1e-3)
    online_parser.add_argument("--num-anchors", type=int, default=16, help="blocks per sequence (512 for 2k tokens)")
    # Small rounds can retrain the length head into predicting no drafts at all (BENCHMARKS.md, online adaptation on
    # the real target), after which the adaptive policy stops drafting; keep it as shipped, or train it more slowly.
    online_parser.add_argument(
        "--train-length-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="retrain the drafter's length head in each round (--no-train-length-head keeps it as it is)",
    )
    online_parser.add_argument(
        "--length-head-learning-rate", type=float, help="the length head's rate in each round (default: OPDConfig's)"
    )
    online_parser.add_argument("--seed", type=int, default=0)
    online_parser.add_argument(
        "--background", action="store_true", help="train in a background thread (default: rounds run between requests)"
    )
    online_parser.add_argument("--compare", action="store_true", help="also serve the stream without adaptation")
    online_parser.add_argument("--json", help="write the per-version and per-domain summary here")
    online_parser.add_argument("--plot", help="write the acceptance-vs-version PNG here")
    online_parser.set_defaults(func=online)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        # training imports TRL's trainers, so only `adaflash train` pays for it
        from .training.cli import train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
