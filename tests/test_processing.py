"""`process_positions` against a reference that processes each row alone, one position at a time."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from adaflash_hf.generation.processing import argmax, process_positions

VOCAB = 12


def _processors():
    return LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.7), NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(0.8)]
    )


def _reference(sequences, lengths, logits, tokens, rows):
    """Row by row, position by position: what plain decoding computes for each row's ids."""
    expected = logits.clone()
    for b, row in enumerate(rows.tolist()):
        ids = sequences[row : row + 1, : int(lengths[b])]
        for i in range(logits.shape[1]):
            expected[b, i] = _processors()(ids, logits[b, i][None].clone())[0]
            ids = torch.cat([ids, tokens[b, i : i + 1][None]], dim=1)
    return expected


def _case(seed, batch, width, lengths):
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, VOCAB, (batch, 16), generator=generator)
    logits = torch.randn(len(lengths), width, VOCAB, generator=generator)
    tokens = torch.randint(0, VOCAB, (len(lengths), width), generator=generator)
    return sequences, torch.tensor(lengths), logits, tokens


def test_whole_batch_at_one_length_matches_rows_alone():
    for width in (1, 4):
        sequences, lengths, logits, tokens = _case(width, 3, width, [9, 9, 9])
        got, _ = process_positions(_processors(), sequences, lengths, logits.clone(), tokens=tokens)
        expected = _reference(sequences, lengths, logits, tokens, torch.arange(3))
        torch.testing.assert_close(got, expected)


def test_ragged_lengths_and_a_subset_of_rows_match_rows_alone():
    for rows, lengths in (([0, 1, 2], [7, 9, 11]), ([2, 0], [10, 10]), ([1], [8])):
        sequences, lengths_t, logits, tokens = _case(len(rows), 3, 3, lengths)
        rows_t = torch.tensor(rows)
        got, _ = process_positions(_processors(), sequences, lengths_t, logits.clone(), tokens=tokens, rows=rows_t)
        torch.testing.assert_close(got, _reference(sequences, lengths_t, logits, tokens, rows_t))


def test_chosen_tokens_feed_the_next_position():
    sequences, lengths, logits, _ = _case(5, 2, 4, [6, 6])
    got, chosen = process_positions(
        _processors(), sequences, lengths, logits.clone(), choose=lambda x: x.argmax(dim=-1)
    )
    torch.testing.assert_close(got, _reference(sequences, lengths, logits, chosen, torch.arange(2)))
    assert torch.equal(chosen, got.argmax(-1))


class _ReadsIds(LogitsProcessor):
    """A processor that reads the ids (for all `process_positions` knows): it runs position by position."""

    def __init__(self):
        self.lengths = []

    def __call__(self, input_ids, scores):
        self.lengths.append(input_ids.shape[-1])
        return scores


def test_length_bans_run_once_over_all_positions_and_match_rows_alone(monkeypatch):
    """`min_length` and `min_new_tokens` read only the ids' length: one pass over all positions bans the
    end-of-sequence tokens exactly where plain decoding, row by row and position by position, bans them, whatever the
    order of the other processors (a ban before a top-k is not a ban after it)."""
    eos = [3, 5]
    lists = (
        [MinNewTokensLengthLogitsProcessor(6, 4, eos), TemperatureLogitsWarper(0.7)],
        [TopKLogitsWarper(2), MinLengthLogitsProcessor(11, eos)],
        [MinLengthLogitsProcessor(11, eos), TopKLogitsWarper(2)],
    )
    for processors in lists:
        sequences, lengths, logits, tokens = _case(7, 3, 4, [7, 9, 11])  # positions on both sides of each bound
        logits[..., eos] += 3.0  # the end-of-sequence tokens in every top 2 before the ban
        expected = logits.clone()
        for b in range(3):
            ids = sequences[b : b + 1, : int(lengths[b])]
            for i in range(4):
                expected[b, i] = LogitsProcessorList(processors)(ids, logits[b, i][None].clone())[0]
                ids = torch.cat([ids, tokens[b, i : i + 1][None]], dim=1)
        reads = _ReadsIds()
        slow, _ = process_positions(
            LogitsProcessorList([*processors, reads]), sequences, lengths, logits.clone(), tokens=tokens
        )
        assert len(reads.lengths) == 4 * 3  # position by position (the rows' lengths differ)
        with monkeypatch.context() as patch:
            for kind in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor):
                patch.setattr(kind, "__call__", lambda *args: pytest.fail("called position by position"))
            fast, _ = process_positions(
                LogitsProcessorList(processors), sequences, lengths, logits.clone(), tokens=tokens
            )
        torch.testing.assert_close(slow, expected)
        torch.testing.assert_close(fast, expected)
        banned = fast[..., eos].isinf().all(-1)
        assert banned.any() and not banned.all()  # the bound falls inside the block for some rows


def test_argmax_gives_torch_argmax_indices_ties_nan_and_infinities_included():
    torch.manual_seed(0)
    cases = [torch.randn(3, 4, 500), torch.randn(2, 500).round(), torch.full((2, 7), float("-inf"))]
    ties = torch.randn(2, 500)
    ties[:, [9, 3, 400]] = 50.0
    nan = torch.randn(2, 500)
    nan[0, [300, 7]] = float("nan")
    nan[1, [20, 5]] = float("inf")
    cases += [ties, nan, torch.randn(6, 500)[:, ::3], torch.randn(500, 4).t(), torch.randn(500)]
    cases += [torch.randn(3, 500, dtype=dtype) for dtype in (torch.float16, torch.bfloat16, torch.float64)]
    for logits in cases:
        ours, theirs = argmax(logits), logits.argmax(dim=-1)
        assert ours.dtype == torch.long and ours.shape == theirs.shape and torch.equal(ours, theirs)
    assert argmax(ties).tolist() == [3, 3] and argmax(nan).tolist() == [7, 5]
