"""`adaflash demo`: plain `generate()` against AdaFlash on the real target, prompt by prompt, side by side.

The default run serves the shipped held-out prompts of the five domains to SmolLM2-135M-Instruct with the shipped
drafter. ``--prompts FILE.jsonl`` serves the user's own prompts instead: one JSON object per line with ``prompt``
(plain text, put through the target's chat template) and optionally ``domain`` (default ``"custom"``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from .instructions import DOMAINS

DATA_DIR = Path(__file__).parent / "data"
DRAFTER_DIR = DATA_DIR / "smollm2-drafter"


class PromptFileError(ValueError):
    """A prompt file line that the demo cannot serve; the message names the line and the fix."""


# The recipe measures on the first 16 held-out prompts of each domain and lets the other 16 decide when training
# stops (adaflash_demo.recipe.validation_prompts); the demo and the benchmark serve only the first 16.
EVALUATION_PROMPTS = 16

# What `adaflash demo` shows against plain generate(): the planner, which never verifies what cannot pay.
DEMO_METHOD = "adaflash_planned"


def shipped_prompts(per_domain: int, data_dir: Path = DRAFTER_DIR) -> dict[str, list[str]]:
    """The first ``min(per_domain, EVALUATION_PROMPTS)`` held-out prompts of each domain, as shipped with the
    drafter."""
    prompts = {}
    for domain in DOMAINS:
        path = Path(data_dir) / "prompts" / f"{domain}.heldout.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: reinstall the demo package (`pip install ./demo`).")
        prompts[domain] = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
        prompts[domain] = prompts[domain][: min(per_domain, EVALUATION_PROMPTS)]
    return prompts


def stream_prompts(domain: str, data_dir: Path = DRAFTER_DIR) -> list[dict]:
    """The online-adaptation stream of the real target: ``{"prompt", "domain"}`` rows of the shipped changelog stream
    (256 prompts of the unseen domain, disjoint from its held-out ones) for ``changelog``, the held-out prompts for a
    trained domain, and all of them interleaved for ``all``."""
    if domain == "all":
        streams = [stream_prompts(name, data_dir) for name in DOMAINS]
        return [row for group in itertools.zip_longest(*streams) for row in group if row is not None]
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: the real target's domains are {', '.join(DOMAINS)}, or all")
    prompts = Path(data_dir) / "prompts"
    path = prompts / f"{domain}.stream.jsonl"
    path = path if path.exists() else prompts / f"{domain}.heldout.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall the demo package (`pip install ./demo`).")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"prompt": row["prompt"], "domain": domain} for row in rows]


def read_prompt_file(path: str | Path) -> dict[str, list[str]]:
    """``{domain: [prompt, ...]}`` from a JSONL file of ``{"prompt": ..., "domain": ...}`` objects."""
    prompts: dict[str, list[str]] = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(
                f"{path}:{number} is not JSON ({error.msg}); write one JSON object per line."
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise PromptFileError(
                f'{path}:{number} has no `prompt` text; each line must be like {{"prompt": "...", "domain": "code"}}.'
            )
        prompts.setdefault(str(row.get("domain", "custom")), []).append(row["prompt"])
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts; write one JSON object with a `prompt` per line.")
    return prompts


def chat_texts(tokenizer, prompts: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each prompt as the user turn of the target's chat template, ready for the assistant's answer; as it is when
    the tokenizer has no template (a base model continues the text)."""
    if tokenizer.chat_template is None:
        return prompts
    return {
        domain: [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in texts
        ]
        for domain, texts in prompts.items()
    }


@dataclass
class DemoRecord:
    """One domain of the demo, as ``--json`` writes it."""

    domain: str
    identical: int
    n: int
    mean_acceptance_length: float
    plain_tokens_per_s: float
    adaflash_tokens_per_s: float
    speedup: float


def demo_records(bench_records, counts: dict[str, int], method: str = DEMO_METHOD) -> list[DemoRecord]:
    """Pairs each domain's plain and AdaFlash (``method``) bench records into one demo record; ``counts`` holds the
    prompts served per domain (at batch 1, one bench row per prompt)."""
    by_key = {(r.domain, r.method): r for r in bench_records}
    records = []
    for domain, n in counts.items():
        plain, fast = by_key[(domain, "plain")], by_key[(domain, method)]
        records.append(
            DemoRecord(
                domain=domain,
                identical=round(fast.identical_fraction * n),
                n=n,
                mean_acceptance_length=round(fast.mean_acceptance_length, 3),
                plain_tokens_per_s=round(plain.tokens_per_s, 2),
                adaflash_tokens_per_s=round(fast.tokens_per_s, 2),
                speedup=round(fast.speedup, 3),
            )
        )
    return records


def markdown(records: list[DemoRecord]) -> str:
    lines = [
        "| domain | identical | acceptance length | plain tok/s | AdaFlash tok/s | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r.domain} | {r.identical}/{r.n} | {r.mean_acceptance_length:.2f} | {r.plain_tokens_per_s:.1f} | "
            f"{r.adaflash_tokens_per_s:.1f} | {r.speedup:.2f}x |"
        )
    return "\n".join(lines)
