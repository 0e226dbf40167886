"""Versioned, checksummed publication of trained weights from the trainer to the serving side
(docs/algorithm.md §5.3).

Layout under the store's root, one *channel* per thing that is trained (``drafter``, or ``adapter-<domain>``)::

    <channel>/v00003/...        the weights of version 3 (any files: a drafter or a PEFT adapter checkpoint)
    <channel>/LATEST.json       {"version": 3, "directory": "v00003", "sha256": {file: digest}, "consumed": [...]}

`VersionStore.publish` writes the weights into a temporary directory, flushes them and renames it into place, and
only then replaces the marker (itself written atomically), so the marker never names weights that are not
complete. The reader recomputes every digest before loading (`verify`), which also catches weights that were
truncated or altered after publishing. ``consumed`` lists the buffered samples the version was trained on: the
trainer deletes them after publishing, and a restarted trainer finishes that deletion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..utils import atomic_directory, write_json_atomic

MARKER = "LATEST.json"


class PublishError(RuntimeError):
    """A publication that cannot be used: unreadable marker, missing file or checksum mismatch."""


@dataclass(frozen=True)
class Publication:
    channel: str
    version: int
    path: Path
    sha256: dict[str, str]
    consumed: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identifies this exact publication (a republished version with other weights gets another key)."""
        return hashlib.sha256(json.dumps([self.version, self.sha256], sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


class VersionStore:
    """Publications by channel under ``root``; keeps the newest ``keep_versions`` weight directories per channel."""

    def __init__(self, root: str | os.PathLike, keep_versions: int = 3):
        self.root = Path(root)
        self.keep_versions = max(keep_versions, 2)  # the served version and the one being loaded both stay
        self.root.mkdir(parents=True, exist_ok=True)

    def channels(self) -> list[str]:
        return sorted(path.parent.name for path in self.root.glob(f"*/{MARKER}"))

    def latest(self, channel: str) -> Publication | None:
        """The channel's current publication, ``None`` before the first; `PublishError` if the marker is unreadable."""
        marker = self.root / channel / MARKER
        if not marker.exists():
            return None
        try:
            raw = json.loads(marker.read_text(encoding="utf-8"))
            return Publication(
                channel=channel,
                version=int(raw["version"]),
                path=self.root / channel / raw["directory"],
                sha256=dict(raw["sha256"]),
                consumed=list(raw.get("consumed", [])),
                info=dict(raw.get("info", {})),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise PublishError(
                f"{marker} is unreadable ({error}); the trainer rewrites it at its next publish"
            ) from None

    def publish(
        self, channel: str, write: Callable[[Path], None], consumed: list[str] = (), info: dict | None = None
    ) -> Publication:
        """Publishes the files ``write(directory)`` creates as the channel's next version."""
        channel_dir = self.root / channel
        channel_dir.mkdir(parents=True, exist_ok=True)
        try:
            previous = self.latest(channel)
        except PublishError:
            previous = None
        version = self._next_version(channel_dir, previous)
        final = channel_dir / f"v{version:05d}"
        # replaces an orphan `final` of a crash between its rename and the marker
        with atomic_directory(final) as staging:
            write(staging)
            _fsync_tree(staging)
            sha256 = {
                path.relative_to(staging).as_posix(): file_sha256(path)
                for path in sorted(staging.rglob("*"))
                if path.is_file()
            }
        info = {"published": time.time(), **(info or {})}
        marker = {
            "version": version,
            "directory": final.name,
            "sha256": sha256,
            "consumed": list(consumed),
            "info": info,
        }
        write_json_atomic(channel_dir / MARKER, marker)
        self._prune(channel_dir, version)
        return Publication(channel, version, final, sha256, list(consumed), info)

    @staticmethod
    def _next_version(channel_dir: Path, previous: Publication | None) -> int:
        # Above every directory ever written too, so an unreadable marker never makes a version number repeat.
        written = [int(path.name[1:]) for path in channel_dir.glob("v[0-9]*") if path.name[1:].isdigit()]
        return max([previous.version if previous else 0, *written]) + 1

    def _prune(self, channel_dir: Path, newest: int) -> None:
        for path in channel_dir.glob("v[0-9]*"):
            if path.name[1:].isdigit() and int(path.name[1:]) <= newest - self.keep_versions:
                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def verify(publication: Publication) -> None:
        """Recomputes every file's digest; `PublishError` names the first file that is missing or differs."""
        if not publication.sha256:
            raise PublishError(f"{publication.channel} v{publication.version} lists no files")
        for name, expected in publication.sha256.items():
            path = publication.path / name
            if not path.is_file():
                raise PublishError(f"{publication.channel} v{publication.version}: {name} is missing")
            if file_sha256(path) != expected:
                raise PublishError(
                    f"{publication.channel} v{publication.version}: {name} does not match its published sha256 "
                    "(truncated or altered after publishing)"
                )
