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
``adaflash_confidence_threshold``, read by `options.py`.

How the loop consults a policy each step is the `StepPlan` protocol: `PolicyPlan` for the policies above, whose
lengths the candidate generator applies as it drafts, and the planner (`planner.VerificationPlanner`) for
``planned``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..configuration import length_policy_problems


@dataclass(frozen=True)
class LengthPolicy:
    length_policy: str = "fixed"
    length_rate: float = 1.3
    min_candidate_length: int = 1
    confidence_threshold: float = 0.3

    def problems(self, drafter_config, prefix: str = "") -> list[str]:
        """What is wrong with this policy for the drafter; empty when nothing is."""
        return length_policy_problems(self, drafter_config, prefix=prefix)

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


class StepPlan(Protocol):
    """What the decoding loop asks a step's plan, once each per step, in this order (a one-row call's step without
    drafts: `before_draft`, then `after_plain`). Plans only choose how many drafts are verified; what is committed is
    the acceptance rule's, so no plan can change the output."""

    def before_draft(
        self, rows: list[int], room: torch.LongTensor, paths: list[list[int]] | None = None
    ) -> torch.LongTensor:
        """Most drafts each active row (``rows``: their indices in the call's batch) may verify this step, within
        ``room [R]`` (each row's token budget, less the token the target adds); all zero: the drafter does not run
        (a plain step, or merged paths alone). ``paths``: with ``adaflash_ngram``, the first n-gram continuation
        each row's context offers this step (`ngram.py`; empty: none)."""

    def path_nodes(self, cap: int) -> int:
        """Tokens of merged n-gram paths each row's tree may hold this step, at most ``cap``
        (``adaflash_ngram_nodes``); asked after `before_draft`."""

    def probing(self) -> bool:
        """Whether this step's drafts are only scored, none verified (the planner's probes): the drafter then drafts
        only the rows `before_draft` asked drafts of, and apart from the call's context where it has read none yet
        (`AdaFlashCandidateGenerator.probe`); asked after `before_draft`, when some row may draft."""

    def projected(
        self, rows: list[int], length_prediction: torch.Tensor | None, max_drafts: torch.LongTensor
    ) -> torch.LongTensor:
        """Drafts of each row that may be verified, ``[R]``, at most ``max_drafts`` (`before_draft`'s): asked once
        the drafter's forward has run (``length_prediction [R]``: its length head's, ``None`` without one) and
        before its hidden states are projected to logits, whose cost grows with the positions projected; the
        drafts beyond are never computed. Not asked for a probe."""

    def after_draft(self, rows: list[int], drafts) -> torch.LongTensor:
        """Drafts each row verifies, ``[R]``, at most ``drafts.num_drafts`` (`candidate_generator.Drafts`)."""

    def tree_shape(self, num_drafts, room, drafted: int, budget: int) -> tuple[torch.LongTensor, int]:
        """``(depth [R], tokens)`` of this step's draft trees, given the drafts chosen, each row's ``room``, the
        ``drafted`` positions of the block and ``adaflash_tree_budget``."""

    def untimed(self) -> None:
        """This step ran a one-off cost (a measurement of the draft head's dtype): not a price of anything."""

    def read_prompts(self) -> None:
        """This step's draft read every row's prompt (a call's first draft): not the price of a draft."""

    def trial(self) -> None:
        """This step's forward timed one of the candidate kernels for its token count (`verify_layout.py`)."""

    def after_verify(self, rows: list[int], verified, emitted: torch.LongTensor) -> dict:
        """The verified step's outcome (`verifiers.Verified`; ``emitted [R]``: the tokens each row committed, cut
        where it stopped); returns what the plan predicted and measured, for `record_stats()`."""

    def after_plain(self, rows: list[int], committed: list[list[int]]) -> dict:
        """`after_verify` for a step that verified no drafts and no paths (the loop's plain step of a one-row call):
        ``committed``, per row, the tokens it committed."""


class PolicyPlan:
    """The `StepPlan` of the ``fixed``, ``adaptive`` and ``confidence`` policies: the candidate generator applies the
    policy's lengths as it drafts, so every step drafts, a tree is as deep as the drafts chosen, and merged n-gram
    paths take up to ``adaflash_ngram_nodes`` of its budget."""

    def before_draft(self, rows, room, paths=None):
        return room

    def path_nodes(self, cap):
        return cap

    def probing(self) -> bool:
        return False

    def projected(self, rows, length_prediction, max_drafts):
        return max_drafts  # the policy's own lengths cut the projection (`AdaFlashCandidateGenerator._drafts`)

    def after_draft(self, rows, drafts):
        return drafts.num_drafts

    def tree_shape(self, num_drafts, room, drafted, budget):
        return num_drafts, budget

    def untimed(self) -> None:
        pass

    def read_prompts(self) -> None:
        pass

    def trial(self) -> None:
        pass

    def after_verify(self, rows, verified, emitted) -> dict:
        return {}

    def after_plain(self, rows, committed) -> dict:
        return {}
