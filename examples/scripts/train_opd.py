"""OPD training of an AdaFlash drafter from a YAML recipe.

    python examples/scripts/train_opd.py --config examples/scripts/adaflash_qwen3_8b.yaml
    accelerate launch examples/scripts/train_opd.py --config examples/scripts/adaflash_qwen3_8b.yaml  # several devices

Same as `adaflash train --config ...`; the logic lives in `adaflash_hf.training.cli.train_main`.
"""

import sys

from adaflash_hf.training.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))
