"""Step by step, what the planner did on one domain's prompts, beside the head's own policy (issue 24, item 7).

A benchmark says how fast a method was; this says why: for each call, one character per decoding step ("." a plain
step, "p" a probe, a digit the drafts a drafted step accepted) with the verify width of each drafted step under it,
for the planner (``adaflash_length_policy="planned"``) and the head's policy (``"adaptive"``), each with its own copy
of the drafter (its own runtime profile), then what the planner's pair knows once the call is over: drafting's rate
over plain steps', a probe's and a draft's cost, the drafted widths' costs (all in plain steps) and the head's
calibration. Run it in a new process with ``ADAFLASH_HF_PROFILE_DIR=off`` to see what a new user's first calls do:

    ADAFLASH_HF_PROFILE_DIR=off OMP_NUM_THREADS=1 python -m adaflash_demo.bench.step_trace --domains shell

The real target, float32 greedy, batch 1; every output is asserted identical to the head's policy's (both are
lossless, so both equal plain ``generate()``'s). Not a timing: the steps' order and widths are the planner's choices,
which follow the costs this machine measured in this process.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from transformers import GenerationConfig

from adaflash_hf import record_stats
from adaflash_hf.chat import render_prompt
from adaflash_hf.generation.profile import profile_for

from .ab import load_for_ab

POLICIES = ("planned", "adaptive")


def step_line(steps) -> tuple[str, str]:
    """``(kinds, widths)``: one character per step (of a call of one row), and under each drafted step its verify
    width (9 for 9 or more)."""
    kinds = "".join(
        "." if s.kind == "plain" else "p" if s.kind == "probe" else str(min(s.accepted[0], 9)) for s in steps
    )
    widths = "".join(str(min(s.verify_width, 9)) if s.kind == "drafted" else " " for s in steps)
    return kinds, widths


def table_state(table) -> str:
    """What the pair's cost table knows, in plain steps of one row."""
    plain = table.cost(1, 1)
    if plain is None:
        return "nothing measured"

    def steps(seconds):
        return "-" if seconds is None else f"{seconds / plain:.2f}"

    speedup = table.drafting_speedup(1)
    widths = " ".join(f"{w}:{steps(s)}" for (rows, w), s in sorted(table.step_s.items()) if rows == 1 and w > 1)
    return (
        f"rate {'-' if speedup is None else f'{speedup:.2f}'}, probe {steps(table.probe(1))}, "
        f"draft {steps(table.draft(1))}, head scale {table.head_scale:.2f}, widths {widths or '-'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default="shell", help="one shipped domain")
    parser.add_argument("--prompts-per-domain", type=int, default=8, help="its first N shipped held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if "," in args.domains:
        parser.error("--domains: one domain (the pair's state is printed after each call)")
    target, tokenizer, drafter, prompts = load_for_ab(parser, args)
    inputs = [tokenizer(render_prompt(tokenizer, text), return_tensors="pt") for text in prompts[args.domains]]
    copies = {policy: copy.deepcopy(drafter) for policy in POLICIES}
    table = profile_for(target, copies["planned"]).cost_table(target.device, target.dtype)
    for index, ids in enumerate(inputs):
        outputs = {}
        for policy in POLICIES:
            config = GenerationConfig(
                max_new_tokens=args.max_new_tokens, do_sample=False, adaflash_length_policy=policy
            )
            with record_stats() as stats:
                outputs[policy] = target.generate(**ids, generation_config=config, assistant_model=copies[policy])
            kinds, widths = step_line(stats.calls[0].steps)
            name = "planner" if policy == "planned" else "head"
            print(f"{index + 1:2d} {name:8s}{len(kinds):3d} {kinds}\n{'':14s}{widths}")
        print(f"{'':14s}planner's pair after it: {table_state(table)}", flush=True)
        if not torch.equal(outputs["planned"], outputs["adaptive"]):
            raise AssertionError("the planner's output differs from the head's policy's: not lossless")
    return 0


if __name__ == "__main__":
    sys.exit(main())
