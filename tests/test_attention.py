"""Grouped-query attention without copies in the loop's forwards (`attention.py`): the same outputs as transformers'
``sdpa`` bit for bit, taken only in the thread and block that asked, every other call handed to the replaced function,
the mapping restored; and the loop's forwards take it, with exact output."""

import threading

import pytest
import torch
from helpers import oracle_drafter, tiny_target
from test_generate_batched import PROMPTS, left_pad
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import adaflash_hf
from adaflash_hf.generation.attention import gqa_sdpa_attention, grouped_query_attention


class _Layer(torch.nn.Module):
    num_key_value_groups = 3


def _inputs(queries: int, batch: int = 2, context: int = 40):
    torch.manual_seed(0)
    query = torch.randn(batch, 6, queries, 16)
    key, value = torch.randn(batch, 2, context, 16), torch.randn(batch, 2, context, 16)
    mask = torch.ones(batch, 1, queries, context, dtype=torch.bool).tril(context - queries)
    mask[1, ..., :5] = False  # a row's left padding, as at batch > 1
    return query, key, value, mask


@pytest.fixture
def copies(monkeypatch):
    """Counts transformers' copies of the keys and values (``repeat_kv``)."""
    calls = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or original(x, n))
    return calls


@pytest.mark.parametrize("queries", [2, 3, 16])
def test_masked_queries_read_the_shared_heads_in_place_with_sdpas_output_bit_for_bit(copies, queries):
    query, key, value, mask = _inputs(queries)
    expected, _ = sdpa_attention.sdpa_attention_forward(_Layer(), query, key, value, mask, scaling=0.25)
    assert len(copies) == 2  # transformers copies the keys and the values: the negative control
    with grouped_query_attention():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is gqa_sdpa_attention
        out, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(), query, key, value, mask, scaling=0.25)
    assert len(copies) == 2 and weights is None
    assert out.shape == expected.shape == (2, queries, 6, 16) and out.is_contiguous()
    assert torch.equal(out, expected)


def test_every_other_call_goes_to_the_function_it_replaced(copies):
    query, key, value, mask = _inputs(3)
    layer = _Layer()
    with grouped_query_attention():
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        sdpa(layer, query, key, value, mask, dropout=0.1)  # dropout (training)
        assert len(copies) == 2
        sdpa(layer, query[:, :, :1], key, value, mask[:, :, :1])  # one query: transformers regroups the queries
        sdpa(layer, query, key, value, None)  # no mask: transformers' enable_gqa
        assert len(copies) == 2
        done = []
        worker = threading.Thread(target=lambda: done.append(sdpa(layer, query, key, value, mask)))
        worker.start()
        worker.join()
        assert len(done) == 1 and len(copies) == 4  # another thread runs transformers' own
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward
    ALL_ATTENTION_FUNCTIONS["sdpa"](layer, query, key, value, mask)  # after the block: transformers' own
    assert len(copies) == 6
    sdpa(layer, query, key, value, mask)  # a reference kept past the block computes transformers' attention
    assert len(copies) == 8


def test_blocks_nest_and_a_users_own_sdpa_entry_is_kept():
    seen = []

    def own(module, query, key, value, attention_mask, **kwargs):
        seen.append(query.shape[2])
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = own
    try:
        query, key, value, mask = _inputs(3)
        with grouped_query_attention():
            with grouped_query_attention():
                assert ALL_ATTENTION_FUNCTIONS["sdpa"] is gqa_sdpa_attention
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is gqa_sdpa_attention  # until the outer block leaves
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(), query[:, :, :1], key, value, mask[:, :, :1])
        assert seen == [1]  # what it does not route goes to the user's function
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is own
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward


def test_the_loops_forwards_read_the_shared_heads_in_place_and_stay_exact(monkeypatch, copies):
    """Batch 3, left-padded: the prompt is read as plain decoding reads it (its keys and values copied), then no
    forward of the loop copies them, the target's verifications and the drafter's blocks run SDPA with
    ``enable_gqa``, and the output is plain decoding's."""
    target = tiny_target("llama")
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    ids, mask = left_pad(PROMPTS[:3])
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=2)
    drafter = oracle_drafter(target, plain[:, ids.shape[1] :].tolist())
    grouped, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        if kwargs.get("enable_gqa") and attn_mask is not None:
            grouped.append(query.shape[2])
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    copies.clear()
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=12, pad_token_id=2
    )
    assert torch.equal(out, plain)
    assert len(copies) == 2 * target.config.num_hidden_layers  # the prefill's keys and values, once
    assert grouped and min(grouped) > 1
    assert drafter.config.block_size in grouped  # the drafter's blocks
    assert adaflash_hf.generation.attention._installed["blocks"] == 0
