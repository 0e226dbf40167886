"""What a verification forward costs with each linear kernel the installed torch offers, beside the roofline.

A plain decoding step at batch 1 streams every weight once for one token: it is bound by memory bandwidth. A
forward of ``k`` tokens streams the same weights and does ``k`` times the arithmetic, so until the arithmetic
catches up with the memory traffic it should cost about one plain step. This module times, for each batch size and
token count, one target forward of ``k`` new tokens per row over a cached context, with the target's linear layers
computed by each kernel of `adaflash_hf.generation.verify_layout.KERNELS` (the model's own ``linear``, the transposed
product, oneDNN's inner product on the weights as they are), interleaved (each repeat runs every kernel, in an order
that rotates), as a median relative to a plain step (``k = 1``, ``linear``) timed in the same rounds. Beside them it
prints the roofline: ``max(1, flops(k) / peak / plain step)`` plain steps, the arithmetic at the GEMM peak this
core reaches on a large product (timed here too), the memory side being the plain step itself.

    python -m adaflash_demo.bench.kernels --batch-sizes 1,8 --lengths 2,3,4,8,16 [--json kernels.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from adaflash_hf.generation.verify_layout import KERNELS
from adaflash_hf.machine import machine_info, machine_summary
from adaflash_hf.utils import write_json_atomic


def gemm_peak_gflops(size: int = 1024, repeats: int = 5) -> float:
    """float32 GFLOP/s of one large square product on this thread (the compute roof)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


def linear_params(model) -> int:
    """Parameters of the linear layers a token passes through (a tied LM head counted once)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            total += module.weight.numel()
    return total


@torch.no_grad()
def measure(target, batch: int, lengths, context: int, repeats: int, kernels=tuple(KERNELS)) -> dict:
    """``{"plain_ms": ..., k: {kernel: forward ms / plain step}}`` for one batch size, interleaved rounds."""
    vocab = target.config.vocab_size
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(100, vocab - 100, (batch, context)), cache=cache, use_cache=True)
    cases = [(1, "linear")] + [(k, kernel) for k in lengths for kernel in kernels]
    times = {case: [] for case in cases}
    for round_ in range(repeats + 1):  # round 0 warms every case up
        shift = round_ % len(cases)
        for k, kernel in cases[shift:] + cases[:shift]:
            ids = torch.randint(100, vocab - 100, (batch, k))
            positions = torch.arange(context, context + k).expand(batch, k)
            start = time.perf_counter()
            with KERNELS[kernel]():
                target(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=k)
            if round_:
                times[(k, kernel)].append(time.perf_counter() - start)
            cache.crop(-k)  # transformers 5.24: crop takes the (negative) number of tokens to drop
    plain = statistics.median(times[(1, "linear")])
    result = {"plain_ms": 1e3 * plain}
    for k in lengths:
        result[k] = {kernel: statistics.median(times[(k, kernel)]) / plain for kernel in kernels}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--lengths", default="2,3,4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the machine and the table here")
    args = parser.parse_args(argv)
    from ..smollm2 import TARGET_NAME, load_target

    target, _ = load_target(dtype=torch.float32)
    machine = machine_info()
    peak = gemm_peak_gflops()
    params = linear_params(target)
    lengths = [int(k) for k in args.lengths.split(",")]
    print(f"machine: {machine_summary(machine)}\ntarget: {TARGET_NAME}, {params / 1e6:.0f}M linear parameters")
    print(f"float32 GEMM peak of this thread (1024^3 product): {peak:.0f} GFLOP/s", file=sys.stderr)
    kernels = tuple(KERNELS)
    lines = [
        "| batch | tokens per row | plain step ms | " + " | ".join(kernels) + " | roofline |",
        "|---" * (4 + len(kernels)) + "|",
    ]
    results = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        result = measure(target, batch, lengths, args.context, args.repeats, kernels)
        results[batch] = result
        plain_s = result["plain_ms"] / 1e3
        for k in lengths:
            roof = max(1.0, 2 * params * batch * k / (peak * 1e9) / plain_s)
            cells = " | ".join(f"{result[k][kernel]:.2f}" for kernel in kernels)
            lines.append(f"| {batch} | {k} | {result['plain_ms']:.1f} | {cells} | {roof:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    print(f"\nforward cost in plain steps (float32 GEMM peak {peak:.0f} GFLOP/s):\n" + "\n".join(lines))
    if args.json:
        payload = {"machine": machine, "gemm_peak_gflops": peak, "linear_params": params, "results": results}
        write_json_atomic(args.json, payload, indent=2)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
