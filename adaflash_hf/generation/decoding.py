"""The speculative decoding loop behind ``target.generate(..., assistant_model=drafter)``, for any batch size.

Per step and per active row: the drafter drafts one block after the anchor (`AdaFlashCandidateGenerator`), the
length policy picks how many drafts to verify, the target verifies ``[anchor, drafts...]`` in one forward, and the
acceptance rule (`acceptance.py`) commits the accepted drafts plus one target token, which becomes the next anchor.

Batch > 1 (ragged acceptance): rows verify different numbers of tokens, padded to the longest; the target's
`DynamicCache` keeps every row's rejected drafts and padding as *holes*, masked out by a 2D attention mask, while
each row carries explicit position ids, so every row computes exactly what it would compute alone. Holes that all
rows share at the end of the cache are cropped right away (with one row, that is all of them, so batch 1 never
carries a mask); the rest is compacted away when it exceeds `COMPACT_FRACTION` of the cache. Rows that finish
leave the batch and stop costing compute.

Stopping is exact: a step's committed tokens are cut at EOS, at the token budget and at the first token where any
other stopping criterion (stop strings, max time, custom criteria) fires, as plain decoding would have stopped there.
Criteria and ids-dependent logits processors are called with the whole batch, as plain decoding calls them.

What plain decoding does with a stopped row while the batch runs on is reproduced whenever the output shows it: the
row then stays in the batch (padded with an EOS criterion, still generating without one) for its scores, its tokens
and its cache columns, and the returned cache is rebuilt to plain decoding's layout (`_rebuild_cache`). A cache the
caller prefilled with the start of the prompt is continued, not re-run. Whatever the loop cannot reproduce is refused
by `_check_call` before anything runs.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import greedy_acceptance, speculative_sampling
from .candidate_generator import AdaFlashCandidateGenerator
from .planner import VerificationPlanner, cost_table
from .processing import check_processors, ids_independent, process_positions
from .stats import CallRecorder
from .tree import build_trees, tree_attention_mask, walk_trees
from .verify_layout import VerifyLayout

COMPACT_FRACTION = 0.5  # compact the target cache once holes exceed this fraction of its columns
# Every tensor a cache layer keeps per position, by layer class: attribute -> (batch dim, position dim). Moving a
# cache column (tree paths to the front, compaction, parking and rebuilding rows) moves all of them together; a
# layer class not listed here (by exact type: a subclass may keep more) is refused wherever columns move, never
# moved in part.
_POSITION_TENSORS = {
    DynamicLayer: {"keys": (0, 2), "values": (0, 2)},
    DynamicSlidingWindowLayer: {"keys": (0, 2), "values": (0, 2)},
    # DeepSeek sparse attention (deepseek_v32, glm_moe_dsa, ...): the indexer scores cached tokens by these keys
    DynamicIndexedLayer: {
        "keys": (0, 2),
        "values": (0, 2),
        "indexer_keys": (0, 1),
        "indexer_position_ids": (1, 2),
    },
    DummyLayer: {},
}


def _prefill_positions(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.LongTensor:
    """Position ids as transformers' generate() builds them: count only unmasked tokens (left padding)."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, -1)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _check_call(target, input_ids, generation_config, logits_processor, streamer, model_kwargs) -> None:
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
        _check_movable(
            cache, "Batched AdaFlash decoding masks and compacts cache columns", "generate one row per call"
        )
        window = _window(cache)
        if window is not None and generation_config.max_length > window:
            # Beyond the window a sliding (or chunked) layer drops columns by count, holes included.
            raise NotImplementedError(
                f"Batched AdaFlash decoding with a sliding-window or chunked-attention target is exact only while "
                f"prompt + new tokens fit the window ({window}); got max_length={generation_config.max_length}. "
                "Generate row by row, or lower max_new_tokens."
            )


def _window(cache) -> int | None:
    """The smallest sliding window (or attention chunk) among the cache's layers: the layers say what the target
    really uses (a config may carry a `sliding_window` no layer applies, as Qwen2-MoE's 0)."""
    windows = [layer.sliding_window for layer in cache.layers if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


def _check_movable(cache, what: str, instead: str) -> None:
    """Refuses caches with a layer whose per-position tensors `_POSITION_TENSORS` does not know."""
    unknown = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in _POSITION_TENSORS})
    if unknown:
        raise NotImplementedError(
            f"{what}, and the target's {unknown} cache layers may keep per-position state the loop does not know how "
            f"to move with its columns; {instead}."
        )


def _position_tensors(layer) -> dict[str, tuple[torch.Tensor, int, int]]:
    """A layer's per-position tensors that hold data: name -> (tensor, batch dim, position dim)."""
    found = {}
    for name, (batch_dim, position_dim) in _POSITION_TENSORS[type(layer)].items():
        tensor = getattr(layer, name, None)
        if tensor is not None and tensor.dim() > max(batch_dim, position_dim):
            found[name] = (tensor, batch_dim, position_dim)
    return found


def _gather_positions(tensor, batch_dim: int, position_dim: int, index: torch.LongTensor) -> torch.Tensor:
    """``tensor`` with positions ``index [B, W]`` of each row, along its position dim."""
    moved = tensor.movedim((batch_dim, position_dim), (0, 1))
    picked = moved.gather(1, index.view(*index.shape, *[1] * (moved.dim() - 2)).expand(-1, -1, *moved.shape[2:]))
    return picked.movedim((0, 1), (batch_dim, position_dim))


def _gather_columns(
    layer, index: torch.LongTensor, valid: torch.Tensor | None = None, columns: slice | None = None
) -> None:
    """Keeps columns ``index [B, W]`` of every row of a cache layer (zeros where ``valid`` is False), in every tensor
    the layer keeps per position (`_POSITION_TENSORS`; keys and values apart, as their head dims may differ on MLA
    targets such as DeepSeek-V3). With `columns`, only that span is rearranged (``index`` then counts from its start)
    and the rest of the layer stays as it is."""
    for name, (tensor, batch_dim, position_dim) in _position_tensors(layer).items():
        span = tensor if columns is None else tensor.narrow(position_dim, columns.start, columns.stop - columns.start)
        picked = _gather_positions(span, batch_dim, position_dim, index)
        if valid is not None:
            keep = valid.view(*valid.shape, *[1] * (picked.dim() - 2)).movedim((0, 1), (batch_dim, position_dim))
            picked = picked.masked_fill(~keep, 0)
        if columns is None:
            setattr(layer, name, picked)
        else:
            span.copy_(picked)
    if columns is None and hasattr(layer, "cumulative_length"):
        # a sliding layer's length bookkeeping sizes the next mask; batched decoding keeps it inside the window
        layer.cumulative_length = index.shape[1]


def _alibi(target) -> bool:
    """Whether the target biases attention by ALiBi (bloom, falcon with ``alibi=True``, mpt): those build the bias
    from the running count of the 2D attention mask, not from position ids."""
    return bool(getattr(target.config, "alibi", False)) or any(
        callable(getattr(module, "build_alibi_tensor", None)) or getattr(module, "use_alibi", False)
        for module in target.modules()
    )


def _tree_budget(generation_config, processors, target, cache, window) -> int | None:
    """``GenerationConfig(adaflash_tree_budget=n)``: verify a draft tree of ``n`` tokens (anchor included) per row and
    step (`tree.py`); ``None`` (the default) verifies the linear block."""
    budget = getattr(generation_config, "adaflash_tree_budget", None)
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"adaflash_tree_budget must be a positive int (tokens verified per row and step, anchor included; 1 is a "
            f"plain step), got {budget!r}. Drop it to verify the linear block."
        )
    dependent = sorted({type(p).__name__ for p in processors if not ids_independent(p)})
    if dependent:
        raise ValueError(
            f"adaflash_tree_budget does not support logits processors that read the ids ({dependent}): each tree node "
            "has a prefix of its own, and they are called with one prefix per row. Drop adaflash_tree_budget (linear "
            "verification supports them), or drop those generation settings."
        )
    if window is not None:
        raise NotImplementedError(
            "adaflash_tree_budget on a sliding-window or chunked-attention target: tree verification passes its own "
            "4D attention mask, which would replace the window mask. Drop adaflash_tree_budget for this target."
        )
    if _alibi(target):
        raise NotImplementedError(
            f"adaflash_tree_budget on an ALiBi target ({type(target).__name__}): its position bias is built from a 2D "
            "attention mask, counting every earlier column, so tree nodes would get their index in the tree as their "
            "distance instead of their depth. Drop adaflash_tree_budget for this target (linear verification is "
            "exact on it)."
        )
    _check_movable(
        cache,
        "Tree verification moves each step's accepted path to the front of its cache columns",
        "drop adaflash_tree_budget for this target",
    )
    return budget


class SpeculativeDecoding:
    """State and steps of one speculative generate() call (see the module docstring)."""

    def __init__(
        self,
        target,
        drafter,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer,
        model_kwargs,
    ):
        _check_call(target, input_ids, generation_config, logits_processor, streamer, model_kwargs)
        self.target = target
        self.config = generation_config
        self.processors = logits_processor
        self.streamer = streamer
        self.generator = AdaFlashCandidateGenerator(target, drafter, generation_config, logits_processor)
        self.hidden_layers = self.generator.model_kwargs_overrides["output_hidden_states"]
        self.cache = model_kwargs["cache"]
        self.window = _window(self.cache)
        self.cache.activate_past_recording()  # lets sliding-window layers roll back rejected tokens
        self.attention_mask = model_kwargs.get("attention_mask")
        self.position_ids = model_kwargs.get("position_ids")

        batch, prompt_len = input_ids.shape
        self.prompt_len = prompt_len
        self.max_new_tokens = generation_config.max_length - prompt_len
        pad = generation_config._pad_token_tensor
        self.pad_token_id = int(pad) if pad is not None else 0
        self.sequences = input_ids.new_full((batch, generation_config.max_length), self.pad_token_id)
        self.sequences[:, :prompt_len] = input_ids
        self.lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=input_ids.device)
        self.active = torch.arange(batch, device=input_ids.device)  # original row index of each active row
        # new tokens of each row when plain decoding would have stopped it (-1: still running)
        self.stopped_at = torch.full((batch,), -1, dtype=torch.long, device=input_ids.device)
        eos = generation_config._eos_token_tensor
        self.eos = None if eos is None else eos.to(input_ids.device).flatten()
        self.extra_criteria = StoppingCriteriaList(
            [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        )
        keep = generation_config.return_dict_in_generate
        self.scores = [[] for _ in range(batch)] if keep and generation_config.output_scores else None
        self.raw_logits = [[] for _ in range(batch)] if keep and generation_config.output_logits else None
        # The cache outlives generate() when it is returned or was passed in (as in transformers' _sample).
        self.returns_cache = keep or getattr(self.cache, "_is_user_defined", False) or self.cache.get_seq_length() > 0
        # Plain decoding runs every row until the whole batch stops: a stopped row then gets padding (with an EOS
        # criterion) or keeps generating (without one), and its scores and cache columns are computed all the same.
        # Rows stay in the batch as *trailing* rows whenever any of that is visible in the output.
        self.keep_rows = batch > 1 and (self.returns_cache or self.eos is None)
        self.parked = {}  # row -> its cache columns and mask, once it left the batch (returned caches only)
        self.recorder = CallRecorder(batch, input_ids.device)
        self.planner = None
        self.mask_dtype = next(target.parameters()).dtype  # tree masks are additive, in the target's dtype
        if self.generator.policy.length_policy == "planned":
            table = cost_table(target, drafter, input_ids.device, self.mask_dtype)
            head = getattr(drafter.config, "use_length_head", False)
            self.planner = VerificationPlanner(
                table, self.generator.block_size, batch, input_ids.device, length_head=head
            )
        self.tree_budget = _tree_budget(generation_config, logits_processor, target, self.cache, self.window)
        self.verify_layout = VerifyLayout(target, getattr(generation_config, "adaflash_verify_layout", None))

    # ------------------------------------------------------------------ loop

    @torch.no_grad()
    def run(self):
        self.prefill()
        while self.active.numel():
            self.step()
        if self.streamer is not None:
            self.streamer.end()
        return self.output()

    def prefill(self):
        batch, length = self.sequences.shape[0], self.prompt_len
        cached = self.cache.get_seq_length()  # a prefix cache the caller filled (multi-turn, prompt caching)
        positions = self.position_ids
        if positions is None:
            positions = _prefill_positions(self.attention_mask, batch, length, self.sequences.device)
        positions = positions[:, cached:]
        outputs = self.target(
            input_ids=self.sequences[:, cached:length],
            attention_mask=self.attention_mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.hidden_layers,
            logits_to_keep=1,
        )
        if self.cache.get_seq_length() != length:
            # Older modeling code (openai-gpt, ...) accepts a cache and ignores it, so plain decoding re-reads the
            # whole sequence each step while verification would see the drafts without their context; others add
            # columns of their own, which the per-token holes and positions of the loop do not account for.
            raise ValueError(
                f"{type(self.target).__name__} keeps {self.cache.get_seq_length()} KV-cache columns for {length} "
                "prompt tokens (its modeling code ignores the cache it is given, or adds columns of its own), and "
                "AdaFlash decoding verifies drafts against a cache of one column per token. Generate without "
                "assistant_model."
            )
        raw = outputs.logits[:, -1:].float()
        processed, first = process_positions(
            self.processors, self.sequences, self.lengths, raw.clone(), choose=self.generator.choose
        )
        self.cache_mask = None if self.attention_mask is None else self.attention_mask.bool()
        # The drafter reads the target features of the new prompt tokens only; a cached prefix has none. Drafts may
        # be worse for it; the output is not, since the target verifies every token.
        valid = None if self.attention_mask is None else self.attention_mask[:, cached:].bool()
        self.generator.add_context(self.generator.context_features(outputs.hidden_states), positions, valid)
        self.next_positions = positions[:, -1] + 1
        self.commit(first, torch.ones(batch, dtype=torch.long, device=first.device), processed, raw, width=1)

    def step(self):
        rows, generator = self.active, self.generator
        if self.planner is not None:
            self.planner.begin()
        start = self.recorder.clock()
        budget = self._limit() - (self.lengths[rows] - self.prompt_len)
        max_drafts = budget - 1
        if self.window is not None:
            max_drafts = torch.clamp(max_drafts, max=self._room() - 1)
        anchors = self.sequences[rows, self.lengths[rows] - 1]
        room = max_drafts  # the most drafts each row may verify: its token budget (and window)
        if self.planner is not None:
            max_drafts = self.planner.plan(rows.tolist(), max_drafts)  # within each row's budget
        if self.planner is not None and not bool(max_drafts.gt(0).any()):
            # a plain step: the drafter does not run, and its context waits for the next draft
            drafts = generator.skip(anchors)
        else:
            if self.planner is not None and generator.draft_head.dtype is None:
                self.planner.untimed()  # the draft head still times its dtypes in this draft
            drafts = generator.draft(
                anchors, self.next_positions, self.sequences, self.lengths[rows], max_drafts, rows
            )
            if self.planner is not None and self.planner.length_head and drafts.length_prediction is not None:
                drafts.num_drafts = self.planner.refine(rows.tolist(), drafts.length_prediction, drafts.num_drafts)
        drafted = self.recorder.clock()

        if self.tree_budget is not None and bool(drafts.num_drafts.gt(0).any()):
            self._verify_tree(rows, anchors, drafts, start, drafted, room)
            return
        width = int(drafts.num_drafts.max()) + 1
        draft_tokens = drafts.tokens[:, : width - 1]
        padded = self._padded_rows()
        if padded is not None:
            draft_tokens = draft_tokens.masked_fill(padded[:, None], self.pad_token_id)
        verify_ids = torch.cat([anchors[:, None], draft_tokens], dim=1)
        offsets = torch.arange(width, device=verify_ids.device)
        fed = offsets <= drafts.num_drafts[:, None]  # [B, width]: padding beyond a row's drafts is masked
        outputs, raw, processed, verified = self._verify(
            rows, verify_ids, self._extended_mask(fed), self.next_positions[:, None] + offsets, draft_tokens
        )
        if generator.do_sample:
            draft_probs = drafts.probs[:, : width - 1] if drafts.probs is not None else processed[:, :0]
            accepted, following = speculative_sampling(
                draft_tokens, draft_probs, torch.softmax(processed, -1), drafts.num_drafts
            )
        else:
            accepted, following = greedy_acceptance(draft_tokens, processed, drafts.num_drafts)
        if padded is not None:  # plain decoding appends padding to stopped rows whatever the target predicts
            accepted = torch.where(padded, drafts.num_drafts, accepted)
            following = following.masked_fill(padded, self.pad_token_id)
        committed = torch.cat([draft_tokens, following[:, None]], dim=1).scatter(
            1, accepted[:, None], following[:, None]
        )
        features = generator.context_features(outputs.hidden_states)
        self._finish_step(
            rows, committed, accepted, drafts.num_drafts, processed, raw, width, features, start, drafted, verified
        )

    def _finish_step(
        self, rows, committed, accepted, offered, processed, raw, width, features, start, drafted, verified, depth=None
    ):
        """Commits a verified step and records it (linear and tree verification alike). offered ``[B]``: drafts
        verified per row; depth ``[B]``: the longest path they allow (``None``: offered, a linear candidate)."""
        row_list, offered, accepted_list = rows.tolist(), offered.tolist(), accepted.tolist()
        emitted = self.commit(committed, accepted + 1, processed, raw, width, features)
        plan = {}
        if self.planner is not None:
            # the planner models acceptance along a path: a tree offers it the depth of its deepest node
            step_s = self.planner.observe(row_list, width, accepted_list, offered if depth is None else depth.tolist())
            plan = {"step_time_s": step_s, **(self.planner.last_prediction or {})}
        self.recorder.add(
            rows=row_list,
            candidate_lengths=[n + 1 for n in offered],
            accepted=accepted_list,
            emitted=emitted.tolist(),
            verify_width=width,
            draft_time_s=drafted - start,
            target_time_s=verified - drafted,
            **plan,
        )

    def _verify(self, rows, verify_ids, attention_mask, position_ids, tokens):
        """One target forward over ``verify_ids [B, W]`` against the cache; returns ``(outputs, raw, processed,
        clock)``: the float32 logits as they are and as the processors leave them (position ``i`` seeing ``tokens[:,
        :i]``), and the recorder's clock after the forward."""
        with self.verify_layout.forward(verify_ids.numel()) as trial:
            outputs = self.target(
                input_ids=verify_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=self.cache,
                use_cache=True,
                output_hidden_states=self.hidden_layers,
            )
        if trial and self.planner is not None:
            self.planner.untimed()  # this forward timed a GEMM layout (`verify_layout.py`), possibly the slow one
        verified = self.recorder.clock()
        raw = outputs.logits.float()
        processed, _ = process_positions(
            self.processors, self.sequences, self.lengths[rows], raw.clone(), tokens=tokens, rows=rows
        )
        return outputs, raw, processed, verified

    def _verify_tree(self, rows, anchors, drafts, start, drafted, room):
        """Tree verification (`tree.py`): one target forward over each row's draft tree, then the accepted path's
        columns (cache, features, logits) are moved to the front of the step's columns, so that committing them is
        exactly the linear case.

        The length policy's drafts cap each tree's depth and `adaflash_tree_budget` its tokens. With the planner, its
        width (the tokens it found worth verifying, anchor included) is the budget instead, within
        `adaflash_tree_budget`, and a tree may reach as deep as the row's `room` ``[B]`` allows (its token budget, the
        drafted positions): the planner decides how many tokens a step verifies, the tree which ones, and a tree of
        ``w`` tokens commits at least what the linear ``w`` would in expectation (it holds the likeliest paths)."""
        depth, budget = drafts.num_drafts, self.tree_budget
        if self.planner is not None:
            budget = min(budget, int(depth.max()) + 1)
            depth = torch.where(depth > 0, room.clamp(max=drafts.logits.shape[1]), 0)
        padded = self._padded_rows()
        if padded is not None:  # plain decoding only pads a stopped row: it gets no tree, its token is padding
            depth = depth.masked_fill(padded, 0)
        tree = build_trees(drafts.logits, depth, budget, self.pad_token_id)
        width, past = tree.width, self.cache.get_seq_length()
        verify_ids = torch.cat([anchors[:, None], tree.tokens], dim=1)
        depths = torch.cat([tree.depths.new_zeros(len(rows), 1), tree.depths], 1)
        # ids-independent processors only (checked up front), so no node needs its path as the processors' ids
        outputs, raw, processed, verified = self._verify(
            rows,
            verify_ids,
            tree_attention_mask(tree, self.cache_mask, past, self.mask_dtype),
            self.next_positions[:, None] + depths,
            tree.tokens,
        )
        choices = self.generator.choose(processed.flatten(0, 1)).view(processed.shape[:2])
        accepted, order, following = walk_trees(tree, choices)
        if padded is not None:
            following = following.masked_fill(padded, self.pad_token_id)

        def by_order(values):  # [B, width, ...] in the walk's order: anchor, accepted path, the rest
            return values.gather(1, order.view(*order.shape, *[1] * (values.dim() - 2)).expand_as(values))

        processed, raw = by_order(processed), by_order(raw)
        features = by_order(self.generator.context_features(outputs.hidden_states))
        for layer in self.cache.layers:
            _gather_columns(layer, order, columns=slice(past, past + width))
        path = by_order(verify_ids)[:, 1:]
        committed = torch.cat([path, following[:, None]], dim=1).scatter(1, accepted[:, None], following[:, None])
        self._finish_step(
            rows,
            committed,
            accepted,
            tree.num_nodes,
            processed,
            raw,
            width,
            features,
            start,
            drafted,
            verified,
            tree.deepest,
        )

    def _limit(self) -> int:
        """New tokens every row runs to: the budget, or, once plain decoding would have stopped every row, the
        length at which the last one stopped."""
        if bool((self.stopped_at >= 0).all()):
            return int(self.stopped_at.max())
        return self.max_new_tokens

    def _padded_rows(self) -> torch.Tensor | None:
        """Active rows that plain decoding has stopped and now pads (``None``: none)."""
        if not self.keep_rows or self.eos is None:
            return None
        padded = self.stopped_at[self.active] >= 0
        return padded if bool(padded.any()) else None

    def _room(self) -> int:
        """Columns the next verification may add while the cache stays shorter than the sliding window (or attention
        chunk): then no layer drops a column, and window and chunk masks, which count columns, holes included, mask
        nothing, as in plain decoding within the window. Compaction frees columns; at least one is always free, since
        `_check_call` keeps max_length within the window."""
        if self.cache.get_seq_length() + self.generator.block_size >= self.window and self.cache_mask is not None:
            self._compact()
        return self.window - 1 - self.cache.get_seq_length()

    # ------------------------------------------------------------------ commit and stop

    def commit(self, tokens, counts, processed, raw, width, features=None) -> torch.LongTensor:
        """Appends ``tokens[b, :counts[b]]`` to each active row, cut where plain decoding would have stopped.

        tokens ``[B, n]``; processed/raw ``[B, n, V]`` target logits behind them; the cache holds `width` new columns
        per row (the verified ids, `features` their drafter context) of which the committed ones stay. Returns the
        counts committed. Rows leave the batch once no output needs them any more.
        """
        rows = self.active
        counts, stops = self._stop_points(tokens, counts)
        offsets = torch.arange(width, device=tokens.device)
        if features is not None:
            kept = offsets < counts[:, None]  # the anchor and the committed tokens but the last (the next anchor)
            self._keep_in_cache(kept, width)
            self.generator.add_context(features, self.next_positions[:, None] + offsets, kept)
            self.next_positions = self.next_positions + counts
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        keep = offsets < counts[:, None]
        columns = (self.lengths[rows, None] + offsets).clamp(max=self.sequences.shape[1] - 1)
        self.sequences[rows[:, None].expand_as(columns)[keep], columns[keep]] = tokens[keep]
        for per_row, values in ((self.scores, processed), (self.raw_logits, raw)):
            for slot, row in enumerate(rows.tolist() if per_row is not None else ()):
                per_row[row].extend(values[slot, : int(counts[slot])])
        if self.streamer is not None:
            self.streamer.put(tokens[0, : int(counts[0])].cpu())
        self.lengths[rows] += counts
        self.stopped_at[rows[stops]] = self.lengths[rows[stops]] - self.prompt_len
        if self.keep_rows:
            leaving = self.lengths[rows] - self.prompt_len >= self._limit()
        else:
            leaving = stops
        if leaving.any():
            self._drop(~leaving)
        return counts

    def _stop_points(self, tokens, counts) -> tuple[torch.LongTensor, torch.Tensor]:
        """Cuts each row's counts where plain decoding stops it; returns (counts, rows that stop here)."""
        rows = self.active
        generated = self.lengths[rows] - self.prompt_len
        counts = torch.minimum(counts, self._limit() - generated)
        running = self.stopped_at[rows] < 0
        stops = running & (generated + counts >= self.max_new_tokens)
        if self.eos is not None:
            is_eos = torch.isin(tokens, self.eos) & (
                torch.arange(tokens.shape[1], device=tokens.device) < counts[:, None]
            )
            hit = is_eos.any(-1) & running
            counts = torch.where(hit, is_eos.int().argmax(-1) + 1, counts)
            stops |= hit
        if len(self.extra_criteria) and bool(running.any()):
            counts, stops = self._criteria_stops(tokens, counts, stops, running)
        return counts, stops

    def _criteria_stops(self, tokens, counts, stops, running):
        """Calls the other stopping criteria (stop strings, max time, custom ones) as plain decoding does: on the
        whole batch, once per sequence length, so criteria that index rows or keep per-row state see each row at its
        own index; the first length at which a running row's criterion fires cuts its counts. `counts` already ends
        at the budget and the first EOS, so the earliest of the three is where each row stops."""
        rows = self.active
        ids = self.sequences.clone()
        new = torch.arange(tokens.shape[1], device=tokens.device)
        writable = new < counts[:, None]
        columns = (self.lengths[rows, None] + new).clamp(max=ids.shape[1] - 1)
        ids[rows[:, None].expand_as(columns)[writable], columns[writable]] = tokens[writable]
        counts, stops = counts.clone(), stops.clone()
        first, last = int(self.lengths[rows].min()) + 1, int((self.lengths[rows] + counts).max())
        for length in range(first, last + 1):
            # every running row, including those the budget or an EOS already stops in this step: a criterion that
            # fires before that point stops the row earlier, as it would have stopped plain decoding
            at = running & (self.lengths[rows] < length) & (length <= self.lengths[rows] + counts)
            if not bool(at.any()):
                continue
            fired = self.extra_criteria(ids[:, :length], None)[rows] & at
            counts = torch.where(fired, length - self.lengths[rows], counts)
            stops |= fired
        return counts, stops

    # ------------------------------------------------------------------ target cache holes

    def _extended_mask(self, fed: torch.Tensor) -> torch.Tensor | None:
        if self.cache_mask is None and bool(fed.all()):
            return None
        past = self.cache_mask
        if past is None:
            past = torch.ones(fed.shape[0], self.cache.get_seq_length(), dtype=torch.bool, device=fed.device)
        return torch.cat([past, fed], dim=1).long()

    def _keep_in_cache(self, kept: torch.Tensor, width: int) -> None:
        """After verification the cache holds `width` new columns per row; `kept` ``[B, width]`` marks the anchor and
        accepted drafts. Trailing columns no row kept are cropped; the others become masked holes."""
        trailing = int((width - kept.sum(-1)).min())
        self.cache.crop(-trailing)
        kept = kept[:, : width - trailing]
        if self.cache_mask is None and bool(kept.all()):
            return
        past = self.cache_mask
        if past is None:
            past = torch.ones(
                kept.shape[0], self.cache.get_seq_length() - kept.shape[1], dtype=torch.bool, device=kept.device
            )
        self.cache_mask = torch.cat([past, kept], dim=1)
        if self.cache_mask.all():
            self.cache_mask = None
        elif (~self.cache_mask).float().mean() > COMPACT_FRACTION:
            self._compact()

    def _compact(self) -> None:
        """Moves each row's valid cache columns to the right end (left padding), dropping shared holes.

        Attention does not depend on where a column sits, only on its mask and its rotary position (baked into the
        cached keys), so the compacted cache gives the same outputs.
        """
        mask = self.cache_mask
        keep = int(mask.sum(-1).max())
        # stable order: holes first, then valid columns in their original order
        order = torch.sort(mask.int(), dim=1, stable=True).indices[:, -keep:]
        for layer in self.cache.layers:
            _gather_columns(layer, order)
        self.cache_mask = mask.gather(1, order)
        if self.cache_mask.all():
            self.cache_mask = None

    def _drop(self, keep: torch.Tensor) -> None:
        index = keep.nonzero().squeeze(-1)
        if self.keep_rows and self.returns_cache:
            for slot in (~keep).nonzero().flatten().tolist():
                self._park(slot)
        self.active = self.active[index]
        self.next_positions = self.next_positions[index]
        if not self.active.numel():
            return
        self.cache.batch_select_indices(index)
        self.generator.select_rows(index)
        if self.cache_mask is not None:
            self.cache_mask = self.cache_mask[index]
            if self.cache_mask.all():
                self.cache_mask = None

    def _park(self, slot: int) -> None:
        """Keeps a leaving row's cache columns (every per-position tensor of every layer, its batch dim kept with one
        entry), for the cache returned at the end."""
        layers = [
            {
                name: (tensor.narrow(batch_dim, slot, 1), batch_dim, position_dim)
                for name, (tensor, batch_dim, position_dim) in _position_tensors(layer).items()
            }
            for layer in self.cache.layers
        ]
        mask = None if self.cache_mask is None else self.cache_mask[slot]
        self.parked[int(self.active[slot])] = (layers, mask)

    # ------------------------------------------------------------------ output

    def output(self):
        generated = int(self.stopped_at.max())
        sequences = self.sequences[:, : self.prompt_len + generated]
        if self.keep_rows and self.returns_cache:
            self._rebuild_cache(generated)
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=self._per_token(self.scores, generated),
            logits=self._per_token(self.raw_logits, generated),
            cache=self.cache,
        )

    def _rebuild_cache(self, generated: int) -> None:
        """Leaves in the cache what plain decoding leaves: every row, ``prompt + generated - 1`` columns, each row's
        tokens right-aligned under its left padding. Columns under the padding hold zeros (plain decoding holds the
        padding's keys there; an attention mask hides both)."""
        width = self.prompt_len + generated - 1
        real = (
            torch.full_like(self.lengths, self.prompt_len)
            if self.attention_mask is None
            else self.attention_mask.sum(-1).long()
        )
        indices, valids = [], []
        for row in range(len(self.lengths)):
            layers, mask = self.parked[row]
            keys, _, position_dim = next(layer["keys"] for layer in layers if "keys" in layer)
            columns = keys.shape[position_dim]
            valid_columns = torch.arange(columns, device=real.device) if mask is None else mask.nonzero().flatten()
            need = int(real[row]) + generated - 1
            indices.append(torch.cat([valid_columns.new_zeros(width - need), valid_columns[:need]]))
            valids.append(torch.arange(width, device=real.device) >= width - need)
        index, valid = torch.stack(indices), torch.stack(valids)
        for i, layer in enumerate(self.cache.layers):
            parts = [self.parked[row][0][i] for row in range(len(self.lengths))]
            for name, (_, batch_dim, position_dim) in parts[0].items():
                tensors = [part[name][0] for part in parts]
                longest = max(t.shape[position_dim] for t in tensors)
                # rows parked at different steps hold different numbers of columns: pad them to a common width
                padded = [
                    torch.cat(
                        [
                            t,
                            t.new_zeros(
                                t.shape[:position_dim]
                                + (longest - t.shape[position_dim],)
                                + t.shape[position_dim + 1 :]
                            ),
                        ],
                        position_dim,
                    )
                    for t in tensors
                ]
                setattr(layer, name, torch.cat(padded, batch_dim))
            _gather_columns(layer, index, valid)

    @staticmethod
    def _per_token(per_row, generated):
        """Per-row lists of ``[V]`` tensors -> tuple over generated positions of ``[B, V]``."""
        if per_row is None:
            return None
        return tuple(torch.stack([row[i] for row in per_row]) for i in range(generated))


def adaflash_decoding(
    target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, **model_kwargs
):
    """Runs speculative decoding; arguments as transformers passes them to a decoding method."""
    return SpeculativeDecoding(
        target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
    ).run()
