"""What the decoding loop measures about one (target, drafter) pair in this process, owned by one object.

The loop learns facts about the machine it runs on, not about a call: the wall time of its steps by rows and width
(the planner's `CostTable`, per device and dtype), which dtype projects drafts faster (`draft_head.py`), which GEMM
layout verifies a few tokens faster (`verify_layout.py`), and it keeps the draft head's weight copies those choices
need. A `RuntimeProfile` holds all of it for one pair, behind one lock (several threads may generate with the same
pair), so a later ``generate()`` call starts from what earlier ones measured. `profile_for` finds a pair's profile;
it lives as long as both models do. `RuntimeProfile.reset` forgets everything (the next call measures again), and
`RuntimeProfile.to_dict` is what the profile measured, in plain types.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .measured import MeasuredChoice
from .planner import CostTable

HEAD_DTYPE_TRIALS = 3  # timed draft-head calls of each dtype before "auto" decides
LAYOUT_TRIALS = 2  # timed forwards of each layout per token count (a forward costs about a plain step)

# drafter -> target -> profile; weak on both sides, so a profile leaves with either model
_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROFILES_LOCK = threading.Lock()


class RuntimeProfile:
    """The measurements of one (target, drafter) pair (see the module docstring).

    Attributes:
        lock (`threading.RLock`): guards every table below.
        head_dtypes (`MeasuredChoice`): float32 or bfloat16 for the draft head, by (device, head shape, vocabulary).
        layouts (`MeasuredChoice`): ``"linear"`` or ``"transposed"`` for a verification forward, by tokens verified.
    """

    def __init__(self):
        self.lock = threading.RLock()
        # bfloat16 only if it wins by 20%; the transposed layout only if it wins by 10%
        self.head_dtypes = MeasuredChoice(
            torch.float32, torch.bfloat16, trials=HEAD_DTYPE_TRIALS, margin=0.8, lock=self.lock
        )
        self.layouts = MeasuredChoice("linear", "transposed", trials=LAYOUT_TRIALS, margin=0.9, lock=self.lock)
        self._cost_tables: dict[tuple[str, str], CostTable] = {}
        # (dtype, vocabulary key) -> (the weight it was made from, its version then, the copy)
        self._head_copies: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}

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
            copy = weight.detach() if rows is None else weight.detach().index_select(0, rows.to(weight.device))
            copy = copy.to(dtype)
            self._head_copies[(dtype, key)] = (weakref.ref(weight), weight._version, copy)
            return copy

    def reset(self) -> None:
        """Forgets every measurement and copy: the next calls measure again."""
        with self.lock:
            self.head_dtypes.clear()
            self.layouts.clear()
            self._cost_tables.clear()
            self._head_copies.clear()

    def to_dict(self) -> dict:
        """What was measured, in plain types (step costs in seconds by ``"rows,width"``, decided choices)."""
        with self.lock:
            return {
                "cost_tables": {
                    f"{device}/{dtype}": {
                        "step_s": {f"{rows},{width}": s for (rows, width), s in table.step_s.items()},
                        "acceptance": table.acceptance,
                        "head_scale": table.head_scale,
                    }
                    for (device, dtype), table in self._cost_tables.items()
                },
                "head_dtypes": {str(key): str(dtype) for key, dtype in self.head_dtypes.choices.items()},
                "layouts": {str(key): layout for key, layout in self.layouts.choices.items()},
            }


def profile_for(target, drafter) -> RuntimeProfile:
    """The profile of this (target, drafter) pair in this process (made on first use)."""
    with _PROFILES_LOCK:
        per_target = _PROFILES.setdefault(drafter, weakref.WeakKeyDictionary())
        profile = per_target.get(target)
        if profile is None:
            profile = per_target[target] = RuntimeProfile()
        return profile
