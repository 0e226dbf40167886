"""File helpers shared by the library (and the demo): atomic writes and JSONL rows.

Everything that other processes read while it may be rewritten (checkpoints, rollouts, published drafter versions,
buffered samples) goes through `atomic_directory` or `write_json_atomic`, so a reader, or a run resumed after a
crash, sees either the old content or the whole new one, never a half-written file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

TEMPORARY_PREFIX = ".tmp-"  # staging names start with it, so directory scans can skip or sweep leftovers


@contextmanager
def atomic_directory(final: str | os.PathLike, *, merge: bool = False, last: Iterable[str] = ()) -> Iterator[Path]:
    """Yields an empty staging directory beside ``final``; when the block succeeds its content becomes ``final``.

    ``merge=False`` replaces ``final`` as a whole by one rename (a previous ``final``, e.g. the orphan of a crash, is
    removed first). ``merge=True`` moves each staged file into ``final`` and keeps what else is there (a Trainer's
    ``output_dir`` holds checkpoints and logs beside the model); the names in ``last`` move last, so a config never
    names weights that are not in place yet. When the block raises, ``final`` is untouched and staging is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{final.name}-", dir=final.parent))
    try:
        yield staging
        if merge:
            final.mkdir(exist_ok=True)
            late = set(last)
            for path in sorted(staging.iterdir(), key=lambda p: p.name in late):
                os.replace(path, final / path.name)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json_atomic(path: str | os.PathLike, payload) -> None:
    """Writes ``payload`` as JSON so that a reader sees the old file or the whole new one, also after a crash."""
    path = Path(path)
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}-{path.name}")
    with temporary.open("w", encoding="utf-8") as handle:
        json.dump(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """Writes one JSON object per line (UTF-8, unescaped) so the files diff and grep well."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Appends one row and flushes it; callers that write from several threads hold their own lock."""
    with Path(path).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: str | os.PathLike, *, skip_invalid: bool = False) -> list[dict]:
    """The rows of a JSONL file (blank lines skipped). ``skip_invalid=True`` also skips lines that do not parse,
    for append-only logs whose last line a crash may have torn; otherwise such a line raises, naming the line."""
    rows = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as error:
                if not skip_invalid:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({error})") from error
    return rows
