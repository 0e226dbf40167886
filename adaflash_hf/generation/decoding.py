"""The speculative decoding loop behind ``target.generate(..., assistant_model=drafter)``, for any batch size.

Per step and per active row (docs/algorithm.md §3): the step's plan (`length_policy.StepPlan`: a length policy or the
planner) bounds the drafts, the drafter drafts one block after the anchor (`AdaFlashCandidateGenerator`), the plan
picks how many drafts to verify, a verifier (`verifiers.LinearVerifier`, or `tree.TreeVerifier` with
``adaflash_tree_budget``) runs the target once over them and applies the acceptance rule, and the loop commits the
accepted drafts plus one target token, which becomes the next anchor. With ``adaflash_ngram`` the step first looks up
the continuations each row's committed context offers (`ngram.py`, an index the commits extend), the plan also
decides how many of their tokens join the tree (and whether the drafter runs at all), and the tree verifies both.

A call of one row takes the steps its plan leaves without drafts in `SpeculativeDecoding._plain_step`: one forward
over the anchor, the token, and the commit with Python integers, so that a plain step costs what plain decoding's
does.

Batch > 1 (ragged acceptance): rows verify different numbers of tokens, padded to the longest; the target's cache
(`cache.TargetCache`) keeps every row's rejected drafts and padding as masked holes, while each row carries explicit
position ids, so every row computes exactly what it would compute alone. Rows that finish leave the batch and stop
costing compute.

The prompt is read in one forward over the padded batch, as plain decoding reads it, or, on a CPU where the prompts'
lengths differ enough, in groups of rows of similar length laid out as that forward would have (`prefill.py`,
``adaflash_prefill``). After it, the loop's forwards of several tokens read the shared key/value heads of
grouped-query attention in place instead of copying them per query head (`attention.py`).

Stopping is exact: a step's committed tokens are cut at EOS, at the token budget and at the first token where any
other stopping criterion (stop strings, max time, custom criteria) fires, as plain decoding would have stopped there.
Criteria and ids-dependent logits processors are called with the whole batch, as plain decoding calls them.

What plain decoding does with a stopped row while the batch runs on is reproduced whenever the output shows it: the
row then stays in the batch (padded with an EOS criterion, still generating without one) for its scores, its tokens
and its cache columns, and the returned cache is rebuilt to plain decoding's layout (`TargetCache.rebuild`). A cache
the caller prefilled with the start of the prompt is continued, not re-run. Whatever the loop cannot reproduce is
refused by `checks.check_call` before anything runs.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .attention import grouped_query_attention
from .cache import TargetCache, reserve
from .candidate_generator import AdaFlashCandidateGenerator, PathProposer
from .checks import check_call
from .options import AdaFlashGenerationOptions
from .planner import step_plan
from .prefill import groups, ragged_applies, ragged_prefill
from .processing import process_positions
from .profile import profile_for
from .stats import CallRecorder
from .stopping import StopRule
from .tree import TreeVerifier
from .verifiers import History, LinearVerifier, TargetForward
from .verify_layout import VerifyLayout


def _prefill_positions(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.LongTensor:
    """Position ids as transformers' generate() builds them: count only unmasked tokens (left padding)."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, -1)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


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
        drafter_config = None if drafter is None else drafter.config  # None: n-gram paths only (`PathProposer`)
        options = AdaFlashGenerationOptions.from_generation_config(generation_config, drafter_config)
        check_call(target, input_ids, generation_config, logits_processor, streamer, model_kwargs, options)
        profile = profile_for(target, drafter)
        self.target, self.config, self.processors = target, generation_config, logits_processor
        self.streamer = streamer
        if drafter is None:
            self.generator = PathProposer(generation_config, options)
        else:
            self.generator = AdaFlashCandidateGenerator(target, drafter, generation_config, logits_processor, options)
        self.hidden_layers = self.generator.model_kwargs_overrides["output_hidden_states"]
        self.cache = TargetCache(model_kwargs["cache"])
        self.attention_mask = model_kwargs.get("attention_mask")
        self.prefill_mode = options.prefill
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
        self.limit = self.max_new_tokens  # new tokens every row runs to
        eos = generation_config._eos_token_tensor
        self.eos = None if eos is None else eos.to(input_ids.device).flatten()
        self.eos_ids = set() if self.eos is None else set(self.eos.tolist())
        self.single = batch == 1  # a call of one row steps plainly with Python integers (`_plain_step`)
        self.stop_rule = StopRule(self.eos, stopping_criteria, self.max_new_tokens)
        keep = generation_config.return_dict_in_generate
        self.scores = [[] for _ in range(batch)] if keep and generation_config.output_scores else None
        self.raw_logits = [[] for _ in range(batch)] if keep and generation_config.output_logits else None
        # The cache outlives generate() when it is returned or was passed in (as in transformers' _sample).
        cache = self.cache.cache
        self.returns_cache = keep or getattr(cache, "_is_user_defined", False) or cache.get_seq_length() > 0
        # Plain decoding runs every row until the whole batch stops: a stopped row then gets padding (with an EOS
        # criterion) or keeps generating (without one), and its scores and cache columns are computed all the same.
        # Rows stay in the batch as *trailing* rows whenever any of that is visible in the output.
        self.keep_rows = batch > 1 and (self.returns_cache or self.eos is None)
        if not self.returns_cache:  # room for the whole call: no step copies the cache (`cache.ReservedLayer`)
            widest = max(self.generator.block_size, options.tree_budget or 0) + 1
            reserve(cache, generation_config.max_length + widest)
        self.recorder = CallRecorder(batch, input_ids.device)
        self.recorder.uses(profile)
        self.profile = profile

        dtype = next(target.parameters()).dtype
        self.plan = step_plan(options.length_policy, profile, drafter_config, batch, input_ids.device, dtype)
        layout = VerifyLayout(target, options.verify_layout, profile)
        features = self.generator.context_features
        forward = TargetForward(
            target, self.cache, layout, logits_processor, self.hidden_layers, features, self.recorder.clock
        )
        self.linear = LinearVerifier(forward, self.generator.do_sample, self.pad_token_id)
        self.generator.start_ngram(input_ids, self.attention_mask)
        self.tree = None
        if options.tree_budget is not None:
            self.tree = TreeVerifier(forward, self.generator.choose, options.tree_budget, self.pad_token_id, dtype)

    # ------------------------------------------------------------------ loop

    @torch.no_grad()
    def run(self):
        self.prefill()
        with grouped_query_attention():  # the forwards of a few tokens after the prompt (`attention.py`)
            while self.active.numel():
                self.step()
        if self.streamer is not None:
            self.streamer.end()
        self.profile.save()
        return self.output()

    def prefill(self):
        batch, length, cache = self.sequences.shape[0], self.prompt_len, self.cache.cache
        cached = cache.get_seq_length()  # a prefix cache the caller filled (multi-turn, prompt caching)
        positions = self.position_ids
        if positions is None:
            positions = _prefill_positions(self.attention_mask, batch, length, self.sequences.device)
        positions = positions[:, cached:]
        start = self.recorder.clock()
        features = self.generator.context_features
        spans = [range(batch)]  # one forward over the padded batch, as plain decoding reads it
        if ragged_applies(self.prefill_mode, cache, self.attention_mask, self.returns_cache, self.sequences.device):
            spans = groups(self.attention_mask.sum(-1).tolist())
        if len(spans) > 1:
            logits, context = ragged_prefill(
                self.target,
                self.sequences[:, :length],
                self.attention_mask,
                positions,
                cache,
                self.hidden_layers,
                features,
                spans,
            )
        else:
            outputs = self.target(
                input_ids=self.sequences[:, cached:length],
                attention_mask=self.attention_mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                output_hidden_states=self.hidden_layers,
                logits_to_keep=1,
            )
            logits, context = outputs.logits, features(outputs.hidden_states)
        self.recorder.prefilled(len(spans), self.recorder.clock() - start)
        if cache.get_seq_length() != length:
            # Older modeling code (openai-gpt, ...) accepts a cache and ignores it, so plain decoding re-reads the
            # whole sequence each step while verification would see the drafts without their context; others add
            # columns of their own, which the per-token holes and positions of the loop do not account for.
            raise ValueError(
                f"{type(self.target).__name__} keeps {cache.get_seq_length()} KV-cache columns for {length} "
                "prompt tokens (its modeling code ignores the cache it is given, or adds columns of its own), and "
                "AdaFlash decoding verifies drafts against a cache of one column per token. Generate without "
                "assistant_model."
            )
        raw = logits[:, -1:].float()
        processed, first = process_positions(
            self.processors, self.sequences, self.lengths, raw.clone(), choose=self.generator.choose
        )
        self.cache.start(self.attention_mask)
        # The drafter reads the target features of the new prompt tokens only; a cached prefix has none. Drafts may
        # be worse for it; the output is not, since the target verifies every token.
        valid = None if self.attention_mask is None else self.attention_mask[:, cached:].bool()
        self.generator.add_context(context, positions, valid)
        self.next_positions = positions[:, -1] + 1
        self.commit(first, torch.ones(batch, dtype=torch.long, device=first.device), processed, raw, width=1)

    def step(self):
        rows, generator, plan = self.active, self.generator, self.plan
        row_list, lengths = rows.tolist(), self.lengths[rows]
        room = self.limit - (lengths - self.prompt_len) - 1  # drafts each row's budget leaves
        if self.cache.window is not None:
            room = torch.clamp(room, max=self.cache.room(generator.block_size) - 1)
        padded = self._padded_rows()  # stopped rows plain decoding pads propose nothing
        paths = generator.ngram_paths(room if padded is None else room.masked_fill(padded, 0), self.eos)
        max_drafts = plan.before_draft(row_list, room, None if paths is None else [p[0] if p else [] for p in paths])
        path_nodes = 0 if paths is None else plan.path_nodes(generator.options.ngram_nodes)

        def projected(length_prediction):
            verified = plan.projected(row_list, length_prediction, max_drafts)
            if self.tree is not None and path_nodes:  # a tree's budget also counts the merged paths' tokens
                verified = torch.minimum(verified + path_nodes, max_drafts)  # (`tree_shape`), the drafter's may use
            return verified

        start = self.recorder.clock()
        drafter_ran = bool(max_drafts.gt(0).any())
        if not drafter_ran and self.single and not (self.tree is not None and path_nodes and any(paths)):
            return self._plain_step(int(lengths[0]), start)
        anchors = self.sequences[rows, lengths - 1]
        if not drafter_ran:
            drafts = generator.skip(anchors)  # a plain step: the drafter's context waits for the next draft
        else:
            if plan.probing():  # a probe's drafts are scored, not verified: only the rows the plan asked draft
                drafts = generator.probe(anchors, self.next_positions, self.sequences, lengths, max_drafts, rows)
            else:
                if generator.reads_prompts:
                    plan.read_prompts()
                drafts = generator.draft(
                    anchors, self.next_positions, self.sequences, lengths, max_drafts, rows, projected
                )
            if generator.draft_head.timed_dtype:
                plan.untimed()  # the draft head timed its dtypes in this draft, maybe a slow one (`draft_head.py`)
            elif generator.draft_head.timed_kernel:
                plan.trial()  # the draft head's product timed a kernel (`draft_head.py`), possibly the slow one
            drafts.num_drafts = plan.after_draft(row_list, drafts)
        drafted = self.recorder.clock()

        history = History(self.sequences, lengths, rows)
        if self.tree is not None and (bool(drafts.num_drafts.gt(0).any()) or path_nodes and any(paths)):
            positions = 0 if drafts.logits is None else drafts.logits.shape[1]  # the drafter's, if it ran
            depth, budget = plan.tree_shape(drafts.num_drafts, room, positions, self.tree.budget)
            verified = self.tree.verify(
                anchors, drafts, self.next_positions, history, padded, depth, budget, paths, path_nodes
            )
        else:
            verified = self.linear.verify(anchors, drafts, self.next_positions, history, padded)
        if verified.trial:
            plan.trial()  # this forward timed a candidate kernel (`verify_layout.py`), possibly the slow one
        v = verified
        emitted = self.commit(v.committed, v.accepted + 1, v.processed, v.raw, v.width, v.features)
        accepted = v.accepted.tolist()
        predicted = plan.after_verify(row_list, v, emitted)
        self.recorder.add(
            rows=row_list,
            candidate_lengths=[n + 1 for n in v.offered.tolist()],
            accepted=accepted,
            emitted=emitted.tolist(),
            verify_width=v.width,
            draft_time_s=drafted - start,
            target_time_s=v.verified_at - drafted,
            drafter_ran=drafter_ran,
            **predicted,
            **{
                f"{name}_{kind}": values.tolist()
                for name, pair in (v.by_source or {}).items()
                for kind, values in zip(("accepted", "offered"), pair)
            },
        )

    def _plain_step(self, length: int, start: float) -> None:
        """A step without drafts in a call of one row: one forward over the anchor, its token, one write.

        What `step` and `commit` do for a batch, with Python integers for the row's length and its stop: between two
        forwards of a small target, each tensor operation of the loop costs a share of a percent of a step (the first
        ones after a forward, tens of microseconds), and plain decoding does a few dozen. The commit falls back to
        `commit` where a stopping criterion beyond EOS and the budget, or a cache with holes or a sliding window,
        needs its tensors."""
        ids = self.sequences[:, length - 1 : length]  # the anchor, [1, 1]
        positions = self.next_positions[:, None]
        history = History(self.sequences, self.lengths, self.active)
        mask = None if self.cache.mask is None else self.cache.extended_mask(torch.ones_like(ids, dtype=torch.bool))
        drafted = self.recorder.clock()
        raw, processed, features, trial, verified_at = self.linear.forward(ids, mask, positions, ids[:, :0], history)
        if trial:
            self.plan.trial()
        chosen = self.generator.choose(processed[:, 0])  # [1]: the argmax, or one sample, as plain decoding's
        token = int(chosen)
        generated = length + 1 - self.prompt_len
        cache = self.cache
        if len(self.stop_rule.criteria) or cache.mask is not None or cache.window is not None:
            ones = torch.ones(1, dtype=torch.long, device=chosen.device)
            emitted = int(self.commit(chosen[:, None], ones, processed, raw, 1, features)[0])
        else:
            emitted = 1
            self.generator.add_context(features, positions)
            self.next_positions = self.next_positions + 1
            self.sequences[0, length] = token
            self.lengths[0] = length + 1
            self.generator.committed(chosen[:, None], torch.ones_like(chosen))
            for per_row, values in ((self.scores, processed), (self.raw_logits, raw)):
                if per_row is not None:
                    per_row[0].append(values[0, 0])
            if self.streamer is not None:
                self.streamer.put(chosen.cpu())
            if generated >= self.max_new_tokens or token in self.eos_ids:
                self.stopped_at[0] = self.limit = generated
                self.active = self.active[:0]
        predicted = self.plan.after_plain([0], [[token][:emitted]])
        self.recorder.add(
            rows=[0],
            candidate_lengths=[1],
            accepted=[0],
            emitted=[emitted],
            verify_width=1,
            draft_time_s=drafted - start,
            target_time_s=verified_at - drafted,
            drafter_ran=False,
            **predicted,
        )

    def _padded_rows(self) -> torch.Tensor | None:
        """Active rows that plain decoding has stopped and now pads (``None``: none)."""
        if not self.keep_rows or self.eos is None:
            return None
        padded = self.stopped_at[self.active] >= 0
        return padded if bool(padded.any()) else None

    # ------------------------------------------------------------------ commit and stop

    def commit(self, tokens, counts, processed, raw, width, features=None) -> torch.LongTensor:
        """Appends ``tokens[b, :counts[b]]`` to each active row, cut where plain decoding would have stopped.

        tokens ``[B, n]``; processed/raw ``[B, n, V]`` target logits behind them; the cache holds `width` new columns
        per row (the verified ids, `features` their drafter context) of which the committed ones stay. Returns the
        counts committed. Rows leave the batch once no output needs them any more.
        """
        rows, lengths = self.active, self.lengths[self.active]
        generated = lengths - self.prompt_len
        running = self.stopped_at[rows] < 0
        cut = self.stop_rule.cut
        counts, stops = cut(self.sequences, lengths, generated, rows, tokens, counts, running, self.limit)
        offsets = torch.arange(width, device=tokens.device)
        if features is not None:
            kept = offsets < counts[:, None]  # the anchor and the committed tokens but the last (the next anchor)
            self.cache.keep(kept, width)
            self.generator.add_context(features, self.next_positions[:, None] + offsets, kept)
            self.next_positions = self.next_positions + counts
        if tokens.shape[1] == 1 and bool(counts.eq(1).all()):  # a plain step: one token per row
            self.sequences[rows, lengths] = tokens[:, 0]
        else:
            offsets = torch.arange(tokens.shape[1], device=tokens.device)
            keep = offsets < counts[:, None]
            columns = (lengths[:, None] + offsets).clamp(max=self.sequences.shape[1] - 1)
            self.sequences[rows[:, None].expand_as(columns)[keep], columns[keep]] = tokens[keep]
        self.generator.committed(tokens, counts)
        for per_row, values in ((self.scores, processed), (self.raw_logits, raw)):
            for slot, row in enumerate(rows.tolist() if per_row is not None else ()):
                per_row[row].extend(values[slot, : int(counts[slot])])
        if self.streamer is not None:
            self.streamer.put(tokens[0, : int(counts[0])].cpu())
        lengths = lengths + counts
        self.lengths[rows] = lengths
        if bool(stops.any()):
            self.stopped_at[rows[stops]] = lengths[stops] - self.prompt_len
            if bool((self.stopped_at >= 0).all()):  # plain decoding would have stopped every row: none runs longer
                self.limit = int(self.stopped_at.max())
        if self.keep_rows:
            leaving = lengths - self.prompt_len >= self.limit
        else:
            leaving = stops
        if leaving.any():
            self._drop(~leaving)
        return counts

    def _drop(self, keep: torch.Tensor) -> None:
        index = keep.nonzero().squeeze(-1)
        if self.keep_rows and self.returns_cache:
            for slot in (~keep).nonzero().flatten().tolist():
                self.cache.park(slot, int(self.active[slot]))
        self.active = self.active[index]
        self.next_positions = self.next_positions[index]
        if self.active.numel():
            self.cache.select_rows(index)
            self.generator.select_rows(index)

    # ------------------------------------------------------------------ output

    def output(self):
        generated = int(self.stopped_at.max())
        sequences = self.sequences[:, : self.prompt_len + generated]
        if self.keep_rows and self.returns_cache:
            real = self.lengths.new_full(self.lengths.shape, self.prompt_len)
            if self.attention_mask is not None:
                real = self.attention_mask.sum(-1).long()
            self.cache.rebuild(self.prompt_len, real, generated)
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=self._per_token(self.scores, generated),
            logits=self._per_token(self.raw_logits, generated),
            cache=self.cache.cache,
        )

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
