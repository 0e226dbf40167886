"""A bounded, crash-safe on-disk buffer of served samples (docs/algorithm.md §5.2), one JSON file per sample.

A sample is durable once `SampleBuffer.add` returns: it is written under a temporary name, flushed to disk and
renamed, so a restart finds exactly the acknowledged samples and never a half-written one. The trainer removes a
round's samples only after the version trained on them is published (and a restarted trainer finishes that
removal from the publication's record), so a crash at any point loses no sample; at worst one round is trained
again. Beyond ``capacity`` the oldest samples are evicted and counted, so a trainer that falls behind cannot fill
the disk. A file that cannot be read back (a disk fault) is moved to ``quarantine/``, never deleted.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..utils import TEMPORARY_PREFIX, write_json_atomic

_DOMAIN_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NO_DOMAIN = "_"
_SUFFIX = ".json"


def check_domain(domain: str | None) -> None:
    """Domains name files and adapters, so they are short identifiers."""
    if domain is not None and (not _DOMAIN_PATTERN.match(domain) or domain == _NO_DOMAIN):
        raise ValueError(
            f"Domain tag {domain!r} is not usable: use 1-64 letters, digits, '_', '-' or '.' (and not '_' alone)."
        )


@dataclass(frozen=True)
class Sample:
    """One served request: the target's exact prompt and response token ids (response cut after EOS)."""

    sample_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    domain: str | None = None
    drafter_version: int = 0
    created: float = field(default_factory=time.time)


class SampleBuffer:
    """Samples under ``directory``, oldest first (file names start with the nanosecond time of `add`)."""

    def __init__(self, directory: str | os.PathLike, capacity: int):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.directory = Path(directory)
        self.quarantine = self.directory / "quarantine"
        self.capacity = capacity
        self.evicted = 0
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        # a write interrupted before its rename was never acknowledged
        for partial in self.directory.glob(f"{TEMPORARY_PREFIX}*"):
            partial.unlink(missing_ok=True)

    @staticmethod
    def _domain_of(sample_id: str) -> str | None:
        domain = sample_id.split("--", 1)[1]
        return None if domain == _NO_DOMAIN else domain

    def sample_ids(self, domain: str | None = None) -> list[str]:
        """Ids of the buffered samples, oldest first; only those tagged ``domain`` when one is given."""
        # a write in flight (another thread's `add`) is a staging file that also ends in the suffix: not a sample
        # until its rename, and taken or quarantined before it, the write would fail and its sample be lost
        names = (path.name for path in self.directory.glob(f"*{_SUFFIX}"))
        ids = sorted(name[: -len(_SUFFIX)] for name in names if not name.startswith(TEMPORARY_PREFIX))
        return ids if domain is None else [i for i in ids if self._domain_of(i) == domain]

    def __len__(self) -> int:
        return len(self.sample_ids())

    def domain_counts(self) -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for sample_id in self.sample_ids():
            domain = self._domain_of(sample_id)
            counts[domain] = counts.get(domain, 0) + 1
        return counts

    def add(self, prompt_ids, completion_ids, domain: str | None = None, drafter_version: int = 0) -> Sample:
        """Stores one sample durably; evicts the oldest beyond ``capacity``."""
        check_domain(domain)
        sample_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}--{domain or _NO_DOMAIN}"
        sample = Sample(sample_id, list(map(int, prompt_ids)), list(map(int, completion_ids)), domain, drafter_version)
        with self._lock:
            write_json_atomic(self.directory / f"{sample_id}{_SUFFIX}", asdict(sample))
            overflow = self.sample_ids()[: -self.capacity]
            for old in overflow:
                (self.directory / f"{old}{_SUFFIX}").unlink(missing_ok=True)
            self.evicted += len(overflow)
        return sample

    def take(self, count: int, domain: str | None = None) -> list[Sample]:
        """The ``count`` oldest readable samples (of ``domain``), left in the buffer until `remove`."""
        samples = []
        for sample_id in self.sample_ids(domain):
            path = self.directory / f"{sample_id}{_SUFFIX}"
            try:
                samples.append(Sample(**json.loads(path.read_text(encoding="utf-8"))))
            except FileNotFoundError:
                continue  # evicted or consumed meanwhile
            except (ValueError, TypeError):
                self.quarantine.mkdir(exist_ok=True)
                os.replace(path, self.quarantine / path.name)
                continue
            if len(samples) == count:
                break
        return samples

    def remove(self, sample_ids) -> None:
        with self._lock:
            for sample_id in sample_ids:
                (self.directory / f"{sample_id}{_SUFFIX}").unlink(missing_ok=True)
