"""The demo world's target: an 8M-parameter Qwen3 trained on the four domains for a fixed number of steps.

8M parameters learn well in 10 minutes on 2 AMX cores (about 5k tokens/s under bf16 autocast); larger targets
verify more cheaply per token but would be undertrained in the same time (see docs/demo-world.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from adaflash_hf.utils import atomic_directory

from .causal_lm import CausalLMShape, build_causal_lm, count_parameters, save_causal_lm
from .lm_training import LMTrainingConfig, train_world_lm, training_summary


@dataclass
class TargetConfig:
    """Shape and training run of the target."""

    shape: CausalLMShape = field(
        default_factory=CausalLMShape,
        metadata={"help": "h256, 6 layers, 4 heads of 64, 2 KV heads, SwiGLU 1024: 8.0M parameters at V=8192."},
    )
    training: LMTrainingConfig = field(
        default_factory=lambda: LMTrainingConfig(max_steps=840),
        metadata={
            "help": "840 steps (about 10 minutes on 2 idle cores), B16 x T256, AdamW lr 2e-3, 50 warmup steps, "
            "cosine to 10%."
        },
    )


def build_target(
    config: TargetConfig, tokenizer: PreTrainedTokenizerFast, tokens_dir: Path, out_dir: Path, seed: int
) -> dict:
    """Trains the target, saves it (bf16 safetensors) to ``out_dir`` and returns its report entry."""
    model = build_causal_lm(config.shape, tokenizer, seed)
    result = train_world_lm(model, config.training, tokens_dir, seed, desc="target")
    with atomic_directory(out_dir) as staging:
        save_causal_lm(model, staging)
    return {
        "parameters": count_parameters(model),
        "shape": asdict(config.shape),
        "training": training_summary(result),
    }
