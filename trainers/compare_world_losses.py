"""Same-budget comparison of the drafting losses on the demo world: `opd` (AdaFlash), `ce` (OSD) and `fkl` (DFlash KD).

    HF_HUB_OFFLINE=1 python trainers/compare_world_losses.py --build build/demo_world --steps 400

Each loss trains the same drafter from the same seed for the same number of steps on the same rollouts (generated
once and shared), then the real speculative loop measures the mean acceptance length per domain on the held-out
prompts. Writes `<build>/loss_comparison.json` and prints a markdown table.
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from adaflash_demo.world.drafter import DrafterConfig, build_drafter
from adaflash_demo.world.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=Path("build/demo_world"), help="A demo-world build directory.")
    parser.add_argument("--steps", type=int, default=400, help="Optimizer steps per loss (the shared budget).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.build / "tokenizer")
    results = {}
    for loss_type in ("opd", "ce", "fkl"):
        config = replace(DrafterConfig(), loss_type=loss_type, max_steps=args.steps)
        run = args.build / "loss_comparison" / loss_type
        report = build_drafter(
            config,
            tokenizer,
            args.build / "tokens",
            args.build / "target",
            args.build / "prompts",
            run / "drafter",
            args.seed,
            run / "work",
            rollout_dir=args.build / "loss_comparison" / "rollouts",
        )
        results[loss_type] = {"steps": report["steps"], "train_seconds": report["train_seconds"], **report["heldout"]}
        print(json.dumps({loss_type: results[loss_type]}), flush=True)
    (args.build / "loss_comparison.json").write_text(json.dumps(results, indent=2) + "\n")
    domains = list(results["opd"].keys() - {"steps", "train_seconds"})
    print("| loss | steps | " + " | ".join(domains) + " |")
    print("|---|---|" + "---|" * len(domains))
    for loss_type, row in results.items():
        cells = " | ".join(f"{row[d]['fixed']['mean_acceptance_length']:.2f}" for d in domains)
        print(f"| {loss_type} | {row['steps']} | {cells} |")


if __name__ == "__main__":
    main()
