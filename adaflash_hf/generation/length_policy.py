"""How many drafted tokens the target verifies per step: one rule, used by every decoding path.

A *candidate length* counts the anchor (the last committed token, which the target has not processed yet), so it
lies in ``[1, block_size]`` and the target verifies the anchor plus ``candidate_length - 1`` drafts (docs/algorithm.md
§3.6).

Policies:

* ``fixed``: the whole block (DFlash).
* ``adaptive``: AdaFlash's length head, ``clamp(round(pred * block_size * rate), min_len, block_size)``
  (docs/algorithm.md §6.5), with torch's half-to-even rounding like the reference.
* ``planned``: the cost-aware planner (`planner.py`) chooses the width of each step, zero drafts included, from the
  measured step costs and the rows' observed acceptance; the drafter drafts the whole block when it runs.
* ``confidence``: training-free; stop at the first draft ``j`` where ``1 - prod_{i<=j} p_i > threshold``, ``p_i`` being
  the drafter's top probability at draft ``i``, and verify the drafts before it (docs/algorithm.md §6.6); usable
  without a head.

The policy comes from the drafter config, and can be overridden per call with `GenerationConfig` attributes
``adaflash_length_policy``, ``adaflash_length_rate``, ``adaflash_min_candidate_length`` and
``adaflash_confidence_threshold`` (bare `generate()` kwargs would be rejected by transformers' kwarg validation).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..configuration import length_policy_problems

GENERATION_CONFIG_PREFIX = "adaflash_"


@dataclass(frozen=True)
class LengthPolicy:
    length_policy: str = "fixed"
    length_rate: float = 1.3
    min_candidate_length: int = 1
    confidence_threshold: float = 0.3

    @classmethod
    def resolve(cls, drafter_config, generation_config=None) -> LengthPolicy:
        """The drafter config's policy, overridden by `adaflash_*` attributes of the generation config."""
        values = {}
        for field in fields(cls):
            override = getattr(generation_config, GENERATION_CONFIG_PREFIX + field.name, None)
            values[field.name] = getattr(drafter_config, field.name) if override is None else override
        policy = cls(**values)
        policy.validate(drafter_config)
        return policy

    def validate(self, drafter_config) -> None:
        problems = length_policy_problems(self, drafter_config, prefix=GENERATION_CONFIG_PREFIX)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def needs_confidence(self) -> bool:
        return self.length_policy == "confidence"

    def candidate_lengths(
        self,
        block_size: int,
        batch_size: int,
        length_prediction: torch.Tensor | None = None,
        draft_confidence: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> torch.LongTensor:
        """Candidate lengths ``[B]`` in ``[1, block_size]``.

        length_prediction: ``[B]`` head output in (0, 1) (adaptive).
        draft_confidence: ``[B, block_size - 1]`` top probability of each draft (confidence).
        """
        if self.length_policy in ("fixed", "planned"):  # the planner caps the drafts in the loop
            return torch.full((batch_size,), block_size, dtype=torch.long, device=device)
        if self.length_policy == "adaptive":
            lengths = torch.round(length_prediction.float() * block_size * self.length_rate).long()
        else:
            doubt = 1.0 - torch.cumprod(draft_confidence.float(), dim=-1)
            over = doubt > self.confidence_threshold
            # first draft j (1-based) whose cumulative doubt exceeds the threshold; verify the drafts before it
            first = torch.where(
                over.any(-1), over.int().argmax(-1) + 1, torch.full_like(over[:, 0], block_size, dtype=torch.long)
            )
            lengths = first.long()
        return lengths.clamp(self.min_candidate_length, block_size)
