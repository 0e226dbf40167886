"""Grouped-query attention for batched CPU decoding: the answers stage's attention, registered with transformers.

transformers' ``sdpa`` path on CPU runs a flash-attention kernel that is slow for one query row per sequence, and its
``eager`` path copies every key and value once per query head (``repeat_kv``) before the matmuls. Decoding a batch
of long answers is dominated by those two costs (BENCHMARKS.md, the recipe's answers stage). This function keeps the
keys and values shared: the query heads of a key/value group become rows of one matmul against that group's keys.
It computes the same attention as ``eager`` (same additive mask, softmax in float32), so greedy answers match the
other implementations up to floating-point summation order.
"""

from __future__ import annotations

import torch

NAME = "grouped_query"  # no "flash" in it: transformers takes such names for flash-attention kernels


def grouped_query_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """``(output [B, Q, H, D], None)`` from ``query [B, H, Q, D]`` and ``key``/``value`` ``[B, KV, L, D]``, where
    query head ``h`` reads key/value head ``h // (H // KV)`` (the layout ``repeat_kv`` assumes)."""
    if dropout and module.training:
        raise ValueError(f"The `{NAME}` attention is for inference; train with `sdpa` or `eager`.")
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, dim), key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores.view(batch, kv_heads, groups, q_len, kv_len) + attention_mask[:, :, None, :, :kv_len]
        scores = scores.view(batch, kv_heads, groups * q_len, kv_len)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(probs, value).view(batch, heads, q_len, dim)
    return output.transpose(1, 2).contiguous(), None


def use_grouped_query_attention(model):
    """Registers the attention (with transformers' additive ``eager`` mask) and switches ``model`` to it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(NAME, grouped_query_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    model.set_attn_implementation(NAME)
    return model


# ------------------------------------------------------------------------------------------------ repetition loops

LOOP_MIN_TOKENS = 48
LOOP_MAX_PERIOD = 64


def loop_end(tokens: list[int], min_tokens: int = LOOP_MIN_TOKENS, max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The length of the shortest prefix of ``tokens`` that ends in a repetition loop, or ``None``: a prefix ends in
    one when its last ``max(2 * period, min_tokens)`` tokens each equal the token ``period`` before (a phrase, line
    or block of up to ``max_period`` tokens repeated until at least three copies or ``min_tokens`` tokens of
    repetition). The small greedy target falls into such loops and stays in them until the token limit; a prefix
    ending this way keeps the start of each loop (what serving sees) without hundreds of copies."""
    best = None
    for period in range(1, max_period + 1):
        need, run = max(2 * period, min_tokens), 0
        for i in range(period, len(tokens) if best is None else min(len(tokens), best)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run >= need:
                best = i + 1
                break
    return best


class StopAtLoops:
    """A stopping criterion (transformers' interface) that ends a row once its generated tokens end in a loop as
    :func:`loop_end` defines it, so that a batch is not held to the token limit by rows that repeat themselves."""

    def __init__(self, prompt_width: int, min_tokens: int = LOOP_MIN_TOKENS, max_period: int = LOOP_MAX_PERIOD):
        self.prompt_width, self.min_tokens, self.max_period = prompt_width, min_tokens, max_period

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width :]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        length = generated.shape[1]
        for period in range(1, self.max_period + 1):
            need = max(2 * period, self.min_tokens)
            if length < need + period:
                break
            done |= (generated[:, length - need :] == generated[:, length - need - period : length - period]).all(1)
        return done
