"""The trainer side of online adaptation: one OPD round on buffered samples, then one publication (docs/algorithm.md
§5.3).

A round takes the ``train_threshold`` oldest samples (of one domain, for domain adapters), trains on their exact
token ids with `OPDTrainer` (no rollouts: served outputs already are the target's own generations, greedy or
sampled), publishes the result through the `VersionStore`, and only then removes the samples from the buffer.

Drafter mode keeps one training copy of the drafter across rounds, started from the weights the serving side
holds, so version ``n + 1`` continues version ``n``; the optimizer restarts every round (AdamW at a constant LR, as
in the reference; its moments are not published). Domain-adapter mode starts each round from the fixed base
drafter plus the domain's last published adapter, or a fresh LoRA for a new domain; the length head stays shared
(it is not part of the adapter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import PrinterCallback, ProgressCallback

from ..modeling import AdaFlashDrafter
from ..training.config import OPDConfig
from ..training.trainer import OPDTrainer
from .buffer import SampleBuffer
from .config import OnlineConfig
from .metrics import MetricsLog
from .publishing import Publication, PublishError, VersionStore

DRAFTER_CHANNEL = "drafter"
ADAPTER_CHANNEL_PREFIX = "adapter-"


def channel_for(mode: str, domain: str | None) -> str:
    return DRAFTER_CHANNEL if mode == "drafter" else ADAPTER_CHANNEL_PREFIX + domain


def drafter_from_state(config, state: dict) -> AdaFlashDrafter:
    drafter = AdaFlashDrafter(config)
    drafter.load_state_dict(state)
    return drafter


class RoundTrainer:
    """Runs rounds for an `OnlineGenerator`.

    Args:
        target: the frozen target (the teacher).
        drafter_config: the served drafter's `AdaFlashConfig`.
        initial_state: returns the state dict a training copy starts from (the served drafter's, or the bare base
            drafter's in domain-adapter mode), read under the serving lock.
        serving_lock: held while a round's `OPDTrainer` is built. Under bf16, accelerate wraps the target's forward in
            autocast for a moment there (`OPDTrainer` undoes it before returning); no request may run meanwhile.
    """

    def __init__(
        self,
        target,
        drafter_config,
        initial_state: Callable[[], dict],
        tokenizer,
        config: OnlineConfig,
        buffer: SampleBuffer,
        store: VersionStore,
        metrics: MetricsLog,
        serving_lock=None,
    ):
        self.target, self.drafter_config, self.initial_state = target, drafter_config, initial_state
        self.serving_lock = serving_lock if serving_lock is not None else contextlib.nullcontext()
        self.tokenizer, self.config = tokenizer, config
        self.buffer, self.store, self.metrics = buffer, store, metrics
        self.publications = 0
        self._student = None

    def recover(self) -> None:
        """Finishes what a crash after a publication left undone: removes the samples it was trained on."""
        for channel in self.store.channels():
            try:
                publication = self.store.latest(channel)
            except PublishError:
                continue
            self.buffer.remove(publication.consumed)

    def ready(self) -> list[str | None]:
        """Domains with a full round buffered (``[None]`` in drafter mode when the buffer holds a round)."""
        if self.config.max_versions is not None and self.publications >= self.config.max_versions:
            return []
        threshold = self.config.train_threshold
        if self.config.mode == "drafter":
            return [None] if len(self.buffer) >= threshold else []
        return sorted(d for d, n in self.buffer.domain_counts().items() if d is not None and n >= threshold)

    def run_round(self, domain: str | None = None) -> Publication | None:
        """One round on the oldest buffered samples (of ``domain``); returns its publication, or ``None`` when no
        sample was long enough to train on (a response needs more than ``block_size`` tokens to hold a block)."""
        channel = channel_for(self.config.mode, domain)
        samples = self.buffer.take(self.config.train_threshold, domain)
        consumed = [s.sample_id for s in samples]
        trainable = [s for s in samples if len(s.completion_ids) > self.drafter_config.block_size]
        if not trainable:
            self.buffer.remove(consumed)
            self.metrics.write("round_skipped", channel=channel, samples=len(samples), reason="responses too short")
            return None
        started = time.perf_counter()
        run_dir = self.store.root / ".runs" / channel
        shutil.rmtree(run_dir, ignore_errors=True)
        student, peft_config = self._student_for(channel)
        dataset = Dataset.from_dict(
            {"prompt_ids": [s.prompt_ids for s in trainable], "completion_ids": [s.completion_ids for s in trainable]}
        )
        with self.serving_lock:
            trainer = OPDTrainer(
                model=student,
                teacher_model=self.target,
                args=self._round_args(run_dir, len(trainable)),
                train_dataset=dataset,
                processing_class=self.tokenizer,
                peft_config=peft_config,
            )
        for callback in (PrinterCallback, ProgressCallback):  # rounds report through the metrics log, not stdout
            trainer.remove_callback(callback)
        result = trainer.train()
        trained = trainer.accelerator.unwrap_model(trainer.model).eval()
        if self.config.mode == "drafter":
            self._student = trained
        info = {
            "samples": len(samples),
            "trained_on": len(trainable),
            "steps": trainer.state.global_step,
            "loss": round(result.training_loss, 4),
        }
        publication = self.store.publish(channel, lambda directory: _save(trained, directory), consumed, info)
        self.buffer.remove(consumed)
        self.publications += 1
        shutil.rmtree(run_dir, ignore_errors=True)
        self.metrics.write(
            "round",
            channel=channel,
            version=publication.version,
            seconds=round(time.perf_counter() - started, 2),
            **info,
        )
        return publication

    def _student_for(self, channel: str):
        """The model a round trains, and the LoRA config when a new adapter is to be created."""
        if self.config.mode == "drafter":
            if self._student is None:
                self._student = drafter_from_state(self.drafter_config, self.initial_state())
            return self._student, None
        base = drafter_from_state(self.drafter_config, self.initial_state())
        try:
            previous = self.store.latest(channel)
            if previous is not None:
                self.store.verify(previous)
                return PeftModel.from_pretrained(base, str(previous.path), is_trainable=True), None
        except PublishError as error:
            self.metrics.write("trainer_error", channel=channel, reason=f"starting a fresh adapter: {error}")
        lora = LoraConfig(
            r=self.config.lora_r,
            lora_alpha=self.config.lora_alpha,
            target_modules=list(self.config.lora_target_modules),
        )
        return base, lora

    def _round_args(self, run_dir: Path, num_samples: int) -> OPDConfig:
        template = self.config.training_args or OPDConfig(
            output_dir=str(run_dir), use_cpu=not torch.cuda.is_available()
        )
        per_step = template.per_device_train_batch_size * template.gradient_accumulation_steps
        steps = max(1, math.ceil(num_samples * self.config.buffer_epochs / per_step))
        return dataclasses.replace(
            template,
            output_dir=str(run_dir),
            max_steps=steps,
            save_strategy="no",
            report_to=[],
            logging_steps=max(1, steps // 4),
            disable_tqdm=True,
            # A domain adapter leaves the shared length head alone (LoRA freezes it anyway).
            train_length_head=template.train_length_head and self.config.mode == "drafter",
        )


def _save(model, directory: Path) -> None:
    if hasattr(model, "peft_config"):
        model.save_pretrained(str(directory))
    else:
        model.save_pretrained(str(directory), save_format="adaflash")
