"""Held-out prompt files: fixed prompts per domain, cut from held-out documents only, for demos and benchmarks.

A prompt starts at the beginning of a held-out document or after a blank line inside one (a paragraph, a
top-level definition, a man-page section), and runs for ``prompt_tokens`` tokens, continuing into the next
held-out document (after an eos) when the text runs out. Paragraph starts give long held-out documents (whole
stdlib modules) several natural prompts, so every domain gets its full count. The files ship with the package so
every benchmark run uses the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerFast

from .corpus import Document


@dataclass
class PromptConfig:
    """How many held-out prompts are written per domain, and how long they are."""

    prompts_per_domain: int = field(
        default=32, metadata={"help": "Prompts per domain (fewer only if there are fewer paragraph starts)."}
    )
    prompt_tokens: int = field(default=128, metadata={"help": "Length of a prompt in world-tokenizer tokens."})


def paragraph_starts(heldout: list[Document]) -> list[tuple[int, int]]:
    """``(document index, character offset)`` of every document start and every start after a blank line."""
    starts = []
    for index, document in enumerate(heldout):
        starts.append((index, 0))
        offset = document.text.find("\n\n")
        while offset != -1:
            start = offset + 2
            while start < len(document.text) and document.text[start] == "\n":
                start += 1
            if start < len(document.text):
                starts.append((index, start))
            offset = document.text.find("\n\n", start)
    return starts


def build_prompts(
    domain: str, heldout: list[Document], tokenizer: PreTrainedTokenizerFast, config: PromptConfig, rng: random.Random
) -> list[dict]:
    """Rows ``{"domain", "doc_id", "char_offset", "prompt", "prompt_tokens"}`` at distinct, seeded starts."""
    candidates = paragraph_starts(heldout)
    chosen = sorted(rng.sample(candidates, min(config.prompts_per_domain, len(candidates))))
    return [_prompt_row(domain, heldout, start, tokenizer, config.prompt_tokens) for start in chosen]


def _prompt_row(
    domain: str, heldout: list[Document], start: tuple[int, int], tokenizer: PreTrainedTokenizerFast, length: int
) -> dict:
    document_index, char_offset = start
    ids: list[int] = []
    text = heldout[document_index].text[char_offset:]
    while len(ids) < length:
        ids += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        document_index += 1
        text = heldout[document_index % len(heldout)].text
    ids = ids[:length]
    # A byte-level cut can split a multi-byte character; drop the partial character so the text re-encodes cleanly.
    while tokenizer.decode(ids).endswith("\ufffd"):
        ids = ids[:-1]
    prompt = tokenizer.decode(ids)
    return {
        "domain": domain,
        "doc_id": heldout[start[0]].doc_id,
        "char_offset": char_offset,
        "prompt": prompt,
        # Re-encoding the text can merge differently at the cut; count what a user of the file will get.
        "prompt_tokens": len(tokenizer.encode(prompt, add_special_tokens=False)),
    }
