"""`OPDConfig`: the configuration of `OPDTrainer`, a TRL `DistillationConfig` with AdaFlash's training knobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DistillationConfig

from .losses import CLIP_MODES, LENGTH_LOSSES, LOSS_TYPES


@dataclass
class OPDConfig(DistillationConfig):
    r"""
    Configuration class for the [`OPDTrainer`]: on-policy distillation of an AdaFlash / DFlash drafter from its target.

    Extends TRL's [`~trl.DistillationConfig`] (and so [`~transformers.TrainingArguments`]) with the parameters of
    AdaFlash's training; TRL's field names are kept where they exist (`max_completion_length`, `temperature`,
    `chat_template_kwargs`, `teacher_model_name_or_path`, ...). The defaults are those of the AdaFlash recipes
    (docs/algorithm.md §4.11), so `OPDConfig("out")` trains as the reference does.

    Using [`~transformers.HfArgumentParser`] (or TRL's `TrlParser`, as `adaflash train` does) we can turn this class
    into [argparse](https://docs.python.org/3/library/argparse#module-argparse) arguments that can be specified on the
    command line or in a YAML recipe.

    Parameters:
        > Parameters that control the drafting loss (docs/algorithm.md §4.2-4.9)

        loss_type (`str`, *optional*, defaults to `"opd"`):
            `"opd"` (AdaFlash): `alpha * CE(teacher argmax) + (1 - alpha) * clipped reverse KL`. `"ce"` (the OSD
            baseline): cross-entropy on the generated tokens. `"fkl"` (DFlash-style knowledge distillation): forward
            KL to the target.
        alpha (`float`, *optional*, defaults to `0.8`):
            Weight of the CE term of the `"opd"` loss, in `[0, 1]`.
        kl_temperature (`float`, *optional*, defaults to `1.0`):
            Softmax temperature `T` of both KL terms, which are scaled by `T^2`. (`temperature` is the rollouts'.)
        clip_tau (`float` or `None`, *optional*, defaults to `0.01`):
            Clip of the reverse KL of the `"opd"` loss; `None` or a value `<= 0` disables it. See `clip_mode`.
        clip_mode (`str`, *optional*, defaults to `"reference"`):
            `"reference"`: each row's KL is divided by the total weight `W` before it is clipped at `clip_tau`,
            exactly as the AdaFlash code does (so the effective cap is `clip_tau * W`). `"per_token"`: each row's KL is
            capped at `clip_tau` itself.
        num_anchors (`int`, *optional*, defaults to `512`):
            Maximum number of blocks (anchors) drawn per sequence.
        loss_decay_gamma (`float` or `None`, *optional*, defaults to `7.0`):
            Block slot `k` weighs `exp(-(k - 1) / gamma)`; `None` or a value `<= 0` disables the decay.
        selector_loss_alpha (`float`, *optional*, defaults to `1.0`):
            DFlash 2 drafters only: weight of the candidate selector's loss added to the drafting loss (speculators'
            `selector_loss_alpha`): the K-way cross-entropy of `unary + transition` over the student's unary top-K,
            the teacher's token injected at rank K where it is missing, the data token before each slot as the
            predecessor, under the same slot weights.
        block_size (`int` or `None`, *optional*):
            Block size to train; `None` uses the drafter's, and a set value must equal it.
        loss_chunk_size (`int`, *optional*, defaults to `1024`):
            Rows projected to the vocabulary at once in the loss; bounds the memory of large vocabularies.
        loss_checkpointing (`bool`, *optional*, defaults to `True`):
            Recompute each chunk's logits in the backward pass instead of keeping them: peak memory of one
            `[loss_chunk_size, V]` block. `False` keeps them (about `6 * rows * V` floats) and skips the second
            projection of every chunk, worth it where memory is to spare (the demo recipe trains so).
        feature_cache_dir (`str` or `None`, *optional*):
            Store the target's features of every sequence here the first time it is seen and read them back after
            (`adaflash_hf.training.FeatureCache`): later epochs, evaluations and resumed runs skip the target
            forward. Pays when responses are fixed (offline pairs, or `rollout_refresh_steps=0`) and the run sees
            each sequence more than once. About `(len(target_layer_ids) + 1) * hidden_size` values per token.
        feature_cache_dtype (`str`, *optional*, defaults to `"bfloat16"`):
            Storage dtype of the feature cache: `"bfloat16"` is what a drafter trained with `bf16=True` receives
            anyway; `"float32"` keeps a float32 run exact.

        > Parameters that control the adaptive length head (docs/algorithm.md §6)

        train_length_head (`bool`, *optional*, defaults to `True`):
            Whether to train the drafter's length head, if it has one, on detached drafter states.
        length_head_learning_rate (`float`, *optional*, defaults to `2e-4`):
            Learning rate of the length head's own parameter group.
        length_head_lookahead (`int`, *optional*, defaults to `1`):
            The head's label is `(accepted drafts + length_head_lookahead) / block_size`.
        length_head_loss (`str`, *optional*, defaults to `"mse"`):
            Loss of the length head: `"mse"` or `"mae"`.

        > Parameters that control the rollouts (docs/algorithm.md §5)

        temperature (`float`, *optional*, defaults to `0.0`):
            Sampling temperature of the target's rollouts; `0` is greedy, as in every AdaFlash recipe.
        max_completion_length (`int` or `None`, *optional*, defaults to `2048`):
            Maximum number of new tokens the target generates per rollout.
        rollout_refresh_steps (`int`, *optional*, defaults to `0`):
            Regenerate the rollouts every this many optimizer steps, so that the current drafter drafts them; `0`
            generates them once. Ignored for datasets with responses.
        rollout_with_drafter (`bool`, *optional*, defaults to `True`):
            Generate the rollouts with the current drafter as the target's assistant. The rollouts are the target's
            own outputs either way (speculative decoding is lossless); the drafter only makes them faster.
        rollout_batch_size (`int`, *optional*, defaults to `8`):
            Prompts the target answers at once when it produces rollouts.
        rollout_dir (`str` or `None`, *optional*):
            Where rollouts are cached as datasets, so a resumed run reloads them; defaults to
            `<output_dir>/rollouts`.
        enable_thinking (`bool`, *optional*, defaults to `False`):
            Passed to the chat template of `messages` prompts; AdaFlash trains without thinking.
        max_length (`int` or `None`, *optional*):
            Keep only the first `max_length` tokens of prompt + response; `None` keeps all.

        > Parameters whose defaults differ from [`~transformers.TrainingArguments`] (docs/algorithm.md §4.10)

        learning_rate (`float`, *optional*, defaults to `3e-4`):
            Learning rate of the drafter (AdamW).
        lr_scheduler_type (`str`, *optional*, defaults to `"constant"`):
            AdaFlash trains at a constant learning rate without warmup.
        weight_decay (`float`, *optional*, defaults to `0.01`):
            AdamW weight decay (torch's default).
        per_device_train_batch_size (`int`, *optional*, defaults to `1`):
            Sequences per device and micro-batch (1 in every AdaFlash recipe).
        gradient_accumulation_steps (`int`, *optional*, defaults to `2`):
            Micro-batches accumulated per optimizer step (2 in the AdaFlash recipes).
        gradient_checkpointing (`bool`, *optional*, defaults to `False`):
            Recompute drafter layer activations in the backward pass; a drafter of a few layers rarely needs it.

        Not supported: `use_vllm=True` (TRL's vLLM path generates with the student, but OPD rollouts come from the
        target).
    """

    # Overridden TrainingArguments / DistillationConfig defaults (docs/algorithm.md §4.10-4.11)
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

    # Drafting loss (docs/algorithm.md §4.2-4.9)
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
            "exactly as the AdaFlash code does (the effective cap is tau * W, docs/algorithm.md §4.9). "
            "`'per_token'`: cap each token's KL at `clip_tau` itself.",
            "choices": list(CLIP_MODES),
        },
    )
    num_anchors: int = field(
        default=512,
        metadata={"help": "Maximum number of blocks (anchors) drawn per sequence (docs/algorithm.md §4.2)."},
    )
    loss_decay_gamma: float | None = field(
        default=7.0,
        metadata={"help": "Block slot k weighs exp(-(k - 1) / gamma); `None` or <= 0 disables the decay."},
    )
    selector_loss_alpha: float = field(
        default=1.0,
        metadata={"help": "DFlash 2 drafters: weight of the candidate selector's K-way loss (speculators')."},
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
    loss_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Recompute each chunk's logits in backward (bounded memory); False keeps them and skips that work."
        },
    )
    feature_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Store the target's features per sequence here and reuse them (later epochs, evaluations, "
            "resumed runs skip the target forward); pays with fixed responses seen more than once."
        },
    )
    feature_cache_dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "Storage dtype of the feature cache: bfloat16 (what bf16 autocast feeds the drafter) or float32.",
            "choices": ["bfloat16", "float32", "float16"],
        },
    )

    # Adaptive length head (docs/algorithm.md §6)
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

    # Rollouts (docs/algorithm.md §5)
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
        if self.selector_loss_alpha < 0:
            problems.append(f"selector_loss_alpha={self.selector_loss_alpha} must be >= 0")
        if not 0.0 <= self.alpha <= 1.0:
            problems.append(f"alpha={self.alpha} must lie in [0, 1]")
        if self.kl_temperature <= 0:
            problems.append(f"kl_temperature={self.kl_temperature} must be > 0")
        if self.feature_cache_dtype not in ("bfloat16", "float32", "float16"):
            problems.append(f"feature_cache_dtype={self.feature_cache_dtype!r} must be bfloat16, float32 or float16")
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
