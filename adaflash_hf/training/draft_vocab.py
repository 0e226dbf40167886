"""Choosing a reduced draft vocabulary (`AdaFlashConfig.draft_vocab`, docs/algorithm.md §1.6) from the target's own
outputs.

A drafter proposes tokens; when most of its cost is the LM head over the whole vocabulary (a small drafter, a large
vocabulary, a CPU), drafting over only the tokens the target actually writes cuts that cost by the vocabulary ratio
(EAGLE-3's reduced draft vocabulary, FR-Spec's frequency-ranked one). The target still verifies over its whole
vocabulary, so output is unchanged; a token outside the draft vocabulary just cannot be drafted, which ends the
accepted run there. The most frequent tokens of the target's answers on the serving distribution cover nearly all
of what it writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def build_draft_vocab(sequences: Iterable[Iterable[int]], size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent token ids of ``sequences`` (ties broken by the smaller id), plus ``always`` (e.g.
    the end-of-sequence ids, so a drafter can propose the end of an answer), ascending: an
    ``AdaFlashConfig.draft_vocab``.

    Args:
        sequences: token id lists the target wrote (its answers to prompts like the ones it will serve).
        size (`int`): tokens to keep (at least 2); fewer when the sequences hold fewer distinct tokens.
        always: ids kept whatever their frequency; they count towards ``size``.
    """
    if size < 2:
        raise ValueError(f"A draft vocabulary needs at least 2 tokens; got size={size}.")
    counts = Counter(token for sequence in sequences for token in sequence)
    keep = set(int(i) for i in always)
    if len(keep) > size:
        raise ValueError(f"size={size} is smaller than the {len(keep)} ids that must always be kept.")
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    for token in ranked:
        if len(keep) >= size:
            break
        keep.add(int(token))
    return sorted(keep)


def coverage(sequences: Iterable[Iterable[int]], draft_vocab: Iterable[int]) -> float:
    """Share of the tokens of ``sequences`` that lie in ``draft_vocab`` (an upper bound on what can be drafted)."""
    vocab = set(draft_vocab)
    total = inside = 0
    for sequence in sequences:
        for token in sequence:
            total += 1
            inside += token in vocab
    return inside / total if total else 0.0
