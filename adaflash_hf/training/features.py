"""The training view of one drafter step: target features and the many-block drafter forward.

Shared by the trainer, the acceptance measurement and the offline length-head initialisation, so all three see the
drafter exactly as it runs at inference (the block mask makes one forward over N blocks equal N cached inference
steps; see `tests/test_modeling.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockLayout, block_attention_mask, block_label_positions, block_noise_ids, block_position_ids


@dataclass
class TargetFeatures:
    """One no-grad target forward over ``[B, S]`` tokens.

    context (`[B, S, K*H]`): ``hidden_states[i + 1]`` for each of the drafter's ``target_layer_ids``, concatenated.
    last_hidden (`[B, S, H]`): the final-normed last hidden state; the target's ``lm_head`` of row ``t`` is its
        distribution for the token at ``t + 1``.
    """

    context: torch.Tensor
    last_hidden: torch.Tensor


@torch.no_grad()
def target_features(target, input_ids, attention_mask, target_layer_ids) -> TargetFeatures:
    outputs = target.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in target_layer_ids],
        use_cache=False,
    )
    context = torch.cat([outputs.hidden_states[i + 1] for i in target_layer_ids], dim=-1)
    return TargetFeatures(context=context, last_hidden=outputs.last_hidden_state)


def draft_blocks(drafter, target, input_ids, features: TargetFeatures, layout: BlockLayout):
    """Runs the drafter on every block of ``layout`` at once; returns its output (``last_hidden_state [B, Q, H]``,
    ``length_prediction [B, N]`` when it has a length head). The noise embeddings come from the target's frozen
    input embeddings, so no gradient reaches them."""
    config = drafter.config
    with torch.no_grad():
        noise_embeds = target.get_input_embeddings()(block_noise_ids(input_ids, layout, config.mask_token_id))
    seq_len = input_ids.shape[1]
    return drafter(
        noise_embeds=noise_embeds,
        context_hidden_states=features.context,
        position_ids=block_position_ids(seq_len, layout),
        attention_mask=block_attention_mask(seq_len, layout),
    )


def slot_targets(input_ids, features: TargetFeatures, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data_labels [B, Q], teacher_hidden [B, Q, H])`` of every slot: the token at ``a_n + k`` and the target's
    last hidden state at ``a_n + k - 1``, whose logits are the teacher's distribution for that token."""
    seq_len = input_ids.shape[1]
    positions = block_label_positions(seq_len, layout).flatten(1)
    data_labels = input_ids.gather(1, positions)
    hidden = features.last_hidden
    before = (positions - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return data_labels, hidden.gather(1, before)


@torch.no_grad()
def draft_top1(target, hidden: torch.Tensor, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax [B, Q], top probability [B, Q])`` of the drafter's distributions, projected with the target's
    output head ``chunk_size`` rows at a time so that a large vocabulary never materialises for every row."""
    head = target.get_output_embeddings()
    rows = hidden.flatten(0, 1).to(head.weight.dtype)
    argmax, top = [], []
    for start in range(0, rows.shape[0], chunk_size):
        probs = head(rows[start : start + chunk_size]).float().softmax(-1)
        values, indices = probs.max(-1)
        argmax.append(indices)
        top.append(values)
    return torch.cat(argmax).view(hidden.shape[:2]), torch.cat(top).view(hidden.shape[:2])
