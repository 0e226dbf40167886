"""The demo-world build: stages, their on-disk layout, the build report and shipping into the package.

Stages run in a fixed order and each reads only what earlier stages wrote to the output directory, so any
suffix of the stage list can be rerun. Every random choice derives from one seed.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adaflash_hf.utils import atomic_directory, write_jsonl

from .ar_draft import ArDraftConfig, build_ar_draft
from .artifacts import SHIPPED_ARTIFACTS, WORLD_DATA_DIR
from .causal_lm import CausalLMShape
from .corpus import DOMAINS, CorpusConfig, build_corpus, load_documents
from .drafter import DrafterConfig, build_drafter
from .evaluation import EvaluationConfig, evaluate_world
from .lm_training import LMTrainingConfig
from .packing import pack_corpus
from .prompts import PromptConfig, build_prompts
from .stream import StreamConfig, build_streams
from .target import TargetConfig, build_target
from .tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

STAGES = ("corpus", "tokenizer", "prompts", "stream", "target", "ar_draft", "evaluate", "drafter", "ship")
DEFAULT_STAGES = STAGES[:-1]


@dataclass
class WorldConfig:
    """Every setting of a world build."""

    seed: int = field(default=0, metadata={"help": "Seeds the corpus order, the generator, batches and inits."})
    corpus: CorpusConfig = field(default_factory=CorpusConfig, metadata={"help": "The four domains."})
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, metadata={"help": "Byte-level BPE."})
    prompts: PromptConfig = field(default_factory=PromptConfig, metadata={"help": "Held-out prompt files."})
    stream: StreamConfig = field(default_factory=StreamConfig, metadata={"help": "Online-adaptation streams."})
    target: TargetConfig = field(default_factory=TargetConfig, metadata={"help": "The target LM."})
    ar_draft: ArDraftConfig = field(default_factory=ArDraftConfig, metadata={"help": "The AR draft model."})
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig, metadata={"help": "Held-out scoring."})
    drafter: DrafterConfig = field(default_factory=DrafterConfig, metadata={"help": "The AdaFlash drafter."})

    @classmethod
    def quick(cls, seed: int = 0) -> WorldConfig:
        """A smoke build of one to two minutes: the same pipeline at toy sizes (the models learn little)."""
        small_training = dict(batch_size=16, seq_len=128, warmup_steps=20)
        return cls(
            seed=seed,
            corpus=CorpusConfig(max_chars_per_domain=400_000, max_chars_per_file=40_000),
            tokenizer=TokenizerConfig(vocab_size=2048),
            prompts=PromptConfig(prompts_per_domain=8),
            stream=StreamConfig(prompts_per_domain=16, heldout_prompts=8),
            target=TargetConfig(
                shape=CausalLMShape(hidden_size=128, num_hidden_layers=4, head_dim=32, intermediate_size=512),
                training=LMTrainingConfig(max_steps=60, **small_training),
            ),
            ar_draft=ArDraftConfig(
                shape=CausalLMShape(hidden_size=128, num_hidden_layers=1, head_dim=32, intermediate_size=512),
                training=LMTrainingConfig(max_steps=30, **small_training),
            ),
            evaluation=EvaluationConfig(seq_len=128, windows_per_domain=8),
            drafter=DrafterConfig(
                target_layer_ids=[1, 2], prompts_per_domain=8, completion_tokens=32, max_steps=10, eval_new_tokens=16
            ),
        )


@dataclass(frozen=True)
class WorldLayout:
    """Where each stage writes inside the output directory."""

    root: Path

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    @property
    def tokens(self) -> Path:
        return self.root / "tokens"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    @property
    def stream(self) -> Path:
        return self.root / "stream"

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def ar_draft(self) -> Path:
        return self.root / "ar_draft"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def report(self) -> Path:
        return self.root / "report.json"


def build_world(
    config: WorldConfig, out_dir: Path, stages: tuple[str, ...] = DEFAULT_STAGES, ship_dir: Path = WORLD_DATA_DIR
) -> dict:
    """Runs ``stages`` in pipeline order, updating ``report.json`` after each; returns the report."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"Unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}.")
    layout = WorldLayout(Path(out_dir))
    layout.root.mkdir(parents=True, exist_ok=True)
    report = json.loads(layout.report.read_text()) if layout.report.exists() else {}
    report.update(seed=config.seed, config=asdict(config))
    runners = {
        "corpus": _corpus_stage,
        "tokenizer": _tokenizer_stage,
        "prompts": _prompts_stage,
        "stream": _stream_stage,
        "target": _target_stage,
        "ar_draft": _ar_draft_stage,
        "evaluate": _evaluate_stage,
        "drafter": _drafter_stage,
    }
    for stage in (name for name in STAGES if name in stages):
        if stage == "ship":
            ship_world(layout, Path(ship_dir))
            continue
        started = time.perf_counter()
        summary = runners[stage](config, layout)
        report.setdefault("stages", {})[stage] = {**summary, "stage_seconds": round(time.perf_counter() - started, 1)}
        layout.report.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _corpus_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    return build_corpus(config.corpus, config.seed, layout.corpus)


def _tokenizer_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    """Trains the tokenizer on training documents only, saves it, and packs the corpus with it."""
    started = time.perf_counter()
    texts = (document.text for domain in DOMAINS for document in load_documents(layout.corpus, domain, "train"))
    tokenizer = train_tokenizer(texts, config.tokenizer)
    training_seconds = time.perf_counter() - started
    with atomic_directory(layout.tokenizer) as staging:
        tokenizer.save_pretrained(str(staging))
    packed = pack_corpus(layout.corpus, tokenizer, layout.tokens)
    return {
        "vocab_size": len(tokenizer),
        "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens},
        "training_seconds": round(training_seconds, 1),
        "domains": packed,
    }


def _prompts_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    tokenizer = load_tokenizer(layout.tokenizer)
    counts = {}
    with atomic_directory(layout.prompts) as staging:
        for domain in DOMAINS:
            rows = build_prompts(
                domain,
                load_documents(layout.corpus, domain, "heldout"),
                tokenizer,
                config.prompts,
                random.Random(f"{config.seed}-prompts-{domain}"),
            )
            write_jsonl(staging / f"{domain}.jsonl", rows)
            counts[domain] = len(rows)
    return {"prompts_per_domain": counts, "prompt_tokens": config.prompts.prompt_tokens}


def _stream_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    return build_streams(config.stream, layout.corpus, load_tokenizer(layout.tokenizer), config.seed, layout.stream)


def _target_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    return build_target(config.target, load_tokenizer(layout.tokenizer), layout.tokens, layout.target, config.seed)


def _ar_draft_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    return build_ar_draft(
        config.ar_draft, load_tokenizer(layout.tokenizer), layout.tokens, layout.target, layout.ar_draft, config.seed
    )


def _evaluate_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    return evaluate_world(layout.tokens, layout.target, layout.ar_draft, config.evaluation)


def _drafter_stage(config: WorldConfig, layout: WorldLayout) -> dict:
    return build_drafter(
        config.drafter,
        load_tokenizer(layout.tokenizer),
        layout.tokens,
        layout.target,
        layout.prompts,
        layout.drafter,
        config.seed,
        layout.root / "drafter_run",
    )


def ship_world(layout: WorldLayout, ship_dir: Path) -> None:
    """Copies the shipped artifacts (models, tokenizer, prompts, report) of a build into ``ship_dir``."""
    missing = [name for name in SHIPPED_ARTIFACTS if not (layout.root / name).exists()]
    if missing:
        raise FileNotFoundError(f"Cannot ship {layout.root}: {missing} missing; run the stages that build them first.")
    ship_dir.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_ARTIFACTS:
        source, destination = layout.root / name, ship_dir / name
        if source.is_dir():
            shutil.rmtree(destination, ignore_errors=True)
            shutil.copytree(source, destination)
        else:
            shutil.copy2(source, destination)
