"""The world artifacts shipped in the ``adaflash-demo`` distribution: target, AR draft, drafter, tokenizer,
held-out prompts and the online-adaptation streams.

They live in ``demo/adaflash_demo/world/data`` and are regenerated with ``trainers/build_demo_world.py`` (its
``ship`` stage copies a build there).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from adaflash_hf.utils import read_jsonl

from .tokenizer import load_tokenizer

WORLD_DATA_DIR = Path(__file__).parent / "data"
SHIPPED_ARTIFACTS = ("target", "ar_draft", "drafter", "tokenizer", "prompts", "stream", "report.json")
REGENERATE_COMMAND = (
    "python trainers/build_demo_world.py "
    "--stages corpus,tokenizer,prompts,stream,target,ar_draft,evaluate,drafter,ship"
)


def world_artifact(name: str, data_dir: Path = WORLD_DATA_DIR) -> Path:
    """Path of one shipped artifact, or one clear error saying how to rebuild it."""
    path = Path(data_dir) / name
    if not path.exists():
        raise FileNotFoundError(f"The demo-world artifact {path} is missing. Rebuild it with `{REGENERATE_COMMAND}`.")
    return path


def load_world_tokenizer(data_dir: Path = WORLD_DATA_DIR) -> PreTrainedTokenizerFast:
    return load_tokenizer(world_artifact("tokenizer", data_dir))


def load_world_model(
    name: str, dtype: torch.dtype = torch.float32, data_dir: Path = WORLD_DATA_DIR
) -> PreTrainedModel:
    """The ``"target"`` or ``"ar_draft"`` model in eval mode.

    fp32 is the default because bf16 1-token and multi-token forwards are not bit-identical, which breaks
    lossless (token-identical) comparisons; pass ``torch.bfloat16`` for speed measurements.
    """
    if name not in ("target", "ar_draft"):
        raise ValueError(f"Unknown world model {name!r}; expected 'target' or 'ar_draft'.")
    return AutoModelForCausalLM.from_pretrained(str(world_artifact(name, data_dir)), dtype=dtype).eval()


def load_prompts(domain: str | None = None, data_dir: Path = WORLD_DATA_DIR) -> list[dict]:
    """Held-out prompt rows (``domain``, ``doc_id``, ``char_offset``, ``prompt``, ``prompt_tokens``).

    ``domain=None`` returns every shipped domain.
    """
    prompts_dir = world_artifact("prompts", data_dir)
    paths = [prompts_dir / f"{domain}.jsonl"] if domain else sorted(prompts_dir.glob("*.jsonl"))
    missing = [path for path in paths if not path.exists()]
    if missing:
        raise FileNotFoundError(
            f"No prompt file {missing[0]}; the shipped domains are "
            f"{sorted(p.stem for p in prompts_dir.glob('*.jsonl'))}."
        )
    return [row for path in paths for row in read_jsonl(path)]


def prompts_by_domain(data_dir: Path = WORLD_DATA_DIR) -> dict[str, list[str]]:
    """The held-out prompt texts grouped by domain, in the shipped order: what the demo and benchmarks serve."""
    grouped: dict[str, list[str]] = {}
    for row in load_prompts(data_dir=data_dir):
        grouped.setdefault(row["domain"], []).append(row["prompt"])
    return grouped


def load_stream(domain: str, heldout: bool = False, data_dir: Path = WORLD_DATA_DIR) -> list[dict]:
    """Stream prompt rows of ``domain`` (a world domain or ``changelog``, the unseen one); ``heldout=True``: the
    unseen domain's held-out prompts."""
    stream_dir = world_artifact("stream", data_dir)
    path = stream_dir / (f"{domain}.heldout.jsonl" if heldout else f"{domain}.jsonl")
    if not path.exists():
        raise FileNotFoundError(
            f"No stream file {path}; the shipped streams are {sorted(p.name for p in stream_dir.glob('*.jsonl'))}."
        )
    return read_jsonl(path)
