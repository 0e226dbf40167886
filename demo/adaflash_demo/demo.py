"""The data and the report of `adaflash-demo demo`: the shipped prompts and streams, the user's prompt files, and
the per-domain records that compare plain `generate()` with AdaFlash.

The default run serves the shipped held-out prompts of every domain (real chat requests and the five instruction
domains) to SmolLM2-135M-Instruct with the shipped drafter. ``--prompts FILE.jsonl`` serves the user's own prompts
instead: one JSON object per line with ``prompt`` (plain text, put through the target's chat template) and
optionally ``domain`` (default ``"custom"``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from adaflash_hf.cli import read_stream
from adaflash_hf.utils import read_jsonl

from .instructions import DOMAINS

DATA_DIR = Path(__file__).parent / "data"
DRAFTER_DIR = DATA_DIR / "smollm2-drafter"
# The drafters this distribution ships, by the name `--drafter` takes: the default (block 16, distilled from the four
# instruction domains) and the one distilled from ShareGPT chat requests too (block 8; BENCHMARKS.md section 23: it
# accepts more on chat requests and less on math, so the default stays).
SHIPPED_DRAFTERS = ("smollm2-drafter", "smollm2-chat-drafter")


def drafter_path(name_or_path: str | None) -> Path:
    """The folder of a drafter for the real target: a shipped one by its name (`SHIPPED_DRAFTERS`; ``None``: the
    default), else the path given."""
    if name_or_path is None:
        return DRAFTER_DIR / "drafter"
    if name_or_path in SHIPPED_DRAFTERS:
        return DATA_DIR / name_or_path / "drafter"
    return Path(name_or_path)


# The recipe measures on the first 16 held-out prompts of each domain and lets the other 16 decide when training
# stops (adaflash_demo.recipe.validation_prompts); the demo and the benchmark serve only the first 16.
EVALUATION_PROMPTS = 16

# What `adaflash-demo demo` shows against plain generate(): the planner, which never verifies what cannot pay, with the
# context's n-gram continuations merged into the drafter's trees (adaflash_ngram): answers that quote their prompt
# are copied, the rest drafted (BENCHMARKS.md section 15: ahead of the planner alone on every domain).
DEMO_METHOD = "adaflash_hybrid"


def _shipped_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall the demo distribution (`pip install ./demo`).")
    return read_jsonl(path)


# Real user requests: held-out ShareGPT conversations (md5 of the conversation id, never trained on; the split and
# the filters in prompts/chat.json), shipped beside the instruction domains.
CHAT_DOMAIN = "chat"


def shipped_domains(data_dir: Path = DRAFTER_DIR) -> tuple[str, ...]:
    """The domains of the shipped held-out prompts: the chat requests where they ship, then the instruction
    domains (the unseen changelog last)."""
    chat = (CHAT_DOMAIN,) if (Path(data_dir) / "prompts" / f"{CHAT_DOMAIN}.heldout.jsonl").exists() else ()
    return chat + DOMAINS


def shipped_prompts(per_domain: int = EVALUATION_PROMPTS, data_dir: Path = DRAFTER_DIR) -> dict[str, list[str]]:
    """The first ``min(per_domain, EVALUATION_PROMPTS)`` held-out prompts of each shipped domain
    (`shipped_domains`), as shipped with the drafter."""
    return {
        domain: [row["prompt"] for row in _shipped_rows(Path(data_dir) / "prompts" / f"{domain}.heldout.jsonl")][
            : min(per_domain, EVALUATION_PROMPTS)
        ]
        for domain in shipped_domains(data_dir)
    }


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
    rows = _shipped_rows(path if path.exists() else prompts / f"{domain}.heldout.jsonl")
    return [{"prompt": row["prompt"], "domain": domain} for row in rows]


def read_prompt_file(path: str | Path) -> dict[str, list[str]]:
    """``{domain: [prompt, ...]}``: every prompt of the user's JSONL file, in its order, grouped by its ``domain``
    (``"custom"`` when a row has none). A bad row raises `adaflash_hf.cli.CommandError`, naming the row."""
    prompts: dict[str, list[str]] = {}
    for row in read_stream(path):
        prompts.setdefault(str(row.get("domain") or "custom"), []).append(row["prompt"])
    return prompts


@dataclass
class DemoRecord:
    """One domain of the demo, as ``--json`` writes it: ``n`` outputs (prompts times repeats), ``identical`` of them
    the same as plain ``generate()``'s, and the speedup with its 95% interval (``speedup_low``, ``speedup_high``:
    a paired bootstrap over the domain's calls, `harness.speedup_interval`; NaN with one call). Runs of identical work
    differ by a few percent on a shared CPU, and a cell of four calls resolves about 5%: the interval says how far
    its point can be trusted."""

    domain: str
    identical: int
    n: int
    mean_acceptance_length: float
    plain_tokens_per_s: float
    adaflash_tokens_per_s: float
    speedup: float
    speedup_low: float
    speedup_high: float


def demo_records(bench_records, counts: dict[str, int], method: str = DEMO_METHOD) -> list[DemoRecord]:
    """Pairs each domain's plain and AdaFlash (``method``) bench records into one demo record; ``counts`` holds the
    outputs per domain (at batch 1, one bench row per prompt and repeat)."""
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
                speedup_low=round(fast.speedup_low, 3),
                speedup_high=round(fast.speedup_high, 3),
            )
        )
    return records


def markdown(records: list[DemoRecord]) -> str:
    lines = [
        "| domain | identical | acceptance length | plain tok/s | AdaFlash tok/s | speedup | 95% interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        interval = "-" if math.isnan(r.speedup_low) else f"[{r.speedup_low:.2f}, {r.speedup_high:.2f}]"
        lines.append(
            f"| {r.domain} | {r.identical}/{r.n} | {r.mean_acceptance_length:.2f} | {r.plain_tokens_per_s:.1f} | "
            f"{r.adaflash_tokens_per_s:.1f} | {r.speedup:.2f}x | {interval} |"
        )
    return "\n".join(lines)
