"""Routing of generate(assistant_model=...), the length policies against the native DFlash path, and errors."""

import functools
import threading
import warnings

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from peft import LoraConfig, get_peft_model
from transformers import GenerationConfig
from transformers.generation import DFlashTokenCandidateGenerator
from transformers.generation.utils import GenerationMixin

import adaflash_hf
from adaflash_hf.generation import routing

PROMPT = torch.tensor([[0, 5, 9, 33, 17, 4, 80]])


def _greedy(target, **kwargs):
    return target.generate(PROMPT, max_new_tokens=40, do_sample=False, **kwargs)


def _native_acceptance(target, drafter, monkeypatch):
    seen = []
    monkeypatch.setattr(
        DFlashTokenCandidateGenerator,
        "update_candidate_strategy",
        lambda self, input_ids, scores, num_matches: seen.append(int(num_matches)),
        raising=False,
    )
    out = _greedy(target, assistant_model=drafter, speculation_type="dflash")
    return out, seen


def test_fixed_policy_equals_the_native_dflash_path_token_and_step(monkeypatch):
    target = tiny_target()
    reference = _greedy(target)
    corrupt = {7: {3}, 10: {1}, 11: {6}, 17: {2, 5}}
    drafter = oracle_drafter(target, [reference[0]], corrupt=lambda row, anchor: corrupt.get(anchor, ()))
    native, native_steps = _native_acceptance(target, drafter, monkeypatch)
    with adaflash_hf.record_stats() as stats:
        ours = _greedy(target, assistant_model=drafter)
    assert torch.equal(ours, native) and torch.equal(ours, reference)
    assert [s.accepted[0] for s in stats.steps] == native_steps[1:]  # native's first entry is its prefill pass
    assert native_steps[1:5] == [2, 0, 5, 1]


def test_adaptive_policy_follows_the_length_head():
    target = tiny_target()
    reference = _greedy(target)
    drafter = oracle_drafter(target, [reference[0]], use_length_head=True, length_head_bottleneck_dim=16)
    with torch.no_grad():
        drafter.length_head.out.weight.mul_(200.0)  # a random head predicts ~0.5 everywhere; spread it out
    predictions = []
    drafter.length_head.register_forward_hook(lambda module, args, out: predictions.append(float(out.flatten()[0])))
    config = GenerationConfig(
        max_new_tokens=40, do_sample=False, adaflash_length_rate=1.2, adaflash_min_candidate_length=2
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(PROMPT, generation_config=config, assistant_model=drafter)
    assert torch.equal(out, reference)
    expected = [min(8, max(2, round(p * 8 * 1.2))) for p in predictions]
    budget = [40 - 1 - sum(s.emitted[0] for s in stats.steps[:i]) for i in range(len(stats.steps))]
    assert [s.candidate_lengths[0] for s in stats.steps] == [min(e, b) for e, b in zip(expected, budget)]
    assert len(set(expected)) > 1  # the head's predictions really vary the length


def test_adaptive_without_a_head_is_a_clear_error():
    target = tiny_target()
    with pytest.raises(ValueError, match="needs a drafter with a length head"):
        target.generate(
            PROMPT,
            max_new_tokens=5,
            assistant_model=tiny_drafter(target),
            generation_config=GenerationConfig(adaflash_length_policy="adaptive", max_new_tokens=5),
        )


def test_transformers_loop_with_our_generator_matches_our_loop():
    target = tiny_target()
    reference = _greedy(target)
    corrupt = {7: {3}, 10: {1}}
    drafter = oracle_drafter(target, [reference[0]], corrupt=lambda row, anchor: corrupt.get(anchor, ()))
    config = GenerationConfig(max_new_tokens=40, do_sample=False, adaflash_decoding_loop="transformers")
    assert torch.equal(target.generate(PROMPT, generation_config=config, assistant_model=drafter), reference)


def test_an_ordinary_assistant_still_uses_transformers_assisted_generation():
    target = tiny_target()
    assistant = tiny_target(num_hidden_layers=1, seed=5)
    assert torch.equal(_greedy(target, assistant_model=assistant), _greedy(target))


def test_install_is_idempotent_and_uninstall_restores():
    assert routing.is_installed()
    wrapped = GenerationMixin._assisted_decoding
    assert adaflash_hf.install() and GenerationMixin._assisted_decoding is wrapped
    originals = {name: previous for name, (_, previous) in routing._installed.items()}
    try:
        assert adaflash_hf.uninstall()
        assert all(getattr(GenerationMixin, name) is fn for name, fn in originals.items())
        assert not routing.is_installed()
    finally:
        adaflash_hf.install()
    assert routing.is_installed()


def test_uninstall_leaves_another_librarys_wrapper_on_top_of_ours(monkeypatch):
    ours = GenerationMixin._assisted_decoding

    @functools.wraps(ours)  # copies every attribute of ours, as stacking libraries do
    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", theirs)
    with pytest.warns(UserWarning, match=r"\['_assisted_decoding'\] were wrapped again"):
        assert adaflash_hf.uninstall() is False
    assert GenerationMixin._assisted_decoding is theirs and routing.is_installed()


def test_generate_after_uninstall_names_the_fix():
    target = tiny_target()
    adaflash_hf.uninstall()
    try:
        with pytest.raises(AttributeError, match="routing is installed.*custom_generate=adaflash_hf.generate_loop"):
            target.generate(PROMPT, max_new_tokens=5, assistant_model=tiny_drafter(target))
    finally:
        adaflash_hf.install()


def test_changed_internals_warn_and_the_custom_generate_entry_point_works(monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target)
    adaflash_hf.uninstall()
    try:
        monkeypatch.setitem(routing.EXPECTED_SIGNATURES, "_assisted_decoding", ("self", "renamed"))
        with pytest.warns(UserWarning, match="custom_generate=adaflash_hf.generate_loop"):
            assert adaflash_hf.install() is False
        assert not routing.is_installed()
        out = target.generate(
            PROMPT, max_new_tokens=40, do_sample=False, custom_generate=adaflash_hf.generate_loop, drafter=drafter
        )
        assert torch.equal(out, _greedy(target))
    finally:
        monkeypatch.undo()
        adaflash_hf.install()


def test_peft_wrapped_drafter_is_routed():
    target = tiny_target()
    drafter = get_peft_model(tiny_drafter(target), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with adaflash_hf.record_stats() as stats:
        out = _greedy(target, assistant_model=drafter)
    assert torch.equal(out, _greedy(target)) and stats.verification_steps > 0


def test_record_stats_is_per_thread():
    target = tiny_target()
    drafter = tiny_drafter(target)
    results = {}

    def run(name, new_tokens):
        with adaflash_hf.record_stats() as stats:
            target.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        results[name] = stats

    threads = [threading.Thread(target=run, args=(f"t{n}", n)) for n in (12, 30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results["t12"].calls) == len(results["t30"].calls) == 1
    assert results["t12"].emitted_tokens == 11 and results["t30"].emitted_tokens == 29


# ------------------------------------------------------------------ errors


def test_incompatible_drafter_is_named_before_generation():
    drafter = tiny_drafter(tiny_target())
    with pytest.raises(ValueError, match="hidden size: drafter 64 vs target 96"):
        tiny_target(hidden_size=96, head_dim=24).generate(PROMPT, max_new_tokens=5, assistant_model=drafter)


def test_beam_search_is_refused():
    target = tiny_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="not beam_search.*set num_beams=1"):
            target.generate(PROMPT, max_new_tokens=5, num_beams=2, assistant_model=tiny_drafter(target))


def test_num_return_sequences_is_refused():
    target = tiny_target()
    with pytest.raises(ValueError, match="num_return_sequences has to be 1"):
        target.generate(
            PROMPT, max_new_tokens=5, do_sample=True, num_return_sequences=2, assistant_model=tiny_drafter(target)
        )


def test_non_croppable_target_is_refused():
    target = tiny_target()
    target.config.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"\['linear_attention'\] layers whose cache cannot be cropped"):
        tiny_drafter(tiny_target()).check_compatible(target)


def test_static_cache_is_refused():
    target = tiny_target()
    with pytest.raises(ValueError, match="needs a DynamicCache.*cache_implementation='dynamic'"):
        target.generate(
            PROMPT,
            max_new_tokens=5,
            do_sample=False,
            cache_implementation="static",
            assistant_model=tiny_drafter(target),
        )


def test_batched_sliding_window_beyond_the_window_is_refused():
    target = tiny_target("mistral", sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window or chunked-attention target"):
        target.generate(
            torch.cat([PROMPT, PROMPT]), max_new_tokens=20, do_sample=False, assistant_model=tiny_drafter(target)
        )


def test_sliding_window_target_at_batch_1_is_lossless():
    target = tiny_target("mistral", sliding_window=12)
    reference = _greedy(target)
    drafter = oracle_drafter(target, [reference[0]], corrupt=lambda row, anchor: {3} if anchor % 2 else ())
    assert torch.equal(_greedy(target, assistant_model=drafter), reference)


def test_transformers_loop_refuses_batches_and_criteria_it_would_run_past(word_tokenizer):
    target = tiny_target()
    drafter = tiny_drafter(target)
    config = dict(max_new_tokens=20, do_sample=False, adaflash_decoding_loop="transformers")
    with pytest.raises(ValueError, match="which is batch 1; this batch has 2 rows"):
        target.generate(
            torch.cat([PROMPT, PROMPT]), generation_config=GenerationConfig(**config), assistant_model=drafter
        )
    with pytest.raises(ValueError, match=r"run past \['StopStringCriteria'\]"):
        target.generate(
            PROMPT,
            generation_config=GenerationConfig(**config, stop_strings=["ab"]),
            tokenizer=word_tokenizer,
            assistant_model=drafter,
        )


def test_a_streamer_at_batch_above_one_is_refused():
    from test_generate_greedy import ChunkRecorder

    target = tiny_target()
    with pytest.raises(ValueError, match="this batch has 2 rows"):
        target.generate(
            torch.cat([PROMPT, PROMPT]),
            max_new_tokens=5,
            streamer=ChunkRecorder(),
            assistant_model=tiny_drafter(target),
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(use_cache=False), "pass use_cache=True"),
        (dict(inputs_embeds=True), "needs input_ids"),
    ],
)
def test_calls_without_a_cache_or_ids_are_refused_clearly(kwargs, match):
    target = tiny_target()
    if kwargs.get("inputs_embeds"):
        kwargs = dict(inputs_embeds=target.get_input_embeddings()(PROMPT))
        inputs = None
    else:
        inputs = PROMPT
    with pytest.raises(ValueError, match=match):
        target.generate(inputs, max_new_tokens=5, do_sample=False, assistant_model=tiny_drafter(target), **kwargs)


def test_a_target_whose_config_turns_the_cache_off_is_told_to_turn_it_on():
    target = tiny_target("mpt")  # MptConfig defaults to use_cache=False
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="pass use_cache=True"):
        target.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=drafter)
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False, use_cache=True)
    ours = target.generate(PROMPT, max_new_tokens=20, do_sample=False, use_cache=True, assistant_model=drafter)
    assert torch.equal(ours, plain)


def test_a_target_that_ignores_its_cache_is_refused_before_generating():
    target = tiny_target("openai-gpt")  # its forward accepts a cache and never fills it
    with pytest.raises(ValueError, match="OpenAIGPTLMHeadModel keeps 0 KV-cache columns for 7 prompt tokens"):
        target.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=tiny_drafter(target))


@pytest.mark.parametrize("family", ["big_bird", "bert"])
def test_a_bidirectional_target_is_refused_and_a_causal_one_works(family):
    target = tiny_target(family)  # is_decoder=False: plain decoding feeds one token at a time, so it never notices
    with pytest.raises(ValueError, match="attends bidirectionally"):
        target.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=tiny_drafter(target))
    target = tiny_target(family, is_decoder=True, attention_type="original_full")
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    assert torch.equal(
        target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=tiny_drafter(target)), plain
    )


def test_a_hybrid_layer_type_is_refused_by_its_cache_and_by_its_name():
    target = tiny_target("inkling_text")  # "hybrid_sliding" layers: linear attention beside sliding-window attention
    with pytest.raises(
        ValueError, match=r"\['LinearAttentionAndSlidingWindowAttentionLayer'\] cache layers cannot be"
    ):
        target.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=tiny_drafter(target))
    with pytest.raises(ValueError, match=r"\['hybrid_sliding'\] layers whose cache cannot be cropped"):
        tiny_drafter(target).check_compatible(target)


def test_a_target_with_several_residual_streams_is_refused_clearly():
    target = tiny_target("hy_v4")  # hyper-connections: hidden states [batch, tokens, streams, hidden]
    with pytest.raises(ValueError, match=r"hidden states have shape \(1, 7, \d+, 64\), not \[batch, tokens, hidden\]"):
        target.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=tiny_drafter(target))
