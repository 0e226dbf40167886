"""Routes ``target.generate(..., assistant_model=drafter)`` to AdaFlash when the assistant is an AdaFlash drafter.

transformers 5.24 has no public registry for speculative decoding methods, so `install()` wraps three private
`GenerationMixin` methods. Each wrapper is a pure function of its arguments (thread-safe, no global state), dispatches
on the drafter's duck-typed `_is_adaflash_drafter` marker (which survives PEFT wrapping, unlike `isinstance`), and
otherwise chains to the method that was there before, so ordinary assistants and other patchers are untouched:

* `_validate_generation_mode`: clear errors for what speculative decoding cannot do (beam search, ...);
* `_assisted_decoding`: our loop (`decoding.py`), any batch size; also prompt lookup (``prompt_lookup_num_tokens``)
  with ``adaflash_ngram=True`` and no assistant, which our loop runs with n-gram paths only;
* `_get_candidate_generator`: `AdaFlashCandidateGenerator`, for callers that choose transformers' own loop with
  ``GenerationConfig(adaflash_decoding_loop="transformers")`` (batch 1; compile, output_attentions, ...). That loop
  checks stopping criteria once per accepted block, so it is refused with criteria beyond EOS and max length (stop
  strings, custom criteria), where it would run past the stop; our loop cuts a block exactly there.

``speculation_type="dflash"`` always reaches transformers' native DFlash path, with our drafter as its assistant.
The wrapped signatures are checked at install; if they changed, nothing is wrapped and a warning points to the
public `custom_generate=adaflash_hf.generate_loop` entry point, which needs no patch. `uninstall()` restores a method
only while ours is still the one installed (by identity): a wrapper another library stacked on top stays.
"""

from __future__ import annotations

import functools
import inspect
import warnings

from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerationMixin

from .candidate_generator import AdaFlashCandidateGenerator
from .decoding import adaflash_decoding
from .options import AdaFlashGenerationOptions

EXPECTED_SIGNATURES = {
    "_assisted_decoding": (
        "self",
        "input_ids",
        "logits_processor",
        "stopping_criteria",
        "generation_config",
        "synced_gpus",
        "streamer",
        "inputs_tensor",
        "assistant_model",
        "assistant_tokenizer",
        "tokenizer",
        "model_kwargs",
    ),
    "_get_candidate_generator": (
        "self",
        "generation_config",
        "input_ids",
        "inputs_tensor",
        "logits_processor",
        "model_kwargs",
        "assistant_model",
        "target_tokenizer",
        "assistant_tokenizer",
    ),
    "_validate_generation_mode": ("self", "generation_mode", "generation_config", "generation_mode_kwargs"),
}
# name -> (the method install() put on GenerationMixin, the one it replaced); empty while not installed
_installed: dict[str, tuple] = {}


def is_adaflash_drafter(model) -> bool:
    return model is not None and bool(getattr(model, "_is_adaflash_drafter", False))


def _ours(assistant_model, generation_config) -> bool:
    return is_adaflash_drafter(assistant_model) and generation_config.speculation_type != "dflash"


def _paths_only(assistant_model, generation_config) -> bool:
    """Prompt lookup in our loop: ``generate(prompt_lookup_num_tokens=k)`` with ``adaflash_ngram=True`` and no
    assistant (n-gram paths only: batched, lossless, `candidate_generator.PathProposer`)."""
    return assistant_model is None and getattr(generation_config, "adaflash_ngram", None) is True


def _options(assistant_model, generation_config) -> AdaFlashGenerationOptions:
    return AdaFlashGenerationOptions.from_generation_config(generation_config, assistant_model.config)


def _validate_generation_mode(previous, self, generation_mode, generation_config, generation_mode_kwargs):
    assistant = generation_mode_kwargs.get("assistant_model")
    if _ours(assistant, generation_config):
        if generation_mode != GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                f"An AdaFlash drafter supports greedy decoding and sampling, not {generation_mode.value} "
                f"(num_beams={generation_config.num_beams}): set num_beams=1, or drop assistant_model."
            )
        if "assistant_tokenizer" in generation_mode_kwargs:
            raise ValueError("An AdaFlash drafter shares the target's tokenizer: do not pass assistant_tokenizer.")
    elif _paths_only(assistant, generation_config) and generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"adaflash_ngram=True without an assistant_model is prompt lookup in adaflash_hf's loop: pass "
            f"prompt_lookup_num_tokens=k (tokens per continuation) with greedy decoding or sampling (this call is "
            f"{generation_mode.value}), or pass assistant_model=<AdaFlashDrafter>, or drop adaflash_ngram."
        )
    return previous(self, generation_mode, generation_config, generation_mode_kwargs)


def _assisted_decoding(
    previous,
    self,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    ours = _ours(assistant_model, generation_config)
    if ours and _options(assistant_model, generation_config).decoding_loop == "transformers":
        _check_transformers_loop(input_ids, stopping_criteria)
    elif ours or _paths_only(assistant_model, generation_config):
        if synced_gpus:
            raise ValueError("adaflash_hf's decoding loop does not support synced_gpus (FSDP/ZeRO-3 generation).")
        return adaflash_decoding(
            self,
            assistant_model if ours else None,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer=streamer,
            **model_kwargs,
        )
    return previous(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus,
        streamer,
        inputs_tensor,
        assistant_model,
        assistant_tokenizer,
        tokenizer,
        **model_kwargs,
    )


def _check_transformers_loop(input_ids, stopping_criteria) -> None:
    """What transformers' assisted loop, driven by our candidate generator, does not do exactly (the options it
    cannot honour are refused by `options.py`)."""
    if input_ids.shape[0] > 1:
        raise ValueError(
            f"adaflash_decoding_loop='transformers' runs transformers' assisted-decoding loop, which is batch 1; this "
            f"batch has {input_ids.shape[0]} rows. Drop adaflash_decoding_loop (adaflash_hf's loop is batched), or "
            "generate one row per call."
        )
    others = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if others:
        raise ValueError(
            f"adaflash_decoding_loop='transformers' checks stopping criteria once per accepted block, so it would run "
            f"past {others} when they fire inside one. Drop adaflash_decoding_loop (adaflash_hf's loop stops exactly "
            "there), or drop those criteria."
        )


def _get_candidate_generator(
    previous,
    self,
    generation_config,
    input_ids,
    inputs_tensor,
    logits_processor,
    model_kwargs,
    assistant_model=None,
    target_tokenizer=None,
    assistant_tokenizer=None,
):
    if _ours(assistant_model, generation_config):
        options = _options(assistant_model, generation_config)
        return AdaFlashCandidateGenerator(self, assistant_model, generation_config, logits_processor, options)
    return previous(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model,
        target_tokenizer,
        assistant_tokenizer,
    )


_WRAPPERS = {
    "_assisted_decoding": _assisted_decoding,
    "_get_candidate_generator": _get_candidate_generator,
    "_validate_generation_mode": _validate_generation_mode,
}


def is_installed() -> bool:
    return bool(_installed)


def install() -> bool:
    """Wraps the generate() internals once (idempotent). Returns whether the routing is active."""
    if is_installed():
        return True
    changed = [
        name
        for name, params in EXPECTED_SIGNATURES.items()
        if tuple(inspect.signature(getattr(GenerationMixin, name)).parameters) != params
    ]
    if changed:
        warnings.warn(
            f"adaflash_hf: this transformers version changed {changed}, so generate(assistant_model=drafter) is not "
            "routed to AdaFlash. Use target.generate(**inputs, custom_generate=adaflash_hf.generate_loop, "
            "drafter=drafter) instead, or install a tested transformers version (see pyproject.toml).",
            stacklevel=2,
        )
        return False
    for name, wrapper in _WRAPPERS.items():
        previous = getattr(GenerationMixin, name)
        method = _bind(wrapper, previous)
        setattr(GenerationMixin, name, method)
        _installed[name] = (method, previous)
    return True


def _bind(wrapper, previous):
    @functools.wraps(previous)
    def method(self, *args, **kwargs):
        return wrapper(previous, self, *args, **kwargs)

    return method


def uninstall() -> bool:
    """Restores the methods that were there before `install()`; returns whether the routing is now off.

    Only our own wrappers are removed. If another library wrapped one of these methods after `install()`, restoring
    ours would silently drop theirs too, so nothing is restored and a warning names the methods.
    """
    stacked = [name for name, (method, _) in _installed.items() if getattr(GenerationMixin, name) is not method]
    if stacked:
        warnings.warn(
            f"adaflash_hf.uninstall(): {stacked} were wrapped again after adaflash_hf.install() by other code; "
            "removing adaflash_hf's wrappers would remove those too, so the routing stays installed. Uninstall the "
            "other wrappers first.",
            stacklevel=2,
        )
        return False
    for name, (_, previous) in _installed.items():
        setattr(GenerationMixin, name, previous)
    _installed.clear()
    return True


def generate_loop(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    drafter=None,
    adaflash_streamer=None,
    **model_kwargs,
):
    """Patch-free entry point: ``target.generate(**inputs, custom_generate=adaflash_hf.generate_loop, drafter=d)``
    (no drafter, with ``adaflash_ngram=True`` and ``prompt_lookup_num_tokens``: n-gram paths only).

    transformers does not forward `streamer` to a `custom_generate` callable, hence `adaflash_streamer`.
    """
    if not (is_adaflash_drafter(drafter) or _paths_only(drafter, generation_config)):
        raise ValueError(
            "generate_loop needs drafter=<AdaFlashDrafter> (custom_generate callables get no assistant_model), or "
            "adaflash_ngram=True for n-gram paths only"
        )
    return adaflash_decoding(
        model,
        drafter,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer=adaflash_streamer,
        **model_kwargs,
    )
