"""The OPD losses (docs/algorithm.md §4.7-4.9) and the length-head labels and loss (docs/algorithm.md §6.2-6.3).

Everything is computed on the ``M`` supervised rows only (block slots with a positive weight). Logits are never
materialised for all rows at once: `row_statistics` projects ``chunk_size`` rows at a time under activation
checkpointing, so peak memory is one ``[chunk_size, V]`` block forward and backward, which lets a 150k vocabulary
and 8k rows fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..generation.acceptance import leading_true

LOSS_TYPES = ("opd", "ce", "fkl")
LOSS_DIVERGENCES = {"opd": ("reverse_kl",), "ce": (), "fkl": ("forward_kl",)}  # what `drafting_loss` reads
CLIP_MODES = ("reference", "per_token")
LENGTH_LOSSES = ("mse", "mae")


@dataclass
class RowStatistics:
    """Per-row quantities of the drafter (student) against the target (teacher); every tensor is ``[M]``.

    ``ce_teacher`` / ``ce_data``: cross-entropy of the drafter against the teacher argmax / the data token.
    ``forward_kl``: ``T^2 KL(p_T || p_S)``; ``reverse_kl``: ``T^2 KL(p_S || p_T)``. Only the losses asked for are
    differentiable; the argmaxes and the drafter's top probability are plain values.
    """

    ce_teacher: torch.Tensor
    ce_data: torch.Tensor
    forward_kl: torch.Tensor
    reverse_kl: torch.Tensor
    student_argmax: torch.Tensor
    teacher_argmax: torch.Tensor
    student_max_prob: torch.Tensor


def _chunk_statistics(student_hidden, teacher_hidden, data_labels, weight, bias, temperature, divergences):
    student_logits = F.linear(student_hidden.to(weight.dtype), weight, bias).float()
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden.to(weight.dtype), weight, bias).float()
        teacher_argmax = teacher_logits.argmax(dim=-1)
        teacher_logp = F.log_softmax(teacher_logits / temperature, dim=-1) if divergences else None
    student_logp_raw = F.log_softmax(student_logits, dim=-1)
    student_logp = F.log_softmax(student_logits / temperature, dim=-1) if temperature != 1.0 else student_logp_raw
    scale = temperature**2
    # Each full-vocabulary pass costs about as much as the projection itself on a CPU: only the asked ones run.
    zeros = student_logits.new_zeros(student_logits.shape[0])
    forward_kl = reverse_kl = zeros
    if "forward_kl" in divergences:
        forward_kl = scale * (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if "reverse_kl" in divergences:
        # The gradient flows through p_S only; log p_T is a constant, as in the reference `kl_div(log p_T, p_S)`.
        reverse_kl = scale * (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    top_logp, student_argmax = student_logp_raw.detach().max(dim=-1)
    return (
        F.nll_loss(student_logp_raw, teacher_argmax, reduction="none"),
        F.nll_loss(student_logp_raw, data_labels, reduction="none"),
        forward_kl,
        reverse_kl,
        student_argmax,
        teacher_argmax,
        top_logp.exp(),
    )


def row_statistics(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    data_labels: torch.LongTensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    divergences: tuple[str, ...] = ("forward_kl", "reverse_kl"),
    checkpointing: bool = True,
) -> RowStatistics:
    """Projects ``M`` rows through the (frozen) output head chunk by chunk and returns `RowStatistics`.

    Args:
        student_hidden (`[M, H]`): drafter hidden states of the supervised slots (carry the gradient).
        teacher_hidden (`[M, H]`): the target's final-normed hidden state at the position before each slot, so its
            logits are the target's distribution for the slot's token.
        data_labels (`[M]`): the data token of each slot.
        lm_head_weight (`[V, H]`), lm_head_bias (`[V]`): the target's output head, detached here so no gradient
            reaches the target.
        divergences (`tuple[str, ...]`): which of ``"forward_kl"`` and ``"reverse_kl"`` to compute (the others are
            zeros); `LOSS_DIVERGENCES` names what each loss type needs.
        checkpointing (`bool`): recompute each chunk's ``[chunk, V]`` logits in backward instead of keeping them
            (bounded memory; about 1.6x the loss time on a CPU, where memory is rarely the limit).
    """
    weight = lm_head_weight.detach()
    bias = lm_head_bias.detach() if lm_head_bias is not None else None
    chunks = []
    # At least one (possibly empty) chunk, so a micro-batch without supervised rows still yields [0] tensors.
    for start in range(0, max(student_hidden.shape[0], 1), chunk_size):
        rows = slice(start, start + chunk_size)
        args = (
            student_hidden[rows],
            teacher_hidden[rows].detach(),
            data_labels[rows],
            weight,
            bias,
            temperature,
            tuple(divergences),
        )
        if checkpointing and torch.is_grad_enabled() and student_hidden.requires_grad:
            # Recompute the [chunk, V] logits in backward instead of keeping them for every chunk.
            chunks.append(checkpoint(_chunk_statistics, *args, use_reentrant=False))
        else:
            chunks.append(_chunk_statistics(*args))
    return RowStatistics(*(torch.cat(parts) for parts in zip(*chunks)))


def total_weight(weights: torch.Tensor) -> torch.Tensor:
    """``W = sum(w) + 1e-6``, the normaliser of every loss (docs/algorithm.md §4.6)."""
    return weights.sum() + 1e-6


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / total_weight(weights)


def clipped_reverse_kl(
    reverse_kl: torch.Tensor, weights: torch.Tensor, clip_tau: float | None, clip_mode: str = "reference"
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaFlash's clipped reverse KL (docs/algorithm.md §4.9) and the mask of clipped rows.

    ``clip_mode="reference"`` reproduces the reference code: ``r_i = KL_i / W`` is clipped at ``tau`` *after* the
    division, so the effective per-token cap is ``tau * W`` and grows with the number of anchors; the loss is
    ``sum_i w_i min(r_i, tau)``. ``clip_mode="per_token"`` caps each token's KL at ``tau`` itself:
    ``sum_i w_i min(KL_i, tau) / W``. Both equal the weighted mean KL without clipping (``tau`` ``None`` or
    ``<= 0``). A clipped row gets zero gradient (``clamp`` is flat there), which is the point of the clip: rows the
    drafter cannot match yet do not dominate the update.

    Args:
        reverse_kl (`[M]`): ``T^2 KL(p_S || p_T)`` per row. weights (`[M]`): loss weights ``w``.
    Returns:
        ``(loss, clipped)`` with ``clipped`` a ``[M]`` bool mask of rows over the cap that carry weight.
    """
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode={clip_mode!r} must be one of {CLIP_MODES}")
    norm = total_weight(weights)
    per_row = reverse_kl / norm if clip_mode == "reference" else reverse_kl
    if clip_tau is None or clip_tau <= 0:
        clipped = torch.zeros_like(per_row, dtype=torch.bool)
    else:
        clipped = (per_row > clip_tau) & (weights > 1e-8)
        per_row = per_row.clamp(max=clip_tau)
    loss = (weights * per_row).sum()
    return (loss if clip_mode == "reference" else loss / norm), clipped


def drafting_loss(
    stats: RowStatistics,
    weights: torch.Tensor,
    loss_type: str,
    alpha: float = 0.8,
    clip_tau: float | None = 0.01,
    clip_mode: str = "reference",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The drafter loss for ``loss_type`` and its parts (detached) for logging.

    - ``"opd"`` (AdaFlash, docs/algorithm.md §4.9): ``alpha * CE(teacher argmax) + (1 - alpha) * clipped reverse KL``.
    - ``"ce"`` (OSD baseline, docs/algorithm.md §4.7): CE on the data tokens (the generated response).
    - ``"fkl"`` (DFlash-style KD, docs/algorithm.md §4.8 with ``a = 0``): forward ``KL(p_T || p_S)``.
    """
    if loss_type == "opd":
        ce = weighted_mean(stats.ce_teacher, weights)
        rkl, clipped = clipped_reverse_kl(stats.reverse_kl, weights, clip_tau, clip_mode)
        supervised = (weights > 1e-8).sum().clamp(min=1)
        parts = {"ce": ce, "reverse_kl": rkl, "clip_ratio": clipped.sum() / supervised}
        return alpha * ce + (1 - alpha) * rkl, {k: v.detach() for k, v in parts.items()}
    if loss_type == "ce":
        loss = weighted_mean(stats.ce_data, weights)
        return loss, {"ce": loss.detach()}
    if loss_type == "fkl":
        loss = weighted_mean(stats.forward_kl, weights)
        return loss, {"forward_kl": loss.detach()}
    raise ValueError(f"loss_type={loss_type!r} must be one of {LOSS_TYPES}")


def accepted_drafts(matches: torch.BoolTensor) -> torch.LongTensor:
    """``[..., bs] -> [...]``: the leading run of matching draft slots 1..bs-1 (slot 0, the anchor, is ignored).

    On target-greedy data with labels = the target's tokens this is exactly the number of drafts greedy speculative
    decoding accepts at that anchor, so ``accepted + 1`` is the acceptance length of the step."""
    return leading_true(matches[..., 1:])


def length_head_labels(
    accepted: torch.LongTensor,
    block_size: int,
    lookahead: int = 1,
    direct_len: bool = True,
    draft_confidence: torch.Tensor | None = None,
) -> torch.Tensor:
    """Targets of the adaptive length head per block (docs/algorithm.md §6.2).

    ``direct_len``: ``clamp(accepted + lookahead, 0, bs) / bs``, the normalised ideal verify length (anchor plus
    accepted drafts). Threshold mode: ``1 - prod_{i=1}^{idx+1} conf_i`` at ``idx = clamp(accepted + lookahead, 0,
    bs - 2)``, and 1 when every draft is accepted; ``draft_confidence`` is ``[..., bs]``, the drafter's top
    probability per slot.
    """
    if direct_len:
        return (accepted + lookahead).clamp(0, block_size).float() / block_size
    if draft_confidence is None:
        raise ValueError("length_head_labels(direct_len=False) needs draft_confidence [..., block_size]")
    cumulative = draft_confidence[..., 1:].float().cumprod(dim=-1)  # cum[j] = prod_{i=1}^{j+1} conf_i
    index = (accepted + lookahead).clamp(0, block_size - 2).unsqueeze(-1)
    labels = 1 - cumulative.gather(-1, index).squeeze(-1)
    return torch.where(accepted >= block_size - 1, torch.ones_like(labels), labels).clamp(0, 1)


def length_head_loss(
    prediction: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, kind: str = "mse"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(pred - label)^2`` (``"mse"``) or ``|pred - label|`` (``"mae"``) over kept blocks (docs/algorithm.md
    §6.3), and the monitoring mean absolute error. ``prediction``, ``labels``, ``keep``: ``[B, N]``."""
    if kind not in LENGTH_LOSSES:
        raise ValueError(f"length head loss {kind!r} must be one of {LENGTH_LOSSES}")
    keep = keep.to(prediction.dtype)
    error = prediction - labels.to(prediction.dtype)
    per_block = error.square() if kind == "mse" else error.abs()
    norm = keep.sum() + 1e-6
    return (per_block * keep).sum() / norm, (error.detach().abs() * keep).sum() / norm
