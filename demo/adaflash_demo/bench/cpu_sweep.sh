#!/usr/bin/env bash
# The batch sweep of BENCHMARKS.md on the real target (the "never slower" issue): plain batched generate(), the fixed
# block, the adaptive length and the planner at batch 1, 2, 4, 8, 16, 32, float32 greedy, on one mixed pool of
# held-out prompts (the first 8 of each trained domain, so batch 32 has a whole batch). NEW (default 64) new tokens,
# BATCHES and METHODS choose what runs; REPEATS (default 1) serves the pool that many times, which a noisy machine
# needs at batch 16-32, where the pool makes only one or two calls per method.
# Writes demo/adaflash_demo/bench/results/smollm2_sweep.*. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
out=demo/adaflash_demo/bench/results
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
"${PYTHON:-python}" - "$out/sweep_prompts.jsonl" <<'PY'
import sys
from adaflash_demo.demo import shipped_prompts
from adaflash_demo.instructions import TRAINED_DOMAINS
from adaflash_hf.utils import write_jsonl
prompts = shipped_prompts(8)
write_jsonl(sys.argv[1], ({"prompt": p, "domain": "mixed"} for domain in TRAINED_DOMAINS for p in prompts[domain]))
PY
"${PYTHON:-python}" -m adaflash_demo.cli bench --dtype float32 --batch-sizes "${BATCHES:-1,2,4,8,16,32}" \
    --prompts "$out/sweep_prompts.jsonl" --prompts-per-domain 32 --max-new-tokens "${NEW:-64}" --repeats "${REPEATS:-1}" \
    --methods "${METHODS:-plain,adaflash_fixed,adaflash_adaptive,adaflash_planned}" \
    --json "$out/smollm2_sweep.json" --markdown "$out/smollm2_sweep.md"
