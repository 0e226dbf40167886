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

    adaflash train --config examples/scripts/adaflash_qwen3_8b.yaml
    adaflash train --config examples/scripts/adaflash_qwen3_8b.yaml max_steps=5 learning_rate=1e-4
    adaflash train --config examples/scripts/adaflash_qwen3_8b.yaml --resume_from_checkpoint true  # the latest
    accelerate launch --num_processes 2 examples/scripts/train_opd.py \
        --config examples/scripts/adaflash_qwen3_8b.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DatasetMixtureConfig, ModelConfig, TrlParser, get_dataset, get_peft_config

from ..configuration import AdaFlashConfig
from ..modeling import AdaFlashDrafter
from ..utils import CommandError
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


DATACLASS_TYPES = (OPDScriptArguments, OPDConfig, ModelConfig, DatasetMixtureConfig)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str = "adaflash train") -> TrlParser:
    """The `train` parser, registered as TRL's scripts register theirs: a sub-command of ``subparsers`` (created
    with ``parser_class=TrlParser``, as `adaflash`'s are) or, without it, a parser of its own (the scripts)."""
    if subparsers is None:
        return TrlParser(DATACLASS_TYPES, prog=prog)
    parser = subparsers.add_parser(
        "train",
        help="OPD training from a YAML recipe (examples/scripts/*.yaml), with field=value overrides; --help lists "
        "the fields",
        description=__doc__.split("\n\n")[0],
        dataclass_types=DATACLASS_TYPES,
    )
    parser.set_defaults(func=_train_command)
    return parser


def field_overrides(argv: list[str], names: set[str]) -> list[str]:
    """``field=value`` overrides become ``--field value``, the form `TrlParser` (argparse) reads; only tokens that
    name one of ``names`` (the dataclass fields), so a value such as a path holding ``=`` is left as it is."""
    flags = []
    for token in argv:
        match = _OVERRIDE.match(token)
        flags += ["--" + match.group(1), match.group(2)] if match and match.group(1) in names else [token]
    return flags


def field_names(dataclass_types) -> set[str]:
    return {f.name for dtype in dataclass_types for f in dataclasses.fields(dtype) if f.init}


def from_namespace(namespace: argparse.Namespace, dataclass_types) -> tuple:
    """The dataclasses of a sub-command's parsed arguments, as `HfArgumentParser.parse_args_into_dataclasses` builds
    them for a parser of its own."""
    values = vars(namespace)
    return tuple(
        dtype(**{f.name: values[f.name] for f in dataclasses.fields(dtype) if f.init and f.name in values})
        for dtype in dataclass_types
    )


def parse_args(argv: list[str] | None = None):
    """``(script_args, training_args, model_args, dataset_args)`` from a recipe and command-line overrides."""
    parsed = make_parser().parse_args_and_config(field_overrides(list(argv or []), field_names(DATACLASS_TYPES)))
    return check_args(*parsed)


def check_args(script_args, training_args, model_args, dataset_args):
    """Names every missing piece of a training run at once, before any model loads."""
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
        raise ValueError("; ".join(problems) + " (see examples/scripts/*.yaml)")
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
    """Entry point of ``examples/scripts/train_opd.py`` (``adaflash train`` parses the same fields as a
    sub-command): trains, resuming when ``resume_from_checkpoint`` is set, saves the final drafter and its model card
    into ``output_dir``, and pushes it to the Hub when ``push_to_hub`` is set."""
    return train(*parse_args(argv))


def _train_command(namespace: argparse.Namespace) -> int:
    try:
        parsed = check_args(*from_namespace(namespace, DATACLASS_TYPES))
    except ValueError as error:  # a missing field, or `new_drafter` that is not JSON
        raise CommandError(str(error)) from None
    return train(*parsed)


def train(script_args, training_args, model_args, dataset_args) -> int:
    trainer = build_trainer(script_args, training_args, model_args, dataset_args)
    run_training(trainer, training_args)
    end_training(trainer)
    return 0


def end_training(trainer: OPDTrainer) -> None:
    """Ends a run that trained and saved: under `accelerate launch` a process that exits with its gloo group alive can
    abort in the interpreter's teardown (the group's worker threads outlive Python), so every rank waits for the
    others and then destroys its process group. Not after an exception: a rank that destroys its group while
    another is still in a collective would hang both."""
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


def run_training(trainer: OPDTrainer, training_args) -> None:
    """Trains (resuming when ``resume_from_checkpoint`` is set), saves the final drafter and its model card, and
    pushes it when ``push_to_hub`` is set; the process group stays up for the caller."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.create_model_card()
    if training_args.push_to_hub:
        trainer.push_to_hub()
