"""Every ``adaflash_*`` generation setting of one call, read from the `GenerationConfig` and validated in one place.

transformers keeps each decoding method's options as typed `GenerationConfig` fields checked by one ``validate()``;
adaflash_hf's options ride on the same object as ``adaflash_*`` attributes (bare ``generate()`` kwargs are refused by
transformers' kwarg validation), so they are read here once, into `AdaFlashGenerationOptions`, and every part of the
loop (routing, the decoding loop, the candidate generator, the draft head, the verification layout) reads that object,
never the `GenerationConfig`. A misspelt ``adaflash_*`` attribute is an error naming the valid ones, and every problem
of a call is reported in one error.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .draft_head import resolve_dtype_name
from .length_policy import LengthPolicy
from .verify_layout import VERIFY_LAYOUTS

PREFIX = "adaflash_"
DECODING_LOOPS = ("adaflash", "transformers")


@dataclass(frozen=True)
class AdaFlashGenerationOptions:
    """The ``adaflash_*`` settings of one ``generate()`` call.

    > Drafting

    length_policy (`LengthPolicy`): how many drafts a step verifies (``adaflash_length_policy``,
        ``adaflash_length_rate``, ``adaflash_min_candidate_length``, ``adaflash_confidence_threshold``; defaults from
        the drafter config).
    adapter_names (`list[str]`, *optional*): one PEFT adapter name per batch row (``adaflash_adapter_names``;
        ``"__base__"`` drafts a row with the bare drafter).
    draft_head_dtype (`str`): ``adaflash_draft_head_dtype``: ``"auto"`` (measured), ``"same"`` or a dtype name
        (`draft_head.py`).

    > Verification

    tree_budget (`int`, *optional*): ``adaflash_tree_budget``: tokens of a draft tree verified per row and step,
        anchor included (`tree.py`); ``None`` verifies the linear block.
    verify_layout (`str`): ``adaflash_verify_layout``: ``"auto"`` (measured), ``"linear"`` (the model's own kernel:
        off), or a kernel always used, ``"transposed"`` or ``"onednn"`` (`verify_layout.py`).
    decoding_loop (`str`): ``adaflash_decoding_loop``: ``"adaflash"`` (adaflash_hf's batched loop) or
        ``"transformers"`` (transformers' assisted loop driving the candidate generator, batch 1).
    """

    length_policy: LengthPolicy
    adapter_names: list[str] | None = None
    draft_head_dtype: str = "auto"
    tree_budget: int | None = None
    verify_layout: str = "auto"
    decoding_loop: str = "adaflash"

    @classmethod
    def attribute_names(cls) -> list[str]:
        """The ``GenerationConfig`` attributes read here."""
        policy = [PREFIX + f.name for f in fields(LengthPolicy)]
        return sorted(policy + [PREFIX + f.name for f in fields(cls) if f.name != "length_policy"])

    @classmethod
    def from_generation_config(cls, generation_config, drafter_config) -> AdaFlashGenerationOptions:
        """The call's options: ``adaflash_*`` attributes of ``generation_config`` over the drafter config's length
        policy. Raises one `ValueError` naming every problem."""
        given = {
            name: value
            for name, value in vars(generation_config).items()
            if name.startswith(PREFIX) and value is not None
        }
        valid = cls.attribute_names()
        problems = [
            f"{name} is not an adaflash_hf generation setting (valid: {', '.join(valid)})"
            for name in sorted(set(given) - set(valid))
        ]

        policy_values = {
            f.name: given.get(PREFIX + f.name, getattr(drafter_config, f.name)) for f in fields(LengthPolicy)
        }
        policy = LengthPolicy(**policy_values)
        problems += policy.problems(drafter_config, prefix=PREFIX)

        budget = given.get(PREFIX + "tree_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            problems.append(
                f"adaflash_tree_budget must be a positive int (tokens verified per row and step, anchor included; 1 "
                f"is a plain step), got {budget!r}; drop it to verify the linear block"
            )
        layout = given.get(PREFIX + "verify_layout", "auto")
        if layout not in VERIFY_LAYOUTS:
            problems.append(
                f"adaflash_verify_layout={layout!r} is not one of {', '.join(map(repr, VERIFY_LAYOUTS))} ('auto' "
                "measures which kernel verifies a few tokens fastest on this machine; 'linear' turns that off)"
            )
        head_dtype = "auto"
        try:
            head_dtype = resolve_dtype_name(given.get(PREFIX + "draft_head_dtype"))
        except ValueError as error:
            problems.append(str(error).rstrip("."))
        loop = given.get(PREFIX + "decoding_loop", "adaflash")
        if loop not in DECODING_LOOPS:
            problems.append(f"adaflash_decoding_loop={loop!r} must be 'adaflash' or 'transformers'")
        names = given.get(PREFIX + "adapter_names")
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
            problems.append(f"adaflash_adapter_names must be a list of adapter names (one per row), got {names!r}")
        if loop == "transformers":
            if budget is not None:
                problems.append(
                    "adaflash_tree_budget needs adaflash_hf's loop: transformers' assisted-decoding loop verifies one "
                    "linear candidate per step; drop adaflash_decoding_loop='transformers', or drop "
                    "adaflash_tree_budget"
                )
            if layout not in ("auto", "linear"):
                problems.append(
                    f"adaflash_verify_layout={layout!r} needs adaflash_hf's loop: transformers' assisted-decoding "
                    "loop runs its own verification forwards; drop adaflash_decoding_loop='transformers', or drop "
                    "adaflash_verify_layout"
                )
        if problems:
            raise ValueError("Invalid AdaFlash generation settings: " + "; ".join(problems) + ".")
        return cls(
            length_policy=policy,
            adapter_names=None if names is None else list(names),
            draft_head_dtype=head_dtype,
            tree_budget=budget,
            verify_layout=layout,
            decoding_loop=loop,
        )
