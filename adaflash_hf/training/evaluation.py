"""Measured acceptance length of a drafter on a target (greedy decoding).

For now the measurement is teacher-forced: the target generates greedily, then the drafter drafts a block at every
response position in one block-masked forward, and the greedy speculative chain is replayed over those blocks.
Because greedy speculative decoding is lossless, the replayed chain visits the same anchors with the same context as
the real loop, so its mean acceptance length equals the real one (up to float noise). The generation side may
replace this with the statistics of the real speculative loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from .blocks import BlockLayout, block_supervised_mask
from .features import draft_blocks, draft_top1, slot_targets, target_features
from .losses import accepted_drafts
from .rollouts import collate_sequences, generate_completions


@dataclass
class AcceptanceStats:
    """mean_acceptance_length: committed tokens per target forward (accepted drafts + 1), averaged over steps.
    num_steps: speculative steps replayed. num_tokens: response tokens they committed."""

    mean_acceptance_length: float
    num_steps: int
    num_tokens: int


def _replay_chain(accepted: list[int], first: int, end: int) -> list[int]:
    """Acceptance lengths of the greedy chain: from anchor ``a``, ``accepted[a] + 1`` tokens are committed and the
    target's bonus token at ``a + accepted + 1`` becomes the next anchor."""
    lengths, anchor = [], first
    while anchor < end:
        step = min(accepted[anchor] + 1, end - anchor)
        lengths.append(step)
        anchor += step
    return lengths


@torch.no_grad()
def measure_acceptance(
    target,
    drafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    pad_token_id: int = 0,
    eos_token_id: int | list[int] | None = None,
    completions: list[list[int]] | None = None,
) -> AcceptanceStats:
    """Mean greedy acceptance length of ``drafter`` on ``target`` over ``prompts`` (token id lists).

    ``completions`` skips generation when the target's greedy responses are already known (they must be greedy
    target outputs for the result to be the real acceptance length).
    """
    if completions is None:
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id,
                                  eos_token_id=eos_token_id)
        completions = generate_completions(target, prompts, config, pad_token_id)
    block_size, device = drafter.config.block_size, target.get_input_embeddings().weight.device
    lengths = []
    for prompt, completion in zip(prompts, completions):
        if len(completion) < 2:
            continue
        # Trailing padding gives every anchor up to the last token a full block; slots past the end count as misses.
        batch = collate_sequences([(prompt, completion + [pad_token_id] * block_size)], pad_token_id)
        batch = {key: value.to(device) for key, value in batch.items()}
        padded, mask, response = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        mask[:, -block_size:] = 0
        response[:, -block_size:] = 0
        # The first response token comes from prefill; every later committed token starts a step from an anchor.
        first, end = len(prompt), len(prompt) + len(completion) - 1
        anchors = torch.arange(first, end, device=device).unsqueeze(0)
        layout = BlockLayout(anchors=anchors, keep=torch.ones_like(anchors, dtype=torch.bool), block_size=block_size)
        features = target_features(target, padded, mask, drafter.config.target_layer_ids)
        output = draft_blocks(drafter, target, padded, features, layout)
        draft_argmax, _ = draft_top1(target, output.last_hidden_state)
        data_labels, _ = slot_targets(padded, features, layout)
        matches = (draft_argmax == data_labels).view(1, -1, block_size) & block_supervised_mask(response, layout)
        accepted = [0] * first + accepted_drafts(matches)[0].tolist()
        lengths += _replay_chain(accepted, first, end)
    if not lengths:
        raise ValueError("No prompt produced a response of at least 2 tokens; raise max_new_tokens.")
    return AcceptanceStats(sum(lengths) / len(lengths), len(lengths), sum(lengths))
