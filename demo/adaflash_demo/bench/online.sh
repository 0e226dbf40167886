#!/usr/bin/env bash
# The online-adaptation benchmark of BENCHMARKS.md (fp32 greedy serving, each run against the same stream served
# without adaptation).
#  WORLD=smollm2 (default): the real target on REQUESTS (default 64) prompts of its unseen changelog stream, served
#     in batches of 4, a round per 16 samples; writes online_smollm2_changelog.* into the results folder.
#  WORLD=toy: the first round's toy world: 256 changelog requests (a round per 32 samples), then the five domains in
#     mixed batches of 5, each row drafted by its own LoRA adapter; writes bench/results/online_{changelog,domains}.*.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
runs=$(mktemp -d)
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
online() { "${PYTHON:-python}" -m adaflash_hf.cli online "$@"; }
if [ "${WORLD:-smollm2}" = smollm2 ]; then
    online --world smollm2 --domain changelog --num-requests "${REQUESTS:-64}" --max-new-tokens 64 \
        --serve-batch-size 4 --train-threshold 16 --compare --swap-dir "$runs/smollm2_changelog" \
        --json "$out/online_smollm2_changelog.json" --plot "$out/online_smollm2_changelog.png"
    names=(smollm2_changelog)
else
    online --world toy --domain changelog --num-requests 256 --max-new-tokens 64 --compare \
        --swap-dir "$runs/changelog" --json "$out/online_changelog.json" --plot "$out/online_changelog.png"
    online --world toy --domain all --mode domain_adapters --num-requests 640 --max-new-tokens 64 \
        --serve-batch-size 5 --compare --swap-dir "$runs/domains" --json "$out/online_domains.json" \
        --plot "$out/online_domains.png"
    names=(changelog domains)
fi
for run in "${names[@]}"; do
    for label in adapted not_adapted; do
        cp "$runs/$run/$label/metrics.jsonl" "$out/online_${run}_${label}.jsonl"
    done
done
rm -rf "$runs"
