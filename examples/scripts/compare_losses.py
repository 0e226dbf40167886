"""Trains the same recipe with `loss_type` opd, ce and fkl (same budget) and compares measured acceptance.

    python examples/scripts/compare_losses.py --eval_data heldout.jsonl --num_eval 64 --config recipe.yaml \
        [field=value ...]

Each run writes to `<output_dir>/<loss_type>`; the table (JSON) goes to stdout and `<output_dir>/comparison.json`.
Acceptance is `adaflash_hf.training.measure_acceptance` (greedy) on the held-out prompts.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from datasets import load_dataset

from adaflash_hf.training import measure_acceptance
from adaflash_hf.training.cli import build_trainer, parse_args
from adaflash_hf.training.rollouts import encode_dataset
from adaflash_hf.utils import write_json_atomic


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval_data", required=True, help="JSON/JSONL file with `prompt` or `messages` rows")
    parser.add_argument("--num_eval", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    options, recipe_args = parser.parse_known_args(argv)  # the rest: --config and overrides, as `adaflash train`
    script_args, training_args, model_args, dataset_args = parse_args(recipe_args)
    root = Path(training_args.output_dir)
    results = {}
    for loss_type in ("opd", "ce", "fkl"):
        args = dataclasses.replace(training_args, loss_type=loss_type, output_dir=str(root / loss_type))
        trainer = build_trainer(script_args, args, model_args, dataset_args)
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model()
        tokenizer, target = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.teacher_model)
        rows = load_dataset("json", data_files=options.eval_data, split="train").select(range(options.num_eval))
        prompts = encode_dataset(rows, tokenizer, {"enable_thinking": trainer.args.enable_thinking})["prompt_ids"]
        stats = measure_acceptance(
            target,
            trainer.accelerator.unwrap_model(trainer.model).eval(),
            prompts,
            max_new_tokens=options.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=trainer.eos_token_ids,
        )
        results[loss_type] = {"mean_acceptance_length": stats.mean_acceptance_length, "steps": stats.num_steps}
    write_json_atomic(root / "comparison.json", results, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
