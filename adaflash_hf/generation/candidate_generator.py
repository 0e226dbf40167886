"""`AdaFlashCandidateGenerator`: drafts one DFlash block per step and decides how much of it to offer the target.

State, per batch row, kept exact across steps (docs/algorithm.md §3.3, §8.2):

* the drafter's `DFlashCache` holds context K/V for exactly the committed positions whose target features have been
  fed, i.e. ``[0, anchor)``; every step feeds the *new* features (prompt at first, then the anchor and accepted
  drafts of the previous step), appends one block, and crops the block rows again;
* rows of a batch feed different numbers of new positions; the shorter ones are padded and their padding is masked
  out for the rest of the generation by a 2D mask over the cache rows (``cache_mask``, ``None`` while nothing is
  masked, which keeps batch 1 on the mask-free fast path).

The drafter always drafts the whole block, because its cache must stay consistent; the length policy then decides how
many drafts the target verifies.

A DFlash 2 drafter (``drafter_type="dflash2"``, `adaflash_hf/dflash2.py`) drafts with the same one forward; its
candidate selector then walks the block slot by slot (`walk_selector`): slot ``i``'s ``K`` candidates are the top
``K`` of its processed unary logits, scored ``unary + transition(token chosen at slot i - 1, candidate) / T``. The
walk is the linear draft, and `Drafts.logits` holds those scores (``-inf`` outside the candidates), so a draft tree
branches over each slot's ``K`` candidates, ranked after the linear path's token at the slot before. Under sampling
the proposal distribution of slot ``i`` is ``q_i = softmax(scores_i)`` over its candidates, given the drafted tokens
before it, and the walk's token is a sample from it; speculative sampling only compares a draft with the target
while every draft before it was accepted, i.e. with exactly the prefix ``q_i`` was conditioned on, so the
acceptance rule stays lossless with this ``q``. `draft()` is the batched core used by `adaflash_hf`'s decoding loop;
`get_candidates()` is the transformers `CandidateGenerator` contract (batch 1) built on it, so transformers' own
assisted-decoding loop can drive the same drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DFlashCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList

from ..dflash2 import walk_selector
from ..modeling import AdaFlashDrafterOutput
from .acceptance import leading_true
from .draft_head import DraftHead
from .ngram import NgramIndex
from .options import AdaFlashGenerationOptions
from .prefill import context_groups, lay_out
from .processing import ids_independent, process_positions, token_chooser
from .profile import profile_for


@dataclass
class Drafts:
    """One drafted block per row.

    tokens ``[B, D]``: drafts (samples from `probs` when sampling, else argmax), ``D <= block_size - 1``: the
    positions some row may verify (all of them for the `confidence` policy).
    logits ``[B, D, V]``: processed drafter logits (float32); for a DFlash 2 drafter, the selector's scores of each
    slot's candidates after the drafted token before it (``-inf`` elsewhere).
    probs ``[B, D, V]``: softmax of `logits` when sampling, else ``None``.
    num_drafts ``[B]``: drafts to verify (candidate length - 1, capped by the token budget), at most ``D``.
    length_prediction ``[B]``: the length head's prediction for the block (``(accepted + 1) / block_size``), when the
    drafter has a head.
    """

    tokens: torch.LongTensor
    logits: torch.Tensor
    probs: torch.Tensor | None
    num_drafts: torch.LongTensor
    length_prediction: torch.Tensor | None = None

    @classmethod
    def none(cls, anchors: torch.LongTensor) -> Drafts:
        """No drafts for any row (a step the drafter does not run)."""
        batch = anchors.shape[0]
        return cls(tokens=anchors.new_zeros((batch, 0)), logits=None, probs=None, num_drafts=anchors.new_zeros(batch))


def _all_true(mask: torch.Tensor | None) -> bool:
    return mask is None or bool(mask.all())


def adapter_names_for(drafter, names: list[str] | None) -> list[str] | None:
    """The per-row PEFT adapter names of ``GenerationConfig(adaflash_adapter_names=[...])``, checked against the
    adapters the (PEFT-wrapped) drafter holds; ``"__base__"`` drafts a row with the bare drafter."""
    if names is None:
        return None
    loaded = set(getattr(drafter, "peft_config", None) or {})
    if not loaded:
        raise ValueError(
            "adaflash_adapter_names needs a PEFT-wrapped drafter (peft.PeftModel with LoRA adapters); this drafter "
            "has none. Wrap it with peft.get_peft_model or PeftModel.from_pretrained, or drop adaflash_adapter_names."
        )
    unknown = sorted(set(names) - loaded - {"__base__"})
    if unknown:
        raise ValueError(
            f"adaflash_adapter_names names adapters {unknown} the drafter does not hold; it holds {sorted(loaded)} "
            "(or use '__base__' for the bare drafter)."
        )
    return list(names)


class ContextPaths:
    """The loop's n-gram side (``adaflash_ngram``, `ngram.py`): each active row's index, started from its prompt and
    extended by its commits, and the continuations it offers each step. Needs ``self.options``; rows follow the batch
    through ``self.ngram.select_rows`` in the owner's `select_rows`."""

    options: AdaFlashGenerationOptions
    ngram: NgramIndex | None = None

    def start_ngram(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> None:
        """With ``adaflash_ngram``: indexes each row's prompt (its unmasked tokens) for n-gram continuations."""
        if not self.options.ngram:
            return
        rows = input_ids.tolist()
        if attention_mask is not None:
            rows = [[t for t, m in zip(row, mask) if m] for row, mask in zip(rows, attention_mask.tolist())]
        self.ngram = NgramIndex(rows, self.options.ngram_max_match, self.options.ngram_min_match)

    def committed(self, tokens: torch.LongTensor, counts: torch.LongTensor) -> None:
        """Each active row committed ``tokens[b, :counts[b]]``: the n-gram index takes them (rejected drafts never
        enter it)."""
        if self.ngram is not None:
            self.ngram.extend([row[:n] for row, n in zip(tokens.tolist(), counts.tolist())])

    def ngram_paths(self, room: torch.LongTensor, stop: torch.Tensor | None) -> list[list[list[int]]] | None:
        """Each active row's n-gram continuations for this step (``None`` without ``adaflash_ngram``), at most
        ``room [B]`` tokens each, ending at their first `stop` token."""
        if self.ngram is None:
            return None
        options = self.options
        stop_ids = () if stop is None else stop.tolist()
        return self.ngram.paths(
            room.clamp(min=0).tolist(), options.ngram_tokens, options.ngram_continuations, stop_ids
        )


class AdaFlashCandidateGenerator(ContextPaths, CandidateGenerator):
    """Drafts with an AdaFlash / DFlash drafter from the target's hidden states.

    Args:
        target: the target `PreTrainedModel`; its input embeddings embed the block, its output embeddings give logits.
        drafter: an `AdaFlashDrafter` (or a PEFT model wrapping one).
        generation_config: the call's `GenerationConfig` (`do_sample`, `temperature`, `max_length`).
        logits_processor: the processors the target's logits get; the drafter's logits get the same.
        options (`AdaFlashGenerationOptions`, *optional*): the call's ``adaflash_*`` settings (read from
            ``generation_config`` when not given): the length policy, the draft head's dtype and
            ``adapter_names``, one PEFT adapter name per batch row, for per-request domain adapters.
    """

    requires_model_outputs = True

    def __init__(
        self,
        target,
        drafter,
        generation_config,
        logits_processor: LogitsProcessorList | None = None,
        options: AdaFlashGenerationOptions | None = None,
    ):
        drafter.check_compatible(target)
        config = drafter.config
        if options is None:
            options = AdaFlashGenerationOptions.from_generation_config(generation_config, config)
        self.drafter = drafter
        self.device = drafter.device
        self.input_embeddings = target.get_input_embeddings()
        self.draft_head = DraftHead(
            target.get_output_embeddings(),
            options.draft_head_dtype,
            vocab=config.draft_vocab,
            profile=profile_for(target, drafter),
            layout=options.verify_layout,
        )
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.target_layer_ids = list(config.target_layer_ids)
        # Only the layers the drafter reads are materialised by the target (None elsewhere).
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in self.target_layer_ids]}
        self.policy = options.length_policy
        self.do_sample = bool(generation_config.do_sample)
        self.choose = token_chooser(self.do_sample)
        self.choose_draft = token_chooser(self.do_sample, drafts=True)
        self.selector = getattr(drafter, "candidate_selector", None)  # DFlash 2's (PEFT forwards the attribute)
        self.temperature = float(generation_config.temperature or 1.0) if self.do_sample else None
        self.logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.max_length = generation_config.max_length
        self.adapter_names = adapter_names_for(drafter, options.adapter_names)
        self.cache = DFlashCache(config=config)
        self.cache_mask: torch.Tensor | None = None
        self.options = options  # `ContextPaths` reads the n-gram settings
        self._pending: list[tuple[torch.Tensor, torch.LongTensor, torch.Tensor | None]] = []

    # ------------------------------------------------------------------ batched core

    def context_features(self, hidden_states: tuple) -> torch.Tensor:
        """``[B, T, K * H]`` drafter context from the target's `hidden_states` tuple (``hidden_states[i + 1]``)."""
        layers = [hidden_states[i + 1] for i in self.target_layer_ids]
        if layers[0].dim() != 3:
            # e.g. hyper-connection targets (hy_v4) keep several residual streams per token
            raise ValueError(
                f"The target's hidden states have shape {tuple(layers[0].shape)}, not [batch, tokens, hidden]: a "
                "DFlash drafter reads one hidden vector per token and layer, so it cannot draft for this target."
            )
        return torch.cat(layers, dim=-1)

    def add_context(self, features: torch.Tensor, positions: torch.LongTensor, valid: torch.Tensor | None = None):
        """Queues the target features of newly committed positions for the next `draft()`.

        features ``[B, n, K * H]``, positions ``[B, n]``, valid ``[B, n]`` bool (``None``: all rows fed ``n``).
        """
        valid = None if valid is None else valid.to(self.device)
        # Steps without drafts (the planner's plain steps) queue their context until a draft() feeds it: kept as a
        # list and joined once there, since joining every step would copy the whole queue each step (at batch 32
        # and a 300-token prompt, 90 MB a step).
        self._pending.append((features.to(self.device), positions.to(self.device), valid))

    def _take_pending(self) -> tuple[torch.Tensor, torch.LongTensor, torch.Tensor | None]:
        """The queued context as one ``(features, positions, valid)``, emptying the queue."""
        pending, self._pending = self._pending, []
        return self._joined(pending)

    def _joined(self, pending: list) -> tuple[torch.Tensor, torch.LongTensor, torch.Tensor | None]:
        if len(pending) == 1:
            features, positions, valid = pending[0]
        else:
            features = torch.cat([f for f, _, _ in pending], dim=1)
            positions = torch.cat([p for _, p, _ in pending], dim=1)
            valid = None
            if any(v is not None for _, _, v in pending):
                valid = torch.cat(
                    [
                        torch.ones(p.shape, dtype=torch.bool, device=self.device) if v is None else v
                        for _, p, v in pending
                    ],
                    dim=1,
                )
        return features, positions, None if _all_true(valid) else valid

    @property
    def reads_prompts(self) -> bool:
        """Whether the next `draft` reads every row's prompt: this call's drafter has read no context yet."""
        return self.cache.get_seq_length() == 0

    def skip(self, anchors: torch.LongTensor) -> Drafts:
        """A step without drafts (the step's plan chose a plain step): the drafter does not run, and the context
        queued for it waits, with the context of this step, for the next `draft()`."""
        return Drafts.none(anchors)

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keeps only the batch rows in `index` (finished rows stop costing drafter compute).

        A drafter that keeps per-row state of its own defines ``on_select_rows(index, cache)``; it is called here
        with the same ``index`` and this call's drafter cache, so its rows follow the batch (the oracle drafters
        of the test suite use it).
        """
        self.cache.batch_select_indices(index.to(self.device))
        hook = getattr(self.drafter, "on_select_rows", None)
        if hook is not None:
            hook(index, self.cache)
        if self.adapter_names is not None:
            self.adapter_names = [self.adapter_names[i] for i in index.tolist()]
        if self.ngram is not None:
            self.ngram.select_rows(index.tolist())
        if self.cache_mask is not None:
            self.cache_mask = self.cache_mask[index]
        self._pending = [
            (features[index], positions[index], None if valid is None else valid[index])
            for features, positions, valid in self._pending
        ]

    @torch.no_grad()
    def draft(
        self,
        anchors: torch.LongTensor,
        anchor_positions: torch.LongTensor,
        sequences: torch.LongTensor,
        lengths: torch.LongTensor,
        max_drafts: torch.LongTensor,
        rows: torch.LongTensor | None = None,
        projected=None,
    ) -> Drafts:
        """Drafts one block per row after the queued context.

        anchors ``[B]``: last committed token per row (not yet seen by the target); anchor_positions ``[B]``: its
        position. sequences ``[N, T]``: the whole batch's ids, for the logits processors; row ``b`` drafts after
        ``sequences[rows[b], :lengths[b]]`` (``rows=None``: row ``b``; see `process_positions`).
        max_drafts ``[B]``: most drafts each row may still use (token budget minus the bonus token).
        projected (*optional*): ``length_prediction [B] (or None) -> [B]``, called once the drafter's forward has
        run: the drafts of each row that may be verified, given its length head's prediction for the block; only
        those positions are projected to logits (the step's plan, `length_policy.StepPlan.projected`).
        """
        features, positions, valid = self._take_pending()
        context_mask = self._context_mask(features.shape[0], features.shape[1], valid)
        spans = context_groups(self.options.prefill, valid, self.cache, self.device)
        if len(spans) > 1:
            out = self._grouped_forward(anchors, anchor_positions, features, positions, valid, spans)
        else:
            out = self._forward(
                anchors, anchor_positions, features, positions, context_mask, self.cache, self.adapter_names
            )
            self.cache.crop(-self.block_size)  # the block leaves; the cache again holds context rows only
        self.cache_mask = context_mask
        return self._drafts(out, anchors, sequences, lengths, max_drafts, rows, projected)

    def _grouped_forward(self, anchors, anchor_positions, features, positions, valid, spans) -> AdaFlashDrafterOutput:
        """A call's first draft with its context read in the row groups ``spans`` (`prefill.context_groups`): each
        group drafts its rows' blocks after the columns from its rows' first token on, in a cache of its own, and the
        call's cache gets every group's context laid out as one read of the padded batch would have (`lay_out`,
        columns a row did not read zero and masked by ``cache_mask``). The output is the padded read's, to rounding:
        a row's drafts depend on its own context alone (`_forward` over the padding masks it out)."""
        batch, length = valid.shape
        first = valid.int().argmax(-1).tolist()
        hook = getattr(self.drafter, "on_select_rows", None)
        self._adapter_kwargs(batch, self.adapter_names)  # one name per row, or the clear error
        hidden = prediction = None
        parts = []
        for rows in spans:
            index = torch.tensor(rows, device=self.device)
            columns = slice(min(first[row] for row in rows), length)
            mask = valid[index, columns]
            cache = DFlashCache(config=self.drafter.config)
            if hook is not None:
                hook(index, cache, source=self.cache)
            names = None if self.adapter_names is None else [self.adapter_names[row] for row in rows]
            out = self._forward(
                anchors[index],
                anchor_positions[index],
                features[index, columns],
                positions[index, columns],
                None if bool(mask.all()) else mask,
                cache,
                names,
            )
            cache.crop(-self.block_size)
            if hidden is None:
                hidden = out.last_hidden_state.new_zeros((batch, *out.last_hidden_state.shape[1:]))
                if out.length_prediction is not None:
                    prediction = out.length_prediction.new_zeros((batch, *out.length_prediction.shape[1:]))
            hidden[index] = out.last_hidden_state
            if prediction is not None:
                prediction[index] = out.length_prediction
            parts.append((index, columns, cache, mask))
        lay_out(self.cache, parts, batch, length)
        return AdaFlashDrafterOutput(last_hidden_state=hidden, cache=self.cache, length_prediction=prediction)

    @torch.no_grad()
    def probe(
        self,
        anchors: torch.LongTensor,
        anchor_positions: torch.LongTensor,
        sequences: torch.LongTensor,
        lengths: torch.LongTensor,
        max_drafts: torch.LongTensor,
        rows: torch.LongTensor | None = None,
    ) -> Drafts:
        """Drafts that a probe scores and nobody verifies (`planner.py`), for the rows with ``max_drafts > 0`` (the
        rest get none); arguments as `draft`'s.

        Where this call's drafter has read no context yet, those rows draft alone, each from its whole queued
        context, in a cache of the probe's own, and the queue stays for the call's first real draft: a call's first
        draft reads every row's prompt, which at batch 8 costs more than a plain step (BENCHMARKS.md section 31),
        and a probe of one row reads one. Their drafts are the ones `draft` would give them (a row's draft depends
        on its own context alone). Otherwise, as `draft`.
        """
        asked = max_drafts.gt(0).nonzero().flatten()
        batch = max_drafts.shape[0]
        if self.cache.get_seq_length() > 0 or asked.numel() == batch:
            return self.draft(anchors, anchor_positions, sequences, lengths, max_drafts, rows)
        index = asked.to(self.device)
        features, positions, valid = self._joined(
            [(f[index], p[index], v if v is None else v[index]) for f, p, v in self._pending]
        )
        if valid is not None and index.numel() == 1:  # one row: its padding need not be read at all
            keep = valid[0]
            features, positions, valid = features[:, keep], positions[:, keep], None
        cache = DFlashCache(config=self.drafter.config)
        hook = getattr(self.drafter, "on_select_rows", None)
        if hook is not None:
            hook(asked, cache, source=self.cache)
        self._adapter_kwargs(batch, self.adapter_names)  # one name per row, or the clear error
        names = None if self.adapter_names is None else [self.adapter_names[i] for i in asked.tolist()]
        out = self._forward(anchors[asked], anchor_positions[asked], features, positions, valid, cache, names)
        full = torch.arange(batch, device=lengths.device) if rows is None else rows
        sample = self._drafts(out, anchors[asked], sequences, lengths[asked], max_drafts[asked], full[asked])
        tokens = sample.tokens.new_zeros((batch, sample.tokens.shape[1]))
        tokens[asked] = sample.tokens
        num_drafts = max_drafts.new_zeros(batch)
        num_drafts[asked] = sample.num_drafts
        prediction = None
        if sample.length_prediction is not None:
            prediction = sample.length_prediction.new_zeros(batch)
            prediction[asked] = sample.length_prediction
        return Drafts(tokens, None, None, num_drafts, prediction)

    def _forward(self, anchors, anchor_positions, features, positions, context_mask, cache, adapter_names):
        """The drafter over one block per row after ``features`` (the context it has not read yet, at
        ``positions``), with ``cache`` holding what it read before and ``context_mask`` the validity of all of it."""
        batch = features.shape[0]
        offsets = torch.arange(self.block_size, device=self.device)
        block_ids = torch.full((batch, self.block_size), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block_ids[:, 0] = anchors
        noise = self.input_embeddings(block_ids.to(self.input_embeddings.weight.device))
        position_ids = torch.cat([positions, anchor_positions.to(self.device)[:, None] + offsets], dim=1)
        attention_mask = (
            None
            if context_mask is None
            else torch.cat([context_mask, torch.ones_like(context_mask[:, :1]).expand(-1, self.block_size)], 1)
        )
        cache.set_previous_accepted_tokens(features.shape[1])
        return self.drafter(
            noise_embeds=noise.to(self.device),
            context_hidden_states=features,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            **self._adapter_kwargs(batch, adapter_names),
        )

    def _drafts(self, out, anchors, sequences, lengths, max_drafts, rows, projected=None) -> Drafts:
        """The drafts of the drafter's output ``out`` (arguments as `draft`'s)."""
        batch = anchors.shape[0]
        hidden = out.last_hidden_state[:, 1:]
        length_prediction = None if out.length_prediction is None else out.length_prediction[:, 0]
        max_drafts = max_drafts.clamp(min=0)
        if not self.policy.needs_confidence:
            # The LM head over the vocabulary is a large part of a draft's cost, and every policy but `confidence`
            # (which reads the drafts' probabilities) knows its lengths before it: project only the positions some
            # row can verify (at least one, so every shape stays non-empty).
            verifiable = self.policy.candidate_lengths(
                self.block_size, batch, length_prediction=length_prediction, device=anchors.device
            )
            limit = torch.minimum(verifiable - 1, max_drafts)
            if projected is not None:
                limit = torch.minimum(limit, projected(length_prediction).to(limit.device))
            hidden = hidden[:, : max(int(limit.max()), 1)]
        logits = self.draft_head(hidden).to(anchors.device)
        if self.selector is None:
            logits, tokens = process_positions(
                self.logits_processor, sequences, lengths, logits, choose=self.choose_draft, rows=rows
            )
        else:
            tokens, logits = self._walk(hidden, logits, anchors, sequences, lengths, rows)
        # where the processors leave no token of the (draft) vocabulary allowed, there is nothing to propose: the
        # row's drafts end before that position
        drafting = leading_true(logits.amax(-1) > float("-inf"))
        probs = None
        if self.do_sample or self.policy.needs_confidence:
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # NaN only past `drafting`, never verified
        candidate_lengths = self.policy.candidate_lengths(
            self.block_size,
            batch,
            length_prediction=length_prediction,
            draft_confidence=probs.amax(-1) if self.policy.needs_confidence else None,
            device=anchors.device,
        )
        num_drafts = torch.minimum(torch.minimum(candidate_lengths - 1, max_drafts), drafting)
        return Drafts(tokens, logits, probs if self.do_sample else None, num_drafts, length_prediction)

    def _walk(self, hidden, logits, anchors, sequences, lengths, rows):
        """The DFlash 2 selector's path and scores (module docstring), its unary logits processed as the target's
        are: all slots at once, or slot by slot after the tokens the walk chose before it when a processor reads
        the ids."""
        processors = self.logits_processor
        process = None
        if all(ids_independent(p) for p in processors):
            logits, _ = process_positions(processors, sequences, lengths, logits, rows=rows)
        else:
            rows = torch.arange(len(lengths), device=sequences.device) if rows is None else rows
            grown = torch.cat([sequences, sequences.new_zeros(sequences.shape[0], logits.shape[1])], dim=1)

            def process(i, chosen):
                if i:
                    grown[rows, lengths + i - 1] = chosen[:, i - 1].to(grown.device)
                logits[:, i : i + 1] = process_positions(
                    processors, grown, lengths + i, logits[:, i : i + 1], rows=rows
                )[0]

        return walk_selector(self.selector, hidden, logits, anchors, self.temperature, process)

    def _adapter_kwargs(self, batch: int, names: list[str] | None) -> dict:
        if names is None:
            return {}
        if len(names) != batch:
            raise ValueError(
                f"adaflash_adapter_names has {len(names)} names for a batch of {batch} rows; give one adapter name "
                "per row."
            )
        return {"adapter_names": names}

    def _context_mask(self, batch: int, new: int, valid: torch.Tensor | None) -> torch.Tensor | None:
        """Validity of every drafter cache row after this step's context is appended (``None``: all valid)."""
        if self.cache_mask is None and valid is None:
            return None
        past = self.cache_mask
        if past is None:
            past = torch.ones(batch, self.cache.get_seq_length(), dtype=torch.bool, device=self.device)
        if valid is None:
            valid = torch.ones(batch, new, dtype=torch.bool, device=self.device)
        return torch.cat([past, valid], dim=1)

    # ------------------------------------------------------------------ transformers' CandidateGenerator contract

    def get_candidates(
        self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, n_last_matches=0, **kwargs
    ):
        """transformers' assisted-decoding contract (batch 1): ``(input_ids + k drafts, their logits or None)``."""
        if is_first_iteration:
            return input_ids, None  # the loop's first pass is the target prefill, which yields our first context
        if input_ids.shape[0] != 1:
            raise ValueError("transformers' assisted loop is batch 1; batched inputs go through adaflash_hf's loop")
        cur_len = input_ids.shape[1]
        fed = cur_len - 1 - self.cache.get_seq_length()  # positions whose features the drafter has not seen yet
        features = self.context_features(model_outputs.hidden_states)[:, :fed]
        positions = model_kwargs["position_ids"][:, -fed - 1 : -1]
        self.add_context(features, positions)
        budget = torch.tensor([self.max_length - cur_len - 1], device=input_ids.device)
        drafts = self.draft(input_ids[:, -1], positions[:, -1] + 1, input_ids, torch.tensor([cur_len]), budget)
        k = int(drafts.num_drafts[0])
        if k == 0:
            return input_ids, None  # never a zero-width logits tensor: the loop would slice everything
        logits = drafts.logits[:, :k] if self.do_sample else None
        return torch.cat([input_ids, drafts.tokens[:, :k]], dim=1), logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """The length policy is stateless per step; nothing to adapt here."""


class PathProposer(ContextPaths):
    """The loop's drafter side with no drafter (n-gram paths only, ``adaflash_ngram`` without ``assistant_model``):
    it never drafts (the planner's block is one token, `planner.step_plan`), so the steps verify the paths its
    context offers, or the anchor alone. The target computes no hidden state for it but the embeddings, whose
    zero-width slice keeps the loop's shapes (`context_features`)."""

    def __init__(self, generation_config, options: AdaFlashGenerationOptions):
        self.options = options
        self.do_sample = bool(generation_config.do_sample)
        self.choose = token_chooser(self.do_sample)
        self.block_size = 1
        self.model_kwargs_overrides = {"output_hidden_states": [0]}

    def context_features(self, hidden_states: tuple) -> torch.Tensor:
        return hidden_states[0][..., :0]

    def add_context(self, features, positions, valid=None) -> None:
        pass

    def skip(self, anchors: torch.LongTensor) -> Drafts:
        return Drafts.none(anchors)

    def draft(self, *args, **kwargs) -> Drafts:
        raise RuntimeError("PathProposer has no drafter: the planner of the n-gram-only loop never drafts")

    probe = draft

    def select_rows(self, index: torch.LongTensor) -> None:
        if self.ngram is not None:
            self.ngram.select_rows(index.tolist())
