"""Which drafted tokens the target accepts: greedy matching and speculative (rejection) sampling, batched.

Both rules see, per row ``b``, ``num_drafts[b]`` drafts (rows are padded to a common width ``k``) and the target's
*processed* logits at ``k + 1`` positions: position ``i`` predicts the token after the anchor and drafts ``< i``.
They return the number of leading drafts accepted and the next token (the correction at the first rejection, or the
bonus after full acceptance), so every row emits ``accepted + 1`` tokens.

Why each is lossless:

* greedy: a draft is kept iff it equals the target's argmax given the same prefix, so the emitted tokens are exactly
  the target's greedy tokens;
* sampling (Leviathan et al. 2023, Alg. 1): draft ``x ~ q`` is kept with probability ``min(1, p(x) / q(x))``, else
  the token is drawn from ``norm(max(p - q, 0))``; the emitted token is then distributed as ``p`` exactly. This needs
  the drafts to be *samples* from ``q``, the drafter's distribution after the same logits processors as the target.
"""

from __future__ import annotations

import torch

from .processing import argmax


def leading_true(flags: torch.Tensor) -> torch.LongTensor:
    """Length of the leading run of True per row: ``[B, k] -> [B]``."""
    return (~flags).int().cumsum(dim=-1).eq(0).sum(dim=-1)


def _valid(num_drafts: torch.LongTensor, width: int) -> torch.Tensor:
    return torch.arange(width, device=num_drafts.device) < num_drafts[:, None]


def greedy_acceptance(
    drafts: torch.LongTensor, target_logits: torch.Tensor, num_drafts: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """drafts ``[B, k]``, target_logits ``[B, k + 1, V]``, num_drafts ``[B]`` -> (accepted ``[B]``, next ``[B]``)."""
    choice = argmax(target_logits)
    if drafts.shape[1] == 0:  # a plain step (the planner's): nothing to match, the target's token follows
        return choice.new_zeros(choice.shape[0]), choice[:, 0]
    accepted = leading_true((drafts == choice[:, :-1]) & _valid(num_drafts, drafts.shape[1]))
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def speculative_sampling(
    drafts: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_drafts: torch.LongTensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """drafts ``[B, k]`` sampled from draft_probs ``[B, k, V]``; target_probs ``[B, k + 1, V]``.

    Returns (accepted ``[B]``, next ``[B]``). Rows with ``num_drafts == 0`` reduce to plain sampling from ``p``.
    """
    width = drafts.shape[1]
    p = target_probs[:, :width].gather(-1, drafts[..., None]).squeeze(-1)
    q = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    keep = torch.rand_like(p) * q <= p  # r <= p / q without dividing by a zero q
    accepted = leading_true(keep & _valid(num_drafts, width))

    rows = torch.arange(drafts.shape[0], device=drafts.device)
    p_next = target_probs[rows, accepted]
    rejected = accepted < num_drafts
    if rejected.any():
        q_next = draft_probs[rows, accepted.clamp(max=width - 1)]
        residual = (p_next - q_next).clamp(min=0)
        # p == q leaves no residual mass; the rejection then had probability 0, so p itself is the right fallback
        usable = rejected & (residual.sum(-1) > 0)
        p_next = torch.where(usable[:, None], residual, p_next)
    return accepted, torch.multinomial(p_next / p_next.sum(-1, keepdim=True), 1).squeeze(1)
