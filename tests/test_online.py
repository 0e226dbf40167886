"""Online adaptation on the synthetic language: durable buffer, checksummed publications, rounds that raise
acceptance, background hot-swaps between requests, faults (a raising trainer, bad publications, restarts) and
per-domain LoRA adapters with mixed batches; every generation is compared with plain greedy decoding."""

import json
import time

import pytest
import torch
from synthetic import opd_args, prompts, synthetic_drafter

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.online import (
    OnlineConfig,
    OnlineGenerator,
    PublishError,
    SampleBuffer,
    VersionStore,
    acceptance_by_version,
    read_metrics,
)
from adaflash_hf.online import rounds as rounds_module

NEW_TOKENS = 24
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=1)


def _config(tmp_path, **overrides):
    defaults = dict(
        swap_dir=str(tmp_path / "swap"),
        train_threshold=16,
        buffer_epochs=4,
        background=False,
        poll_interval_s=0.02,
        training_args=opd_args(tmp_path / "unused", per_device_train_batch_size=4),
        lora_r=8,
        lora_alpha=16,
    )
    return OnlineConfig(**{**defaults, **overrides})


def _serve(adapter, tokenizer, target, texts, domains=None, batch_size=4):
    """Serves ``texts`` in batches; asserts every output equals plain greedy decoding of the target."""
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
        tags = None if domains is None else domains[start : start + batch_size]
        served = adapter.generate(batch.input_ids, batch.attention_mask, domains=tags, **GREEDY)
        plain = target.generate(batch.input_ids, attention_mask=batch.attention_mask, **GREEDY)
        assert torch.equal(served, plain)


def _by_version(rows, domain=None):
    rows = [r for r in rows if domain is None or r.get("domain") == domain]
    return {s["version"]: s["mean_acceptance_length"] for s in acceptance_by_version(rows)}


# ---------------------------------------------------------------------------------------------- buffer and store


def test_buffer_is_durable_ordered_bounded_and_quarantines_bad_files(tmp_path):
    buffer = SampleBuffer(tmp_path / "buffer", capacity=3)
    for i in range(4):
        buffer.add([i], [i, 1], domain="code" if i % 2 else None)
    assert buffer.evicted == 1 and len(buffer) == 3
    (tmp_path / "buffer" / ".tmp-deadbeef-x.json").write_text("{")  # a write interrupted before its rename
    reopened = SampleBuffer(tmp_path / "buffer", capacity=3)
    assert [s.prompt_ids for s in reopened.take(10)] == [[1], [2], [3]]  # oldest first, the evicted one gone
    assert not list((tmp_path / "buffer").glob(".tmp-*"))
    assert reopened.domain_counts() == {"code": 2, None: 1}
    assert [s.prompt_ids for s in reopened.take(10, domain="code")] == [[1], [3]]

    corrupt = tmp_path / "buffer" / f"{reopened.sample_ids()[0]}.json"
    corrupt.write_text("{not json")
    assert [s.prompt_ids for s in reopened.take(10)] == [[2], [3]]
    assert (tmp_path / "buffer" / "quarantine" / corrupt.name).exists()  # kept for inspection, not deleted
    with pytest.raises(ValueError, match="Domain tag"):
        reopened.add([1], [1], domain="no/slashes")
    # a write in flight (the serving thread's, while the trainer's thread takes samples) is no sample yet: neither
    # listed, nor taken, nor quarantined as unreadable, so its rename still finds it
    in_flight = tmp_path / "buffer" / f".tmp-cafe-{reopened.sample_ids()[0]}.json"
    in_flight.write_text('{"sample_id": ')
    assert not any(i.startswith(".tmp-") for i in reopened.sample_ids()) and len(reopened.take(10)) == 2
    assert in_flight.exists() and len(reopened) == 2


def test_store_publishes_atomically_and_verify_names_the_bad_file(tmp_path):
    store = VersionStore(tmp_path, keep_versions=2)
    first = store.publish("drafter", lambda d: (d / "model.bin").write_bytes(b"weights-1"), consumed=["a"])
    second = store.publish("drafter", lambda d: (d / "model.bin").write_bytes(b"weights-2"))
    third = store.publish("drafter", lambda d: (d / "model.bin").write_bytes(b"weights-3"))
    assert [first.version, second.version, third.version] == [1, 2, 3]
    assert store.latest("drafter").version == 3 and not first.path.exists()  # pruned beyond keep_versions
    store.verify(third)
    (third.path / "model.bin").write_bytes(b"weights")  # truncated after publishing
    with pytest.raises(PublishError, match="model.bin does not match its published sha256"):
        store.verify(third)

    def crash(directory):
        (directory / "model.bin").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.publish("drafter", crash)
    assert store.latest("drafter").version == 3 and not list((tmp_path / "drafter").glob(".staging-*"))
    (tmp_path / "drafter" / "LATEST.json").write_text("{")
    with pytest.raises(PublishError, match="unreadable"):
        store.latest("drafter")
    assert store.publish("drafter", lambda d: (d / "model.bin").write_bytes(b"4")).version == 4  # never repeats


# ---------------------------------------------------------------------------------------------- drafter rounds


def test_rounds_raise_acceptance_over_versions_and_every_output_stays_lossless(target, tokenizer, tmp_path):
    adapter = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, _config(tmp_path))
    _serve(adapter, tokenizer, target, prompts(80, seed=3))
    by_version = _by_version(adapter.metrics.rows())
    print("acceptance by drafter version", by_version)
    assert sorted(by_version) == [0, 1, 2, 3, 4]
    assert by_version[0] < 1.3 and by_version[4] > by_version[0] + 1.0
    swaps = adapter.metrics.rows("swap")
    assert [s["version"] for s in swaps] == [1, 2, 3, 4] and adapter.status["buffered"] == 0
    published = adapter.store.latest("drafter")
    assert published.info["samples"] == 16 and (published.path / "config.json").exists()


def test_background_trainer_swaps_only_between_requests(target, tokenizer, tmp_path, monkeypatch):
    built_under_lock = []

    class CheckedTrainer(rounds_module.OPDTrainer):
        # Building a trainer briefly wraps the target's forward (bf16 autocast); no request may run meanwhile.
        def __init__(self, *args, **kwargs):
            built_under_lock.append(adapter._lock._is_owned())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(rounds_module, "OPDTrainer", CheckedTrainer)
    config = _config(tmp_path, background=True, max_versions=2)
    with OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, config) as adapter:
        texts = prompts(48, seed=4)
        _serve(adapter, tokenizer, target, texts[:16])
        assert adapter.wait_for_version(1, timeout=120)
        _serve(adapter, tokenizer, target, texts[16:32])
        assert adapter.wait_for_version(2, timeout=120)
        _serve(adapter, tokenizer, target, texts[32:])
    requests = adapter.metrics.rows("request")
    versions = [r["version"] for r in requests]
    assert versions == sorted(versions) and versions[-1] == 2  # adopted in order, never mid-request
    batches = [versions[i : i + 4] for i in range(0, len(versions), 4)]
    assert all(len(set(batch)) == 1 for batch in batches)  # one version per generate() call
    assert adapter.status["trainer"] == "idle" and adapter.status["trainer_error"] is None
    assert built_under_lock == [True, True]


# ---------------------------------------------------------------------------------------------- faults


def test_a_raising_trainer_keeps_serving_and_loses_no_sample(target, tokenizer, tmp_path, monkeypatch):
    def broken_train(self, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(rounds_module.OPDTrainer, "train", broken_train)
    config = _config(tmp_path, background=True, max_consecutive_failures=2)
    with OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, config) as adapter:
        _serve(adapter, tokenizer, target, prompts(16, seed=5))
        deadline = time.monotonic() + 60
        while adapter.status["trainer"] == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        _serve(adapter, tokenizer, target, prompts(8, seed=6))  # serving goes on with the initial drafter
    status = adapter.status
    assert status["trainer"] == "failed" and "illegal memory access" in status["trainer_error"]
    assert status["versions"] == {} and status["buffered"] == 24  # every served sample is still buffered
    assert [e["consecutive"] for e in adapter.metrics.rows("trainer_error")] == [1, 2]


def _publish_good_version(adapter, tokenizer, target):
    _serve(adapter, tokenizer, target, prompts(16, seed=7))
    adapter.refresh()  # what the next request would do first
    assert adapter.versions == {"drafter": 1}
    return {name: tensor.clone() for name, tensor in adapter.base_drafter.state_dict().items()}


def _republish(adapter, damage):
    """Publishes the served drafter's weights again, then damages the publication with ``damage(publication)``."""
    publication = adapter.store.publish("drafter", lambda d: adapter.base_drafter.save_pretrained(d))
    damage(publication)
    return publication


def _truncate(publication):
    weights = publication.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _wrong_checksum(publication):
    marker = publication.path.parent / "LATEST.json"
    raw = json.loads(marker.read_text())
    raw["sha256"]["model.safetensors"] = "0" * 64
    marker.write_text(json.dumps(raw))


def _truncate_and_rehash(publication):
    from adaflash_hf.online.publishing import file_sha256

    _truncate(publication)
    marker = publication.path.parent / "LATEST.json"
    raw = json.loads(marker.read_text())
    raw["sha256"]["model.safetensors"] = file_sha256(publication.path / "model.safetensors")
    marker.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "does not match its published sha256"),
        (_wrong_checksum, "does not match its published sha256"),
        (_truncate_and_rehash, "Error"),  # checksums agree, but the file is no safetensors file any more
    ],
)
def test_a_bad_publication_keeps_the_last_good_drafter(target, tokenizer, tmp_path, damage, reason):
    adapter = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, _config(tmp_path))
    good = _publish_good_version(adapter, tokenizer, target)
    bad = _republish(adapter, damage)
    _serve(adapter, tokenizer, target, prompts(8, seed=8))  # two requests: the bad version is tried once
    assert adapter.versions == {"drafter": 1}
    assert all(torch.equal(good[n], t) for n, t in adapter.base_drafter.state_dict().items())
    failures = adapter.metrics.rows("swap_failed")
    assert len(failures) == 1 and failures[0]["version"] == bad.version and reason in failures[0]["reason"]
    assert reason in adapter.status["swap_errors"][0]

    fixed = adapter.store.publish("drafter", lambda d: adapter.base_drafter.save_pretrained(d))
    _serve(adapter, tokenizer, target, prompts(4, seed=9))
    assert adapter.versions == {"drafter": fixed.version}  # the next good publication is adopted


def test_restart_after_a_crash_mid_round_resumes_without_losing_samples(target, tokenizer, tmp_path, monkeypatch):
    config = _config(tmp_path)
    adapter = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, config)

    def crash_before_consuming(sample_ids):  # the process dies right after publishing version 1
        raise KeyboardInterrupt

    monkeypatch.setattr(adapter.buffer, "remove", crash_before_consuming)
    batch = tokenizer(prompts(16, seed=10), return_tensors="pt", padding=True)
    for start in range(0, 12, 4):
        adapter.generate(batch.input_ids[start : start + 4], batch.attention_mask[start : start + 4], **GREEDY)
    with pytest.raises(KeyboardInterrupt):
        adapter.generate(batch.input_ids[12:], batch.attention_mask[12:], **GREEDY)
    published = adapter.store.latest("drafter")
    assert published.version == 1 and len(adapter.buffer.sample_ids()) == 16  # published, not yet consumed
    trained = {name: tensor.clone() for name, tensor in adapter.trainer._student.state_dict().items()}

    # A crash inside the next round's training leaves its samples in the buffer.
    restarted = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, config)
    assert len(restarted.buffer) == 0  # recovery finished version 1's consumption
    assert restarted.versions == {"drafter": 1}
    assert all(torch.equal(trained[n], t) for n, t in restarted.base_drafter.state_dict().items())
    monkeypatch.setattr(
        rounds_module.OPDTrainer, "train", lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        _serve(restarted, tokenizer, target, prompts(16, seed=11))
    assert len(restarted.buffer) == 16

    monkeypatch.undo()
    again = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, config)
    again.train_ready_rounds()
    assert again.store.latest("drafter").version == 2 and len(again.buffer) == 0
    requests = read_metrics(tmp_path / "swap" / "metrics.jsonl", "request")
    assert [r["request"] for r in requests] == list(range(32))  # request numbering continues across restarts


# ---------------------------------------------------------------------------------------------- domain adapters


def _domains(texts):
    return ["odd" if text.split()[0] in ("step1", "step3") else "even" for text in texts]


def test_domain_adapters_route_per_row_in_mixed_batches_losslessly(target, tokenizer, tmp_path):
    config = _config(tmp_path, mode="domain_adapters")
    # Loaded from an official-schema checkpoint, as in serving: PEFT re-reads that config when saving adapters.
    synthetic_drafter(target, tokenizer).save_pretrained(tmp_path / "drafter")
    base = AdaFlashDrafter.from_pretrained(tmp_path / "drafter")
    base_weights = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    adapter = OnlineGenerator(target, base, tokenizer, config)
    texts = prompts(96, seed=12)
    _serve(adapter, tokenizer, target, texts, _domains(texts))  # mixed batches throughout
    assert set(adapter.versions) == {"adapter-odd", "adapter-even"} and min(adapter.versions.values()) >= 2
    assert set(adapter.serving_drafter.peft_config) == {"odd", "even"}
    untouched = adapter.serving_drafter.get_base_model().state_dict()
    frozen = {n.replace(".base_layer", ""): t for n, t in untouched.items() if "lora_" not in n}
    assert frozen.keys() == base_weights.keys()
    assert all(torch.equal(base_weights[n], t) for n, t in frozen.items())  # only the adapters were trained

    held_out = prompts(32, seed=13)
    shared = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, _config(tmp_path / "shared"))
    shared.trainer.ready = lambda: []  # the same base drafter, never adapted
    _serve(adapter, tokenizer, target, held_out, _domains(held_out))
    _serve(shared, tokenizer, target, held_out, _domains(held_out))
    for domain in ("odd", "even"):
        own = adapter.metrics.rows("request")[-32:]
        base_rows = shared.metrics.rows("request")
        with_adapter = _by_version(own, domain)
        without = _by_version(base_rows, domain)
        print(domain, "with its adapter", with_adapter, "shared base drafter", without)
        assert list(with_adapter.values())[-1] > without[0] + 0.5


def test_adapter_names_are_checked(target, tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    batch = tokenizer(prompts(2, seed=14), return_tensors="pt", padding=True)
    bare = synthetic_drafter(target, tokenizer)

    def run(drafter, names, policy="fixed"):
        config = GenerationConfig(**GREEDY, adaflash_adapter_names=names, adaflash_length_policy=policy)
        return target.generate(**batch, assistant_model=drafter, generation_config=config)

    with pytest.raises(ValueError, match="needs a PEFT-wrapped drafter"):
        run(bare, ["alpha", "alpha"])
    wrapped = get_peft_model(bare, LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="alpha").eval()
    with pytest.raises(ValueError, match=r"does not hold; it holds \['alpha'\]"):
        run(wrapped, ["alpha", "beta"])
    plain = target.generate(**batch, **GREEDY)
    # the planner's first probes draft one row of the two, with that row's adapter (`AdaFlashCandidateGenerator.probe`)
    for policy in ("fixed", "planned"):
        with pytest.raises(ValueError, match="2 rows"):
            run(wrapped, ["alpha"], policy)
        assert torch.equal(run(wrapped, ["alpha", "__base__"], policy), plain)


def test_online_config_errors_are_clear(tmp_path, target, tokenizer):
    with pytest.raises(ValueError, match="mode='lora' must be one of"):
        OnlineConfig(swap_dir=str(tmp_path), mode="lora")
    with pytest.raises(ValueError, match="a round could never fill"):
        OnlineConfig(swap_dir=str(tmp_path), train_threshold=64, buffer_capacity=10)
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(synthetic_drafter(target, tokenizer), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="needs a bare AdaFlashDrafter"):
        OnlineGenerator(target, wrapped, tokenizer, _config(tmp_path))


def test_a_round_of_responses_too_short_for_a_block_is_consumed_without_a_version(target, tokenizer, tmp_path):
    adapter = OnlineGenerator(target, synthetic_drafter(target, tokenizer), tokenizer, _config(tmp_path))
    batch = tokenizer(prompts(16, seed=15), return_tensors="pt", padding=True)
    for start in range(0, 16, 4):
        short = dict(GREEDY, max_new_tokens=6)  # fewer tokens than the block (8) + 1
        adapter.generate(batch.input_ids[start : start + 4], batch.attention_mask[start : start + 4], **short)
    assert adapter.store.channels() == [] and len(adapter.buffer) == 0
    skipped = adapter.metrics.rows("round_skipped")
    assert len(skipped) == 1 and skipped[0]["samples"] == 16


def test_the_old_name_works_for_one_release_and_warns():
    import adaflash_hf
    import adaflash_hf.online

    with pytest.warns(FutureWarning, match="renamed `OnlineGenerator`"):
        assert adaflash_hf.online.OnlineAdapter is OnlineGenerator
    for _ in range(2):  # every use warns: the top-level lazy export does not cache the old name
        with pytest.warns(FutureWarning, match="renamed `OnlineGenerator`"):
            assert adaflash_hf.OnlineAdapter is OnlineGenerator
