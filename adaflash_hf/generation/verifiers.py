"""Verification of a step's drafts by the target: one forward, then the acceptance rule; linear blocks here.

A verifier takes the step's anchors and drafts, runs the target once over them against the cache (`TargetForward`)
and returns a `Verified`: the tokens each row commits, in order (its accepted drafts, then the target's own token),
with the target logits and drafter features behind them. The loop commits a `Verified` the same way whichever
verifier made it; `LinearVerifier` verifies each row's block prefix (here), `tree.TreeVerifier` a draft tree.

Where exactness lives: the committed tokens are decided by the acceptance rule (`acceptance.py`: greedy identity, or
speculative sampling against the drafter's own distribution), applied to the target's logits processed as plain
decoding processes them (`processing.process_positions`); a row plain decoding has stopped and pads gets padding
whatever the target predicts, as plain decoding appends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .acceptance import greedy_acceptance, speculative_sampling
from .cache import TargetCache
from .processing import process_positions
from .verify_layout import VerifyLayout


@dataclass
class Verified:
    """What one verification commits, per active row.

    committed ``[B, n]``: accepted drafts, then the target's token (row ``b`` commits ``accepted[b] + 1`` of them).
    accepted ``[B]``: drafts accepted. offered ``[B]``: drafts verified. depth ``[B]``: the longest path they
    allowed (``offered`` for a linear block; a tree's deepest node).
    processed / raw ``[B, width, V]``: float32 target logits behind ``committed`` (position ``i`` is the target's
    distribution for ``committed[:, i]``), processed as plain decoding processes them, and as they came.
    width: tokens per row in the forward (the cache gained that many columns per row, in commit order).
    features ``[B, width, K * H]``: the drafter's context from the verified columns, in commit order.
    trial: the forward timed a GEMM layout (`verify_layout.py`), a one-off cost.
    verified_at: the recorder's clock after the forward.
    by_source: with merged n-gram paths (`tree.py`), ``{"drafter": (accepted, offered), "ngram": (accepted,
    offered)}``, ``[B]`` each: the leading nodes of the accepted path each source proposed, and its deepest node
    (``None`` otherwise).
    """

    committed: torch.LongTensor
    accepted: torch.LongTensor
    offered: torch.LongTensor
    depth: torch.LongTensor
    processed: torch.Tensor
    raw: torch.Tensor
    width: int
    features: torch.Tensor
    trial: bool
    verified_at: float
    by_source: dict[str, tuple[torch.LongTensor, torch.LongTensor]] | None = None


@dataclass
class History:
    """The ids the logits processors read: row ``b`` of the step is ``sequences[rows[b], :lengths[b]]``."""

    sequences: torch.LongTensor
    lengths: torch.LongTensor
    rows: torch.LongTensor


class TargetForward:
    """One verification forward of the target against its cache, in the measured GEMM layout.

    Args:
        target: the target model. cache (`TargetCache`): its cache. layout (`VerifyLayout`): the GEMM layout.
        processors: the call's logits processors. hidden_layers: the hidden states the drafter reads.
        context_features: hidden states -> the drafter's context features. clock: the recorder's clock.
    """

    def __init__(
        self,
        target,
        cache: TargetCache,
        layout: VerifyLayout,
        processors,
        hidden_layers,
        context_features,
        clock: Callable[[], float],
    ):
        self.target, self.cache, self.layout, self.processors = target, cache, layout, processors
        self.hidden_layers, self.context_features, self.clock = hidden_layers, context_features, clock

    def __call__(self, ids, attention_mask, position_ids, tokens, history: History):
        """Runs ``ids [B, W]``; returns ``(raw, processed, features, trial, clock)``, position ``i`` of ``processed``
        seeing the row's history then ``tokens[:, :i]``."""
        with self.layout.forward(ids.numel()) as trial:
            outputs = self.target(
                input_ids=ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=self.cache.cache,
                use_cache=True,
                output_hidden_states=self.hidden_layers,
            )
        verified_at = self.clock()
        raw = outputs.logits.float()
        processed = raw  # processors change the logits in place: on a copy, the raw ones are an output too
        if len(self.processors):
            processed, _ = process_positions(
                self.processors, history.sequences, history.lengths, raw.clone(), tokens=tokens, rows=history.rows
            )
        return raw, processed, self.context_features(outputs.hidden_states), trial, verified_at


class LinearVerifier:
    """Verifies ``[anchor, drafts[:num_drafts]]`` per row, padded to the widest row (padding masked).

    Args:
        forward (`TargetForward`): the target's verification forward.
        do_sample (`bool`): speculative sampling, else greedy identity.
        pad_token_id (`int`): what a stopped row gets.
    """

    def __init__(self, forward: TargetForward, do_sample: bool, pad_token_id: int):
        self.forward, self.do_sample, self.pad_token_id = forward, do_sample, pad_token_id

    def verify(self, anchors, drafts, positions, history: History, padded: torch.Tensor | None) -> Verified:
        """anchors ``[B]``, drafts (`candidate_generator.Drafts`), positions ``[B]``: the anchors' positions;
        padded ``[B]``: rows plain decoding has stopped and pads (``None``: none)."""
        num_drafts = drafts.num_drafts
        width = int(num_drafts.max()) + 1
        tokens = drafts.tokens[:, : width - 1]
        if padded is not None:
            tokens = tokens.masked_fill(padded[:, None], self.pad_token_id)
        ids = torch.cat([anchors[:, None], tokens], dim=1)
        offsets = torch.arange(width, device=ids.device)
        fed = offsets <= num_drafts[:, None]  # [B, width]: padding beyond a row's drafts is masked
        attention_mask = self.forward.cache.extended_mask(fed)
        raw, processed, features, trial, at = self.forward(
            ids, attention_mask, positions[:, None] + offsets, tokens, history
        )
        if self.do_sample:
            draft_probs = drafts.probs[:, : width - 1] if drafts.probs is not None else processed[:, :0]
            accepted, following = speculative_sampling(tokens, draft_probs, torch.softmax(processed, -1), num_drafts)
        else:
            accepted, following = greedy_acceptance(tokens, processed, num_drafts)
        if padded is not None:
            accepted = torch.where(padded, num_drafts, accepted)
            following = following.masked_fill(padded, self.pad_token_id)
        committed = torch.cat([tokens, following[:, None]], dim=1).scatter(1, accepted[:, None], following[:, None])
        return Verified(committed, accepted, num_drafts, num_drafts, processed, raw, width, features, trial, at)
