"""What the n-gram index costs per decoding step as a row's context grows (`adaflash_hf/generation/ngram.py`).

Each step extends a row's index by the tokens it committed and looks up the continuations of its new suffix. This
times both against a Python rescan of the whole context (the work transformers' prompt lookup does each step, there
with tensor operations), per context
length, on token sequences drawn from a small vocabulary with copied spans (many repeated n-grams: a lookup's worst
case is a suffix that occurred very often). Pure CPU Python; no model.

    python -m adaflash_demo.bench.ngram_cost --lengths 256,1024,4096,16384
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from adaflash_hf.generation.ngram import SuffixIndex
from adaflash_hf.machine import machine_info, machine_summary


def context(length: int, vocab: int, seed: int = 0) -> list[int]:
    """Random tokens with copied spans (a third of the text repeats an earlier span)."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.3:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randint(4, 32)]
        else:
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
    return tokens[:length]


def rescan(tokens: list[int], max_match: int, length: int) -> list[int]:
    """Prompt lookup's scan: the first earlier occurrence of the longest suffix, over the whole context."""
    end = len(tokens)
    for n in range(min(max_match, end - 1), 0, -1):
        suffix = tokens[end - n :]
        for start in range(n, end):
            if tokens[start - n : start] == suffix:
                return tokens[start : start + length]
    return []


def measure(length: int, vocab: int, steps: int, max_match: int, per_step: int) -> dict:
    tokens = context(length + steps * per_step, vocab)
    index = SuffixIndex(max_match, 1, tokens[:length])
    step_s, rescan_s = [], []
    for step in range(steps):
        new = tokens[length + step * per_step : length + (step + 1) * per_step]
        start = time.perf_counter()
        index.extend(new)
        index.lookup(10, 2)
        step_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        rescan(index.tokens, max_match, 10)
        rescan_s.append(time.perf_counter() - start)
    return {
        "context": length,
        "vocab": vocab,
        "index_step_us": 1e6 * statistics.median(step_s),
        "rescan_step_us": 1e6 * statistics.median(rescan_s),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,4096,16384", help="context lengths (tokens)")
    parser.add_argument("--vocab", type=int, default=64, help="token ids drawn from (small: many repeats)")
    parser.add_argument("--steps", type=int, default=200, help="steps timed per length")
    parser.add_argument("--max-match", type=int, default=3)
    parser.add_argument("--tokens-per-step", type=int, default=3, help="tokens committed per step")
    args = parser.parse_args(argv)
    print(machine_summary(machine_info()))
    for length in map(int, args.lengths.split(",")):
        print(json.dumps(measure(length, args.vocab, args.steps, args.max_match, args.tokens_per_step)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
