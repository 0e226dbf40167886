"""Logits processors at several positions at once, for the drafter and for the target alike.

Lossless sampling needs the drafter's distribution after *the same* processors the target gets, each position seeing
the ids before it. Processors that ignore the ids (temperature, top-k/p, min-p, ...) run once over all positions;
the others (repetition penalty, n-gram bans, ...) run position by position and row by row, because rows of a batch
hold different numbers of committed tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

_IDS_INDEPENDENT = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
)

TokenChooser = Callable[[torch.Tensor], torch.LongTensor]


def token_chooser(do_sample: bool) -> TokenChooser:
    """argmax, or one sample from softmax, of processed logits ``[N, V] -> [N]``."""
    if do_sample:
        return lambda logits: torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(-1)
    return lambda logits: logits.argmax(dim=-1)


def process_positions(
    processors: LogitsProcessorList,
    sequences: torch.LongTensor,
    lengths: torch.LongTensor,
    logits: torch.Tensor,
    tokens: torch.LongTensor | None = None,
    choose: TokenChooser | None = None,
) -> tuple[torch.Tensor, torch.LongTensor | None]:
    """Processes ``logits [B, n, V]`` (float32, modified in place) position by position.

    Position ``i`` of row ``b`` sees ids ``sequences[b, :lengths[b]] + tokens[b, :i]``. With ``tokens=None`` they are
    chosen on the way by ``choose`` (drafting); otherwise they are given (verification). Returns the processed
    logits and the chosen tokens (``None`` when none were chosen).
    """
    batch, width = logits.shape[:2]
    if all(isinstance(p, _IDS_INDEPENDENT) for p in processors):
        if len(processors):
            flat = logits.view(batch * width, -1)
            logits = processors(sequences[:1].expand(flat.shape[0], -1), flat).view_as(logits)
        return logits, (choose(logits.flatten(0, 1)).view(batch, width) if choose else None)

    chosen = torch.empty(batch, width, dtype=torch.long, device=logits.device) if choose else None
    following = chosen if choose else tokens
    for b in range(batch):
        history = sequences[b, : int(lengths[b])]
        for i in range(width):
            ids = torch.cat([history, following[b, :i]])[None]
            logits[b, i] = processors(ids, logits[b, i][None])[0]
            if choose:
                chosen[b, i] = choose(logits[b, i][None])[0]
    return logits, chosen
