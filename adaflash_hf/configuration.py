"""`AdaFlashConfig`: the geometry of a DFlash block-diffusion drafter plus AdaFlash's adaptive length head.

The drafter is a small Qwen3-style non-causal transformer that reads hidden states of a few target layers
(``target_layer_ids``) and drafts a block of ``block_size`` tokens in one forward pass (docs/algorithm.md §1). It has
no embeddings and no LM head of its own: it borrows the target's, so ``hidden_size`` and ``vocab_size`` must equal
the target's.

The official z-lab DFlash and AdaFlash checkpoints store the same facts as a ``Qwen3Config`` plus a nested
``dflash_config`` dict, and `speculators` ones in its own schema; :mod:`adaflash_hf.schema` maps each to this class's
fields and back, for `AdaFlashConfig.from_pretrained` and the drafter's loads and saves alike.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .dflash2 import DRAFTER_TYPES
from .schema import (
    ADAFLASH_MODEL_TYPE,
    CONFIG_NAME,
    HUB_KWARGS,
    CheckpointError,
    fields_from_config_dict,
    read_config_dict,
    root_message,
)

LENGTH_POLICIES = ("fixed", "adaptive", "confidence", "planned")


def length_policy_problems(policy, drafter_config, prefix: str = "") -> list[str]:
    """What is wrong with a candidate-length policy (``length_policy``, ``length_rate``, ``min_candidate_length``,
    ``confidence_threshold`` attributes of ``policy``) for a drafter; empty when nothing is. One rule for the drafter
    config and for the per-call ``adaflash_*`` generation overrides; ``prefix`` names the settings as the caller
    spelled them."""
    problems = []
    if policy.length_policy not in LENGTH_POLICIES:
        problems.append(f"{prefix}length_policy={policy.length_policy!r} must be one of {LENGTH_POLICIES}")
    if policy.length_policy == "adaptive" and not drafter_config.use_length_head:
        problems.append(
            f"{prefix}length_policy='adaptive' needs a drafter with a length head: load one with "
            "drafter.load_length_head(path), or use 'fixed' or the training-free 'confidence'"
        )
    if not 1 <= policy.min_candidate_length <= drafter_config.block_size:
        problems.append(
            f"{prefix}min_candidate_length={policy.min_candidate_length} must lie in "
            f"[1, block_size={drafter_config.block_size}]"
        )
    if policy.length_rate <= 0:
        problems.append(f"{prefix}length_rate={policy.length_rate} must be > 0")
    if not 0 < policy.confidence_threshold < 1:
        problems.append(f"{prefix}confidence_threshold={policy.confidence_threshold} must lie in (0, 1)")
    return problems


def draft_vocab_problems(draft_vocab, vocab_size: int) -> list[str]:
    """What is wrong with a reduced draft vocabulary (``AdaFlashConfig.draft_vocab``); empty when nothing is."""
    if draft_vocab is None:
        return []
    ids = list(draft_vocab)
    if len(ids) < 2 or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        return [f"draft_vocab must be a list of at least 2 token ids (ints); got {len(ids)} entries"]
    if any(a >= b for a, b in zip(ids, ids[1:])):
        return ["draft_vocab must be strictly ascending (sorted, no duplicates): sorted(set(ids))"]
    if ids[0] < 0 or ids[-1] >= vocab_size:
        return [f"draft_vocab holds ids outside the target vocabulary [0, {vocab_size}): {ids[0]}..{ids[-1]}"]
    return []


def dflash2_problems(config) -> list[str]:
    """What is wrong with a config's drafter type and DFlash 2 geometry; empty when nothing is."""
    if config.drafter_type not in DRAFTER_TYPES:
        return [f"drafter_type={config.drafter_type!r} must be one of {DRAFTER_TYPES}"]
    if config.drafter_type != "dflash2":
        return []
    problems = []
    if config.conv_group_size < 1 or config.hidden_size % config.conv_group_size:
        problems.append(
            f"conv_group_size={config.conv_group_size} must divide hidden_size={config.hidden_size} (16 is the "
            "engines' default)"
        )
    if not 1 <= config.conv_kernel_size <= config.block_size:
        problems.append(f"conv_kernel_size={config.conv_kernel_size} must lie in [1, block_size={config.block_size}]")
    if config.selector_rank < 1:
        problems.append(f"selector_rank={config.selector_rank} must be >= 1")
    if not 1 <= config.selector_top_k <= config.vocab_size:
        problems.append(f"selector_top_k={config.selector_top_k} must lie in [1, vocab_size={config.vocab_size}]")
    if config.draft_vocab is not None:
        problems.append(
            "a DFlash 2 drafter drafts over the whole vocabulary (its selector's codebooks are indexed by target "
            "token ids, and the engines refuse a reduced one): set draft_vocab=None"
        )
    return problems


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the drafter (docs/algorithm.md §1.2).

    One drafter layer reads the middle target layer; otherwise ``num_draft_layers`` ids are spread evenly over
    ``[1, num_target_layers - 3]`` with Python's (banker's) ``round``, so that e.g. 36 target layers and 5 drafter
    layers give ``[1, 9, 17, 25, 33]`` exactly as the reference code does.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@strict(accept_kwargs=True)
class AdaFlashConfig(PreTrainedConfig):
    r"""
    Configuration of an [`AdaFlashDrafter`].

    Drafter geometry (Qwen3-style):
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        hidden_act, rms_norm_eps, rope_parameters, max_position_embeddings, attention_bias, attention_dropout,
        layer_types, sliding_window, initializer_range: as in `Qwen3Config`. `hidden_size` must equal the target's.

    DFlash block drafting:
        block_size (`int`, defaults to 16):
            Tokens per drafted block, the anchor (last committed token) included, so at most `block_size - 1`
            drafts per step.
        target_layer_ids (`list[int]`, *optional*):
            0-based target decoder layers whose outputs (`hidden_states[i + 1]`) are concatenated as context.
            Defaults to the DFlash rule of `build_target_layer_ids`.
        num_target_layers (`int`, defaults to 36):
            Number of decoder layers of the target the drafter was built for.
        mask_token_id (`int`):
            Row of the *target* embedding matrix used for the masked block slots. Never derived from a tokenizer.
        vocab_size, bos_token_id, eos_token_id, pad_token_id:
            Copied from the target so that `generate()` and pipelines accept the drafter as an assistant.
        target_model (`str`, *optional*): Hub id or path of the target the drafter was trained for (model cards).
        draft_vocab (`list[int]`, *optional*):
            A reduced draft vocabulary (docs/algorithm.md §1.6): the target token ids, ascending, that the drafter
            may propose. Drafts are projected with only these rows of the target's LM head, which is most of a
            drafter's cost with a large vocabulary; the target still verifies over its whole vocabulary, so
            outputs stay exact (a token outside it simply cannot be drafted). `None` (the default): the whole
            vocabulary. The official DFlash schema has no place for it: it is saved under `adaflash_config`, which
            SGLang and vLLM ignore (they draft over the whole vocabulary with the same weights).

    DFlash 2 (in-block local convolutions and a top-K candidate selector, `adaflash_hf/dflash2.py`):
        drafter_type (`str`, defaults to `"dflash"`): `"dflash"` (the DFlash drafter) or `"dflash2"`.
        conv_kernel_size (`int`, defaults to 2): taps of each local convolution (the slot itself and the ones before
            it in the block); at most `block_size`.
        conv_group_size (`int`, defaults to 16): channels sharing one dynamic coefficient; divides `hidden_size`.
        selector_rank (`int`, defaults to 256): rank of the selector's bilinear transition.
        selector_top_k (`int`, defaults to 16): unary candidates the selector rescores per draft slot (and the
            branches a draft tree gets per slot).
        The four are the engines' defaults (speculators' `DFlash2SpeculatorConfig`) and are ignored by a `"dflash"`
        drafter. A DFlash 2 drafter drafts over the whole vocabulary (`draft_vocab` must be `None`), as the
        engines require: its codebooks are indexed by target token ids.

    Adaptive length head (AdaFlash "two_model" thresh head, docs/algorithm.md §6):
        use_length_head (`bool`, defaults to `False`): whether the drafter has the head.
        length_head_bottleneck_dim (`int`, defaults to 256): width of the head.
        length_head_direct_len (`bool`, defaults to `True`): the head predicts (accepted + 1) / block_size directly.

    Candidate length policy (how many drafts the target verifies per step):
        length_policy (`str`, *optional*): `"fixed"`, `"adaptive"`, `"confidence"` or `"planned"` (the cost-aware
            planner of `adaflash_hf/generation/planner.py`: each step's width from measured step costs and observed
            acceptance, a plain step when drafting cannot pay; in transformers' own assisted loop it drafts the
            whole block); defaults to `"adaptive"` when the drafter has a length head and `"fixed"` otherwise.
        length_rate (`float`, defaults to 1.3): `candidate_len = clamp(round(pred * block_size * rate), min, bs)`.
        min_candidate_length (`int`, defaults to 1): lower clamp of the candidate length (the anchor counts).
        confidence_threshold (`float`, defaults to 0.3): `"confidence"` stops drafting at the first position where
            `1 - prod(max draft probability)` exceeds it.
    """

    model_type = ADAFLASH_MODEL_TYPE
    default_theta = 1_000_000.0  # the rope_theta of every shipped Qwen3 DFlash drafter

    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    vocab_size: int = 151936
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    block_size: int = 16
    target_layer_ids: list[int] | None = None
    num_target_layers: int = 36
    mask_token_id: int | None = None

    drafter_type: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    use_length_head: bool = False
    length_head_bottleneck_dim: int = 256
    length_head_direct_len: bool = True

    target_model: str | None = None
    draft_vocab: list[int] | None = None

    length_policy: str | None = None
    length_rate: float = 1.3
    min_candidate_length: int = 1
    confidence_threshold: float = 0.3

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.length_policy is None:
            self.length_policy = "adaptive" if self.use_length_head else "fixed"
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """Reads ``config.json`` in any drafter schema (z-lab DFlash and DFlash 2, AdaFlash, speculators, native)
        with the one reader of `adaflash_hf.schema`, so `AdaFlashConfig.from_pretrained` accepts every checkpoint
        `AdaFlashDrafter.from_pretrained` does (PEFT reads a base model's config this way when it saves an adapter)."""
        hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
        kwargs.pop("trust_remote_code", None)  # never needed, never honoured: no repository code runs
        raw, source = read_config_dict(pretrained_model_name_or_path, hub)
        return fields_from_config_dict(raw, source), kwargs

    def validate_architecture(self):
        """Checks that hold for any drafter, independent of the target it is paired with."""
        super().validate_architecture()
        problems = []
        if self.block_size < 2:
            problems.append(f"block_size={self.block_size} must be >= 2 (the anchor plus at least one draft)")
        if not self.target_layer_ids or any(not isinstance(i, int) or i < 0 for i in self.target_layer_ids):
            problems.append(f"target_layer_ids={self.target_layer_ids} must be a non-empty list of ints >= 0")
        elif max(self.target_layer_ids) >= self.num_target_layers:
            problems.append(
                f"target_layer_ids={self.target_layer_ids} has an id >= num_target_layers={self.num_target_layers}; "
                "pass target_layer_ids explicitly for small targets"
            )
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(
                f"mask_token_id={self.mask_token_id} must be a row of the target vocabulary [0, {self.vocab_size}); "
                "for Qwen3 targets it is 151669"
            )
        problems += length_policy_problems(self, self)
        problems += draft_vocab_problems(self.draft_vocab, self.vocab_size)
        problems += dflash2_problems(self)
        if problems:
            raise ValueError("Invalid AdaFlashConfig: " + "; ".join(problems))

    @classmethod
    def from_target_config(
        cls,
        target_config: PreTrainedConfig,
        *,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        use_length_head: bool = False,
        **overrides,
    ) -> AdaFlashConfig:
        """Builds a drafter config for any decoder-only target.

        Hidden size, heads, head_dim, MLP width, norm eps, rope settings, vocabulary and special token ids come from
        the target (its text config for multimodal targets) unless given in ``overrides``, which are applied first,
        so a value the target's config lacks can be passed. Families name these fields differently; without any of
        the MLP width's names the drafter gets ``4 * hidden_size`` (GPT-2's convention), and per-layer-type rope
        settings (Gemma 3 and others) give the drafter, a full-attention model, those of ``full_attention``.

        ``drafter_type="dflash2"`` (an override like any other) builds a DFlash 2 drafter, with the engines' default
        ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k`` unless given.
        """
        text = target_config.get_text_config(decoder=True)

        def read(name):
            try:
                return getattr(text, name, None)
            except Exception:  # e.g. a per-layer attribute whose layers disagree (Gemma 4): no single value to copy
                return None

        def first(*names, default=None):
            values = (read(name) for name in names)
            return next((v for v in values if v is not None), default)

        def required(name, *aliases):
            value = first(name, *aliases)
            if value is None:
                raise ValueError(
                    f"AdaFlashConfig.from_target_config: the {type(text).__name__} has no {name}; pass {name}=... "
                    "as an override"
                )
            return value

        computed = {
            "hidden_size": lambda: required("hidden_size", "n_embd", "d_model"),
            "num_attention_heads": lambda: required("num_attention_heads", "n_head", "n_heads"),
            "intermediate_size": lambda: first(
                "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "d_ff", default=4 * field("hidden_size")
            ),
            "num_key_value_heads": lambda: first("num_key_value_heads", default=field("num_attention_heads")),
            "head_dim": lambda: first("head_dim", default=field("hidden_size") // field("num_attention_heads")),
            "hidden_act": lambda: first("hidden_act", "activation_function", default="silu"),
            "rms_norm_eps": lambda: first("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6),
            "rope_parameters": lambda: _full_attention_rope(read("rope_parameters")),
            "max_position_embeddings": lambda: first("max_position_embeddings", "n_positions", default=2048),
            "vocab_size": lambda: required("vocab_size"),
            "bos_token_id": lambda: read("bos_token_id"),
            "eos_token_id": lambda: read("eos_token_id"),
            "pad_token_id": lambda: read("pad_token_id"),
            "num_target_layers": lambda: required("num_hidden_layers", "n_layer", "num_layers"),
        }

        def field(name):
            return overrides[name] if name in overrides else computed[name]()

        fields = {name: field(name) for name in computed}
        fields["target_model"] = getattr(target_config, "name_or_path", None) or None
        fields.update(overrides)
        return cls(
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids,
            use_length_head=use_length_head,
            **fields,
        )


def _full_attention_rope(rope_parameters: dict | None) -> dict | None:
    """Rope settings for the drafter: per-layer-type settings (``{"full_attention": {...}, ...}``) give those of
    ``full_attention``, the drafter's only attention kind."""
    if isinstance(rope_parameters, dict) and "rope_type" not in rope_parameters:
        per_type = {k: v for k, v in rope_parameters.items() if isinstance(v, dict)}
        if per_type:
            return dict(per_type.get("full_attention", next(iter(per_type.values()))))
    return rope_parameters


@strict(accept_kwargs=True)
class AdaptiveLengthHeadConfig(PreTrainedConfig):
    r"""
    Configuration of a standalone [`AdaptiveLengthHead`]: a length head published on its own, trained on top of a
    frozen drafter, and attached with `drafter.load_length_head(path)`.

    Args:
        hidden_size (`int`, defaults to 4096):
            The drafter's (and so the target's) hidden size.
        bottleneck_dim (`int`, defaults to 256):
            Width of the head.
        block_size (`int`, defaults to 16):
            Block size of the drafter the head was trained for; the head predicts a fraction of it.
        direct_len (`bool`, defaults to `True`):
            The head predicts `(accepted drafts + 1) / block_size` directly.
        base_drafter (`str`, *optional*):
            Hub id or path of the drafter the head was trained on (model cards).
    """

    model_type = "adaflash_length_head"

    hidden_size: int = 4096
    bottleneck_dim: int = 256
    block_size: int = 16
    direct_len: bool = True
    base_drafter: str | None = None


def config_from_dict(raw: dict, source: str = CONFIG_NAME, **overrides) -> AdaFlashConfig:
    """An `AdaFlashConfig` from a ``config.json`` dict of any drafter schema, with ``overrides`` applied before
    validation; a value the config refuses is a `CheckpointError` naming the file."""
    fields = {**fields_from_config_dict(raw, source), **overrides}
    try:
        return AdaFlashConfig(**fields)
    except Exception as error:  # strict dataclass validation: wrong types or values
        raise CheckpointError(f"{source} is malformed: {root_message(error)}") from error


__all__ = [
    "AdaFlashConfig",
    "AdaptiveLengthHeadConfig",
    "LENGTH_POLICIES",
    "build_target_layer_ids",
    "config_from_dict",
    "dflash2_problems",
    "draft_vocab_problems",
    "length_policy_problems",
]
