"""Drafter checkpoint files: checked before a load, converted for a save; one clear error each.

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

The ``config.json`` schemas themselves, and `CheckpointError`, are `adaflash_hf.schema`'s. Loading and saving are
transformers' own (`AdaFlashDrafter.from_pretrained` and ``save_pretrained`` call ``super()``): this module checks a
checkpoint before the one load (`DrafterCheckpoint`) and converts a save to its format around the one save
(`save_keywords`, `staged_save`, `write_format_files`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel

from .configuration import AdaFlashConfig, AdaptiveLengthHeadConfig, config_from_dict, draft_vocab_problems
from .draft_vocab_rows import vocab_ids, vocab_rows
from .schema import (
    ADAFLASH_KEYS,
    CONFIG_NAME,
    HUB_KWARGS,
    UNSUPPORTED_HEADS,
    CheckpointError,
    config_to_dflash_dict,
    config_to_speculators_dict,
    read_config_dict,
    read_json,
    resolve_file,
    root_message,
)
from .utils import atomic_directory

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
_FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # safetensors dtypes a drafter checkpoint may hold
# speculators' draft-vocabulary maps, the only non-float tensors a drafter checkpoint may hold
_INDEX_TENSORS = {"t2d": {"BOOL": 1}, "d2t": {"I64": 8, "I32": 4}}
# Tensors of a speculators checkpoint that the verifier supplies (or that `DrafterCheckpoint` reads itself): never
# loaded as drafter weights.
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


# ---------------------------------------------------------------------------------------------- files


def resolve_weight_files(path_or_repo_id, hub_kwargs: dict) -> list[str]:
    """Paths of the safetensors weight files; refuses pickled weights."""
    single = resolve_file(path_or_repo_id, WEIGHTS_NAME, hub_kwargs, required=False)
    if single is not None:
        return [single]
    index = resolve_file(path_or_repo_id, WEIGHTS_INDEX_NAME, hub_kwargs, required=False)
    if index is not None:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files; the index is corrupt.")
        shards = sorted(set(weight_map.values()))
        return [resolve_file(path_or_repo_id, shard, hub_kwargs) for shard in shards]
    for name in PICKLED_WEIGHTS:
        if resolve_file(path_or_repo_id, name, hub_kwargs, required=False) is not None:
            raise CheckpointError(
                f"{path_or_repo_id!r} only has pickled weights ({name}). adaflash_hf loads safetensors only, because "
                "unpickling can execute arbitrary code. Convert it once in a trusted environment: "
                "`AdaFlashDrafter(config).load_state_dict(torch.load(path, weights_only=True))` then save_pretrained."
            )
    raise CheckpointError(f"{path_or_repo_id!r} has no {WEIGHTS_NAME} (or sharded safetensors) weights.")


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


# ---------------------------------------------------------------------------------------------- load


@dataclass
class DrafterCheckpoint:
    """A drafter checkpoint checked before `AdaFlashDrafter.from_pretrained` loads it through transformers: the config
    to build the drafter with, the keywords for the one load, and what the load does after it (a speculators
    checkpoint's length head, saved beside it)."""

    path_or_repo_id: str | os.PathLike
    config: AdaFlashConfig
    hub: dict
    load_kwargs: dict
    attach_saved_length_head: bool = False
    length_head_policy: str | None = None  # the policy the saved length head is attached with

    @classmethod
    def check(cls, model_class, path_or_repo_id, kwargs: dict) -> DrafterCheckpoint:
        """Reads the checkpoint's config (``config.json``, unless ``kwargs`` holds a ``config``; config fields in
        ``kwargs`` override it) and checks its weight files against it: safetensors only, complete, inside the
        checkpoint, and exactly the tensors a ``model_class`` drafter of that config has. Nothing is loaded yet."""
        kwargs = dict(kwargs)
        config = kwargs.pop("config", None)
        kwargs.pop("trust_remote_code", None)  # never needed, never honoured: no repository code runs
        hub, overrides, load_kwargs = _split_kwargs(kwargs)
        source = str(path_or_repo_id)
        raw: dict = {}
        if config is None:
            raw, config_source = read_config_dict(path_or_repo_id, hub)
            config = config_from_dict(raw, config_source, **overrides)
        elif not isinstance(config, AdaFlashConfig):
            raise CheckpointError(
                f"config must be an AdaFlashConfig, got a {type(config).__name__}: pass an AdaFlashConfig, or no "
                "config to read the checkpoint's own"
            )
        speculators = "speculators_model_type" in raw
        files = resolve_weight_files(path_or_repo_id, hub)
        shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            shapes.update(read_safetensors_shapes(path))
        if speculators:
            _speculators_vocab(config, files, shapes, raw.get("draft_vocab_size"), source)
        check_weights(
            _shape_model(model_class, config), shapes, source, ignored=SPECULATORS_EXTRAS if speculators else ()
        )
        saved_policy = (raw.get("adaflash_config") or {}).get("length_policy")
        return cls(
            path_or_repo_id,
            config,
            hub,
            load_kwargs,
            attach_saved_length_head=speculators and not config.use_length_head,
            length_head_policy=overrides.get("length_policy", saved_policy),
        )

    def from_pretrained_kwargs(self) -> dict:
        """The keywords of the one `PreTrainedModel.from_pretrained` call: the checked config, safetensors only, the
        Hub keywords and the caller's loading keywords (``dtype``, ``device_map``, ...)."""
        return {"config": self.config, "use_safetensors": True, **self.hub, **self.load_kwargs}

    def finish(self, model):
        """What the load does after the weights: the drafter remembers where it came from, and a speculators
        checkpoint's length head, saved beside it in ``length_head/``, is attached."""
        model.config.name_or_path = str(self.path_or_repo_id)
        if self.attach_saved_length_head:
            _attach_saved_length_head(model, self.path_or_repo_id, self.hub, self.length_head_policy)
        return model


def _split_kwargs(kwargs: dict) -> tuple[dict, dict, dict]:
    hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    config_fields = set(AdaFlashConfig.__dataclass_fields__) | set(ADAFLASH_KEYS)
    overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in config_fields}
    return hub, overrides, kwargs


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
    if resolve_file(path_or_repo_id, CONFIG_NAME, sub, required=False) is not None:
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
            f"The config cannot build a drafter ({root_message(error)}): it is malformed."
        ) from error


def load_length_head(cls, path_or_repo_id, **kwargs):
    """`AdaptiveLengthHead.from_pretrained` with the same safetensors-only checks as the drafter."""
    hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    raw, _ = read_config_dict(path_or_repo_id, hub)
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


# ---------------------------------------------------------------------------------------------- save


def save_keywords(model, save_format: str, target_lm_head, kwargs: dict) -> dict:
    """Checks a save's format and keywords, and returns the keywords of the one `PreTrainedModel.save_pretrained`
    call: the caller's, with the state dict the format stores when it is not the model's own (speculators')."""
    if save_format not in SAVE_FORMATS:
        raise ValueError(
            f"save_format={save_format!r} must be 'dflash' (the official z-lab schema), 'adaflash' (native) or "
            "'speculators' (the speculators library's, which vLLM serves)"
        )
    kwargs = dict(kwargs)
    if kwargs.pop("push_to_hub", False):
        raise ValueError("Use drafter.push_to_hub(repo_id): it also renders the model card.")
    if save_format == "speculators":
        kwargs["state_dict"] = _speculators_state_dict(model, kwargs.get("state_dict"), target_lm_head)
    return kwargs


@contextmanager
def staged_save(save_directory) -> Iterator[Path]:
    """A staging folder for one save: when the block succeeds, its files replace those of ``save_directory``, the
    config last, so a reader never sees new weights with an old config or a half-written file; weight shards of a
    previous, differently sharded save are removed. When the block raises, ``save_directory`` is untouched."""
    target = Path(save_directory)
    with atomic_directory(target, merge=True, last=(CONFIG_NAME,)) as staging:
        yield staging
        for stale in target.glob("model*.safetensors*"):
            if not (staging / stale.name).exists():
                stale.unlink()


def write_format_files(model, staging: Path, save_format: str) -> None:
    """Turns the native checkpoint transformers wrote into ``staging`` into ``save_format``'s: its ``config.json``
    in that schema and, for speculators, which has no place for it, the length head in ``length_head/``."""
    if save_format == "adaflash":
        return
    convert = config_to_speculators_dict if save_format == "speculators" else config_to_dflash_dict
    (staging / CONFIG_NAME).write_text(json.dumps(convert(model.config), indent=2, sort_keys=True) + "\n")
    if save_format == "speculators" and model.thresh_head_two_model is not None:
        model.thresh_head_two_model.save_pretrained(staging / LENGTH_HEAD_FOLDER)


def _speculators_state_dict(model, state_dict: dict | None, target_lm_head) -> dict:
    """speculators' tensors: the drafter's without the length head (saved beside it); a reduced vocabulary adds
    ``t2d``, ``d2t`` and the LM head's rows as ``lm_head.weight``, which speculators requires."""
    config = model.config
    state = {
        name: tensor
        for name, tensor in (state_dict if state_dict is not None else model.state_dict()).items()
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
    return state


__all__ = [
    "DrafterCheckpoint",
    "check_weights",
    "load_length_head",
    "read_safetensors_shapes",
    "save_keywords",
    "staged_save",
    "write_format_files",
]
