"""Builds the offline demo world: corpus, tokenizer, held-out prompts, target, AR draft model and AdaFlash drafter.

Regenerate the shipped artifacts (about 30 minutes on 2 cores):

    HF_HUB_OFFLINE=1 python trainers/build_demo_world.py --out build/demo_world \
        --stages corpus,tokenizer,prompts,stream,target,ar_draft,evaluate,drafter,ship

`ship` copies target/, ar_draft/, drafter/, tokenizer/, prompts/, stream/ and report.json into
demo/adaflash_demo/world/data (the adaflash-demo distribution: with `pip install -e ./demo` they are used at once).
Smoke build (1-2 minutes, toy sizes; `ship` is never a default stage): add --quick.

Every stage is deterministic for a seed: the models train for fixed step counts (target 840, AR draft 300,
drafter 950: about 10, 3 and 10 minutes on 2 idle cores), so a rebuild on a busy machine takes longer but
reproduces the same weights.
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
    parser.add_argument("--ar-draft-steps", type=int, default=None, help="Exact AR draft steps (default 300).")
    parser.add_argument("--drafter-steps", type=int, default=None, help="Exact drafter steps (default 950).")
    parser.add_argument("--quick", action="store_true", help="Toy sizes for a 1-2 minute smoke build.")
    parser.add_argument("--ship-dir", type=Path, default=WORLD_DATA_DIR, help="Where the `ship` stage copies to.")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = WorldConfig.quick(args.seed) if args.quick else WorldConfig(seed=args.seed)
    for run, steps in (
        (config.target.training, args.target_steps),
        (config.ar_draft.training, args.ar_draft_steps),
        (config.drafter, args.drafter_steps),
    ):
        if steps is not None:
            run.max_steps = steps
    stages = tuple(stage.strip() for stage in args.stages.split(",") if stage.strip())
    report = build_world(config, args.out, stages, ship_dir=args.ship_dir)
    print(json.dumps(report.get("stages", {}), indent=2))


if __name__ == "__main__":
    main()
