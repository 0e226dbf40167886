"""`OnlineConfig`: every setting of online adaptation (serving side, buffer, trainer rounds, domain adapters)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..training.config import OPDConfig

MODES = ("drafter", "domain_adapters")
DEFAULT_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class OnlineConfig:
    """Online adaptation of a drafter to the traffic it serves (docs/algorithm.md §5)."""

    swap_dir: str = field(
        metadata={"help": "Directory of the buffer, the published versions and metrics.jsonl; reuse it to resume."}
    )
    mode: str = field(
        default="drafter",
        metadata={
            "help": "`drafter`: rounds train the whole drafter on every buffered sample. `domain_adapters`: rounds "
            "train one PEFT LoRA adapter per domain tag on that domain's samples; the base drafter stays fixed.",
            "choices": list(MODES),
        },
    )
    train_threshold: int = field(
        default=128, metadata={"help": "Samples a round trains on; a round starts once this many are buffered."}
    )
    buffer_epochs: int = field(default=2, metadata={"help": "Passes over a round's samples (2 in the reference)."})
    buffer_capacity: int = field(
        default=4096, metadata={"help": "Most samples kept on disk; beyond it the oldest are evicted (and counted)."}
    )
    training_args: OPDConfig | None = field(
        default=None,
        metadata={
            "help": "OPD settings of every round (loss, learning rates, anchors, batch); output_dir, max_steps, "
            "saving and logging are set per round. None: the reference recipe (OPDConfig defaults)."
        },
    )
    background: bool = field(
        default=True,
        metadata={
            "help": "Train in a background thread while serving (asynchronous, like the reference). False: a "
            "round runs inside the generate() call that fills the buffer, after its outputs are done "
            "(reproducible, for tests and benchmarks)."
        },
    )
    poll_interval_s: float = field(
        default=1.0, metadata={"help": "Background trainer: seconds between buffer checks."}
    )
    max_consecutive_failures: int = field(
        default=3, metadata={"help": "Background trainer: failed rounds in a row after which it stops and reports."}
    )
    max_versions: int | None = field(default=None, metadata={"help": "Stop training after this many publications."})
    keep_versions: int = field(default=3, metadata={"help": "Published versions kept on disk per channel (>= 2)."})
    lora_r: int = field(default=16, metadata={"help": "Domain adapters: LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "Domain adapters: LoRA alpha."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_MODULES), metadata={"help": "Domain adapters: modules with LoRA."}
    )

    def __post_init__(self):
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode={self.mode!r} must be one of {MODES}")
        if self.train_threshold < 1 or self.buffer_epochs < 1:
            problems.append("train_threshold and buffer_epochs must be >= 1")
        if self.buffer_capacity < self.train_threshold:
            problems.append(
                f"buffer_capacity={self.buffer_capacity} < train_threshold={self.train_threshold}: a round could "
                "never fill; raise buffer_capacity"
            )
        if problems:
            raise ValueError("Invalid OnlineConfig: " + "; ".join(problems))
