#!/usr/bin/env bash
# The online-adaptation benchmark of BENCHMARKS.md, on the shipped demo world (fp32 greedy serving):
#  1. drafter mode: 256 requests from the unseen `changelog` domain, a round per 32 samples, against the same
#     stream without adaptation;
#  2. domain adapters: a stream of all five domains (128 requests each) served in mixed batches of 5 (one row per
#     domain, each drafted by its own LoRA adapter in the same forward), against the shared drafter.
# Writes bench/results/online_{changelog,domains}.{json,png} and each run's metrics JSONL; about 15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
runs=$(mktemp -d)
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
"${PYTHON:-python}" -m adaflash_hf.cli online --domain changelog --num-requests 256 --max-new-tokens 64 --compare \
    --swap-dir "$runs/changelog" --json "$out/online_changelog.json" --plot "$out/online_changelog.png"
"${PYTHON:-python}" -m adaflash_hf.cli online --domain all --mode domain_adapters --num-requests 640 --max-new-tokens 64 \
    --serve-batch-size 5 --compare --swap-dir "$runs/domains" --json "$out/online_domains.json" --plot "$out/online_domains.png"
for run in changelog domains; do
    for label in adapted not_adapted; do
        cp "$runs/$run/$label/metrics.jsonl" "$out/online_${run}_${label}.jsonl"
    done
done
rm -rf "$runs"
