"""Grouped-query attention in the decoding loop's forwards without copying the keys and values (CPU).

A model with fewer key/value heads than query heads (grouped-query attention: SmolLM2, Llama 3, Qwen, Mistral, ...)
runs transformers' ``sdpa`` attention in one of three ways: with no mask, torch's SDPA reads each key/value head for
its group of query heads (``enable_gqa``); with a mask and one query token (a plain decoding step), the query heads
are regrouped so that the key/value heads serve them as they are; with a mask and several query tokens, the keys and
values are first copied once per query head of their group (``repeat_kv``), the whole cache, in every layer. The
loop's forwards are exactly that last case: a verification forward has a mask (the cache's holes at batch > 1, a
draft tree, or just the causal offset of a few tokens after a long context) and 2-16 query tokens, and so does the
drafter's block. On a CPU those copies cost a verification forward of 2-3 tokens about a tenth of a plain step over a
256-token context at batch 1, and a quarter at batch 8 (BENCHMARKS.md section 44), where the arithmetic says such a
forward should cost about one plain step. torch's SDPA on a CPU takes ``enable_gqa`` with a mask too, reading the
shared heads where they are. Other devices are left as transformers runs them: there its condition (no mask) keeps
SDPA on its fused kernels, and nothing here measured otherwise.

`grouped_query_attention` runs this thread's ``sdpa`` attention that way while the block runs: it puts a function in
front of transformers' ``sdpa`` entry of `ALL_ATTENTION_FUNCTIONS` (the mapping the modeling code looks its attention
up in at every forward), which computes the masked, several-query case of a grouped-query layer on a CPU with
``enable_gqa`` and hands every other call to the function it replaced: other threads, one query token, no mask, other
devices, a position bias, a soft cap, dropout. The entry is restored when the last block that put it there leaves.

Lossless: the same scaled dot products of the same vectors, summed by the same kernel; only where the kernel
reads a key/value head from changes (the outputs are identical in the tests, bit for bit, on this kernel).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_state = threading.local()  # depth: how many `grouped_query_attention` blocks this thread is in
_lock = threading.Lock()
# the blocks in progress in every thread, and the `sdpa` function the first of them replaced (transformers' own when
# none is: a reference to `gqa_sdpa_attention` kept past the blocks still computes transformers' attention)
_installed = {"blocks": 0, "previous": sdpa_attention_forward}


def _routes(module, query, attention_mask, dropout, kwargs) -> bool:
    """Whether this call is the masked, several-query, grouped-query case on a CPU, in a thread that asked for it."""
    return (
        getattr(_state, "depth", 0) > 0
        and attention_mask is not None
        and query.shape[2] > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.device.type == "cpu"
        and not dropout
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' ``sdpa`` attention (``[B, H, q, d]`` in, ``([B, q, H, d], None)`` out) with the key/value heads
    read in place where `_routes` says so; the replaced ``sdpa`` function otherwise."""
    if not _routes(module, query, attention_mask, dropout, kwargs):
        return _installed["previous"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_query_attention():
    """Runs this thread's ``sdpa`` attention of grouped-query layers without copying keys and values while the block
    runs (module docstring); blocks nest and may run in several threads at once."""
    with _lock:
        if _installed["blocks"] == 0:
            _installed["previous"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
            ALL_ATTENTION_FUNCTIONS["sdpa"] = gqa_sdpa_attention
        _installed["blocks"] += 1
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        with _lock:
            _installed["blocks"] -= 1
            if _installed["blocks"] == 0:
                previous = _installed["previous"]
                if ALL_ATTENTION_FUNCTIONS["sdpa"] is gqa_sdpa_attention:  # unless someone replaced it since
                    del ALL_ATTENTION_FUNCTIONS["sdpa"]  # the local entry: transformers' own shows through again
                    if ALL_ATTENTION_FUNCTIONS["sdpa"] is not previous:
                        ALL_ATTENTION_FUNCTIONS["sdpa"] = previous  # it was a local entry itself
                _installed["previous"] = sdpa_attention_forward
