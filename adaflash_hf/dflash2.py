"""DFlash 2: in-block local convolutions and a top-K candidate selector, computed as the serving engines do.

A DFlash 2 drafter is a DFlash drafter (docs/algorithm.md §1) with two additions, still one drafter forward per block
(the reference is the engines' code: `speculators` 0.9.0 ``models/dflash2``, SGLang 0.5.23 ``models/dflash.py``):

* **Local convolutions.** Every decoder layer wraps its attention and its MLP in a grouped *dynamic* causal
  convolution along the block: ``prepare`` convolves the sublayer's input, ``finish`` its output, both with kernels
  ``base[side, tap] + delta[side, tap, group]`` where ``delta`` comes from one linear projection of the sublayer's
  input (``kernel_projection``: ``H -> 2 * taps * groups``). Tap ``t`` reads the slot ``t`` places earlier *in the
  same block* (slots before the block's start read zero), and the ``group_size`` channels of a group share one
  dynamic coefficient. Initialised as identities (``base[:, 0] = 1``, zero projection), so a fresh DFlash 2 drafter
  computes exactly what the DFlash drafter it grows from does.
* **Candidate selector.** The target's LM head gives unary logits at every draft slot; the selector keeps their
  top ``K`` and rescores candidate ``c`` after predecessor token ``p`` with a rank-``r`` bilinear transition:
  ``score(p, c) = unary[c] + <A[p] * W h, B[c]>`` (``A``, ``B``: ``[V, r]`` codebooks, ``W``: ``H -> r``, ``h``: the
  slot's final-normed hidden state). The draft is one path through the ``K``-wide lattice, walked slot by slot from
  the anchor: each slot's predecessor is the token the walk chose at the slot before (the verified anchor for the
  first). Greedy takes the best score; sampling draws from ``softmax(score / T)`` over the ``K`` candidates.

Trained (speculators' ``compute_selector_loss``) by a ``K``-way cross-entropy with teacher forcing: the candidates
are the student's unary top ``K`` with the teacher's token injected at rank ``K - 1`` when it is missing, the
predecessor is the data token before the slot.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
    MuseGlimmerAssistantDecoderLayer as DFlashDecoderLayer,
)

DRAFTER_TYPES = ("dflash", "dflash2")
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def grouped_dynamic_conv(
    hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """The grouped dynamic causal convolution of one side of a sublayer, within each block.

    hidden ``[B, Q, H]`` (``Q`` slots, block ``n`` at ``[n * block_size, (n + 1) * block_size)``), delta
    ``[B, Q, taps, G]`` (``G = H / group_size``), base ``[taps, H]``. Returns ``[B, Q, H]`` with
    ``out[q] = sum_t (base[t] + delta[q, t]) * hidden[q - t]`` over the taps ``t`` that stay inside ``q``'s block.
    """
    taps, num_groups = base.shape[0], hidden.shape[-1] // group_size
    blocks = hidden.unflatten(-1, (num_groups, group_size))  # [B, Q, G, g]
    coefficients = base.to(hidden.dtype).view(taps, num_groups, group_size) + delta.unsqueeze(-1)  # [B, Q, t, G, g]
    out = coefficients[:, :, 0] * blocks
    slot = torch.arange(hidden.shape[1], device=hidden.device) % block_size
    for tap in range(1, taps):
        shifted = nn.functional.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        shifted = shifted * (slot >= tap).view(1, -1, 1, 1).to(hidden.dtype)
        out = out + coefficients[:, :, tap] * shifted
    return out.flatten(-2)


class GroupedDynamicConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, driven by one projection of its input.

    Tensor names and layout (``base_kernel [2, taps, H]``, ``kernel_projection.weight [2 * taps * G, H]``) are those
    of the engines' checkpoints.
    """

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: a DFlash 2 layer with fresh convolutions computes what its DFlash layer does."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolves the sublayer's input; returns it with the output side's dynamic kernel."""
        kernels = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.num_groups)
        convolved = grouped_dynamic_conv(hidden, kernels[..., 0, :, :], self.base_kernel[0], *self._geometry())
        return convolved, kernels[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Convolves the sublayer's output with the kernel `prepare` returned."""
        return grouped_dynamic_conv(hidden, delta, self.base_kernel[1], *self._geometry())

    def _geometry(self) -> tuple[int, int]:
        return self.block_size, self.group_size


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """The DFlash decoder layer with a local convolution around its attention and its MLP."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        geometry = (config.hidden_size, config.block_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*geometry)
        self.mlp_conv = GroupedDynamicConv(*geometry)

    def forward(
        self, hidden_states, context_hidden_states, position_embeddings, attention_mask=None, cache=None, **kw
    ):
        residual = hidden_states
        hidden_states, kernel = self.attention_conv.prepare(self.input_layernorm(hidden_states))
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            context_hidden_states=context_hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kw,
        )
        hidden_states = residual + self.attention_conv.finish(hidden_states, kernel)
        residual = hidden_states
        hidden_states, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states))
        return residual + self.mlp_conv.finish(self.mlp(hidden_states), kernel)


class CandidateSelector(nn.Module):
    """The bilinear predecessor/hidden/candidate scorer applied to the unary top-K (engines' tensor names)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def transition_scores(
        self, hidden: torch.Tensor, predecessors: torch.LongTensor, candidates: torch.LongTensor
    ) -> torch.Tensor:
        """``<A[p] * W h, B[c]>``: hidden ``[..., H]``, predecessors ``[...]`` (or ``[..., P]``), candidates
        ``[..., K]`` -> ``[..., K]`` (or ``[..., P, K]``: every predecessor against every candidate)."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        predecessor = self.predecessor_codebook[predecessors]
        if predecessors.dim() == projected.dim():  # [..., P]: one context per predecessor
            context = predecessor * projected.unsqueeze(-2)
            return torch.einsum("...pr,...cr->...pc", context, self.successor_codebook[candidates]).float()
        context = predecessor * projected
        return (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1).float()


def training_candidates(
    candidate_ids: torch.LongTensor, target_ids: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor, torch.Tensor]:
    """speculators' ``selector_training_candidates``: the unary top-K ``[..., K]`` with the target ``[...]`` put in
    the weakest slot where it is missing, so every row has a K-way label. Returns ``(candidates, label positions,
    contains)``, ``contains`` marking rows whose unary top-K already held the target (the selector's recall)."""
    top_k = candidate_ids.shape[-1]
    matches = candidate_ids.eq(target_ids.unsqueeze(-1))
    contains = matches.any(-1)
    positions = torch.where(contains, matches.long().argmax(-1), torch.full_like(target_ids, top_k - 1))
    candidates = candidate_ids.clone()
    candidates[..., -1] = torch.where(contains, candidate_ids[..., -1], target_ids)
    return candidates, positions, contains


def walk_selector(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    anchors: torch.LongTensor,
    temperature: float | None,
    process=None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """The selector's path through a drafted block, slot by slot as the engines walk it.

    hidden ``[B, n, H]``: final-normed drafter states of draft slots ``1..n``; logits ``[B, n, V]``: their unary
    logits after the call's logits processors; anchors ``[B]``: the verified token before slot 1. ``temperature``
    ``None``: greedy (the best score); else a sample from ``softmax(unary + transition / T)`` over the candidates,
    which is SGLang's ``softmax((raw + transition) / T)`` when temperature is the only processor (the processed
    unary logits already carry ``1 / T``). ``process(i, tokens)`` (optional) processes slot ``i``'s logits in place
    given the tokens chosen before it, for processors that read the ids.

    Returns ``(tokens [B, n], scores [B, n, V])``: the path and, per slot, the selector's scores of its ``K``
    candidates after the path's predecessor (``-inf`` elsewhere). ``softmax(scores)`` is the proposal ``q`` of each
    slot given the path before it; under sampling, the path's token is a sample from it.
    """
    batch, width = logits.shape[:2]
    top_k = min(selector.top_k, logits.shape[-1])
    tokens = anchors.new_empty(batch, width)
    scores = torch.full_like(logits, float("-inf"))
    previous = anchors.to(logits.device)
    for i in range(width):
        if process is not None:
            process(i, tokens[:, :i])
        unary, candidates = logits[:, i].topk(top_k, dim=-1)
        transition = selector.transition_scores(hidden[:, i], previous.to(hidden.device), candidates.to(hidden.device))
        slot_scores = unary + transition.to(unary.device) / (temperature or 1.0)
        if temperature is None:
            choice = slot_scores.argmax(-1)
        else:
            choice = torch.multinomial(torch.softmax(slot_scores, dim=-1), 1).squeeze(-1)
        previous = candidates.gather(-1, choice[:, None]).squeeze(-1)
        tokens[:, i] = previous
        scores[:, i].scatter_(-1, candidates, slot_scores)
    return tokens, scores


__all__ = [
    "DFLASH2_ARCHITECTURE",
    "DRAFTER_TYPES",
    "CandidateSelector",
    "DFlash2DecoderLayer",
    "GroupedDynamicConv",
    "grouped_dynamic_conv",
    "training_candidates",
    "walk_selector",
]
