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
from .prefill import PREFILL_MODES
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
    ngram (`bool`): ``adaflash_ngram``: add the continuations the row's own context offers for its suffix (prompt
        lookup, `ngram.py`) to each step's draft tree, verified in the same forward (`tree.py`); implies tree
        verification (``tree_budget`` defaults to the drafter's block plus ``ngram_nodes``). Without a drafter
        (``prompt_lookup_num_tokens`` and no ``assistant_model``): prompt lookup in adaflash_hf's loop, `paths_only`.
    ngram_max_match, ngram_min_match (`int`): ``adaflash_ngram_max_match`` (3; 2 without a drafter),
        ``adaflash_ngram_min_match`` (1): the suffix lengths matched, longest first (transformers'
        ``max_matching_ngram_size`` is read as the first).
    ngram_tokens (`int`): ``adaflash_ngram_tokens`` (10): tokens per continuation (transformers'
        ``prompt_lookup_num_tokens`` is read as it).
    ngram_continuations (`int`): ``adaflash_ngram_continuations`` (2; 1 without a drafter): distinct continuations
        of one match.
    ngram_nodes (`int`): ``adaflash_ngram_nodes`` (16): most tree nodes the continuations take per row and step,
        within ``tree_budget``.
    verify_layout (`str`): ``adaflash_verify_layout``: ``"auto"`` (measured), ``"linear"`` (the model's own kernel:
        off), or a kernel always used, ``"transposed"``, ``"onednn"`` or ``"blocked"`` (`verify_layout.py`), in the
        target's forwards and the draft head's float32 product (`draft_head.py`).
    prefill (`str`): ``adaflash_prefill``: how the prompt is read, by the target and by the drafter's first draft:
        ``"auto"`` (in groups of rows of similar length on a CPU when that saves more padding than the extra forwards
        cost, `prefill.py`; one padded forward elsewhere), ``"ragged"`` (groups on any device, same rule) or
        ``"padded"`` (one forward over the padded batch, as plain decoding).
    decoding_loop (`str`): ``adaflash_decoding_loop``: ``"adaflash"`` (adaflash_hf's batched loop) or
        ``"transformers"`` (transformers' assisted loop driving the candidate generator, batch 1).
    """

    length_policy: LengthPolicy
    adapter_names: list[str] | None = None
    draft_head_dtype: str = "auto"
    tree_budget: int | None = None
    ngram: bool = False
    ngram_max_match: int = 3
    ngram_min_match: int = 1
    ngram_tokens: int = 10
    ngram_continuations: int = 2
    ngram_nodes: int = 16
    verify_layout: str = "auto"
    prefill: str = "auto"
    decoding_loop: str = "adaflash"

    @classmethod
    def attribute_names(cls) -> list[str]:
        """The ``GenerationConfig`` attributes read here."""
        policy = [PREFIX + f.name for f in fields(LengthPolicy)]
        return sorted(policy + [PREFIX + f.name for f in fields(cls) if f.name != "length_policy"])

    @classmethod
    def from_generation_config(cls, generation_config, drafter_config) -> AdaFlashGenerationOptions:
        """The call's options: ``adaflash_*`` attributes of ``generation_config`` over the drafter config's length
        policy (``drafter_config=None``: the n-gram-only loop, `paths_only`). Raises one `ValueError` naming every
        problem."""
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

        if given.get(PREFIX + "ngram") is True:
            given = prompt_lookup_names(generation_config, given, problems)
        if drafter_config is None:
            given = paths_only(given, problems)
            policy = LengthPolicy(length_policy="planned")
        else:
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
        ngram = given.get(PREFIX + "ngram", False)
        if not isinstance(ngram, bool):
            problems.append(f"adaflash_ngram must be True or False, got {ngram!r}")
        sizes = {}
        for name in ("ngram_max_match", "ngram_min_match", "ngram_tokens", "ngram_continuations", "ngram_nodes"):
            value = given.get(PREFIX + name, getattr(cls, name))
            sizes[name] = value
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{PREFIX}{name} must be a positive int, got {value!r}")
            elif not ngram and PREFIX + name in given:
                problems.append(f"{PREFIX}{name} is set without adaflash_ngram=True; set it, or drop {PREFIX}{name}")
        if not problems and sizes["ngram_min_match"] > sizes["ngram_max_match"]:
            problems.append(
                f"adaflash_ngram_min_match ({sizes['ngram_min_match']}) exceeds adaflash_ngram_max_match "
                f"({sizes['ngram_max_match']}); the suffixes matched are max_match tokens down to min_match"
            )
        if ngram is True and budget is None:
            block = 1 if drafter_config is None else drafter_config.block_size
            budget = block + sizes["ngram_nodes"]  # the drafter's block, and the paths' room
        layout = given.get(PREFIX + "verify_layout", "auto")
        if layout not in VERIFY_LAYOUTS:
            problems.append(
                f"adaflash_verify_layout={layout!r} is not one of {', '.join(map(repr, VERIFY_LAYOUTS))} ('auto' "
                "measures which kernel verifies a few tokens fastest on this machine; 'linear' turns that off)"
            )
        prefill = given.get(PREFIX + "prefill", "auto")
        if prefill not in PREFILL_MODES:
            problems.append(
                f"adaflash_prefill={prefill!r} is not one of {', '.join(map(repr, PREFILL_MODES))} ('padded' reads "
                "the prompt in one forward over the padded batch, as plain decoding does)"
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
            if ngram is True:
                problems.append(
                    "adaflash_ngram needs adaflash_hf's loop: transformers' assisted-decoding loop verifies one "
                    "linear candidate per step (its own prompt lookup is prompt_lookup_num_tokens, without a "
                    "drafter); drop adaflash_decoding_loop='transformers', or drop adaflash_ngram"
                )
            elif budget is not None:
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
            ngram=ngram,
            **sizes,
            verify_layout=layout,
            prefill=prefill,
            decoding_loop=loop,
        )


def paths_only(given: dict, problems: list[str]) -> dict:
    """The settings of the n-gram-only loop (no drafter: ``generate(prompt_lookup_num_tokens=k,
    generation_config=GenerationConfig(adaflash_ngram=True))``): prompt lookup's defaults (the longest match 2
    tokens, one continuation), and the planner chooses every step's width (no length policy applies without a
    drafter); its problems join `problems`."""
    given = dict(given)
    if given.get(PREFIX + "ngram") is not True:
        problems.append(
            "without an AdaFlash drafter adaflash_hf's loop verifies n-gram paths only: set adaflash_ngram=True, or "
            "pass assistant_model=<AdaFlashDrafter>"
        )
        return given
    if PREFIX + "ngram_max_match" not in given:
        given[PREFIX + "ngram_max_match"] = 2  # transformers' prompt lookup default
    if PREFIX + "ngram_continuations" not in given:
        given[PREFIX + "ngram_continuations"] = 1  # a chain: what prompt lookup verifies
    drafter_only = sorted(
        name
        for name in given
        if name.removeprefix(PREFIX) in {f.name for f in fields(LengthPolicy)} | {"draft_head_dtype", "adapter_names"}
    )
    if drafter_only:
        problems.append(f"{', '.join(drafter_only)} need a drafter; drop them for n-gram-only decoding")
    return given


def prompt_lookup_names(generation_config, given: dict, problems: list[str]) -> dict:
    """With ``adaflash_ngram=True``, transformers' prompt lookup settings (``prompt_lookup_num_tokens``,
    ``max_matching_ngram_size``) name the continuation length and the longest match where the ``adaflash_ngram_*``
    ones are not given; both given and different is a problem."""
    given = dict(given)
    names = {"ngram_tokens": "prompt_lookup_num_tokens", "ngram_max_match": "max_matching_ngram_size"}
    for ours, theirs in names.items():
        value = getattr(generation_config, theirs, None)
        if value is not None:
            if PREFIX + ours in given and given[PREFIX + ours] != value:
                problems.append(f"{theirs}={value} and {PREFIX}{ours}={given[PREFIX + ours]} disagree; give one")
            given.setdefault(PREFIX + ours, value)
    return given
