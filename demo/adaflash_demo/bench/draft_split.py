"""What a draft costs inside the loop, split: the drafter's forward and its projection by the draft head, by the number
of positions projected.

With a length head, the planner chooses each step's width from the head's prediction before the drafts are projected,
and only the drafts it verifies are (`VerificationPlanner.projected`); a float32 head runs its product in the kernel
measured fastest for that many positions (`draft_head.py`). This times, around the loop's own calls of one planned
``generate()`` per prompt (the real target, float32 greedy, batch 1), the drafter's forward
(`AdaFlashCandidateGenerator._forward`), the drafts' making (`_drafts`: the projection, the logits processors, the
choice) and the head's product alone (`DraftHead.__call__`), and prints their medians per number of projected
positions, with how many drafts projected that many (probes project the whole block):

    ADAFLASH_HF_PROFILE_DIR=off OMP_NUM_THREADS=1 python -m adaflash_demo.bench.draft_split --domains code

``--whole-block`` projects every draft in the head's ``linear`` product, as before BENCHMARKS.md section 35.
``--head-trials`` also prints each timed trial of the head's options (float32 kernels, the bfloat16 copy) per number
of projected positions, and what was kept (with an empty ``ADAFLASH_HF_PROFILE_DIR``: a profile holds decided
choices, which are not timed again).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

from transformers import GenerationConfig

from adaflash_hf.chat import render_prompt
from adaflash_hf.generation.candidate_generator import AdaFlashCandidateGenerator
from adaflash_hf.generation.draft_head import DraftHead
from adaflash_hf.generation.planner import VerificationPlanner
from adaflash_hf.generation.profile import profile_for

from .ab import load_for_ab


def _timed(owner, name: str, into: list, positions: list | None = None) -> None:
    """Wraps ``owner.name`` to append each call's seconds to ``into`` (and its hidden states' positions)."""
    real = getattr(owner, name)

    def wrapped(self, *args, **kwargs):
        start = time.perf_counter()
        out = real(self, *args, **kwargs)
        into.append(time.perf_counter() - start)
        if positions is not None:
            positions.append(args[0].shape[1])
        return out

    setattr(owner, name, wrapped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default="code", help="comma-separated shipped domains")
    parser.add_argument("--prompts-per-domain", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--whole-block", action="store_true", help="every draft projected, in linear")
    parser.add_argument("--head-trials", action="store_true", help="print the head's timed options")
    args = parser.parse_args(argv)
    target, tokenizer, drafter, prompts = load_for_ab(parser, args)
    choice = profile_for(target, drafter).head_kernels
    trials = defaultdict(list)  # (positions key, option) -> seconds of each timed trial
    record = choice.record

    def recorded(key, option, seconds):
        trials[(key[1], option)].append(seconds)
        record(key, option, seconds)

    choice.record = recorded
    if args.whole_block:
        VerificationPlanner.projected = lambda self, rows, length_prediction, max_drafts: max_drafts
        choice_key = DraftHead._choice_key  # the dtype still measured, the float32 product never rerouted
        DraftHead._choice_key = lambda self, positions: (*choice_key(self, positions)[:3], False)
    forward, drafts, head, positions = [], [], [], []
    _timed(AdaFlashCandidateGenerator, "_forward", forward)
    _timed(AdaFlashCandidateGenerator, "_drafts", drafts)
    _timed(DraftHead, "__call__", head, positions)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, adaflash_length_policy="planned")
    for texts in prompts.values():
        for text in texts:
            ids = tokenizer(render_prompt(tokenizer, text), return_tensors="pt")
            target.generate(**ids, generation_config=config, assistant_model=drafter)
    by_positions = defaultdict(list)
    for n, timings in zip(positions, zip(forward, drafts, head)):
        by_positions[n].append(timings)
    print("| positions projected | drafts | drafter forward ms | drafts made ms | head's product ms |")
    print("|---|---|---|---|---|")
    for n in sorted(by_positions):
        rows = by_positions[n]
        medians = [1e3 * statistics.median(t[i] for t in rows) for i in range(3)]
        print(f"| {n} | {len(rows)} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")
    if args.head_trials:
        kept = {key[1]: option for key, option in choice.choices.items()}
        print("\n| positions (key) | option | trials ms | kept |")
        print("|---|---|---|---|")
        for (n, option), seconds in sorted(trials.items()):
            timed = ", ".join(f"{1e3 * s:.2f}" for s in seconds)
            print(f"| {n} | {option} | {timed} | {'yes' if kept.get(n) == option else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
