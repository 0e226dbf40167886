"""Where the real target's prompts come from: documents read from the machine's own files (standard-library code,
manuals, man pages, Debian changelogs) and generated arithmetic problems. `adaflash_demo.instructions` turns them
into instruction prompts; nothing is downloaded."""

from .arithmetic import generate_problem
from .documents import (
    CorpusConfig,
    CorpusError,
    Document,
    changelog_documents,
    code_documents,
    is_heldout,
    man_documents,
    math_documents,
    prose_documents,
)

__all__ = [
    "CorpusConfig",
    "CorpusError",
    "Document",
    "changelog_documents",
    "code_documents",
    "generate_problem",
    "is_heldout",
    "man_documents",
    "math_documents",
    "prose_documents",
]
