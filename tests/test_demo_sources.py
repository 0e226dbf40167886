"""The documents the real target's prompts come from (`adaflash_demo.sources`): one clear error when this machine
lacks a source, held-out choice fixed by the document id, arithmetic that adds up; and the atomic writers the
recipe's resumable stages rely on (`adaflash_hf.utils`)."""

import gzip
import random
import re

import pytest

from adaflash_demo.sources import CorpusConfig, CorpusError, changelog_documents, generate_problem, is_heldout
from adaflash_demo.sources.documents import chunk_text, man_documents
from adaflash_hf.utils import TEMPORARY_PREFIX, read_jsonl, write_json_atomic, write_jsonl


def test_missing_man_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(
        "adaflash_demo.sources.documents.shutil.which", lambda tool: None if tool == "man" else "/usr/bin/col"
    )
    with pytest.raises(CorpusError, match=r"needs the man command.*apt-get install man-db"):
        next(man_documents(CorpusConfig(), random.Random(0)))


def test_too_few_changelogs_is_one_clear_error(tmp_path):
    with pytest.raises(CorpusError, match=r"Found 0 Debian changelogs under .*needs at least 20"):
        changelog_documents(CorpusConfig(changelog_dir=str(tmp_path)))


def test_heldout_choice_depends_on_the_document_id_only():
    ids = [f"code:module{i}.py" for i in range(2000)]
    held = [doc_id for doc_id in ids if is_heldout(doc_id, 10.0)]
    assert 150 < len(held) < 250 and held == [doc_id for doc_id in ids if is_heldout(doc_id, 10.0)]
    assert set(held) <= {doc_id for doc_id in ids if is_heldout(doc_id, 20.0)}  # a larger share keeps these


def test_chunks_cut_at_paragraphs_and_lose_no_text():
    text = "\n\n".join(f"paragraph {i} " + "word " * 30 for i in range(20))
    chunks = chunk_text(text, 400)
    assert all(len(c) <= 400 for c in chunks) and all(c.startswith("paragraph") for c in chunks)
    assert "".join(chunks).replace("\n", "") == text.replace("\n", "")


def test_arithmetic_solutions_compute_their_answers():
    rng = random.Random(0)
    for _ in range(200):
        problem = generate_problem(rng)
        steps = re.findall(r"<<([^=]+)=(-?\d+)>>", problem)
        assert steps, problem
        for expression, result in steps:
            assert eval(expression.replace("x", "*")) == int(result), problem  # noqa: S307 (generated digits)
        assert problem.startswith("Question: ") and re.search(r"\n#### -?\d+$", problem)


def test_atomic_writes_leave_the_old_file_when_they_fail(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"a": 1}])

    def rows():
        yield {"a": 2}
        raise RuntimeError("the writer crashed")

    with pytest.raises(RuntimeError):
        write_jsonl(path, rows())
    assert read_jsonl(path) == [{"a": 1}]  # the old file, whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMPORARY_PREFIX)]  # no staging left behind
    write_json_atomic(tmp_path / "report.json", {"b": [1, 2]}, indent=1)
    assert (tmp_path / "report.json").read_text() == '{\n "b": [\n  1,\n  2\n ]\n}\n'
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write('{"a": 3}\n\n{"a": 4}\n')
    assert read_jsonl(tmp_path / "rows.jsonl.gz") == [{"a": 3}, {"a": 4}]  # a gzipped file reads the same way
