"""What the planner costs when drafting cannot pay: the real target with a drafter that never agrees with it.

A randomly initialised drafter of the shipped drafter's shape accepts nothing, so every step the planner does not
take plainly is a loss. Measurements on the shipped held-out prompts, float32 greedy, ``--batch-size`` prompts a call
(1 by default; pooled across domains, left-padded):

* ``--count``: what the loop spends, counted, not timed: tokens verified beyond the anchor, drafter forwards, and
  their share of the time priced with the pair's measured costs (the runtime profile's draft and plain-step costs);
* ``--time``: plain ``generate()`` and the planner interleaved prompt by prompt (order alternating), every prompt
  generating exactly ``--max-new-tokens``: the ratio of their times per token, with its spread;
* ``--overhead``: where the time goes, plain ``generate()`` and the planner interleaved, every call generating exactly
  ``--max-new-tokens``: the prefill apart, then per decoding step the target's forward (timed by hooks), the
  drafter's drafts (the loop's own step records) and the rest, the decoding loop's own work. The forwards dominate a
  step and carry most of the noise of a shared machine; the loop's own share is what the planner's plain steps cost
  over transformers' ``_sample`` steps, measured apart from it.

    python -m adaflash_demo.bench.never_agreeing --count --time --overhead --prompts-per-domain 4

* ``--between-forwards``: plain ``generate()`` and the planner interleaved, greedy with no logits processor: the
  median time between two decoding forwards of the target, each loop's own work per step (`between_forwards`).

``--save-drafter FOLDER`` only saves the never-agreeing drafter, for the side-by-side benchmark
(``adaflash-demo bench --drafter FOLDER``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.chat import render_prompt
from adaflash_hf.generation.profile import profile_for
from adaflash_hf.machine import machine_info, machine_summary

from .. import demo as demo_data
from ..cli import chosen_prompts, load_demo_models
from .harness import ForwardCounter


def random_drafter(folder: str, seed: int = 1) -> str:
    """Saves a randomly initialised drafter of the shipped drafter's shape in ``folder``; returns the folder."""
    shipped = AdaFlashDrafter.from_pretrained(str(demo_data.drafter_path(None)))
    torch.manual_seed(seed)
    AdaFlashDrafter(shipped.config).save_pretrained(folder)
    return folder


def count(target, tokenizer, drafter, inputs, max_new_tokens: int) -> dict:
    forwards = []
    hook = drafter.register_forward_hook(lambda *_: forwards.append(1))
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, adaflash_length_policy="planned")
    with adaflash_hf.record_stats() as stats:
        for ids in inputs:
            target.generate(**ids, generation_config=config, assistant_model=drafter)
    hook.remove()
    steps = [step for call in stats.calls for step in call.steps]
    table = profile_for(target, drafter).cost_table(target.device, target.dtype)
    plain, probe = table.cost(1, 1), table.probe(1)  # a never-agreeing drafter's forwards are probes
    return {
        "prompts": len(inputs),
        "steps": len(steps),
        "verified_beyond_anchor": sum(step.verify_width - 1 for step in steps),
        "drafter_forwards": len(forwards),
        "plain_step_s": plain,
        "probe_s": probe,
        "drafting_share": len(forwards) * probe / (len(steps) * plain) if plain and probe else None,
    }


def timed(target, drafter, inputs, max_new_tokens: int, repeats: int) -> dict:
    fixed = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    plain, ours = GenerationConfig(**fixed), GenerationConfig(**fixed, adaflash_length_policy="planned")

    def seconds(ids, kind) -> float:
        start = time.perf_counter()
        if kind == "plain":
            target.generate(**ids, generation_config=plain)
        else:
            target.generate(**ids, generation_config=ours, assistant_model=drafter)
        return time.perf_counter() - start

    for ids in inputs[:2]:  # warm both paths (the pair's dtype and cost measurements, allocator)
        seconds(ids, "ours"), seconds(ids, "plain")
    ratios = []
    for repeat in range(repeats):
        for ids in inputs:
            order = ("plain", "ours") if repeat % 2 == 0 else ("ours", "plain")
            took = {kind: seconds(ids, kind) for kind in order}
            ratios.append(took["ours"] / took["plain"])
    mean, spread = statistics.mean(ratios), statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    half_width = 1.96 * spread / len(ratios) ** 0.5
    return {"calls": len(ratios), "ratio_mean": mean, "ratio_sd": spread, "ratio_95": half_width}


def _interleaved(target, drafter, inputs, configs: dict, repeats: int):
    """Warms plain ``generate()`` and the planner on the first two inputs, then yields ``(kind, generate)`` for every
    input and repeat, the two interleaved call by call (their order alternating with the repeat); ``configs`` holds
    each kind's `GenerationConfig`."""

    def generate(ids, kind):
        extra = {"assistant_model": drafter} if kind == "ours" else {}
        return target.generate(**ids, generation_config=configs[kind], **extra)

    for ids in inputs[:2]:  # warm both paths
        generate(ids, "ours"), generate(ids, "plain")
    for repeat in range(repeats):
        for ids in inputs:
            for kind in ("plain", "ours") if repeat % 2 == 0 else ("ours", "plain"):
                yield kind, functools.partial(generate, ids, kind)


def overhead(target, drafter, inputs, max_new_tokens: int, repeats: int) -> dict:
    """Plain ``generate()`` and the planner, interleaved call by call, every call generating exactly
    ``max_new_tokens``: the prefill apart (every forward from an empty cache, `harness.ForwardCounter`), and per
    decoding step the target's forward (hooks), the drafter's drafts
    (the loop's step records) and the rest, the decoding loop's own work."""
    fixed = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    plain, ours = GenerationConfig(**fixed), GenerationConfig(**fixed, adaflash_length_policy="planned")
    counter = ForwardCounter(target)
    keys = ("calls", "seconds", "prefill_s", "steps", "forward_s", "draft_s")
    totals = {kind: dict.fromkeys(keys, 0.0) for kind in ("plain", "ours")}
    for kind, generate in _interleaved(target, drafter, inputs, {"plain": plain, "ours": ours}, repeats):
        with adaflash_hf.record_stats() as stats, counter.counting():
            start = time.perf_counter()
            generate()
            took = time.perf_counter() - start
        total = totals[kind]
        total["calls"] += 1
        total["seconds"] += took
        total["prefill_s"] += counter.prefill_seconds  # the prompt's forwards, grouped or not
        total["steps"] += len(counter.sizes)
        total["forward_s"] += counter.step_seconds
        total["draft_s"] += sum(step.draft_time_s for step in stats.steps)
    result = {}
    for kind, total in totals.items():
        decoding = total["seconds"] - total["prefill_s"]
        per_step = {key: 1e3 * total[key] / total["steps"] for key in ("forward_s", "draft_s")}
        result[kind] = {
            "calls": int(total["calls"]),
            "prefill_s": round(total["prefill_s"], 3),
            "decoding_s": round(decoding, 3),
            "steps": int(total["steps"]),
            "forward_ms_per_step": round(per_step["forward_s"], 2),
            "draft_ms_per_step": round(per_step["draft_s"], 2),
            "loop_ms_per_step": round(1e3 * decoding / total["steps"] - sum(per_step.values()), 2),
        }
    ratio = {key: totals["ours"][key] / totals["plain"][key] for key in ("seconds", "prefill_s")}
    result["time_ratio"] = {
        "whole_calls": round(ratio["seconds"], 4),
        "prefill": round(ratio["prefill_s"], 4),
        "decoding": round(result["ours"]["decoding_s"] / result["plain"]["decoding_s"], 4),
    }
    return result


def between_forwards(target, drafter, inputs, max_new_tokens: int, repeats: int) -> dict:
    """Plain ``generate()`` and the planner interleaved call by call, greedy with no logits processor (calls end at
    EOS or the budget: ``min_new_tokens`` would add a processor that costs plain decoding about 1 ms a step here):
    the seconds between two consecutive decoding forwards of the target (`harness.ForwardCounter`), what each loop
    does per step besides the target's forward (the loop's median is its plain steps': a never-agreeing drafter's
    probes are a few percent of the steps), and the decoding forwards' own mean."""
    plain = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    ours = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, adaflash_length_policy="planned")
    counter = ForwardCounter(target)
    gaps, forward_s, forwards = {"plain": [], "ours": []}, {"plain": 0.0, "ours": 0.0}, {"plain": 0, "ours": 0}
    for kind, generate in _interleaved(target, drafter, inputs, {"plain": plain, "ours": ours}, repeats):
        with counter.counting():
            generate()
        gaps[kind] += counter.gaps
        forward_s[kind] += counter.step_seconds
        forwards[kind] += len(counter.sizes)
    return {
        kind: {
            "gaps": len(gaps[kind]),
            "between_forwards_ms_median": round(1e3 * statistics.median(gaps[kind]), 3),
            "between_forwards_ms_mean": round(1e3 * statistics.mean(gaps[kind]), 3),
            "forward_ms_mean": round(1e3 * forward_s[kind] / forwards[kind], 2),
        }
        for kind in gaps
    }


def batches(tokenizer, texts: list[str], batch_size: int) -> list[dict]:
    """The prompts through the chat template, ``batch_size`` at a time, left-padded as generate() expects."""
    tokenizer.padding_side = "left"
    rendered = [render_prompt(tokenizer, text) for text in texts]
    return [
        tokenizer(rendered[start : start + batch_size], return_tensors="pt", padding=True)
        for start in range(0, len(rendered) - batch_size + 1, batch_size)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="count what the planner spends")
    parser.add_argument("--time", action="store_true", help="time plain generate() and the planner, interleaved")
    parser.add_argument("--overhead", action="store_true", help="split a token's time: forwards, drafts, the loop")
    parser.add_argument(
        "--between-forwards", action="store_true", help="what each loop does between two forwards of the target"
    )
    parser.add_argument("--save-drafter", metavar="FOLDER", help="save the never-agreeing drafter here and stop")
    parser.add_argument("--prompts-per-domain", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts a call (pooled across domains)")
    args = parser.parse_args(argv)
    if args.save_drafter:
        print(random_drafter(args.save_drafter))
        return 0
    print(f"machine: {machine_summary(machine_info())}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as folder:
        options = SimpleNamespace(
            target=None, drafter=random_drafter(folder), dtype="float32", device="cpu", prompts=None
        )
        options.prompts_per_domain = args.prompts_per_domain
        target, tokenizer, drafter = load_demo_models(options)
        texts = [text for domain in chosen_prompts(options, args.prompts_per_domain).values() for text in domain]
        inputs = batches(tokenizer, texts, args.batch_size)
        if not inputs:
            parser.error(f"--batch-size {args.batch_size}: only {len(texts)} prompts; raise --prompts-per-domain")
        if args.count:
            print(count(target, tokenizer, drafter, inputs, args.max_new_tokens))
        if args.time:
            print(timed(target, drafter, inputs, args.max_new_tokens, args.repeats))
        if args.overhead:
            print(overhead(target, drafter, inputs, args.max_new_tokens, args.repeats))
        if args.between_forwards:
            print(between_forwards(target, drafter, inputs, args.max_new_tokens, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
