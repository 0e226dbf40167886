"""A choice between two exact ways of computing the same thing, made by timing both where they run.

Which of two kernels is faster on a CPU cannot be read off the hardware: the draft head's bfloat16 copy of the LM
head (`draft_head.py`) was faster than float32 in a standalone loop on one machine and slower inside the decoding
loop on the same machine; the target's float32 GEMMs on 2-7 tokens (`verify_layout.py`) run faster in one layout
than the other inside a forward, which a microbenchmark with the weights in cache does not show (BENCHMARKS.md §3).
So the loop times both where they are used: the first calls of each key alternate between the options (the one timed
fewest times runs next, so both see the same conditions), and after `trials` timings of each the faster by median is
kept, the candidate only if it wins by the margin.

Generations in several threads may share a key (transformers' generate() is thread-safe per call), so the
bookkeeping is locked (with the lock of the `profile.RuntimeProfile` that owns the choice); the timed work itself is
not.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Hashable


class MeasuredChoice:
    """Per key, ``baseline`` or ``candidate``, whichever the timings of both found faster.

    Args:
        baseline: the option kept unless the candidate is clearly faster.
        candidate: the option timed against it.
        trials (`int`): timings of each option before the key is decided.
        margin (`float`): the candidate is chosen when its median time is below ``margin`` times the baseline's.
        lock (`threading.RLock`, *optional*): the lock guarding the bookkeeping (its owner's; a new one by default).
    """

    def __init__(self, baseline, candidate, trials: int, margin: float, lock=None):
        self.baseline, self.candidate = baseline, candidate
        self.trials_per_option = trials
        self.margin = margin
        self.choices: dict[Hashable, object] = {}  # key -> the option kept
        self.timings: dict[Hashable, dict[object, list[float]]] = {}  # key -> option -> seconds, while measuring
        self._lock = threading.RLock() if lock is None else lock

    def chosen(self, key: Hashable):
        """The option decided for ``key``; ``None`` while it is still measured."""
        return self.choices.get(key)

    def next_trial(self, key: Hashable):
        """The option the next timed call of ``key`` runs."""
        with self._lock:
            timings = self.timings.setdefault(key, {self.baseline: [], self.candidate: []})
            return min(timings, key=lambda option: len(timings[option]))

    def record(self, key: Hashable, option, seconds: float) -> None:
        """Adds one timing of ``option``; decides the key once both options have `trials` timings."""
        with self._lock:
            timings = self.timings.get(key)
            if timings is None:  # another thread's timing decided it meanwhile
                return
            timings[option].append(seconds)
            if all(len(times) >= self.trials_per_option for times in timings.values()):
                baseline, candidate = (statistics.median(timings[o]) for o in (self.baseline, self.candidate))
                self.choices[key] = self.candidate if candidate < self.margin * baseline else self.baseline
                self.timings.pop(key, None)

    def clear(self) -> None:
        """Forgets every choice and measurement (the next calls measure again)."""
        with self._lock:
            self.choices.clear()
            self.timings.clear()
