"""The kernel of the target's linear layers in the decoding loop's forwards on a CPU, measured.

A verification forward multiplies the ``M = rows x width`` tokens it verifies by every weight matrix of the target. A
plain decoding step at batch 1 (``M = 1``) is a matrix-vector product that streams each weight once; for a small
``M > 1`` the product should cost about as much (the weights are read once either way), but float32 ``linear``
(``x @ W.T``) can take a GEMM path that makes a forward of 2-3 tokens cost as much as one of 8 or 16 (BENCHMARKS.md
§3), while other kernels for the same product cost less at some ``M``: the transposed product ``(W @ x.T).T`` (the
BLAS's matrix-times-few-columns path), oneDNN's inner product on the weights as they are (no reordered copy, so no
memory beyond the model's) and a batched product over blocks of the weight's rows (`_blocked`). Which wins depends
on the BLAS library, the CPU and the memory around the forward, so none is assumed: for each ``M`` (`measured_key`:
every count from 1 to 16, then one key per power of two up to `MAX_MEASURED_TOKENS`), the first forwards rotate through
the kernels (`kernels_for`), timed whole in the loop (`measured.py`), and another kernel than the model's own is kept,
in the pair's `profile.RuntimeProfile`, only if it is at least 10% faster; every other forward runs as the model wrote
it. A plain step of the loop is a forward of ``M = rows`` tokens like any other, so it runs the kernel measured for its
``M`` too (a matrix-vector product at batch 1, where oneDNN's can beat the BLAS's with several threads). Plain
``generate()``, the benchmarks' baseline, runs the model's own.
BENCHMARKS.md §12, §14, §24 and §36 have the kernels' costs per machine (``python -m adaflash_demo.bench.kernels``).

Lossless: every kernel computes the same sums of the same float32 products, in another order, as any change of GEMM
shape does (verifying 8 tokens already sums differently from decoding 1); the target still verifies every committed
token, and greedy outputs are compared with plain ``generate()`` in the tests (every kernel, several families, batch
1 and 3) and in every benchmark (docs/algorithm.md §3.8).

Only the target's `torch.nn.Linear` layers with a plain float32 CPU weight are rerouted (`routed_linears`), each
for the duration of one of the loop's forwards after the prefill and only for the thread running it (`routed`): other
calls, other threads and other dtypes run the model's own. ``GenerationConfig(adaflash_verify_layout=...)``
overrides the choice: ``"auto"`` (the default, measured), ``"linear"`` (never reroute: the off switch) or a kernel's
name (always, for every ``M`` with a `measured_key`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable

import torch

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


def _transposed(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(W @ x.T).T``: the BLAS's matrix-times-few-columns path."""
    return torch.mm(weight, flat.t()).t().contiguous()


def _onednn(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's inner product on the weight as it is (no reordered copy)."""
    return torch.ops.mkldnn._linear_pointwise(flat, weight, None, "none", [], "")


def _blocked(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One batched product over blocks of `BLOCK_ROWS` rows of ``W``: ``[M, K]`` times each ``[K, BLOCK_ROWS]``
    block, the rows beyond the last whole block by ``linear``. At a few tokens (``M`` of 4 to 12) the BLAS's product
    over the whole weight reaches a fraction of the core's arithmetic, so a forward of 8 tokens costs twice a plain
    step on some machines; a block's product is small enough to run at the speed of a product whose weight sits in
    cache, and the weight is still read once (BENCHMARKS.md section 24)."""
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
BLOCKED_FROM = 4  # the fewest tokens of a forward whose kernel trials time the blocked product (`kernels_for`)
# name -> ``product(flat [M, K], weight [N, K]) -> [M, N]`` (row-major); ``None``: ``linear``, the model's own
KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {
    "linear": None,
    "transposed": _transposed,
    "onednn": _onednn,
    "blocked": _blocked,
}
VERIFY_LAYOUTS = ("auto", *KERNELS)


def _reroutes(weight) -> bool:
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` computed by ``kernel``; a product that is not a plain float32
    one on a CPU runs ``linear`` whatever the kernel."""
    product = KERNELS[kernel]
    plain_x = type(x) is torch.Tensor and x.dtype == torch.float32 and x.device.type == "cpu"
    if product is None or not plain_x or not _reroutes(weight):
        return torch.nn.functional.linear(x, weight, bias)
    # laid out as linear's own result (row-major): a kernel choice must not change what later ops accept
    # (view_as_complex in complex rotary embeddings needs a last dimension of stride 1)
    out = product(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def routed_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The layers of ``model`` that a kernel reroutes: `torch.nn.Linear` modules running ``Linear.forward`` itself
    (a subclass with its own forward, or a module another library has wrapped, runs as it is) on a plain float32
    weight on a CPU."""
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
        and type(module).forward is torch.nn.Linear.forward
        and _reroutes(module.weight)
    ]


def _routed_forward(module: torch.nn.Linear, kernel: str, thread: int, x: torch.Tensor) -> torch.Tensor:
    if threading.get_ident() != thread:  # another thread's forward through the same module runs the model's own
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return linear(x, module.weight, module.bias, kernel)


@contextlib.contextmanager
def routed(linears: list[torch.nn.Linear], kernel: str):
    """Runs this thread's forwards through ``linears`` (`routed_linears`) with ``kernel`` for the block's duration.

    Each layer gets an instance ``forward`` that calls `linear`, removed on exit; a layer that already has one
    (another thread's forward is routing it, or a hook library's wrapper) is left alone. Nothing else of the forward
    is intercepted: a `torch.overrides.TorchFunctionMode` would do the same for every torch call of the forward, and
    its Python dispatch of the ~1,000 other operations cost more than the kernels saved (BENCHMARKS.md section 36)."""
    if KERNELS[kernel] is None:
        yield
        return
    thread, installed = threading.get_ident(), []
    for module in linears:
        attributes = module.__dict__  # directly: `Module.__setattr__` costs a forward of 200 layers a millisecond
        if "forward" not in attributes:
            attributes["forward"] = functools.partial(_routed_forward, module, kernel, thread)
            installed.append(attributes)
    try:
        yield
    finally:
        for attributes in installed:
            del attributes["forward"]


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
        self.linears = routed_linears(target) if self.active else []

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
        with routed(self.linears, layout):
            yield trial
        if trial:
            self.choice.record(measured_key(tokens), layout, time.perf_counter() - start)
