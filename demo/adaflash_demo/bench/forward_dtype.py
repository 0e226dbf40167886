"""What the recipe's features stage pays per token on this machine, per dtype of the target.

The features stage (`adaflash_demo.recipe.stage_features`) runs the target once over every training sequence
(prompt and answer, up to ``max_length`` tokens) and stores the hidden states the drafter reads. Its cost is the
target's forward over long sequences, which is matrix products at full width: on a CPU with AVX-512 BF16 or AMX,
bfloat16 runs them natively and beats float32; on an AVX2-only core bfloat16 is converted to float32 around every
product and is slower (the recipe's ``feature_dtype: auto`` takes float32 there).

    python -m adaflash_demo.bench.forward_dtype --dtypes float32,bfloat16 --batch-size 8 --length 128

prints the machine and, per dtype, the milliseconds a sequence token costs (the median of ``--repeats`` timed
forwards after a warm-up), and the hours the chat recipe's 2.5 million feature tokens would take on one core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaflash_hf.machine import machine_info, machine_summary
from adaflash_hf.training.features import target_features

# sequence tokens the chat recipe stores features for (5,112 answered prompts cut to max_length 768: BENCHMARKS.md §22)
CHAT_RECIPE_TOKENS = 2_504_744


def per_token_ms(target, layer_ids, batch_size: int, length: int, repeats: int, seed: int = 0) -> float:
    """Median milliseconds per sequence token of `target_features` over ``[batch_size, length]`` random ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (batch_size, length), generator=generator)
    mask = torch.ones_like(ids)
    target_features(target, ids, mask, layer_ids)  # warm-up: kernels chosen, buffers allocated
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target_features(target, ids, mask, layer_ids)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times) / ids.numel()


def measure(load_target, dtypes, layer_ids, batch_size: int, length: int, repeats: int) -> dict[str, float]:
    """``{dtype: ms per token}``; ``load_target(dtype)`` returns the target in that dtype."""
    return {
        name: per_token_ms(load_target(getattr(torch, name)), layer_ids, batch_size, length, repeats)
        for name in dtypes
    }


def main(argv=None) -> None:
    from ..smollm2 import load_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", default="1,10,19,27", help="target layers tapped (the recipe's)")
    args = parser.parse_args(argv)
    print(f"machine: {machine_summary(machine_info())}")
    results = measure(
        lambda dtype: load_target(dtype=dtype)[0],
        args.dtypes.split(","),
        [int(i) for i in args.layers.split(",")],
        args.batch_size,
        args.length,
        args.repeats,
    )
    for name, ms in results.items():
        hours = ms * CHAT_RECIPE_TOKENS / 3.6e6
        print(f"{name}: {ms:.2f} ms a token; the chat recipe's features: {hours:.1f} h of this many threads")


if __name__ == "__main__":
    main()
