"""Logits processors at several positions at once, for the drafter and for the target alike.

Lossless sampling needs the drafter's distribution after *the same* processors the target gets, each position seeing
the ids before it. Processors that ignore the ids (temperature, top-k/p, min-p, ...) run once over all positions, and
so do the two that read only the ids' length (``min_length`` and ``min_new_tokens``: the end-of-sequence tokens are
banned while the ids are shorter than a bound, applied per position from its length, `_eos_bound`); the others
(repetition penalty, n-gram bans, prefix constraints, ...) run position by position, and are called the way plain
generate() calls them: with the *whole* batch at one sequence length. Processors may index rows
(``prefix_allowed_tokens_fn(batch_id, ids)``, a per-row ``prompt_ignore_length``), so row ``b`` must sit at index
``b`` of a full-size batch; rows of a speculative batch hold different numbers of tokens, so each call serves the
positions of every row that reaches that length, and the other rows' outputs are discarded.

Processors that keep state across calls on the assumption of one call per generated token cannot be fed speculative
positions (several per call, rejected ones rolled back): `check_processors` refuses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
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

# processor -> (the generate() argument that adds it, why it cannot run on speculative positions)
_STATEFUL = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: (
        "guidance_scale",
        "classifier-free guidance runs the target on the unconditional prompt with a cache of its own, one token per "
        "call",
    ),
    SynthIDTextWatermarkLogitsProcessor: (
        "watermarking_config (SynthID)",
        "the SynthID watermark keeps a per-call state that assumes one call per generated token",
    ),
}

TokenChooser = Callable[[torch.Tensor], torch.LongTensor]


def ids_independent(processor) -> bool:
    """Whether a processor's output depends on the logits only (then all positions are processed in one call)."""
    return isinstance(processor, _IDS_INDEPENDENT)


def _eos_bound(processor) -> tuple[int, torch.Tensor] | None:
    """``(bound, eos ids)`` of a processor that sets the end-of-sequence logits to ``-inf`` while the ids are shorter
    than ``bound`` and reads nothing else of them (transformers' ``MinLengthLogitsProcessor`` and
    ``MinNewTokensLengthLogitsProcessor``, their own classes only: a subclass may read more); else ``None``."""
    if type(processor) is MinLengthLogitsProcessor:
        return processor.min_length, processor.eos_token_id
    if type(processor) is MinNewTokensLengthLogitsProcessor:
        return processor.prompt_length_to_skip + processor.min_new_tokens, processor.eos_token_id
    return None


def _all_at_once(processors, sequences, lengths, logits) -> torch.Tensor:
    """`process_positions` when every processor is ids-independent or an `_eos_bound`: each one call over all
    positions, in the list's order (a ban before a top-k is not a ban after it)."""
    batch, width = logits.shape[:2]
    flat = logits.view(batch * width, -1)
    seen = None  # each position's ids length, once a ban needs it (sampling's warpers alone, every step, do not)
    for processor in processors:
        bound = _eos_bound(processor)
        if bound is None:
            flat = processor(sequences[:1].expand(flat.shape[0], -1), flat)
        else:
            limit, eos = bound
            if seen is None:
                seen = (lengths[:, None] + torch.arange(width, device=lengths.device)).view(-1).to(flat.device)
            short = (seen < limit).nonzero()  # [n, 1]: the positions whose ids are shorter than the bound
            flat[short, eos.to(flat.device).view(1, -1)] = -math.inf
    return flat.view_as(logits)


_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)


def argmax(logits: torch.Tensor) -> torch.LongTensor:
    """``logits.argmax(dim=-1)``, the same indices: the first maximal value of each row, a NaN counting as maximal.

    On a CPU it is numpy's argmax, which keeps those rules and costs a few microseconds over a vocabulary where
    torch's costs about 80 (a greedy step's own argmax, next to a forward of a small target, is a share of a percent
    of the step); elsewhere, and for dtypes numpy lacks, torch's."""
    if logits.device.type != "cpu" or logits.dtype not in _NUMPY_ARGMAX or logits.requires_grad:
        return logits.argmax(dim=-1)
    return torch.as_tensor(logits.numpy().argmax(-1))


def token_chooser(do_sample: bool, drafts: bool = False) -> TokenChooser:
    """argmax, or one sample from softmax, of processed logits ``[N, V] -> [N]``.

    With `drafts`, a row whose processors allow no token at all (every logit ``-inf``: suppressed or banned tokens
    covering a reduced draft vocabulary) gets an arbitrary token instead of an error; the drafter drafts nothing from
    such a position on (`AdaFlashCandidateGenerator.draft`), so the token is never verified. The target's logits
    never get this leniency: plain decoding fails on them too."""
    if do_sample:

        def sample(logits):
            probs = torch.softmax(logits, dim=-1)
            return torch.multinomial(probs.nan_to_num(1.0) if drafts else probs, 1).squeeze(-1)

        return sample
    return argmax


def check_processors(processors: LogitsProcessorList) -> None:
    """Refuses, before anything runs, the processors whose state cannot follow speculative decoding."""
    for processor in processors:
        for kind, (argument, why) in _STATEFUL.items():
            if isinstance(processor, kind):
                raise ValueError(
                    f"{argument} is not supported with an AdaFlash drafter: {why}, while speculative verification "
                    f"processes several positions per call and rolls rejected ones back. Drop {argument}, or drop "
                    "assistant_model to generate without speculation."
                )


def process_positions(
    processors: LogitsProcessorList,
    sequences: torch.LongTensor,
    lengths: torch.LongTensor,
    logits: torch.Tensor,
    tokens: torch.LongTensor | None = None,
    choose: TokenChooser | None = None,
    rows: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.LongTensor | None]:
    """Processes ``logits [B, n, V]`` (float32, modified in place) position by position.

    sequences ``[N, T]``: the whole batch as plain generate() holds it (finished rows included); row ``b`` of the
    logits is row ``rows[b]`` of it (``rows=None``: row ``b``), with ``lengths[b]`` committed ids. Position ``i`` of
    row ``b`` sees ids ``sequences[rows[b], :lengths[b]] + tokens[b, :i]``. With ``tokens=None`` they are chosen on
    the way by ``choose`` (drafting); otherwise they are given (verification). Returns the processed logits and the
    chosen tokens (``None`` when none were chosen).
    """
    batch, width = logits.shape[:2]
    if all(ids_independent(p) or _eos_bound(p) is not None for p in processors):
        if len(processors):
            logits = _all_at_once(processors, sequences, lengths, logits)
        return logits, (choose(logits.flatten(0, 1)).view(batch, width) if choose else None)

    # the whole batch, in order, at one length: plain decoding's own call (every plain step at batch 1)
    if rows is None:
        rows = torch.arange(batch, device=sequences.device)
    whole = batch == sequences.shape[0] and bool((rows == torch.arange(batch, device=rows.device)).all())
    lengths_list = lengths.tolist()
    if whole and len(set(lengths_list)) == 1:
        return _process_whole_batch(processors, sequences, lengths_list[0], logits, tokens, choose)
    chosen = torch.empty(batch, width, dtype=torch.long, device=logits.device) if choose else None
    following = chosen if choose else tokens
    ids = sequences  # grown into a scratch copy once a position needs the tokens before it
    for i in range(width):
        if i == 1:
            ids = torch.cat([sequences, sequences.new_zeros(sequences.shape[0], width)], dim=1)
        if i:
            ids[rows, lengths + i - 1] = following[:, i - 1]
        seen = [length + i for length in lengths_list]
        for length in sorted(set(seen)):
            members = (lengths + i == length).nonzero().squeeze(-1)
            scores = logits.new_zeros(sequences.shape[0], logits.shape[-1])
            scores[rows[members]] = logits[members, i]
            logits[members, i] = processors(ids[:, :length], scores)[rows[members]]
            if choose:
                chosen[members, i] = choose(logits[members, i])
    return logits, chosen


def _process_whole_batch(processors, sequences, length, logits, tokens, choose):
    """`process_positions` when every row of the batch is present, in order, at one length: each position is one
    call on the whole batch, as plain decoding makes it, with no scattering of rows."""
    batch, width = logits.shape[:2]
    chosen = torch.empty(batch, width, dtype=torch.long, device=logits.device) if choose else None
    following = chosen if choose else tokens
    ids = sequences[:, :length]
    for i in range(width):
        if i:
            ids = torch.cat([ids, following[:, i - 1 : i]], dim=1)
        logits[:, i] = processors(ids, logits[:, i])
        if choose:
            chosen[:, i] = choose(logits[:, i])
    return logits, chosen
