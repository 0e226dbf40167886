"""The output head that turns the drafter's hidden states into draft logits, in the fastest dtype measured here.

The drafter borrows the target's LM head (docs/algorithm.md §1.5). With a float32 target on a CPU, that head is the
drafter's largest cost: over a block's 15 draft positions it reads the whole vocabulary matrix (113 MB for
SmolLM2's 49152 x 576), several times the drafter's own layers (a draft vocabulary, `AdaFlashConfig.draft_vocab`,
cuts it by the vocabulary ratio; the step-cost model of BENCHMARKS.md §3 prices both).
A bfloat16 copy of the same matrix halves the bytes and can run several times faster; but whether it does depends on
more than the CPU: on one machine a standalone timing loop found bfloat16 several times faster, while inside the
decoding loop, between target forwards, the same bfloat16 product was several times slower than float32. So the
choice is measured where it is used, and per number of projected positions (rows x drafts,
`verify_layout.measured_key`; larger counts one key per power of two): a projection streams the whole matrix
whatever its positions, so one of 15 positions costs little more than one of 2, and a choice made by time *per
position* compared a float32 trial of one draft with a bfloat16 trial of a probe's whole block, and could keep
bfloat16 by that alone. A float32 head on a CPU also runs the product in the fastest of the verification kernels
(`verify_layout.KERNELS`) for its positions: the planner projects only the drafts it verifies, 1-3 positions at
batch 1 on most steps, where float32 ``linear`` on the vocabulary rows can cost as much as a whole block and the
transposed product a quarter of it (BENCHMARKS.md section 35), and a probe's block of 15, where ``linear`` can cost
several times bfloat16's product and the transposed one less than it. So the options are timed together, per
position count, in the pair's `profile.RuntimeProfile` (`measured.py`): float32 ``linear`` (the head's own product,
the baseline), the float32 kernels (kept if 10% faster), and the bfloat16 copy (kept if 20% faster; its logits
differ a little, so it must win clearly); the first calls of each count rotate through them.

Lossless either way: the drafts only *propose* tokens. Greedy verification keeps a draft only if it equals the
float32 target's own choice; sampling draws the drafts from the distribution these logits define and accepts them
against that same distribution (docs/algorithm.md §3.4), so the output distribution is the target's.

``GenerationConfig(adaflash_draft_head_dtype=...)`` overrides the choice: ``"auto"`` (the default, measured),
``"same"`` (the target head's own dtype, no copy) or a dtype name such as ``"bfloat16"``.

``adaflash_verify_layout`` applies here as in the target's forwards: ``"linear"`` never reroutes, a kernel's name
always runs it (the dtype is still measured under ``"auto"``).

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
from .profile import BFLOAT16, RuntimeProfile
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
        profile (`RuntimeProfile`, *optional*): where the choices and the weight copies live (the pair's
            `profile.profile_for` in generation); a new one by default.
        layout (`str`): ``adaflash_verify_layout``: the float32 product's kernel, ``"auto"`` (measured per projected
            positions), ``"linear"`` (the module's own) or a kernel's name.

    Attributes:
        timed_kernel (`bool`): the last call timed one of the head's options (a step a little slower than later
            ones).
        timed_dtype (`bool`): the last call timed the bfloat16 copy (in the loop, its product can cost several
            times a float32 one: the step says nothing of later ones). A float32 kernel's trial differs from the
            kept kernel by a fraction of the head's product, a few milliseconds of a step: such a step is timed
            as a trial (`timed_kernel`), which counts in drafting's rates. Kept out of them as well, a new pair's
            first drafted steps were, one position count after another, and drafting went on only step by step:
            with an empty profile, math's first four calls drafted 65-86 steps (1.48-1.65x) where they now draft
            89-92 (1.76-1.78x; BENCHMARKS.md section 43).
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
        self.timed_kernel = self.timed_dtype = False
        self.profile = RuntimeProfile() if profile is None else profile
        weight = output_embeddings.weight
        self.vocab = None if vocab is None else _Vocab(vocab, weight.device)
        name = resolve_dtype_name(dtype_name)
        # "auto" measures bfloat16 against a float32 head only: a half-precision head is already the cheap one
        self._auto = name == "auto" and weight.dtype == torch.float32
        self._dtype = weight.dtype if name in DRAFT_HEAD_CHOICES else getattr(torch, name)
        self._kernels = self._dtype == torch.float32 and weight.device.type == "cpu"  # they reroute these only

    def dtype(self, positions: int) -> torch.dtype | None:
        """The dtype a projection of ``positions`` positions runs in; ``None`` while "auto" still measures it."""
        if not self._auto:
            return self._dtype
        option = self.profile.head_kernels.chosen(self._choice_key(positions))
        return None if option is None else (torch.bfloat16 if option == BFLOAT16 else torch.float32)

    @property
    def _key(self) -> tuple:
        weight = self.head.weight
        return (weight.device.type, tuple(weight.shape), None if self.vocab is None else self.vocab.key)

    def _choice_key(self, positions: int) -> tuple:
        """The `RuntimeProfile.head_kernels` key of a projection of ``positions`` positions: the head, the position
        count (`measured_key`; above `MAX_MEASURED_TOKENS`, one per power of two, for the dtype alone) and what is
        measured for it (`profile.head_candidates`)."""
        tokens = measured_key(positions)
        kernels = self._kernels and self.layout == "auto" and tokens is not None
        tokens = tokens if tokens is not None else 1 << (max(positions, 1) - 1).bit_length()
        return (self._key, tokens, self._auto, kernels)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.timed_kernel = self.timed_dtype = False
        positions = hidden.shape[0] * hidden.shape[1]
        key = self._choice_key(positions)
        _, _, auto, kernels = key
        choice = self.profile.head_kernels
        option = choice.chosen(key) if auto or kernels else "linear"
        if option is not None:
            dtype, kernel = self._resolve(option, positions)
            return _project(self.head, hidden, dtype, self.vocab, self.profile, kernel)
        option = choice.next_trial(key)
        dtype, kernel = self._resolve(option, positions)
        logits, seconds = _timed(self.head, hidden, dtype, self.vocab, self.profile, kernel)
        choice.record(key, option, seconds)
        self.timed_kernel, self.timed_dtype = True, option == BFLOAT16
        return logits

    def _resolve(self, option: str, positions: int) -> tuple[torch.dtype, str]:
        """``(dtype, kernel)`` of a head choice's option."""
        if option == BFLOAT16:
            return torch.bfloat16, "linear"
        if self._kernels and self.layout != "auto" and measured_key(positions):
            return torch.float32, self.layout  # a kernel named: the float32 option runs it
        return self._dtype, option
