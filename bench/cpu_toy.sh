#!/usr/bin/env bash
# The first round's CPU benchmark: every method on the toy world (--world toy), fp32 greedy, batch sweep.
# Writes bench/results/cpu_fp32.{json,md} and the plots. About 20 minutes on 2 cores; keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
"${PYTHON:-python}" -m adaflash_hf.cli bench --world toy --dtype float32 --batch-sizes 1,4,8,16,32 --prompts-per-domain 32 --max-new-tokens 128 \
    --json "$out/cpu_fp32.json" --markdown "$out/cpu_fp32.md" --plots "$out"
