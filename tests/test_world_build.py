"""End-to-end demo-world build at toy sizes: determinism, held-out separation, prompt files, offline reloading."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from adaflash_demo.world import (
    DOMAINS,
    UNSEEN_DOMAIN,
    ArDraftConfig,
    CausalLMShape,
    CorpusConfig,
    CorpusError,
    DrafterConfig,
    EvaluationConfig,
    LMTrainingConfig,
    PromptConfig,
    StreamConfig,
    TargetConfig,
    TokenizerConfig,
    WorldConfig,
    WorldLayout,
    build_corpus,
    build_world,
    evaluate_heldout,
    heldout_windows,
    is_heldout,
    load_documents,
    load_prompts,
    load_stream,
    load_world_model,
    load_world_tokenizer,
    world_artifact,
)
from adaflash_demo.world.lm_training import learning_rate_at
from adaflash_demo.world.packing import load_streams
from adaflash_hf import AdaFlashDrafter

TINY_SHAPE = CausalLMShape(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=256,
)
PROMPT_TOKENS = 32


def tiny_world(seed: int) -> WorldConfig:
    training = dict(batch_size=4, seq_len=32, warmup_steps=2)
    return WorldConfig(
        seed=seed,
        corpus=CorpusConfig(
            max_chars_per_domain=60_000,
            max_chars_per_file=3_000,
            prose_chunk_chars=2_000,
            heldout_percent=20,
            max_gcloud_man_pages=5,
        ),
        tokenizer=TokenizerConfig(vocab_size=512),
        prompts=PromptConfig(prompts_per_domain=3, prompt_tokens=PROMPT_TOKENS),
        stream=StreamConfig(prompts_per_domain=3, heldout_prompts=2, prompt_tokens=PROMPT_TOKENS),
        target=TargetConfig(shape=TINY_SHAPE, training=LMTrainingConfig(max_steps=6, **training)),
        ar_draft=ArDraftConfig(
            shape=CausalLMShape(**{**TINY_SHAPE.__dict__, "num_hidden_layers": 1}),
            training=LMTrainingConfig(max_steps=3, **training),
        ),
        evaluation=EvaluationConfig(seq_len=32, windows_per_domain=2, batch_size=2),
        drafter=DrafterConfig(
            block_size=4,
            target_layer_ids=[0, 1],
            length_head_bottleneck_dim=8,
            prompts_per_domain=2,
            prompt_tokens=16,
            completion_tokens=8,
            batch_size=2,
            num_anchors=2,
            max_steps=2,
            eval_new_tokens=8,
        ),
    )


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Two full builds with seed 0, and a seed-1 build up to the target, each with its report."""
    built = {}
    for name, seed, stages in (
        ("first", 0, None),
        ("second", 0, None),
        ("other_seed", 1, ("corpus", "tokenizer", "target")),
    ):
        layout = WorldLayout(tmp_path_factory.mktemp(name))
        kwargs = {} if stages is None else {"stages": stages}
        built[name] = (layout, build_world(tiny_world(seed), layout.root, ship_dir=layout.root / "shipped", **kwargs))
    return built


def test_same_seed_gives_identical_corpus_tokenizer_and_training(worlds):
    (first, first_report), (second, second_report) = worlds["first"], worlds["second"]
    for domain in DOMAINS:
        for split in ("train", "heldout"):
            assert (first.corpus / f"{domain}.{split}.jsonl").read_bytes() == (
                second.corpus / f"{domain}.{split}.jsonl"
            ).read_bytes()
    assert (first.tokenizer / "tokenizer.json").read_bytes() == (second.tokenizer / "tokenizer.json").read_bytes()
    first_training, second_training = (
        first_report["stages"]["target"]["training"],
        second_report["stages"]["target"]["training"],
    )
    for key in ("steps", "first_loss", "final_loss_mean_last_20"):
        assert first_training[key] == second_training[key]
    assert (first.target / "model.safetensors").read_bytes() == (second.target / "model.safetensors").read_bytes()


def test_another_seed_gives_another_world(worlds):
    (first, first_report), (other, other_report) = worlds["first"], worlds["other_seed"]
    assert (first.corpus / "math.train.jsonl").read_bytes() != (other.corpus / "math.train.jsonl").read_bytes()
    assert (
        first_report["stages"]["target"]["training"]["first_loss"]
        != other_report["stages"]["target"]["training"]["first_loss"]
    )


def test_heldout_documents_never_reach_training(worlds):
    layout, _ = worlds["first"]
    heldout_percent = tiny_world(0).corpus.heldout_percent
    for domain in DOMAINS:
        train = load_documents(layout.corpus, domain, "train")
        heldout = load_documents(layout.corpus, domain, "heldout")
        assert heldout and train
        assert all(is_heldout(doc.doc_id, heldout_percent) for doc in heldout)
        assert not any(is_heldout(doc.doc_id, heldout_percent) for doc in train)
        train_texts = {doc.text for doc in train}
        assert not any(doc.text in train_texts for doc in heldout)


def test_prompt_files_come_from_heldout_documents(worlds):
    layout, _ = worlds["first"]
    tokenizer = AutoTokenizer.from_pretrained(str(layout.tokenizer))
    for domain in DOMAINS:
        rows = [json.loads(line) for line in (layout.prompts / f"{domain}.jsonl").read_text().splitlines()]
        heldout = {doc.doc_id: doc.text for doc in load_documents(layout.corpus, domain, "heldout")}
        assert len(rows) == 3
        for row in rows:
            assert row["domain"] == domain and row["doc_id"] in heldout
            assert heldout[row["doc_id"]][row["char_offset"] :].startswith(row["prompt"][:20])
            assert len(tokenizer(row["prompt"])["input_ids"]) == row["prompt_tokens"]
            assert PROMPT_TOKENS - 4 <= row["prompt_tokens"] <= PROMPT_TOKENS


def test_streams_cut_training_documents_and_an_unseen_heldout_changelog_split(worlds):
    (first, _), (second, _) = worlds["first"], worlds["second"]
    for domain in DOMAINS:
        rows = load_stream(domain, data_dir=first.root)
        train = {doc.doc_id for doc in load_documents(first.corpus, domain, "train")}
        assert len(rows) == 3 and all(row["doc_id"] in train for row in rows)
    changelog = load_stream(UNSEEN_DOMAIN, data_dir=first.root)
    heldout = load_stream(UNSEEN_DOMAIN, heldout=True, data_dir=first.root)
    assert len(changelog) == 3 and len(heldout) == 2
    assert all(row["doc_id"].startswith("changelog/") for row in changelog + heldout)
    assert not {row["doc_id"] for row in changelog} & {row["doc_id"] for row in heldout}
    for name in (f"{UNSEEN_DOMAIN}.jsonl", f"{UNSEEN_DOMAIN}.heldout.jsonl", "code.jsonl"):
        assert (first.stream / name).read_bytes() == (second.stream / name).read_bytes()  # same seed, same stream
    with pytest.raises(FileNotFoundError, match="the shipped streams are"):
        load_stream("poetry", data_dir=first.root)


def test_saved_world_reloads_offline_and_generates(worlds):
    layout, _ = worlds["first"]
    tokenizer = AutoTokenizer.from_pretrained(str(layout.tokenizer))
    assert (tokenizer.eos_token_id, tokenizer.mask_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    for directory in (layout.target, layout.ar_draft):
        model = AutoModelForCausalLM.from_pretrained(str(directory))
        assert model.dtype == torch.bfloat16
        assert model.config.vocab_size == len(tokenizer)
        assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (0, 2)
        inputs = tokenizer("def main():", return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, min_new_tokens=5)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 5


def test_ar_draft_works_as_a_transformers_assistant(worlds):
    """The bench's classic baseline: greedy assisted generation with the AR draft equals plain greedy (fp32)."""
    layout, _ = worlds["first"]
    tokenizer = AutoTokenizer.from_pretrained(str(layout.tokenizer))
    target = AutoModelForCausalLM.from_pretrained(str(layout.target), dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(str(layout.ar_draft), dtype=torch.float32)
    inputs = tokenizer("Question: Ava has 12 apples.", return_tensors="pt")
    settings = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    plain = target.generate(**inputs, **settings)
    assisted = target.generate(**inputs, assistant_model=draft, **settings)
    assert assisted.tolist() == plain.tolist()


def test_evaluation_windows_span_the_heldout_stream_and_agreement_is_exact(worlds):
    layout, report = worlds["first"]
    stream = load_streams(layout.tokens, "heldout")["math"]
    windows = heldout_windows(stream, seq_len=16, max_windows=5)
    assert windows.shape == (5, 17)
    assert windows[0].tolist() == stream[:17].tolist() and windows[-1].tolist() == stream[-17:].tolist()
    target = AutoModelForCausalLM.from_pretrained(str(layout.target), dtype=torch.float32)
    config = tiny_world(0).evaluation
    metrics = evaluate_heldout(target, {"math": windows}, config, reference=target)["math"]
    assert metrics["target_agreement"] == 1.0
    assert (
        report["stages"]["evaluate"]["target"]["math"]
        == evaluate_heldout(
            target, {"math": heldout_windows(stream, config.seq_len, config.windows_per_domain)}, config
        )["math"]
    )


def test_ship_stage_copies_loadable_artifacts(worlds):
    layout, report = worlds["first"]
    build_world(tiny_world(0), layout.root, stages=("ship",), ship_dir=layout.root / "shipped")
    shipped = layout.root / "shipped"
    assert load_world_tokenizer(shipped).mask_token_id == 1
    assert load_world_model("ar_draft", data_dir=shipped).config.num_hidden_layers == 1
    drafter = AdaFlashDrafter.from_pretrained(shipped / "drafter")
    assert drafter.config.use_length_head and drafter.config.mask_token_id == 1
    assert set(report["stages"]["drafter"]["heldout"]) == set(DOMAINS)
    assert {row["domain"] for row in load_prompts(data_dir=shipped)} == set(DOMAINS)
    assert json.loads((shipped / "report.json").read_text())["stages"]["target"] == report["stages"]["target"]


def test_missing_artifact_names_the_rebuild_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_demo_world.py"):
        load_world_model("target", data_dir=tmp_path)


def test_missing_man_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(
        "adaflash_demo.world.corpus.shutil.which", lambda tool: None if tool == "man" else "/usr/bin/col"
    )
    with pytest.raises(CorpusError, match=r"needs the man command.*apt-get install man-db"):
        build_corpus(CorpusConfig(), seed=0, corpus_dir=tmp_path)


def test_empty_domain_is_one_clear_error(tmp_path):
    config = CorpusConfig(max_chars_per_domain=10_000, stdlib_dir=str(tmp_path))
    with pytest.raises(CorpusError, match="code domain is empty"):
        build_corpus(config, seed=0, corpus_dir=tmp_path / "corpus")


def test_learning_rate_warms_up_then_decays_to_the_floor():
    config = LMTrainingConfig(learning_rate=1.0, warmup_steps=4, final_lr_fraction=0.1)
    assert learning_rate_at(0, 0.0, config) == pytest.approx(0.25)
    assert learning_rate_at(3, 0.0, config) == pytest.approx(1.0)
    assert learning_rate_at(100, 0.5, config) == pytest.approx(0.55)
    assert learning_rate_at(200, 1.0, config) == pytest.approx(0.1)


def test_shipped_world_is_complete_and_consistent():
    """The artifacts in demo/adaflash_demo/world/data load offline and agree on the tokenizer."""
    tokenizer = load_world_tokenizer()
    target, draft = load_world_model("target"), load_world_model("ar_draft")
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer) == 8192
    assert tokenizer.mask_token_id == 1
    drafter = AdaFlashDrafter.from_pretrained(world_artifact("drafter"))
    drafter.check_compatible(target)
    assert drafter.config.mask_token_id == tokenizer.mask_token_id and drafter.config.length_policy == "adaptive"
    for domain in DOMAINS:
        rows = load_prompts(domain)
        assert len(rows) == 32
        assert all(len(tokenizer(row["prompt"])["input_ids"]) == row["prompt_tokens"] for row in rows)
    for domain in (*DOMAINS, UNSEEN_DOMAIN):
        assert len(load_stream(domain)) == 256
    assert len(load_stream(UNSEEN_DOMAIN, heldout=True)) == 32
    report = json.loads(world_artifact("report.json").read_text())
    steps = {stage: report["stages"][stage]["training"]["steps"] for stage in ("target", "ar_draft")}
    assert steps == {"target": 840, "ar_draft": 300} and report["stages"]["drafter"]["steps"] == 950  # pinned
