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

Both use the same tensor names (docs/algorithm.md §2.3), stored as safetensors. Pickled weights are refused, and no
file of a repository is ever executed (the ``auto_map``/``dflash.py`` of z-lab repos is ignored).
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.utils.hub import cached_file

from .configuration import (
    ADAFLASH_KEYS,
    DFLASH_ARCHITECTURE,
    UNSUPPORTED_HEADS,
    AdaFlashConfig,
    AdaptiveLengthHeadConfig,
    CheckpointError,
    config_to_dflash_dict,
    fields_from_dflash_dict,
    is_dflash_dict,
)
from .utils import atomic_directory

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder", "proxies")
_FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # safetensors dtypes a drafter checkpoint may hold


# ---------------------------------------------------------------------------------------------- config schema


def config_from_dict(raw: dict, source: str = "config.json", **overrides) -> AdaFlashConfig:
    """Builds an `AdaFlashConfig` from a z-lab DFlash, AdaFlash or native `config.json` dict."""
    if raw.get("model_type") == AdaFlashConfig.model_type:
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
    elif is_dflash_dict(raw):
        fields = fields_from_dflash_dict(raw, source)
    else:
        raise CheckpointError(
            f"{source} is not a DFlash or AdaFlash drafter config (model_type={raw.get('model_type')!r}, "
            f"architectures={raw.get('architectures')}): a drafter config has model_type 'adaflash', or "
            f"architectures ['{DFLASH_ARCHITECTURE}'] with a 'dflash_config' dict. Is this the target model?"
        )
    fields.update(overrides)
    try:
        return AdaFlashConfig(**fields)
    except Exception as error:  # strict dataclass validation: wrong types or values
        raise CheckpointError(f"{source} is malformed: {_root_message(error)}") from error


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
    spans = sorted((_tensor_span(path, name, entry, fix), name) for name, entry in header.items())
    end = 0
    for (begin, stop), name in spans:  # safetensors data is contiguous: each tensor starts where the last ended
        if begin != end:
            raise CheckpointError(f"{path}: tensor {name} starts at byte {begin}, expected {end}: {fix}.")
        end = stop
    needed = 8 + header_len + end
    if needed > size:
        raise CheckpointError(f"{path} is truncated ({size} of {needed} bytes): {fix}.")
    return {name: tuple(entry["shape"]) for name, entry in header.items()}


def _tensor_span(path: str, name: str, entry, fix: str) -> tuple[int, int]:
    """The byte span of one header entry, after checking that its dtype is a float type and that its shape and
    dtype fill that span exactly (what the safetensors reader would otherwise reject with its own error)."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: the header entry of {name} is not an object: {fix}.")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _FLOAT_BYTES:
        raise CheckpointError(
            f"{path}: tensor {name} has dtype {dtype!r}; drafter weights are floating point ({sorted(_FLOAT_BYTES)}): "
            f"{fix}."
        )
    valid = (
        isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not valid or offsets[1] - offsets[0] != math.prod(shape) * _FLOAT_BYTES[dtype]:
        raise CheckpointError(
            f"{path}: tensor {name} has shape {shape!r}, dtype {dtype} and offsets {offsets!r}, which disagree: {fix}."
        )
    return offsets[0], offsets[1]


def check_weights(model: PreTrainedModel, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Raises if the checkpoint's tensors do not match `model` exactly (names and shapes)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    skipped = tuple(UNSUPPORTED_HEADS.values())
    unexpected = sorted(n for n in shapes if n not in expected and not n.startswith(skipped))
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
    if config is None:
        raw = _read_json(_resolve(path_or_repo_id, CONFIG_NAME, hub))
        config = config_from_dict(raw, f"{source}/{CONFIG_NAME}", **overrides)
    elif not isinstance(config, AdaFlashConfig):
        raise CheckpointError(f"config must be an AdaFlashConfig, got {type(config).__name__}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in resolve_weight_files(path_or_repo_id, hub):
        shapes.update(read_safetensors_shapes(path))
    check_weights(_shape_model(cls, config), shapes, source)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*model_type.*")
        model = PreTrainedModel.from_pretrained.__func__(
            cls, path_or_repo_id, *model_args, config=config, use_safetensors=True, **hub, **load_kwargs
        )
    model.config.name_or_path = source
    return model


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


def save_drafter(model, save_directory, *args, save_format: str = "dflash", **kwargs) -> None:
    """Writes the checkpoint into a temporary sibling directory, then moves each file into place, the config
    last, so a reader never sees new weights with an old config or a half-written file."""
    if save_format not in ("dflash", "adaflash"):
        raise ValueError(f"save_format={save_format!r} must be 'dflash' (official schema) or 'adaflash' (native)")
    if kwargs.pop("push_to_hub", False):
        raise ValueError("Use drafter.push_to_hub(repo_id): it also renders the model card.")
    target = Path(save_directory)
    with atomic_directory(target, merge=True, last=(CONFIG_NAME,)) as staging:
        model._save_pretrained_native(staging, *args, **kwargs)
        if save_format == "dflash":
            config_dict = config_to_dflash_dict(model.config)
            (staging / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        for stale in target.glob("model*.safetensors*"):  # shards of a previous, differently sharded save
            if not (staging / stale.name).exists():
                stale.unlink()


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
    "load_drafter",
    "load_length_head",
    "read_safetensors_shapes",
    "save_drafter",
]
