"""`AdaFlashDrafter` (the DFlash or DFlash 2 block-diffusion drafter) and `AdaptiveLengthHead` (the length head).

The decoder layers, RMSNorm and rotary embedding are transformers' own DFlash modules (those of
`MuseGlimmerAssistantModel`): they implement exactly the DFlash attention of docs/algorithm.md §1.3 (queries from the
block, keys/values from ``[context ; block]``, q/k norms, rope on absolute positions, non-causal) under the z-lab
parameter names, so official checkpoints load 1:1 and the in-library DFlash path is our numerical reference.
"""

import os
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DFlashCache
from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
    MuseGlimmerAssistantDecoderLayer as DFlashDecoderLayer,
)
from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
    MuseGlimmerAssistantRMSNorm as DFlashRMSNorm,
)
from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
    MuseGlimmerAssistantRotaryEmbedding as DFlashRotaryEmbedding,
)

from .configuration import AdaFlashConfig, AdaptiveLengthHeadConfig
from .dflash2 import CandidateSelector, DFlash2DecoderLayer, GroupedDynamicConv
from .formats import DrafterCheckpoint, load_length_head, save_keywords, staged_save, write_format_files
from .hub import push_drafter_to_hub, push_length_head_to_hub
from .schema import DFLASH2_KEYS


class AdaptiveLengthHead(PreTrainedModel):
    """AdaFlash's "two_model" thresh head (docs/algorithm.md §6.1).

    Reads the drafter's final-normed block hidden states ``x`` of shape ``[..., block_size, H]`` (anchor included)
    and returns ``pred`` of shape ``[...]`` in (0, 1): the predicted ``(accepted drafts + 1) / block_size``.
    Tensor names (``down``, ``res.0``, ``out``) are those of the AdaFlash checkpoints.
    """

    config: AdaptiveLengthHeadConfig
    main_input_name = "hidden_states"

    def __init__(self, config: AdaptiveLengthHeadConfig):
        super().__init__(config)
        width = config.bottleneck_dim
        self.down = nn.Linear(2 * config.hidden_size, width)
        self.res = nn.Sequential(nn.Linear(width, width), nn.SiLU())
        self.out = nn.Linear(width, 1)
        self.post_init()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        features = torch.cat([hidden_states.mean(dim=-2), hidden_states[..., -1, :]], dim=-1)
        hidden = nn.functional.silu(self.down(features))
        hidden = hidden + self.res(hidden)
        return torch.sigmoid(self.out(hidden)).squeeze(-1)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Saves the head and uploads it with a README rendered from `adaflash_hf/templates/length_head.md`."""
        return push_length_head_to_hub(self, repo_id, **kwargs)


@dataclass
class AdaFlashDrafterOutput(BaseModelOutputWithPast):
    r"""
    last_hidden_state (`torch.FloatTensor` of shape `(batch_size, num_blocks * block_size, hidden_size)`):
        Final-normed hidden states of the block positions, ready for the target's `lm_head`. Position 0 of each
        block is the anchor; position k predicts the token at absolute position `anchor + k`.
    cache (`DFlashCache`, *optional*): the drafter cache, holding the context K/V (and the block rows until cropped).
    length_prediction (`torch.FloatTensor` of shape `(batch_size, num_blocks)`, *optional*):
        The adaptive length head's prediction of `(accepted + 1) / block_size` per block, when the drafter has a head.
        Computed on detached hidden states, so its loss never reaches the drafter (docs/algorithm.md §6.3).
    """

    length_prediction: torch.FloatTensor | None = None


# Layer kinds whose cache cannot be rolled back by cropping after a rejected draft.
_NON_CROPPABLE_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "hybrid")


class AdaFlashPreTrainedModel(PreTrainedModel):
    config: AdaFlashConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["MuseGlimmerAssistantDecoderLayer", "DFlash2DecoderLayer"]
    # speculators checkpoints may carry the verifier's tensors and their vocabulary maps (`formats.SPECULATORS_EXTRAS`)
    _keys_to_ignore_on_load_unexpected = [
        r"^(embed_tokens|lm_head|verifier_lm_head|verifier_norm)\.weight$",
        r"^(t2d|d2t)$",
    ]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    main_input_name = "noise_embeds"

    def _init_weights(self, module):
        """DFlash 2's modules start as the engines start them: identity convolutions (the drafter then computes what
        its DFlash form does) and normal(0, initializer_range) selector tables."""
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicConv):
            base = torch.zeros_like(module.base_kernel)
            base[:, 0] = 1.0
            init.copy_(module.base_kernel, base)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            std = self.config.initializer_range
            for weight in (module.predecessor_codebook, module.successor_codebook, module.hidden_projection.weight):
                init.normal_(weight, mean=0.0, std=std)


class AdaFlashDrafter(AdaFlashPreTrainedModel):
    """The DFlash drafter (docs/algorithm.md §1), optionally with AdaFlash's adaptive length head (docs/algorithm.md
    §6).

    It has no embeddings and no LM head: callers embed the block with the target's input embeddings and project
    `last_hidden_state` with the target's output embeddings. Load any official z-lab DFlash or AdaFlash checkpoint,
    or one of ours, with `AdaFlashDrafter.from_pretrained(path_or_repo_id)` (see `adaflash_hf.schema` and
    `adaflash_hf.formats`).
    """

    # Duck-typed marker read by the generate() routing: it survives PEFT wrapping, `isinstance` does not.
    _is_adaflash_drafter = True

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "generation_config":
                raise
            # transformers' own assisted decoding reads it first: the routing to AdaFlash is not installed
            raise AttributeError(
                "An AdaFlashDrafter is not a transformers assistant model: generate(assistant_model=drafter) reaches "
                "AdaFlash decoding only while adaflash_hf's routing is installed, and it is not (adaflash_hf."
                "uninstall() was called, or install() warned). Call adaflash_hf.install(), or use the patch-free "
                "entry point: target.generate(**inputs, custom_generate=adaflash_hf.generate_loop, drafter=drafter)."
            ) from None

    def __init__(self, config: AdaFlashConfig):
        super().__init__(config)
        layer_class = DFlash2DecoderLayer if config.drafter_type == "dflash2" else DFlashDecoderLayer
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config=config)
        self.candidate_selector = (
            CandidateSelector(config.vocab_size, config.hidden_size, config.selector_rank, config.selector_top_k)
            if config.drafter_type == "dflash2"
            else None
        )
        self.thresh_head_two_model = AdaptiveLengthHead(self._length_head_config()) if config.use_length_head else None
        self.gradient_checkpointing = False
        self.post_init()

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        cache: DFlashCache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> AdaFlashDrafterOutput:
        r"""
        noise_embeds (`[B, Q, H]`): target embeddings of the block(s): `[anchor, mask * (block_size - 1)]` per block.
        context_hidden_states (`[B, C, K*H]`): concatenated target features (`hidden_states[i + 1]` for each id in
            `target_layer_ids`) of the C context positions not yet in `cache`.
        position_ids (`[B, C + Q]`): absolute positions of the new context rows followed by the block rows.
        attention_mask: `None` (every block row sees all context and its block), a 2D `[B, past + C + Q]` padding
            mask, or a prepared 4D `[B, 1, Q, past + C + Q]` mask (boolean: True = attend), e.g. the block-sparse
            training mask; a dict `{layer_type: mask}` is used as is.
        cache (`DFlashCache`): K/V of `[context ; block]` are appended per layer; callers crop the block rows.
        """
        self._check_context_width(context_hidden_states)
        dtype = self.fc.weight.dtype
        noise_embeds = noise_embeds.to(dtype)
        if use_cache and cache is None:
            cache = DFlashCache(config=self.config)
        context = self.hidden_norm(self.fc(context_hidden_states.to(dtype)))
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + context.shape[1] + noise_embeds.shape[1], device=context.device)
            position_ids = position_ids.unsqueeze(0)
        masks = self._attention_masks(noise_embeds, attention_mask, cache)

        hidden = noise_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden = layer(
                hidden,
                context_hidden_states=context,
                position_embeddings=position_embeddings,
                attention_mask=masks[layer_type],
                cache=cache,
                **kwargs,
            )
        hidden = self.norm(hidden)
        return AdaFlashDrafterOutput(
            last_hidden_state=hidden, cache=cache, length_prediction=self._predict_length(hidden)
        )

    def _check_context_width(self, context_hidden_states: torch.Tensor):
        expected = self.fc.in_features
        if context_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"context_hidden_states has width {context_hidden_states.shape[-1]}, but the drafter expects "
                f"{expected} = len(target_layer_ids={self.config.target_layer_ids}) * "
                f"hidden_size={self.config.hidden_size}: "
                "concatenate target hidden_states[i + 1] for each id in drafter.config.target_layer_ids"
            )

    def _attention_masks(self, noise_embeds, attention_mask, cache) -> dict:
        if isinstance(attention_mask, dict):
            return attention_mask
        if attention_mask is not None and attention_mask.dim() == 4:
            if attention_mask.dtype == torch.bool:
                # An additive mask is exact for every backend; eager would *add* a boolean mask to the scores.
                # finfo.min (not -inf) keeps fully masked rows (padded blocks) finite instead of NaN.
                blocked = torch.finfo(noise_embeds.dtype).min
                attention_mask = torch.zeros_like(attention_mask, dtype=noise_embeds.dtype).masked_fill(
                    ~attention_mask, blocked
                )
            return dict.fromkeys(("full_attention", "sliding_attention"), attention_mask)
        # Every cached context position precedes the block, so "bidirectional" is exactly "all context + the block".
        kwargs = {
            "config": self.config,
            "inputs_embeds": noise_embeds,
            "attention_mask": attention_mask,
            "cache": cache,
        }
        builders = {
            "full_attention": create_bidirectional_mask,
            "sliding_attention": create_bidirectional_sliding_window_mask,
        }
        return {kind: builders[kind](**kwargs) for kind in set(self.config.layer_types)}

    def _predict_length(self, hidden: torch.Tensor) -> torch.Tensor | None:
        head, block_size = self.thresh_head_two_model, self.config.block_size
        if head is None or hidden.shape[1] % block_size:
            return None
        blocks = hidden.detach().unflatten(1, (hidden.shape[1] // block_size, block_size))
        return head(blocks.to(head.down.weight.dtype))

    # ------------------------------------------------------------------ length head

    @property
    def length_head(self) -> AdaptiveLengthHead | None:
        """The adaptive length head (stored as `thresh_head_two_model`, its name in AdaFlash checkpoints)."""
        return self.thresh_head_two_model

    def _length_head_config(self) -> AdaptiveLengthHeadConfig:
        return AdaptiveLengthHeadConfig(
            hidden_size=self.config.hidden_size,
            bottleneck_dim=self.config.length_head_bottleneck_dim,
            block_size=self.config.block_size,
            direct_len=self.config.length_head_direct_len,
            base_drafter=self.config.name_or_path or None,
        )

    def add_length_head(self, head: AdaptiveLengthHead | None = None) -> AdaptiveLengthHead:
        """Attaches `head` (or a freshly initialised, untrained one to train) and makes `adaptive` the policy."""
        if head is None:
            head = AdaptiveLengthHead(self._length_head_config())
        else:
            self._check_length_head(head)
        ref = self.fc.weight
        self.thresh_head_two_model = head.to(device=ref.device, dtype=ref.dtype)
        self.config.use_length_head = True
        self.config.length_head_bottleneck_dim = head.config.bottleneck_dim
        self.config.length_head_direct_len = head.config.direct_len
        self.config.length_policy = "adaptive"
        return head

    def load_length_head(self, path_or_repo_id: str | os.PathLike, **kwargs) -> AdaptiveLengthHead:
        """Loads a separately published length head (`AdaptiveLengthHead.save_pretrained`) and attaches it."""
        return self.add_length_head(load_length_head(AdaptiveLengthHead, path_or_repo_id, **kwargs))

    def _check_length_head(self, head: AdaptiveLengthHead):
        mine, theirs = self.config, head.config
        if theirs.hidden_size != mine.hidden_size or theirs.block_size != mine.block_size:
            raise ValueError(
                f"Length head was trained for hidden_size={theirs.hidden_size}, block_size={theirs.block_size}; "
                f"this drafter has hidden_size={mine.hidden_size}, block_size={mine.block_size}. "
                "Use a head trained on this drafter (examples/scripts/init_length_head.py)."
            )

    # ------------------------------------------------------------------ DFlash 2

    def to_dflash2(self, **fields) -> "AdaFlashDrafter":
        """A DFlash 2 drafter grown from this DFlash one, to train further (`OPDTrainer`): the same weights, identity
        convolutions (so it drafts exactly as this drafter until trained) and a fresh candidate selector.

        ``fields``: DFlash 2 settings other than the engines' defaults (``conv_kernel_size``, ``conv_group_size``,
        ``selector_rank``, ``selector_top_k``).
        """
        if self.config.drafter_type == "dflash2":
            raise ValueError("This drafter is already a DFlash 2 drafter.")
        unknown = sorted(set(fields) - set(DFLASH2_KEYS))
        if unknown:
            raise ValueError(f"to_dflash2 takes only {DFLASH2_KEYS}; got {unknown}")
        config = AdaFlashConfig.from_dict({**self.config.to_dict(), **fields, "drafter_type": "dflash2"})
        config.validate_architecture()
        reference = self.fc.weight
        grown = type(self)(config).to(device=reference.device, dtype=reference.dtype)
        missing, unexpected = grown.load_state_dict(self.state_dict(), strict=False)
        new = ("attention_conv.", "mlp_conv.", "candidate_selector.")
        if unexpected or any(not any(part in name for part in new) for name in missing):
            raise RuntimeError(f"to_dflash2: tensors do not carry over (missing {missing}, unexpected {unexpected})")
        return grown

    # ------------------------------------------------------------------ target pairing

    def check_compatible(self, target: PreTrainedModel) -> None:
        """Raises one `ValueError` naming every mismatch between this drafter and `target`; warns when the target
        has another depth than the one the drafter was built for."""
        config = self.config
        text = target.config.get_text_config(decoder=True)
        problems = []
        if text.hidden_size != config.hidden_size:
            problems.append(
                f"hidden size: drafter {config.hidden_size} vs target {text.hidden_size} (the drafter reads the "
                "target's hidden states and embeddings, so it must be built for this target: "
                "AdaFlashConfig.from_target_config)"
            )
        rows = target.get_input_embeddings().weight.shape[0]
        if config.vocab_size != rows:
            problems.append(f"vocabulary: drafter vocab_size {config.vocab_size} vs target embedding rows {rows}")
        if not 0 <= (config.mask_token_id if config.mask_token_id is not None else -1) < rows:
            problems.append(f"mask_token_id {config.mask_token_id} is not a row of the target embeddings [0, {rows})")
        layers = text.num_hidden_layers
        bad_ids = [i for i in config.target_layer_ids if not 0 <= i < layers]
        if bad_ids:
            problems.append(
                f"target_layer_ids {bad_ids} are not layers of the target (it has {layers}: 0..{layers - 1})"
            )
        kinds = sorted({t for t in (getattr(text, "layer_types", None) or []) if t.startswith(_NON_CROPPABLE_LAYERS)})
        if kinds or getattr(target, "_is_stateful", False):
            problems.append(
                f"the target has {kinds or 'stateful'} layers whose cache cannot be cropped after a rejected draft "
                "(hybrid linear-attention/SSM models are not supported by speculative decoding in transformers)"
            )
        if problems:
            raise ValueError("Drafter and target are incompatible: " + "; ".join(problems))
        if config.num_target_layers != layers:
            warnings.warn(
                f"The drafter was built for a target with {config.num_target_layers} layers; this one has {layers}. "
                "Acceptance will be poor unless the drafter was trained on this target.",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ formats

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Loads an official z-lab DFlash, DFlash 2 or AdaFlash checkpoint, a `speculators` DFlash or DFlash 2 one,
        or one of ours, from the Hub or a local dir.

        Never executes code from the repository and never unpickles (safetensors only). Accepts the usual
        `from_pretrained` keywords (`dtype`, `device_map`, `revision`, `token`, `cache_dir`, `local_files_only`)
        plus config overrides (e.g. `length_policy="confidence"`).

        The checkpoint is checked first (`formats.DrafterCheckpoint`: its config in any schema, its weight files
        against that config), then loaded once by transformers' own `from_pretrained` with the checked config.
        """
        checkpoint = DrafterCheckpoint.check(cls, pretrained_model_name_or_path, kwargs)
        model = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, **checkpoint.from_pretrained_kwargs()
        )
        return checkpoint.finish(model)

    def save_pretrained(self, save_directory, *args, save_format: str = "dflash", target_lm_head=None, **kwargs):
        """Saves atomically in the official DFlash schema (`save_format="dflash"`, read by SGLang, vLLM and
        z-lab code; z-lab's DFlash 2 schema for a DFlash 2 drafter), in the native schema (`save_format="adaflash"`,
        read by `AutoModel` after `import adaflash_hf`) or in the `speculators` library's (`save_format=
        "speculators"`, which vLLM serves; its length head goes to `length_head/` beside it, and a reduced draft
        vocabulary needs `target_lm_head=target.get_output_embeddings()`). All use the official tensor names.

        transformers' own `save_pretrained` writes the checkpoint (keywords such as `max_shard_size` work as
        usual); `formats.write_format_files` then converts it to the format, before it replaces the folder's
        content."""
        kwargs = save_keywords(self, save_format, target_lm_head, kwargs)
        with staged_save(save_directory) as staging:
            super().save_pretrained(staging, *args, **kwargs)
            write_format_files(self, staging, save_format)

    def push_to_hub(self, repo_id: str, *, card_data: dict | None = None, **kwargs):
        """Saves, renders a model card from `adaflash_hf/templates/drafter.md` and uploads (see `adaflash_hf.hub`)."""
        return push_drafter_to_hub(self, repo_id, card_data=card_data, **kwargs)


__all__ = [
    "AdaFlashDrafter",
    "AdaFlashDrafterOutput",
    "AdaFlashPreTrainedModel",
    "AdaptiveLengthHead",
]
