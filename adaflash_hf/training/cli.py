"""`adaflash train`: OPD training of an AdaFlash drafter, parsed exactly like TRL's own training scripts.

One parser, `trl.TrlParser.parse_args_and_config`, reads a YAML recipe (``--config``) whose keys are the fields of
four dataclasses, and command-line overrides of any of them, given as ``field=value`` or ``--field value``:

* `OPDScriptArguments`: the drafter to start from when it is not a checkpoint (``new_drafter``), ``add_length_head``;
* `OPDConfig`: every training field, including TRL's ``teacher_model_name_or_path`` / ``teacher_model_init_kwargs``
  (the target) and transformers' ``output_dir``, ``max_steps`` and ``resume_from_checkpoint``;
* `trl.ModelConfig`: ``model_name_or_path`` (the drafter checkpoint to train) and the LoRA fields
  (``use_peft``, ``lora_r``, ``lora_alpha``, ``lora_target_modules``, ``lora_modules_to_save``, ...);
* `trl.DatasetMixtureConfig`: ``datasets``, a list of `datasets.load_dataset` specs (``path``, ``data_files``,
  ``split``, ...) whose rows hold ``prompt`` or ``messages``.

::

    adaflash train --config trainers/adaflash_qwen3_8b.yaml
    adaflash train --config trainers/adaflash_qwen3_8b.yaml max_steps=5 learning_rate=1e-4
    adaflash train --config trainers/adaflash_qwen3_8b.yaml --resume_from_checkpoint true   # latest checkpoint
    accelerate launch --num_processes 2 trainers/train_opd.py --config trainers/adaflash_qwen3_8b.yaml
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DatasetMixtureConfig, ModelConfig, TrlParser, get_dataset, get_peft_config

from ..configuration import AdaFlashConfig
from ..modeling import AdaFlashDrafter
from .config import OPDConfig
from .trainer import OPDTrainer

_OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


@dataclass
class OPDScriptArguments:
    """What `adaflash train` needs beyond `OPDConfig`, `trl.ModelConfig` and `trl.DatasetMixtureConfig`."""

    new_drafter: dict | str | None = field(
        default=None,
        metadata={
            "help": "Train a fresh drafter instead of `model_name_or_path`: keyword arguments of "
            "`AdaFlashConfig.from_target_config` (a dict in YAML, JSON on the command line), e.g. "
            '{"num_hidden_layers": 1, "block_size": 16, "mask_token_id": 151669}.'
        },
    )
    add_length_head: bool = field(
        default=False, metadata={"help": "Attach a fresh adaptive length head (if the drafter has none) and train it."}
    )

    def __post_init__(self):
        if isinstance(self.new_drafter, str):
            self.new_drafter = json.loads(self.new_drafter)


def make_parser(prog: str = "adaflash train") -> TrlParser:
    return TrlParser((OPDScriptArguments, OPDConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def _as_flags(argv: list[str]) -> list[str]:
    """``field=value`` overrides become ``--field value``, the form `TrlParser` (argparse) reads."""
    flags = []
    for token in argv:
        match = _OVERRIDE.match(token)
        flags += ["--" + match.group(1), match.group(2)] if match else [token]
    return flags


def parse_args(argv: list[str] | None = None):
    """``(script_args, training_args, model_args, dataset_args)`` from a recipe and command-line overrides."""
    script_args, training_args, model_args, dataset_args = make_parser().parse_args_and_config(
        _as_flags(list(argv or []))
    )
    problems = []
    if (model_args.model_name_or_path is None) == (script_args.new_drafter is None):
        problems.append(
            "give exactly one of `model_name_or_path` (a drafter checkpoint to train) and `new_drafter` "
            "(the geometry of a fresh one)"
        )
    if training_args.teacher_model_name_or_path is None:
        problems.append("`teacher_model_name_or_path` (the target) is required")
    if not dataset_args.datasets:
        problems.append("`datasets` is required: a list like [{path: json, data_files: prompts.jsonl}]")
    if problems:
        raise ValueError("adaflash train: " + "; ".join(problems) + " (see trainers/*.yaml)")
    if str(training_args.resume_from_checkpoint).lower() == "true":
        training_args.resume_from_checkpoint = True  # Trainer.train: True = the latest checkpoint in output_dir
    return script_args, training_args, model_args, dataset_args


def build_trainer(script_args, training_args, model_args, dataset_args) -> OPDTrainer:
    """The target, its tokenizer, the drafter (a checkpoint or a fresh one), the dataset and optional LoRA."""
    target_name = training_args.teacher_model_name_or_path
    target = AutoModelForCausalLM.from_pretrained(target_name, **(training_args.teacher_model_init_kwargs or {}))
    tokenizer = AutoTokenizer.from_pretrained(target_name)
    if model_args.model_name_or_path is not None:
        drafter = AdaFlashDrafter.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    else:
        drafter = AdaFlashDrafter(AdaFlashConfig.from_target_config(target.config, **script_args.new_drafter))
    if script_args.add_length_head and drafter.length_head is None:
        drafter.add_length_head()
    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        peft_config.task_type = None  # the drafter is not a causal LM: PEFT wraps it as a plain PeftModel
    dataset = get_dataset(dataset_args)["train"]
    if not isinstance(dataset, Dataset):
        raise TypeError(f"adaflash train needs a map-style dataset, got {type(dataset).__name__} (streaming=false)")
    return OPDTrainer(
        model=drafter,
        teacher_model=target,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of ``adaflash train`` and ``trainers/train_opd.py``: trains (resuming when
    ``resume_from_checkpoint`` is set), saves the final drafter and its model card into ``output_dir``, and pushes
    it to the Hub when ``push_to_hub`` is set."""
    script_args, training_args, model_args, dataset_args = parse_args(argv)
    trainer = build_trainer(script_args, training_args, model_args, dataset_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.create_model_card()
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return 0
