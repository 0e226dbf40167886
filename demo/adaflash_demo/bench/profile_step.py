"""Where one speculative step's time goes, on the demo world (batch 1, fp32 greedy).

    python -m adaflash_demo.bench.profile_step --prompts 8

Splits the wall time of AdaFlash generation into the drafter's network forward, the target's verification forward
(which also captures the hidden states the drafter reads), and everything else (drafting logits and choice, the
length policy, acceptance, cache and mask bookkeeping, Python), next to plain decoding.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

from adaflash_hf.generation.stats import record_stats
from adaflash_hf.modeling import AdaFlashDrafter

from ..world import load_world_model, load_world_tokenizer, prompts_by_domain, world_artifact


class _Timer:
    """Accumulates the wall time of a module's forward calls (hooks, no patch); `remove()` detaches its hooks."""

    def __init__(self, module):
        self.seconds, self._start = 0.0, None
        self._handles = (
            module.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.perf_counter())),
            module.register_forward_hook(
                lambda *_: setattr(self, "seconds", self.seconds + time.perf_counter() - self._start)
            ),
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    tokenizer = load_world_tokenizer()
    target = load_world_model("target")
    drafter = AdaFlashDrafter.from_pretrained(world_artifact("drafter"), dtype=torch.float32).eval()
    texts = [t for prompts in prompts_by_domain().values() for t in prompts[: args.prompts]]
    inputs = [tokenizer(t, return_tensors="pt") for t in texts]
    base = {**target.generation_config.to_dict(), "max_new_tokens": args.max_new_tokens, "do_sample": False}
    for policy in ("fixed", "adaptive"):
        config = GenerationConfig(**base, adaflash_length_policy=policy)
        target_timer, drafter_timer = _Timer(target), _Timer(drafter)
        start = time.perf_counter()
        with record_stats() as stats:
            for batch in inputs:
                target.generate(**batch, assistant_model=drafter, generation_config=config)
        total = time.perf_counter() - start
        steps = stats.verification_steps
        rest = total - target_timer.seconds - drafter_timer.seconds
        print(
            f"{policy}: {steps} steps, {1000 * total / steps:.2f} ms/step = drafter forward "
            f"{1000 * drafter_timer.seconds / steps:.2f} + target forward {1000 * target_timer.seconds / steps:.2f} "
            f"+ rest {1000 * rest / steps:.2f} (acceptance {stats.mean_acceptance_length:.2f})"
        )
        target_timer.remove(), drafter_timer.remove()
    timer = _Timer(target)
    start, tokens = time.perf_counter(), 0
    for batch in inputs:
        out = target.generate(**batch, generation_config=GenerationConfig(**base))
        tokens += out.shape[1] - batch["input_ids"].shape[1]
    total = time.perf_counter() - start
    print(
        f"plain: {1000 * total / tokens:.2f} ms/token = target forward {1000 * timer.seconds / tokens:.2f} "
        f"+ rest {1000 * (total - timer.seconds) / tokens:.2f}"
    )


if __name__ == "__main__":
    main()
