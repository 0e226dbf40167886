"""Batch > 1 with lossless sampling and the adaptive length policy, on the demo's real target (CPU, offline):
SmolLM2-135M-Instruct with the drafter the demo distribution ships.

python examples/batched_sampling.py        # needs the demo distribution: pip install ./demo (or make install)
"""

import torch
from transformers import GenerationConfig

import adaflash_hf
from adaflash_demo.demo import DRAFTER_DIR
from adaflash_demo.smollm2 import load_target
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.chat import render_prompt


def main():
    target, tokenizer = load_target(dtype=torch.float32)  # left padding, for batched prompts
    drafter = AdaFlashDrafter.from_pretrained(DRAFTER_DIR / "drafter", dtype=torch.float32)
    prompts = [
        "Write a Python function that reverses a string.",
        "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "What does the `find` command do?",
    ]
    batch = tokenizer(
        [render_prompt(tokenizer, p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False
    )  # the template already holds the special tokens
    config = GenerationConfig(
        max_new_tokens=64,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        adaflash_length_policy="adaptive" if drafter.config.use_length_head else "confidence",
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(**batch, generation_config=config, assistant_model=drafter)
    for row in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True):
        print("->", row[:200].replace("\n", " "))
    print({i: stats.calls[0].row(i) for i in range(len(prompts))})


if __name__ == "__main__":
    main()
