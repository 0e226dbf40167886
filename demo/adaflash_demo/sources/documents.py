"""The documents the real target's prompts are built from: files already on the machine (never downloaded) and
generated arithmetic.

* ``code``: CPython standard-library ``.py`` files, tests and generated tables excluded.
* ``prose``: GNU info manuals, the Python language reference (``pydoc_data.topics``) and README/md/txt/rst files
  from ``/usr/share/doc`` (changelogs, copyright and news files excluded), cut into chunks.
* ``man``: man pages rendered as plain text with ``MANWIDTH=80 man -l FILE | col -bx``.
* ``math``: generated GSM8K-style word problems (:mod:`adaflash_demo.sources.arithmetic`).
* ``changelog``: Debian package changelogs (``/usr/share/doc/*/changelog.Debian.gz``), which no other source reads:
  the domain no drafter trains on, kept for evaluation and for the online-adaptation stream.

Sources are visited in a seeded order, so a seed fixes which documents come first. Whether a document is held out
is a fixed function of its id (`is_heldout`), independent of the seed, so a held-out document stays held out in
every build that reads it.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import shutil
import subprocess
import sysconfig
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .arithmetic import generate_problem

_EXCLUDED_DOC_WORDS = ("changelog", "copyright", "news")
_DOC_SUFFIXES = (".md", ".txt", ".rst")


class CorpusError(RuntimeError):
    """A domain cannot be read from this machine's files; the message names the missing piece and the fix."""


@dataclass(frozen=True)
class Document:
    """One unit of a domain. ``doc_id`` names its source (path, chunk, page), so it is stable across builds and
    decides the held-out split."""

    doc_id: str
    text: str


@dataclass
class CorpusConfig:
    """Where each domain's documents come from and how much of a source is read."""

    max_chars_per_file: int = field(
        default=400_000,
        metadata={
            "help": "Only the first this many characters of a source file are read, so one huge file "
            "(e.g. node's API docs) cannot fill a domain."
        },
    )
    prose_chunk_chars: int = field(
        default=8192,
        metadata={
            "help": "Prose sources are cut into chunks of about this size; each chunk is one document, so a few long "
            "GNU manuals still give many held-out candidates."
        },
    )
    min_document_chars: int = field(
        default=200, metadata={"help": "Shorter documents (stubs, redirects) are dropped."}
    )
    max_gcloud_man_pages: int = field(
        default=400,
        metadata={"help": "Cap on the templated `gcloud` man pages, which would otherwise be most of section 1."},
    )
    man_render_threads: int = field(default=2, metadata={"help": "Parallel `man` processes while rendering."})
    stdlib_dir: str | None = field(
        default=None,
        metadata={
            "help": "CPython standard library directory (the code domain); None: this interpreter's (sysconfig)."
        },
    )
    excluded_stdlib_dirs: tuple[str, ...] = field(
        default=("test", "tests", "idle_test", "site-packages", "pydoc_data", "encodings"),
        metadata={
            "help": "Directory names skipped in the stdlib: tests, third-party code, the language reference "
            "(used as prose) and generated codec tables."
        },
    )
    info_dir: str = field(default="/usr/share/info", metadata={"help": "GNU info manuals (prose)."})
    doc_dir: str = field(default="/usr/share/doc", metadata={"help": "Package documentation (prose)."})
    man_dir: str = field(default="/usr/share/man", metadata={"help": "Man pages; only sections man1-man8 are read."})
    changelog_dir: str = field(default="/usr/share/doc", metadata={"help": "Where */changelog.Debian.gz live."})
    max_chars_per_changelog: int = field(default=20_000, metadata={"help": "Characters read per changelog."})


def is_heldout(doc_id: str, heldout_percent: float) -> bool:
    """Whether a document is held out: a fixed function of its id, so held-out sets never drift between builds."""
    bucket = int(hashlib.md5(doc_id.encode("utf-8")).hexdigest()[:8], 16) % 10_000
    return bucket < heldout_percent * 100


def read_text_file(path: Path, max_chars: int) -> str | None:
    """UTF-8 text of a plain or gzipped file, or None for binary or non-UTF-8 files (they are not prose)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read(4 * max_chars)  # UTF-8 needs at most 4 bytes per character
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None
    return None if "\x00" in text else text[:max_chars]


def _shuffled(items: Iterable, rng: random.Random) -> list:
    ordered = sorted(items)
    rng.shuffle(ordered)
    return ordered


def _keep(text: str | None, config: CorpusConfig) -> bool:
    return text is not None and len(text.strip()) >= config.min_document_chars


# ---------------------------------------------------------------------------------------------------- code


def code_documents(config: CorpusConfig, rng: random.Random) -> Iterator[Document]:
    """Whole standard-library modules in a seeded order; one file is one document."""
    root = Path(config.stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(
            f"The code domain needs the CPython standard library, but {root} does not exist; "
            f"set CorpusConfig.stdlib_dir."
        )
    excluded = set(config.excluded_stdlib_dirs)
    files = [
        path
        for path in root.rglob("*.py")
        if not excluded.intersection(path.relative_to(root).parts[:-1]) and not path.name.startswith("test_")
    ]
    for path in _shuffled(files, rng):
        text = read_text_file(path, config.max_chars_per_file)
        if _keep(text, config):
            yield Document(f"code:{path.relative_to(root)}", text)


# ---------------------------------------------------------------------------------------------------- prose


def prose_documents(config: CorpusConfig, rng: random.Random) -> Iterator[Document]:
    """Chunks of info manuals, pydoc topics and package docs, sources in a seeded order."""
    sources = [("info", str(path)) for path in _info_files(config)] + [
        ("doc", str(path)) for path in _doc_files(config)
    ]
    sources.append(("pydoc", "pydoc_data.topics"))
    for kind, path in _shuffled(sources, rng):
        yield from _prose_source_documents(kind, Path(path), config)


def _prose_source_documents(kind: str, path: Path, config: CorpusConfig) -> Iterator[Document]:
    if kind == "pydoc":
        from pydoc_data.topics import topics

        for name in sorted(topics):
            if _keep(topics[name], config):
                yield Document(f"prose:pydoc/{name}", topics[name])
        return
    text = read_text_file(path, config.max_chars_per_file)
    if text is None:
        return
    if kind == "info":
        text = clean_info_text(text)
    for index, chunk in enumerate(chunk_text(text, config.prose_chunk_chars)):
        if _keep(chunk, config):
            yield Document(f"prose:{path}#{index}", chunk)


def _info_files(config: CorpusConfig) -> list[Path]:
    root = Path(config.info_dir)
    return [path for path in root.glob("*.info*") if path.is_file()] if root.is_dir() else []


def _doc_files(config: CorpusConfig) -> list[Path]:
    """README/md/txt/rst files (gzipped or not) that are documentation, not changelogs or licences."""
    root = Path(config.doc_dir)
    if not root.is_dir():
        return []
    selected = []
    for path in root.rglob("*"):
        name = path.name.lower().removesuffix(".gz")
        if path.is_symlink() or not path.is_file() or any(word in name for word in _EXCLUDED_DOC_WORDS):
            continue
        if name.startswith("readme") or name.endswith(_DOC_SUFFIXES):
            selected.append(path)
    return selected


def clean_info_text(text: str) -> str:
    """Drops the info navigation markup (node separators, ``File: ... Node:`` lines, index markers, tag table)."""
    text = text.split("\x1fTag Table:")[0]
    text = text.replace("\x00\x08[index\x00\x08]", "").replace("\x00\x08[image\x00\x08]", "")
    lines = [line for line in text.split("\n") if line != "\x1f" and not line.startswith("File: ")]
    return "\n".join(lines).replace("\x1f", "")


def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cuts text into pieces of at most ``chunk_chars``, at a paragraph (else line) break where there is one."""
    chunks = []
    while len(text) > chunk_chars:
        window = text[:chunk_chars]
        cut = window.rfind("\n\n")
        if cut < chunk_chars // 2:
            cut = window.rfind("\n")
        if cut < chunk_chars // 2:
            cut = chunk_chars
        chunks.append(text[:cut])
        text = text[cut:].lstrip("\n")
    chunks.append(text)
    return chunks


# ---------------------------------------------------------------------------------------------------- man


def check_man_available(config: CorpusConfig) -> None:
    """Fails at once when the man domain cannot be rendered, instead of yielding no page at all."""
    missing = [tool for tool in ("man", "col") if shutil.which(tool) is None]
    if missing:
        raise CorpusError(
            f"The man domain needs the {' and '.join(missing)} command(s), which are not installed. "
            f"Install them (Debian/Ubuntu: `apt-get install man-db bsdextrautils`) and rerun."
        )
    if not _man_files(config):
        raise CorpusError(
            f"The man domain needs man pages, but {config.man_dir}/man1..man8 has none. Install "
            f"them (Debian/Ubuntu: remove the `path-exclude=/usr/share/man/*` line in "
            f"/etc/dpkg/dpkg.cfg.d/ and reinstall packages) or set CorpusConfig.man_dir."
        )


def _man_files(config: CorpusConfig) -> list[Path]:
    """Real pages of sections 1-8 (symlinks are aliases of other pages, so they would duplicate documents)."""
    root = Path(config.man_dir)
    return [
        path
        for section in range(1, 9)
        for path in (root / f"man{section}").glob("*")
        if path.is_file() and not path.is_symlink()
    ]


def man_documents(config: CorpusConfig, rng: random.Random) -> Iterator[Document]:
    """Rendered pages in a seeded order, rendered in small parallel batches, so a consumer that has enough stops
    the rendering."""
    check_man_available(config)
    pages = _shuffled(_man_files(config), rng)
    gcloud = [page for page in pages if page.name.startswith("gcloud")][: config.max_gcloud_man_pages]
    pages = _shuffled([page for page in pages if not page.name.startswith("gcloud")] + gcloud, rng)
    batch_size = 8 * config.man_render_threads
    with ThreadPoolExecutor(config.man_render_threads) as executor:
        for start in range(0, len(pages), batch_size):
            batch = pages[start : start + batch_size]
            for page, text in zip(batch, executor.map(render_man_page, batch)):
                if _keep(text, config):
                    yield Document(f"man:{page.relative_to(config.man_dir)}", text[: config.max_chars_per_file])


def render_man_page(path: Path) -> str | None:
    """Plain text of one page as a terminal shows it at 80 columns; None when ``man`` cannot render it."""
    # seccomp sandboxing of man-db's decompressor fails inside some containers; the input is local and trusted.
    env = {**os.environ, "MANWIDTH": "80", "MAN_DISABLE_SECCOMP": "1", "LC_ALL": "C.UTF-8", "MANPAGER": "cat"}
    try:
        rendered = subprocess.run(["man", "-l", str(path)], env=env, capture_output=True, timeout=60)
        if rendered.returncode != 0:
            return None
        plain = subprocess.run(["col", "-bx"], input=rendered.stdout, env=env, capture_output=True, timeout=60)
        return plain.stdout.decode("utf-8", errors="replace")
    except subprocess.TimeoutExpired:
        return None


# ---------------------------------------------------------------------------------------------------- math


def math_documents(config: CorpusConfig, rng: random.Random) -> Iterator[Document]:
    """An endless stream of generated problems; the consumer decides how many it takes."""
    index = 0
    while True:
        yield Document(f"math:{index:07d}", generate_problem(rng))
        index += 1


# ---------------------------------------------------------------------------------------------------- changelog


def changelog_documents(config: CorpusConfig | None = None) -> list[Document]:
    """Every Debian changelog of the machine (sorted by package; the caller shuffles)."""
    config = config or CorpusConfig()
    documents = []
    for path in sorted(Path(config.changelog_dir).glob("*/changelog.Debian.gz")):
        text = read_text_file(path, config.max_chars_per_changelog)
        if text and len(text.strip()) >= config.min_document_chars:
            documents.append(Document(f"changelog/{path.parent.name}", text))
    if len(documents) < 20:
        raise CorpusError(
            f"Found {len(documents)} Debian changelogs under {config.changelog_dir}; the changelog domain needs at "
            "least 20 (any Debian or Ubuntu system has hundreds)."
        )
    return documents
