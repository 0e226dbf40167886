"""What the planner costs when drafting cannot pay: the real target with a drafter that never agrees with it.

A randomly initialised drafter of the shipped drafter's shape accepts nothing, so every step the planner does not
take plainly is a loss. Two measurements on the shipped held-out prompts, float32 greedy, batch 1:

* ``--count``: what the loop spends, counted, not timed: tokens verified beyond the anchor, drafter forwards, and
  their share of the time priced with the pair's measured costs (the runtime profile's draft and plain-step costs);
* ``--time``: plain ``generate()`` and the planner interleaved prompt by prompt (order alternating), every prompt
  generating exactly ``--max-new-tokens``: the ratio of their times per token, with its spread.

    python -m adaflash_demo.bench.never_agreeing --count --time --prompts-per-domain 4
"""

from __future__ import annotations

import argparse
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


def random_drafter(folder: str, seed: int = 1) -> str:
    """Saves a randomly initialised drafter of the shipped drafter's shape in ``folder``; returns the folder."""
    shipped = AdaFlashDrafter.from_pretrained(str(demo_data.DRAFTER_DIR / "drafter"))
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
    plain, draft = table.cost(1, 1), table.draft_s.get(1)
    return {
        "prompts": len(inputs),
        "steps": len(steps),
        "verified_beyond_anchor": sum(step.verify_width - 1 for step in steps),
        "drafter_forwards": len(forwards),
        "plain_step_s": plain,
        "draft_s": draft,
        "drafting_share": len(forwards) * draft / (len(steps) * plain) if plain and draft else None,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="count what the planner spends")
    parser.add_argument("--time", action="store_true", help="time plain generate() and the planner, interleaved")
    parser.add_argument("--prompts-per-domain", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"machine: {machine_summary(machine_info())}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as folder:
        options = SimpleNamespace(
            target=None, drafter=random_drafter(folder), dtype="float32", device="cpu", prompts=None
        )
        options.prompts_per_domain = args.prompts_per_domain
        target, tokenizer, drafter = load_demo_models(options)
        texts = [text for domain in chosen_prompts(options, args.prompts_per_domain).values() for text in domain]
        inputs = [tokenizer(render_prompt(tokenizer, text), return_tensors="pt") for text in texts]
        if args.count:
            print(count(target, tokenizer, drafter, inputs, args.max_new_tokens))
        if args.time:
            print(timed(target, drafter, inputs, args.max_new_tokens, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
