"""Checkpoint formats: official z-lab DFlash, AdaFlash, and ours; validation with one clear error each.

Formats (docs/algorithm.md §2):

* **dflash** (z-lab DFlash and AdaFlash checkpoints, and our default save): a `Qwen3Config` dict with
  ``model_type: "qwen3"``, ``architectures: ["DFlashDraftModel"]``, top-level ``block_size`` and
  ``num_target_layers``, a nested ``dflash_config`` (``mask_token_id``, ``target_layer_ids``, AdaFlash's
  ``use_thresh_head_two_model`` / ``thresh_head_bottleneck_dim`` / ``thresh_head_direct_len``). SGLang, vLLM and
  z-lab code read it. Our length-policy settings ride along in an ``adaflash_config`` dict that they ignore.
* **adaflash** (native): ``model_type: "adaflash"``, the fields of `AdaFlashConfig`; `AutoConfig`/`AutoModel` load
  it after ``import adaflash_hf``. A ``model_type: "qwen3"`` config can never reach our class through the Auto
  classes (that would hijack every Qwen3 load), which is why both formats exist.

* **speculators** (the `speculators` library's DFlash and DFlash 2 checkpoints, which vLLM serves):
  ``speculators_model_type: "dflash"`` or ``"dflash2"``, the drafter's decoder geometry in a nested
  ``transformer_layer_config`` (a diff dict over its ``model_type``'s config class), ``block_size``,
  ``mask_token_id``, the DFlash 2 fields at the top level, and the target layers as
  ``aux_hidden_state_layer_ids``, which count the target's ``hidden_states`` tuple (``[0]`` is the embedding output),
  so they are ``target_layer_ids + 1``. A reduced draft vocabulary is stored as speculators stores it: ``t2d``
  (``[V]`` bool) and ``d2t`` (``[V_d]`` offsets, ``target id = draft index + d2t``) with the head's rows as
  ``lm_head.weight``. Weights the verifier supplies (``embed_tokens``, ``verifier_lm_head``, ``verifier_norm``) are
  ignored when present. The length head, which speculators has no place for, is saved beside it in ``length_head/``
  and attached on load.

z-lab's DFlash 2 format is the **dflash** schema with ``architectures: ["DFlash2DraftModel"]`` and the DFlash 2
fields (and ``block_size``) in ``dflash_config``; SGLang reads it. All formats use the same tensor names
(docs/algorithm.md §2.3, plus ``layers.*.{attention,mlp}_conv.*`` and ``candidate_selector.*`` for DFlash 2), stored
as safetensors. Pickled weights are refused, and no file of a repository is ever executed (the
``auto_map``/``dflash.py`` of z-lab repos is ignored).
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedModel
from transformers.utils.hub import cached_file

from .configuration import (
    _GEOMETRY_KEYS,
    ADAFLASH_KEYS,
    DFLASH2_KEYS,
    DFLASH_ARCHITECTURE,
    UNSUPPORTED_HEADS,
    AdaFlashConfig,
    AdaptiveLengthHeadConfig,
    CheckpointError,
    check_logit_transforms,
    config_to_dflash_dict,
    draft_vocab_problems,
    fields_from_dflash_dict,
    is_dflash_dict,
)
from .dflash2 import DFLASH2_ARCHITECTURE
from .draft_vocab_rows import vocab_ids, vocab_rows
from .utils import atomic_directory

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder", "proxies")
_FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # safetensors dtypes a drafter checkpoint may hold
# speculators' draft-vocabulary maps, the only non-float tensors a drafter checkpoint may hold
_INDEX_TENSORS = {"t2d": {"BOOL": 1}, "d2t": {"I64": 8, "I32": 4}}
# Tensors of a speculators checkpoint that the verifier supplies (or that `load_drafter` reads itself): never loaded as
# drafter weights.
SPECULATORS_EXTRAS = (
    "embed_tokens.weight",
    "lm_head.weight",
    "verifier_lm_head.weight",
    "verifier_norm.weight",
    "t2d",
    "d2t",
)
SAVE_FORMATS = ("dflash", "adaflash", "speculators")
LENGTH_HEAD_FOLDER = "length_head"


# ---------------------------------------------------------------------------------------------- config schema


def config_from_dict(raw: dict, source: str = "config.json", **overrides) -> AdaFlashConfig:
    """Builds an `AdaFlashConfig` from a z-lab DFlash, AdaFlash or native `config.json` dict."""
    if raw.get("model_type") == AdaFlashConfig.model_type:
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
    elif "speculators_model_type" in raw:
        fields = fields_from_speculators_dict(raw, source)
    elif is_dflash_dict(raw):
        fields = fields_from_dflash_dict(raw, source)
    else:
        raise CheckpointError(
            f"{source} is not a DFlash or AdaFlash drafter config (model_type={raw.get('model_type')!r}, "
            f"architectures={raw.get('architectures')}): a drafter config has model_type 'adaflash', "
            f"architectures ['{DFLASH_ARCHITECTURE}'] or ['{DFLASH2_ARCHITECTURE}'] with a 'dflash_config' dict, or "
            "speculators_model_type 'dflash' or 'dflash2'. Is this the target model?"
        )
    fields.update(overrides)
    try:
        return AdaFlashConfig(**fields)
    except Exception as error:  # strict dataclass validation: wrong types or values
        raise CheckpointError(f"{source} is malformed: {_root_message(error)}") from error


def fields_from_speculators_dict(raw: dict, source: str) -> dict:
    """`AdaFlashConfig` fields of a speculators DFlash or DFlash 2 ``config.json`` (the draft vocabulary, stored as
    tensors, is read by `load_drafter`)."""
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
        raise CheckpointError(f"{source}: transformer_layer_config is malformed: {_root_message(error)}") from error
    geometry = {key: getattr(layers, key) for key in _GEOMETRY_KEYS if getattr(layers, key, None) is not None}
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


def config_to_speculators_dict(config: AdaFlashConfig) -> dict:
    """The speculators 0.9 ``config.json`` dict of a drafter (the inverse of `fields_from_speculators_dict`)."""
    dflash2 = config.drafter_type == "dflash2"
    native = config.to_dict()
    layers = {key: native[key] for key in _GEOMETRY_KEYS if key in native}
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


def _root_message(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------- files


def _resolve(path_or_repo_id, filename: str, hub_kwargs: dict, required: bool = True) -> str | None:
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


def resolve_weight_files(path_or_repo_id, hub_kwargs: dict) -> list[str]:
    """Paths of the safetensors weight files; refuses pickled weights."""
    single = _resolve(path_or_repo_id, WEIGHTS_NAME, hub_kwargs, required=False)
    if single is not None:
        return [single]
    index = _resolve(path_or_repo_id, WEIGHTS_INDEX_NAME, hub_kwargs, required=False)
    if index is not None:
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files; the index is corrupt.")
        shards = sorted(set(weight_map.values()))
        return [_resolve(path_or_repo_id, shard, hub_kwargs) for shard in shards]
    for name in PICKLED_WEIGHTS:
        if _resolve(path_or_repo_id, name, hub_kwargs, required=False) is not None:
            raise CheckpointError(
                f"{path_or_repo_id!r} only has pickled weights ({name}). adaflash_hf loads safetensors only, because "
                "unpickling can execute arbitrary code. Convert it once in a trusted environment: "
                "`AdaFlashDrafter(config).load_state_dict(torch.load(path, weights_only=True))` then save_pretrained."
            )
    raise CheckpointError(f"{path_or_repo_id!r} has no {WEIGHTS_NAME} (or sharded safetensors) weights.")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the file is corrupt or truncated.") from error
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not an object; the file is corrupt.")
    return raw


def read_safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header, after checking that the file holds every byte it declares."""
    size = os.path.getsize(path)
    fix = "re-download it (delete the cached copy) or save the checkpoint again"
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file ({size} bytes, no header): {fix}.")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise CheckpointError(f"{path} is truncated: its header needs {header_len} bytes; {fix}.")
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({error}): {fix}.") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object): {fix}.")
    header.pop("__metadata__", None)
    spans = sorted(
        (_tensor_span(path, name, entry, fix, _INDEX_TENSORS.get(name)), name) for name, entry in header.items()
    )
    end = 0
    for (begin, stop), name in spans:  # safetensors data is contiguous: each tensor starts where the last ended
        if begin != end:
            raise CheckpointError(f"{path}: tensor {name} starts at byte {begin}, expected {end}: {fix}.")
        end = stop
    needed = 8 + header_len + end
    if needed > size:
        raise CheckpointError(f"{path} is truncated ({size} of {needed} bytes): {fix}.")
    return {name: tuple(entry["shape"]) for name, entry in header.items()}


def _tensor_span(path: str, name: str, entry, fix: str, index_dtypes: dict | None = None) -> tuple[int, int]:
    """The byte span of one header entry, after checking that its dtype is a float type (or, for speculators'
    vocabulary maps, the index dtype they have) and that its shape and dtype fill that span exactly (what the
    safetensors reader would otherwise reject with its own error)."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: the header entry of {name} is not an object: {fix}.")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    allowed = index_dtypes or _FLOAT_BYTES
    if dtype not in allowed:
        kind = "its vocabulary map is stored as" if index_dtypes else "drafter weights are floating point"
        raise CheckpointError(f"{path}: tensor {name} has dtype {dtype!r}; {kind} ({sorted(allowed)}): {fix}.")
    valid = (
        isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not valid or offsets[1] - offsets[0] != math.prod(shape) * allowed[dtype]:
        raise CheckpointError(
            f"{path}: tensor {name} has shape {shape!r}, dtype {dtype} and offsets {offsets!r}, which disagree: {fix}."
        )
    return offsets[0], offsets[1]


def check_weights(
    model: PreTrainedModel, shapes: dict[str, tuple[int, ...]], source: str, ignored: tuple[str, ...] = ()
) -> None:
    """Raises if the checkpoint's tensors do not match `model` exactly (names and shapes); ``ignored`` names tensors
    the format may hold that are not the model's (speculators' verifier-owned ones)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    skipped = tuple(UNSUPPORTED_HEADS.values())
    unexpected = sorted(n for n in shapes if n not in expected and not n.startswith(skipped) and n not in ignored)
    missing = sorted(n for n in expected if n not in shapes)
    mismatched = [
        f"{n}: checkpoint {shapes[n]} vs model {expected[n]}"
        for n in expected
        if n in shapes and shapes[n] != expected[n]
    ]
    problems = []
    if missing:
        hint = (
            " (the config declares a length head the checkpoint does not have: load the head with "
            "drafter.load_length_head(path) or set use_length_head=False)"
            if any(n.startswith("thresh_head_two_model.") for n in missing)
            else ""
        )
        if any(n.startswith("candidate_selector.") or "_conv." in n for n in missing) and not hint:
            hint = (
                " (the config declares a DFlash 2 drafter but the checkpoint holds DFlash weights: load it as DFlash "
                "and grow it with drafter.to_dflash2() to train one)"
            )
        problems.append(f"missing tensors {missing}{hint}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches {mismatched} (the config does not describe these weights)")
    if problems:
        raise CheckpointError(f"{source} does not match its config: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------- load / save


def _split_kwargs(kwargs: dict) -> tuple[dict, dict, dict]:
    hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    config_fields = set(AdaFlashConfig.__dataclass_fields__) | set(ADAFLASH_KEYS)
    overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in config_fields}
    return hub, overrides, kwargs


def load_drafter(cls, path_or_repo_id, *model_args, **kwargs):
    """`AdaFlashDrafter.from_pretrained`: see its docstring."""
    config = kwargs.pop("config", None)
    kwargs.pop("trust_remote_code", None)  # never needed, never honoured: no repository code runs
    hub, overrides, load_kwargs = _split_kwargs(kwargs)
    source = str(path_or_repo_id)
    speculators = False
    if config is None:
        raw = _read_json(_resolve(path_or_repo_id, CONFIG_NAME, hub))
        speculators = "speculators_model_type" in raw
        config = config_from_dict(raw, f"{source}/{CONFIG_NAME}", **overrides)
    elif not isinstance(config, AdaFlashConfig):
        raise CheckpointError(f"config must be an AdaFlashConfig, got {type(config).__name__}")
    files = resolve_weight_files(path_or_repo_id, hub)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        shapes.update(read_safetensors_shapes(path))
    if speculators:
        _speculators_vocab(config, files, shapes, raw.get("draft_vocab_size"), source)
    check_weights(_shape_model(cls, config), shapes, source, ignored=SPECULATORS_EXTRAS if speculators else ())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*model_type.*")
        model = PreTrainedModel.from_pretrained.__func__(
            cls, path_or_repo_id, *model_args, config=config, use_safetensors=True, **hub, **load_kwargs
        )
    model.config.name_or_path = source
    if speculators and not config.use_length_head:
        saved_policy = (raw.get("adaflash_config") or {}).get("length_policy")
        _attach_saved_length_head(model, path_or_repo_id, hub, overrides.get("length_policy", saved_policy))
    return model


def _speculators_vocab(config: AdaFlashConfig, files, shapes: dict, draft_vocab_size, source: str) -> None:
    """Sets ``config.draft_vocab`` from a speculators checkpoint's ``t2d``/``d2t`` maps, after checking them."""
    has = [name for name in ("t2d", "d2t") if name in shapes]
    reduced = draft_vocab_size is not None and draft_vocab_size != config.vocab_size
    if not reduced and not has:
        return
    fix = "the vocabulary maps are corrupt; re-save the drafter with speculators or save_format='speculators'"
    if len(has) != 2 or not reduced:
        raise CheckpointError(
            f"{source}: draft_vocab_size={draft_vocab_size} (target vocabulary {config.vocab_size}) but the weights "
            f"hold {has or 'no'} vocabulary maps; a reduced draft vocabulary needs both t2d and d2t: {fix}."
        )
    tensors = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in has if name in handle.keys()})
    t2d, d2t = tensors["t2d"], tensors["d2t"]
    ids = (torch.arange(d2t.shape[0]) + d2t.long()).tolist() if d2t.dim() == 1 else []
    ok = (
        d2t.dim() == 1
        and d2t.shape[0] == draft_vocab_size
        and tuple(t2d.shape) == (config.vocab_size,)
        and not draft_vocab_problems(ids, config.vocab_size)
        and int(t2d.sum()) == len(ids)
        and bool(t2d[torch.tensor(ids)].all())
    )
    if not ok:
        raise CheckpointError(f"{source}: t2d {tuple(t2d.shape)} and d2t {tuple(d2t.shape)} disagree: {fix}.")
    config.draft_vocab = ids
    config.validate_architecture()


def _attach_saved_length_head(model, path_or_repo_id, hub: dict, policy: str | None) -> None:
    """Attaches the length head `save_drafter` writes beside a speculators checkpoint, when there is one, keeping
    the length policy it was saved with (attaching a head otherwise makes it ``adaptive``)."""
    folder = f"{hub['subfolder']}/{LENGTH_HEAD_FOLDER}" if hub.get("subfolder") else LENGTH_HEAD_FOLDER
    sub = {**hub, "subfolder": folder}
    if _resolve(path_or_repo_id, CONFIG_NAME, sub, required=False) is not None:
        model.load_length_head(path_or_repo_id, **sub)
        if policy is not None:
            model.config.length_policy = policy


def _shape_model(cls, config: AdaFlashConfig):
    """A weightless instance, for comparing the checkpoint's tensor names and shapes with what the config implies."""
    try:
        with torch.device("meta"):
            return cls(config)
    except (
        TypeError,
        ValueError,
        KeyError,
        AttributeError,
    ) as error:  # a config that passed validation yet builds nothing
        raise CheckpointError(
            f"The config cannot build a drafter ({_root_message(error)}): it is malformed."
        ) from error


def save_drafter(model, save_directory, *args, save_format: str = "dflash", target_lm_head=None, **kwargs) -> None:
    """Writes the checkpoint into a temporary sibling directory, then moves each file into place, the config
    last, so a reader never sees new weights with an old config or a half-written file."""
    if save_format not in SAVE_FORMATS:
        raise ValueError(
            f"save_format={save_format!r} must be 'dflash' (the official z-lab schema), 'adaflash' (native) or "
            "'speculators' (the speculators library's, which vLLM serves)"
        )
    if kwargs.pop("push_to_hub", False):
        raise ValueError("Use drafter.push_to_hub(repo_id): it also renders the model card.")
    target = Path(save_directory)
    with atomic_directory(target, merge=True, last=(CONFIG_NAME,)) as staging:
        if save_format == "speculators":
            _save_speculators(model, staging, target_lm_head)
        else:
            model._save_pretrained_native(staging, *args, **kwargs)
        if save_format == "dflash":
            config_dict = config_to_dflash_dict(model.config)
            (staging / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        for stale in target.glob("model*.safetensors*"):  # shards of a previous, differently sharded save
            if not (staging / stale.name).exists():
                stale.unlink()


def _save_speculators(model, staging: Path, target_lm_head) -> None:
    """speculators' layout: the drafter's tensors (a reduced vocabulary adds ``t2d``, ``d2t`` and the head's rows
    as ``lm_head.weight``, which speculators requires) and its config; the length head in ``length_head/``."""
    config = model.config
    state = {
        name: tensor.detach().contiguous().cpu()
        for name, tensor in model.state_dict().items()
        if not name.startswith("thresh_head_two_model.")
    }
    if config.draft_vocab is not None:
        if target_lm_head is None:
            raise ValueError(
                "The speculators format stores a reduced draft vocabulary's LM head rows: pass "
                "target_lm_head=target.get_output_embeddings() to save_pretrained(..., save_format='speculators')."
            )
        ids = vocab_ids(config.draft_vocab)
        weight = target_lm_head.weight.detach()
        if weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"target_lm_head has shape {tuple(weight.shape)}, not [vocab_size, hidden_size] = "
                f"[{config.vocab_size}, {config.hidden_size}]: pass the target's output embeddings."
            )
        state["lm_head.weight"] = vocab_rows(weight, ids).to(model.fc.weight.dtype).cpu()
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        state["d2t"] = ids - torch.arange(len(ids))
    save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
    (staging / CONFIG_NAME).write_text(json.dumps(config_to_speculators_dict(config), indent=2, sort_keys=True) + "\n")
    if model.thresh_head_two_model is not None:
        model.thresh_head_two_model.save_pretrained(staging / LENGTH_HEAD_FOLDER)


def load_length_head(cls, path_or_repo_id, **kwargs):
    """`AdaptiveLengthHead.from_pretrained` with the same safetensors-only checks as the drafter."""
    hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    raw = _read_json(_resolve(path_or_repo_id, CONFIG_NAME, hub))
    if raw.get("model_type") != AdaptiveLengthHeadConfig.model_type:
        raise CheckpointError(
            f"{path_or_repo_id!r} is not a length head (model_type={raw.get('model_type')!r}); "
            "save one with AdaptiveLengthHead.save_pretrained or drafter.length_head.save_pretrained"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for path in resolve_weight_files(path_or_repo_id, hub):
        shapes.update(read_safetensors_shapes(path))
    config = AdaptiveLengthHeadConfig.from_dict(raw)
    check_weights(_shape_model(cls, config), shapes, str(path_or_repo_id))
    return cls.from_pretrained(path_or_repo_id, config=config, use_safetensors=True, **hub, **kwargs)


__all__ = [
    "CheckpointError",
    "config_from_dict",
    "config_to_dflash_dict",
    "config_to_speculators_dict",
    "fields_from_speculators_dict",
    "load_drafter",
    "load_length_head",
    "read_safetensors_shapes",
    "save_drafter",
]
