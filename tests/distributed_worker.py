"""One process of tests/test_distributed.py's `accelerate launch`: `adaflash train`'s own code path, plus a
fingerprint of this rank's drafter weights after training, so the test can compare the ranks."""

import hashlib
import json
import sys
from pathlib import Path

import torch

from adaflash_hf.training.cli import build_trainer, end_training, parse_args, run_training


def main(argv: list[str]) -> None:
    script_args, training_args, model_args, dataset_args = parse_args(argv)
    trainer = build_trainer(script_args, training_args, model_args, dataset_args)
    run_training(trainer, training_args)
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    digest = hashlib.sha256()
    for name, tensor in sorted(drafter.state_dict().items()):
        digest.update(name.encode() + tensor.detach().to(torch.float32).cpu().numpy().tobytes())
    rank = trainer.accelerator.process_index
    record = {
        "world_size": trainer.accelerator.num_processes,
        "step": trainer.state.global_step,
        "sha256": digest.hexdigest(),
    }
    Path(training_args.output_dir, f"rank{rank}.json").write_text(json.dumps(record))
    end_training(trainer)  # as `adaflash train` does: no gloo threads left for the teardown


if __name__ == "__main__":
    main(sys.argv[1:])
