"""Lossless greedy speculative decoding with an official z-lab DFlash drafter (needs the Hub and a GPU).

python examples/generate_greedy.py --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import adaflash_hf  # routes generate(assistant_model=drafter) to AdaFlash
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.chat import render_prompt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="Qwen/Qwen3-8B")
    parser.add_argument("--drafter", default="z-lab/Qwen3-8B-DFlash-b16")
    parser.add_argument("--prompt", default="Write a quicksort in Python and explain it.")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).to(device)
    drafter = AdaFlashDrafter.from_pretrained(args.drafter, dtype=torch.bfloat16).to(device)
    # the chat template as the drafter's training rendered it (non-thinking turns)
    input_ids = torch.tensor([render_prompt(tokenizer, args.prompt, tokenize=True)], device=device)
    with adaflash_hf.record_stats() as stats:
        out = target.generate(input_ids, assistant_model=drafter, max_new_tokens=256, do_sample=False)
    print(tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True))
    print(stats.summary())


if __name__ == "__main__":
    main()
