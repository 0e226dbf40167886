"""OPDTrainer end to end on the synthetic language: acceptance gain, checkpoints, resume, LoRA, length head, errors."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from synthetic import opd_args, prompts, synthetic_drafter
from transformers import TrainerCallback

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.training import OPDTrainer, measure_acceptance
from adaflash_hf.training import rollouts as rollouts_module

COMPLETION = 32  # synthetic.opd_args' max_completion_length


@pytest.fixture(scope="module")
def eval_prompts(tokenizer):
    return [tokenizer(p)["input_ids"] for p in prompts(8, seed=1)]


def _trainer(target, tokenizer, args, drafter=None, dataset=None, **kwargs):
    drafter = drafter if drafter is not None else synthetic_drafter(target, tokenizer)
    dataset = dataset if dataset is not None else Dataset.from_dict({"prompt": prompts(32)})
    return OPDTrainer(
        model=drafter, teacher_model=target, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs
    )


def _acceptance(target, drafter, prompts_ids):
    return measure_acceptance(
        target, drafter.eval(), prompts_ids, max_new_tokens=COMPLETION, pad_token_id=0, eos_token_id=1
    ).mean_acceptance_length


def test_opd_training_raises_acceptance_and_the_checkpoint_reloads(target, tokenizer, eval_prompts, tmp_path):
    drafter = synthetic_drafter(target, tokenizer)
    before = _acceptance(target, drafter, eval_prompts)
    args = opd_args(tmp_path, max_steps=100, logging_steps=20, save_strategy="steps", save_steps=100)
    trainer = _trainer(target, tokenizer, args, drafter=drafter)
    trainer.train()
    after = _acceptance(target, drafter, eval_prompts)
    print(f"mean acceptance length before {before:.3f} after {after:.3f}")
    assert before < 1.5 and after >= 3.0
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for p in target.parameters())

    checkpoint = tmp_path / "checkpoint-100"
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    reloaded = AdaFlashDrafter.from_pretrained(checkpoint)
    assert _acceptance(target, reloaded, eval_prompts) == pytest.approx(after)
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {
        "loss/ce",
        "loss/reverse_kl",
        "loss/clip_ratio",
        "draft_accuracy",
        "acceptance_length",
        "step_acceptance_length",
    } <= logged
    # the harmonic mean of the blocks (a lower estimate of the loop's): never above their anchor average, above 1 once
    # the drafter learns
    pairs = [(e["step_acceptance_length"], e["acceptance_length"]) for e in trainer.state.log_history if "loss" in e]
    assert all(1.0 <= step <= mean + 1e-6 for step, mean in pairs) and pairs[-1][0] > 1.0
    assert (tmp_path / "rollouts" / "round-00000").is_dir()
    card = (tmp_path / "README.md").read_text()
    assert "block size | 8" in card and "loss_type=opd" in card and "2306.13649" in card  # the `_paper` citation


@pytest.mark.parametrize("loss_type", ["opd", "ce", "fkl"])
def test_every_loss_type_trains_on_offline_pairs(target, tokenizer, tmp_path, loss_type):
    texts = prompts(16)
    # Offline pairs: the target's own continuations as plain text responses.
    pairs = Dataset.from_dict(
        {
            "prompt": texts,
            "completion": [" ".join(tokenizer.decode(ids).split()) for ids in _greedy(target, tokenizer, texts)],
        }
    )
    trainer = _trainer(
        target, tokenizer, opd_args(tmp_path, loss_type=loss_type, max_steps=12, logging_steps=2), dataset=pairs
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]
    assert not (tmp_path / "rollouts").exists()  # offline data is never regenerated


def test_token_id_pairs_train_under_bf16_and_leave_the_callers_target_untouched(target, tokenizer, tmp_path):
    texts = prompts(8)
    prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
    pairs = Dataset.from_dict({"prompt_ids": prompt_ids, "completion_ids": _greedy(target, tokenizer, texts)})
    probe = torch.tensor(prompt_ids)
    with torch.no_grad():
        before = target(probe).logits
    trainer = _trainer(target, tokenizer, opd_args(tmp_path, bf16=True, max_steps=2), dataset=pairs)
    trainer.train()
    # accelerate wraps a bf16 run's models in autocast; the target the caller serves with must not stay wrapped.
    assert "forward" not in vars(target) and not hasattr(target, "_original_forward")
    with torch.no_grad():
        assert torch.equal(target(probe).logits, before)


def _greedy(target, tokenizer, texts):
    ids = [tokenizer(t)["input_ids"] for t in texts]
    config = rollouts_module.GenerationConfig(max_new_tokens=COMPLETION, do_sample=False, pad_token_id=0)
    return rollouts_module.generate_completions(target, ids, config, pad_token_id=0)


class _Interrupt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 7:
            raise KeyboardInterrupt


def test_resume_continues_exactly_from_the_checkpoint_without_regenerating(target, tokenizer, tmp_path, monkeypatch):
    reference = _trainer(target, tokenizer, opd_args(tmp_path / "reference", save_strategy="steps", save_steps=5))
    reference.train()

    interrupted_dir = tmp_path / "interrupted"
    args = opd_args(interrupted_dir, save_strategy="steps", save_steps=5)
    with pytest.raises(KeyboardInterrupt):
        _trainer(target, tokenizer, args, callbacks=[_Interrupt()]).train()
    assert (interrupted_dir / "checkpoint-5").is_dir() and not (interrupted_dir / "checkpoint-10").exists()

    def no_generation(*a, **k):
        raise AssertionError("rollouts were regenerated on resume")

    monkeypatch.setattr("adaflash_hf.training.trainer.generate_completions", no_generation)
    resumed = _trainer(target, tokenizer, args)
    resumed.train(resume_from_checkpoint=str(interrupted_dir / "checkpoint-5"))
    assert resumed.state.global_step == 10
    ref_state, new_state = reference.model.state_dict(), resumed.model.state_dict()
    for name, value in ref_state.items():
        assert torch.allclose(value, new_state[name], atol=1e-6), name
    ref_opt, new_opt = reference.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.allclose(ref_opt[k]["exp_avg"], new_opt[k]["exp_avg"], atol=1e-6) for k in ref_opt)


def test_lora_adapters_train_save_reload_and_hotswap(target, tokenizer, eval_prompts, tmp_path):
    from peft import LoraConfig, PeftModel
    from peft.utils.hotswap import hotswap_adapter

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    args = opd_args(tmp_path, max_steps=20, save_strategy="steps", save_steps=20)
    trainer = _trainer(target, tokenizer, args, peft_config=lora)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-20"
    assert (checkpoint / "adapter_config.json").exists() and (checkpoint / "adapter_model.safetensors").exists()
    trained = trainer.model.eval()
    base_before = synthetic_drafter(target, tokenizer)
    base_after = {
        n.replace(".base_layer", ""): p for n, p in trained.get_base_model().named_parameters() if "lora_" not in n
    }
    assert all(torch.equal(base_after[n], p) for n, p in base_before.named_parameters())  # only adapters train

    reloaded = PeftModel.from_pretrained(synthetic_drafter(target, tokenizer), checkpoint).eval()
    assert _acceptance(target, reloaded, eval_prompts) == pytest.approx(_acceptance(target, trained, eval_prompts))

    fresh = PeftModel.from_pretrained(synthetic_drafter(target, tokenizer), checkpoint).eval()
    with torch.no_grad():
        for name, param in fresh.named_parameters():
            if "lora_B" in name:
                param.zero_()
    hotswap_adapter(fresh, str(checkpoint), adapter_name="default")
    assert _acceptance(target, fresh, eval_prompts) == pytest.approx(_acceptance(target, trained, eval_prompts))


def test_length_head_trains_in_its_own_parameter_group(target, tokenizer, tmp_path):
    drafter = synthetic_drafter(target, tokenizer, use_length_head=True)
    head_before = {n: p.clone() for n, p in drafter.length_head.named_parameters()}
    trainer = _trainer(target, tokenizer, opd_args(tmp_path, max_steps=6, logging_steps=2), drafter=drafter)
    trainer.train()
    lrs = sorted(group["lr"] for group in trainer.optimizer.param_groups)
    assert lrs == [2e-4, 3e-3]
    assert any(not torch.equal(p, head_before[n]) for n, p in drafter.length_head.named_parameters())
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"length_head/mae", "loss/length_head"} <= logged


def test_frozen_length_head_under_lora_is_a_clear_error(target, tokenizer, tmp_path):
    from peft import LoraConfig

    drafter = synthetic_drafter(target, tokenizer, use_length_head=True)
    with pytest.raises(ValueError, match="modules_to_save"):
        _trainer(
            target,
            tokenizer,
            opd_args(tmp_path),
            drafter=drafter,
            peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
        )


def test_bad_inputs_raise_one_clear_error(target, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="`prompt` or `messages`"):
        _trainer(target, tokenizer, opd_args(tmp_path), dataset=Dataset.from_dict({"text": ["step1 n1"]}))
    with pytest.raises(ValueError, match="use_vllm"):
        opd_args(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="block_size"):
        _trainer(target, tokenizer, opd_args(tmp_path, block_size=4))
    other = synthetic_drafter(target, tokenizer)
    other.config.hidden_size = 32
    with pytest.raises(ValueError, match="incompatible: hidden size"):
        _trainer(target, tokenizer, opd_args(tmp_path), drafter=other)
    short = Dataset.from_dict({"prompt": ["step1 n1"], "completion": ["n2"]})
    trainer = _trainer(
        target, tokenizer, opd_args(tmp_path, max_steps=1, per_device_train_batch_size=1), dataset=short
    )
    with pytest.raises(ValueError, match="too short|no anchor"):
        trainer.train()


def test_messages_prompts_use_the_chat_template_and_rollouts_are_cached(target, tokenizer, tmp_path):
    dataset = Dataset.from_dict({"messages": [[{"role": "user", "content": p}] for p in prompts(8)]})
    args = opd_args(tmp_path, max_steps=2)
    trainer = _trainer(target, tokenizer, args, dataset=dataset)
    assert trainer.train_dataset[0]["prompt_ids"] == tokenizer(prompts(8)[0] + " ")["input_ids"]
    trainer.train()
    cached = trainer._rollout_store.load_or_generate(0, lambda: pytest.fail("round 0 regenerated"))
    assert len(cached) == 8 and len(cached[0]["completion_ids"]) == COMPLETION
    other = Dataset.from_dict({"messages": [[{"role": "user", "content": p}] for p in prompts(8, seed=5)]})
    with pytest.raises(ValueError, match="rollouts of other prompts or generation settings"):
        _trainer(target, tokenizer, opd_args(tmp_path, max_steps=4), dataset=other).train()


def test_evaluate_on_pairs_and_push_to_hub_uploads_the_hub_format_with_our_card(
    target, tokenizer, tmp_path, monkeypatch
):
    pairs = Dataset.from_dict({"prompt": prompts(4), "completion": ["n1 n2 n3 n4 n5 n6 n7 n8 n9 n10 n11"] * 4})
    args = opd_args(tmp_path, max_steps=2, hub_model_id="someone/tiny-drafter", per_device_eval_batch_size=2)
    trainer = _trainer(target, tokenizer, args, eval_dataset=pairs)
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "eval_acceptance_length" in metrics
    with pytest.raises(ValueError, match="eval_dataset needs prompt/response pairs"):
        _trainer(target, tokenizer, args, eval_dataset=Dataset.from_dict({"prompt": prompts(2)}))

    uploaded = {}

    def fake_upload_folder(repo_id, folder_path, **kwargs):
        uploaded.update({p.name: p.read_text() for p in Path(folder_path).iterdir() if p.suffix in (".json", ".md")})
        return "commit"

    class FakeApi:  # records the upload instead of reaching the Hub
        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            return fake_upload_folder(repo_id, folder_path)

    monkeypatch.setattr("transformers.trainer.hf_api", FakeApi)
    trainer.push_to_hub()
    assert json.loads(uploaded["config.json"])["architectures"] == ["DFlashDraftModel"]
    assert "someone/tiny-drafter" in uploaded["README.md"] and "loss_type=opd" in uploaded["README.md"]


def test_rollouts_are_refreshed_every_rollout_refresh_steps(target, tokenizer, tmp_path):
    trainer = _trainer(
        target,
        tokenizer,
        opd_args(tmp_path, max_steps=7, rollout_refresh_steps=3),
        dataset=Dataset.from_dict({"prompt": prompts(8)}),
    )
    trainer.train()
    rounds = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert rounds == ["round-00000", "round-00001", "round-00002"]  # steps 0-2, 3-5, 6


def test_rollouts_are_drafted_by_the_current_drafter_and_unchanged(target, tokenizer, tmp_path):
    import adaflash_hf

    dataset = Dataset.from_dict({"prompt": prompts(8)})
    speculative = _trainer(target, tokenizer, opd_args(tmp_path / "a", rollout_with_drafter=True), dataset=dataset)
    with adaflash_hf.record_stats() as stats:
        drafted = speculative._generate_rollouts()["completion_ids"]
    plain = _trainer(target, tokenizer, opd_args(tmp_path / "b", rollout_with_drafter=False), dataset=dataset)
    with adaflash_hf.record_stats() as no_stats:
        reference = plain._generate_rollouts()["completion_ids"]
    assert drafted == reference
    assert stats.verification_steps > 0 and no_stats.verification_steps == 0
    assert speculative.model.training  # the drafter goes back to training mode


def test_the_private_trl_and_accelerate_internals_are_checked_at_import(monkeypatch):
    from adaflash_hf.training import trainer

    assert trainer.missing_internals() == []  # the tested versions have them all

    class RenamedTrainer:
        def __init__(self, processing_class):
            self._tokenizer = processing_class
            self.eos_token_ids = []
            self.metrics = {}  # renamed: OPDTrainer logs into `_metrics`

    def prepare_model(model):
        return model

    missing = trainer.missing_internals(RenamedTrainer, prepare_model)
    assert missing[0] == "trl RenamedTrainer: self._metrics ="
    assert (
        "accelerate test_the_private_trl_and_accelerate_internals_are_checked_at_import.<locals>.prepare_model: "
        "_original_forward" in missing
    )
    monkeypatch.setattr(trainer, "missing_internals", lambda: missing)
    with pytest.warns(UserWarning, match="tested with trl 1.16 and accelerate 1.15"):
        trainer._warn_if_internals_changed()
