"""N-gram candidates: the continuations a row's own context (prompt and committed tokens) offers for its suffix.

Prompt lookup (transformers' ``prompt_lookup_num_tokens``) proposes, after the longest of the last
``max_match .. min_match`` tokens that occurred earlier in the context, the tokens that followed that occurrence. It
pays wherever the answer quotes its input (summaries, edits of given code, repeated chat turns), and costs no drafter
forward. `SuffixIndex` keeps, per row, every n-gram of the match lengths with the positions that follow its
occurrences, updated as tokens are committed (``max_match - min_match + 1`` dictionary appends a token), so a
lookup costs a few dictionary reads and a bounded scan of recent occurrences however long the context grows; a
rescan, as transformers' prompt lookup does each step, grows with the context.

A lookup (`SuffixIndex.lookup`) returns, for the longest match length that has an earlier occurrence, up to
``continuations`` distinct continuations of ``length`` tokens, the most recent occurrence first (the text being
copied now is likelier to continue as it did most recently), scanning at most ``SCAN_PER_CONTINUATION`` occurrences
per continuation asked. Two continuations are distinct when neither is a prefix of the other: a prefix adds no
node to a token tree, and a continuation that extends one already chosen replaces it. A continuation may run into
the suffix itself (``a b a b`` after ``a b``), as prompt lookup's does, and ends at the end of the context.

Only committed tokens enter the index (drafts a step rejects never do), so the candidates are a deterministic
function of the committed prefix; rows are independent and leave with `NgramIndex.select_rows`, as the loop's
other per-row state does. The candidates are verified as extra paths of the step's draft tree (`tree.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SCAN_PER_CONTINUATION = 8  # occurrences scanned per continuation asked: bounds a lookup when a short n-gram repeats


def _add_distinct(chosen: list[list[int]], continuation: list[int]) -> None:
    """Adds `continuation` to `chosen` unless it is a prefix of one there; replaces one it extends."""
    for i, other in enumerate(chosen):
        if other[: len(continuation)] == continuation:
            return
        if continuation[: len(other)] == other:
            chosen[i] = continuation
            return
    chosen.append(continuation)


class SuffixIndex:
    """The n-grams of one row's context, each with the positions that follow its occurrences (module docstring).

    Args:
        max_match (`int`): the longest suffix matched. min_match (`int`): the shortest (1 matches a single token).
        tokens (`Iterable[int]`, *optional*): the context to start from.
    """

    def __init__(self, max_match: int, min_match: int = 1, tokens: Iterable[int] = ()):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"match lengths must satisfy 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match, self.min_match = max_match, min_match
        self.tokens: list[int] = []
        # n-gram (a tuple; lengths min_match..max_match share the dict) -> positions following its occurrences,
        # ascending; the last may be len(tokens) (the suffix itself, which has no continuation yet)
        self.follow: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends committed tokens, indexing the n-grams that end at each."""
        context, follow = self.tokens, self.follow
        for token in tokens:
            context.append(int(token))
            end = len(context)
            for n in range(self.min_match, min(self.max_match, end) + 1):
                follow.setdefault(tuple(context[end - n :]), []).append(end)

    def lookup(self, length: int, continuations: int = 1) -> tuple[int, list[list[int]]]:
        """``(n, paths)``: the longest match length ``n`` whose suffix occurred earlier, and up to `continuations`
        distinct continuations of at most `length` tokens after its occurrences, the most recent first; ``(0, [])``
        when no suffix of the match lengths occurred earlier (or `length` is 0)."""
        context, end = self.tokens, len(self.tokens)
        if length <= 0 or continuations <= 0:
            return 0, []
        for n in range(min(self.max_match, end - 1), self.min_match - 1, -1):
            positions = self.follow.get(tuple(context[end - n :]))
            if not positions or (len(positions) == 1 and positions[0] == end):
                continue
            chosen: list[list[int]] = []
            scanned = 0
            for start in reversed(positions):
                if start >= end:
                    continue  # the suffix itself
                _add_distinct(chosen, context[start : start + length])
                scanned += 1
                if len(chosen) >= continuations or scanned >= SCAN_PER_CONTINUATION * continuations:
                    break
            return n, chosen
        return 0, []


class NgramIndex:
    """One `SuffixIndex` per active row of a batch.

    Args:
        contexts (`Sequence[Sequence[int]]`): each row's context (its prompt without padding).
        max_match, min_match (`int`): the suffix lengths matched (`SuffixIndex`).
    """

    def __init__(self, contexts: Sequence[Sequence[int]], max_match: int, min_match: int = 1):
        self.rows = [SuffixIndex(max_match, min_match, context) for context in contexts]

    def extend(self, tokens: Sequence[Sequence[int]]) -> None:
        """Appends each active row's committed tokens (``tokens[b]`` for row ``b``)."""
        for index, new in zip(self.rows, tokens, strict=True):
            index.extend(new)

    def select_rows(self, index: Iterable[int]) -> None:
        """Keeps the rows in `index`, in that order (finished rows leave the batch)."""
        self.rows = [self.rows[i] for i in index]

    def paths(
        self, room: Sequence[int], length: int, continuations: int, stop: Iterable[int] = ()
    ) -> list[list[list[int]]]:
        """Each row's candidate paths: its lookup's continuations, each at most ``room[b]`` tokens (the drafts the
        row's token budget leaves) and ending at its first `stop` token (nothing after an end of sequence is
        committed)."""
        stop = set(stop)
        out = []
        for index, budget in zip(self.rows, room, strict=True):
            _, found = index.lookup(min(length, budget), continuations)
            cut = []
            for path in found:
                for i, token in enumerate(path):
                    if token in stop:
                        path = path[: i + 1]
                        break
                cut.append(path)
            out.append(cut)
        return out
