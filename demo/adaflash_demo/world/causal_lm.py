"""The world's causal LMs (the target and the AR draft): plain ``Qwen3ForCausalLM`` built from a config.

Plain transformers classes keep the shipped models loadable with ``AutoModelForCausalLM`` anywhere, and exercise
the same code paths as real Qwen3 targets. Embeddings are tied: at V=8192 the embedding is a quarter of an
8M-parameter model, and tying halves that cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM


@dataclass
class CausalLMShape:
    """Geometry of a Qwen3 decoder (the vocabulary comes from the tokenizer)."""

    hidden_size: int = field(default=256, metadata={"help": "Model width."})
    num_hidden_layers: int = field(default=6, metadata={"help": "Decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Query heads."})
    num_key_value_heads: int = field(default=2, metadata={"help": "Key/value heads (grouped-query attention)."})
    head_dim: int = field(default=64, metadata={"help": "Width of one attention head."})
    intermediate_size: int = field(default=1024, metadata={"help": "SwiGLU MLP width."})
    max_position_embeddings: int = field(
        default=2048,
        metadata={
            "help": "Longest context: 128-token prompts plus a few hundred generated tokens fit with room to spare."
        },
    )


def build_causal_lm(shape: CausalLMShape, tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    """A freshly initialised model whose vocabulary and special ids match the world tokenizer."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (``parameters()`` yields a tied embedding once)."""
    return sum(parameter.numel() for parameter in model.parameters())


def save_causal_lm(model: Qwen3ForCausalLM, out_dir: Path) -> None:
    """Saves bf16 safetensors plus a generation config with eos/pad, so ``generate()`` stops at document ends.

    bf16 halves the shipped size; the model was trained under bf16 autocast, so its matmuls already ran in bf16.
    """
    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.to(torch.bfloat16).save_pretrained(str(out_dir))


def load_saved_causal_lm(directory: Path, stage: str) -> torch.nn.Module:
    """A model saved by an earlier stage, in fp32 for training or scoring under autocast, or a clear error."""
    if not (Path(directory) / "config.json").exists():
        raise FileNotFoundError(f"No model in {directory}: run the `{stage}` stage first.")
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
