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
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import greedy_acceptance, speculative_sampling
from .candidate_generator import AdaFlashCandidateGenerator
from .processing import process_positions
from .stats import CallRecorder

COMPACT_FRACTION = 0.5  # compact the target cache once holes exceed this fraction of its columns


def _prefill_positions(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.LongTensor:
    """Position ids as transformers' generate() builds them: count only unmasked tokens (left padding)."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, -1)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _check_cache(cache, target, batch_size: int, max_length: int) -> None:
    if type(cache) is not DynamicCache:
        raise ValueError(
            f"AdaFlash decoding needs a DynamicCache (it crops rejected drafts and masks holes), got "
            f"{type(cache).__name__}: drop cache_implementation= or pass cache_implementation='dynamic'."
        )
    window = getattr(target.config.get_text_config(decoder=True), "sliding_window", None)
    if batch_size > 1 and window is not None and max_length > window:
        # A sliding window counts cache columns, holes included, so it would see fewer real tokens than plain decoding.
        raise NotImplementedError(
            f"Batched AdaFlash decoding with a sliding-window target is exact only while prompt + new tokens fit the "
            f"window ({window}); got max_length={max_length}. Generate row by row, or lower max_new_tokens."
        )


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
        self.target = target
        self.config = generation_config
        self.processors = logits_processor
        self.streamer = streamer
        self.generator = AdaFlashCandidateGenerator(target, drafter, generation_config, logits_processor)
        self.hidden_layers = self.generator.model_kwargs_overrides["output_hidden_states"]
        self.cache = model_kwargs["cache"]
        _check_cache(self.cache, target, input_ids.shape[0], generation_config.max_length)
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
        eos = generation_config._eos_token_tensor
        self.eos = None if eos is None else eos.to(input_ids.device).flatten()
        self.extra_criteria = [
            c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))
        ]
        keep = generation_config.return_dict_in_generate
        self.scores = [[] for _ in range(batch)] if keep and generation_config.output_scores else None
        self.raw_logits = [[] for _ in range(batch)] if keep and generation_config.output_logits else None
        self.recorder = CallRecorder(batch, input_ids.device)

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
        positions = self.position_ids
        if positions is None:
            positions = _prefill_positions(self.attention_mask, batch, length, self.sequences.device)
        outputs = self.target(
            input_ids=self.sequences[:, :length],
            attention_mask=self.attention_mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.hidden_layers,
            logits_to_keep=1,
        )
        raw = outputs.logits[:, -1:].float()
        processed, first = process_positions(
            self.processors, self.sequences, self.lengths, raw.clone(), choose=self.generator.choose
        )
        self.cache_mask = None if self.attention_mask is None else self.attention_mask.bool()
        valid = None if self.attention_mask is None else self.attention_mask.bool()
        self.generator.add_context(self.generator.context_features(outputs.hidden_states), positions, valid)
        self.next_positions = positions[:, -1] + 1
        self.commit(first, torch.ones(batch, dtype=torch.long, device=first.device), processed, raw)

    def step(self):
        rows, generator = self.active, self.generator
        start = self.recorder.clock()
        budget = self.max_new_tokens - (self.lengths[rows] - self.prompt_len)
        anchors = self.sequences[rows, self.lengths[rows] - 1]
        drafts = generator.draft(anchors, self.next_positions, self.sequences[rows], self.lengths[rows], budget - 1)
        drafted = self.recorder.clock()

        width = int(drafts.num_drafts.max()) + 1
        verify_ids = torch.cat([anchors[:, None], drafts.tokens[:, : width - 1]], dim=1)
        offsets = torch.arange(width, device=verify_ids.device)
        fed = offsets <= drafts.num_drafts[:, None]  # [B, width]: padding beyond a row's drafts is masked
        outputs = self.target(
            input_ids=verify_ids,
            attention_mask=self._extended_mask(fed),
            position_ids=self.next_positions[:, None] + offsets,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.hidden_layers,
        )
        verified = self.recorder.clock()

        raw = outputs.logits.float()
        processed, _ = process_positions(
            self.processors, self.sequences[rows], self.lengths[rows], raw.clone(), tokens=verify_ids[:, 1:]
        )
        draft_tokens = drafts.tokens[:, : width - 1]
        if generator.do_sample:
            accepted, following = speculative_sampling(
                draft_tokens, drafts.probs[:, : width - 1], torch.softmax(processed, -1), drafts.num_drafts
            )
        else:
            accepted, following = greedy_acceptance(draft_tokens, processed, drafts.num_drafts)
        committed = torch.cat([draft_tokens, following[:, None]], dim=1).scatter(
            1, accepted[:, None], following[:, None]
        )

        self._keep_in_cache(offsets <= accepted[:, None], width)
        generator.add_context(
            generator.context_features(outputs.hidden_states),
            self.next_positions[:, None] + offsets,
            offsets <= accepted[:, None],
        )
        self.next_positions = self.next_positions + accepted + 1
        emitted = self.commit(committed, accepted + 1, processed, raw)
        self.recorder.add(
            rows=rows.tolist(),
            candidate_lengths=(drafts.num_drafts + 1).tolist(),
            accepted=accepted.tolist(),
            emitted=emitted.tolist(),
            verify_width=width,
            draft_time_s=drafted - start,
            target_time_s=verified - drafted,
        )

    # ------------------------------------------------------------------ commit and stop

    def commit(self, tokens, counts, processed, raw) -> torch.LongTensor:
        """Appends ``tokens[b, :counts[b]]`` to each active row, cut where plain decoding would have stopped.

        tokens ``[B, n]``; processed/raw ``[B, n, V]`` target logits behind them. Returns the counts committed.
        Finished rows leave the batch.
        """
        rows = self.active
        counts, finished = self._stop_points(tokens, counts)
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        keep = offsets < counts[:, None]
        columns = (self.lengths[rows, None] + offsets).clamp(max=self.sequences.shape[1] - 1)
        self.sequences[rows[:, None].expand_as(columns)[keep], columns[keep]] = tokens[keep]
        for per_row, values in ((self.scores, processed), (self.raw_logits, raw)):
            for slot, row in enumerate(rows.tolist() if per_row is not None else ()):
                per_row[row].extend(values[slot, : int(counts[slot])])
        if self.streamer is not None and len(rows) == 1:
            self.streamer.put(tokens[0, : int(counts[0])].cpu())
        self.lengths[rows] += counts
        if finished.any():
            self._drop(~finished)
        return counts

    def _stop_points(self, tokens, counts) -> tuple[torch.LongTensor, torch.Tensor]:
        rows = self.active
        budget = self.max_new_tokens - (self.lengths[rows] - self.prompt_len)
        finished = counts >= budget
        counts = torch.minimum(counts, budget)
        if self.eos is not None:
            is_eos = torch.isin(tokens, self.eos) & (
                torch.arange(tokens.shape[1], device=tokens.device) < counts[:, None]
            )
            hit = is_eos.any(-1)
            counts = torch.where(hit, is_eos.int().argmax(-1) + 1, counts)
            finished |= hit
        for slot in range(len(rows)) if self.extra_criteria else ():
            stop = self._first_criterion_stop(int(rows[slot]), tokens[slot, : int(counts[slot])])
            if stop is not None:
                counts[slot], finished[slot] = stop, True
        return counts, finished

    def _first_criterion_stop(self, row: int, new_tokens: torch.LongTensor) -> int | None:
        history = self.sequences[row, : int(self.lengths[row])]
        for count in range(1, len(new_tokens) + 1):
            ids = torch.cat([history, new_tokens[:count]])[None]
            if any(bool(criterion(ids, None).any()) for criterion in self.extra_criteria):
                return count
        return None

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
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.cache_mask = mask.gather(1, order)

    def _drop(self, keep: torch.Tensor) -> None:
        index = keep.nonzero().squeeze(-1)
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

    # ------------------------------------------------------------------ output

    def output(self):
        generated = int((self.lengths - self.prompt_len).max())
        sequences = self.sequences[:, : self.prompt_len + generated]
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=self._per_token(self.scores, generated),
            logits=self._per_token(self.raw_logits, generated),
            cache=self.cache,
        )

    @staticmethod
    def _per_token(per_row, generated):
        """Per-row lists of ``[V]`` tensors -> tuple over generated positions of ``[B, V]``, zeros after a row ends."""
        if per_row is None:
            return None
        template = next(t for row in per_row for t in row)
        return tuple(
            torch.stack([row[i] if i < len(row) else torch.zeros_like(template) for row in per_row])
            for i in range(generated)
        )


def adaflash_decoding(
    target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, **model_kwargs
):
    """Runs speculative decoding; arguments as transformers passes them to a decoding method."""
    return SpeculativeDecoding(
        target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
    ).run()
