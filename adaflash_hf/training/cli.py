"""`adaflash train --config recipe.yaml`: OPD training from a YAML recipe (see `trainers/*.yaml`).

A recipe has these sections::

    target: Qwen/Qwen3-8B                   # id or path of the target (teacher)
    target_kwargs: {dtype: bfloat16}        # optional, for AutoModelForCausalLM.from_pretrained
    drafter: z-lab/Qwen3-8B-DFlash-b16      # id or path of the drafter to train, or:
    new_drafter: {num_hidden_layers: 1, block_size: 8, mask_token_id: 3, target_layer_ids: [0, 1]}
    add_length_head: false                  # attach a fresh length head before training
    dataset: {path: json, data_files: prompts.jsonl, split: train}   # datasets.load_dataset kwargs
    lora: {r: 16, lora_alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}   # optional
    training: {output_dir: runs/opd, max_steps: 1000, ...}           # OPDConfig fields
    resume_from_checkpoint: null            # a checkpoint dir, or true for the latest in output_dir

Run it on several devices with ``accelerate launch trainers/train_opd.py --config recipe.yaml``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

RECIPE_KEYS = {
    "target",
    "target_kwargs",
    "drafter",
    "new_drafter",
    "add_length_head",
    "dataset",
    "lora",
    "training",
    "resume_from_checkpoint",
}


def load_recipe(path: str | Path) -> dict:
    recipe = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(recipe) - RECIPE_KEYS
    missing = {"target", "dataset", "training"} - set(recipe)
    if unknown or missing or ("drafter" in recipe) == ("new_drafter" in recipe):
        raise ValueError(
            f"Recipe {path}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; it needs `target`, "
            f"`dataset`, `training` and exactly one of `drafter` (a checkpoint) or `new_drafter` (a fresh geometry). "
            f"Allowed keys: {sorted(RECIPE_KEYS)}"
        )
    return recipe


def build_from_recipe(recipe: dict):
    """Returns ``(trainer, resume_from_checkpoint)`` for a loaded recipe."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

    from ..configuration import AdaFlashConfig
    from ..modeling import AdaFlashDrafter
    from .config import OPDConfig
    from .trainer import OPDTrainer

    (args,) = HfArgumentParser(OPDConfig).parse_dict(recipe["training"])
    target = AutoModelForCausalLM.from_pretrained(recipe["target"], **recipe.get("target_kwargs", {}))
    tokenizer = AutoTokenizer.from_pretrained(recipe["target"])
    if "drafter" in recipe:
        drafter = AdaFlashDrafter.from_pretrained(recipe["drafter"])
    else:
        drafter = AdaFlashDrafter(AdaFlashConfig.from_target_config(target.config, **recipe["new_drafter"]))
    if recipe.get("add_length_head") and drafter.length_head is None:
        drafter.add_length_head()
    peft_config = None
    if recipe.get("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(**recipe["lora"])
    dataset = load_dataset(**recipe["dataset"])
    trainer = OPDTrainer(
        model=drafter,
        teacher_model=target,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    return trainer, recipe.get("resume_from_checkpoint")


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of ``adaflash train``: trains, saves the final drafter into ``output_dir`` and pushes it to the
    Hub when ``training.push_to_hub`` is set."""
    parser = argparse.ArgumentParser(prog="adaflash train", description="OPD training of an AdaFlash drafter.")
    parser.add_argument("--config", required=True, help="YAML recipe (see trainers/*.yaml)")
    parser.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="checkpoint dir, or 'true' for the latest one in output_dir (overrides the recipe)",
    )
    options = parser.parse_args(argv)
    trainer, resume = build_from_recipe(load_recipe(options.config))
    if options.resume_from_checkpoint is not None:
        resume = True if options.resume_from_checkpoint.lower() == "true" else options.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    trainer.create_model_card()
    if trainer.args.push_to_hub:
        trainer.push_to_hub()
    return 0
