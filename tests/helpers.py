"""Tiny models built from configs, and checkpoint directories laid out exactly like the Hub repos."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

VOCAB = 128
MASK_ID = VOCAB - 1
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(head_dim=16)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=16, sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict()),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    ),
}


# Tiny sizes for any family's config, under each of the names families give them; a family gets those of its config's
# own fields only, passed to its config class, so derived fields (layer types, head dims) follow.
_TINY = {
    **_COMMON,
    "head_dim": 16,
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_positions": 512,
    "n_inner": 128,
    "n_ctx": 512,
    "rotary_dim": 8,
    "d_model": 64,
    "n_layers": 4,
    "n_heads": 4,
    "num_layers": 4,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    # multi-head latent attention (DeepSeek-V2/V3 style): value heads narrower than query/key heads
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,  # = head_dim, which MLA configs use as the rotary width
    "qk_nope_head_dim": 16,
    "v_head_dim": 8,
}


def tiny_config(family: str, **overrides):
    """A tiny config of any transformers family: the hand-tuned `FAMILIES` ones, else the family's defaults shrunk
    with `_TINY`."""
    if family in FAMILIES:
        config_cls, _, extra = FAMILIES[family]
        config = config_cls(**{**_COMMON, **extra, **overrides})
    else:
        defaults = AutoConfig.for_model(family).to_dict()
        tiny = {k: v for k, v in _TINY.items() if k in defaults}
        if "kv_lora_rank" in defaults:  # multi-head latent attention has as many key/value heads as query heads
            tiny["num_key_value_heads"] = tiny["num_attention_heads"]
        config = AutoConfig.for_model(family, **{**tiny, **overrides})
    config._attn_implementation = "sdpa"
    return config


def tiny_target(family: str = "qwen3", seed: int = 0, **overrides):
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    if family in FAMILIES:
        model = FAMILIES[family][1](config)
    else:
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # older architectures have no sdpa path
            config._attn_implementation = "eager"
            model = AutoModelForCausalLM.from_config(config)
    model.eval()
    # Random tiny models are near-uniform; sharper logits give greedy paths with structure and EOS hits.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def tiny_drafter(
    target,
    num_hidden_layers: int = 2,
    block_size: int = 8,
    target_layer_ids=(0, 2),
    use_length_head: bool = False,
    seed: int = 1,
    mask_token_id: int | None = None,
    **overrides,
):
    torch.manual_seed(seed)
    if mask_token_id is None:
        mask_token_id = target.config.vocab_size - 1
    config = AdaFlashConfig.from_target_config(
        target.config,
        num_hidden_layers=num_hidden_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        use_length_head=use_length_head,
        **overrides,
    )
    return AdaFlashDrafter(config).eval()


# ------------------------------------------------------------------- Hub-like checkpoint directories

# The official z-lab config of z-lab/Qwen3-8B-DFlash-b16 (docs/algorithm.md §2.1), at a tiny geometry.
ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 8,
    "bos_token_id": 0,
    "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]},
    "dtype": "bfloat16",
    "eos_token_id": 1,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 512,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 4,
    "pad_token_id": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}
ADAFLASH_HEAD_FLAGS = {
    "use_thresh_head_two_model": True,
    "thresh_head_bottleneck_dim": 32,
    "thresh_head_direct_len": True,
}

# A repository file that must never run: loading executes no code from the repo.
DFLASH_PY = "raise RuntimeError('remote code from the checkpoint repository was executed')\n"


def official_tensor_shapes(config: dict, with_head: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of docs/algorithm.md §2.3, derived from the config alone."""
    h, hd, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    k = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (nq * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if with_head:
        b = config["dflash_config"]["thresh_head_bottleneck_dim"]
        shapes.update(
            {
                "thresh_head_two_model.down.weight": (b, 2 * h),
                "thresh_head_two_model.down.bias": (b,),
                "thresh_head_two_model.res.0.weight": (b, b),
                "thresh_head_two_model.res.0.bias": (b,),
                "thresh_head_two_model.out.weight": (1, b),
                "thresh_head_two_model.out.bias": (1,),
            }
        )
    return shapes


def write_hub_checkpoint(directory, kind: str = "dflash", seed: int = 0) -> dict[str, torch.Tensor]:
    """Writes a z-lab DFlash (`kind="dflash"`) or AdaFlash (`kind="adaflash"`) repo; returns its tensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(ZLAB_CONFIG))
    if kind == "adaflash":
        config["dflash_config"].update(ADAFLASH_HEAD_FLAGS)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: (
            torch.randn(shape, generator=gen) * (0.05 if len(shape) > 1 else 1.0)
            + (1.0 if len(shape) == 1 and "norm" in name else 0.0)
        ).to(torch.bfloat16)
        for name, shape in official_tensor_shapes(config, with_head=kind == "adaflash").items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "dflash.py").write_text(DFLASH_PY)
    (directory / "README.md").write_text("---\nlicense: mit\n---\n# DFlash drafter\n")
    return tensors


# ------------------------------------------------------------------- oracle drafters


class OracleDrafter(AdaFlashDrafter):
    """A drafter that drafts known future tokens: the reference continuation of each row, optionally corrupted.

    It runs the real drafter forward (so its cache evolves exactly like a real drafter's), then replaces the
    drafted positions' hidden states with vectors whose projection by the target's lm_head has the wanted argmax
    by a wide margin. `corrupt(row, anchor_position) -> draft indices (1-based)` forces rejections where wanted.
    Rows are tracked across finished-row removal through `AdaFlashCandidateGenerator.select_rows` (see
    `track_rows`).
    """

    def setup(self, target, references, corrupt=None, margin: float = 60.0):
        weight = target.get_output_embeddings().weight.detach().float()
        solution = torch.linalg.lstsq(weight, margin * torch.eye(weight.shape[0])).solution  # [H, V]
        assert torch.equal((weight @ solution).argmax(0), torch.arange(weight.shape[0])), "oracle cannot force tokens"
        self.token_hidden = solution.T.contiguous()
        self.references = [list(map(int, r)) for r in references]
        self.corrupt = corrupt or (lambda row, anchor: ())
        self._call_cache = None
        self._probe = (None, [])  # a probe's own cache and the rows it drafts
        return self

    def _follow(self, cache):
        """A new generate() call brings a new drafter cache: every reference row is back in the batch."""
        if cache is not self._call_cache and cache is not self._probe[0]:
            self._call_cache, self.rows = cache, list(range(len(self.references)))

    def on_select_rows(self, index, cache, source=None):
        """Rows `index` of the batch drafting with `source` (default: `cache` itself) now draft with `cache` (a
        probe of some rows drafts them in a cache of its own)."""
        self._follow(cache if source is None else source)
        rows = [self.rows[i] for i in index.tolist()]
        if source is None:
            self.rows = rows
        else:
            self._probe = (cache, rows)

    def rows_of(self, cache) -> list[int]:
        """The reference rows drafting with `cache`, slot by slot."""
        return self._probe[1] if cache is self._probe[0] else self.rows

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, attention_mask=None, cache=None, **kw):
        self._follow(cache)
        out = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache, **kw)
        bs, vocab = self.config.block_size, self.token_hidden.shape[0]
        wanted = torch.zeros(noise_embeds.shape[0], bs - 1, dtype=torch.long)
        for slot, row in enumerate(self.rows_of(cache)):
            reference, anchor = self.references[row], int(position_ids[slot, -bs])
            for k in range(1, bs):
                token = reference[anchor + k] if anchor + k < len(reference) else 3
                wanted[slot, k - 1] = (token + 1) % vocab if k in self.corrupt(row, anchor) else token
        hidden = out.last_hidden_state.clone()
        hidden[:, 1:] = self.token_hidden[wanted].to(hidden.dtype)
        out.last_hidden_state = hidden
        return out


class TickingClock:
    """Stands for `time` in the planner's module: every reading is one second after the last. A plain step (its
    start and its end read) then costs one second and a drafted step two (the draft's end read between), whatever
    the machine's load: a test whose oracle must make drafting pay does not hang on the tiny models' timings, where
    a draft costs about a plain step and drafting pays by a small margin that a busy machine can turn."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def oracle_drafter(target, references, corrupt=None, **kwargs) -> OracleDrafter:
    drafter = tiny_drafter(target, **kwargs)
    oracle = OracleDrafter(drafter.config)
    oracle.load_state_dict(drafter.state_dict())
    return oracle.eval().setup(target, references, corrupt)
