"""The output head that turns the drafter's hidden states into draft logits, in the fastest dtype measured here.

The drafter borrows the target's LM head (docs/algorithm.md §1.5). With a float32 target on a CPU, that head is the
drafter's largest cost: over a block's 15 draft positions it reads the whole vocabulary matrix (113 MB for
SmolLM2's 49152 x 576), about half a plain target step in the step-cost model of BENCHMARKS.md, several times the
drafter's own layers.
A bfloat16 copy of the same matrix halves the bytes and, on CPUs with AMX, runs several times faster; on CPUs without
it, bfloat16 matmuls over more than one row can be slower than float32. So the choice is measured, once per process,
head and row count, and the faster dtype wins.

Lossless either way: the drafts only *propose* tokens. Greedy verification keeps a draft only if it equals the
float32 target's own choice; sampling draws the drafts from the distribution these logits define and accepts them
against that same distribution (docs/algorithm.md §3.4), so the output distribution is the target's.

``GenerationConfig(adaflash_draft_head_dtype=...)`` overrides the choice: ``"auto"`` (the default, measured),
``"same"`` (the target head's own dtype, no copy) or a dtype name such as ``"bfloat16"``.
"""

from __future__ import annotations

import time
import weakref

import torch

DRAFT_HEAD_CHOICES = ("auto", "same")

# (id of the weight, its version counter, device, rows) -> the chosen dtype; measured once per process.
_CHOICES: dict[tuple, torch.dtype] = {}
# (id of the weight, its version counter, dtype) -> the weight in that dtype (one copy per head, refreshed when the
# weight changes in place, e.g. during training).
_COPIES: dict[tuple, torch.Tensor] = {}


def resolve_dtype_name(name) -> str:
    """Validates ``adaflash_draft_head_dtype``; returns ``"auto"``, ``"same"`` or a torch dtype name."""
    name = "auto" if name is None else str(name).removeprefix("torch.")
    if name in DRAFT_HEAD_CHOICES or isinstance(getattr(torch, name, None), torch.dtype):
        return name
    raise ValueError(
        f"adaflash_draft_head_dtype={name!r} is not 'auto', 'same' or a torch dtype name (e.g. 'bfloat16')."
    )


def _key(weight: torch.Tensor) -> tuple:
    return (id(weight), weight._version, weight.device, tuple(weight.shape))


def _copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == weight.dtype:
        return weight
    key = (*_key(weight), dtype)
    if key not in _COPIES:
        stale = [k for k in _COPIES if k[0] == id(weight)]
        for old in stale:
            del _COPIES[old]
        _COPIES[key] = weight.detach().to(dtype)
        if not stale:  # the copy goes with the weight it was made from
            weakref.finalize(weight, _forget, id(weight))
    return _COPIES[key]


def _forget(weight_id: int) -> None:
    for table in (_COPIES, _CHOICES):
        for key in [k for k in table if k[0] == weight_id]:
            del table[key]


def _time(weight: torch.Tensor, hidden: torch.Tensor, repeats: int = 5) -> float:
    hidden = hidden.to(weight.dtype)
    torch.nn.functional.linear(hidden, weight)  # warm-up
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(hidden, weight)
    sync()
    return time.perf_counter() - start


class DraftHead:
    """Projects ``[B, n, H]`` drafter hidden states to float32 logits ``[B, n, V]`` with the target's head.

    Args:
        output_embeddings (`nn.Linear`): the target's LM head.
        rows (`int`): draft positions projected per row and step (``block_size - 1``), used to measure.
        dtype_name (`str`): ``adaflash_draft_head_dtype`` (see the module docstring).
    """

    def __init__(self, output_embeddings: torch.nn.Module, rows: int, dtype_name: str = "auto"):
        self.head = output_embeddings
        weight = output_embeddings.weight
        name = resolve_dtype_name(dtype_name)
        if name == "same" or (name == "auto" and weight.dtype != torch.float32):
            self.dtype = weight.dtype  # a half-precision head is already the cheap one
        elif name == "auto":
            self.dtype = self._measured(weight, rows)
        else:
            self.dtype = getattr(torch, name)

    @staticmethod
    def _measured(weight: torch.Tensor, rows: int) -> torch.dtype:
        key = (*_key(weight), rows)
        if key not in _CHOICES:
            hidden = torch.randn(1, rows, weight.shape[1], device=weight.device)
            with torch.no_grad():
                fp32 = _time(weight, hidden)
                bf16 = _time(_copy(weight, torch.bfloat16), hidden)
            _CHOICES[key] = torch.bfloat16 if bf16 < 0.8 * fp32 else torch.float32
        return _CHOICES[key]

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        if self.dtype == weight.dtype:
            return self.head(hidden.to(weight.device, weight.dtype)).float()
        bias = None if self.head.bias is None else self.head.bias.to(self.dtype)
        logits = torch.nn.functional.linear(hidden.to(weight.device, self.dtype), _copy(weight, self.dtype), bias)
        return logits.float()
