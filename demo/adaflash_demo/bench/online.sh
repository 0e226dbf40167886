#!/usr/bin/env bash
# The online-adaptation benchmark of BENCHMARKS.md §7 (fp32 greedy serving, against the same stream served without
# adaptation): the real target on REQUESTS (default 64) prompts of its unseen changelog stream, served in batches of
# 4, a round per 16 samples; writes online_smollm2_changelog.* into the results folder. Extra arguments go to
# `adaflash-demo online` (e.g. --no-train-length-head, with NAME=smollm2_changelog_frozen_head).
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
out=demo/adaflash_demo/bench/results
runs=$(mktemp -d)
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
name=${NAME:-smollm2_changelog}
"${PYTHON:-python}" -m adaflash_demo.cli online --domain changelog --num-requests "${REQUESTS:-64}" \
    --max-new-tokens 64 --serve-batch-size 4 --train-threshold 16 --compare --swap-dir "$runs/$name" \
    --json "$out/online_$name.json" --plot "$out/online_$name.png" "$@"
for label in adapted not_adapted; do
    cp "$runs/$name/$label/metrics.jsonl" "$out/online_${name}_${label}.jsonl"
done
rm -rf "$runs"
