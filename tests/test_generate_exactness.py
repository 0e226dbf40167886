"""Exactness against plain generate() on the same inputs, batch included: every feature plain generate() honours
gives the same sequences, scores and cache, or one clear error at the start of generate()."""

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD, PROMPTS, left_pad
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList


def both(target, drafter, ids, mask=None, fresh=dict, **kwargs):
    """(plain, speculative) generate() outputs on the same inputs; `fresh()` gives the stateful arguments (a cache,
    stopping criteria) anew for each call."""

    def call(**extra):
        return target.generate(
            ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kwargs, **fresh(), **extra
        )

    return call(), call(assistant_model=drafter)


def batch_and_references(target, size=3, new=30):
    prompts = PROMPTS[:size]
    ids, mask = left_pad(prompts)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
    return ids, mask, free


def corrupting_oracle(target, references):
    return oracle_drafter(target, references, corrupt=lambda row, anchor: {1 + (row + anchor) % 5})


def first_new_token(free, row, prompt_width, after):
    """A token that row `row` generates at index >= `after`, and not before it."""
    new = free[row, prompt_width:].tolist()
    return next(t for i, t in enumerate(new) if i >= after and t not in new[:i])


# ------------------------------------------------------------------ case 1: a prefilled prefix cache


def prefix_cache(target, ids, mask, length):
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[:, :length], attention_mask=None if mask is None else mask[:, :length], cache=cache)
    return cache


@pytest.mark.parametrize("size", [1, 3])
def test_a_prefilled_prefix_cache_gives_the_plain_output(size):
    target = tiny_target()
    ids, mask, free = batch_and_references(target, size)
    if size == 1:
        mask = None
    kwargs = dict(max_new_tokens=30, eos_token_id=None)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kwargs)
    for drafter in (tiny_drafter(target), corrupting_oracle(target, free)):
        plain, ours = both(
            target, drafter, ids, mask, fresh=lambda: dict(cache=prefix_cache(target, ids, mask, 4)), **kwargs
        )
        assert torch.equal(plain, reference)  # plain generate agrees with and without the prefix cache
        assert torch.equal(ours, reference)


def test_a_cache_holding_the_whole_prompt_is_refused_clearly():
    target = tiny_target()
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="cache already holds all 7 prompt tokens"):
        target.generate(
            ids, cache=prefix_cache(target, ids, None, 7), max_new_tokens=5, assistant_model=tiny_drafter(target)
        )


# ------------------------------------------------------------------ cases 2, 7, 8: the whole batch, finished rows too


def test_scores_logits_and_cache_of_finished_rows_equal_plain():
    target = tiny_target()
    ids, mask, free = batch_and_references(target)
    eos = first_new_token(free, 1, ids.shape[1], after=3)  # row 1 stops early, the others run on
    kwargs = dict(
        max_new_tokens=30, eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    plain, ours = both(target, corrupting_oracle(target, free), ids, mask, **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert (plain.sequences[1, ids.shape[1] :] == PAD).sum() > 10
    assert len(ours.scores) == len(plain.scores) and len(ours.logits) == len(plain.logits)
    for got, want in zip(ours.scores + ours.logits, plain.scores + plain.logits):
        assert torch.allclose(got, want, atol=1e-4)  # finished rows too: plain reports what it computed for them

    # the returned cache continues a second turn exactly like plain's own cache
    turn = torch.tensor([[40, 41, 42]] * 3)
    second_ids = torch.cat([plain.sequences, turn], dim=1)
    second_mask = torch.cat([mask, torch.ones(3, second_ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    outputs = [
        target.generate(
            second_ids,
            attention_mask=second_mask,
            cache=result.cache,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        for result in (plain, ours)
    ]
    assert torch.equal(outputs[0], outputs[1])


class StopPerRow(StoppingCriteria):
    """One stop token per request, as a serving stack would keep it: the criterion indexes rows."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.tokens


@pytest.mark.parametrize("eos", ["configured", "none"])
def test_row_indexed_stopping_criteria_see_the_whole_batch(eos):
    target = tiny_target()
    ids, mask, free = batch_and_references(target, new=40)
    stops = [first_new_token(free, row, ids.shape[1], after=3 + 4 * row) for row in range(3)]
    kwargs = dict(
        max_new_tokens=40,
        eos_token_id=1 if eos == "configured" else None,
    )
    for drafter in (tiny_drafter(target), corrupting_oracle(target, free)):
        fresh = lambda: dict(stopping_criteria=StoppingCriteriaList([StopPerRow(stops)]))  # noqa: E731
        plain, ours = both(target, drafter, ids, mask, fresh=fresh, **kwargs)
        assert plain.shape[1] < ids.shape[1] + 40  # the criterion stopped the batch early
        assert torch.equal(ours, plain)  # without EOS, rows stopped early keep their tokens, as in plain


# ------------------------------------------------------------------ cases 4, 10: row-indexed logits processors


def test_prefix_allowed_tokens_fn_sees_each_rows_batch_id():
    target = tiny_target()
    ids, mask, free = batch_and_references(target)

    def allowed(batch_id, input_ids):
        return [t for t in range(128) if t % 3 == batch_id]

    kwargs = dict(max_new_tokens=20, eos_token_id=None, prefix_allowed_tokens_fn=allowed)
    plain, ours = both(target, tiny_drafter(target), ids, mask, **kwargs)
    assert all(t % 3 == row for row in range(3) for t in plain[row, ids.shape[1] :].tolist())
    assert torch.equal(ours, plain)


def test_repetition_penalty_with_left_padding_greedy_and_sampling():
    target = tiny_target()
    ids, mask, free = batch_and_references(target)
    kwargs = dict(max_new_tokens=20, eos_token_id=None, repetition_penalty=1.3)
    plain, ours = both(target, corrupting_oracle(target, free), ids, mask, **kwargs)
    assert not torch.equal(plain, free[:, : plain.shape[1]])  # the penalty changes the greedy path
    assert torch.equal(ours, plain)
    sampled = target.generate(
        ids, attention_mask=mask, do_sample=True, pad_token_id=PAD, assistant_model=tiny_drafter(target), **kwargs
    )
    assert sampled.shape == plain.shape


# ------------------------------------------------------------------ cases 3, 6: refused clearly


@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_attentions_and_hidden_states_are_refused_clearly(flag):
    target = tiny_target()
    with pytest.raises(ValueError, match=f"{flag}=True"):
        target.generate(
            torch.tensor([PROMPTS[0]]),
            max_new_tokens=5,
            return_dict_in_generate=True,
            assistant_model=tiny_drafter(target),
            **{flag: True},
        )


def test_classifier_free_guidance_is_refused_clearly():
    target = tiny_target()
    with pytest.raises(ValueError, match="guidance_scale"):
        target.generate(
            torch.tensor([PROMPTS[0]]), max_new_tokens=5, guidance_scale=1.5, assistant_model=tiny_drafter(target)
        )


# ------------------------------------------------------------------ cases 9, 15, 18: targets the hole compaction met


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("mistral", dict(sliding_window=4096)),  # mistral's default window, far beyond the generation
        ("mistral", dict(sliding_window=41)),  # prompt + new tokens fill the window exactly: holes must not overflow
        ("qwen2_moe", dict()),  # sliding_window=0 with use_sliding_window=False: every layer is full attention
        ("deepseek_v3", dict()),  # MLA: values narrower than keys
    ],
)
def test_batched_greedy_with_forced_compaction_on_window_moe_and_mla_targets(family, overrides, monkeypatch):
    from adaflash_hf.generation import cache

    monkeypatch.setattr(cache, "COMPACT_FRACTION", 0.05)
    compactions = []
    original = cache.TargetCache.compact
    monkeypatch.setattr(cache.TargetCache, "compact", lambda self: (compactions.append(1), original(self)))
    target = tiny_target(family, **overrides)
    ids, mask, free = batch_and_references(target)
    assert ids.shape[1] + 30 == 41
    plain, ours = both(target, corrupting_oracle(target, free), ids, mask, max_new_tokens=30, eos_token_id=None)
    assert torch.equal(ours, plain) and compactions


# ------------------------------------------------------------------ case 14: a drafter config from any target config


@pytest.mark.parametrize("family", ["gemma3_text", "gpt2", "codegen", "cohere2_moe", "gemma4_unified_text"])
def test_from_target_config_builds_a_working_drafter(family):
    """Per-layer-type rope settings (gemma3_text), no `intermediate_size` (gpt2, codegen), `rms_norm_eps=None`
    (cohere2_moe), a `head_dim` that differs across layers and raises when read globally (gemma4_unified_text)."""
    target = tiny_target(family)
    ids = torch.tensor([PROMPTS[0]])
    plain, ours = both(target, tiny_drafter(target), ids, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(ours, plain)


def test_from_target_config_overrides_apply_before_the_target_is_read():
    from transformers import MptConfig

    from adaflash_hf import AdaFlashConfig

    config = AdaFlashConfig.from_target_config(
        MptConfig(d_model=64, n_heads=4, n_layers=4, vocab_size=128), mask_token_id=127, intermediate_size=96
    )
    assert (config.intermediate_size, config.hidden_size, config.num_target_layers) == (96, 64, 4)
    with pytest.raises(ValueError, match="has no hidden_size; pass hidden_size=... as an override"):
        AdaFlashConfig.from_target_config(
            type("Bare", (), {"get_text_config": lambda self, decoder: self})(), mask_token_id=1
        )
