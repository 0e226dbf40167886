"""`AdaFlashConfig`: the geometry of a DFlash block-diffusion drafter plus AdaFlash's adaptive length head.

The drafter is a small Qwen3-style non-causal transformer that reads hidden states of a few target layers
(``target_layer_ids``) and drafts a block of ``block_size`` tokens in one forward pass (spec §1). It has no
embeddings and no LM head of its own: it borrows the target's, so ``hidden_size`` and ``vocab_size`` must equal
the target's.

The official z-lab DFlash and AdaFlash checkpoints store the same facts as a ``Qwen3Config`` plus a nested
``dflash_config`` dict; :mod:`adaflash_hf.formats` converts between that schema and this class.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

LENGTH_POLICIES = ("fixed", "adaptive", "confidence")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the drafter (spec §1.2).

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

    Adaptive length head (AdaFlash "two_model" thresh head, spec §6):
        use_length_head (`bool`, defaults to `False`): whether the drafter has the head.
        length_head_bottleneck_dim (`int`, defaults to 256): width of the head.
        length_head_direct_len (`bool`, defaults to `True`): the head predicts (accepted + 1) / block_size directly.

    Candidate length policy (how many drafts the target verifies per step):
        length_policy (`str`, *optional*): `"fixed"`, `"adaptive"` or `"confidence"`; defaults to `"adaptive"`
            when the drafter has a length head and `"fixed"` otherwise.
        length_rate (`float`, defaults to 1.3): `candidate_len = clamp(round(pred * block_size * rate), min, bs)`.
        min_candidate_length (`int`, defaults to 1): lower clamp of the candidate length (the anchor counts).
        confidence_threshold (`float`, defaults to 0.3): `"confidence"` stops drafting at the first position where
            `1 - prod(max draft probability)` exceeds it.
    """

    model_type = "adaflash"
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

    use_length_head: bool = False
    length_head_bottleneck_dim: int = 256
    length_head_direct_len: bool = True

    target_model: str | None = None

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
        """Also reads the official z-lab DFlash schema (``model_type: qwen3`` with a ``dflash_config``), so
        `AdaFlashConfig.from_pretrained` accepts every checkpoint `AdaFlashDrafter.from_pretrained` does (PEFT reads
        a base model's config this way when it saves an adapter)."""
        from .formats import fields_from_dflash_dict, is_dflash_dict

        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") != cls.model_type and is_dflash_dict(config_dict):
            config_dict = fields_from_dflash_dict(config_dict, f"{pretrained_model_name_or_path}/config.json")
        return config_dict, kwargs

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
        if self.length_policy not in LENGTH_POLICIES:
            problems.append(f"length_policy={self.length_policy!r} must be one of {LENGTH_POLICIES}")
        if self.length_policy == "adaptive" and not self.use_length_head:
            problems.append(
                "length_policy='adaptive' needs a length head: load one with drafter.load_length_head(path) "
                "or choose length_policy='fixed' or 'confidence'"
            )
        if not 1 <= self.min_candidate_length <= self.block_size:
            problems.append(f"min_candidate_length={self.min_candidate_length} must lie in [1, block_size]")
        if self.length_rate <= 0:
            problems.append(f"length_rate={self.length_rate} must be > 0")
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


__all__ = ["AdaFlashConfig", "LENGTH_POLICIES", "build_target_layer_ids"]
