#!/usr/bin/env bash
# Tree against linear verification on the real target (the tree-verification issue): plain generate(), the fixed
# block, and draft trees of 16, 32 and 64 tokens (`adaflash_tree<N>`, the block as the tree's depth) with the same
# drafter at batch 1, float32 greedy, on the held-out prompts of every domain. PROMPTS (default 4) per domain, NEW
# (default 64) new tokens. Writes demo/adaflash_demo/bench/results/smollm2_tree.*. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
out=demo/adaflash_demo/bench/results
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
"${PYTHON:-python}" -m adaflash_demo.cli bench --dtype float32 --batch-sizes 1 --prompts-per-domain "${PROMPTS:-4}" \
    --max-new-tokens "${NEW:-64}" --methods plain,adaflash_fixed,adaflash_tree16,adaflash_tree32,adaflash_tree64 \
    --json "$out/smollm2_tree.json" --markdown "$out/smollm2_tree.md"
