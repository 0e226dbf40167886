"""The prompt's forward: one forward over the padded batch, or the rows grouped by length (*ragged*).

Plain decoding reads a batch of prompts in one forward over the left-padded batch, so a batch whose prompts differ in
length computes every padding column of every row: a batch of 32 chat, code, docs and math prompts is about two
thirds padding, and that forward costs about three times what the prompts' own tokens would. A row's
keys, values, hidden states and last logits depend only on its own tokens and positions (padding is masked, and
position ids count real tokens only), so the prompts can be read in groups of similar length, each group padded to
its own longest row only, and the results laid out as the padded forward would have: each row's columns at the right
end of the full width, the padding columns zero (masked in every later forward, as padding is). Rows read in another
group compute the same function of the same inputs in a forward of another shape, so they agree with the padded
forward to rounding (as a verification forward agrees with a plain step), not bit for bit.

`groups` chooses the grouping: the rows sorted by length, cut into consecutive groups so that the padded tokens of
all groups plus a fixed price per forward (`FORWARD_TOKENS`, the forward's own cost in tokens) is least; one group,
the padded forward, whenever splitting saves less than that price. `ragged_applies` says when the loop may read a
prompt this way (`adaflash_prefill`, options.py): a `DynamicCache` of full-attention layers that starts empty and is
not returned to the caller (a returned cache holds plain decoding's padding columns; here they are zero).

The drafter reads the same prompts at a call's first real draft, and `context_groups` groups its rows the same way
(`AdaFlashCandidateGenerator.draft`); `lay_out` lays out either's groups.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .cache import ReservedLayer, empty_in_memory

PREFILL_MODES = ("auto", "ragged", "padded")
# What one more forward costs, in prompt tokens of the same forward: on a CPU a forward's fixed part (30 layers'
# norms, rotary embeddings and attention dispatched op by op) is about what 10-30 tokens' products cost.
FORWARD_TOKENS = 32


def groups(lengths: list[int], forward_tokens: int | None = None) -> list[list[int]]:
    """Row indices grouped for the prompt's forwards, longest rows first: the cut of the rows sorted by length into
    consecutive groups that minimises the sum over groups of ``rows x longest row + forward_tokens``.

    A group's padded tokens are its rows times its longest row, and sorting first loses nothing: any grouping can be
    rearranged into consecutive runs of the sorted rows without raising any group's longest row. The least sum over
    cuts is a prefix dynamic program (``best[j]`` over the first ``j`` sorted rows), quadratic in the batch.
    ``forward_tokens`` defaults to `FORWARD_TOKENS`."""
    forward_tokens = FORWARD_TOKENS if forward_tokens is None else forward_tokens
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    best = [0] + [None] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + (end - start) * lengths[order[start]] + forward_tokens
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    spans, end = [], len(order)
    while end:
        spans.append(order[cut[end] : end])
        end = cut[end]
    return spans[::-1]


def ragged_applies(mode: str, cache, attention_mask, returns_cache: bool, device: torch.device) -> bool:
    """Whether the prompt may be read in groups: ``"padded"`` never; ``"auto"`` on a CPU only (on an accelerator one
    wide forward is rarely dearer than several narrow ones, and no one has measured it there); ``"ragged"`` and
    ``"auto"`` only when there is padding to save, the cache is an empty `DynamicCache` of full-attention layers (a
    sliding window, an offloaded or a prefilled cache keeps state this module does not assemble), the caller does
    not get it back, and the batch is left-padded (each row's tokens its last columns)."""
    if not _mode_allows(mode, device):
        return False
    if attention_mask is None or attention_mask.shape[0] < 2 or bool(attention_mask.all()):
        return False
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    left_padded = columns >= attention_mask.shape[1] - attention_mask.sum(-1, keepdim=True)
    if not bool((attention_mask.bool() == left_padded).all()):
        return False  # right padding or holes: a row's tokens are not the last columns a group reads
    return not returns_cache and type(cache) is DynamicCache and _assembled(cache)


def context_groups(mode: str, valid: torch.Tensor | None, cache, device: torch.device) -> list[list[int]]:
    """The row groups in which a drafter reads a call's first context (the prompts' features and those of the plain
    steps since), ``valid [B, T]`` telling which columns hold a token (left padding, and the holes of rows that
    stopped): `groups` of each row's columns from its first token on where ``mode`` allows it (as for the prompt's
    forward, `ragged_applies`) and the drafter's cache is empty and of full-attention layers; else one group of every
    row. A drafter's forward reads its new context and drafts a block per row at once, so each group drafts its own
    rows' blocks; a row's drafts depend on its own context alone."""
    batch = 1 if valid is None else valid.shape[0]
    every = [list(range(batch))]
    if valid is None or batch < 2 or not _mode_allows(mode, device):
        return every
    if not _assembled(cache) or bool(valid.all()):  # the cache's check first: every later draft fails it
        return every
    first = valid.int().argmax(-1)  # each row's first token
    return groups((valid.shape[1] - first).tolist())


def _mode_allows(mode: str, device: torch.device) -> bool:
    return mode == "ragged" or (mode == "auto" and device.type == "cpu")


def _assembled(cache) -> bool:
    """Whether `lay_out` can fill ``cache``: empty, not offloaded, every layer a full-attention `DynamicLayer` (a
    sliding window keeps state of its own)."""
    return empty_in_memory(cache) and all(type(layer) in (DynamicLayer, ReservedLayer) for layer in cache.layers)


def ragged_prefill(target, input_ids, attention_mask, positions, cache, hidden_layers, features, spans):
    """Reads the left-padded prompt ``input_ids [B, L]`` in the row groups ``spans`` (`groups`), fills ``cache`` (an
    empty `DynamicCache`) as one forward over the padded batch would have, padding columns zero, and returns
    ``(logits [B, 1, V], context [B, L, F])``: the last position's logits and ``features(hidden_states)`` of every
    column (zero at padding)."""
    batch, length = input_ids.shape
    real = attention_mask.sum(-1).tolist()
    logits = context = None
    parts = []  # per group: (rows, columns, its cache, its mask), for `lay_out`
    for rows in spans:
        width = max(int(real[row]) for row in rows)
        index = torch.tensor(rows, device=input_ids.device)
        columns = slice(length - width, length)
        mask = attention_mask[index, columns]
        own = DynamicCache(config=target.config) if cache.layers else DynamicCache()  # as the call's was built
        outputs = target(
            input_ids=input_ids[index, columns],
            attention_mask=mask,
            position_ids=positions[index, columns],
            cache=own,
            use_cache=True,
            output_hidden_states=hidden_layers,
            logits_to_keep=1,
        )
        found = features(outputs.hidden_states)
        if logits is None:
            logits = outputs.logits.new_zeros(batch, 1, outputs.logits.shape[-1])
            context = found.new_zeros(batch, length, found.shape[-1])
        logits[index] = outputs.logits[:, -1:]
        context[index, columns] = found.masked_fill(~mask.bool()[..., None], 0)
        parts.append((index, columns, own, mask))
    lay_out(cache, parts, batch, length)
    return logits, context


def lay_out(cache, parts, batch: int, length: int) -> None:
    """Fills the empty ``cache`` with the keys and values that groups of rows read, laid out as one forward over
    the padded batch of ``length`` columns would have: ``parts`` holds per group ``(rows, columns, group_cache,
    mask)``, the group's rows (an index), the columns it read (a slice ending at ``length``), its own cache and its
    padding mask over those columns; every column a row did not read, or read as padding, is zero (masked in every
    later forward, as padding is)."""
    for number in range(len(parts[0][2].layers)):
        entries = [(index, columns, own.layers[number], mask) for index, columns, own, mask in parts]
        first = next((layer for _, _, layer, _ in entries if getattr(layer, "keys", None) is not None), None)
        if first is None:
            continue  # a layer that keeps nothing (one sharing another layer's keys and values)
        keys = first.keys.new_zeros(batch, first.keys.shape[1], length, first.keys.shape[3])
        values = first.values.new_zeros(batch, first.values.shape[1], length, first.values.shape[3])
        for index, columns, layer, mask in entries:
            padding = ~mask.bool()[:, None, :, None]
            keys[index, :, columns] = layer.keys.masked_fill(padding, 0)
            values[index, :, columns] = layer.values.masked_fill(padding, 0)
        cache.update(keys, values, number)
