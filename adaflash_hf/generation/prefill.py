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
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

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
    if mode == "padded" or (mode == "auto" and device.type != "cpu"):
        return False
    if attention_mask is None or attention_mask.shape[0] < 2 or bool(attention_mask.all()):
        return False
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    left_padded = columns >= attention_mask.shape[1] - attention_mask.sum(-1, keepdim=True)
    if not bool((attention_mask.bool() == left_padded).all()):
        return False  # right padding or holes: a row's tokens are not the last columns a group reads
    if returns_cache or type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return False
    return cache.get_seq_length() == 0 and all(type(layer) is DynamicLayer for layer in cache.layers)


def ragged_prefill(target, input_ids, attention_mask, positions, cache, hidden_layers, features, spans):
    """Reads the left-padded prompt ``input_ids [B, L]`` in the row groups ``spans`` (`groups`), fills ``cache`` (an
    empty `DynamicCache`) as one forward over the padded batch would have, padding columns zero, and returns
    ``(logits [B, 1, V], context [B, L, F])``: the last position's logits and ``features(hidden_states)`` of every
    column (zero at padding)."""
    batch, length = input_ids.shape
    real = attention_mask.sum(-1).tolist()
    logits = context = None
    layers: list[list[tuple]] = []  # per group, per cache layer: (rows, columns, keys, values, mask)
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
        layers.append(
            [
                (index, columns, getattr(layer, "keys", None), getattr(layer, "values", None), mask)
                for layer in own.layers
            ]
        )
    for number, per_group in enumerate(zip(*layers)):
        first = next((entry for entry in per_group if entry[2] is not None), None)
        if first is None:
            continue  # a layer that keeps nothing (one sharing another layer's keys and values)
        keys = first[2].new_zeros(batch, first[2].shape[1], length, first[2].shape[3])
        values = first[3].new_zeros(batch, first[3].shape[1], length, first[3].shape[3])
        for index, columns, group_keys, group_values, mask in per_group:
            padding = ~mask.bool()[:, None, :, None]
            keys[index, :, columns] = group_keys.masked_fill(padding, 0)
            values[index, :, columns] = group_values.masked_fill(padding, 0)
        cache.update(keys, values, number)
    return logits, context
