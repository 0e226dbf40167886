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
