#!/usr/bin/env bash
# The benchmark on a GPU (bf16, sdpa): the real target side by side, then drafter/target time per step on a
# Qwen3-8B-shaped random-weight target with the 5-layer z-lab drafter geometry. Writes into ${OUT:-bench-gpu}.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
out=${OUT:-bench-gpu}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
"${PYTHON:-python}" -m adaflash_demo.bench.step_timing --shape qwen3-8b --dtype bfloat16 --batch-sizes 1,8,32 | tee "$out/step_timing.jsonl"
"${PYTHON:-python}" -m adaflash_demo.cli bench --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --prompts-per-domain 32 \
    --json "$out/bench.json" --markdown "$out/bench.md" --plots "$out" | tee "$out/bench.log"
"${PYTHON:-python}" -m adaflash_demo.cli bench --device cuda --dtype float32 --quick --json "$out/bench_fp32_quick.json" | tee "$out/bench_fp32.log"
