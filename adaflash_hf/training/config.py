"""`OPDConfig`: the configuration of `OPDTrainer`, a TRL `DistillationConfig` with AdaFlash's training knobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DistillationConfig

from .losses import CLIP_MODES, LENGTH_LOSSES, LOSS_TYPES


@dataclass
class OPDConfig(DistillationConfig):
    r"""
    Configuration class for [`OPDTrainer`]: on-policy distillation of an AdaFlash / DFlash drafter from its target.

    Extends TRL's [`~trl.DistillationConfig`] (and so [`~transformers.TrainingArguments`]); TRL's field names are
    kept where they exist (`max_completion_length`, `temperature`, `chat_template_kwargs`, `learning_rate`, ...).
    Defaults follow the AdaFlash recipes (spec §4.11): AdamW at 3e-4 with a constant schedule, weight decay 0.01,
    gradient clipping 1.0, one sequence per device and 2 accumulation steps, 512 anchors, decay gamma 7,
    `alpha=0.8`, `clip_tau=0.01`, greedy rollouts without thinking.

    Fields are grouped as in TRL: drafting loss, length head, rollouts, and overridden training defaults.
    """

    # Overridden TrainingArguments / DistillationConfig defaults (spec §4.10-4.11)
    learning_rate: float = field(default=3e-4, metadata={"help": "Learning rate of the drafter (AdamW)."})
    lr_scheduler_type: str = field(
        default="constant", metadata={"help": "LR schedule; AdaFlash trains at a constant LR without warmup."}
    )
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (torch's AdamW default)."})
    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Sequences per device and micro-batch (1 in every AdaFlash recipe)."}
    )
    gradient_accumulation_steps: int = field(
        default=2, metadata={"help": "Micro-batches accumulated per optimizer step (2 in the AdaFlash recipes)."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute drafter layer activations in backward; a few-layer drafter rarely needs it."},
    )
    temperature: float = field(
        default=0.0,
        metadata={
            "help": "Sampling temperature of the target's rollouts; 0 is greedy, as in every AdaFlash recipe. The "
            "loss temperature is `kl_temperature`."
        },
    )
    max_completion_length: int | None = field(
        default=2048, metadata={"help": "Maximum number of new tokens the target generates per rollout."}
    )

    # Drafting loss (spec §4.2-4.9)
    loss_type: str = field(
        default="opd",
        metadata={
            "help": "`'opd'` (AdaFlash): alpha * CE(teacher argmax) + (1 - alpha) * clipped reverse KL. `'ce'` (OSD "
            "baseline): CE on the generated tokens. `'fkl'` (DFlash-style KD): forward KL to the target.",
            "choices": list(LOSS_TYPES),
        },
    )
    alpha: float = field(default=0.8, metadata={"help": "Weight of the CE term of the `'opd'` loss, in [0, 1]."})
    kl_temperature: float = field(
        default=1.0, metadata={"help": "Softmax temperature T of both KL terms; they are scaled by T^2."}
    )
    clip_tau: float | None = field(
        default=0.01,
        metadata={"help": "Clip of the reverse KL (`'opd'`); `None` or <= 0 disables it. See `clip_mode`."},
    )
    clip_mode: str = field(
        default="reference",
        metadata={
            "help": "`'reference'`: divide each token's KL by the total weight W before clipping at `clip_tau`, "
            "exactly as the AdaFlash code does (the effective cap is tau * W, spec §4.9). `'per_token'`: cap each "
            "token's KL at `clip_tau` itself.",
            "choices": list(CLIP_MODES),
        },
    )
    num_anchors: int = field(
        default=512, metadata={"help": "Maximum number of blocks (anchors) drawn per sequence (spec §4.2)."}
    )
    loss_decay_gamma: float | None = field(
        default=7.0,
        metadata={"help": "Block slot k weighs exp(-(k - 1) / gamma); `None` or <= 0 disables the decay."},
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Block size to train; `None` uses the drafter's. Must equal the drafter's if set."},
    )
    loss_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Rows projected to the vocabulary at once in the loss; bounds memory for large vocabularies."
        },
    )

    # Adaptive length head (spec §6)
    train_length_head: bool = field(
        default=True,
        metadata={"help": "Train the drafter's length head (if it has one) on detached drafter states."},
    )
    length_head_learning_rate: float = field(
        default=2e-4, metadata={"help": "Learning rate of the length head's own parameter group."}
    )
    length_head_lookahead: int = field(
        default=1, metadata={"help": "Length-head label = (accepted drafts + lookahead) / block_size."}
    )
    length_head_loss: str = field(
        default="mse", metadata={"help": "Length head loss.", "choices": list(LENGTH_LOSSES)}
    )

    # Rollouts (spec §5)
    rollout_refresh_steps: int = field(
        default=0,
        metadata={
            "help": "Regenerate the rollouts every this many optimizer steps, so they are drafted by the current "
            "drafter; 0 generates them once. Ignored for prompt/completion datasets."
        },
    )
    rollout_with_drafter: bool = field(
        default=True,
        metadata={
            "help": "Generate rollouts with the current drafter as the target's assistant (speculative decoding). "
            "The rollouts are the target's own outputs either way (lossless); the drafter only makes them faster."
        },
    )
    rollout_batch_size: int = field(
        default=8, metadata={"help": "Prompts the target generates for at once when producing rollouts."}
    )
    rollout_dir: str | None = field(
        default=None,
        metadata={"help": "Where rollouts are cached as datasets; defaults to `<output_dir>/rollouts`."},
    )
    enable_thinking: bool = field(
        default=False,
        metadata={"help": "Passed to the chat template for `messages` prompts; AdaFlash trains without thinking."},
    )
    max_length: int | None = field(
        default=None,
        metadata={"help": "Truncate prompt + response to this many tokens (left part kept); `None` keeps all."},
    )

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.loss_type not in LOSS_TYPES:
            problems.append(f"loss_type={self.loss_type!r} must be one of {LOSS_TYPES}")
        if self.clip_mode not in CLIP_MODES:
            problems.append(f"clip_mode={self.clip_mode!r} must be one of {CLIP_MODES}")
        if self.length_head_loss not in LENGTH_LOSSES:
            problems.append(f"length_head_loss={self.length_head_loss!r} must be one of {LENGTH_LOSSES}")
        if not 0.0 <= self.alpha <= 1.0:
            problems.append(f"alpha={self.alpha} must lie in [0, 1]")
        if self.kl_temperature <= 0:
            problems.append(f"kl_temperature={self.kl_temperature} must be > 0")
        if self.num_anchors < 1:
            problems.append(f"num_anchors={self.num_anchors} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy rollouts)")
        if self.use_vllm:
            problems.append(
                "use_vllm=True is not supported: TRL's vLLM path generates with (and syncs weights to) the student, "
                "but OPD rollouts come from the target; set use_vllm=False"
            )
        if problems:
            raise ValueError("Invalid OPDConfig: " + "; ".join(problems))
