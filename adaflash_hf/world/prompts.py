"""Held-out prompt files: fixed prompts per domain, cut from held-out documents only, for demos and benchmarks.

A prompt starts at the beginning of a held-out document and runs for ``prompt_tokens`` tokens, continuing into
the next held-out document (after an eos) when the first is shorter, so every domain gets prompts of the same
length. The files ship with the package so every benchmark run uses the same prompts.
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
        default=32, metadata={"help": "Prompts per domain (fewer if fewer held-out documents)."}
    )
    prompt_tokens: int = field(default=128, metadata={"help": "Length of a prompt in world-tokenizer tokens."})


def build_prompts(
    domain: str, heldout: list[Document], tokenizer: PreTrainedTokenizerFast, config: PromptConfig, rng: random.Random
) -> list[dict]:
    """Rows ``{"domain", "doc_id", "prompt", "prompt_tokens"}`` starting at distinct, seeded held-out documents."""
    starts = sorted(rng.sample(range(len(heldout)), min(config.prompts_per_domain, len(heldout))))
    return [_prompt_row(domain, heldout, start, tokenizer, config.prompt_tokens) for start in starts]


def _prompt_row(
    domain: str, heldout: list[Document], start: int, tokenizer: PreTrainedTokenizerFast, length: int
) -> dict:
    ids: list[int] = []
    index = start
    while len(ids) < length:
        ids += tokenizer.encode(heldout[index % len(heldout)].text, add_special_tokens=False) + [
            tokenizer.eos_token_id
        ]
        index += 1
    ids = ids[:length]
    # A byte-level cut can split a multi-byte character; drop the partial character so the text re-encodes cleanly.
    while tokenizer.decode(ids).endswith("\ufffd"):
        ids = ids[:-1]
    return {
        "domain": domain,
        "doc_id": heldout[start].doc_id,
        "prompt": tokenizer.decode(ids),
        "prompt_tokens": len(ids),
    }
