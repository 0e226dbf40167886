"""The checks a speculative ``generate()`` call passes before anything runs: one clear error for every feature the
decoding loop does not reproduce exactly, naming the fix.

The loop is exact for what passes here (greedy identity, the sampling distribution, stopping where plain decoding
stops); what it cannot reproduce (embeddings without ids, per-token attentions, bidirectional attention, caches
that cannot be cropped or whose columns it cannot move, trees where positions or masks are not per-node) is refused,
never run approximately. Option values are validated earlier, in one place (`options.py`).
"""

from __future__ import annotations

from transformers.cache_utils import DynamicCache

from .cache import check_movable, sliding_window
from .processing import check_processors, ids_independent


def check_call(target, input_ids, generation_config, logits_processor, streamer, model_kwargs, options) -> None:
    """One clear error, before anything runs, for every generate() feature the loop does not reproduce exactly."""
    batch, prompt_len = input_ids.shape
    if "inputs_embeds" in model_kwargs or prompt_len == 0:
        raise ValueError(
            "AdaFlash decoding needs input_ids: the drafter and the acceptance rule work on token ids, and "
            "generate(inputs_embeds=...) gives none. Pass input_ids, or drop assistant_model."
        )
    if generation_config.return_dict_in_generate:
        for flag in ("output_attentions", "output_hidden_states"):
            if getattr(generation_config, flag, False):
                raise ValueError(
                    f"{flag}=True is not supported with an AdaFlash drafter: the target runs one forward per "
                    f"verified block, not per token, so there are no per-token {flag.removeprefix('output_')} to "
                    f"return. Drop {flag}, or drop assistant_model."
                )
    if streamer is not None and batch > 1:
        raise ValueError(
            f"A streamer receives one row of tokens, and this batch has {batch} rows; stream one request per "
            "generate() call, or drop the streamer."
        )
    check_processors(logits_processor)
    if any(False in (getattr(m, "is_causal", None), getattr(m, "is_decoder", None)) for m in target.modules()):
        raise ValueError(
            f"{type(target).__name__} attends bidirectionally (a module has is_causal or is_decoder False, as "
            "BERT-style models without is_decoder=True do): verifying several drafts in one forward would let each "
            "position see the drafts after it. Build the target with is_decoder=True, or generate without "
            "assistant_model."
        )
    cache = model_kwargs.get("cache")
    if cache is None:
        supported = getattr(target, "_supports_default_dynamic_cache", lambda: True)()
        raise ValueError(
            "AdaFlash decoding needs the target's KV cache (it verifies drafts against it and crops rejected ones); "
            + (
                "this call runs without one: pass use_cache=True (it is False, given or from the model's generation "
                "config)."
                if supported
                else f"{type(target).__name__} has no DynamicCache support (its modeling code predates the cache "
                "API). Generate without assistant_model."
            )
        )
    if type(cache) is not DynamicCache:
        raise ValueError(
            f"AdaFlash decoding needs a DynamicCache (it crops rejected drafts and masks holes), got "
            f"{type(cache).__name__}: drop cache_implementation= or pass cache_implementation='dynamic'."
        )
    stateful = sorted({type(layer).__name__ for layer in cache.layers if not getattr(layer, "is_croppable", True)})
    if stateful:
        # the cache's own word, whatever the config's layer types say (check_compatible reads those)
        raise ValueError(
            f"The target's {stateful} cache layers cannot be cropped after a rejected draft (hybrid linear-attention/"
            "SSM state), so speculative decoding cannot be exact on it. Generate without assistant_model."
        )
    cached = cache.get_seq_length()
    if cached >= prompt_len:
        raise ValueError(
            f"The cache already holds all {cached} prompt tokens; generate() needs at least one new one to start "
            "from. Pass the cache of the prompt without its last token."
        )
    if batch > 1:
        check_movable(cache, "Batched AdaFlash decoding masks and compacts cache columns", "generate one row per call")
        window = sliding_window(cache)
        if window is not None and generation_config.max_length > window:
            # Beyond the window a sliding (or chunked) layer drops columns by count, holes included.
            raise NotImplementedError(
                f"Batched AdaFlash decoding with a sliding-window or chunked-attention target is exact only while "
                f"prompt + new tokens fit the window ({window}); got max_length={generation_config.max_length}. "
                "Generate row by row, or lower max_new_tokens."
            )
    if options.tree_budget is not None:
        # adaflash_ngram verifies a tree too (its paths merged into the drafter's): refused where trees are
        _check_trees(target, cache, logits_processor, "adaflash_ngram" if options.ngram else "adaflash_tree_budget")


def _alibi(target) -> bool:
    """Whether the target biases attention by ALiBi (bloom, falcon with ``alibi=True``, mpt): those build the bias
    from the running count of the 2D attention mask, not from position ids."""
    return bool(getattr(target.config, "alibi", False)) or any(
        callable(getattr(module, "build_alibi_tensor", None)) or getattr(module, "use_alibi", False)
        for module in target.modules()
    )


def _check_trees(target, cache, processors, option: str) -> None:
    """What tree verification (`tree.py`: ``adaflash_tree_budget``, ``adaflash_ngram``) cannot verify exactly;
    `option` is the setting that asked for it."""
    dependent = sorted({type(p).__name__ for p in processors if not ids_independent(p)})
    if dependent:
        raise ValueError(
            f"{option} does not support logits processors that read the ids ({dependent}): each tree node "
            f"has a prefix of its own, and they are called with one prefix per row. Drop {option} (linear "
            "verification supports them), or drop those generation settings."
        )
    if sliding_window(cache) is not None:
        raise NotImplementedError(
            f"{option} on a sliding-window or chunked-attention target: tree verification passes its own "
            f"4D attention mask, which would replace the window mask. Drop {option} for this target."
        )
    if _alibi(target):
        raise NotImplementedError(
            f"{option} on an ALiBi target ({type(target).__name__}): its position bias is built from a 2D "
            "attention mask, counting every earlier column, so tree nodes would get their index in the tree as their "
            f"distance instead of their depth. Drop {option} for this target (linear verification is "
            "exact on it)."
        )
    check_movable(
        cache,
        "Tree verification moves each step's accepted path to the front of its cache columns",
        f"drop {option} for this target",
    )
