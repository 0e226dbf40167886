"""Exactness at the edges of the newer paths: a stopping criterion inside a block that also ends the row another
way, reduced draft vocabularies that the processors empty under sampling, trees on ALiBi targets, the verification
layout on complex rotary embeddings, and cache column moves on DeepSeek sparse attention (the draft head's dtype
option: tests/test_draft_head.py). Each case is exact against plain generate(), or refused with one error naming the
problem and the fix."""

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD, left_pad
from test_generate_tree import _runner_up_oracle
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

import adaflash_hf

PROMPTS = [[0, 5, 9, 33, 17, 4, 80], [0, 44], [0, 7, 7, 7, 101, 3, 9, 12, 5]]


def _inputs(batch):
    return left_pad(PROMPTS[:batch])


CALL_ARGUMENTS = (
    "stopping_criteria",
    "cache",
    "tokenizer",
    "assistant_model",
)  # generate() arguments that are not config fields


def _generate(target, ids, mask, **kwargs):
    call = {k: kwargs.pop(k) for k in CALL_ARGUMENTS if k in kwargs}
    config = GenerationConfig(**{"do_sample": False, "pad_token_id": PAD, **kwargs})
    return target.generate(ids, attention_mask=mask, generation_config=config, **call)


def _plain(target, ids, mask, **kwargs):
    return _generate(target, ids, mask, **kwargs)


def _ours(target, drafter, ids, mask, **kwargs):
    with adaflash_hf.record_stats() as stats:
        out = _generate(target, ids, mask, assistant_model=drafter, **kwargs)
    return out, stats


def _oracle(target, ids, reference, **kwargs):
    """A drafter that drafts plain decoding's own continuation of every row (it accepts whole blocks)."""
    width = ids.shape[1]
    rows = [row[width - len(p) :].tolist() + [3] * 40 for row, p in zip(reference, PROMPTS)]
    return oracle_drafter(target, rows, **kwargs)


# ------------------------------------------------------------------ 1. a criterion inside a block that ends anyway


class StopAtNewTokens(StoppingCriteria):
    """Fires for every row once it holds `new` generated tokens (a custom criterion, called on the whole batch)."""

    def __init__(self, prompt_width, new):
        self.length = prompt_width + new

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree", [None, 16])
@pytest.mark.parametrize("other_end", ["budget", "eos"])
def test_a_criterion_inside_a_block_stops_the_row_there_whatever_else_ends_the_block(batch, tree, other_end):
    target = tiny_target()
    ids, mask = _inputs(batch)
    free = _plain(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    if other_end == "budget":
        # one accepted block of 8 reaches the budget of 6 and passes the criterion's 3
        kwargs = dict(max_new_tokens=6, eos_token_id=None)
    else:
        # row 0's sixth new token is an EOS, in the same block as the criterion's third
        new = free[0, ids.shape[1] :].tolist()
        eos = next(t for t in new[5:] if t not in new[:3])
        kwargs = dict(max_new_tokens=30, eos_token_id=eos)
    criteria = lambda: StoppingCriteriaList([StopAtNewTokens(ids.shape[1], 3)])  # noqa: E731
    extra = {} if tree is None else {"adaflash_tree_budget": tree}
    expected = _plain(target, ids, mask, stopping_criteria=criteria(), **kwargs)
    assert expected.shape[1] == ids.shape[1] + 3
    out, stats = _ours(target, _oracle(target, ids, free), ids, mask, stopping_criteria=criteria(), **kwargs, **extra)
    assert max(stats.steps[0].accepted) >= 3  # the first block accepted past the criterion's point
    assert torch.equal(out, expected)


def test_stop_strings_inside_a_block_that_reaches_the_budget(word_tokenizer):
    target = tiny_target()
    ids, mask = _inputs(1)
    free = _plain(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    new = free[0, ids.shape[1] :].tolist()
    stop = word_tokenizer.convert_ids_to_tokens(new[1]) + word_tokenizer.convert_ids_to_tokens(new[2])
    kwargs = dict(max_new_tokens=6, eos_token_id=None, stop_strings=[stop], tokenizer=word_tokenizer)
    expected = _plain(target, ids, mask, **kwargs)
    out, _ = _ours(target, _oracle(target, ids, free), ids, mask, **kwargs)
    assert expected.shape[1] < ids.shape[1] + 6 and torch.equal(out, expected)


# ------------------------------------------------------------------ 2. a draft vocabulary the processors empty

VOCAB_IDS = [3, 4, 5, 7, 8, 9]  # a reduced draft vocabulary; the target's EOS (1) is outside it


@pytest.mark.parametrize(
    "processors",
    [
        dict(suppress_tokens=VOCAB_IDS),
        dict(bad_words_ids=[[t] for t in VOCAB_IDS]),
        dict(forced_eos_token_id=1, eos_token_id=1),
        dict(no_repeat_ngram_size=1),
    ],
    ids=["suppress_tokens", "bad_words_ids", "forced_eos_token_id", "no_repeat_ngram_size"],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_no_allowed_draft_token_drafts_nothing_there_under_sampling_and_greedy(processors, batch):
    target = tiny_target()
    ids, mask = _inputs(batch)
    drafter = tiny_drafter(target, block_size=4, draft_vocab=VOCAB_IDS)
    kwargs = dict(max_new_tokens=12, **{"eos_token_id": None, **processors})
    torch.manual_seed(0)
    sampled = _generate(target, ids, mask, do_sample=True, assistant_model=drafter, **kwargs)
    assert sampled.shape[0] == batch
    if "suppress_tokens" in processors or "bad_words_ids" in processors:
        assert not torch.isin(sampled[:, ids.shape[1] :], torch.tensor(VOCAB_IDS)).any()
    expected = _plain(target, ids, mask, **kwargs)
    out, stats = _ours(target, drafter, ids, mask, **kwargs)
    assert torch.equal(out, expected)
    if "suppress_tokens" in processors or "bad_words_ids" in processors:
        # nothing of the draft vocabulary is ever allowed: no draft is offered for verification
        assert all(length == 1 for step in stats.steps for length in step.candidate_lengths)


def test_no_allowed_draft_token_ends_the_tree_there():
    target = tiny_target()
    ids, mask = _inputs(3)
    drafter = tiny_drafter(target, block_size=4, draft_vocab=VOCAB_IDS)
    kwargs = dict(max_new_tokens=12, eos_token_id=None, suppress_tokens=VOCAB_IDS, adaflash_tree_budget=8)
    expected = _plain(target, ids, mask, **kwargs)
    out, stats = _ours(target, drafter, ids, mask, **kwargs)
    assert torch.equal(out, expected)
    assert all(length == 1 for step in stats.steps for length in step.candidate_lengths)
    torch.manual_seed(0)
    _generate(target, ids, mask, do_sample=True, assistant_model=drafter, **kwargs)


# ------------------------------------------------------------------ 3. trees on ALiBi targets


@pytest.mark.parametrize("family, overrides", [("bloom", {}), ("falcon", {"alibi": True})])
def test_trees_on_alibi_targets_are_refused_and_linear_stays_exact(family, overrides):
    target = tiny_target(family, **overrides)
    ids, mask = _inputs(3)
    drafter = tiny_drafter(target)
    with pytest.raises(NotImplementedError, match="ALiBi target.*Drop adaflash_tree_budget"):
        _ours(target, drafter, ids, mask, max_new_tokens=8, eos_token_id=None, adaflash_tree_budget=8)
    expected = _plain(target, ids, mask, max_new_tokens=12, eos_token_id=None)
    out, _ = _ours(target, drafter, ids, mask, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out, expected)


# ------------------------------------------------------------------ 4. the verification layout, any rotary kind


@pytest.mark.parametrize("family", ["deepseek_v2", "llama4_text"])
@pytest.mark.parametrize("layout", ["transposed", None])
def test_the_transposed_layout_returns_what_linear_returns_on_complex_rotary_targets(family, layout):
    target = tiny_target(family)
    ids, mask = _inputs(1)
    expected = _plain(target, ids, mask, max_new_tokens=12, eos_token_id=None)
    extra = {} if layout is None else {"adaflash_verify_layout": layout}
    # blocks of 4: verification forwards of 2-4 tokens, the widths the transposed layout serves
    drafter = _oracle(target, ids, expected, block_size=4, corrupt=lambda row, anchor: {2 + anchor % 2})
    out, _ = _ours(target, drafter, ids, mask, max_new_tokens=12, eos_token_id=None, **extra)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kernel", ["transposed", "onednn", "blocked"])
def test_the_rerouted_product_is_laid_out_as_linear(kernel):
    from adaflash_hf.generation.verify_layout import linear

    x, weight = torch.randn(2, 3, 8), torch.randn(6, 8)
    out = linear(x, weight, None, kernel)
    assert out.is_contiguous() and out.stride() == torch.nn.functional.linear(x, weight).stride()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))


# ------------------------------------------------------------------ 5. per-position cache tensors beyond K and V


def _sparse_target():
    # The indexer's top-k (default 2048) covers the whole tiny context, so attention is dense and greedy outputs are
    # comparable token for token (with a top-k below the context, a random tiny model's index scores tie often, and
    # plain decoding's own one-token and many-token forwards break those ties differently). What the sparse layer
    # adds, its indexer keys, is compared in the returned cache: a column moved without them shows there.
    return tiny_target("deepseek_v32", index_head_dim=16, index_n_heads=2)


def _same_indexer_keys(ours, plain):
    for ours_layer, plain_layer in zip(ours.cache.layers, plain.cache.layers):
        torch.testing.assert_close(ours_layer.indexer_keys, plain_layer.indexer_keys, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tree", [None, 16])
def test_trees_move_the_sparse_attention_indexer_keys_with_their_columns(tree):
    target = _sparse_target()
    ids, mask = _inputs(1)
    kwargs = dict(max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    expected = _plain(target, ids, mask, **kwargs)
    # wrong at varying drafts with the right token as the runner-up: a tree's accepted path then goes through a
    # second branch, out of the tree's node order
    width = ids.shape[1]
    references = [row[width - len(p) :].tolist() + [3] * 40 for row, p in zip(expected.sequences, PROMPTS)]
    drafter = _runner_up_oracle(target, references, corrupt=lambda row, anchor: {1 + anchor % 3})
    extra = {} if tree is None else {"adaflash_tree_budget": tree}
    out, stats = _ours(target, drafter, ids, mask, **kwargs, **extra)
    assert torch.equal(out.sequences, expected.sequences)
    if tree is not None:  # the runner-up branches were taken
        assert stats.mean_acceptance_length > 3
    _same_indexer_keys(out, expected)


def test_compaction_and_returned_caches_move_the_sparse_attention_indexer_keys_at_batch_3():
    target = _sparse_target()
    ids, mask = _inputs(3)
    kwargs = dict(max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    expected = _plain(target, ids, mask, **kwargs)
    for drafter in (
        tiny_drafter(target),  # rejects nearly everything: holes past the compaction threshold
        _oracle(target, ids, expected.sequences, corrupt=lambda row, anchor: {1 + row}),
    ):
        out, _ = _ours(target, drafter, ids, mask, **kwargs)
        assert torch.equal(out.sequences, expected.sequences)
        # the returned cache is rebuilt to plain's layout; columns under the left padding hold zeros there
        for ours_layer, plain_layer in zip(out.cache.layers, expected.cache.layers):
            real = mask.bool()[:, :, None].expand(-1, -1, plain_layer.indexer_keys.shape[-1])
            width = mask.shape[1]
            torch.testing.assert_close(
                ours_layer.indexer_keys[:, width:], plain_layer.indexer_keys[:, width:], atol=1e-5, rtol=1e-4
            )
            torch.testing.assert_close(
                ours_layer.indexer_keys[:, :width][real],
                plain_layer.indexer_keys[:, :width][real],
                atol=1e-5,
                rtol=1e-4,
            )


def test_a_cache_layer_the_loop_cannot_move_is_refused():
    from transformers.cache_utils import DynamicLayer

    class KeepsMore(DynamicLayer):  # a subclass may keep per-position state of its own
        pass

    target = tiny_target()
    ids, mask = _inputs(3)
    cache = DynamicCache(config=target.config)
    cache.layers = [KeepsMore() for _ in cache.layers]
    with pytest.raises(NotImplementedError, match=r"\['KeepsMore'\] cache layers.*generate one row per call"):
        _ours(target, tiny_drafter(target), ids, mask, max_new_tokens=4, eos_token_id=None, cache=cache)
