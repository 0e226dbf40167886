"""What a verification forward costs with each linear kernel the installed torch offers, beside the roofline.

A plain decoding step at batch 1 streams every weight once for one token: it is bound by memory bandwidth. A
forward of ``k`` tokens streams the same weights and does ``k`` times the arithmetic, so until the arithmetic
catches up with the memory traffic it should cost about one plain step. This module times, for each batch size and
token count, one target forward of ``k`` new tokens per row over a cached context, with the target's linear layers
computed by each kernel of `adaflash_hf.generation.verify_layout.KERNELS` (the model's own ``linear``, the transposed
product, oneDNN's inner product on the weights as they are), interleaved (each repeat runs every kernel, in an order
that rotates), as a median relative to a plain step (``k = 1``, ``linear``) timed in the same rounds. Beside them it
prints the roofline: ``max(1, flops(k) / peak / plain step)`` plain steps, the arithmetic at the GEMM peak these
threads reach on a large product (timed here too), the memory side being the plain step itself.

A length of 1 times the plain step itself with each kernel (would one speed up plain decoding?). The kernels reroute
the target's linear layers as the loop does (`verify_layout.routed`), and the forwards read grouped-query keys and
values in place as the loop's do (`adaflash_hf.generation.attention`); ``--function-mode`` adds each kernel rerouted
from a `TorchFunctionMode` as the loop did before BENCHMARKS.md section 36 (``linear+mode``: the mode alone);
``--copied-kv`` adds each kernel with transformers' ``sdpa`` as it is, which copies the keys and values of every
layer for a masked forward of several tokens, as the loop's forwards did before section 44 (``linear+copied_kv``).
``--compile`` adds a column for the whole forward compiled by ``torch.compile`` (inductor, dynamic shapes, so that
one compilation serves every token count and context length), reporting what the compilation cost; it is a
measurement only: the compiled forward fuses the normalisations, rotary embeddings and attention too, so its logits
are not those of the model's own one-token step.

    python -m adaflash_demo.bench.kernels --batch-sizes 1,8 --lengths 1,2,3,4,8,16 [--threads 2] [--compile]
        [--function-mode] [--copied-kv] [--json kernels.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache

from adaflash_hf.generation.attention import grouped_query_attention
from adaflash_hf.generation.verify_layout import KERNELS, linear, routed, routed_linears
from adaflash_hf.machine import machine_info, machine_summary
from adaflash_hf.utils import write_json_atomic


def gemm_peak_gflops(size: int = 1024, repeats: int = 5) -> float:
    """float32 GFLOP/s of one large square product on torch's threads (the compute roof)."""
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


COMPILED = "compiled"  # the `--compile` column's name
MODE_SUFFIX = "+mode"  # `--function-mode` columns: a kernel rerouted by a `FunctionMode`
COPIES_SUFFIX = "+copied_kv"  # `--copied-kv` columns: transformers' sdpa as it is (keys and values copied)


class FunctionMode(TorchFunctionMode):
    """Reroutes every ``linear`` of a forward through a `KERNELS` product from a `TorchFunctionMode`, as the loop did
    before BENCHMARKS.md section 36: the mode sees every torch call of the forward, not only the linear ones."""

    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return linear(args[0], weight, bias, self.kernel)
        return func(*args, **kwargs)


@contextlib.contextmanager
def kernel_context(linears, kernel: str):
    """The context a forward through ``linears`` (`routed_linears`) runs ``kernel`` in: `routed` (the loop's), or
    `FunctionMode` for a name ending in `MODE_SUFFIX`; with the loop's grouped-query attention unless the name ends
    in `COPIES_SUFFIX`."""
    copied = kernel.endswith(COPIES_SUFFIX)
    kernel = kernel.removesuffix(COPIES_SUFFIX)
    with contextlib.nullcontext() if copied else grouped_query_attention():
        if kernel.endswith(MODE_SUFFIX):
            with FunctionMode(kernel.removesuffix(MODE_SUFFIX)):
                yield
        else:
            with routed(linears, kernel):
                yield


@torch.no_grad()
def measure(target, batch: int, lengths, context: int, repeats: int, kernels=tuple(KERNELS), compiled=None) -> dict:
    """``{"plain_ms": ..., k: {kernel: forward ms / plain step}}`` for one batch size, interleaved rounds; a kernel
    named `COMPILED` runs the forward through `compiled` (the target compiled), one ending in `MODE_SUFFIX` through a
    `FunctionMode`."""
    linears = routed_linears(target)
    vocab = target.config.vocab_size
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(100, vocab - 100, (batch, context)), cache=cache, use_cache=True)
    cases = list(dict.fromkeys([(1, "linear")] + [(k, kernel) for k in lengths for kernel in kernels]))
    times = {case: [] for case in cases}
    for round_ in range(repeats + 1):  # round 0 warms every case up
        shift = round_ % len(cases)
        for k, kernel in cases[shift:] + cases[:shift]:
            ids = torch.randint(100, vocab - 100, (batch, k))
            positions = torch.arange(context, context + k).expand(batch, k)
            if kernel == COMPILED:
                model, mode = compiled, contextlib.nullcontext()
            else:
                model, mode = target, kernel_context(linears, kernel)
            start = time.perf_counter()
            with mode:
                model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=k)
            if round_:
                times[(k, kernel)].append(time.perf_counter() - start)
            cache.crop(-k)  # transformers 5.24: crop takes the (negative) number of tokens to drop
    plain = statistics.median(times[(1, "linear")])
    result = {"plain_ms": 1e3 * plain}
    for k in lengths:
        result[k] = {kernel: statistics.median(times[(k, kernel)]) / plain for kernel in kernels}
    return result


@torch.no_grad()
def compile_forward(target, batch: int):
    """``(compiled target, seconds)``: `torch.compile` with dynamic shapes, compiled by a first forward (a prefill
    and a 2-token step, so that both shapes' graphs exist before timing)."""
    compiled = torch.compile(target, dynamic=True)
    vocab = target.config.vocab_size
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    compiled(input_ids=torch.randint(100, vocab - 100, (batch, 8)), cache=cache, use_cache=True)
    compiled(input_ids=torch.randint(100, vocab - 100, (batch, 2)), cache=cache, use_cache=True, logits_to_keep=2)
    return compiled, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--lengths", default="2,3,4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the peak is measured on as many)")
    parser.add_argument("--compile", action="store_true", help="add the forward compiled by torch.compile")
    parser.add_argument(
        "--function-mode",
        action="store_true",
        help="add each kernel rerouted by a TorchFunctionMode (the loop's way before BENCHMARKS.md section 36)",
    )
    parser.add_argument(
        "--copied-kv",
        action="store_true",
        help="add each kernel with transformers' sdpa copying keys and values (the loop before BENCHMARKS.md 44)",
    )
    parser.add_argument("--json", help="write the machine and the table here")
    args = parser.parse_args(argv)
    from ..smollm2 import TARGET_NAME, load_target

    torch.set_num_threads(args.threads)
    target, _ = load_target(dtype=torch.float32)
    machine = machine_info()
    peak = gemm_peak_gflops()
    params = linear_params(target)
    lengths = [int(k) for k in args.lengths.split(",")]
    print(f"machine: {machine_summary(machine)}\ntarget: {TARGET_NAME}, {params / 1e6:.0f}M linear parameters")
    print(f"float32 GEMM peak of {args.threads} thread(s) (1024^3 product): {peak:.0f} GFLOP/s", file=sys.stderr)
    kernels, compiled, compile_s = tuple(KERNELS), None, None
    if args.function_mode:
        kernels += tuple(name + MODE_SUFFIX for name in KERNELS)
    if args.copied_kv:
        kernels += tuple(name + COPIES_SUFFIX for name in KERNELS)
    if args.compile:
        compiled, compile_s = compile_forward(target, max(int(b) for b in args.batch_sizes.split(",")))
        kernels += (COMPILED,)
        print(f"torch.compile (inductor, dynamic shapes): {compile_s:.0f} s to the first forward", file=sys.stderr)
    lines = [
        "| batch | tokens per row | plain step ms | " + " | ".join(kernels) + " | roofline |",
        "|---" * (4 + len(kernels)) + "|",
    ]
    results = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        result = measure(target, batch, lengths, args.context, args.repeats, kernels, compiled)
        results[batch] = result
        plain_s = result["plain_ms"] / 1e3
        for k in lengths:
            roof = max(1.0, 2 * params * batch * k / (peak * 1e9) / plain_s)
            cells = " | ".join(f"{result[k][kernel]:.2f}" for kernel in kernels)
            lines.append(f"| {batch} | {k} | {result['plain_ms']:.1f} | {cells} | {roof:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    compiled_line = "" if compile_s is None else f", torch.compile {compile_s:.0f} s to its first forward"
    print(
        f"\nforward cost in plain steps ({args.threads} thread(s), float32 GEMM peak {peak:.0f} GFLOP/s"
        f"{compiled_line}):\n" + "\n".join(lines)
    )
    if args.json:
        payload = {
            "machine": machine,
            "threads": args.threads,
            "gemm_peak_gflops": peak,
            "linear_params": params,
            "compile_s": compile_s,
            "results": results,
        }
        write_json_atomic(args.json, payload, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
