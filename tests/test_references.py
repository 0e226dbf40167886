"""Every reference in the repository's code and documents resolves inside the repository: the sections of
docs/algorithm.md that code cites as `docs/algorithm.md §N`, and the repository paths that code and documents name."""

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALGORITHM = REPO / "docs" / "algorithm.md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg"}
# Top-level folders of the repository, and the retired `model_cards/`, `trainers/` (now examples/scripts/) and `bench/`
# (now in demo/adaflash_demo/bench/), so a stale mention of one fails.
ROOTS = ("adaflash_hf", "demo", "docs", "trainers", "tests", "examples", "bench", ".ci", "model_cards")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(map(re.escape, ROOTS)) + r")/[\w./*-]*[\w*/])")
SECTIONS = re.compile(r"docs/algorithm\.md ((?:§[\d.]+(?:-[\d.]+)?(?:, )?)+)")


def _text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    names = [REPO / n for n in listed if Path(n).suffix in TEXT_SUFFIXES or n in ("Makefile", ".ci/run")]
    # this file spells the patterns it looks for
    return [path for path in names if path.is_file() and path != Path(__file__).resolve()]


def _headings() -> set[str]:
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?) ", ALGORITHM.read_text(), flags=re.MULTILINE))


def _cited_sections(text: str) -> list[str]:
    cited = []
    for group in SECTIONS.findall(text):
        for item in re.findall(r"§([\d.]+(?:-[\d.]+)?)", group):
            cited += item.rstrip(".").split("-")
    return cited


def test_cited_algorithm_sections_exist():
    headings = _headings()
    assert {"1", "4.9", "6.5", "8.2"} <= headings  # the heading pattern itself works
    missing = {
        f"{path.relative_to(REPO)}: §{section}"
        for path in _text_files()
        for section in _cited_sections(path.read_text(errors="replace"))
        if section not in headings
    }
    assert not missing, sorted(missing)


def test_within_document_section_references_exist():
    headings = _headings()
    text = ALGORITHM.read_text()
    missing = {s for s in re.findall(r"§([\d.]+\d)", text) if s not in headings}
    assert not missing, sorted(missing)


def test_no_reference_to_the_unpublished_spec():
    offenders = [str(p.relative_to(REPO)) for p in _text_files() if "spec §" in p.read_text(errors="replace")]
    assert not offenders


def test_named_modules_exist():
    """`python -m adaflash_...` commands and dotted `adaflash_hf.x` / `adaflash_demo.x` module names in the docs."""
    missing = set()
    for path in _text_files():
        for name in re.findall(
            r"python -m ((?:adaflash_hf|adaflash_demo)(?:\.\w+)+)", path.read_text(errors="replace")
        ):
            if importlib.util.find_spec(name) is None:
                missing.add(f"{path.relative_to(REPO)}: {name}")
    assert not missing, sorted(missing)


@pytest.mark.parametrize("root", ROOTS)
def test_named_repository_paths_exist(root):
    missing = set()
    for path in _text_files():
        text = path.read_text(errors="replace")
        for match in PATH.finditer(text):
            name = match.group(1).rstrip(".")
            if not name.startswith(root + "/") or text[match.end() :].lstrip(".")[:1] in ("{", "$", "<"):
                continue  # another folder's test, or a pattern such as `online_{changelog,domains}.json`
            found = any(REPO.glob(name)) if "*" in name else (REPO / name).exists()
            if not found:
                missing.add(f"{path.relative_to(REPO)}: {name}")
    assert not missing, sorted(missing)
