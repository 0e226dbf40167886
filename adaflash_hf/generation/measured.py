"""A choice between exact ways of computing the same thing, made by timing each where it runs.

Which of two kernels is faster on a CPU cannot be read off the hardware: the draft head's bfloat16 copy of the LM
head (`draft_head.py`) was faster than float32 in a standalone loop on one machine and slower inside the decoding
loop on the same machine; the target's float32 GEMMs on 2-7 tokens (`verify_layout.py`) run faster in one layout
than the other inside a forward, which a microbenchmark with the weights in cache does not show (BENCHMARKS.md §3).
So the loop times them where they are used: the first calls of each key rotate through the options (the one timed
fewest times runs next, so all see the same conditions), and after `trials` timings of each the fastest candidate
by median is kept if it beats the baseline by its margin, else the baseline. A trial of a slow option is a slow step
of the caller's, so a candidate that one timing shows far slower than the baseline (``drop``) is timed no more for
that key: it could win only by a timing error several times the spread of a step's time.

Generations in several threads may share a key (transformers' generate() is thread-safe per call), so the
bookkeeping is locked (with the lock of the `profile.RuntimeProfile` that owns the choice); the timed work itself is
not.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Hashable


class MeasuredChoice:
    """Per key, ``baseline`` or one of the ``candidates``, whichever the timings found fastest.

    Args:
        baseline: the option kept unless a candidate is clearly faster.
        candidates (`tuple`): the options timed against it.
        trials (`int`): timings of each option before the key is decided.
        margin (`float`): a candidate can be chosen when its median time is below ``margin`` times the
            baseline's; the fastest such candidate is.
        margins (`dict`, *optional*): ``option -> margin`` for the candidates whose margin is not ``margin``.
        lock (`threading.RLock`, *optional*): the lock guarding the bookkeeping (its owner's; a new one by default).
        candidates_for (`Callable`, *optional*): ``key -> candidates`` timed for that key (a subset of
            ``candidates``; all of them by default), where some are known not to be worth their trials.
        drop (`float`, *optional*): a candidate timed above ``drop`` times the baseline's median so far is timed no
            more for that key (never, by default).
    """

    def __init__(
        self,
        baseline,
        candidates: tuple,
        trials: int,
        margin: float,
        lock=None,
        candidates_for=None,
        drop=None,
        margins: dict | None = None,
    ):
        self.baseline, self.candidates = baseline, tuple(candidates)
        self.candidates_for = candidates_for
        self.trials_per_option = trials
        self.margin = margin
        self.margins = {} if margins is None else dict(margins)
        self.drop = drop
        self.choices: dict[Hashable, object] = {}  # key -> the option kept
        self.timings: dict[Hashable, dict[object, list[float]]] = {}  # key -> option -> seconds, while measuring
        self._lock = threading.RLock() if lock is None else lock

    @property
    def options(self) -> tuple:
        return (self.baseline, *self.candidates)

    def chosen(self, key: Hashable):
        """The option decided for ``key``; ``None`` while it is still measured."""
        return self.choices.get(key)

    def options_for(self, key: Hashable) -> tuple:
        """The baseline and the candidates timed for ``key``."""
        candidates = self.candidates if self.candidates_for is None else self.candidates_for(key)
        return (self.baseline, *(c for c in self.candidates if c in candidates))

    def next_trial(self, key: Hashable):
        """The option the next timed call of ``key`` runs."""
        with self._lock:
            timings = self.timings.setdefault(key, {option: [] for option in self.options_for(key)})
            return min(timings, key=lambda option: len(timings[option]))

    def record(self, key: Hashable, option, seconds: float) -> None:
        """Adds one timing of ``option`` (dropping it if `drop` says so); decides the key once every option still
        timed has `trials` timings."""
        with self._lock:
            timings = self.timings.get(key)
            if timings is None or option not in timings:  # another thread's timing decided it, or dropped the option
                return
            timings[option].append(seconds)
            baseline = timings[self.baseline]
            if self.drop is not None and option != self.baseline and baseline:
                if seconds > self.drop * statistics.median(baseline):
                    del timings[option]
            if all(len(times) >= self.trials_per_option for times in timings.values()):
                medians = {option: statistics.median(times) for option, times in timings.items()}
                base = medians.pop(self.baseline)
                winners = [o for o, m in medians.items() if m < self.margins.get(o, self.margin) * base]
                self.choices[key] = min(winners, key=medians.get) if winners else self.baseline
                self.timings.pop(key, None)

    def clear(self) -> None:
        """Forgets every choice and measurement (the next calls measure again)."""
        with self._lock:
            self.choices.clear()
            self.timings.clear()
