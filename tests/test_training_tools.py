"""Offline length-head initialisation, the YAML recipe CLI and the rollout helpers."""

import json

import pytest
import torch
import yaml
from datasets import Dataset
from synthetic import opd_args, prompts, synthetic_drafter
from transformers import GenerationConfig

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.training.cli import load_recipe, train_main
from adaflash_hf.training.length_head import LengthHeadInitConfig, init_length_head
from adaflash_hf.training.rollouts import RolloutStore, collate_sequences, encode_dataset, generate_completions


def test_length_head_init_fits_only_the_head(target, tokenizer):
    drafter = synthetic_drafter(target, tokenizer)
    frozen = {n: p.clone() for n, p in drafter.named_parameters()}
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts(16)]
    config = GenerationConfig(max_new_tokens=24, do_sample=False, pad_token_id=0)
    pairs = list(zip(prompt_ids, generate_completions(target, prompt_ids, config, pad_token_id=0)))
    errors = init_length_head(
        drafter,
        target,
        pairs,
        pad_token_id=0,
        config=LengthHeadInitConfig(num_anchors=16, epochs=8, batch_size=8, learning_rate=1e-2),
    )
    assert drafter.length_head is not None and drafter.config.use_length_head
    assert errors[-1] < errors[0] / 2
    assert all(torch.equal(p, frozen[n]) for n, p in drafter.named_parameters() if not n.startswith("thresh_head"))


def test_collate_marks_only_response_tokens_and_truncates():
    batch = collate_sequences([([5, 6], [7, 8, 9]), ([5], [7])], pad_token_id=0, max_length=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [5, 7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_encode_dataset_handles_pairs_and_conversations(tokenizer):
    pairs = encode_dataset(Dataset.from_dict({"prompt": ["step1 n1"], "response": ["n2 n3"]}), tokenizer)
    assert pairs[0]["prompt_ids"] == tokenizer("step1 n1")["input_ids"]
    assert pairs[0]["completion_ids"] == tokenizer("n2 n3")["input_ids"]
    chats = encode_dataset(
        Dataset.from_dict(
            {"messages": [[{"role": "user", "content": "step1 n1"}, {"role": "assistant", "content": "n2 n3"}]]}
        ),
        tokenizer,
    )
    assert chats[0]["prompt_ids"] == tokenizer("step1 n1 ")["input_ids"]
    assert chats[0]["completion_ids"] == tokenizer("n2 n3")["input_ids"]


def test_rollout_store_writes_each_round_once(tmp_path):
    store = RolloutStore(tmp_path, fingerprint="abc")
    first = store.load_or_generate(0, lambda: Dataset.from_dict({"completion_ids": [[1, 2]]}))
    again = store.load_or_generate(0, lambda: pytest.fail("round 0 regenerated"))
    assert first["completion_ids"] == again["completion_ids"] == [[1, 2]]
    assert [p.name for p in tmp_path.iterdir()] == ["round-00000"]  # no staging directory left behind
    with pytest.raises(ValueError, match="other prompts or generation settings"):
        RolloutStore(tmp_path, fingerprint="xyz").load_or_generate(0, lambda: pytest.fail("regenerated"))


def test_train_main_runs_a_yaml_recipe(target, tokenizer, tmp_path):
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(8)))
    recipe = {
        "target": str(tmp_path / "target"),
        "new_drafter": {
            "num_hidden_layers": 1,
            "block_size": 8,
            "mask_token_id": tokenizer.mask_token_id,
            "target_layer_ids": [0, 1],
        },
        "add_length_head": True,
        "dataset": {"path": "json", "data_files": str(tmp_path / "prompts.jsonl"), "split": "train"},
        "training": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "bf16": False,
            "use_cpu": True,
            "report_to": [],
            "max_completion_length": 24,
            "num_anchors": 16,
            "save_strategy": "no",
            "disable_tqdm": True,
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert train_main(["--config", str(path)]) == 0
    drafter = AdaFlashDrafter.from_pretrained(tmp_path / "run")
    assert drafter.config.block_size == 8 and drafter.length_head is not None
    assert "measured mean acceptance length" in (tmp_path / "run" / "README.md").read_text()

    path.write_text(yaml.safe_dump({**recipe, "drafter": "x"}))
    with pytest.raises(ValueError, match="exactly one of `drafter`"):
        load_recipe(path)


def _stepwise_acceptance(target, drafter, prompt, completion):
    """Greedy speculative decoding replayed one step at a time with the drafter's inference view (no block mask):
    context = target features before the anchor, block = [anchor, mask * (bs - 1)]."""
    from adaflash_hf.training.features import target_features

    sequence = torch.tensor([prompt + completion])
    features = target_features(target, sequence, torch.ones_like(sequence), drafter.config.target_layer_ids)
    bs, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    lengths, anchor, end = [], len(prompt), sequence.shape[1] - 1
    while anchor < end:
        block = torch.tensor([[sequence[0, anchor].item()] + [mask_id] * (bs - 1)])
        hidden = drafter(
            noise_embeds=target.get_input_embeddings()(block),
            context_hidden_states=features.context[:, :anchor],
            position_ids=torch.arange(anchor + bs)[None],
        ).last_hidden_state
        drafts = target.lm_head(hidden)[0, 1:].argmax(-1).tolist()
        accepted = 0
        while (
            accepted < bs - 1
            and anchor + accepted + 1 <= end
            and drafts[accepted] == sequence[0, anchor + accepted + 1]
        ):
            accepted += 1
        step = min(accepted + 1, end - anchor)
        lengths.append(step)
        anchor += step
    return lengths


def test_measured_acceptance_equals_a_teacher_forced_stepwise_replay(target, tokenizer, tmp_path):
    from adaflash_hf.training import OPDTrainer, measure_acceptance

    # A partly trained drafter, so that blocks are accepted to different depths.
    drafter = synthetic_drafter(target, tokenizer)
    args = opd_args(tmp_path, max_steps=30, max_completion_length=24, num_anchors=32, seed=42)
    OPDTrainer(
        model=drafter,
        teacher_model=target,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts(16)}),
        processing_class=tokenizer,
    ).train()
    drafter.eval()
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts(4, seed=3)]
    config = GenerationConfig(max_new_tokens=20, do_sample=False, pad_token_id=0)
    completions = generate_completions(target, prompt_ids, config, pad_token_id=0)
    stats = measure_acceptance(target, drafter, prompt_ids, max_new_tokens=20, pad_token_id=0)
    with torch.no_grad():
        stepwise = [n for p, c in zip(prompt_ids, completions) for n in _stepwise_acceptance(target, drafter, p, c)]
    assert len(set(stepwise)) > 2  # the comparison covers short and long accepted runs
    assert stats.num_steps == len(stepwise)
    assert stats.mean_acceptance_length == pytest.approx(sum(stepwise) / len(stepwise))
