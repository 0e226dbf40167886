"""Held-out evaluation of the saved world models: teacher-forced loss, perplexity, top-1 and target agreement.

Evaluation is its own stage and reads the models back from disk, so the report describes exactly the shipped
bf16 checkpoints, and a better metric can be recomputed without retraining.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .causal_lm import load_saved_causal_lm
from .packing import load_streams


@dataclass
class EvaluationConfig:
    """Which held-out tokens are scored."""

    seq_len: int = field(default=256, metadata={"help": "Tokens per scored window."})
    windows_per_domain: int = field(
        default=64,
        metadata={
            "help": "Windows per domain, spread evenly over the held-out stream so every held-out document "
            "region counts, not just the first documents."
        },
    )
    batch_size: int = field(default=8, metadata={"help": "Windows per forward pass."})
    bf16_autocast: bool = field(default=True, metadata={"help": "Score under bf16 autocast, as the models trained."})


def heldout_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Up to ``max_windows`` windows of ``seq_len + 1`` tokens at evenly spaced offsets of the stream.

    Offsets are at least ``seq_len`` apart before rounding, so neighbouring windows share at most a token or two.
    """
    count = min(max_windows, (stream.size - 1) // seq_len)
    if count < 1:
        raise ValueError(f"A held-out stream of {stream.size} tokens is too short for one window of {seq_len + 1}.")
    last_start = stream.size - seq_len - 1
    starts = [round(index * last_start / max(1, count - 1)) for index in range(count)]
    return torch.stack(
        [torch.from_numpy(np.asarray(stream[start : start + seq_len + 1], dtype=np.int64)) for start in starts]
    )


@torch.no_grad()
def evaluate_heldout(
    model: torch.nn.Module,
    windows: dict[str, torch.Tensor],
    config: EvaluationConfig,
    reference: torch.nn.Module | None = None,
) -> dict[str, dict[str, float]]:
    """Per-domain loss, perplexity and greedy top-1 accuracy on fixed held-out windows.

    With a ``reference`` (the target, when scoring a draft model) it also reports ``target_agreement``: how often
    the model's greedy next token equals the reference's, the per-token acceptance rate of greedy assisted
    generation.
    """
    metrics = {}
    for domain, domain_windows in windows.items():
        totals = {"loss": 0.0, "top1": 0.0, "target_agreement": 0.0}
        for batch in domain_windows.split(config.batch_size):
            inputs, labels = batch[:, :-1], batch[:, 1:]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16_autocast):
                logits = model(input_ids=inputs).logits.float()
                reference_logits = None if reference is None else reference(input_ids=inputs).logits.float()
            totals["loss"] += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            totals["top1"] += (logits.argmax(-1) == labels).sum().item()
            if reference_logits is not None:
                totals["target_agreement"] += (logits.argmax(-1) == reference_logits.argmax(-1)).sum().item()
        count = domain_windows[:, 1:].numel()
        domain_metrics = {"loss": totals["loss"] / count, "top1": totals["top1"] / count}
        domain_metrics["ppl"] = math.exp(domain_metrics["loss"])
        if reference is not None:
            domain_metrics["target_agreement"] = totals["target_agreement"] / count
        metrics[domain] = {name: round(value, 4) for name, value in domain_metrics.items()}
    return metrics


def evaluate_world(tokens_dir: Path, target_dir: Path, ar_draft_dir: Path, config: EvaluationConfig) -> dict:
    """Scores the saved target and AR draft on the same held-out windows (the draft also against the target)."""
    windows = {
        domain: heldout_windows(stream, config.seq_len, config.windows_per_domain)
        for domain, stream in load_streams(tokens_dir, "heldout").items()
    }
    target = load_saved_causal_lm(target_dir, "target")
    ar_draft = load_saved_causal_lm(ar_draft_dir, "ar_draft")
    return {
        "windows_per_domain": {domain: len(domain_windows) for domain, domain_windows in windows.items()},
        "seq_len": config.seq_len,
        "target": evaluate_heldout(target, windows, config),
        "ar_draft": evaluate_heldout(ar_draft, windows, config, reference=target),
    }
