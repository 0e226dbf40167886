"""Per-call speculative decoding statistics: ``with adaflash_hf.record_stats() as stats: target.generate(...)``.

Recording is scoped by a `ContextVar`, so concurrent threads (or asyncio tasks) each see only their own calls, and a
decoding loop with no active recorder does no timing work at all.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

_RECORDERS: ContextVar[tuple[SpeculativeStats, ...]] = ContextVar("adaflash_recorders", default=())


@dataclass
class StepRecord:
    """One verification step of one generate() call; list entries are per active row.

    rows: row indices (into the call's batch) that were verified this step.
    candidate_lengths: tokens each row offered the target (anchor included).
    accepted: drafts accepted per row. emitted: tokens committed per row (accepted + 1, less if a stop hit).
    verify_width: tokens per row in the padded verification forward (max candidate length).
    draft_time_s / target_time_s: wall time of the drafter and of the target forward (device-synchronised).
    step_time_s / predicted_step_s / predicted_tokens (``length_policy="planned"`` only, else ``None``): the whole
        step's measured wall time, and what the planner predicted it would cost and commit when it chose the width.
    drafter_accepted / drafter_offered / ngram_accepted / ngram_offered (``adaflash_ngram`` tree steps only, else
        ``None``): per source of the merged tree, the leading tokens of the accepted path it proposed and the deepest
        path it offered (a token both proposed counts for both).
    drafter_ran: whether the drafter ran this step (``None``: not recorded). With `verify_width` it names the step's
        `kind`.
    """

    rows: list[int]
    candidate_lengths: list[int]
    accepted: list[int]
    emitted: list[int]
    verify_width: int
    draft_time_s: float
    target_time_s: float
    step_time_s: float | None = None
    predicted_step_s: float | None = None
    predicted_tokens: float | None = None
    drafter_accepted: list[int] | None = None
    drafter_offered: list[int] | None = None
    ngram_accepted: list[int] | None = None
    ngram_offered: list[int] | None = None
    drafter_ran: bool | None = None

    @property
    def kind(self) -> str:
        """``"plain"`` (the anchor alone, no draft), ``"probe"`` (the anchor alone verified while the drafter drafted
        a block the planner scores against the tokens then committed, `planner.py`), ``"drafted"`` (drafts
        verified, merged n-gram paths among them or not) or ``"paths"`` (merged n-gram paths verified without
        the drafter)."""
        if self.verify_width == 1:
            return "probe" if self.drafter_ran else "plain"
        return "drafted" if self.drafter_ran or self.drafter_ran is None else "paths"


@dataclass
class CallRecord:
    """One generate() call: its batch size, its steps, the runtime profile it used (``profile``: the profile
    file, ``None`` when profiles are kept in memory only; ``profile_loaded``: whether the call started from the
    file's measurements, `profile.py`), and how its prompt was read (``prefill_forwards``: 1 for one forward over
    the padded batch, more for rows read in groups, `prefill.py`; ``prefill_time_s``: their wall time)."""

    batch_size: int
    steps: list[StepRecord] = field(default_factory=list)
    profile: str | None = None
    profile_loaded: bool = False
    prefill_forwards: int = 0
    prefill_time_s: float = 0.0

    def row(self, index: int) -> dict:
        """Per-row figures: verification steps, emitted tokens, mean acceptance length."""
        emitted = steps = verified = 0
        for step in self.steps:
            if index in step.rows:
                slot = step.rows.index(index)
                steps, emitted, verified = (
                    steps + 1,
                    emitted + step.emitted[slot],
                    verified + step.candidate_lengths[slot],
                )
        return {
            "steps": steps,
            "emitted_tokens": emitted,
            "verified_tokens": verified,
            "mean_acceptance_length": emitted / steps if steps else 0.0,
        }


@dataclass
class SpeculativeStats:
    """Everything recorded inside one `record_stats()` block."""

    calls: list[CallRecord] = field(default_factory=list)

    @property
    def steps(self) -> list[StepRecord]:
        return [step for call in self.calls for step in call.steps]

    def _total(self, name: str) -> int:
        return sum(sum(getattr(step, name)) for step in self.steps)

    @property
    def verification_steps(self) -> int:
        """Row-steps: a step that verifies R rows counts R times."""
        return sum(len(step.rows) for step in self.steps)

    @property
    def emitted_tokens(self) -> int:
        return self._total("emitted")

    @property
    def verified_tokens(self) -> int:
        return self._total("candidate_lengths")

    @property
    def mean_acceptance_length(self) -> float:
        """Emitted tokens per target verification step, bonus included (DFlash's tau); prefill excluded."""
        return self.emitted_tokens / max(self.verification_steps, 1)

    @property
    def verified_tokens_per_emitted_token(self) -> float:
        return self.verified_tokens / max(self.emitted_tokens, 1)

    def source_acceptance(self, source: str) -> dict:
        """``source`` (``"drafter"`` or ``"ngram"``) of ``adaflash_ngram`` steps: tokens it offered (its deepest path
        per row-step) and accepted, and the accepted share."""
        offered = sum(sum(getattr(s, f"{source}_offered") or ()) for s in self.steps)
        accepted = sum(sum(getattr(s, f"{source}_accepted") or ()) for s in self.steps)
        return {"offered": offered, "accepted": accepted, "rate": accepted / offered if offered else 0.0}

    def by_kind(self) -> dict[str, dict]:
        """Per step `StepRecord.kind`: steps, row-steps, tokens committed, seconds (the planner's measured step time,
        else draft plus target time), and, where the planner predicted them, predicted seconds and tokens: where the
        loop's time went, and how well the planner priced it."""
        kinds: dict[str, dict] = {}
        for step in self.steps:
            entry = kinds.setdefault(
                step.kind,
                {
                    "steps": 0,
                    "row_steps": 0,
                    "emitted_tokens": 0,
                    "seconds": 0.0,
                    "predicted_s": 0.0,
                    "predicted_tokens": 0.0,
                },
            )
            entry["steps"] += 1
            entry["row_steps"] += len(step.rows)
            entry["emitted_tokens"] += sum(step.emitted)
            measured = step.step_time_s
            entry["seconds"] += step.draft_time_s + step.target_time_s if measured is None else measured
            entry["predicted_s"] += step.predicted_step_s or 0.0
            entry["predicted_tokens"] += step.predicted_tokens or 0.0
        return kinds

    @property
    def draft_time_s(self) -> float:
        return sum(step.draft_time_s for step in self.steps)

    @property
    def target_time_s(self) -> float:
        return sum(step.target_time_s for step in self.steps)

    def summary(self) -> dict:
        return {
            "calls": len(self.calls),
            "verification_steps": self.verification_steps,
            "emitted_tokens": self.emitted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "verified_tokens_per_emitted_token": self.verified_tokens_per_emitted_token,
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "steps_by_kind": {kind: entry["steps"] for kind, entry in self.by_kind().items()},
        }


@contextlib.contextmanager
def record_stats():
    """Collects a `SpeculativeStats` for every speculative generate() call made inside the block (nesting allowed)."""
    stats = SpeculativeStats()
    token = _RECORDERS.set(_RECORDERS.get() + (stats,))
    try:
        yield stats
    finally:
        _RECORDERS.reset(token)


class CallRecorder:
    """What a decoding loop holds for one call; a no-op when nobody records."""

    def __init__(self, batch_size: int, device: torch.device):
        recorders = _RECORDERS.get()
        self.active = bool(recorders)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if self.active:
            self.call = CallRecord(batch_size)
            for stats in recorders:
                stats.calls.append(self.call)

    def clock(self) -> float:
        if not self.active:
            return 0.0
        self._sync()
        return time.perf_counter()

    def add(self, **record) -> None:
        if self.active:
            self.call.steps.append(StepRecord(**record))

    def prefilled(self, forwards: int, seconds: float) -> None:
        """Notes how the prompt was read: in how many forwards, in how long."""
        if self.active:
            self.call.prefill_forwards, self.call.prefill_time_s = forwards, seconds

    def uses(self, profile) -> None:
        """Notes the runtime profile the call uses."""
        if self.active:
            self.call.profile = None if profile.path is None else str(profile.path)
            self.call.profile_loaded = profile.loaded
