#!/usr/bin/env bash
# Drafting losses at an equal budget on the real target (BENCHMARKS.md): `opd` (AdaFlash), `ce` (OSD) and `fkl`
# (DFlash KD), each training the same drafter from the same seed for STEPS (default 80) steps on the same answers and
# cached features of the recipe's build (run its prompts, answers and features stages first), then the real
# speculative loop on EVAL_PROMPTS (default 8) held-out prompts per domain, 32 new tokens, fixed block and adaptive
# length. Each run's outputs go to build/smollm2-drafter/{trainer,drafter,evaluation}-loss-<type>; the table to
# smollm2_losses.md in the results folder (not run yet: no table is committed).
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
steps=${STEPS:-80}
for loss in opd ce fkl; do
    "${PYTHON:-python}" -m adaflash_demo.recipe --config demo/recipes/smollm2-drafter.yaml --run_name "loss-$loss" \
        --loss_type "$loss" --max_steps "$steps" --warmup_steps 10 --save_steps "$steps" \
        --eval_prompts_per_domain "${EVAL_PROMPTS:-8}" --eval_new_tokens 32 --stages train evaluate
done
out=demo/adaflash_demo/bench/results
"${PYTHON:-python}" - "$steps" <<'PY' | tee "$out/smollm2_losses.md"
import json, sys
from pathlib import Path
root = Path("build/smollm2-drafter")
print(f"| loss ({sys.argv[1]} steps) | " + " | ".join(["code", "docs", "shell", "math", "changelog"]) + " |")
print("|---|" + "---|" * 5)
for loss in ("opd", "ce", "fkl"):
    result = json.loads((root / f"evaluation-loss-{loss}.json").read_text())
    cells = [f"{result[d]['fixed']['mean_acceptance_length']:.3f} / {result[d]['adaptive']['mean_acceptance_length']:.3f}"
             for d in ("code", "docs", "shell", "math", "changelog")]
    print(f"| `{loss}` | " + " | ".join(cells) + " |")
PY
