"""`OnlineGenerator`: serve with ``target.generate(..., assistant_model=drafter)``, learn from what is served, swap in
the improved drafter (or per-domain LoRA adapters) between requests.

The serving side and the trainer meet only on disk (`SampleBuffer`, `VersionStore`), as in the reference, so
either can crash or restart without the other losing anything. The trainer runs in a background *thread* by
default: it needs the target as its teacher, and a thread shares the already loaded one where a process would hold
a second copy (two copies of an 8B target do not fit beside each other on most GPUs); torch kernels release the
GIL, so training overlaps serving. A Python exception in the trainer stays in its thread: it is logged, the round
is retried (its samples stay buffered), and after ``max_consecutive_failures`` the trainer stops and `status` says
why, while serving goes on with the last good weights. A hard crash (a killed process) loses nothing on disk
either: a new `OnlineGenerator` on the same ``swap_dir`` resumes from the buffer and the last publication.

Swaps happen only in `refresh`, which `generate` calls before a request under the serving lock, so a request is
never drafted by two versions. A publication is adopted only after every file's sha256 matches its marker and the
weights load with exactly the served model's keys and shapes; otherwise the last good weights keep serving, the
reason is logged (``swap_failed`` in the metrics, `swap_errors`), and that publication is not retried.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils.hotswap import hotswap_adapter
from transformers import GenerationConfig

from ..generation.stats import record_stats
from ..generation.stopping import cut_after_eos
from ..modeling import AdaFlashDrafter
from .buffer import SampleBuffer, check_domain
from .config import OnlineConfig
from .metrics import MetricsLog
from .publishing import Publication, PublishError, VersionStore
from .rounds import ADAPTER_CHANNEL_PREFIX, DRAFTER_CHANNEL, RoundTrainer

logger = logging.getLogger(__name__)


def _clone_state(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


class OnlineGenerator:
    """Wraps a target and its drafter for serving with online adaptation.

    Args:
        target: the target `PreTrainedModel` (frozen; it generates and teaches).
        drafter: its `AdaFlashDrafter`, updated in place by each adopted version; in ``domain_adapters`` mode it is
            the frozen base of the adapters, which PEFT injects into it in place (pass a copy to keep it bare).
        tokenizer: the target's tokenizer (padding and EOS for the buffered samples).
        config: `OnlineConfig`.
        start: start the background trainer now (``config.background``); else call `start()` later.
    """

    def __init__(self, target, drafter: AdaFlashDrafter, tokenizer, config: OnlineConfig, start: bool = True):
        if not getattr(drafter, "_is_adaflash_drafter", False) or hasattr(drafter, "peft_config"):
            raise TypeError(
                "OnlineGenerator needs a bare AdaFlashDrafter (in mode='domain_adapters' it creates and loads the "
                f"adapters itself); got {type(drafter).__name__}."
            )
        drafter.check_compatible(target)
        self.target, self.tokenizer, self.config = target.eval(), tokenizer, config
        self.base_drafter = drafter.eval()
        self.serving_drafter = self.base_drafter  # becomes a PeftModel once a domain adapter is adopted
        root = Path(config.swap_dir)
        self.buffer = SampleBuffer(root / "buffer", config.buffer_capacity)
        self.store = VersionStore(root / "published", config.keep_versions)
        self.metrics = MetricsLog(root / "metrics.jsonl")
        self.versions: dict[str, int] = {}
        self.swap_errors: list[str] = []
        self.trainer_error: str | None = None
        self._rejected: set[str] = set()
        self._lock = threading.RLock()
        self._base_state = _clone_state(drafter) if config.mode == "domain_adapters" else None
        self._requests = len(self.metrics.rows("request"))
        self.trainer = RoundTrainer(
            target,
            drafter.config,
            self._training_start_state,
            tokenizer,
            config,
            self.buffer,
            self.store,
            self.metrics,
            serving_lock=self._lock,
        )
        self.trainer.recover()
        self.refresh()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0
        if config.background and start:
            self.start()

    # ------------------------------------------------------------------ serving

    def generate(self, input_ids, attention_mask=None, domains: list[str | None] | None = None, **generate_kwargs):
        """``target.generate`` with the current drafter (or each row's domain adapter), then buffers every row.

        input_ids ``[B, T]`` (left-padded with ``attention_mask`` when rows differ in length); ``domains``: one tag
        (or ``None``) per row. Other keyword arguments go to `generate` (``max_new_tokens``, ``do_sample``, ...).
        Returns the `generate` output.
        """
        domains = list(domains) if domains is not None else [None] * input_ids.shape[0]
        if len(domains) != input_ids.shape[0]:
            raise ValueError(f"domains has {len(domains)} tags for a batch of {input_ids.shape[0]} rows")
        for domain in domains:
            check_domain(domain)
        with self._lock:
            self.refresh()
            generation_config, versions = self._request_config(domains, generate_kwargs.pop("generation_config", None))
            model_kwargs = generation_config.update(**generate_kwargs)
            with record_stats() as stats:
                started = time.perf_counter()
                output = self.target.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    assistant_model=self.serving_drafter,
                    generation_config=generation_config,
                    **model_kwargs,
                )
                seconds = time.perf_counter() - started
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            self._record(input_ids, attention_mask, sequences, domains, versions, stats, seconds, generation_config)
        if not self.config.background and self._failures < self.config.max_consecutive_failures:
            self._train_safely()
        return output

    def _request_config(self, domains, base: GenerationConfig | None) -> tuple[GenerationConfig, list[int]]:
        generation_config = copy.deepcopy(base or self.target.generation_config)
        if self.config.mode == "drafter":
            return generation_config, [self.versions.get(DRAFTER_CHANNEL, 0)] * len(domains)
        names = [d if d is not None and self._has_adapter(d) else "__base__" for d in domains]
        if self.serving_drafter is not self.base_drafter:
            generation_config.adaflash_adapter_names = names
        versions = [
            self.versions.get(ADAPTER_CHANNEL_PREFIX + d, 0) if n != "__base__" else 0 for d, n in zip(domains, names)
        ]
        return generation_config, versions

    def _has_adapter(self, domain: str) -> bool:
        return ADAPTER_CHANNEL_PREFIX + domain in self.versions

    def _record(self, input_ids, attention_mask, sequences, domains, versions, stats, seconds, generation_config):
        """Buffers every row (prompt without padding, response cut after EOS) and writes its metrics row."""
        completions = [cut_after_eos(row, generation_config) for row in sequences[:, input_ids.shape[1] :].tolist()]
        tokens_per_s = sum(map(len, completions)) / seconds
        call = stats.calls[0] if stats.calls else None
        for row, (domain, completion) in enumerate(zip(domains, completions)):
            prompt = input_ids[row] if attention_mask is None else input_ids[row][attention_mask[row].bool()]
            figures = call.row(row) if call is not None else {"steps": 0, "verified_tokens": 0, "emitted_tokens": 0}
            steps = max(figures["steps"], 1)
            self.buffer.add(prompt.tolist(), completion, domain, versions[row])
            self.metrics.write(
                "request",
                request=self._requests,
                version=versions[row],
                domain=domain,
                batch_size=len(domains),
                prompt_tokens=len(prompt),
                new_tokens=len(completion),
                seconds=round(seconds, 4),
                tokens_per_s=round(tokens_per_s, 2),
                mean_acceptance_length=round(figures["emitted_tokens"] / steps, 4),
                mean_verify_length=round(figures["verified_tokens"] / steps, 4),
            )
            self._requests += 1

    # ------------------------------------------------------------------ swapping

    def refresh(self) -> list[Publication]:
        """Adopts every newer good publication; returns those adopted. Called between requests."""
        adopted = []
        with self._lock:
            for channel in self.store.channels():
                try:
                    publication = self.store.latest(channel)
                except PublishError as error:
                    self._reject(channel, str(error), key=f"marker:{channel}:{error}")
                    continue
                if publication.version <= self.versions.get(channel, 0) or publication.key in self._rejected:
                    continue
                try:
                    self.store.verify(publication)
                    self._adopt(publication)
                except Exception as error:  # noqa: BLE001 - any unusable publication keeps the last good weights
                    self._reject(
                        channel, f"{type(error).__name__}: {error}", key=publication.key, version=publication.version
                    )
                    continue
                previous = self.versions.get(channel, 0)
                self.versions[channel] = publication.version
                self.metrics.write("swap", channel=channel, version=publication.version, previous=previous)
                adopted.append(publication)
        return adopted

    def _reject(self, channel: str, reason: str, key: str, version: int | None = None) -> None:
        if key in self._rejected:
            return
        self._rejected.add(key)
        message = f"{channel} v{version}: {reason}" if version is not None else f"{channel}: {reason}"
        self.swap_errors.append(message)
        logger.warning("Keeping the last good drafter; not adopting %s", message)
        self.metrics.write("swap_failed", channel=channel, version=version, reason=reason)

    def _adopt(self, publication: Publication) -> None:
        if publication.channel == DRAFTER_CHANNEL:
            if self.config.mode != "drafter":
                raise PublishError("a drafter publication in domain_adapters mode; the base drafter stays fixed")
            loaded = AdaFlashDrafter.from_pretrained(str(publication.path))
            # strict: every key and shape must match the served drafter before a single weight is overwritten
            self.base_drafter.load_state_dict(loaded.state_dict(), strict=True)
            return
        if not publication.channel.startswith(ADAPTER_CHANNEL_PREFIX) or self.config.mode != "domain_adapters":
            raise PublishError(f"unexpected channel {publication.channel!r} in mode={self.config.mode!r}")
        self._load_adapter(publication.channel[len(ADAPTER_CHANNEL_PREFIX) :], str(publication.path))

    def _load_adapter(self, domain: str, path: str) -> None:
        if self.serving_drafter is self.base_drafter:
            self.serving_drafter = PeftModel.from_pretrained(self.base_drafter, path, adapter_name=domain).eval()
        elif domain in self.serving_drafter.peft_config:
            hotswap_adapter(self.serving_drafter, path, adapter_name=domain)
        else:
            self.serving_drafter.load_adapter(path, adapter_name=domain)
        self.serving_drafter.eval()

    def _training_start_state(self) -> dict:
        if self._base_state is not None:
            return self._base_state
        with self._lock:
            return _clone_state(self.base_drafter)

    # ------------------------------------------------------------------ trainer

    def train_ready_rounds(self) -> list[Publication]:
        """Runs every round the buffer holds enough samples for, in this thread; returns the publications."""
        publications = [self.trainer.run_round(domain) for domain in self.trainer.ready()]
        return [publication for publication in publications if publication is not None]

    def start(self) -> None:
        """Starts the background trainer thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self.trainer_error, self._failures = None, 0
        self._thread = threading.Thread(target=self._train_forever, name="adaflash-online-trainer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Asks the trainer to stop after its current round and waits for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    close = stop

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.stop()

    def _train_safely(self) -> list[Publication]:
        """`train_ready_rounds`, with a failure recorded instead of raised: the trainer never takes serving down,
        and the failed round's samples stay buffered for the next try."""
        try:
            published = self.train_ready_rounds()
        except Exception as error:  # noqa: BLE001
            self._failures += 1
            self.trainer_error = f"{type(error).__name__}: {error}"
            logger.exception("Online training round failed (%d in a row)", self._failures)
            self.metrics.write("trainer_error", reason=self.trainer_error, consecutive=self._failures)
            if self._failures >= self.config.max_consecutive_failures:
                self.trainer_error = f"stopped after {self._failures} failed rounds; last: {self.trainer_error}"
            return []
        self._failures = 0
        return published

    def _train_forever(self) -> None:
        while not self._stop.is_set() and self._failures < self.config.max_consecutive_failures:
            if not self._train_safely():
                self._stop.wait(self.config.poll_interval_s)

    @property
    def status(self) -> dict:
        """Served versions, buffered samples, trainer state and swap errors, for health checks."""
        running = self._thread is not None and self._thread.is_alive()
        failed = self._failures >= self.config.max_consecutive_failures
        return {
            "versions": dict(self.versions),
            "buffered": len(self.buffer),
            "evicted": self.buffer.evicted,
            "trainer": "running" if running else ("failed" if failed else "idle"),
            "trainer_error": self.trainer_error,
            "swap_errors": list(self.swap_errors),
        }

    def wait_for_version(self, version: int, channel: str = DRAFTER_CHANNEL, timeout: float = 600.0) -> bool:
        """Blocks until ``channel`` has published ``version`` (for scripts and tests); True when it has."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                latest = self.store.latest(channel)
            except PublishError:
                latest = None
            if latest is not None and latest.version >= version:
                return True
            if self._thread is None or not self._thread.is_alive():
                return False
            time.sleep(0.05)
        return False
