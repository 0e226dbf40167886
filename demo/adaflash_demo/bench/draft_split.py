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
    args = parser.parse_args(argv)
    target, tokenizer, drafter, prompts = load_for_ab(parser, args)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
