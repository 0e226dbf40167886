"""The offline demo world: four local text domains, a byte-level BPE tokenizer, a small Qwen3 target and an AR
draft model, built by ``trainers/build_demo_world.py`` and shipped in ``demo/adaflash_demo/world/data`` (the
``adaflash-demo`` distribution: ``pip install ./demo``).

Everything is built from files already on the machine (CPython stdlib, GNU info manuals, package docs, man pages)
plus generated arithmetic problems, so the demo and benchmarks need no download. Debian changelogs, kept out of
the corpus, make an unseen domain for the online-adaptation streams.
"""

from .ar_draft import ArDraftConfig, build_ar_draft
from .artifacts import (
    WORLD_DATA_DIR,
    load_prompts,
    load_stream,
    load_world_model,
    load_world_tokenizer,
    prompts_by_domain,
    world_artifact,
)
from .build import DEFAULT_STAGES, STAGES, WorldConfig, WorldLayout, build_world, ship_world
from .causal_lm import CausalLMShape, build_causal_lm, count_parameters, load_saved_causal_lm, save_causal_lm
from .corpus import DOMAINS, CorpusConfig, CorpusError, Document, build_corpus, is_heldout, load_documents
from .drafter import DrafterConfig, build_drafter
from .evaluation import EvaluationConfig, evaluate_heldout, evaluate_world, heldout_windows
from .lm_training import LMTrainingConfig, TrainingResult, train_causal_lm
from .prompts import PromptConfig, build_prompts
from .stream import UNSEEN_DOMAIN, StreamConfig, build_streams
from .target import TargetConfig, build_target
from .tokenizer import MASK_TOKEN, TokenizerConfig, load_tokenizer, train_tokenizer

__all__ = [
    "DEFAULT_STAGES",
    "DOMAINS",
    "MASK_TOKEN",
    "STAGES",
    "UNSEEN_DOMAIN",
    "WORLD_DATA_DIR",
    "ArDraftConfig",
    "CausalLMShape",
    "CorpusConfig",
    "CorpusError",
    "DrafterConfig",
    "EvaluationConfig",
    "evaluate_world",
    "heldout_windows",
    "Document",
    "LMTrainingConfig",
    "PromptConfig",
    "StreamConfig",
    "TargetConfig",
    "TokenizerConfig",
    "TrainingResult",
    "WorldConfig",
    "WorldLayout",
    "build_ar_draft",
    "build_causal_lm",
    "build_corpus",
    "build_drafter",
    "build_prompts",
    "build_streams",
    "build_target",
    "build_world",
    "count_parameters",
    "evaluate_heldout",
    "is_heldout",
    "load_documents",
    "load_prompts",
    "load_stream",
    "load_saved_causal_lm",
    "load_tokenizer",
    "load_world_model",
    "load_world_tokenizer",
    "save_causal_lm",
    "prompts_by_domain",
    "ship_world",
    "train_causal_lm",
    "train_tokenizer",
    "world_artifact",
]
