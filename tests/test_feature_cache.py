"""The feature cache of OPD training: stored features equal the target's, later epochs skip the target forward, a
run with the cache trains exactly as one without, and another target's cache is refused."""

import pytest
import torch
from datasets import Dataset
from synthetic import opd_args, prompts, synthetic_drafter

from adaflash_hf.training import FeatureCache, OPDTrainer
from adaflash_hf.training import features as features_module
from adaflash_hf.training.rollouts import GenerationConfig, collate_sequences, generate_completions


def _pairs(target, tokenizer, count=8):
    prompt_ids = [tokenizer(text)["input_ids"] for text in prompts(count)]
    config = GenerationConfig(max_new_tokens=24, do_sample=False, pad_token_id=0)
    return prompt_ids, generate_completions(target, prompt_ids, config, pad_token_id=0)


def test_cached_features_equal_the_targets_and_are_read_back_without_a_forward(
    target, tokenizer, tmp_path, monkeypatch
):
    prompt_ids, completions = _pairs(target, tokenizer)
    batch = collate_sequences(list(zip(prompt_ids, completions)), pad_token_id=0)
    layers = [0, 1]
    expected = features_module.target_features(target, batch["input_ids"], batch["attention_mask"], layers)

    cache = FeatureCache(tmp_path, target, layers, dtype=torch.float32)
    first = cache.features(batch["input_ids"], batch["attention_mask"])
    monkeypatch.setattr(features_module, "target_features", _forbidden)
    second = cache.features(batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    for got in (first, second):
        assert torch.equal(got.context[real], expected.context[real])
        assert torch.equal(got.last_hidden[real], expected.last_hidden[real])
    assert second.context.dtype == expected.context.dtype and second.context.shape == expected.context.shape
    # The teacher's whole-vocabulary argmax and log-sum-exp are stored with them (read back exactly).
    logits = target.get_output_embeddings()(expected.last_hidden).float()
    for got in (first, second):
        assert torch.equal(got.teacher.argmax[real], logits.argmax(-1)[real])
        assert torch.allclose(got.teacher.logsumexp[real], logits.logsumexp(-1)[real], atol=1e-5)

    # bfloat16 storage: the values a bf16-autocast drafter sees, the same on the first pass as read back later.
    monkeypatch.setattr(features_module, "target_features", expected_features := _recorder(expected))
    bf16 = FeatureCache(tmp_path / "bf16", target, layers)
    first = bf16.features(batch["input_ids"], batch["attention_mask"])
    second = bf16.features(batch["input_ids"], batch["attention_mask"])
    assert expected_features.calls == 1
    assert torch.equal(first.context[real], second.context[real])
    assert torch.equal(second.context[real], expected.context[real].bfloat16().float())


def _forbidden(*args, **kwargs):
    raise AssertionError("the target ran although every sequence was cached")


def _recorder(result):
    def run(*args, **kwargs):
        run.calls += 1
        return result

    run.calls = 0
    return run


def test_fill_shares_the_work_between_workers_and_skips_what_is_stored(target, tokenizer, tmp_path):
    prompt_ids, completions = _pairs(target, tokenizer, count=6)
    sequences = [p + c for p, c in zip(prompt_ids, completions)]
    cache = FeatureCache(tmp_path, target, [0, 1])
    assert cache.fill(sequences, batch_size=2, worker=0, num_workers=2) == 3
    assert cache.fill(sequences, batch_size=2, worker=1, num_workers=2) == 3
    assert cache.fill(sequences, batch_size=4) == 0
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 6


def test_fill_skips_what_another_process_stored_while_it_ran(target, tokenizer, tmp_path, monkeypatch):
    """Two processes over the same sequences (one restarted with other worker settings) never compute one twice:
    each batch looks again at what is stored."""
    prompt_ids, completions = _pairs(target, tokenizer, count=6)
    sequences = [p + c for p, c in zip(prompt_ids, completions)]
    cache, other = FeatureCache(tmp_path, target, [0, 1]), FeatureCache(tmp_path, target, [0, 1])
    longest = sorted(sequences, key=len)[-2:]  # the last batch this process would compute
    computed, features = [], cache.features

    def features_then_the_other_process(input_ids, attention_mask):
        computed.append(input_ids.shape[0])
        out = features(input_ids, attention_mask)
        if len(computed) == 1:  # meanwhile, the other process stores the longest two
            other.fill(longest, batch_size=2)
        return out

    monkeypatch.setattr(cache, "features", features_then_the_other_process)
    assert cache.fill(sequences, batch_size=2) == 4 and computed == [2, 2]
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 6


@pytest.mark.parametrize("reduced_vocab", [False, True])
def test_a_run_with_the_cache_trains_exactly_as_one_without_and_later_epochs_skip_the_target(
    target, tokenizer, tmp_path, monkeypatch, reduced_vocab
):
    prompt_ids, completions = _pairs(target, tokenizer)
    pairs = Dataset.from_dict({"prompt_ids": prompt_ids, "completion_ids": completions})
    # With a draft vocabulary the cached run reads the teacher's stored argmax and log-sum-exp instead of projecting
    # the whole vocabulary: the same numbers.
    draft_vocab = sorted({t for c in completions for t in c})[::2] if reduced_vocab else None
    weights = {}
    for name, extra in [("plain", {}), ("cached", {"feature_cache_dir": str(tmp_path / "features")})]:
        args = opd_args(tmp_path / name, max_steps=4, feature_cache_dtype="float32", **extra)  # 2 epochs of 4 rows
        torch.manual_seed(0)
        drafter = synthetic_drafter(target, tokenizer, draft_vocab=draft_vocab)
        trainer = OPDTrainer(drafter, target, args, train_dataset=pairs, processing_class=tokenizer)
        if name == "cached":
            calls = _counting(monkeypatch)
        trainer.train()
        weights[name] = {key: value.clone() for key, value in trainer.model.state_dict().items()}
    assert calls.count == 2  # the first epoch's two batches; the second epoch read every row back
    for key, value in weights["plain"].items():
        assert torch.allclose(value, weights["cached"][key], atol=1e-6), key


def _counting(monkeypatch):
    original = features_module.target_features

    def run(*args, **kwargs):
        run.count += 1
        return original(*args, **kwargs)

    run.count = 0
    monkeypatch.setattr(features_module, "target_features", run)
    return run


def test_another_targets_cache_is_refused_with_the_fix(target, tokenizer, tmp_path):
    FeatureCache(tmp_path, target, [0, 1])
    with pytest.raises(ValueError, match="another target_layer_ids.*new directory"):
        FeatureCache(tmp_path, target, [0])
    with pytest.raises(ValueError, match="feature_cache_dtype"):
        opd_args(tmp_path, feature_cache_dtype="int8")
