"""Where a generated row ends: where plain decoding stops it, and its tokens up to its first end-of-sequence token.

The decoding loop commits several tokens per step, and a step may accept past the point where plain decoding would
have stopped; `StopRule` finds that point (the earliest of the token budget, the first end-of-sequence token and the
first length at which any other stopping criterion fires), so the loop stops exactly where plain decoding stops.

Batched generate() pads a finished row after its end-of-sequence token until the longest row ends; training
rollouts, online serving and the benchmark all keep only the row's own tokens, with one rule (`cut_after_eos`).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


class StopRule:
    """Where plain decoding stops each row of a batch.

    Args:
        eos (`torch.LongTensor`, *optional*): the end-of-sequence ids (``None``: no EOS criterion).
        stopping_criteria (`StoppingCriteriaList`): the call's criteria; the length and EOS ones are applied here
            directly, the others (stop strings, max time, custom criteria) are called as plain decoding calls them.
        max_new_tokens (`int`): the token budget.
    """

    def __init__(self, eos: torch.LongTensor | None, stopping_criteria, max_new_tokens: int):
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self.criteria = StoppingCriteriaList(
            [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        )

    def cut(self, sequences, lengths, generated, rows, tokens, counts, running, limit: int):
        """Cuts ``counts [B]`` (tokens each active row would commit from ``tokens [B, n]``) where plain decoding
        stops the row; returns ``(counts, stops [B])``, stops marking the rows that stop in this step.

        sequences ``[N, T]``: the batch's ids so far; ``lengths [B]`` and ``generated [B]``: each active row's
        length and new tokens; ``rows [B]``: their indices in the batch; ``running [B]``: rows not stopped yet
        (stopped rows that stay in the batch only pad); ``limit``: the new tokens every row runs to."""
        counts = torch.minimum(counts, limit - generated)
        stops = running & (generated + counts >= self.max_new_tokens)
        is_eos = None if self.eos is None else torch.isin(tokens, self.eos)
        if is_eos is not None and bool(is_eos.any()):  # most steps commit no EOS at all
            is_eos &= torch.arange(tokens.shape[1], device=tokens.device) < counts[:, None]
            hit = is_eos.any(-1) & running
            counts = torch.where(hit, is_eos.int().argmax(-1) + 1, counts)
            stops |= hit
        if len(self.criteria) and bool(running.any()):
            counts, stops = self._criteria(sequences, lengths, rows, tokens, counts, stops, running)
        return counts, stops

    def _criteria(self, sequences, lengths, rows, tokens, counts, stops, running):
        """Calls the other stopping criteria as plain decoding does: on the whole batch, once per sequence length,
        so criteria that index rows or keep per-row state see each row at its own index; the first length at which a
        running row's criterion fires cuts its counts. `counts` already ends at the budget and the first EOS, so the
        earliest of the three is where each row stops."""
        ids = sequences.clone()
        new = torch.arange(tokens.shape[1], device=tokens.device)
        writable = new < counts[:, None]
        columns = (lengths[:, None] + new).clamp(max=ids.shape[1] - 1)
        ids[rows[:, None].expand_as(columns)[writable], columns[writable]] = tokens[writable]
        counts, stops = counts.clone(), stops.clone()
        for length in range(int(lengths.min()) + 1, int((lengths + counts).max()) + 1):
            # every running row, including those the budget or an EOS already stops in this step: a criterion that
            # fires before that point stops the row earlier, as it would have stopped plain decoding
            at = running & (lengths < length) & (length <= lengths + counts)
            if not bool(at.any()):
                continue
            fired = self.criteria(ids[:, :length], None)[rows] & at
            counts = torch.where(fired, length - lengths, counts)
            stops |= fired
        return counts, stops


def cut_after_eos(new_tokens: list[int], generation_config: GenerationConfig) -> list[int]:
    """A row's generated ids up to and including its first end-of-sequence token (the padding after it dropped)."""
    eos = generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    end = next((i for i, token in enumerate(new_tokens) if token in eos_ids), None)
    return new_tokens if end is None else new_tokens[: end + 1]


__all__ = ["StopRule", "cut_after_eos"]
