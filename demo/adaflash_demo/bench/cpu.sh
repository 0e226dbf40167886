#!/usr/bin/env bash
# The CPU benchmark of BENCHMARKS.md on the real target (SmolLM2-135M-Instruct with the shipped drafter), fp32 greedy:
# the step-cost model, then every method side by side at batch 1 on the held-out prompts of the five domains.
# PROMPTS (default 16 per domain, about 35 minutes on 2 idle cores; 4 takes about 9) sets how many.
# Writes demo/adaflash_demo/bench/results/smollm2_*. Keep the machine otherwise idle: methods are compared within one run.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
out=demo/adaflash_demo/bench/results
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
"${PYTHON:-python}" -m adaflash_demo.bench.cost_model --json "$out/smollm2_cost_model.json" | tee "$out/smollm2_cost_model.log"
"${PYTHON:-python}" -m adaflash_demo.cli bench --dtype float32 --batch-sizes 1 --prompts-per-domain "${PROMPTS:-16}" \
    --max-new-tokens 128 --methods plain,prompt_lookup,native_dflash,adaflash_fixed,adaflash_adaptive,adaflash_confidence,adaflash_planned,adaflash_tree \
    --json "$out/smollm2_fp32.json" --markdown "$out/smollm2_fp32.md"
