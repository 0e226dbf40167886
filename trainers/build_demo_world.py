"""Builds the offline demo world: corpus, tokenizer, held-out prompts, target, AR draft model and AdaFlash drafter.

Regenerate the shipped artifacts (about 30 minutes on 2 cores):

    HF_HUB_OFFLINE=1 python trainers/build_demo_world.py --out build/demo_world \
        --stages corpus,tokenizer,prompts,target,ar_draft,evaluate,drafter,ship

`ship` copies target/, ar_draft/, drafter/, tokenizer/, prompts/ and report.json into adaflash_hf/world/data.
Smoke build (1-2 minutes, toy sizes; `ship` is never a default stage): add --quick.

Every stage is deterministic for a seed: the models train for fixed step counts (target 840, AR draft 300,
drafter 950: about 10, 3 and 10 minutes on 2 idle cores), so a rebuild on a busy machine takes longer but
reproduces the same weights. --target-minutes / --drafter-minutes trade that for a wall-clock budget instead
(more or fewer steps on a faster or busier machine: comparable, not identical models).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from adaflash_demo.world import DEFAULT_STAGES, STAGES, WORLD_DATA_DIR, WorldConfig, build_world


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGES),
        help=f"Comma-separated stages, run in pipeline order; any of {','.join(STAGES)}.",
    )
    parser.add_argument("--out", type=Path, default=Path("build/demo_world"), help="Build directory.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of every random choice.")
    parser.add_argument("--target-steps", type=int, default=None, help="Exact target steps (default 840).")
    parser.add_argument(
        "--target-minutes", type=float, default=None, help="Train the target for a wall-clock budget instead of steps."
    )
    parser.add_argument("--ar-draft-steps", type=int, default=None, help="Exact AR draft steps (default 300).")
    parser.add_argument("--drafter-steps", type=int, default=None, help="Exact drafter steps (default 950).")
    parser.add_argument(
        "--drafter-minutes",
        type=float,
        default=None,
        help="Train the drafter for a wall-clock budget instead of steps.",
    )
    parser.add_argument("--quick", action="store_true", help="Toy sizes for a 1-2 minute smoke build.")
    parser.add_argument("--ship-dir", type=Path, default=WORLD_DATA_DIR, help="Where the `ship` stage copies to.")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    return parser.parse_args()


def _set_budget(run_config, steps: int | None, minutes: float | None) -> None:
    """A wall-clock budget replaces the step count; an explicit step count replaces the default one."""
    if minutes is not None:
        run_config.minutes, run_config.max_steps = minutes, None
    if steps is not None:
        run_config.max_steps = steps


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = WorldConfig.quick(args.seed) if args.quick else WorldConfig(seed=args.seed)
    _set_budget(config.target.training, args.target_steps, args.target_minutes)
    _set_budget(config.ar_draft.training, args.ar_draft_steps, None)
    _set_budget(config.drafter, args.drafter_steps, args.drafter_minutes)
    stages = tuple(stage.strip() for stage in args.stages.split(",") if stage.strip())
    report = build_world(config, args.out, stages, ship_dir=args.ship_dir)
    print(json.dumps(report.get("stages", {}), indent=2))


if __name__ == "__main__":
    main()
