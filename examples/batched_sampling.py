"""Batch > 1 with lossless sampling and the adaptive length policy, on the shipped demo world (CPU, offline).

python examples/batched_sampling.py        # needs the demo distribution: pip install ./demo
"""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import adaflash_hf
from adaflash_demo.world import world_artifact
from adaflash_hf import AdaFlashDrafter


def main():
    tokenizer = AutoTokenizer.from_pretrained(world_artifact("tokenizer"), padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(world_artifact("target"), dtype=torch.float32)
    drafter = AdaFlashDrafter.from_pretrained(world_artifact("drafter"), dtype=torch.float32)
    prompts = ["def fibonacci(n):\n", "Tom has 3 apples and buys 4 more.", "The find command searches"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
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
