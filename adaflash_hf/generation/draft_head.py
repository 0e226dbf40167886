"""The output head that turns the drafter's hidden states into draft logits, in the fastest dtype measured here.

The drafter borrows the target's LM head (docs/algorithm.md §1.5). With a float32 target on a CPU, that head is the
drafter's largest cost: over a block's 15 draft positions it reads the whole vocabulary matrix (113 MB for
SmolLM2's 49152 x 576), several times the drafter's own layers (a draft vocabulary, `AdaFlashConfig.draft_vocab`,
cuts it by the vocabulary ratio; the step-cost model of BENCHMARKS.md §3 prices both).
A bfloat16 copy of the same matrix halves the bytes and can run several times faster; but whether it does depends on
more than the CPU: on one machine a standalone timing loop found bfloat16 several times faster, while inside the
decoding loop, between target forwards, the same bfloat16 product was several times slower than float32. So the
choice is measured where it is used:
the first calls of each dtype inside generation, alternating, timed per projected position; then the faster one (by
median, bfloat16 only if it wins by 20%) is kept in the pair's `profile.RuntimeProfile` (`measured.py`), with the
bfloat16 copy.

Lossless either way: the drafts only *propose* tokens. Greedy verification keeps a draft only if it equals the
float32 target's own choice; sampling draws the drafts from the distribution these logits define and accepts them
against that same distribution (docs/algorithm.md §3.4), so the output distribution is the target's.

``GenerationConfig(adaflash_draft_head_dtype=...)`` overrides the choice: ``"auto"`` (the default, measured),
``"same"`` (the target head's own dtype, no copy) or a dtype name such as ``"bfloat16"``.

A float32 head on a CPU also runs the product in the fastest of the verification kernels (`verify_layout.KERNELS`)
for its number of projected positions (rows x drafts), measured the same way per `verify_layout.measured_key`: the
planner projects only the drafts it verifies, 1-3 positions at batch 1 on most steps, where float32 ``linear`` on the
vocabulary rows can cost as much as a whole block and the transposed product a quarter of it (BENCHMARKS.md
section 35). ``adaflash_verify_layout`` applies here as in the target's forwards: ``"linear"`` never reroutes, a
kernel's name always runs it.

A drafter with a reduced draft vocabulary (``AdaFlashConfig.draft_vocab``) projects with only those rows of the
head (one copy per head, dtype and vocabulary), which divides the head's cost by the vocabulary ratio; the logits are
then scattered back into the whole vocabulary with ``-inf`` elsewhere, so logits processors, sampling, acceptance
and trees see the usual ``[..., V]`` tensor, and a token outside the draft vocabulary is never drafted (greedy: its
logit is ``-inf``; sampling: its draft probability is 0, which rejection sampling handles exactly).
"""

from __future__ import annotations

import time

import torch

from ..draft_vocab_rows import full_vocab_logits, vocab_ids, vocab_rows
from .profile import RuntimeProfile
from .verify_layout import linear, measured_key

DRAFT_HEAD_CHOICES = ("auto", "same")

# what a head can project in: floating dtypes that matmul supports on every device (no float8, no complex)
HEAD_DTYPES = ("float32", "bfloat16", "float16", "float64")


def resolve_dtype_name(name) -> str:
    """Validates ``adaflash_draft_head_dtype``; returns ``"auto"``, ``"same"`` or one of `HEAD_DTYPES`."""
    name = "auto" if name is None else str(name).removeprefix("torch.")
    if name in DRAFT_HEAD_CHOICES or name in HEAD_DTYPES:
        return name
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype) and str(dtype).removeprefix("torch.") in HEAD_DTYPES:
        return str(dtype).removeprefix("torch.")  # an alias such as "float" or "half"
    raise ValueError(
        f"adaflash_draft_head_dtype={name!r} is not a dtype the draft head can compute logits in: use 'auto' "
        f"(measured), 'same' (the target head's dtype) or one of {', '.join(map(repr, HEAD_DTYPES))}."
    )


class _Vocab:
    """A draft vocabulary: its ids as a tensor and a key that tells vocabularies apart in the caches above."""

    def __init__(self, ids, device):
        ids = [int(i) for i in ids]
        self.key = (len(ids), hash(tuple(ids)))
        self.ids = vocab_ids(ids, device)


def _project(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    dtype: torch.dtype,
    vocab: _Vocab | None,
    profile: RuntimeProfile,
    kernel: str = "linear",
) -> torch.Tensor:
    """Float32 logits over the whole vocabulary (``-inf`` outside ``vocab`` when given), the product computed by
    ``kernel`` (`verify_layout.KERNELS`); a copy of the weight in another dtype or of its vocabulary rows is the
    profile's."""
    weight = head.weight
    if dtype == weight.dtype and vocab is None:
        if kernel == "linear" or type(head).forward is not torch.nn.Linear.forward:
            return head(hidden.to(weight.device, weight.dtype)).float()
        return linear(hidden.to(weight.device, weight.dtype), weight, head.bias, kernel).float()
    bias = head.bias
    if bias is not None:
        bias = (bias if vocab is None else vocab_rows(bias, vocab.ids)).to(dtype)
    copy = _weight_copy(weight, dtype, vocab, profile)
    logits = linear(hidden.to(weight.device, dtype), copy, bias, kernel).float()
    if vocab is None:
        return logits
    return full_vocab_logits(logits, vocab.ids, weight.shape[0])


def _weight_copy(weight, dtype, vocab: _Vocab | None, profile: RuntimeProfile) -> torch.Tensor:
    return profile.head_copy(weight, dtype, None if vocab is None else vocab.ids, None if vocab is None else vocab.key)


def _timed(head, hidden, dtype, vocab, profile, kernel: str = "linear") -> tuple[torch.Tensor, float]:
    """Projects and returns the logits with the seconds it took (device-synchronised)."""
    sync = torch.cuda.synchronize if head.weight.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    logits = _project(head, hidden, dtype, vocab, profile, kernel)
    sync()
    return logits, time.perf_counter() - start


class DraftHead:
    """Projects ``[B, n, H]`` drafter hidden states to float32 logits ``[B, n, V]`` with the target's head.

    Args:
        output_embeddings (`nn.Linear`): the target's LM head.
        dtype_name (`str`): ``adaflash_draft_head_dtype`` (see the module docstring).
        vocab (`list[int]`, *optional*): the drafter's reduced draft vocabulary (``AdaFlashConfig.draft_vocab``).
        profile (`RuntimeProfile`, *optional*): where the dtype choice and the weight copies live (the pair's
            `profile.profile_for` in generation); a new one by default.
        layout (`str`): ``adaflash_verify_layout``: the float32 product's kernel, ``"auto"`` (measured per projected
            positions), ``"linear"`` (the module's own) or a kernel's name.

    Attributes:
        timed_kernel (`bool`): the last call timed a kernel (a step a little slower than later ones).
    """

    def __init__(
        self,
        output_embeddings: torch.nn.Module,
        dtype_name: str = "auto",
        vocab=None,
        profile: RuntimeProfile | None = None,
        layout: str = "auto",
    ):
        self.head = output_embeddings
        self.layout = layout
        self.timed_kernel = False
        self.profile = RuntimeProfile() if profile is None else profile
        weight = output_embeddings.weight
        self.vocab = None if vocab is None else _Vocab(vocab, weight.device)
        name = resolve_dtype_name(dtype_name)
        self._fixed: torch.dtype | None = None  # None: "auto" on a float32 head, measured in use
        if name == "same" or (name == "auto" and weight.dtype != torch.float32):
            self._fixed = weight.dtype  # a half-precision head is already the cheap one
        elif name != "auto":
            self._fixed = getattr(torch, name)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype drafts are projected in; ``None`` while "auto" is still measuring."""
        return self._fixed if self._fixed is not None else self.profile.head_dtypes.chosen(self._key)

    @property
    def _key(self) -> tuple:
        weight = self.head.weight
        return (weight.device.type, tuple(weight.shape), None if self.vocab is None else self.vocab.key)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype, self.timed_kernel = self.dtype, False
        if dtype is None:
            choice = self.profile.head_dtypes
            dtype = choice.next_trial(self._key)
            logits, seconds = _timed(self.head, hidden, dtype, self.vocab, self.profile)
            choice.record(self._key, dtype, seconds / max(hidden.shape[0] * hidden.shape[1], 1))
            return logits
        kernel, key = self._kernel(dtype, hidden.shape[0] * hidden.shape[1])
        if key is None:
            return _project(self.head, hidden, dtype, self.vocab, self.profile, kernel)
        logits, seconds = _timed(self.head, hidden, dtype, self.vocab, self.profile, kernel)
        self.profile.head_kernels.record(key, kernel, seconds)
        self.timed_kernel = True
        return logits

    def _kernel(self, dtype: torch.dtype, positions: int) -> tuple[str, tuple | None]:
        """``(kernel, key)`` of a projection of ``positions`` positions in ``dtype``: ``key`` when this call times
        the kernel (`RuntimeProfile.head_kernels`), else ``None``."""
        tokens = measured_key(positions)
        if dtype != torch.float32 or self.head.weight.device.type != "cpu" or tokens is None:
            return "linear", None  # the kernels reroute float32 products on a CPU only
        if self.layout != "auto":
            return self.layout, None
        key = (self._key, tokens)
        choice = self.profile.head_kernels
        chosen = choice.chosen(key)
        return (chosen, None) if chosen is not None else (choice.next_trial(key), key)
