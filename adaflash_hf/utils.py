"""File helpers shared by the library (and the demo): atomic writes and JSONL rows.

Everything that other processes read while it may be rewritten (checkpoints, rollouts, published drafter versions,
buffered samples, the stages of a resumable recipe) goes through `atomic_directory` or `atomic_path` (and the
writers built on it: `atomic_file`, `write_json_atomic`, `write_jsonl`, `write_text_atomic`), so a reader, or a run
resumed after a crash, sees either the old content or the whole new one, never a half-written file.
"""

from __future__ import annotations

import gzip
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


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a staging path beside ``path`` for a writer that takes a file name (``safetensors.torch.save_file``);
    when the block succeeds the file is synced to disk and renamed onto ``path``, so a reader (or a run resumed after
    a crash, which skips finished outputs) sees the old file or the whole new one, never a half-written one. When the
    block raises, ``path`` is untouched and the staging file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}-{path.name}")
    try:
        yield temporary
        with temporary.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator:
    """`atomic_path` for text: yields an open UTF-8 handle."""
    with atomic_path(path) as temporary, temporary.open("w", encoding="utf-8") as handle:
        yield handle


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` through `atomic_file`."""
    with atomic_file(path) as handle:
        handle.write(text)


def write_json_atomic(path: str | os.PathLike, payload, *, indent: int | None = None) -> None:
    """Writes ``payload`` as JSON through `atomic_file`."""
    with atomic_file(path) as handle:
        json.dump(payload, handle, indent=indent)
        if indent is not None:
            handle.write("\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """Writes one JSON object per line (UTF-8, unescaped, so the files diff and grep well) through `atomic_file`:
    resumable stages take a file that exists for a finished one."""
    with atomic_file(path) as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Appends one row and flushes it; callers that write from several threads hold their own lock."""
    with Path(path).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: str | os.PathLike, *, skip_invalid: bool = False) -> list[dict]:
    """The rows of a JSONL file, gzipped when its name ends in ``.gz`` (blank lines skipped). ``skip_invalid=True``
    also skips lines that do not parse, for append-only logs whose last line a crash may have torn; otherwise such a
    line raises, naming the line."""
    rows = []
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as error:
                if not skip_invalid:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({error})") from error
    return rows


class CommandError(ValueError):
    """Bad command-line input; the message names the problem and the fix, and the command exits with it (the
    `adaflash` commands and the training command raise it; `adaflash_hf.cli` turns it into an exit)."""
