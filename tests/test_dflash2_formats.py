"""DFlash 2 and speculators checkpoints: the engines' layouts load (strictly, without running repository code), every
save format round-trips bit-exact, and a corrupted DFlash 2 checkpoint is one `CheckpointError` naming the fix."""

import json

import pytest
import torch
from helpers import DFLASH_PY, MASK_ID, VOCAB, ZLAB_CONFIG, tiny_drafter, tiny_target
from safetensors.torch import load_file, save_file

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter, CheckpointError

DFLASH2 = dict(drafter_type="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=16, conv_kernel_size=2)

# z-lab's DFlash 2 schema (its dflash repository's DFlash 2 config fixture), at ZLAB_CONFIG's tiny geometry.
ZLAB_DFLASH2_CONFIG = {
    **{k: v for k, v in ZLAB_CONFIG.items() if k != "block_size"},
    "architectures": ["DFlash2DraftModel"],
    "is_causal": False,
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "mask_token_id": MASK_ID,
        "selector_rank": 8,
        "selector_top_k": 4,
        "target_layer_ids": [0, 2],
    },
}

# What speculators 0.9.0 writes for DFlash2DraftModel.save_pretrained (its auto_map and config.py included).
SPECULATORS_DFLASH2_CONFIG = {
    "architectures": ["DFlash2DraftModel"],
    "auto_map": {"": "config.DFlash2SpeculatorConfig"},
    "aux_hidden_state_layer_ids": [1, 3],
    "block_size": 8,
    "conv_group_size": 16,
    "conv_kernel_size": 2,
    "draft_vocab_size": VOCAB,
    "dtype": "float32",
    "mask_token_id": MASK_ID,
    "sample_from_anchor": False,
    "selector_rank": 8,
    "selector_top_k": 4,
    "sliding_window_non_causal": True,
    "speculators_config": {
        "algorithm": "dflash2",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 7, "verifier_accept_k": 1}
        ],
        "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"},
    },
    "speculators_model_type": "dflash2",
    "speculators_version": "0.9.0",
    "target_hidden_size": None,
    "tie_word_embeddings": False,
    # a diff dict: fields at Qwen3Config's defaults are absent (rms_norm_eps, hidden_act, ...)
    "transformer_layer_config": {
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 512,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "vocab_size": VOCAB,
    },
    "transformers_version": "5.19.0",
}
SPECULATORS_DFLASH_CONFIG = {
    **{k: v for k, v in SPECULATORS_DFLASH2_CONFIG.items() if k not in ("conv_group_size", "conv_kernel_size")},
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"": "config.DFlashSpeculatorConfig"},
    "speculators_model_type": "dflash",
    "sliding_window_non_causal": False,
}
for key in ("selector_rank", "selector_top_k"):
    del SPECULATORS_DFLASH_CONFIG[key]
SPECULATORS_DFLASH_CONFIG["speculators_config"] = {
    **SPECULATORS_DFLASH2_CONFIG["speculators_config"],
    "algorithm": "dflash",
}
CONFIG_PY = "raise RuntimeError('remote code from the speculators checkpoint was executed')\n"


def _weights(config: dict, drafter_type: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the engines' tensor names for a tiny drafter of `drafter_type`."""
    torch.manual_seed(seed)
    extra = DFLASH2 if drafter_type == "dflash2" else {}
    geometry = AdaFlashConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, mask_token_id=MASK_ID, block_size=8, target_layer_ids=[0, 2],
        num_target_layers=4, **extra,
    )  # fmt: skip
    return {name: torch.randn(t.shape) * 0.05 for name, t in AdaFlashDrafter(geometry).state_dict().items()}


def write_layout(directory, config: dict, drafter_type: str, extras: dict | None = None) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _weights(config, drafter_type)
    save_file({**tensors, **(extras or {})}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "dflash.py").write_text(DFLASH_PY)
    (directory / "config.py").write_text(CONFIG_PY)
    return tensors


def _assert_loaded(drafter: AdaFlashDrafter, tensors: dict):
    state = drafter.state_dict()
    assert sorted(state) == sorted(tensors)  # strict: nothing missing, nothing unexpected
    assert all(torch.equal(state[k], tensors[k]) for k in tensors)


# ------------------------------------------------------------------ the engines' layouts


def test_zlab_dflash2_layout_loads(tmp_path):
    tensors = write_layout(tmp_path, ZLAB_DFLASH2_CONFIG, "dflash2")
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    config = drafter.config
    assert (config.drafter_type, config.block_size, config.target_layer_ids) == ("dflash2", 8, [0, 2])
    assert (config.selector_rank, config.selector_top_k, config.conv_group_size) == (8, 4, 16)
    _assert_loaded(drafter, tensors)
    assert AdaFlashConfig.from_pretrained(tmp_path).drafter_type == "dflash2"


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_speculators_layouts_load(tmp_path, kind):
    config = SPECULATORS_DFLASH2_CONFIG if kind == "dflash2" else SPECULATORS_DFLASH_CONFIG
    verifier_tensors = {  # what older speculators saves kept: the verifier's, supplied by the target here
        "embed_tokens.weight": torch.zeros(VOCAB, 64),
        "verifier_norm.weight": torch.ones(64),
        "verifier_lm_head.weight": torch.zeros(VOCAB, 64),
    }
    tensors = write_layout(tmp_path, config, kind, verifier_tensors)
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    # aux_hidden_state_layer_ids count the target's hidden_states tuple: layer i is hidden_states[i + 1]
    assert drafter.config.target_layer_ids == [0, 2]
    assert drafter.config.drafter_type == kind and drafter.config.target_model == "Qwen/Qwen3-8B"
    # the diff dict's absent fields take Qwen3Config's defaults
    assert drafter.config.rms_norm_eps == 1e-6 and drafter.config.hidden_act == "silu"
    _assert_loaded(drafter, tensors)
    # the config class reads the file with the same reader and schema mapping (PEFT reads a base model's config so)
    read = AdaFlashConfig.from_pretrained(tmp_path)
    loaded = {key: value for key, value in drafter.config.to_diff_dict().items() if key != "dtype"}
    assert read.to_diff_dict() == loaded


def test_a_dflash_checkpoint_loaded_as_dflash2_names_to_dflash2(tmp_path):
    write_layout(tmp_path, ZLAB_CONFIG, "dflash")
    with pytest.raises(CheckpointError, match=r"missing tensors.*candidate_selector.*to_dflash2\(\)"):
        AdaFlashDrafter.from_pretrained(tmp_path, drafter_type="dflash2")


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("save_format", ["dflash", "adaflash", "speculators"])
@pytest.mark.parametrize("drafter_type", ["dflash", "dflash2"])
@pytest.mark.parametrize("use_length_head", [False, True])
def test_every_format_round_trips_bit_exact(tmp_path, save_format, drafter_type, use_length_head):
    extra = DFLASH2 if drafter_type == "dflash2" else {}
    drafter = tiny_drafter(tiny_target(), use_length_head=use_length_head, length_policy="confidence", **extra)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)  # not the identity convolutions of a fresh drafter
    drafter.save_pretrained(tmp_path, save_format=save_format)
    loaded = AdaFlashDrafter.from_pretrained(tmp_path)
    _assert_loaded(loaded, drafter.state_dict())
    for field in ("drafter_type", "target_layer_ids", "num_target_layers", "block_size", "mask_token_id",
                  "selector_rank", "selector_top_k", "conv_group_size", "conv_kernel_size", "use_length_head",
                  "length_policy", "rms_norm_eps", "rope_parameters"):  # fmt: skip
        assert getattr(loaded.config, field) == getattr(drafter.config, field), field
    if save_format == "speculators":
        written = load_file(tmp_path / "model.safetensors")
        assert not any(name.startswith("thresh_head_two_model.") for name in written)  # the head is its own artifact
        assert (tmp_path / "length_head" / "config.json").exists() == use_length_head
        raw = json.loads((tmp_path / "config.json").read_text())
        assert raw["speculators_model_type"] == drafter_type and raw["aux_hidden_state_layer_ids"] == [1, 3]
    elif save_format == "dflash":
        raw = json.loads((tmp_path / "config.json").read_text())
        assert raw["architectures"] == ["DFlash2DraftModel" if drafter_type == "dflash2" else "DFlashDraftModel"]


@pytest.mark.parametrize("save_format", ["dflash", "speculators"])
def test_a_format_save_takes_transformers_save_keywords(tmp_path, save_format):
    # every format is transformers' own save plus a conversion, so its keywords (sharding here) work in each
    drafter = tiny_drafter(tiny_target(), use_length_head=True, length_head_bottleneck_dim=32)
    drafter.save_pretrained(tmp_path, save_format=save_format, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    _assert_loaded(AdaFlashDrafter.from_pretrained(tmp_path), drafter.state_dict())


def test_speculators_draft_vocabulary_round_trips_as_t2d_and_d2t(tmp_path):
    target = tiny_target()
    vocab = list(range(0, VOCAB, 3))
    drafter = tiny_drafter(target, draft_vocab=vocab)
    with pytest.raises(ValueError, match="target_lm_head=target.get_output_embeddings"):
        drafter.save_pretrained(tmp_path, save_format="speculators")
    drafter.save_pretrained(tmp_path, save_format="speculators", target_lm_head=target.get_output_embeddings())
    written = load_file(tmp_path / "model.safetensors")
    assert written["t2d"].dtype == torch.bool and int(written["t2d"].sum()) == len(vocab)
    assert (torch.arange(len(vocab)) + written["d2t"]).tolist() == vocab  # speculators' offsets
    assert torch.equal(written["lm_head.weight"], target.get_output_embeddings().weight[vocab])
    loaded = AdaFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab == vocab
    _assert_loaded(loaded, drafter.state_dict())


def test_to_dflash2_drafts_exactly_as_the_dflash_drafter_until_trained():
    drafter = tiny_drafter(tiny_target())
    grown = drafter.to_dflash2(selector_rank=8, selector_top_k=4)
    assert grown.config.drafter_type == "dflash2" and drafter.config.drafter_type == "dflash"
    noise, context = torch.randn(2, 16, 64), torch.randn(2, 5, 128)
    expected = drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state
    torch.testing.assert_close(grown(noise_embeds=noise, context_hidden_states=context).last_hidden_state, expected)
    with pytest.raises(ValueError, match="already a DFlash 2"):
        grown.to_dflash2()


def test_from_target_config_builds_dflash2_with_the_engines_defaults():
    target = tiny_target()
    config = AdaFlashConfig.from_target_config(
        target.config, mask_token_id=MASK_ID, target_layer_ids=[0, 2], drafter_type="dflash2"
    )
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    drafter = AdaFlashDrafter(config)
    assert drafter.candidate_selector.predecessor_codebook.shape == (VOCAB, 256)
    assert drafter.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * 64 // 16, 64)


# ------------------------------------------------------------------ corrupted DFlash 2 checkpoints


def _edit_json(path, edit):
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _drop_tensor(path, name):
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, str(path))


def _reshape_tensor(path, name):
    tensors = load_file(path)
    tensors[name] = tensors[name][..., :-1].contiguous()
    save_file(tensors, str(path))


ZLAB_CORRUPTIONS = {
    "selector table missing": (
        lambda d: _drop_tensor(d / "model.safetensors", "candidate_selector.successor_codebook"),
        r"missing tensors \['candidate_selector.successor_codebook'\]",
    ),
    "convolution of the wrong width": (
        lambda d: _reshape_tensor(d / "model.safetensors", "layers.1.mlp_conv.base_kernel"),
        r"shape mismatches.*layers.1.mlp_conv.base_kernel",
    ),
    "config rank disagreeing with the tables": (
        lambda d: _edit_json(
            d / "config.json", lambda c: {**c, "dflash_config": {**c["dflash_config"], "selector_rank": 6}}
        ),
        r"shape mismatches.*candidate_selector",
    ),
    "group size not dividing the hidden size": (
        lambda d: _edit_json(
            d / "config.json", lambda c: {**c, "dflash_config": {**c["dflash_config"], "conv_group_size": 24}}
        ),
        r"conv_group_size=24 must divide hidden_size=64",
    ),
    "top-K beyond the vocabulary": (
        lambda d: _edit_json(
            d / "config.json", lambda c: {**c, "dflash_config": {**c["dflash_config"], "selector_top_k": 999}}
        ),
        r"selector_top_k=999 must lie in \[1, vocab_size=128\]",
    ),
    "scaled unary logits": (
        lambda d: _edit_json(
            d / "config.json", lambda c: {**c, "dflash_config": {**c["dflash_config"], "output_multiplier": 0.2}}
        ),
        r"scales the drafter's logits.*output_multiplier",
    ),
    "truncated weights": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
        r"truncated",
    ),
}
SPECULATORS_CORRUPTIONS = {
    "no layer ids": (
        lambda d: _edit_json(
            d / "config.json", lambda c: {k: v for k, v in c.items() if k != "aux_hidden_state_layer_ids"}
        ),
        r"lacks required key\(s\) \['aux_hidden_state_layer_ids'\]",
    ),
    "the embedding output as a layer": (
        lambda d: _edit_json(d / "config.json", lambda c: {**c, "aux_hidden_state_layer_ids": [0, 3]}),
        r"aux_hidden_state_layer_ids=\[0, 3\].*embedding output",
    ),
    "anchor sampling": (
        lambda d: _edit_json(d / "config.json", lambda c: {**c, "sample_from_anchor": True}),
        r"sample_from_anchor=true",
    ),
    "another speculators algorithm": (
        lambda d: _edit_json(d / "config.json", lambda c: {**c, "speculators_model_type": "eagle3"}),
        r"speculators 'eagle3' checkpoint",
    ),
    "layer config of an unknown family": (
        lambda d: _edit_json(
            d / "config.json",
            lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"], "model_type": "nope"}},
        ),
        r"transformer_layer_config is malformed",
    ),
    "reduced vocabulary without its maps": (
        lambda d: _edit_json(d / "config.json", lambda c: {**c, "draft_vocab_size": 64}),
        r"draft_vocab_size=64.*t2d and d2t",
    ),
    "selector table of the wrong vocabulary": (
        lambda d: _reshape_tensor(d / "model.safetensors", "candidate_selector.predecessor_codebook"),
        r"shape mismatches.*candidate_selector.predecessor_codebook",
    ),
}


@pytest.mark.parametrize("corruption", sorted(ZLAB_CORRUPTIONS))
def test_corrupted_zlab_dflash2_checkpoints_raise_checkpoint_error(tmp_path, corruption):
    write_layout(tmp_path, ZLAB_DFLASH2_CONFIG, "dflash2")
    corrupt, message = ZLAB_CORRUPTIONS[corruption]
    corrupt(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        AdaFlashDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("corruption", sorted(SPECULATORS_CORRUPTIONS))
def test_corrupted_speculators_dflash2_checkpoints_raise_checkpoint_error(tmp_path, corruption):
    write_layout(tmp_path, SPECULATORS_DFLASH2_CONFIG, "dflash2")
    corrupt, message = SPECULATORS_CORRUPTIONS[corruption]
    corrupt(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_corrupted_vocabulary_maps_raise_checkpoint_error(tmp_path):
    target = tiny_target()
    tiny_drafter(target, draft_vocab=list(range(0, VOCAB, 2))).save_pretrained(
        tmp_path, save_format="speculators", target_lm_head=target.get_output_embeddings()
    )
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["d2t"] = tensors["d2t"].flip(0)  # offsets no longer ascending ids
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="t2d .* and d2t .* disagree"):
        AdaFlashDrafter.from_pretrained(tmp_path)
