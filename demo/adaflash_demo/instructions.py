"""Instruction prompts for the real target, in five domains, from files already on the machine.

* ``code``: explain, document or complete a function of the CPython standard library.
* ``docs``: summarise or explain a passage of the GNU info manuals, the Python language reference or a package's
  documentation under ``/usr/share/doc``.
* ``shell``: questions about a command, with or without an excerpt of its man page.
* ``math``: generated multi-step word problems, solved step by step.
* ``changelog``: summarise a Debian changelog entry. The unseen domain: never used to train a drafter, only to
  evaluate one and to adapt it online.

Each prompt is plain text (the user turn); the chat template turns it into the target's input. The split is by
source document (``md5(doc_id)``, the same rule as the corpus), never by prompt, so no held-out prompt shares a
function, manual chunk, man page or changelog with a training prompt. Every row records its ``doc_id`` and
``split``.
"""

from __future__ import annotations

import ast
import gzip
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from .sources import (
    CorpusConfig,
    Document,
    changelog_documents,
    code_documents,
    is_heldout,
    man_documents,
    math_documents,
    prose_documents,
)

TRAINED_DOMAINS = ("code", "docs", "shell", "math")
UNSEEN_DOMAIN = "changelog"
DOMAINS = TRAINED_DOMAINS + (UNSEEN_DOMAIN,)

CODE_TASKS = (
    "Explain what the following Python function from the `{module}` module does, step by step."
    "\n\n```python\n{code}\n```",
    "Write a docstring for the following Python function from the `{module}` module, then explain how it works."
    "\n\n```python\n{code}\n```",
    "Point out edge cases or possible bugs in this Python function from the `{module}` module, and suggest a test."
    "\n\n```python\n{code}\n```",
    "Complete the body of this Python function.\n\n```python\n{signature}\n```",
)
DOCS_TASKS = (
    "Summarize the following passage from the {source} documentation in a few sentences.\n\n{text}",
    "Explain the following passage from the {source} documentation to a beginner.\n\n{text}",
)
SHELL_TASKS = (
    "What does the `{command}` command do? Explain it with an example, using this excerpt of its man page.\n\n{text}",
    "Explain how to use the `{command}` command and its most common options, with examples.",
    "Here is the beginning of the man page of `{command}`. Summarize it and show one typical invocation.\n\n{text}",
)
MATH_TASKS = ("Solve this problem step by step, then give the final answer.\n\n{text}",)
CHANGELOG_TASKS = ("Summarize the changes in this Debian changelog entry of the `{package}` package.\n\n{text}",)


@dataclass
class InstructionConfig:
    """How many prompts of each split, and how long their source excerpts are."""

    train_per_domain: int = field(default=700, metadata={"help": "Training prompts per trained domain."})
    heldout_per_domain: int = field(default=32, metadata={"help": "Held-out prompts per domain (all five)."})
    stream_per_domain: int = field(
        default=256, metadata={"help": "Served-traffic prompts of the unseen changelog domain (online adaptation)."}
    )
    heldout_percent: float = field(default=10.0, metadata={"help": "Percent of documents held out, by md5(doc_id)."})
    max_excerpt_chars: int = field(default=1200, metadata={"help": "Longest source excerpt put into a prompt."})
    max_function_lines: int = field(default=40, metadata={"help": "Longest standard-library function used."})
    min_function_lines: int = field(default=4, metadata={"help": "Shortest standard-library function used."})


def _excerpt(text: str, max_chars: int) -> str:
    """The start of ``text`` up to ``max_chars``, cut at a paragraph or line break."""
    text = re.sub(r"\n{3,}", "\n\n", text.strip())
    if len(text) <= max_chars:
        return text
    window = text[:max_chars]
    cut = max(window.rfind("\n\n"), window.rfind("\n"))
    return window[: cut if cut > max_chars // 2 else max_chars].rstrip()


def functions_of(document: Document, config: InstructionConfig) -> list[tuple[str, str, str]]:
    """``(qualified name, source, signature line with docstring)`` of the module's top-level functions and
    methods whose length is within the configured bounds."""
    try:
        tree = ast.parse(document.text)
    except (SyntaxError, ValueError):
        return []
    lines = document.text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        length = node.end_lineno - node.lineno + 1
        if not config.min_function_lines <= length <= config.max_function_lines:
            continue
        source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        indent = len(source) - len(source.lstrip())
        source = "\n".join(line[indent:] for line in source.splitlines())
        body_start = node.body[0].lineno - node.lineno
        if ast.get_docstring(node) is not None:
            body_start = node.body[0].end_lineno - node.lineno + 1
        signature = "\n".join(source.splitlines()[:body_start])
        found.append((node.name, source, signature + "\n    ..."))
    return found


def _code_prompts(document: Document, config: InstructionConfig, rng: random.Random) -> list[dict]:
    module = document.doc_id.removeprefix("code:").removesuffix(".py").replace("/", ".")
    rows = []
    for name, source, signature in functions_of(document, config):
        task = rng.choice(CODE_TASKS)
        rows.append({"prompt": task.format(module=module, code=source, signature=signature), "source": name})
    return rows


def _docs_prompts(document: Document, config: InstructionConfig, rng: random.Random) -> list[dict]:
    kind, _, path = document.doc_id.removeprefix("prose:").partition("/")
    source = "Python language reference" if kind == "pydoc" else Path(document.doc_id.split("#")[0]).name
    source = re.sub(r"(\.info)?(-\d+)?(\.gz)?$", "", source)
    text = _excerpt(document.text, config.max_excerpt_chars)
    return [{"prompt": rng.choice(DOCS_TASKS).format(source=source, text=text)}]


SHELL_SECTIONS = ("man1/", "man8/")


def _shell_prompts(document: Document, config: InstructionConfig, rng: random.Random) -> list[dict]:
    # Sections 1 and 8 are commands; the others are C functions, file formats and overviews. The templated gcloud
    # pages would crowd out everything else.
    page = document.doc_id.removeprefix("man:")
    command = Path(page).name.split(".")[0]
    if not page.startswith(SHELL_SECTIONS) or command.startswith("gcloud"):
        return []
    text = _excerpt(document.text, config.max_excerpt_chars)
    return [{"prompt": rng.choice(SHELL_TASKS).format(command=command, text=text)}]


def _math_prompts(document: Document, config: InstructionConfig, rng: random.Random) -> list[dict]:
    # The generator writes the worked answer after the question; the prompt keeps the question only.
    question = document.text.split("\nAnswer:")[0].removeprefix("Question:").strip()
    return [{"prompt": MATH_TASKS[0].format(text=question)}]


def changelog_entry(text: str) -> str:
    """The newest entry of a Debian changelog: its header line up to the maintainer's sign-off line."""
    match = re.search(r"^ -- .*$", text, flags=re.MULTILINE)
    return text[: match.end()] if match else text


def _changelog_prompts(document: Document, config: InstructionConfig, rng: random.Random) -> list[dict]:
    package = document.doc_id.removeprefix("changelog/")
    text = _excerpt(changelog_entry(document.text), config.max_excerpt_chars)
    return [{"prompt": CHANGELOG_TASKS[0].format(package=package, text=text)}]


PROMPT_BUILDERS = {
    "code": _code_prompts,
    "docs": _docs_prompts,
    "shell": _shell_prompts,
    "math": _math_prompts,
    "changelog": _changelog_prompts,
}


def source_documents(domain: str, seed: int, corpus: CorpusConfig | None = None):
    """The domain's documents in a seeded order (an iterator: man pages render lazily, math never ends)."""
    corpus = corpus or CorpusConfig()
    rng = random.Random(f"{seed}-{domain}-documents")
    if domain == "code":
        return code_documents(corpus, rng)
    if domain == "docs":
        return prose_documents(corpus, rng)
    if domain == "shell":
        return man_documents(corpus, rng)
    if domain == "math":
        return math_documents(corpus, rng)
    if domain == "changelog":
        documents = changelog_documents(corpus)
        rng.shuffle(documents)
        return iter(documents)
    raise ValueError(f"Unknown domain {domain!r}; the domains are {', '.join(DOMAINS)}.")


def build_domain(domain: str, config: InstructionConfig, seed: int, corpus: CorpusConfig | None = None) -> dict:
    """``{split: rows}`` for one domain. At most one prompt per document in each split, except code, where a module
    gives up to three functions; prompts of a held-out document never reach the training split."""
    wanted = {"heldout": config.heldout_per_domain}
    if domain == UNSEEN_DOMAIN:
        wanted["stream"] = config.stream_per_domain
    else:
        wanted["train"] = config.train_per_domain
    rows = {split: [] for split in wanted}
    rng = random.Random(f"{seed}-{domain}-prompts")
    per_document = 3 if domain == "code" else 1
    for document in source_documents(domain, seed, corpus):
        split = (
            "heldout" if is_heldout(document.doc_id, config.heldout_percent) else next(iter(set(wanted) - {"heldout"}))
        )
        if len(rows[split]) >= wanted[split]:
            if all(len(rows[s]) >= wanted[s] for s in wanted):
                break
            continue
        built = PROMPT_BUILDERS[domain](document, config, rng)
        rng.shuffle(built)
        for row in built[:per_document]:
            rows[split].append({"prompt": row["prompt"], "domain": domain, "doc_id": document.doc_id, "split": split})
    for split, count in wanted.items():
        rows[split] = rows[split][:count]
    return rows


def read_changelog(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as handle:
        return handle.read()
