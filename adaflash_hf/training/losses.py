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

from ..dflash2 import training_candidates
from ..draft_vocab_rows import vocab_rows
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
    # DFlash 2's selector (`selector_top_k`; ``[M, 0]`` / empty otherwise): the student's unary top-K with the teacher
    # argmax injected at rank K where missing (`dflash2.training_candidates`), their unary logits (differentiable),
    # the teacher token's rank among them, and whether the unary top-K already held it (the candidate recall).
    selector_candidates: torch.Tensor | None = None
    selector_unary: torch.Tensor | None = None
    selector_labels: torch.Tensor | None = None
    selector_recall: torch.Tensor | None = None


@dataclass
class TeacherTop:
    """The teacher's full-vocabulary argmax and log-sum-exp of its logits per row (``[M]`` each): all a
    reduced-vocabulary loss needs of the whole vocabulary (`adaflash_hf.training.FeatureCache` stores them)."""

    argmax: torch.LongTensor
    logsumexp: torch.Tensor


@torch.no_grad()
def teacher_top(teacher_hidden, weight, bias=None, chunk_size: int = 1024) -> TeacherTop:
    """`TeacherTop` of ``teacher_hidden [M, H]`` under the head ``weight [V, H]``, ``chunk_size`` rows at a time."""
    argmax, lse = [], []
    for start in range(0, max(teacher_hidden.shape[0], 1), chunk_size):
        logits = F.linear(teacher_hidden[start : start + chunk_size].to(weight.dtype), weight, bias).float()
        argmax.append(logits.argmax(dim=-1))
        lse.append(logits.logsumexp(dim=-1))
    return TeacherTop(torch.cat(argmax), torch.cat(lse))


def _chunk_statistics(
    student_hidden,
    teacher_hidden,
    data_labels,
    weight,
    bias,
    temperature,
    divergences,
    vocab=None,
    top=None,
    selector_top_k=0,
):
    """Row statistics of one chunk. With a draft vocabulary, ``weight``/``bias`` are its rows only, ``data_labels``
    and ``top.argmax`` are already mapped to its indices (-1: outside it), and ``top.logsumexp`` normalises the
    teacher over the whole vocabulary."""
    student_logits = F.linear(student_hidden.to(weight.dtype), weight, bias).float()
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden.to(weight.dtype), weight, bias).float()
        if top is None:
            teacher_argmax = teacher_logits.argmax(dim=-1)
            teacher_logp = F.log_softmax(teacher_logits / temperature, dim=-1) if divergences else None
        else:
            teacher_argmax = top.argmax
            # log p_T over the draft vocabulary's rows, normalised over the whole vocabulary.
            teacher_logp = teacher_logits / temperature - top.logsumexp.unsqueeze(-1)
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
    ce_teacher = _nll(student_logp_raw, teacher_argmax)
    ce_data = _nll(student_logp_raw, data_labels)
    if vocab is not None:  # back to target token ids
        student_argmax = vocab[student_argmax]
        teacher_argmax = top.full_argmax
    rows = student_logits.shape[0]
    candidates = student_logits.new_zeros((rows, selector_top_k), dtype=torch.long)
    labels = candidates.new_zeros(rows)
    recall = torch.zeros(rows, dtype=torch.bool, device=student_logits.device)
    if selector_top_k:  # DFlash 2 drafts over the whole vocabulary (no `vocab`): logit indices are token ids
        with torch.no_grad():
            top_ids = student_logits.topk(selector_top_k, dim=-1).indices
        candidates, labels, recall = training_candidates(top_ids, teacher_argmax)
    unary = student_logits.gather(-1, candidates)
    stats = (ce_teacher, ce_data, forward_kl, reverse_kl, student_argmax, teacher_argmax, top_logp.exp())
    return (*stats, candidates, unary, labels, recall)


def _nll(logp: torch.Tensor, labels: torch.LongTensor) -> torch.Tensor:
    """Per-row negative log-likelihood; 0 for labels outside a draft vocabulary (-1), which no draft can match."""
    inside = labels >= 0
    nll = F.nll_loss(logp, labels.clamp(min=0), reduction="none")
    return torch.where(inside, nll, torch.zeros_like(nll))


@dataclass
class _MappedTop:
    argmax: torch.LongTensor  # in draft-vocabulary indices, -1 outside it
    logsumexp: torch.Tensor
    full_argmax: torch.LongTensor  # target token ids


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
    draft_vocab: torch.LongTensor | None = None,
    teacher: TeacherTop | None = None,
    selector_top_k: int = 0,
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
            (bounded memory, at the price of projecting every chunk a second time).
        draft_vocab (`[V_d]`, *optional*): the drafter's reduced vocabulary (``AdaFlashConfig.draft_vocab``). The
            student is a distribution over these tokens only, as at inference: its logits use only these rows of
            the head (``V_d / V`` of the cost). The teacher stays the whole-vocabulary target: its argmax and
            log-sum-exp come from ``teacher`` (or one no-grad pass over the whole head), so the reverse KL is exact
            (the student has no mass elsewhere); the forward KL covers the draft vocabulary's share of the teacher;
            a cross-entropy whose label lies outside the draft vocabulary is 0 (no draft can match it).
        teacher (`TeacherTop`, *optional*): the teacher's whole-vocabulary argmax and log-sum-exp per row, when the
            caller has them (stored features); only read with ``draft_vocab`` at temperature 1.
        selector_top_k (`int`): a DFlash 2 drafter's ``K``: also return its selector's training candidates
            (`RowStatistics.selector_*`, for `selector_loss`); 0: none. Needs the whole vocabulary.
    """
    if selector_top_k and draft_vocab is not None:
        raise ValueError("the DFlash 2 selector's candidates are token ids of the whole vocabulary: no draft_vocab")
    weight = lm_head_weight.detach()
    bias = lm_head_bias.detach() if lm_head_bias is not None else None
    top = None
    if draft_vocab is not None:
        draft_vocab = draft_vocab.to(weight.device)
        if teacher is None or temperature != 1.0:
            # The teacher's normaliser at the loss temperature (stored statistics are at temperature 1).
            scaled = (
                (weight, bias)
                if temperature == 1.0
                else (weight / temperature, None if bias is None else bias / temperature)
            )
            teacher = teacher_top(teacher_hidden.detach(), *scaled)
        index = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
        index[draft_vocab] = torch.arange(draft_vocab.shape[0], device=weight.device)
        data_labels = index[data_labels]
        top = _MappedTop(index[teacher.argmax], teacher.logsumexp, teacher.argmax)
        weight, bias = vocab_rows(weight, draft_vocab), vocab_rows(bias, draft_vocab)
    chunks = []
    # At least one (possibly empty) chunk, so a micro-batch without supervised rows still yields [0] tensors.
    for start in range(0, max(student_hidden.shape[0], 1), chunk_size):
        rows = slice(start, start + chunk_size)
        chunk_top = (
            None if top is None else _MappedTop(*(t[rows] for t in (top.argmax, top.logsumexp, top.full_argmax)))
        )
        args = (
            student_hidden[rows],
            teacher_hidden[rows].detach(),
            data_labels[rows],
            weight,
            bias,
            temperature,
            tuple(divergences),
            draft_vocab,
            chunk_top,
            selector_top_k,
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


def selector_loss(
    selector, student_hidden: torch.Tensor, predecessors: torch.LongTensor, stats: RowStatistics, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A DFlash 2 drafter's candidate-selector loss (speculators' ``compute_selector_loss``) and its metrics.

    The K-way cross-entropy of ``unary + transition(predecessor, candidate)`` over `row_statistics`' training
    candidates (the student's unary top-K, the teacher's token injected at rank K where missing), teacher-forced: each
    row's predecessor is the data token before its slot. Both the unary logits and the selector get its gradient.
    Weighted by the slots' loss weights as the drafting loss is.

    Args:
        selector (`CandidateSelector`): the drafter's. student_hidden (`[M, H]`): its final-normed slot states.
        predecessors (`[M]`): the token before each slot. stats: `row_statistics(..., selector_top_k=K)`'s.
        weights (`[M]`): the slots' loss weights.
    Returns:
        ``(loss, parts)``; parts (detached): ``selector_ce``, ``recall`` (share of rows whose unary top-K held the
        teacher's token: the most the selector can draft right) and ``accuracy`` (the selector's teacher-forced pick is
        the teacher's token, over the rows whose top-K held it, as speculators counts it).
    """
    transition = selector.transition_scores(student_hidden, predecessors, stats.selector_candidates)
    logits = stats.selector_unary.float() + transition
    ce = F.cross_entropy(logits, stats.selector_labels, reduction="none") if logits.numel() else logits.sum(-1)
    loss = weighted_mean(ce, weights)
    with torch.no_grad():
        recall = stats.selector_recall
        right = (logits.argmax(-1) == stats.selector_labels) & recall if logits.numel() else recall
        parts = {
            "selector_ce": loss.detach(),
            "recall": recall.float().mean() if recall.numel() else loss.new_zeros(()),
            "accuracy": right.sum() / recall.sum().clamp(min=1),
        }
    return loss, parts


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
