"""What the decoding loop measures about one (target, drafter) pair in this process, owned by one object.

The loop learns facts about the machine it runs on, not about a call: the wall time of its steps by rows and width
(the planner's `CostTable`, per device and dtype), which dtype projects drafts faster (`draft_head.py`), which GEMM
layout verifies a few tokens faster (`verify_layout.py`), and it keeps the draft head's weight copies those choices
need. A `RuntimeProfile` holds all of it for one pair, behind one lock (several threads may generate with the same
pair), so a later ``generate()`` call starts from what earlier ones measured. `profile_for` finds a pair's profile;
it lives as long as both models do. `RuntimeProfile.reset` forgets everything (the next call measures again), and
`RuntimeProfile.to_dict` is what the profile measured, in plain types.

What a process measured, the next one starts from: a profile is kept in a small JSON file per (machine, torch
version, target config, drafter config) under ``$HF_HOME/adaflash_hf/profiles`` (``ADAFLASH_HF_PROFILE_DIR`` names
another folder; ``ADAFLASH_HF_PROFILE_DIR=none`` keeps profiles in memory only). The file carries a format version
and the key it was measured under; one that cannot be read, or was measured elsewhere (copied from another machine,
another torch), is ignored with one warning and rewritten from this process's measurements. Writes are atomic.
Step costs keep being averaged as the new process runs, so a profile measured while the machine was busy heals.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
import weakref
from pathlib import Path

import torch

from ..draft_vocab_rows import vocab_rows
from ..machine import machine_info
from ..utils import write_json_atomic
from .measured import MeasuredChoice
from .planner import CostTable
from .verify_layout import KERNELS, kernels_for

# 5: the draft head's dtype is chosen with its kernels, per position count; 4: kernels reroute the linear layers only
# (their costs and the steps' prices changed); 3: four kernels; 2: three
PROFILE_FORMAT = 5
PROFILE_DIR_ENV = "ADAFLASH_HF_PROFILE_DIR"
SAVE_INTERVAL_S = 60.0  # cost tables are rewritten at most this often; a new decision is written at once
LAYOUT_TRIALS = 2  # timed forwards of each layout per token count (a forward costs about a plain step)
HEAD_KERNEL_TRIALS = 3  # timed draft-head products of each option per position count (each a few milliseconds)
# A kernel whose timed forward costs this many times the model's own is timed no more for that token count: four
# kernels' trials of two forwards each are the dearest steps of a pair's first calls (BENCHMARKS.md section 24)
LAYOUT_DROP = 1.25

# drafter -> target -> profile; weak on both sides, so a profile leaves with either model
_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROFILES_LOCK = threading.Lock()


# the draft head's option that projects with a bfloat16 copy; every other option is a float32 kernel
BFLOAT16 = "bfloat16"


def head_candidates(key: tuple) -> tuple[str, ...]:
    """The options timed against float32 ``linear`` for a `draft_head.DraftHead._choice_key`: the verification
    kernels for its position count (`verify_layout.kernels_for`) where they are measured (the key says so only up to
    `verify_layout.MAX_MEASURED_TOKENS`), and the bfloat16 copy under "auto"."""
    _, tokens, auto, kernels = key
    return (kernels_for(tokens) if kernels else ()) + ((BFLOAT16,) if auto else ())


class RuntimeProfile:
    """The measurements of one (target, drafter) pair (see the module docstring).

    Attributes:
        lock (`threading.RLock`): guards every table below.
        layouts (`MeasuredChoice`): the linear kernel of the loop's forwards (``"linear"``, ``"transposed"``,
            ``"onednn"``, ``"blocked"``: `verify_layout.KERNELS`), by `verify_layout.measured_key` of their tokens.
        head_kernels (`MeasuredChoice`): the same kernels, or a bfloat16 copy, for a float32 draft head's product,
            by `draft_head.DraftHead`'s key (the head, its projected positions, what is measured for them).
    """

    def __init__(self):
        self.lock = threading.RLock()
        # another kernel only if it wins by 10%, and one that a forward shows a quarter slower than the model's own
        # is not timed again (`LAYOUT_DROP`); the draft head's bfloat16 copy only if it wins by 20%
        self.layouts = MeasuredChoice(
            "linear",
            tuple(KERNELS)[1:],
            trials=LAYOUT_TRIALS,
            margin=0.9,
            lock=self.lock,
            candidates_for=kernels_for,
            drop=LAYOUT_DROP,
        )
        self.head_kernels = MeasuredChoice(
            "linear",
            (*tuple(KERNELS)[1:], BFLOAT16),
            trials=HEAD_KERNEL_TRIALS,
            margin=0.9,
            lock=self.lock,
            candidates_for=head_candidates,
            drop=LAYOUT_DROP,
            margins={BFLOAT16: 0.8},
        )
        self._cost_tables: dict[tuple[str, str], CostTable] = {}
        # (dtype, vocabulary key) -> (the weight it was made from, its version then, the copy)
        self._head_copies: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}
        self.path: Path | None = None  # the profile file (`attach`); None: in memory only
        self.key: dict | None = None
        self.loaded = False  # whether measurements came from the file
        self._saved: str | None = None
        self._saved_at = 0.0

    def cost_table(self, device: torch.device, dtype: torch.dtype) -> CostTable:
        """The planner's table for steps on ``device`` with a target in ``dtype``."""
        with self.lock:
            return self._cost_tables.setdefault((device.type, str(dtype)), CostTable())

    def head_copy(self, weight: torch.Tensor, dtype: torch.dtype, rows: torch.LongTensor | None, key) -> torch.Tensor:
        """``weight`` (its ``rows`` only, when given; ``key`` tells row sets apart) in ``dtype``, made once per weight
        and version (a weight trained in place gets a fresh copy)."""
        with self.lock:
            made = self._head_copies.get((dtype, key))
            if made is not None and made[0]() is weight and made[1] == weight._version:
                return made[2]
            copy = weight.detach() if rows is None else vocab_rows(weight.detach(), rows)
            copy = copy.to(dtype)
            self._head_copies[(dtype, key)] = (weakref.ref(weight), weight._version, copy)
            return copy

    def reset(self) -> None:
        """Forgets every measurement and copy: the next calls measure again."""
        with self.lock:
            self.layouts.clear()
            self.head_kernels.clear()
            self._cost_tables.clear()
            self._head_copies.clear()

    def to_dict(self) -> dict:
        """What was measured, in plain types: step costs by ``"rows,width"`` per ``"device/dtype"``, the decided
        choices (the form the profile file keeps)."""
        with self.lock:
            return {
                "cost_tables": {
                    f"{device}/{dtype}": {
                        "step_s": {f"{rows},{width}": s for (rows, width), s in table.step_s.items()},
                        "drafted_speedup": {str(rows): x for rows, x in table.drafted_speedup.items()},
                        "draft_s": {str(rows): x for rows, x in table.draft_s.items()},
                        "probe_s": {str(rows): x for rows, x in table.settled_probes().items()},
                        "undrafted_s": {f"{rows},{width}": s for (rows, width), s in table.undrafted_s.items()},
                        "acceptance": table.acceptance,
                        "path_acceptance": table.path_acceptance,
                        "head_scale": table.head_scale,
                    }
                    for (device, dtype), table in self._cost_tables.items()
                },
                "layouts": [[_plain(key), layout] for key, layout in self.layouts.choices.items()],
                "head_kernels": [[_plain(key), kernel] for key, kernel in self.head_kernels.choices.items()],
            }

    def load_dict(self, state: dict) -> None:
        """Takes the measurements of `to_dict`'s form (a profile file's); raises on a malformed one."""
        with self.lock:
            for name, table in state["cost_tables"].items():
                device, dtype = name.split("/")
                cost = self._cost_tables.setdefault((device, dtype), CostTable())
                for key, seconds in table["step_s"].items():
                    rows, width = key.split(",")
                    cost.step_s[(int(rows), int(width))] = float(seconds)
                cost.drafted_speedup.update({int(r): float(x) for r, x in table["drafted_speedup"].items()})
                cost.draft_s.update({int(r): float(x) for r, x in table.get("draft_s", {}).items()})
                cost.probe_s.update({int(r): float(x) for r, x in table.get("probe_s", {}).items()})
                for key, seconds in table.get("undrafted_s", {}).items():
                    rows, width = key.split(",")
                    cost.undrafted_s[(int(rows), int(width))] = float(seconds)
                cost.acceptance, cost.head_scale = float(table["acceptance"]), float(table["head_scale"])
                stored = table.get("path_acceptance", cost.path_acceptance)
                # a profile written before paths were modelled per depth holds one rate: it stands for every depth
                stored = [stored] * len(cost.path_acceptance) if isinstance(stored, (int, float)) else stored
                if len(stored) != len(cost.path_acceptance):
                    raise ValueError(f"path_acceptance holds {len(stored)} depths, not {len(cost.path_acceptance)}")
                cost.path_acceptance = [float(x) for x in stored]
            for stored, choice in ((state["layouts"], self.layouts), (state["head_kernels"], self.head_kernels)):
                for key, layout in stored:
                    if layout not in choice.options:
                        raise ValueError(f"unknown layout {layout!r}")
                    choice.choices[_hashable(key)] = layout

    # ------------------------------------------------------------------ the profile file

    def attach(self, path: Path, key: dict) -> None:
        """Keeps this profile in ``path`` (measured under ``key``), starting from what the file holds."""
        self.path, self.key = path, key
        if not path.is_file():
            return
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            if payload.get("format") != PROFILE_FORMAT or payload.get("key") != key:
                raise ValueError(
                    f"measured under {payload.get('key')!r} (format {payload.get('format')!r}), not this process's "
                    f"{key!r} (format {PROFILE_FORMAT})"
                )
            self.load_dict(payload["profile"])
            self.loaded = True
            self._saved = json.dumps(self.to_dict(), sort_keys=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is ignored the same way
            self.reset()
            warnings.warn(
                f"adaflash_hf: ignoring the runtime profile {path} ({type(error).__name__}: {error}); it will be "
                "measured again and rewritten.",
                stacklevel=2,
            )

    def save(self, force: bool = False) -> bool:
        """Writes the profile file when something changed: a new decision at once, cost tables at most every
        `SAVE_INTERVAL_S`. Returns whether it wrote."""
        if getattr(self, "path", None) is None:
            return False
        with self.lock:
            state = self.to_dict()
            text = json.dumps(state, sort_keys=True)
            if text == self._saved:
                return False
            decided = self._saved is None or _decisions(state) != _decisions(json.loads(self._saved))
            if not (force or decided or time.monotonic() - self._saved_at >= SAVE_INTERVAL_S):
                return False
            try:
                write_json_atomic(self.path, {"format": PROFILE_FORMAT, "key": self.key, "profile": state}, indent=1)
            except OSError as error:  # a read-only cache folder must not fail generation
                warnings.warn(f"adaflash_hf: could not write the runtime profile {self.path}: {error}", stacklevel=2)
                self.path = None
                return False
            self._saved, self._saved_at = text, time.monotonic()
            return True


def _plain(key):
    """A choice key in JSON's types (tuples as lists)."""
    return [_plain(k) for k in key] if isinstance(key, tuple) else key


def _hashable(key):
    """`_plain`'s inverse."""
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _decisions(state: dict) -> tuple:
    return tuple(json.dumps(state[name], sort_keys=True) for name in ("layouts", "head_kernels"))


def profile_dir() -> Path | None:
    """Where profile files live (module docstring); ``None``: nowhere."""
    configured = os.environ.get(PROFILE_DIR_ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "none", "off", "0") else Path(configured)
    from huggingface_hub.constants import HF_HOME

    return Path(HF_HOME) / "adaflash_hf" / "profiles"


def _config_digest(model) -> str:
    """The model's configuration, less the folder it was loaded from (`_name_or_path`): the same checkpoint read from
    another folder (a moved checkout, another copy of a Hub snapshot) runs at the same costs, and keeps its profile."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        fields = {name: value for name, value in config.to_dict().items() if name != "_name_or_path"}
        text = json.dumps(fields, sort_keys=True, default=str)
    else:
        text = type(model).__name__
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_key() -> dict:
    """What a profile's measurements depend on besides the models: the CPU (model and the ISA that torch's kernels
    use), the CPUs this process may use, torch (version, threads, BLAS) and the GPUs (`adaflash_hf.machine`)."""
    info = machine_info()
    keep = ("vendor", "model_name", "family", "model", "isa", "cpus", "torch_version", "torch_threads", "blas")
    return {name: info.get(name) for name in (*keep, "cpu_capability", "gpus")}


class _NoDrafter:
    """The drafter slot of the n-gram-only loop's profile (weakly referenced like a drafter; lives forever)."""

    config = None


_NO_DRAFTER = _NoDrafter()


def profile_for(target, drafter, subfolder: str | None = None) -> RuntimeProfile:
    """The profile of this (target, drafter) pair in this process (made on first use); ``drafter=None``: the
    target's own, for the n-gram-only loop. ``subfolder``: where the profile is made by this call, its file is kept
    in that subfolder of the profile folder (the benchmarks give each method's copy of one drafter its own: the
    file's name is keyed by the drafter's configuration, which the copies share)."""
    drafter = _NO_DRAFTER if drafter is None else drafter
    with _PROFILES_LOCK:
        per_target = _PROFILES.setdefault(drafter, weakref.WeakKeyDictionary())
        profile = per_target.get(target)
        if profile is None:
            profile = per_target[target] = RuntimeProfile()
            folder = profile_dir()
            if folder is not None:
                key = {**machine_key(), "target": _config_digest(target), "drafter": _config_digest(drafter)}
                name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
                profile.attach(folder / (subfolder or "") / f"{name}.json", key)
        return profile
