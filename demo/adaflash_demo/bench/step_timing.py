"""Drafter vs target time per speculative step on a model of real shape with random weights.

Random weights make acceptance meaningless, but the cost of one step (one drafter forward over a block, one target
forward verifying it) depends only on the shapes: `python -m adaflash_demo.bench.step_timing --shape qwen3-8b` on a
GPU reports what a Qwen3-8B target with the 5-layer z-lab drafter geometry costs per step at several batch sizes.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from adaflash_hf.configuration import AdaFlashConfig
from adaflash_hf.generation.stats import record_stats
from adaflash_hf.modeling import AdaFlashDrafter

SHAPES = {
    # Qwen3-8B and the z-lab Qwen3-8B-DFlash-b16 drafter (docs/algorithm.md §2.2)
    "qwen3-8b": dict(
        target=dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
        drafter_layers=5,
        mask_token_id=151669,
    ),
    "tiny": dict(
        target=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        drafter_layers=2,
        mask_token_id=511,
    ),
}


def build_pair(shape: str, dtype: torch.dtype, device: str, attn_implementation: str = "sdpa"):
    spec = SHAPES[shape]
    config = Qwen3Config(**spec["target"], eos_token_id=None, pad_token_id=0)
    config._attn_implementation = attn_implementation
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype).eval()
        drafter_config = AdaFlashConfig.from_target_config(
            config, num_hidden_layers=spec["drafter_layers"], block_size=16, mask_token_id=spec["mask_token_id"]
        )
        drafter_config._attn_implementation = attn_implementation
        drafter = AdaFlashDrafter(drafter_config).to(dtype).eval()
    return target, drafter


def time_steps(target, drafter, batch_size: int, prompt_len: int = 512, new_tokens: int = 64) -> dict:
    """Mean drafter and target milliseconds per step, fixed 16-token block, after one warm-up call."""
    prompt = torch.randint(1, target.config.vocab_size - 1, (batch_size, prompt_len), device=target.device)
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None, adaflash_length_policy="fixed"
    )
    target.generate(prompt, generation_config=config, assistant_model=drafter)  # warm-up
    with record_stats() as stats:
        target.generate(prompt, generation_config=config, assistant_model=drafter)
    steps = len(stats.steps)
    return {
        "batch_size": batch_size,
        "steps": steps,
        "drafter_ms_per_step": round(1000 * stats.draft_time_s / steps, 3),
        "target_ms_per_step": round(1000 * stats.target_time_s / steps, 3),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    target, drafter = build_pair(args.shape, getattr(torch, args.dtype), args.device)
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        row = time_steps(target, drafter, batch_size, args.prompt_len, args.new_tokens)
        print(json.dumps({"shape": args.shape, "dtype": args.dtype, "device": args.device, **row}), flush=True)


if __name__ == "__main__":
    main()
