"""A drafter checkpoint's ``config.json``: read by one function, and mapped between the schemas the engines write
and `AdaFlashConfig`'s fields, both ways.

Three schemas describe the same drafter (docs/algorithm.md §2.1):

* **dflash** (z-lab DFlash and AdaFlash checkpoints, z-lab DFlash 2 ones, our default save): a `Qwen3Config` dict
  with ``architectures: ["DFlashDraftModel"]`` (``["DFlash2DraftModel"]``) and a nested ``dflash_config``;
* **adaflash** (native): ``model_type: "adaflash"`` and the fields of `AdaFlashConfig`;
* **speculators** (the `speculators` library's DFlash and DFlash 2 checkpoints, which vLLM serves):
  ``speculators_model_type`` with the decoder geometry in ``transformer_layer_config``.

`read_config_dict` is the only reader of the file (for `AdaFlashConfig.from_pretrained` and for the drafter and
length-head loads alike); `fields_from_config_dict` maps any of the three to `AdaFlashConfig` fields, and
`config_to_dflash_dict` / `config_to_speculators_dict` write them back. Every refusal is a `CheckpointError` that
names the problem and the fix. `configuration` and `formats` both build on this module; it imports neither.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from transformers import AutoConfig
from transformers.utils.hub import cached_file

from .dflash2 import DFLASH2_ARCHITECTURE

CONFIG_NAME = "config.json"
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder", "proxies")
DFLASH_ARCHITECTURE = "DFlashDraftModel"
ADAFLASH_MODEL_TYPE = "adaflash"  # the native schema's model_type: `AdaFlashConfig.model_type`

# Qwen3 config keys that map 1:1 onto AdaFlashConfig fields.
GEOMETRY_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "attention_bias",
    "attention_dropout",
    "layer_types",
    "initializer_range",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
)
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# AdaFlash dflash_config flag -> AdaFlashConfig field.
HEAD_KEYS = {
    "use_thresh_head_two_model": "use_length_head",
    "thresh_head_bottleneck_dim": "length_head_bottleneck_dim",
    "thresh_head_direct_len": "length_head_direct_len",
}
# AdaFlashConfig fields with no place in the official schema; saved under "adaflash_config".
ADAFLASH_KEYS = (
    "target_model",
    "length_policy",
    "length_rate",
    "min_candidate_length",
    "confidence_threshold",
    "draft_vocab",
)
# DFlash 2 fields, under the names the engines' configs give them (z-lab's ``dflash_config``, speculators' top level).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# z-lab DFlash 2 settings that scale the unary logits (MiniMax drafters); not implemented here, so refused if set.
_UNSUPPORTED_LOGIT_TRANSFORMS = {"output_multiplier": 1.0, "final_logit_softcapping": None}
# Legacy AdaFlash heads that no serving engine uses (docs/algorithm.md §6.1); their tensors are skipped, with a
# warning.
UNSUPPORTED_HEADS = {"use_thresh_head_subsequent": "thresh_head_subsequent.", "use_prob_head": "prob_head."}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as a drafter; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------- the file


def read_config_dict(path_or_repo_id, hub_kwargs: dict) -> tuple[dict, str]:
    """The ``config.json`` of a checkpoint folder or Hub repo (``hub_kwargs``: `HUB_KWARGS`), as a dict, and the name
    errors give it; a missing, unreadable or non-object file is a `CheckpointError`. ``path_or_repo_id`` may also
    name the file itself, as `PreTrainedConfig.from_pretrained` allows."""
    if os.path.isfile(path_or_repo_id):
        return read_json(path_or_repo_id), str(path_or_repo_id)
    subfolder = hub_kwargs.get("subfolder")
    source = "/".join(str(part) for part in (path_or_repo_id, subfolder, CONFIG_NAME) if part)
    return read_json(resolve_file(path_or_repo_id, CONFIG_NAME, hub_kwargs)), source


def resolve_file(path_or_repo_id, filename: str, hub_kwargs: dict, required: bool = True) -> str | None:
    """The local path of one file of a checkpoint (downloaded when it is a Hub repo); ``None`` for a missing file
    that is not ``required``. A local checkpoint's file must lie inside its folder."""
    try:
        path = cached_file(
            path_or_repo_id,
            filename,
            _raise_exceptions_for_missing_entries=required,
            _raise_exceptions_for_connection_errors=required,
            **hub_kwargs,
        )
    except OSError as error:
        if not required:
            return None
        raise CheckpointError(f"Cannot find {filename} for {path_or_repo_id!r}: {error}") from error
    if path is None and required:
        # transformers' cached_file answers None, not an error, for a file missing from a local folder
        raise CheckpointError(
            f"{path_or_repo_id} has no {filename}. A drafter checkpoint folder holds config.json and "
            "model.safetensors (what save_pretrained writes); pass that folder, or a Hub repo id."
        )
    if path is not None and os.path.isdir(path_or_repo_id):
        _check_inside(path, path_or_repo_id)
    return path


def _check_inside(path: str, directory) -> None:
    """A local checkpoint's files must lie in its folder: a symlink out of it would load whatever it points at. The
    Hub cache's own layout, ``snapshots/<revision>/<file> -> ../../blobs/<hash>``, is the one exception."""
    real, root = Path(path).resolve(), Path(directory).resolve()
    blobs = root.parent.parent / "blobs"
    if not (real.is_relative_to(root) or (root.parent.name == "snapshots" and real.is_relative_to(blobs))):
        raise CheckpointError(
            f"{path} leads outside the checkpoint folder {directory} (to {real}); copy the file into the folder "
            "if it is meant to be part of the checkpoint."
        )


def read_json(path: str) -> dict:
    """A JSON object from a checkpoint file; anything else (corrupt, truncated, not an object) is a
    `CheckpointError`."""
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the file is corrupt or truncated.") from error
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not an object; the file is corrupt.")
    return raw


# ---------------------------------------------------------------------------------------------- schemas


def fields_from_config_dict(raw: dict, source: str = CONFIG_NAME) -> dict:
    """`AdaFlashConfig` fields of a z-lab DFlash, AdaFlash, speculators or native ``config.json`` dict; ``source``
    names the file in errors."""
    if raw.get("model_type") == ADAFLASH_MODEL_TYPE:
        return {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
    if "speculators_model_type" in raw:
        return fields_from_speculators_dict(raw, source)
    if is_dflash_dict(raw):
        return fields_from_dflash_dict(raw, source)
    raise CheckpointError(
        f"{source} is not a DFlash or AdaFlash drafter config (model_type={raw.get('model_type')!r}, "
        f"architectures={raw.get('architectures')}): a drafter config has model_type 'adaflash', "
        f"architectures ['{DFLASH_ARCHITECTURE}'] or ['{DFLASH2_ARCHITECTURE}'] with a 'dflash_config' dict, or "
        "speculators_model_type 'dflash' or 'dflash2'. Is this the target model?"
    )


def is_dflash_dict(raw: dict) -> bool:
    """Whether a ``config.json`` dict is in the z-lab DFlash (or DFlash 2) schema."""
    architectures = raw.get("architectures") or []
    return (
        DFLASH_ARCHITECTURE in architectures
        or DFLASH2_ARCHITECTURE in architectures
        or isinstance(raw.get("dflash_config"), dict)
    )


def fields_from_dflash_dict(raw: dict, source: str) -> dict:
    """`AdaFlashConfig` fields of a z-lab DFlash, DFlash 2 or AdaFlash ``config.json`` dict (the inverse of
    `config_to_dflash_dict`)."""
    missing = [key for key in REQUIRED_KEYS if key not in raw]
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        missing.append("dflash_config")
        dflash = {}
    elif "mask_token_id" not in dflash:
        missing.append("dflash_config.mask_token_id")
    if "block_size" not in raw and "block_size" not in dflash:
        missing.append("block_size")
    if missing:
        raise CheckpointError(
            f"{source} lacks required key(s) {missing}; an official DFlash config has them "
            "(see docs/algorithm.md §2.1). Re-export the drafter with save_pretrained or add the keys."
        )
    fields = {key: raw[key] for key in GEOMETRY_KEYS if key in raw}
    fields["rope_parameters"] = _rope_parameters(raw)
    if raw.get("use_sliding_window"):
        fields["sliding_window"] = raw.get("sliding_window")
    fields["block_size"] = dflash.get("block_size", raw.get("block_size"))
    fields["mask_token_id"] = dflash["mask_token_id"]
    layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if layer_ids is not None:
        fields["target_layer_ids"] = layer_ids
    num_target_layers = dflash.get("num_target_layers", raw.get("num_target_layers"))
    if num_target_layers is not None:
        fields["num_target_layers"] = num_target_layers
    elif layer_ids is None:
        raise CheckpointError(f"{source} needs 'num_target_layers' or dflash_config.target_layer_ids")
    else:
        fields["num_target_layers"] = max(layer_ids) + 1
    for key, field in HEAD_KEYS.items():
        if key in dflash:
            fields[field] = dflash[key]
    if DFLASH2_ARCHITECTURE in (raw.get("architectures") or []) or any(key in dflash for key in DFLASH2_KEYS):
        fields["drafter_type"] = "dflash2"
        fields.update({key: dflash[key] for key in DFLASH2_KEYS if key in dflash})
        check_logit_transforms(dflash, source)
    for key in UNSUPPORTED_HEADS:
        if dflash.get(key):
            warnings.warn(
                f"{source}: {key} is a legacy AdaFlash head that adaflash_hf does not use; ignored.", stacklevel=3
            )
    fields.update({k: v for k, v in (raw.get("adaflash_config") or {}).items() if k in ADAFLASH_KEYS})
    return fields


def check_logit_transforms(settings: dict, source: str) -> None:
    """Refuses the z-lab DFlash 2 unary-logit scalings (``output_multiplier``, ``final_logit_softcapping``) this
    library does not apply: drafting without them would propose from other logits than the checkpoint's."""
    found = {
        k: settings[k] for k, default in _UNSUPPORTED_LOGIT_TRANSFORMS.items() if settings.get(k, default) != default
    }
    if found:
        raise CheckpointError(
            f"{source} scales the drafter's logits ({found}), which adaflash_hf does not implement; serve this "
            "drafter with SGLang, or remove the settings if the drafter was trained without them."
        )


def _rope_parameters(raw: dict) -> dict | None:
    if raw.get("rope_parameters"):
        return dict(raw["rope_parameters"])
    if "rope_theta" not in raw:
        return None
    rope = dict(raw.get("rope_scaling") or {"rope_type": "default"})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = raw["rope_theta"]
    return rope


def config_to_dflash_dict(config) -> dict:
    """The official DFlash `config.json` dict for `config` (the inverse of `fields_from_dflash_dict`)."""
    native = config.to_dict()
    dflash2 = config.drafter_type == "dflash2"
    out = {"architectures": [DFLASH2_ARCHITECTURE if dflash2 else DFLASH_ARCHITECTURE], "model_type": "qwen3"}
    out.update({key: native[key] for key in GEOMETRY_KEYS if key in native})
    rope = dict(native.get("rope_parameters") or {})
    out["rope_theta"] = rope.pop("rope_theta", config.default_theta)
    out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" and len(rope) <= 1 else rope
    out["use_sliding_window"] = config.sliding_window is not None
    out["sliding_window"] = config.sliding_window
    out["max_window_layers"] = config.num_hidden_layers
    out["block_size"] = config.block_size
    out["num_target_layers"] = config.num_target_layers
    out["dtype"] = native.get("dtype")
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if dflash2:  # z-lab's DFlash 2 schema: the block size and the DFlash 2 geometry in dflash_config
        dflash.update({"block_size": config.block_size, **{key: getattr(config, key) for key in DFLASH2_KEYS}})
        out["is_causal"] = False
    if config.use_length_head:
        dflash.update({key: getattr(config, field) for key, field in HEAD_KEYS.items()})
    out["dflash_config"] = dflash
    out["adaflash_config"] = {key: getattr(config, key) for key in ADAFLASH_KEYS}
    out["transformers_version"] = native.get("transformers_version")
    return out


def fields_from_speculators_dict(raw: dict, source: str) -> dict:
    """`AdaFlashConfig` fields of a speculators DFlash or DFlash 2 ``config.json`` (the draft vocabulary, stored as
    tensors, is read with the weights by `formats.DrafterCheckpoint`)."""
    kind = raw.get("speculators_model_type")
    if kind not in ("dflash", "dflash2"):
        raise CheckpointError(
            f"{source} is a speculators {kind!r} checkpoint; adaflash_hf loads the block drafters 'dflash' and "
            "'dflash2' only (EAGLE-3 and the other speculators algorithms are other drafter families)."
        )
    missing = [
        key for key in ("transformer_layer_config", "block_size", "aux_hidden_state_layer_ids") if key not in raw
    ]
    layer_config = raw.get("transformer_layer_config")
    if "transformer_layer_config" in raw and not isinstance(layer_config, dict):
        missing.append("transformer_layer_config (a dict)")
    if raw.get("mask_token_id") is None:
        missing.append("mask_token_id")
    if missing:
        raise CheckpointError(
            f"{source} lacks required key(s) {missing}; a speculators DFlash config written by speculators 0.9 has "
            "them. Add them, or re-save the drafter with save_pretrained(..., save_format='speculators')."
        )
    if raw.get("sample_from_anchor"):
        raise CheckpointError(
            f"{source} has sample_from_anchor=true (the anchor slot is a draft too); adaflash_hf drafts from slot 1 "
            "as vLLM and SGLang do for DFlash. Use a drafter trained with sample_from_anchor=false."
        )
    try:
        layers = AutoConfig.for_model(**{"model_type": "qwen3", **layer_config})
    except Exception as error:  # an unknown model_type or a value its config class rejects
        raise CheckpointError(f"{source}: transformer_layer_config is malformed: {root_message(error)}") from error
    geometry = {key: getattr(layers, key) for key in GEOMETRY_KEYS if getattr(layers, key, None) is not None}
    if any(t == "sliding_attention" for t in geometry.get("layer_types") or []):
        if not raw.get("sliding_window_non_causal", kind == "dflash2"):
            raise CheckpointError(
                f"{source} has sliding-window layers with causal masking inside the block "
                "(sliding_window_non_causal=false), which adaflash_hf does not implement (its blocks are "
                "bidirectional, as in DFlash)."
            )
    aux = raw["aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not aux or any(not isinstance(i, int) or i < 1 for i in aux):
        raise CheckpointError(
            f"{source}: aux_hidden_state_layer_ids={aux!r} must be a non-empty list of target hidden-state indices "
            ">= 1 (index 0, the embedding output, is not a layer the drafter can read)."
        )
    fields = {
        **geometry,
        "rope_parameters": _rope_from(layers),
        "sliding_window": getattr(layers, "sliding_window", None),
        "block_size": raw["block_size"],
        "mask_token_id": raw["mask_token_id"],
        "target_layer_ids": [i - 1 for i in aux],
        "num_target_layers": raw.get("num_target_layers") or max(aux),
        "drafter_type": kind,
    }
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        fields["target_model"] = verifier["name_or_path"]
    if kind == "dflash2":
        fields.update({key: raw[key] for key in DFLASH2_KEYS if key in raw})
        check_logit_transforms(raw, source)
    fields.update({k: v for k, v in (raw.get("adaflash_config") or {}).items() if k in ADAFLASH_KEYS})
    if fields.get("length_policy") == "adaptive":
        del fields["length_policy"]  # the head lives in length_head/; attaching it makes the policy adaptive again
    return fields


def _rope_from(layers) -> dict | None:
    rope = getattr(layers, "rope_parameters", None)
    return dict(rope) if rope else None


def config_to_speculators_dict(config) -> dict:
    """The speculators 0.9 ``config.json`` dict of a drafter (the inverse of `fields_from_speculators_dict`)."""
    dflash2 = config.drafter_type == "dflash2"
    native = config.to_dict()
    layers = {key: native[key] for key in GEOMETRY_KEYS if key in native}
    layers.update(
        model_type="qwen3",
        rope_parameters=native.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.default_theta},
        sliding_window=config.sliding_window,
        use_sliding_window=config.sliding_window is not None,
        max_window_layers=config.num_hidden_layers,
    )
    vocab = len(config.draft_vocab) if config.draft_vocab is not None else config.vocab_size
    out = {
        "architectures": [DFLASH2_ARCHITECTURE if dflash2 else DFLASH_ARCHITECTURE],
        "speculators_model_type": config.drafter_type,
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": config.drafter_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": config.target_model, "architectures": []},
        },
        "transformer_layer_config": layers,
        "draft_vocab_size": vocab,
        "block_size": config.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        # speculators keeps keys it does not know (pydantic extra="allow"); these two round-trip our settings
        "num_target_layers": config.num_target_layers,
        "adaflash_config": {key: getattr(config, key) for key in ADAFLASH_KEYS if key != "draft_vocab"},
        "dtype": native.get("dtype"),
        "transformers_version": native.get("transformers_version"),
    }
    if dflash2:
        out.update({key: getattr(config, key) for key in DFLASH2_KEYS})
    return out


def root_message(error: BaseException) -> str:
    """The last line of the innermost cause of ``error``: what a validation failure says, without the chain."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).strip().splitlines()[-1]
