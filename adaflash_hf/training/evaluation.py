"""Measured acceptance length of a drafter on a target: the real speculative loop's own statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ..generation.stats import record_stats
from .rollouts import generate_completions


@dataclass
class AcceptanceStats:
    """mean_acceptance_length: committed tokens per target verification (accepted drafts + 1), prefill excluded.
    num_steps: verification steps (row-steps). num_tokens: tokens they committed. verified_per_emitted: tokens the
    target verified per committed token (what the length policy saves)."""

    mean_acceptance_length: float
    num_steps: int
    num_tokens: int
    verified_per_emitted: float


@torch.no_grad()
def measure_acceptance(
    target,
    drafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    pad_token_id: int = 0,
    eos_token_id: int | list[int] | None = None,
    batch_size: int = 8,
    length_policy: str = "fixed",
) -> AcceptanceStats:
    """Mean greedy acceptance length of ``drafter`` on ``target`` over ``prompts`` (token id lists), measured by
    generating with ``target.generate(..., assistant_model=drafter)`` (the whole block verified by default)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        adaflash_length_policy=length_policy,
    )
    with record_stats() as stats:
        generate_completions(target, prompts, config, pad_token_id, batch_size=batch_size, assistant_model=drafter)
    if not stats.verification_steps:
        raise ValueError("No prompt produced a response of at least 2 tokens; raise max_new_tokens.")
    return AcceptanceStats(
        stats.mean_acceptance_length,
        stats.verification_steps,
        stats.emitted_tokens,
        stats.verified_tokens_per_emitted_token,
    )
