"""The kernel of the target's linear layers in the decoding loop's forwards on a CPU, measured.

A verification forward multiplies the ``M = rows x width`` tokens it verifies by every weight matrix of the target. A
plain decoding step at batch 1 (``M = 1``) is a matrix-vector product that streams each weight once; for a small
``M > 1`` the product should cost about as much (the weights are read once either way), but float32 ``linear``
(``x @ W.T``) can take a GEMM path that makes a forward of 2-3 tokens cost as much as one of 8 or 16 (BENCHMARKS.md
§3), while other kernels for the same product cost less at some ``M``: the transposed product ``(W @ x.T).T`` (the
BLAS's matrix-times-few-columns path), oneDNN's inner product on the weights as they are (no reordered copy, so no
memory beyond the model's) and a batched product over blocks of the weight's rows (`BlockedLinear`). Which wins depends
on the BLAS library, the CPU and the memory around the forward, so none is assumed: for each ``M`` (`measured_key`:
every count from 1 to 16, then one key per power of two up to `MAX_MEASURED_TOKENS`), the first forwards rotate through
the kernels (`kernels_for`), timed whole in the loop (`measured.py`), and another kernel than the model's own is kept,
in the pair's `profile.RuntimeProfile`, only if it is at least 10% faster; every other forward runs as the model wrote
it. A plain step of the loop is a forward of ``M = rows`` tokens like any other, so it runs the kernel measured for its
``M`` too (a matrix-vector product at batch 1, where oneDNN's can beat the BLAS's with several threads). Plain
``generate()``, the benchmarks' baseline, runs the model's own.
BENCHMARKS.md §12, §14 and §24 have the kernels' costs per machine (``python -m adaflash_demo.bench.kernels``).

Lossless: every kernel computes the same sums of the same float32 products, in another order, as any change of GEMM
shape does (verifying 8 tokens already sums differently from decoding 1); the target still verifies every committed
token, and greedy outputs are compared with plain ``generate()`` in the tests (every kernel, several families, batch
1 and 3) and in every benchmark (docs/algorithm.md §3.8).

Only `torch.nn.functional.linear` with a plain float32 CPU weight is rerouted (what `nn.Linear` calls), through a
`TorchFunctionMode` entered around the loop's forwards after the prefill only, which is thread-local and leaves other
calls, other threads and other dtypes alone. ``GenerationConfig(adaflash_verify_layout=...)`` overrides the choice:
``"auto"`` (the default, measured), ``"linear"`` (never reroute: the off switch) or a kernel's name (always, for every
``M`` with a `measured_key`).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.overrides import TorchFunctionMode

# A forward of more tokens is a prefill, not a verification (32 rows of a 16-token block are 512).
MAX_MEASURED_TOKENS = 512


def measured_key(tokens: int) -> int | None:
    """The key under which a forward of ``tokens`` tokens (rows x width) measures its kernel; ``None``: the model's
    own. Each count from 1 (a plain step at batch 1: a matrix-vector product) to 16 (a block at batch 1, a few tokens
    a row at batch > 1: where the kernels' ranking changes from one count to the next) has its own; larger forwards
    (whole blocks at batch > 1, arithmetic-bound, where the ranking is stable) share one per power of two, so a batch
    of any size costs a few trials."""
    if tokens < 1 or tokens > MAX_MEASURED_TOKENS:
        return None
    return tokens if tokens <= 16 else 1 << (tokens - 1).bit_length()


def kernels_for(key: int) -> tuple[str, ...]:
    """The kernels timed against ``linear`` for a `measured_key`: above 16 tokens the transposed product is the
    BLAS's few-columns path on many columns, slower than ``linear`` on every machine measured (BENCHMARKS.md
    sections 12 and 14), and a trial there costs several plain steps, so it is not timed; the blocked product is
    timed from 4 to 16 tokens only, where the BLAS's products of a few rows fall far below the core's arithmetic:
    at 1-3 tokens ``linear`` streams the weight at about a plain step's cost, and above 16 the product is
    arithmetic-bound (BENCHMARKS.md section 24). A candidate that cannot win is not only a slow trial: each one timed
    is one more chance that a timing burst keeps a slower kernel."""
    if key > 16:
        return ("onednn",)
    return tuple(name for name in tuple(KERNELS)[1:] if name != "blocked" or key >= BLOCKED_FROM)


class _RoutedLinear(TorchFunctionMode):
    """Reroutes ``linear(x, W, b)`` with a plain float32 CPU weight through `product`; all else runs unchanged."""

    def product(self, flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``flat [M, K] @ weight.T [K, N]`` as a row-major ``[M, N]``."""
        raise NotImplementedError

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                type(weight) in (torch.Tensor, torch.nn.Parameter)
                and type(x) is torch.Tensor
                and weight.dim() == 2
                and x.dtype == weight.dtype == torch.float32
                and x.device.type == weight.device.type == "cpu"
            ):
                # laid out as linear's own result (row-major): a kernel choice must not change what later ops accept
                # (view_as_complex in complex rotary embeddings needs a last dimension of stride 1)
                out = self.product(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
                return out if bias is None else out + bias
        return func(*args, **kwargs)


class TransposedLinear(_RoutedLinear):
    """Computes ``linear(x, W, b)`` as ``(W @ x.T).T + b`` (the BLAS's matrix-times-few-columns path)."""

    def product(self, flat, weight):
        return torch.mm(weight, flat.t()).t().contiguous()


class OneDNNLinear(_RoutedLinear):
    """Computes ``linear(x, W, b)`` with oneDNN's inner product on the weight as it is (no reordered copy)."""

    def product(self, flat, weight):
        return torch.ops.mkldnn._linear_pointwise(flat, weight, None, "none", [], "")


class BlockedLinear(_RoutedLinear):
    """Computes ``linear(x, W, b)`` as one batched product over blocks of `BLOCK_ROWS` rows of ``W``: ``[M, K]`` times
    each ``[K, BLOCK_ROWS]`` block, the rows beyond the last whole block by ``linear``. At a few tokens (``M`` of 4 to
    12) the BLAS's product over the whole weight reaches a fraction of the core's arithmetic, so a forward of 8 tokens
    costs twice a plain step on some machines; a block's product is small enough to run at the speed of a product
    whose weight sits in cache, and the weight is still read once (BENCHMARKS.md section 24)."""

    def product(self, flat, weight):
        rows = weight.shape[0]
        blocks = rows // BLOCK_ROWS
        if blocks < 2 or not weight.is_contiguous():
            return torch.nn.functional.linear(flat, weight)
        whole = blocks * BLOCK_ROWS
        stacked = weight[:whole].view(blocks, BLOCK_ROWS, weight.shape[1])
        out = torch.bmm(flat.expand(blocks, -1, -1), stacked.transpose(1, 2))  # [blocks, M, BLOCK_ROWS]
        out = out.transpose(0, 1).reshape(flat.shape[0], whole)
        if whole < rows:
            out = torch.cat([out, torch.nn.functional.linear(flat, weight[whole:])], dim=1)
        return out


BLOCK_ROWS = 64
BLOCKED_FROM = 4  # the fewest tokens of a forward whose kernel trials time `BlockedLinear` (`kernels_for`)
KERNELS = {
    "linear": contextlib.nullcontext,
    "transposed": TransposedLinear,
    "onednn": OneDNNLinear,
    "blocked": BlockedLinear,
}
VERIFY_LAYOUTS = ("auto", *KERNELS)


class VerifyLayout:
    """The layout of one generate() call's verification forwards.

    Args:
        target (`PreTrainedModel`): the verifying model; only a float32 model on a CPU is ever rerouted.
        name (`str`): ``adaflash_verify_layout`` (see the module docstring; validated by `options.py`).
        profile (`RuntimeProfile`): where the measured choices live (the pair's `profile.profile_for`).
    """

    def __init__(self, target, name: str, profile):
        self.choice = profile.layouts
        self.name = name
        parameter = next(target.parameters(), None)
        cpu_float32 = parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.float32
        self.active = cpu_float32 and self.name != "linear"

    def layout(self, tokens: int) -> tuple[str, bool]:
        """``(layout, trial)`` for a forward over ``tokens`` tokens: ``trial`` when this forward times the layout."""
        key = measured_key(tokens)
        if not self.active or key is None:
            return "linear", False
        if self.name != "auto":
            return self.name, False
        chosen = self.choice.chosen(key)
        if chosen is not None:
            return chosen, False
        return self.choice.next_trial(key), True

    @contextlib.contextmanager
    def forward(self, tokens: int):
        """Runs the block's forward with the kernel for ``tokens`` tokens; yields whether this forward was a timing
        trial (a step the planner should not price)."""
        layout, trial = self.layout(tokens)
        start = time.perf_counter()
        with KERNELS[layout]():
            yield trial
        if trial:
            self.choice.record(measured_key(tokens), layout, time.perf_counter() - start)
