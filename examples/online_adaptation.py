"""Online adaptation while serving, on the demo's real target (CPU, offline): SmolLM2-135M-Instruct with the
drafter the demo distribution ships.

Requests from Debian changelogs, a domain the drafter never trained on, go through an `OnlineGenerator`: every finished
request is buffered on disk, a background thread trains a new drafter version per 16 buffered requests, and the
server adopts each version between requests. Traffic comes in bursts of 16 requests with a quiet spell after each
(`wait_for_version`), so every burst is served by a newer drafter. Outputs stay the target's greedy outputs.
Acceptance per burst also depends on the burst's prompts; `adaflash-demo online --compare` pairs every version with the
unadapted drafter on the same requests.

    python examples/online_adaptation.py        # needs the demo distribution: pip install ./demo
"""

import tempfile

import torch

from adaflash_demo.demo import DRAFTER_DIR, stream_prompts
from adaflash_demo.smollm2 import load_target
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.chat import render_prompt
from adaflash_hf.online import OnlineConfig, OnlineGenerator, acceptance_by_version
from adaflash_hf.training import OPDConfig


def main():
    target, tokenizer = load_target(dtype=torch.float32)  # left padding, for batched prompts
    drafter = AdaFlashDrafter.from_pretrained(DRAFTER_DIR / "drafter", dtype=torch.float32)
    rounds = OPDConfig(
        "unused",  # every round sets its own output_dir, steps, saving and logging
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        num_anchors=16,
        train_length_head=False,  # rounds this small retrain the length head into drafting nothing (BENCHMARKS.md §7)
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
    )
    config = OnlineConfig(
        swap_dir=tempfile.mkdtemp(prefix="adaflash-online-"), train_threshold=16, buffer_epochs=4, training_args=rounds
    )
    prompts = [render_prompt(tokenizer, row["prompt"]) for row in stream_prompts("changelog")[:64]]
    with OnlineGenerator(target, drafter, tokenizer, config) as server:  # starts the background trainer
        for burst in range(4):
            for start in range(16 * burst, 16 * (burst + 1), 4):
                batch = tokenizer(
                    prompts[start : start + 4], return_tensors="pt", padding=True, add_special_tokens=False
                )
                server.generate(batch.input_ids, batch.attention_mask, max_new_tokens=64, do_sample=False)
            server.wait_for_version(burst + 1)  # the quiet spell: the round on this burst publishes meanwhile
        print(server.status)
    for row in acceptance_by_version(server.metrics.rows()):
        print(f"drafter v{row['version']}: {row['requests']} requests, acceptance {row['mean_acceptance_length']:.2f}")
    print(f"metrics: {config.swap_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
