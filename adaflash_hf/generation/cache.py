"""The target's KV cache during batched speculative decoding: a `DynamicCache` whose rows may hold masked holes.

Rows of a batch verify different numbers of tokens and accept different numbers of drafts, so after a step each
row's cache holds its committed columns and, between them, *holes*: its rejected drafts and the padding up to the
widest row. `TargetCache` keeps a 2D mask over the columns (``None`` while every column is valid, which keeps batch 1
on the mask-free path) and does everything the loop needs with them:

* `keep`: after a verification, crops the trailing columns no row kept (the Cache API's ``crop``) and masks the rest;
* `compact`: once the holes every row has (the columns compaction would free) exceed `COMPACT_FRACTION` of the
  columns, moves each row's valid columns to the right end
  (left padding), which changes nothing a row computes: attention depends on a column's mask and on the rotary
  position baked into its key, not on where it sits;
* `select_rows`: rows that finish leave the batch (the Cache API's ``batch_select_indices``);
* `park` and `rebuild`: a finished row's columns are kept when the cache is returned, and the returned cache is
  rebuilt to plain decoding's layout;
* `move_to_front`: tree verification's accepted path goes to the front of the step's columns (`tree.py`).

Where the caller does not get the cache back, `reserve` gives its full-attention layers room for the whole call
(`ReservedLayer`): each forward then writes its new columns after the cached ones instead of copying the whole layer
into a new tensor, as `DynamicLayer`'s ``torch.cat`` does every step.

transformers' Cache API has no operation that moves columns within rows, so `gather_columns` touches the layers'
tensors directly; it is the only place that does, and it moves every tensor a layer keeps per position
(`POSITION_TENSORS`) together, refusing (`check_movable`) a layer class it does not know rather than moving part of
its state.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DummyLayer, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are the first columns of buffers with room for ``capacity`` columns.

    `DynamicLayer.update` copies the whole layer into a new tensor every forward (``torch.cat``): at 32 rows of 600
    columns that is 30 MB a layer, about a fifth of a plain step of a 30-layer model on a CPU (BENCHMARKS.md
    section 38). Here an update writes its columns after the cached ones and returns views of the buffers: the same
    values at the same positions, so attention computes the same (scaled dot-product attention gives the same bits
    on such a view as on a contiguous copy). `crop` keeps views of the buffers (its columns are written over by the
    next update); an operation that replaces the tensors (``batch_select_indices``, `gather_columns` without a span)
    is seen at the next update, which moves them into new buffers, once, as ``torch.cat`` would have copied them.

    Args:
        capacity (`int`): columns the buffers hold; an update that needs more grows them by half at least.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        # (keys, values, columns) as the last update left them: while the layer still holds those very tensors (no
        # crop, row selection or compaction since), the next update skips `_holds`' checks, which at one row of a
        # short prompt cost as much as the copy this layer saves
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new, last = key_states.shape[-2], self._last
        if last is not None and last[0] is self.keys and last[1] is self.values:
            length = last[2]
            if length + new > self._buffers[0].shape[-2]:
                self._reserve(length, length + new, key_states, value_states)
        else:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            length = self.get_seq_length()
            if not self._holds(length + new, key_states, value_states):
                self._reserve(length, length + new, key_states, value_states)
        keys, values = self._buffers
        end = length + new
        keys.narrow(-2, length, new).copy_(key_states)
        values.narrow(-2, length, new).copy_(value_states)
        self.keys, self.values = keys.narrow(-2, 0, end), values.narrow(-2, 0, end)
        self._last = (self.keys, self.values, end)
        return self.keys, self.values

    def _holds(self, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the buffers take ``total`` columns of these states and the layer's tensors are still their first
        columns."""
        if self._buffers is None:
            return False
        keys, values = self._buffers
        if total > keys.shape[-2] or keys.dtype != key_states.dtype:
            return False
        if keys.shape[:-2] != key_states.shape[:-2] or values.shape[:-2] != value_states.shape[:-2]:
            return False  # rows selected since
        return self.keys.numel() == 0 or all(
            mine.data_ptr() == buffer.data_ptr() and mine.stride() == buffer.stride()
            for mine, buffer in ((self.keys, keys), (self.values, values))
        )

    def _reserve(self, length: int, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers of at least ``total`` columns, holding the layer's first ``length`` ones."""
        old = 0 if self._buffers is None else self._buffers[0].shape[-2]
        self.capacity = max(self.capacity, total, old + old // 2)
        buffers = []
        for cached, states in ((self.keys, key_states), (self.values, value_states)):
            buffer = states.new_empty((*states.shape[:-2], self.capacity, states.shape[-1]))
            if length:
                buffer[..., :length, :].copy_(cached)
            buffers.append(buffer)
        self._buffers = tuple(buffers)

    def reset(self) -> None:
        self._buffers, self._last = None, None
        super().reset()


def empty_in_memory(cache) -> bool:
    """Whether ``cache`` holds no column yet and keeps its layers in memory (not offloaded): what may lay its layers
    out anew (`reserve`, `prefill.lay_out`)."""
    return not getattr(cache, "offloading", False) and cache.get_seq_length() == 0


def reserve(cache, capacity: int) -> None:
    """Replaces the empty full-attention layers of ``cache`` by `ReservedLayer` s of ``capacity`` columns (a
    lazily built cache has no layers yet and is left as it is)."""
    if not empty_in_memory(cache):
        return
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]


COMPACT_FRACTION = 0.5  # compact once the columns it would free exceed this fraction of the cache's
# Every tensor a cache layer keeps per position, by layer class (exact type: a subclass may keep more):
# attribute -> (batch dim, position dim).
POSITION_TENSORS = {
    DynamicLayer: {"keys": (0, 2), "values": (0, 2)},
    ReservedLayer: {"keys": (0, 2), "values": (0, 2)},
    DynamicSlidingWindowLayer: {"keys": (0, 2), "values": (0, 2)},
    # DeepSeek sparse attention (deepseek_v32, glm_moe_dsa, ...): the indexer scores cached tokens by these keys
    DynamicIndexedLayer: {
        "keys": (0, 2),
        "values": (0, 2),
        "indexer_keys": (0, 1),
        "indexer_position_ids": (1, 2),
    },
    DummyLayer: {},
}


def sliding_window(cache) -> int | None:
    """The smallest sliding window (or attention chunk) among the cache's layers: the layers say what the target
    really uses (a config may carry a `sliding_window` no layer applies, as Qwen2-MoE's 0)."""
    windows = [layer.sliding_window for layer in cache.layers if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


def check_movable(cache, what: str, instead: str) -> None:
    """Refuses caches with a layer whose per-position tensors `POSITION_TENSORS` does not know."""
    unknown = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in POSITION_TENSORS})
    if unknown:
        raise NotImplementedError(
            f"{what}, and the target's {unknown} cache layers may keep per-position state the loop does not know how "
            f"to move with its columns; {instead}."
        )


def position_tensors(layer) -> dict[str, tuple[torch.Tensor, int, int]]:
    """A layer's per-position tensors that hold data: name -> (tensor, batch dim, position dim)."""
    found = {}
    for name, (batch_dim, position_dim) in POSITION_TENSORS[type(layer)].items():
        tensor = getattr(layer, name, None)
        if tensor is not None and tensor.dim() > max(batch_dim, position_dim):
            found[name] = (tensor, batch_dim, position_dim)
    return found


def _gather_positions(tensor, batch_dim: int, position_dim: int, index: torch.LongTensor) -> torch.Tensor:
    """``tensor`` with positions ``index [B, W]`` of each row, along its position dim."""
    moved = tensor.movedim((batch_dim, position_dim), (0, 1))
    picked = moved.gather(1, index.view(*index.shape, *[1] * (moved.dim() - 2)).expand(-1, -1, *moved.shape[2:]))
    return picked.movedim((0, 1), (batch_dim, position_dim))


def gather_columns(layer, index: torch.LongTensor, valid: torch.Tensor | None = None, columns: slice | None = None):
    """Keeps columns ``index [B, W]`` of every row of a cache layer (zeros where ``valid`` is False), in every tensor
    the layer keeps per position (keys and values apart, as their head dims may differ on MLA targets such as
    DeepSeek-V3). With `columns`, only that span is rearranged (``index`` then counts from its start) and the rest
    of the layer stays as it is."""
    for name, (tensor, batch_dim, position_dim) in position_tensors(layer).items():
        span = tensor if columns is None else tensor.narrow(position_dim, columns.start, columns.stop - columns.start)
        picked = _gather_positions(span, batch_dim, position_dim, index)
        if valid is not None:
            keep = valid.view(*valid.shape, *[1] * (picked.dim() - 2)).movedim((0, 1), (batch_dim, position_dim))
            picked = picked.masked_fill(~keep, 0)
        if columns is None:
            setattr(layer, name, picked)
        else:
            span.copy_(picked)
    if columns is None and hasattr(layer, "cumulative_length"):
        # a sliding layer's length bookkeeping sizes the next mask; batched decoding keeps it inside the window
        layer.cumulative_length = index.shape[1]


def _pad_to(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[:dim] + (missing,) + tensor.shape[dim + 1 :])], dim)


class TargetCache:
    """The target's `DynamicCache` and the mask of its holes (see the module docstring).

    Args:
        cache (`DynamicCache`): the call's cache (prefilled by the loop, or by the caller with a prompt prefix).
    """

    def __init__(self, cache):
        self.cache = cache
        self.mask: torch.Tensor | None = None  # [B, columns] bool; None: every column valid
        self.window = sliding_window(cache)
        self.parked: dict[int, tuple[list[dict], torch.Tensor | None]] = {}  # row -> its columns, once it left
        cache.activate_past_recording()  # lets sliding-window layers roll back rejected tokens

    @property
    def columns(self) -> int:
        return self.cache.get_seq_length()

    def start(self, attention_mask: torch.Tensor | None) -> None:
        """After the prefill: the prompt's padding columns are the first holes."""
        self.mask = None if attention_mask is None else attention_mask.bool()

    def extended_mask(self, fed: torch.Tensor) -> torch.Tensor | None:
        """The 2D attention mask of a forward feeding ``fed [B, width]`` (False: padding) after the cache."""
        if self.mask is None and bool(fed.all()):
            return None
        past = self.mask
        if past is None:
            past = torch.ones(fed.shape[0], self.columns, dtype=torch.bool, device=fed.device)
        return torch.cat([past, fed], dim=1).long()

    def keep(self, kept: torch.Tensor, width: int) -> None:
        """After a verification the cache holds `width` new columns per row; `kept` ``[B, width]`` marks the anchor
        and accepted drafts. Trailing columns no row kept are cropped; the others become masked holes."""
        if self.window is None and self.mask is None and bool(kept.all()):
            return  # every column kept (a plain step, or all drafts accepted); a sliding layer trims on crop(0)
        trailing = int((width - kept.sum(-1)).min())
        self.cache.crop(-trailing)
        kept = kept[:, : width - trailing]
        if self.mask is None and bool(kept.all()):
            return
        past = self.mask
        if past is None:
            past = torch.ones(kept.shape[0], self.columns - kept.shape[1], dtype=torch.bool, device=kept.device)
        self.mask = torch.cat([past, kept], dim=1)
        if self.mask.all():
            self.mask = None
        elif self.columns - int(self.mask.sum(-1).max()) > COMPACT_FRACTION * self.columns:
            # only holes every row has can go (a row's left padding or rejected drafts that another row's valid
            # columns sit beside stay): counting all holes would compact every step and free nothing
            self.compact()

    def compact(self) -> None:
        """Moves each row's valid columns to the right end (left padding), dropping the holes all rows share."""
        mask = self.mask
        keep = int(mask.sum(-1).max())
        # stable order: holes first, then valid columns in their original order
        order = torch.sort(mask.int(), dim=1, stable=True).indices[:, -keep:]
        for layer in self.cache.layers:
            gather_columns(layer, order)
        self.mask = mask.gather(1, order)
        if self.mask.all():
            self.mask = None

    def room(self, block: int) -> int:
        """Columns the next verification may add while the cache stays shorter than the sliding window (or
        attention chunk): then no layer drops a column, and window and chunk masks, which count columns, holes
        included, mask nothing, as in plain decoding within the window. Compaction frees columns; at least one is
        always free, since the call's checks keep max_length within the window."""
        if self.columns + block >= self.window and self.mask is not None:
            self.compact()
        return self.window - 1 - self.columns

    def move_to_front(self, order: torch.LongTensor, width: int) -> None:
        """Reorders each row's last `width` columns by ``order [B, width]`` (tree verification's walk order)."""
        past = self.columns - width
        for layer in self.cache.layers:
            gather_columns(layer, order, columns=slice(past, past + width))

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keeps only the rows in ``index``."""
        self.cache.batch_select_indices(index)
        if self.mask is not None:
            self.mask = self.mask[index]
            if self.mask.all():
                self.mask = None

    def park(self, slot: int, row: int) -> None:
        """Keeps the columns of the row in batch slot ``slot`` (the call's row ``row``), about to leave the batch,
        for the cache returned at the end: every per-position tensor of every layer, its batch dim kept."""
        layers = [
            {
                name: (tensor.narrow(batch_dim, slot, 1), batch_dim, position_dim)
                for name, (tensor, batch_dim, position_dim) in position_tensors(layer).items()
            }
            for layer in self.cache.layers
        ]
        self.parked[row] = (layers, None if self.mask is None else self.mask[slot])

    def rebuild(self, prompt_len: int, real: torch.LongTensor, generated: int) -> None:
        """Leaves in the cache what plain decoding leaves, from the parked rows: every row, ``prompt_len + generated
        - 1`` columns, each row's ``real[row]`` prompt tokens and its tokens right-aligned under its left padding.
        Columns under the padding hold zeros (plain decoding holds the padding's keys there; a mask hides both)."""
        rows = range(len(real))
        width = prompt_len + generated - 1
        indices, valids = [], []
        for row in rows:
            layers, mask = self.parked[row]
            keys, _, position_dim = next(layer["keys"] for layer in layers if "keys" in layer)
            columns = keys.shape[position_dim]
            valid_columns = torch.arange(columns, device=real.device) if mask is None else mask.nonzero().flatten()
            need = int(real[row]) + generated - 1
            indices.append(torch.cat([valid_columns.new_zeros(width - need), valid_columns[:need]]))
            valids.append(torch.arange(width, device=real.device) >= width - need)
        index, valid = torch.stack(indices), torch.stack(valids)
        for i, layer in enumerate(self.cache.layers):
            parts = [self.parked[row][0][i] for row in rows]
            for name, (_, batch_dim, position_dim) in parts[0].items():
                tensors = [part[name][0] for part in parts]
                # rows parked at different steps hold different numbers of columns: pad them to a common width
                longest = max(t.shape[position_dim] for t in tensors)
                setattr(layer, name, torch.cat([_pad_to(t, position_dim, longest) for t in tensors], batch_dim))
            gather_columns(layer, index, valid)
