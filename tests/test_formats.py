"""Checkpoint formats: z-lab DFlash and AdaFlash repos, our own saves, the length-head artifact, and bad input."""

import json
import os
import re
import struct
from unittest import mock

import pytest
import torch
from helpers import (
    MASK_ID,
    ZLAB_CONFIG,
    official_tensor_shapes,
    tiny_drafter,
    tiny_target,
    write_hub_checkpoint,
)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter, AdaptiveLengthHead, CheckpointError, build_target_layer_ids
from adaflash_hf.configuration import config_from_dict
from adaflash_hf.schema import config_to_dflash_dict


def _state_equal(model, tensors):
    state = model.state_dict()
    return set(state) == set(tensors) and all(torch.equal(state[k], tensors[k]) for k in tensors)


# ------------------------------------------------------------------ official checkpoints


@pytest.mark.parametrize("kind", ["dflash", "adaflash"])
def test_hub_layout_loads_with_no_missing_or_unexpected_keys(tmp_path, kind):
    tensors = write_hub_checkpoint(tmp_path, kind)
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    assert _state_equal(drafter, tensors)  # zero missing, zero unexpected, same values
    assert drafter.dtype == torch.bfloat16  # dtype "auto" follows the checkpoint
    config = drafter.config
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (8, MASK_ID, [0, 2])
    assert config.num_target_layers == 4 and config.rope_parameters["rope_theta"] == 1000000
    assert config.use_length_head is (kind == "adaflash")
    assert config.length_policy == ("adaptive" if kind == "adaflash" else "fixed")
    if kind == "dflash":
        assert drafter.length_head is None  # never a silently random head


@pytest.mark.parametrize("kind", ["dflash", "adaflash"])
def test_config_from_pretrained_reads_the_official_schema(tmp_path, kind):
    write_hub_checkpoint(tmp_path, kind)
    config = AdaFlashConfig.from_pretrained(tmp_path)  # what PEFT calls on the base model when saving an adapter
    loaded = AdaFlashDrafter.from_pretrained(tmp_path).config
    loaded_fields = {key: value for key, value in loaded.to_diff_dict().items() if key != "dtype"}  # set by loading
    assert config.to_diff_dict() == loaded_fields
    assert (config.mask_token_id, config.block_size, config.use_length_head) == (MASK_ID, 8, kind == "adaflash")


def test_loading_never_executes_repository_code(tmp_path):
    write_hub_checkpoint(tmp_path)
    AdaFlashDrafter.from_pretrained(tmp_path, trust_remote_code=True)  # dflash.py raises if imported


def test_plain_dflash_checkpoint_refuses_a_random_length_head(tmp_path):
    write_hub_checkpoint(tmp_path, "dflash")
    with pytest.raises(CheckpointError, match=r"missing tensors.*thresh_head_two_model.*load_length_head"):
        AdaFlashDrafter.from_pretrained(tmp_path, use_length_head=True)


def test_config_overrides_at_load(tmp_path):
    write_hub_checkpoint(tmp_path, "adaflash")
    drafter = AdaFlashDrafter.from_pretrained(tmp_path, length_policy="confidence", length_rate=1.0)
    assert (drafter.config.length_policy, drafter.config.length_rate) == ("confidence", 1.0)


# ------------------------------------------------------------------ our saves


@pytest.mark.parametrize("use_length_head", [False, True])
def test_save_writes_official_schema_and_round_trips_bit_exact(tmp_path, use_length_head):
    drafter = tiny_drafter(tiny_target(), use_length_head=use_length_head, length_head_bottleneck_dim=32)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["DFlashDraftModel"]
    expected_keys = set(ZLAB_CONFIG) - {"auto_map", "use_cache"} | {"adaflash_config"}
    assert expected_keys <= set(saved)
    assert saved["dflash_config"]["mask_token_id"] == MASK_ID
    assert saved["dflash_config"]["target_layer_ids"] == [0, 2]
    assert saved["dflash_config"].get("use_thresh_head_two_model", False) is use_length_head
    shapes = {k: tuple(v.shape) for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert shapes == official_tensor_shapes(saved, with_head=use_length_head)

    reloaded = AdaFlashDrafter.from_pretrained(tmp_path)
    assert _state_equal(reloaded, drafter.state_dict())
    assert config_to_dflash_dict(reloaded.config) == saved | {"dtype": saved["dtype"]}


def test_zlab_checkpoint_resaves_to_the_same_tensors_and_config_facts(tmp_path):
    tensors = write_hub_checkpoint(tmp_path / "hub", "adaflash")
    AdaFlashDrafter.from_pretrained(tmp_path / "hub").save_pretrained(tmp_path / "ours")
    resaved = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(resaved) == set(tensors) and all(torch.equal(resaved[k], tensors[k]) for k in tensors)
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    hub = json.loads((tmp_path / "hub" / "config.json").read_text())
    for key in ("block_size", "num_target_layers", "dflash_config", "hidden_size", "rope_theta", "vocab_size"):
        assert ours[key] == hub[key], key


def test_native_format_loads_through_auto_classes(tmp_path):
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path, save_format="adaflash")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "adaflash"
    assert isinstance(AutoConfig.from_pretrained(tmp_path), AdaFlashConfig)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, AdaFlashDrafter) and _state_equal(loaded, drafter.state_dict())
    assert _state_equal(AdaFlashDrafter.from_pretrained(tmp_path), drafter.state_dict())


def test_save_replaces_an_existing_checkpoint_without_leftovers(tmp_path):
    target = tiny_target()
    tiny_drafter(target, seed=1).save_pretrained(tmp_path)
    second = tiny_drafter(target, seed=2)
    second.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.parent.iterdir() if ".tmp-" in p.name]
    assert _state_equal(AdaFlashDrafter.from_pretrained(tmp_path), second.state_dict())


# ------------------------------------------------------------------ length head artifact


def test_length_head_artifact_round_trips_and_attaches(tmp_path):
    target = tiny_target()
    with_head = tiny_drafter(target, use_length_head=True, length_head_bottleneck_dim=32)
    with_head.length_head.save_pretrained(tmp_path / "head")
    head = AdaptiveLengthHead.from_pretrained(tmp_path / "head")
    assert all(
        torch.equal(a, b) for a, b in zip(head.state_dict().values(), with_head.length_head.state_dict().values())
    )

    plain = tiny_drafter(target)
    assert plain.config.length_policy == "fixed"
    plain.load_length_head(tmp_path / "head")
    assert plain.config.use_length_head and plain.config.length_policy == "adaptive"
    noise, context = torch.randn(1, 8, 64), torch.randn(1, 3, 128)
    prediction = plain(noise_embeds=noise, context_hidden_states=context).length_prediction
    expected = with_head.length_head(
        plain(noise_embeds=noise, context_hidden_states=context).last_hidden_state[:, None]
    )
    assert prediction.shape == (1, 1) and torch.allclose(prediction, expected)

    plain.save_pretrained(tmp_path / "merged")  # the attached head is saved in the AdaFlash layout
    assert AdaFlashDrafter.from_pretrained(tmp_path / "merged").config.use_length_head


def test_length_head_for_another_geometry_is_refused(tmp_path):
    other = tiny_drafter(tiny_target(), use_length_head=True, block_size=4, length_head_bottleneck_dim=32)
    other.length_head.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="block_size=4.*block_size=8"):
        tiny_drafter(tiny_target()).load_length_head(tmp_path)


def test_drafter_checkpoint_is_not_a_length_head(tmp_path):
    write_hub_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="is not a length head"):
        tiny_drafter(tiny_target()).load_length_head(tmp_path)


# ------------------------------------------------------------------ config rules


@pytest.mark.parametrize(
    "layers,n,expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (28, 5, [1, 7, 13, 19, 25]),
        (32, 5, [1, 8, 15, 22, 29]),
        (48, 5, [1, 12, 23, 34, 45]),
        (36, 1, [18]),
    ],
)
def test_target_layer_id_rule(layers, n, expected):
    assert build_target_layer_ids(layers, n) == expected


def test_from_target_config_copies_the_target_geometry():
    target = tiny_target("llama")
    config = AdaFlashConfig.from_target_config(target.config, mask_token_id=MASK_ID, target_layer_ids=[1, 2])
    assert (config.hidden_size, config.num_attention_heads, config.head_dim, config.vocab_size) == (64, 4, 16, 128)
    assert (config.eos_token_id, config.num_target_layers, config.block_size) == (1, 4, 16)


# ------------------------------------------------------------------ bad input, one clear error each


def _corrupt(tmp_path, edit):
    write_hub_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.pop("hidden_size"), r"lacks required key\(s\) \['hidden_size'\]"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), r"dflash_config\.mask_token_id"),
        (lambda c: c.pop("dflash_config"), r"'dflash_config'"),
        (lambda c: c.update(num_hidden_layers="two"), r"malformed.*num_hidden_layers"),
        (lambda c: c["dflash_config"].update(mask_token_id=10_000), r"mask_token_id=10000 must be a row"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"], dflash_config=None), r"not a DFlash or AdaFlash"),
        (lambda c: c.update(intermediate_size=96), r"shape mismatches.*mlp\.gate_proj"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]), r"id >= num_target_layers"),
    ],
)
def test_bad_configs(tmp_path, edit, message):
    _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_config_that_is_not_json(tmp_path):
    write_hub_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        AdaFlashDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_safetensors(tmp_path, keep):
    write_hub_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"(truncated|not a safetensors).*re-download"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_corrupt_safetensors_header(tmp_path):
    write_hub_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_pickled_weights_are_refused(tmp_path):
    tensors = write_hub_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with mock.patch("torch.load", side_effect=AssertionError("unpickled")):
        with pytest.raises(CheckpointError, match=r"pickled weights \(pytorch_model\.bin\).*unpickling can execute"):
            AdaFlashDrafter.from_pretrained(tmp_path)


def test_unexpected_tensor(tmp_path):
    tensors = write_hub_checkpoint(tmp_path)
    save_file({**tensors, "embed_tokens.weight": torch.zeros(128, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['embed_tokens.weight'\]"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(CheckpointError, match="Cannot find config.json"):
        AdaFlashDrafter.from_pretrained(tmp_path / "nope")


def test_folder_without_config_is_one_clear_error(tmp_path):
    # a folder that exists but holds no checkpoint (e.g. the demo's data folder above its drafter/): transformers'
    # cached_file answers None for it, which used to surface as a TypeError from open(None)
    (tmp_path / "prompts").mkdir()
    with pytest.raises(CheckpointError, match=r"has no config\.json.*holds config\.json and model\.safetensors"):
        AdaFlashDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "target_kwargs,drafter_kwargs,message",
    [
        (dict(hidden_size=96, head_dim=24), {}, r"hidden size: drafter 64 vs target 96"),
        (dict(vocab_size=256), {}, r"vocabulary: drafter vocab_size 128 vs target embedding rows 256"),
        (dict(num_hidden_layers=2), dict(target_layer_ids=(0, 3)), r"target_layer_ids \[3\] are not layers"),
    ],
)
def test_check_compatible_names_the_mismatch(target_kwargs, drafter_kwargs, message):
    drafter = tiny_drafter(tiny_target(), **drafter_kwargs)
    with pytest.raises(ValueError, match=message):
        drafter.check_compatible(tiny_target(**target_kwargs))


def test_check_compatible_mask_token_outside_target_vocabulary():
    target = tiny_target()
    drafter = tiny_drafter(target)
    target.resize_token_embeddings(64)
    with pytest.raises(ValueError, match=r"mask_token_id 127 is not a row of the target embeddings \[0, 64\)"):
        drafter.check_compatible(target)


def test_wrong_context_width_is_named():
    drafter = tiny_drafter(tiny_target())
    with pytest.raises(ValueError, match=re.escape("expects 128 = len(target_layer_ids=[0, 2]) * hidden_size=64")):
        drafter(noise_embeds=torch.randn(1, 8, 64), context_hidden_states=torch.randn(1, 3, 64))


def test_config_from_dict_rejects_a_target_config():
    with pytest.raises(CheckpointError, match="Is this the target model"):
        config_from_dict(tiny_target().config.to_dict())


# ------------------------------------------------------------------ model cards


def test_push_to_hub_uploads_the_checkpoint_with_a_rendered_card(tmp_path):
    drafter = tiny_drafter(tiny_target(), use_length_head=True, target_model="Qwen/Qwen3-8B")
    seen = {}

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        seen["files"] = sorted(os.listdir(folder_path))
        seen["readme"] = open(os.path.join(folder_path, "README.md")).read()
        seen["config"] = json.load(open(os.path.join(folder_path, "config.json")))

    with (
        mock.patch("huggingface_hub.HfApi.create_repo"),
        mock.patch("huggingface_hub.HfApi.upload_folder", upload_folder),
    ):
        drafter.push_to_hub("me/tiny-adaflash", card_data={"acceptance": "3.1 (demo world)"})
    assert seen["files"] == ["README.md", "config.json", "model.safetensors"]
    assert seen["config"]["architectures"] == ["DFlashDraftModel"]
    readme = seen["readme"]
    assert "base_model: Qwen/Qwen3-8B" in readme and "speculative-decoding" in readme
    assert "| block size | 8 |" in readme and "| target layer ids | [0, 2] |" in readme
    assert "3.1 (demo world)" in readme and 'AdaFlashDrafter.from_pretrained("me/tiny-adaflash")' in readme


# ------------------------------------------------------------------ corrupted files: CheckpointError, nothing else


def _rewrite_header(path, edit):
    """Rewrites a safetensors file's JSON header through `edit(header) -> header`, keeping its data bytes."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8 : 8 + length]))
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def _first_tensor(header):
    return next(name for name in header if name != "__metadata__")


CORRUPTIONS = {
    "flipped header bytes": lambda p: p.write_bytes(p.read_bytes()[:20] + b"\x00\xff" + p.read_bytes()[22:]),
    "header length beyond the file": lambda p: p.write_bytes(struct.pack("<Q", 10**9) + p.read_bytes()[8:]),
    "header not an object": lambda p: _rewrite_header(p, lambda h: [h]),
    "entry without offsets": lambda p: _rewrite_header(p, lambda h: {**h, _first_tensor(h): {"dtype": "BF16"}}),
    "unknown dtype": lambda p: _rewrite_header(
        p, lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "dtype": "Q3"}}
    ),
    "dtype disagreeing with the byte size": lambda p: _rewrite_header(
        p, lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "dtype": "F32"}}
    ),
    "integer tensor": lambda p: _rewrite_header(
        p, lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "dtype": "I16"}}
    ),
    "overlapping offsets": lambda p: _rewrite_header(
        p,
        lambda h: {
            k: ({**v, "data_offsets": [0, v["data_offsets"][1] - v["data_offsets"][0]]} if k != "__metadata__" else v)
            for k, v in h.items()
        },
    ),
}
CONFIG_CORRUPTIONS = {
    "config not an object": lambda p: p.write_text("[1, 2]"),
    "config not UTF-8": lambda p: p.write_bytes(b'{"block_size": "\xff\xfe"}'),
    "config geometry disagreeing with the tensors": lambda p: p.write_text(
        json.dumps({**json.loads(p.read_text()), "hidden_size": 96})
    ),
    "config with a null field": lambda p: p.write_text(
        json.dumps({**json.loads(p.read_text()), "num_hidden_layers": None})
    ),
    "config missing dflash_config": lambda p: p.write_text(
        json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "dflash_config"})
    ),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupted_weights_raise_checkpoint_error(tmp_path, corruption):
    write_hub_checkpoint(tmp_path)
    CORRUPTIONS[corruption](tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError):
        AdaFlashDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("corruption", sorted(CONFIG_CORRUPTIONS))
def test_corrupted_configs_raise_checkpoint_error(tmp_path, corruption):
    write_hub_checkpoint(tmp_path)
    CONFIG_CORRUPTIONS[corruption](tmp_path / "config.json")
    with pytest.raises(CheckpointError):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_a_weights_symlink_leading_outside_the_checkpoint_is_refused(tmp_path):
    write_hub_checkpoint(tmp_path / "ckpt")
    (tmp_path / "elsewhere.safetensors").write_bytes((tmp_path / "ckpt" / "model.safetensors").read_bytes())
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        AdaFlashDrafter.from_pretrained(tmp_path / "ckpt")


def test_the_hub_cache_layout_of_symlinks_into_blobs_loads(tmp_path):
    tensors = write_hub_checkpoint(tmp_path / "snapshots" / "abc")
    (tmp_path / "blobs").mkdir()
    for name in ("model.safetensors", "config.json"):
        link = tmp_path / "snapshots" / "abc" / name
        (tmp_path / "blobs" / name).write_bytes(link.read_bytes())
        link.unlink()
        link.symlink_to(os.path.join("..", "..", "blobs", name))
    assert _state_equal(AdaFlashDrafter.from_pretrained(tmp_path / "snapshots" / "abc"), tensors)
