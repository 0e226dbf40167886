"""Online adaptation on a simulated serving stream (docs/algorithm.md §5): the same code as `adaflash online`.

    python trainers/online_adapt.py --domain changelog --num-requests 256 --compare --plot online.png
    python trainers/online_adapt.py --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 \\
        --prompts stream.jsonl --train-threshold 128 --num-anchors 512 --background

Every request's prompt and output go to the buffer under --swap-dir; a round of OPD runs per --train-threshold
samples and publishes a new drafter version, adopted before the next request. --mode domain_adapters trains one
LoRA adapter per `domain` tag instead (try --domain all, a mixed stream of the demo world's five domains).
"""

import sys

from adaflash_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["online", *sys.argv[1:]]))
