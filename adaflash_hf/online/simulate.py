"""A simulated serving stream: prompts served in arrival order through an `OnlineGenerator`, with or without
adaptation, for `adaflash online` and the benchmark (acceptance length over drafter versions)."""

from __future__ import annotations

import dataclasses

from .config import OnlineConfig
from .generator import OnlineGenerator


def serve_stream(
    target,
    drafter,
    tokenizer,
    texts: list[str],
    config: OnlineConfig,
    domains: list[str | None] | None = None,
    batch_size: int = 1,
    adapt: bool = True,
    progress=None,
    **generate_kwargs,
) -> OnlineGenerator:
    """Serves ``texts`` (``batch_size`` per request, left-padded) and returns the `OnlineGenerator`, whose metrics
    log holds a row per request. ``adapt=False`` serves the same stream with training switched off (the baseline)."""
    if not adapt:
        config = dataclasses.replace(config, max_versions=0, background=False)
    domains = domains if domains is not None else [None] * len(texts)
    device = next(target.parameters()).device
    with OnlineGenerator(target, drafter, tokenizer, config) as server:
        for start in range(0, len(texts), batch_size):
            texts_now = texts[start : start + batch_size]
            batch = tokenizer(texts_now, return_tensors="pt", padding=True, padding_side="left").to(device)
            server.generate(
                batch.input_ids, batch.attention_mask, domains=domains[start : start + batch_size], **generate_kwargs
            )
            if progress is not None:
                progress.update(len(batch.input_ids))
    return server
