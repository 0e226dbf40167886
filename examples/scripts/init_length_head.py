"""Offline initialisation of the adaptive length head on a frozen drafter (docs/algorithm.md §6.4).

    python examples/scripts/init_length_head.py --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 \
        --data data/regen.jsonl --output_dir models/Qwen3-8B-DFlash-b16-length-head

`--data` is any `datasets.load_dataset("json", ...)` file with prompt/response rows (`prompt` + `response` or
`completion`, or `messages` ending in an assistant turn), e.g. target rollouts cached by OPDTrainer. The drafter
with its head is saved in the DFlash Hub format; the logic lives in `adaflash_hf.training.length_head`.
"""

import argparse
import dataclasses
import sys

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.training.length_head import LengthHeadInitConfig, init_length_head
from adaflash_hf.training.rollouts import encode_dataset, is_offline


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="JSON/JSONL file of prompt/response rows")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dtype", default="auto")
    for field in dataclasses.fields(LengthHeadInitConfig):
        parser.add_argument(
            f"--{field.name}", type=type(field.default) if field.default is not None else int, default=field.default
        )
    options = parser.parse_args(argv)
    config = LengthHeadInitConfig(
        **{f.name: getattr(options, f.name) for f in dataclasses.fields(LengthHeadInitConfig)}
    )

    tokenizer = AutoTokenizer.from_pretrained(options.target)
    target = AutoModelForCausalLM.from_pretrained(options.target, dtype=options.dtype)
    drafter = AdaFlashDrafter.from_pretrained(options.drafter)
    drafter.check_compatible(target)
    dataset = load_dataset("json", data_files=options.data, split="train")
    if not is_offline(dataset):
        raise ValueError(f"{options.data} has prompts only; the length head needs prompt/response rows")
    encoded = encode_dataset(dataset, tokenizer, {"enable_thinking": False})
    pairs = list(zip(encoded["prompt_ids"], encoded["completion_ids"]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    errors = init_length_head(drafter, target, pairs, pad, config)
    print(f"length head mean abs error (tokens): first batch {errors[0]:.2f}, last batch {errors[-1]:.2f}")
    drafter.save_pretrained(options.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
