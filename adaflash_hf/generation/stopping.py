"""Where a generated row ends: its tokens up to its first end-of-sequence token, for every caller of generate().

Batched generate() pads a finished row after its end-of-sequence token until the longest row ends; training
rollouts, online serving and the benchmark all keep only the row's own tokens, with one rule.
"""

from __future__ import annotations

from transformers import GenerationConfig


def cut_after_eos(new_tokens: list[int], generation_config: GenerationConfig) -> list[int]:
    """A row's generated ids up to and including its first end-of-sequence token (the padding after it dropped)."""
    eos = generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    end = next((i for i, token in enumerate(new_tokens) if token in eos_ids), None)
    return new_tokens if end is None else new_tokens[: end + 1]


__all__ = ["cut_after_eos"]
