#!/usr/bin/env bash
# Drafter training variants at an equal, short budget on a slice of the build (the answers and features stages must
# have run for SHARDS): held-out (teacher-forced validation) acceptance every EVAL steps and seconds per step, per
# variant. Each variant is a recipe run_name, so they share the build's prompts, answers and stored features.
# Results: demo/adaflash_demo/bench/results/smollm2_drafter_ab.json.
#   SHARDS="0 21" STEPS=120 EVAL=40 PYTHON=.venv/bin/python bash demo/adaflash_demo/bench/cpu_drafter_ab.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
PYTHON=${PYTHON:-python}
SHARDS=${SHARDS:-"0 21"}
STEPS=${STEPS:-120}
EVAL=${EVAL:-40}
CONFIG=${CONFIG:-demo/recipes/smollm2-drafter.yaml}
WORK=${WORK:-build/smollm2-drafter}
declare -A VARIANTS=(
  [full]="--draft_vocab_size 0"
  [vocab8k]="--draft_vocab_size 8192"
)
NAMES=${ORDER:-full vocab8k}
for name in $NAMES; do
  # shellcheck disable=SC2086
  $PYTHON -m adaflash_demo.recipe --config "$CONFIG" --work_dir "$WORK" --stages train --answer_shards $SHARDS \
    --run_name "ab-$name" --max_steps "$STEPS" --save_steps "$EVAL" --warmup_steps $((STEPS / 10)) \
    ${VARIANTS[$name]} ${EXTRA:-}
done
mkdir -p demo/adaflash_demo/bench/results
$PYTHON - "$WORK" $NAMES <<'PY'
import json, statistics, sys
from adaflash_hf.utils import write_json_atomic
work, names = sys.argv[1], sys.argv[2:]
out = {}
for name in names:
    log = json.load(open(f"{work}/drafter-ab-{name}/training_log.json"))
    history = log["log_history"]
    out[name] = {
        "eval_acceptance_length": {e["step"]: e["eval_acceptance_length"] for e in history if "eval_acceptance_length" in e},
        "median_step_s": statistics.median(e["step_time"] for e in history if "step_time" in e),
        "recipe": {k: log["recipe"][k] for k in ("draft_vocab_size", "num_anchors", "answer_shards", "max_steps")},
    }
write_json_atomic("demo/adaflash_demo/bench/results/smollm2_drafter_ab.json", out, indent=1)
print(json.dumps(out, indent=1))
PY
