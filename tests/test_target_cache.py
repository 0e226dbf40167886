"""The target cache with holes (`generation/cache.py`) on its own: what a verification keeps, crops and masks,
compaction keeping each row's valid columns in order, rows leaving, and the returned cache's layout."""

import torch
from transformers.cache_utils import DynamicCache

from adaflash_hf.generation import cache as cache_module
from adaflash_hf.generation.cache import TargetCache

LAYERS, HEADS, DIM = 2, 2, 4


def _cache(batch: int, columns: int) -> TargetCache:
    """A cache whose key at (row b, column c) is the number 100 * b + c in every entry (values: its negative)."""
    cache = DynamicCache()
    marks = (100 * torch.arange(batch)[:, None] + torch.arange(columns)[None]).float()
    keys = marks[:, None, :, None].expand(batch, HEADS, columns, DIM).contiguous()
    for layer in range(LAYERS):
        cache.update(keys.clone(), -keys.clone(), layer)
    return TargetCache(cache)


def _marks(target: TargetCache, layer: int = 0) -> torch.Tensor:
    """``[B, columns]``: the mark of each column (see `_cache`)."""
    return target.cache.layers[layer].keys[:, 0, :, 0]


def test_keep_crops_what_no_row_kept_and_masks_the_rest():
    target = _cache(batch=2, columns=10)  # 6 committed columns, then a verification of 4
    kept = torch.tensor([[True, True, False, False], [True, True, True, False]])
    target.keep(kept, width=4)
    assert target.columns == 9  # the last column no row kept is cropped
    expected = torch.ones(2, 9, dtype=torch.bool)
    expected[0, 8] = False  # row 0's rejected draft stays as a hole
    assert torch.equal(target.mask, expected)
    assert torch.equal(
        target.extended_mask(torch.tensor([[True], [True]])),
        torch.cat([expected, torch.ones(2, 1, dtype=torch.bool)], 1).long(),
    )

    everything = _cache(batch=2, columns=10)
    everything.keep(torch.ones(2, 4, dtype=torch.bool), width=4)
    assert everything.mask is None and everything.columns == 10  # nothing masked: batch 1's fast path


def test_compaction_keeps_each_rows_valid_columns_in_order(monkeypatch):
    monkeypatch.setattr(cache_module, "COMPACT_FRACTION", 0.9)  # compact by hand below
    target = _cache(batch=3, columns=8)
    target.mask = torch.tensor(
        [
            [1, 0, 1, 1, 0, 0, 1, 1],
            [1, 1, 1, 1, 1, 0, 1, 1],
            [0, 0, 1, 0, 1, 0, 1, 0],
        ],
        dtype=torch.bool,
    )
    before = [_marks(target)[row][target.mask[row]].tolist() for row in range(3)]
    target.compact()
    assert target.columns == 7  # the longest row's valid columns; the holes every row shares are gone
    for row in range(3):
        valid = target.mask[row]
        assert _marks(target)[row][valid].tolist() == before[row]  # same columns, same order, right-aligned
        assert valid[-len(before[row]) :].all() and not valid[: 7 - len(before[row])].any()
    values = target.cache.layers[1].values[:, 0, :, 0]
    assert torch.equal(values[target.mask], -_marks(target, 1)[target.mask])  # keys and values moved together


def test_holes_that_compaction_cannot_free_do_not_trigger_it(monkeypatch):
    """Short prompts beside a long one leave mostly padding in their rows: compaction would free nothing (the long
    row has no holes), so it must not run, step after step, at the cost of moving every layer's columns."""
    compactions = []
    monkeypatch.setattr(cache_module.TargetCache, "compact", lambda self: compactions.append(1))
    kept = torch.tensor([[True, True, True], [True, False, False], [True, False, False]])
    target = _cache(batch=3, columns=10)  # 7 columns before the step, 3 it verified
    target.mask = torch.tensor([[1] * 7, [0] * 7, [0] * 7], dtype=torch.bool)
    target.keep(kept, width=3)
    assert (~target.mask).float().mean() > cache_module.COMPACT_FRACTION and compactions == []
    # rejected drafts every row has: compaction frees them once they are most of the cache
    target = _cache(batch=3, columns=10)
    target.mask = torch.tensor([[0] * 6 + [1]] * 3, dtype=torch.bool)
    target.keep(kept.logical_and(torch.tensor([True, False, False])), width=3)
    assert compactions == [1]


def test_rows_leave_with_their_mask_rows():
    target = _cache(batch=3, columns=5)
    target.mask = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    target.select_rows(torch.tensor([1]))
    assert target.mask is None and _marks(target).tolist() == [[100.0, 101.0, 102.0, 103.0, 104.0]]


def test_parked_rows_are_rebuilt_right_aligned_as_plain_decoding_leaves_them():
    target = _cache(batch=2, columns=6)
    target.mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    target.park(0, row=0)
    target.park(1, row=1)
    # prompt of width 3 (row 0 has 2 real tokens under one padding column), 3 generated tokens: plain decoding leaves
    # 3 + 3 - 1 = 5 columns, each row's real ones right-aligned
    target.rebuild(prompt_len=3, real=torch.tensor([2, 3]), generated=3)
    marks = _marks(target)
    assert marks.shape == (2, 5)
    assert marks[0].tolist() == [0.0, 0.0, 1.0, 3.0, 4.0]  # zeros under the padding, then row 0's valid columns
    assert marks[1].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0]


def test_tree_paths_move_to_the_front_of_the_steps_columns():
    target = _cache(batch=1, columns=6)  # 3 committed columns, a tree of 3 verified
    target.move_to_front(torch.tensor([[0, 2, 1]]), width=3)
    assert _marks(target).tolist() == [[0.0, 1.0, 2.0, 3.0, 5.0, 4.0]]


def _replay(layer, rng: torch.Generator, steps: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs a random sequence of what the loop does to a cache layer (prompt, verifications of 1-6 columns, crops of
    their rejected columns, rows leaving, compaction, a tree's reordered span) on ``layer``; returns its keys and
    values after each operation."""
    batch, seen = 5, []
    keys = torch.randn(batch, HEADS, 7, DIM, generator=rng)
    layer.update(keys, keys * 2)
    for _ in range(steps):
        batch = layer.keys.shape[0]
        width = int(torch.randint(1, 7, (), generator=rng))
        new = torch.randn(batch, HEADS, width, DIM + 0, generator=rng)
        layer.update(new, -new)
        rejected = int(torch.randint(0, width, (), generator=rng))
        if rejected:
            layer.crop(-rejected)
        roll = float(torch.rand((), generator=rng))
        if roll < 0.1 and batch > 1:
            layer.batch_select_indices(torch.arange(1, batch))
        elif roll < 0.2:
            columns = layer.keys.shape[2]
            cache_module.gather_columns(layer, torch.arange(columns).roll(1).expand(batch, -1))
        elif roll < 0.3:
            span = layer.keys.shape[2] - 3
            order = torch.tensor([2, 0, 1]).expand(batch, -1)
            cache_module.gather_columns(layer, order, columns=slice(span, span + 3))
        seen.append((layer.keys.clone(), layer.values.clone()))
    return seen


def test_a_reserved_layer_holds_what_a_dynamic_layer_holds():
    from transformers.cache_utils import DynamicLayer

    for seed in range(4):
        dynamic = _replay(DynamicLayer(), torch.Generator().manual_seed(seed))
        reserved = _replay(cache_module.ReservedLayer(capacity=12), torch.Generator().manual_seed(seed))
        assert len(dynamic) == len(reserved)
        for (k, v), (rk, rv) in zip(dynamic, reserved):
            assert torch.equal(k, rk) and torch.equal(v, rv)


def test_a_reserved_layer_that_misses_replaced_tensors_is_caught(monkeypatch):
    """The negative control: the same comparison sees a layer that keeps writing into its buffers after a compaction
    replaced its tensors (it would return the columns as they were before)."""
    from transformers.cache_utils import DynamicLayer

    def holds(self, total, key_states, value_states):
        keys = self._buffers[0] if self._buffers is not None else None
        return keys is not None and total <= keys.shape[-2] and keys.shape[:-2] == key_states.shape[:-2]

    monkeypatch.setattr(cache_module.ReservedLayer, "_holds", holds)
    dynamic = _replay(DynamicLayer(), torch.Generator().manual_seed(0))
    reserved = _replay(cache_module.ReservedLayer(capacity=12), torch.Generator().manual_seed(0))
    assert not all(torch.equal(k, rk) for (k, _), (rk, _) in zip(dynamic, reserved))


def test_a_reserved_layer_copies_the_cache_only_when_it_grows_or_rows_leave():
    layer = cache_module.ReservedLayer(capacity=64)
    layer.update(torch.randn(3, HEADS, 10, DIM), torch.randn(3, HEADS, 10, DIM))
    buffer = layer._buffers[0]
    for _ in range(20):  # plain steps, verifications and their crops within the room reserved: no new buffer
        layer.update(torch.randn(3, HEADS, 2, DIM), torch.randn(3, HEADS, 2, DIM))
        layer.crop(-1)
        assert layer._buffers[0] is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    assert layer.keys.shape[2] == 30
    layer.update(torch.randn(3, HEADS, 40, DIM), torch.randn(3, HEADS, 40, DIM))  # past the room: it grows
    assert layer._buffers[0].shape[2] >= 70 and layer._buffers[0] is not buffer
    layer.batch_select_indices(torch.tensor([0, 2]))  # rows leave: the next update moves them into new buffers
    layer.update(torch.randn(2, HEADS, 1, DIM), torch.randn(2, HEADS, 1, DIM))
    assert layer._buffers[0].shape[0] == 2 and layer.keys.shape == (2, HEADS, 71, DIM)


def test_generate_reserves_the_cache_unless_it_is_returned():
    from helpers import tiny_drafter, tiny_target
    from transformers import GenerationConfig

    target = tiny_target()
    layers = []
    real = cache_module.reserve

    def spy(cache, capacity):
        real(cache, capacity)
        layers.append({type(layer).__name__ for layer in cache.layers})

    import adaflash_hf.generation.decoding as decoding

    original = decoding.reserve
    decoding.reserve = spy
    try:
        for returned in (False, True):
            config = GenerationConfig(max_new_tokens=6, do_sample=False, return_dict_in_generate=returned)
            target.generate(torch.tensor([[0, 5, 9]]), generation_config=config, assistant_model=tiny_drafter(target))
    finally:
        decoding.reserve = original
    assert layers == [{"ReservedLayer"}]  # the returned cache keeps transformers' own layers
