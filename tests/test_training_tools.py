"""Offline length-head initialisation, the YAML recipe CLI and the rollout helpers."""

import json

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file, save_file
from synthetic import opd_args, prompts, synthetic_drafter
from transformers import GenerationConfig

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.cli import main
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


def write_recipe(directory, target, tokenizer, **fields) -> str:
    """A flat `adaflash train` recipe (examples/scripts/*.yaml style) for a seconds-long CPU run on the synthetic
    target."""
    target.save_pretrained(directory / "target")
    tokenizer.save_pretrained(directory / "target")
    (directory / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(8)))
    recipe = {
        "teacher_model_name_or_path": str(directory / "target"),
        "new_drafter": {
            "num_hidden_layers": 1,
            "block_size": 8,
            "mask_token_id": tokenizer.mask_token_id,
            "target_layer_ids": [0, 1],
        },
        "add_length_head": True,
        "datasets": [{"path": "json", "data_files": str(directory / "prompts.jsonl"), "split": "train"}],
        "output_dir": str(directory / "run"),
        "max_steps": 50,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "bf16": False,
        "use_cpu": True,
        "report_to": [],
        "max_completion_length": 16,
        "num_anchors": 8,
        "logging_steps": 1,
        "save_steps": 2,
        "disable_tqdm": True,
        **fields,
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_adaflash_train_applies_command_line_overrides_and_resumes(target, tokenizer, tmp_path):
    recipe = write_recipe(tmp_path, target, tokenizer)
    run = tmp_path / "run"
    # the recipe asks for 50 steps; the overrides (both spellings) cut it to 2 and change the learning rate
    assert main(["train", "--config", recipe, "max_steps=2", "--learning_rate", "5e-4"]) == 0
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and not (run / "checkpoint-4").exists()
    assert {row["learning_rate"] for row in state["log_history"] if "learning_rate" in row} == {5e-4}
    drafter = AdaFlashDrafter.from_pretrained(run)
    assert drafter.config.block_size == 8 and drafter.length_head is not None
    assert "measured mean acceptance length" in (run / "README.md").read_text()

    # Zero one weight matrix in the checkpoint: a run that resumes trains on from it, a fresh one would not.
    weights = run / "checkpoint-2" / "model.safetensors"
    tensors = load_file(weights)
    tensors["fc.weight"] = torch.zeros_like(tensors["fc.weight"])
    save_file(tensors, weights, metadata={"format": "pt"})
    assert main(["train", "--config", recipe, "max_steps=3", "--resume_from_checkpoint", "true"]) == 0
    assert json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    resumed = AdaFlashDrafter.from_pretrained(run).fc.weight
    assert resumed.abs().max() < 0.01 < drafter.fc.weight.abs().max()  # one AdamW step away from zero


def test_adaflash_train_names_what_a_recipe_lacks(target, tokenizer, tmp_path, capsys):
    recipe = write_recipe(tmp_path, target, tokenizer, model_name_or_path="some/drafter")
    with pytest.raises(SystemExit):
        main(["train", "--config", recipe])
    assert "adaflash train: error: give exactly one of `model_name_or_path`" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a field of none of the four dataclasses, on the command line or in the recipe
        main(["train", "--config", recipe, "no_such_field=1"])
    assert "no_such_field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--config", write_recipe(tmp_path, target, tokenizer, no_such_key=2)])
    assert "no_such_key" in capsys.readouterr().err


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
