"""Small file helpers shared by the world stages: JSONL rows and atomic directory writes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Writes one JSON object per line (UTF-8, unescaped) so the files diff and grep well."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@contextmanager
def atomic_directory(final_path: Path) -> Iterator[Path]:
    """Yields a temporary sibling directory and renames it to ``final_path`` only when the block succeeds.

    An interrupted stage then never leaves a half-written model or tokenizer that a later stage would load.
    """
    final_path = Path(final_path)
    temporary = final_path.with_name(final_path.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    shutil.rmtree(final_path, ignore_errors=True)
    temporary.rename(final_path)
