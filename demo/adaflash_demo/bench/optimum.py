"""How fast the planner could be: the best width its own measured step costs and the measured acceptance allow.

The planner picks each step's verify width from measured step costs and estimated acceptance. Whether it picks
well is a question with an answer: at batch 1 and greedy decoding, a step that offers ``w - 1`` drafts accepts
``min(A, w - 1)`` of them, ``A`` being what the whole block would have accepted (acceptance is a prefix), so the
distribution of ``A`` over a domain's steps, measured once with the whole block (`adaflash_fixed`), gives the
tokens any width would commit there. Priced with the step costs the planner measured (the runtime profile a
benchmark run left behind: whole loop steps, the draft included), the best width chosen in advance for the domain is

    rate(w) = E[min(A, w - 1) + 1] / S(w),  w = 1 .. block size  (w = 1: a plain step, S(1) its cost)

and its speedup over plain steps is ``max_w rate(w) * S(1)``. The planner can beat it only by changing width within
the domain (it adapts per row and step); falling short of it by more than noise means its estimates misjudge. This
prints, per domain, that optimum beside the planner's measured speedup from the same run's ``--json``:

    adaflash-demo bench --methods plain,adaflash_fixed,adaflash_planned --batch-sizes 1 --json run.json
    ADAFLASH_HF_PROFILE_DIR=<that run's profile folder> python -m adaflash_demo.bench.optimum --bench-json run.json

Steps the token budget cut short (fewer drafts offered than the block holds) are left out of the distribution:
whether their last draft would have been accepted is unknown. Counting needs no quiet machine: acceptance under
greedy decoding does not depend on timing.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf.chat import render_prompt
from adaflash_hf.generation.profile import profile_for
from adaflash_hf.machine import machine_info, machine_summary

from ..cli import chosen_prompts, load_demo_models
from .report import interval, read_results


def block_acceptance(target, tokenizer, drafter, prompts: list[str], max_new_tokens: int) -> list[int]:
    """``A`` per step of the whole-block method over ``prompts`` (batch 1, greedy), steps offered a full block."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, adaflash_length_policy="fixed")
    full = drafter.config.block_size - 1
    accepted = []
    for text in prompts:
        ids = tokenizer(render_prompt(tokenizer, text), return_tensors="pt").to(target.device)
        with adaflash_hf.record_stats() as stats:
            target.generate(**ids, generation_config=config, assistant_model=drafter)
        accepted += [a for step in stats.steps for a, n in zip(step.accepted, step.candidate_lengths) if n - 1 == full]
    return accepted


def best_width(accepted: list[int], cost, block_size: int) -> tuple[int, float, dict[int, float]]:
    """``(w, speedup over plain steps, speedup per width)`` of the best width for the distribution ``accepted`` of
    ``A``, ``cost(w)`` giving a step's seconds at width ``w``."""
    plain = cost(1)
    speedups = {}
    for width in range(1, block_size + 1):
        tokens = sum(min(a, width - 1) + 1 for a in accepted) / len(accepted) if width > 1 else 1.0
        speedups[width] = tokens / cost(width) * plain
    width = max(speedups, key=speedups.get)
    return width, speedups[width], speedups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-json", required=True, help="the benchmark run's --json (its planner's speedups)")
    parser.add_argument("--drafter", help="the drafter that run used (default: the shipped one)")
    parser.add_argument("--prompts-per-domain", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    machine, records = read_results(args.bench_json)
    planned = {r.domain: r for r in records if r.method == "adaflash_planned" and r.batch_size == 1}
    options = SimpleNamespace(target=None, drafter=args.drafter, dtype="float32", device="cpu", prompts=None)
    options.prompts_per_domain = args.prompts_per_domain
    target, tokenizer, drafter = load_demo_models(options)
    table = profile_for(target, drafter).cost_table(target.device, target.dtype)
    if table.cost(1, 1) is None or table.cost(1, 2) is None:
        raise SystemExit(
            "the runtime profile holds no measured plain and drafted steps at batch 1 for this pair: set "
            "ADAFLASH_HF_PROFILE_DIR to the profile folder of the benchmark run (it must have run adaflash_planned)"
        )
    print(f"machine: {machine_summary(machine_info())}\nbenchmark run's machine: {machine_summary(machine)}")
    block = drafter.config.block_size
    costs = ", ".join(f"{w}: {table.cost(1, w) / table.cost(1, 1):.2f}" for w in range(2, block + 1))
    print(f"step cost over a plain step ({1e3 * table.cost(1, 1):.1f} ms) by width: {costs}")
    lines = [
        "| domain | A mean (steps) | best width | its speedup | planner measured [95%] | planner / best |",
        "|---|---|---|---|---|---|",
    ]
    for domain, prompts in chosen_prompts(options, args.prompts_per_domain).items():
        accepted = block_acceptance(target, tokenizer, drafter, prompts, args.max_new_tokens)
        if not accepted:
            continue
        width, speedup, _ = best_width(accepted, lambda w: table.cost(1, w), block)
        record = planned.get(domain)
        measured = f"{record.speedup:.2f}x {interval(record)}" if record else "-"
        ratio = f"{record.speedup / speedup:.2f}" if record else "-"
        mean = sum(accepted) / len(accepted)
        lines.append(f"| {domain} | {mean:.2f} ({len(accepted)}) | {width} | {speedup:.2f}x | {measured} | {ratio} |")
        print(lines[-1], file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
