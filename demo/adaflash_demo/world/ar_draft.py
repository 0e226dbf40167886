"""A small autoregressive draft model for transformers' classic assisted generation (the bench's baseline).

It shares the world tokenizer (assisted generation needs the same vocabulary) and is distilled from the target's
next-token distributions on the training data, because assisted generation accepts the tokens the *target*
would pick, not the corpus's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from adaflash_hf.utils import atomic_directory

from .causal_lm import CausalLMShape, build_causal_lm, count_parameters, load_saved_causal_lm, save_causal_lm
from .lm_training import LMTrainingConfig, train_world_lm, training_summary


@dataclass
class ArDraftConfig:
    """Shape and training run of the AR draft model."""

    shape: CausalLMShape = field(
        default_factory=lambda: CausalLMShape(num_hidden_layers=2),
        metadata={"help": "The target's width with 2 layers: each draft token costs about a third of a target token."},
    )
    training: LMTrainingConfig = field(
        default_factory=lambda: LMTrainingConfig(max_steps=300),
        metadata={"help": "A short run (300 steps, about 3 minutes) with the target's optimiser settings."},
    )
    distill_from_target: bool = field(
        default=True,
        metadata={"help": "Train on the target's next-token distributions (True) or on the corpus tokens (False)."},
    )


def build_ar_draft(
    config: ArDraftConfig,
    tokenizer: PreTrainedTokenizerFast,
    tokens_dir: Path,
    target_dir: Path,
    out_dir: Path,
    seed: int,
) -> dict:
    """Trains the draft (distilled from the saved target when configured), saves it and returns its report entry."""
    teacher = load_saved_causal_lm(target_dir, "target") if config.distill_from_target else None
    model = build_causal_lm(config.shape, tokenizer, seed)
    result = train_world_lm(model, config.training, tokens_dir, seed, desc="ar_draft", teacher=teacher)
    with atomic_directory(out_dir) as staging:
        save_causal_lm(model, staging)
    return {
        "parameters": count_parameters(model),
        "shape": asdict(config.shape),
        "distilled": config.distill_from_target,
        "training": training_summary(result),
    }
