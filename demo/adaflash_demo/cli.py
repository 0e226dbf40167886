"""`adaflash-demo`: the demo distribution's own command.

* ``demo``: plain ``generate()`` against AdaFlash, prompt by prompt at batch 1, on the real target (SmolLM2-135M-
  Instruct with the shipped drafter) or on ``--target``/``--drafter``;
* ``bench``: every method side by side, at several batch sizes (the domains with fewer prompts than a batch size
  pooled for it);
* ``recipe``: the resumable recipe that builds, evaluates and ships the SmolLM2 drafter (a YAML ``--config`` and
  ``field=value`` overrides, TRL's parser);
* ``online``: online adaptation on the real target's shipped streams (``--domain``), or on a prompt file.

``demo`` and ``bench`` print the machine they ran on (`adaflash_hf.machine`) above their tables and write it into
their ``--json`` (and ``bench`` into its ``--markdown``).

The library's own command, ``adaflash``, keeps ``train`` and ``online --target --drafter --prompts``; the model
loading, stream reading and online serving here are the library's (`adaflash_hf.cli`), not copies.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from adaflash_hf.chat import render_prompt
from adaflash_hf.cli import (
    CommandError,
    add_model_arguments,
    add_online_arguments,
    check_online_arguments,
    command_parser,
    load_models,
    read_stream,
    run_command,
    run_online,
    torch_dtype,
)
from adaflash_hf.machine import machine_info, machine_summary
from adaflash_hf.utils import write_jsonl, write_text_atomic

from . import demo as demo_data
from .instructions import DOMAINS

ADAFLASH_METHODS = (
    "adaflash_planned",
    "adaflash_adaptive",
    "adaflash_fixed",
    "adaflash_confidence",
    "adaflash_tree",
    "adaflash_hybrid",
    "adaflash_lookup",
)


def load_demo_models(args) -> tuple:
    """``(target, tokenizer, drafter)``: ``--target``/``--drafter`` when given, else the real target with the
    shipped drafter (or ``--drafter``)."""
    if args.target is not None:
        return load_models(args)
    from adaflash_hf import AdaFlashDrafter

    from .smollm2 import TARGET_NAME, load_target

    dtype = torch_dtype(args.dtype)
    try:
        target, tokenizer = load_target(dtype=dtype)
    except FileNotFoundError as error:
        raise CommandError(f"{error} Or pass --target and --drafter.") from None
    drafter_path = demo_data.drafter_path(args.drafter)
    if not drafter_path.exists() and (args.drafter is None or args.drafter in demo_data.SHIPPED_DRAFTERS):
        raise CommandError(f"{drafter_path} is missing: reinstall the demo distribution (`pip install ./demo`).")
    drafter = AdaFlashDrafter.from_pretrained(str(drafter_path), dtype=dtype).to(args.device).eval()
    print(f"target: {TARGET_NAME}\ndrafter: {drafter_path}", file=sys.stderr)
    return target.to(args.device), tokenizer, drafter


def chosen_prompts(args, default_per_domain: int) -> dict[str, list[str]]:
    """The plain-text prompts to serve, by domain. A ``--prompts`` file is the user's: every prompt in it runs
    unless ``--prompts-per-domain`` is given. Without one, the shipped held-out prompts of the real target
    (``default_per_domain`` of each domain, at most the 16 the recipe measured on), or, for ``--target``, a few
    generic chat prompts."""
    limit = args.prompts_per_domain
    if args.prompts:
        prompts, source = demo_data.read_prompt_file(args.prompts), args.prompts
    elif args.target is None:
        prompts, source = demo_data.shipped_prompts(), "the shipped held-out prompts"
        limit = limit or default_per_domain
    else:
        prompts, source = GENERIC_PROMPTS, "generic chat prompts"
    if limit is not None:
        if limit < 1:
            raise CommandError(f"--prompts-per-domain {limit}: give at least 1")
        prompts = {domain: texts[:limit] for domain, texts in prompts.items()}
    counts = ", ".join(f"{domain} {len(texts)}" for domain, texts in prompts.items())
    print(f"prompts: {sum(map(len, prompts.values()))} from {source} ({counts})", file=sys.stderr)
    return prompts


GENERIC_PROMPTS = {
    "chat": [
        "Explain in a few sentences why the sky is blue.",
        "Write a Python function that returns the n-th Fibonacci number.",
        "A farmer has 12 cows and buys 7 more, then sells 5. How many cows does he have?",
    ]
}


def _rendered(tokenizer, prompts: dict[str, list[str]]) -> dict[str, list[str]]:
    return {domain: [render_prompt(tokenizer, text) for text in texts] for domain, texts in prompts.items()}


# ---------------------------------------------------------------------------------------------- demo


def demo(args) -> int:
    """Plain generate() against AdaFlash (``--method``, by default the planner with n-gram paths), prompt by prompt at
    batch 1: one answer per domain, then per domain whether every output is identical, the acceptance length and both
    speeds."""
    from .bench import harness

    if args.repeats < 1:
        raise CommandError(f"--repeats {args.repeats}: give at least 1")
    method = args.method or demo_data.DEMO_METHOD
    texts = chosen_prompts(args, default_per_domain=4)
    target, tokenizer, drafter = load_demo_models(args)
    chosen = _rendered(tokenizer, texts)
    settings = {k: v for k, v in harness.method_kwargs(method, drafter).items() if k != "assistant_model"}
    shown = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    print(
        f"method: {method} (generate(..., assistant_model=drafter, {shown})) against plain generate()", file=sys.stderr
    )
    samples = {}  # the last AdaFlash answer per domain, shown as an example

    def keep_sample(domain, ran, rows):
        if ran == method:
            samples[domain] = rows[-1]

    total = args.repeats * sum(map(len, chosen.values()))
    with tqdm(total=total, desc="demo", unit="prompt", file=sys.stderr) as progress:
        records = harness.run_benchmark(
            target,
            tokenizer,
            chosen,
            drafter=drafter,
            methods=("plain", method),
            max_new_tokens=args.max_new_tokens or 128,
            repeats=args.repeats,
            progress=progress,
            on_output=keep_sample,
        )
    for domain, prompts in texts.items():
        answer = tokenizer.decode(samples[domain], skip_special_tokens=True)
        print(f"\n[{domain}] ...{prompts[-1][-200:]!s}\n  -> {answer[:300]!s}")
    counts = {domain: args.repeats * len(t) for domain, t in chosen.items()}
    summary = demo_data.demo_records(records, counts, method)
    machine = machine_info()
    print(f"\nmachine: {machine_summary(machine)}\n\n" + demo_data.markdown(summary))
    speedups = [r.speedup for r in summary]
    print(
        f"\nmean speedup {sum(speedups) / len(speedups):.2f}x ({args.dtype}, {target.device}, batch 1, greedy); "
        f"outputs identical to plain generate(): {sum(r.identical for r in summary)}/{sum(r.n for r in summary)}"
    )
    calls = sorted(set(counts.values()))
    span = str(calls[0]) if len(calls) == 1 else f"{calls[0]}-{calls[-1]}"
    print(
        f"each speedup is over {span} calls a domain, interleaved with plain generate(), with its 95% interval (a "
        "paired bootstrap over the calls); runs of the same work differ by a few percent on a shared CPU: serve more "
        "to resolve less (--prompts-per-domain 16, --repeats 2)"
    )
    if args.json:
        write_jsonl(args.json, ({**asdict(r), "machine": machine} for r in summary))
    return 0


# ---------------------------------------------------------------------------------------------- bench


def bench(args) -> int:
    """All methods side by side; writes JSON records, a markdown table and PNG plots."""
    import torch
    from transformers import AutoModelForCausalLM

    from .bench import harness, report

    quick = {"batch_sizes": "1,8", "max_new_tokens": 64}
    full = {"batch_sizes": "1,8,32", "max_new_tokens": 128}
    for name, default in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    texts = chosen_prompts(args, default_per_domain=8 if args.quick else 16)
    try:
        plan = harness.plan_batches(texts, batch_sizes)
    except ValueError as error:
        raise CommandError(str(error)) from None
    for group in plan:
        if group.pooled_from:
            print(group.describe(), file=sys.stderr)
    target, tokenizer, drafter = load_demo_models(args)
    assistant = None
    if args.assistant_model:  # a small autoregressive model of the target's tokenizer, for `hf_assisted`
        assistant = AutoModelForCausalLM.from_pretrained(args.assistant_model, dtype=torch_dtype(args.dtype))
        assistant = assistant.to(torch.device(args.device)).eval()
    chosen = _rendered(tokenizer, texts)
    steps = sum(len(group.batches) for group in plan) * args.repeats
    with tqdm(total=steps, desc="bench", unit="batch", file=sys.stderr) as progress:
        records = harness.run_benchmark(
            target,
            tokenizer,
            chosen,
            drafter=drafter,
            ar_draft=assistant,
            methods=args.methods.split(",") if args.methods else harness.METHODS,
            batch_sizes=batch_sizes,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            progress=progress,
        )
    machine = machine_info()
    table = report.markdown_report(records, machine)
    print(table)
    if args.json:
        report.write_results(args.json, records, machine)
    if args.markdown:
        write_text_atomic(args.markdown, table + "\n")
    if args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        for path in report.plot_records(records, args.plots):
            print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------------- online


def online(args) -> int:
    """Online adaptation on a stream: the real target's shipped stream of ``--domain``, or the ``--prompts`` file."""
    check_online_arguments(args)
    if args.prompts:
        rows, title = read_stream(args.prompts), ""
    elif args.target is not None:
        raise CommandError("--target needs a --prompts stream: the shipped streams are the real target's prompts")
    else:
        try:
            rows, title = demo_data.stream_prompts(args.domain), args.domain
        except (ValueError, FileNotFoundError) as error:
            raise CommandError(str(error)) from None
    target, tokenizer, drafter = load_demo_models(args)
    return run_online(args, target, tokenizer, drafter, rows, title=title)


# ---------------------------------------------------------------------------------------------- entry


def _add_prompt_arguments(parser, default_per_domain: str) -> None:
    parser.add_argument(
        "--prompts",
        help="JSONL of your own prompts: one object per line, `prompt` (plain text, put through the target's chat "
        "template) and optional `domain`; every prompt runs unless --prompts-per-domain is given",
    )
    parser.add_argument(
        "--prompts-per-domain",
        type=int,
        help=f"at most this many prompts per domain (default: every prompt of a --prompts file; {default_per_domain} "
        "of the shipped held-out prompts)",
    )


def build_parser():
    from .recipe import make_parser as make_recipe_parser

    parser, commands = command_parser("adaflash-demo", "The adaflash-hf demo: SmolLM2-135M-Instruct and its drafter")
    models = (
        "; default: SmolLM2-135M-Instruct with the shipped drafter (--drafter smollm2-chat-drafter: the shipped one "
        "distilled from chat requests too)"
    )

    demo_parser = commands.add_parser("demo", help="plain generate() vs AdaFlash, prompt by prompt" + models)
    add_model_arguments(demo_parser, required=False)
    _add_prompt_arguments(demo_parser, "4")
    demo_parser.add_argument(
        "--repeats", type=int, default=1, help="serve every prompt this many times (default 1): narrower intervals"
    )
    demo_parser.add_argument("--json", help="write one JSON record per domain here, each naming the machine")
    demo_parser.add_argument(
        "--method",
        choices=ADAFLASH_METHODS,
        help="the AdaFlash method shown against plain generate() (default: adaflash_hybrid, the planner with the "
        "context's n-gram continuations; adaflash_planned on targets that refuse draft trees: sliding-window, ALiBi)",
    )
    demo_parser.set_defaults(func=demo)

    bench_parser = commands.add_parser("bench", help="every method side by side" + models)
    add_model_arguments(bench_parser, required=False)
    _add_prompt_arguments(bench_parser, "16 (8 with --quick)")
    bench_parser.add_argument("--methods", help="comma-separated subset of the methods (default: all usable)")
    bench_parser.add_argument("--batch-sizes", help="comma-separated (default 1,8,32; 1,8 with --quick)")
    bench_parser.add_argument("--repeats", type=int, default=1)
    bench_parser.add_argument(
        "--assistant-model", help="a small autoregressive model sharing the target's tokenizer, for `hf_assisted`"
    )
    bench_parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced defaults: batch 1 and 8, 8 shipped prompts per domain, 64 tokens (a --prompts file still runs "
        "whole)",
    )
    bench_parser.add_argument("--json", help="write the machine and the records here")
    bench_parser.add_argument("--markdown", help="write the machine and the tables here")
    bench_parser.add_argument("--plots", help="write PNG plots into this folder")
    bench_parser.set_defaults(func=bench)

    make_recipe_parser(commands)

    online_parser = commands.add_parser(
        "online", help="online adaptation on the real target's shipped streams, or a --prompts stream" + models
    )
    add_model_arguments(online_parser, required=False)
    source = online_parser.add_mutually_exclusive_group()
    source.add_argument("--prompts", help="JSONL stream: one request per line, `prompt` and optional `domain`")
    source.add_argument(
        "--domain",
        default="changelog",
        choices=[*DOMAINS, "all"],
        help="the shipped stream: changelog (the domain the drafter never trained on, 256 prompts; the default), a "
        "trained domain's held-out prompts, or all of them interleaved",
    )
    add_online_arguments(online_parser)
    online_parser.set_defaults(func=online)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
