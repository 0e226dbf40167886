"""The block layout of DFlash training (docs/algorithm.md §4.2-4.6): anchors, noise ids, positions, attention mask,
labels, weights.

One training forward drafts ``N`` overlapping blocks of ``block_size`` slots per sequence. Block ``n`` starts at the
anchor ``a_n`` (a committed response token) and slot ``k`` is trained to output the token at ``a_n + k``: the exact
view the drafter has at inference when ``a_n`` is the last committed token. All functions are pure tensor functions.

Shapes: ``B`` sequences of length ``S``, ``N`` blocks per sequence, ``bs`` = block size, ``Q = N * bs`` query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockLayout:
    """Where the blocks of one micro-batch sit.

    Attributes:
        anchors (`LongTensor [B, N]`): anchor positions, ascending per row; 0 for dropped blocks.
        keep (`BoolTensor [B, N]`): False for blocks a row could not fill (rows with fewer candidates than ``N``).
        block_size (`int`): slots per block, the anchor included.
    """

    anchors: torch.LongTensor
    keep: torch.BoolTensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def to(self, device) -> BlockLayout:
        return BlockLayout(anchors=self.anchors.to(device), keep=self.keep.to(device), block_size=self.block_size)

    def slot_positions(self) -> torch.LongTensor:
        """``[B, N, bs]`` absolute positions ``a_n + k`` of every slot."""
        offsets = torch.arange(self.block_size, device=self.anchors.device)
        return self.anchors.unsqueeze(-1) + offsets


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator | None = None
) -> BlockLayout:
    """Draws up to ``num_anchors`` distinct anchors per row among response positions (docs/algorithm.md §4.2).

    Candidates are positions ``0 .. S - bs`` whose token is a response token (``loss_mask [B, S]`` > 0.5), so every
    slot of a block lies inside the sequence. ``N = min(num_anchors, max_b c_b - 1)`` as in the reference code (the
    ``- 1`` is kept for fidelity). Each row draws ``N`` candidates uniformly without replacement (a random-key sort)
    and sorts them; rows with ``c_b < N`` keep only their first ``c_b`` blocks.
    """
    batch, seq_len = loss_mask.shape
    if seq_len <= block_size:
        raise ValueError(
            f"Sequences of length {seq_len} are too short for block_size={block_size}: every sequence needs more than "
            "block_size tokens. Raise max_completion_length or use shorter prompts."
        )
    candidates = loss_mask[:, : seq_len - block_size + 1] > 0.5
    counts = candidates.sum(dim=1)
    num_blocks = min(num_anchors, int(counts.max()) - 1)
    if num_blocks <= 0:
        raise ValueError(
            f"No sequence in the batch has at least 2 response tokens in positions [0, S - block_size] "
            f"(S={seq_len}, block_size={block_size}), so no anchor can be drawn. Generate longer responses "
            "(max_completion_length) or drop rows whose response is shorter than block_size + 1 tokens."
        )
    keys = torch.rand(candidates.shape, generator=generator, device=loss_mask.device)
    keys = keys.masked_fill(~candidates, 2.0)  # non-candidates sort after every candidate
    picked = keys.topk(num_blocks, dim=1, largest=False).indices
    # Rows with c_b < N also pick non-candidates; sorting them past every real position leaves the c_b real anchors
    # first and ascending, which is what `keep` marks.
    is_candidate = candidates.gather(1, picked)
    anchors = (picked + (~is_candidate) * seq_len).sort(dim=1).values
    keep = torch.arange(num_blocks, device=loss_mask.device) < counts.clamp(max=num_blocks).unsqueeze(1)
    anchors = anchors.masked_fill(~keep, 0)
    return BlockLayout(anchors=anchors, keep=keep, block_size=block_size)


def block_noise_ids(input_ids: torch.LongTensor, layout: BlockLayout, mask_token_id: int) -> torch.LongTensor:
    """``[B, Q]`` ids ``[token_at_anchor, mask * (bs - 1)]`` per block (docs/algorithm.md §4.3), embedded with the
    target's frozen input embeddings. Dropped blocks are all mask tokens."""
    anchor_tokens = input_ids.gather(1, layout.anchors).masked_fill(~layout.keep, mask_token_id)
    ids = torch.full(
        (*layout.anchors.shape, layout.block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = anchor_tokens
    return ids.flatten(1)


def block_position_ids(seq_len: int, layout: BlockLayout) -> torch.LongTensor:
    """``[B, S + Q]``: ``0 .. S-1`` for the context rows, then ``a_n + 0 .. a_n + bs-1`` per block (docs/algorithm.md
    §4.4)."""
    context = torch.arange(seq_len, device=layout.anchors.device).expand(layout.anchors.shape[0], seq_len)
    return torch.cat([context, layout.slot_positions().flatten(1)], dim=1)


def block_attention_mask(seq_len: int, layout: BlockLayout) -> torch.BoolTensor:
    """``[B, 1, Q, S + Q]`` boolean mask, True = attend (docs/algorithm.md §4.5).

    A query of block ``n`` sees context position ``j`` iff ``j < a_n`` (the anchor's own target feature is not yet
    available at inference, hence the strict ``<``) and every slot of its own block (bidirectional); no other block.
    Dropped blocks see nothing; the drafter turns the boolean mask into a finite additive one, so their rows stay
    finite and carry zero loss weight.
    """
    block_size, num_blocks = layout.block_size, layout.num_blocks
    device = layout.anchors.device
    context = torch.arange(seq_len, device=device) < layout.anchors.unsqueeze(-1)  # [B, N, S]
    block_ids = torch.arange(num_blocks * block_size, device=device) // block_size
    own_block = block_ids.unsqueeze(1) == block_ids.unsqueeze(0)  # [Q, Q]
    context = context.repeat_interleave(block_size, dim=1)  # [B, Q, S]
    mask = torch.cat([context, own_block.expand(context.shape[0], -1, -1)], dim=2)
    keep_rows = layout.keep.repeat_interleave(block_size, dim=1)  # [B, Q]
    return (mask & keep_rows.unsqueeze(-1)).unsqueeze(1)


def block_label_positions(seq_len: int, layout: BlockLayout) -> torch.LongTensor:
    """``[B, N, bs]`` positions ``a_n + k`` clamped to ``S - 1``: slot ``k`` predicts the token at ``a_n + k``
    (same-position labels, docs/algorithm.md §8.1); its teacher distribution is the target's logits at ``a_n + k -
    1``."""
    return layout.slot_positions().clamp(max=seq_len - 1)


def block_supervised_mask(loss_mask: torch.Tensor, layout: BlockLayout) -> torch.BoolTensor:
    """``[B, N, bs]`` slots that are supervised: kept block, ``k > 0`` (the anchor is given, never predicted),
    inside the sequence and a response token (docs/algorithm.md §4.6, the unweighted ``binary_eval_mask``)."""
    seq_len = loss_mask.shape[1]
    positions = layout.slot_positions()
    labels = loss_mask.gather(1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions) > 0.5
    not_anchor = torch.arange(layout.block_size, device=positions.device) > 0
    return layout.keep.unsqueeze(-1) & not_anchor & (positions < seq_len) & labels


def block_loss_weights(loss_mask: torch.Tensor, layout: BlockLayout, decay_gamma: float | None) -> torch.Tensor:
    """``[B, N, bs]`` loss weights: the supervised mask times ``exp(-(k - 1) / gamma)`` (docs/algorithm.md §4.6), so
    the first draft slot weighs 1 and later slots, which are accepted less often, weigh less. ``gamma`` ``None`` or
    ``<= 0`` disables the decay."""
    weights = block_supervised_mask(loss_mask, layout).to(torch.float32)
    if decay_gamma is not None and decay_gamma > 0:
        slots = torch.arange(layout.block_size, device=weights.device, dtype=torch.float32)
        weights = weights * torch.exp(-(slots - 1).clamp(min=0) / decay_gamma)
    return weights
