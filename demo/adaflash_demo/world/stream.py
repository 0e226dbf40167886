"""Served-traffic streams for online adaptation: prompts per world domain, plus an unseen domain.

The world domains' streams are cut from *training*-split documents (traffic resembling what the drafter learnt).
The ``changelog`` domain is the Debian package changelogs (``/usr/share/doc/*/changelog.Debian.gz``), which the
corpus excludes, so neither the target nor the drafter ever trained on it: the domain on which online adaptation
has something to learn. Its held-out split (by the same document-id hash as the corpus) gives its own held-out
prompt file.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from adaflash_hf.utils import atomic_directory, write_jsonl

from .corpus import DOMAINS, CorpusError, Document, is_heldout, load_documents, read_text_file
from .prompts import PromptConfig, build_prompts

UNSEEN_DOMAIN = "changelog"


@dataclass
class StreamConfig:
    """Sizes of the stream files."""

    prompts_per_domain: int = field(default=256, metadata={"help": "Stream prompts per domain."})
    heldout_prompts: int = field(default=32, metadata={"help": "Held-out prompts of the unseen domain."})
    prompt_tokens: int = field(default=128, metadata={"help": "Tokens per prompt (as the held-out prompt files)."})
    changelog_dir: str = field(default="/usr/share/doc", metadata={"help": "Where */changelog.Debian.gz live."})
    max_chars_per_changelog: int = field(default=20_000, metadata={"help": "Characters read per changelog."})
    heldout_percent: float = field(default=10.0, metadata={"help": "Changelogs held out (by package-name hash)."})


def changelog_documents(config: StreamConfig) -> list[Document]:
    documents = []
    for path in sorted(Path(config.changelog_dir).glob("*/changelog.Debian.gz")):
        text = read_text_file(path, config.max_chars_per_changelog)
        if text and len(text.strip()) >= 200:
            documents.append(Document(f"changelog/{path.parent.name}", text))
    if len(documents) < 20:
        raise CorpusError(
            f"Found {len(documents)} Debian changelogs under {config.changelog_dir}; the unseen stream domain needs "
            "at least 20 (any Debian or Ubuntu system has hundreds)."
        )
    return documents


def build_streams(
    config: StreamConfig, corpus_dir: Path, tokenizer: PreTrainedTokenizerFast, seed: int, out_dir: Path
) -> dict:
    """Writes ``<domain>.jsonl`` per world domain and for ``changelog``, plus ``changelog.heldout.jsonl``."""
    prompt_config = PromptConfig(prompts_per_domain=config.prompts_per_domain, prompt_tokens=config.prompt_tokens)
    changelogs = changelog_documents(config)
    sources = {domain: load_documents(corpus_dir, domain, "train") for domain in DOMAINS}
    sources[UNSEEN_DOMAIN] = [d for d in changelogs if not is_heldout(d.doc_id, config.heldout_percent)]
    heldout = [d for d in changelogs if is_heldout(d.doc_id, config.heldout_percent)]
    counts = {}
    with atomic_directory(out_dir) as staging:
        for domain, documents in sources.items():
            rows = build_prompts(domain, documents, tokenizer, prompt_config, random.Random(f"{seed}-stream-{domain}"))
            write_jsonl(staging / f"{domain}.jsonl", rows)
            counts[domain] = len(rows)
        heldout_config = PromptConfig(prompts_per_domain=config.heldout_prompts, prompt_tokens=config.prompt_tokens)
        rows = build_prompts(
            UNSEEN_DOMAIN, heldout, tokenizer, heldout_config, random.Random(f"{seed}-stream-heldout")
        )
        write_jsonl(staging / f"{UNSEEN_DOMAIN}.heldout.jsonl", rows)
        counts[f"{UNSEEN_DOMAIN}.heldout"] = len(rows)
    return {"prompts": counts, "changelogs": {"train": len(sources[UNSEEN_DOMAIN]), "heldout": len(heldout)}}
