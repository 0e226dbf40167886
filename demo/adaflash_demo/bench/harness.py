"""Side-by-side generation benchmark: every method on the same prompts, interleaved so machine drift cancels.

Each method is a way to call ``target.generate``; all are measured by the same instruments:

* wall time around the call (prefill included), giving tokens/s over the tokens each row really generated;
* a forward pre-hook on the target counting its verification forwards and the tokens they process (padding
  included, because padding costs compute), giving the mean acceptance length (tokens committed per target forward
  after the prefill) and the processed tokens per emitted token;
* the outputs compared with plain greedy generation row by row (fp32 is exact; other dtypes are reported as they are);
* for our loop, `adaflash_hf.record_stats()`: the share of verified positions that are padding (rows padded to the
  widest row of a step), which the forward counter cannot tell from real drafts;
* each speedup with its 95% interval (`speedup_interval`): runs of identical work differ by several percent on a
  shared CPU, so a cell's speedup is only as good as the batches behind it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationConfig

from adaflash_hf.generation.profile import profile_for
from adaflash_hf.generation.stats import record_stats
from adaflash_hf.generation.stopping import cut_after_eos
from adaflash_hf.generation.verify_layout import KERNELS

METHODS = (
    "plain",
    "hf_assisted",
    "prompt_lookup",
    "native_dflash",
    "adaflash_fixed",
    "adaflash_adaptive",
    "adaflash_confidence",
    "adaflash_planned",
    "adaflash_tree",
    "adaflash_hybrid",
    "adaflash_lookup",
)
PATHS_ONLY = "adaflash_lookup"  # prompt lookup in our loop (adaflash_ngram, no drafter): batched, beside prompt_lookup
TREE_BUDGET = 32  # tokens per tree of `adaflash_tree`; `adaflash_tree<N>` (adaflash_tree16, ...) sets another
# `adaflash_planned_linear`, `adaflash_fixed_onednn`, ...: the method with every verification forward in one kernel
# (`adaflash_hf.generation.verify_layout.KERNELS`; `_linear`: the model's own, no measured choice)
KERNEL_SUFFIXES = {f"_{name}": name for name in KERNELS}
BATCH_1_ONLY = ("hf_assisted", "prompt_lookup", "native_dflash")  # transformers' assisted loop refuses batch > 1


@dataclass
class BenchRecord:
    method: str
    batch_size: int
    domain: str
    dtype: str
    tokens_per_s: float
    speedup: float
    mean_acceptance_length: float
    verified_per_emitted: float
    identical_fraction: float
    emitted_tokens: int
    seconds: float
    padding_fraction: float = float("nan")  # verified positions of our loop that were padding (nan: not our loop)
    # the speedup's 95% interval (`speedup_interval`) and the timed calls behind it
    speedup_low: float = float("nan")
    speedup_high: float = float("nan")
    calls: int = 0
    # adaflash_ngram methods: the share of accepted drafts that the context's n-gram paths proposed (a token both
    # sources proposed counts as copied); nan for the others
    copied_fraction: float = float("nan")
    # (tokens, seconds) of each timed call in the group's batch order, for a look at how a cell's calls differ (the
    # first calls of a process pay its kernel and draft-head trials); plain's are the same batches'
    call_times: list = field(default_factory=list)
    # our loop: per step kind (`adaflash_hf.generation.stats.StepRecord.kind`: plain, probe, drafted, paths), the
    # steps, tokens, seconds and the planner's predicted seconds and tokens, summed over the cell's calls (where the
    # time went, and how well the planner priced it)
    steps_by_kind: dict = field(default_factory=dict)
    # the calls' time reading their prompts (`ForwardCounter`), and the speedup of the rest (the decoding after the
    # prefill) with its 95% interval: a padded batch's prefill is most of a short call's time at batch 32, the same
    # work for every method unless the loop reads the prompt in groups (`adaflash_prefill`)
    prefill_seconds: float = float("nan")
    decode_speedup: float = float("nan")
    decode_speedup_low: float = float("nan")
    decode_speedup_high: float = float("nan")


@dataclass
class _Tally:
    seconds: float = 0.0
    tokens: int = 0
    row_forwards: int = 0
    processed: int = 0
    identical: int = 0
    rows: int = 0
    real_verified: int = 0  # our loop: tokens rows really verified (anchor + drafts, or tree nodes)
    padded_verified: int = 0  # our loop: rows x width over its steps
    calls: list = field(default_factory=list)  # (tokens, seconds) of each timed call, in the group's batch order
    decode_calls: list = field(default_factory=list)  # (tokens, seconds after the prefill) of the same calls
    prefill_seconds: float = 0.0
    accepted: int = 0  # our loop: drafts accepted
    copied: int = 0  # adaflash_ngram: of them, proposed by n-gram paths
    merged: bool = False  # a step of adaflash_ngram ran
    kinds: dict = field(default_factory=dict)  # our loop: `SpeculativeStats.by_kind` summed over the calls


class ForwardCounter:
    """Counts the target's forwards, the batch rows they serve and the tokens they process, and times the prompt's
    forwards (hooks, no patch: wrapping the forward would hide its signature from transformers' checks).

    A forward that starts from an empty cache reads a prompt (the prefill: one forward over the padded batch, or
    several over groups of rows, `adaflash_hf.generation.prefill`); those are left out of the counts, and
    `prefill_seconds` is their wall time; `step_seconds` is the other forwards' (a plain step's, a verification's);
    `gaps` holds the seconds between two consecutive such forwards (what the decoding loop does between them).
    """

    def __init__(self, model):
        self.model, self.sizes, self.prefill_seconds, self.step_seconds = model, [], 0.0, 0.0
        self._started, self._prefill, self._ended, self.gaps = None, False, None, []

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._prefill = cache is None or cache.get_seq_length() == 0
        self._started = time.perf_counter()
        if not self._prefill:
            self.sizes.append(ids.shape)
            if self._ended is not None:
                self.gaps.append(self._started - self._ended)
        self._ended = None

    def _after(self, module, args, output):
        if self._started is not None:
            seconds = time.perf_counter() - self._started
            if self._prefill:
                self.prefill_seconds += seconds
            else:
                self.step_seconds += seconds
                self._ended = self._started + seconds
            self._started = None

    @property
    def row_forwards(self) -> int:
        return sum(shape[0] for shape in self.sizes)

    @property
    def processed_tokens(self) -> int:
        return sum(shape[0] * shape[1] for shape in self.sizes)

    @contextlib.contextmanager
    def counting(self):
        self.sizes, self.prefill_seconds, self.step_seconds, self._started = [], 0.0, 0.0, None
        self._ended, self.gaps = None, []
        handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def method_kwargs(method: str, drafter=None, ar_draft=None) -> dict:
    """`generate()` keyword arguments that select a method."""
    if method == "plain":
        return {}
    if method == "hf_assisted":
        return {"assistant_model": ar_draft}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 10}
    if method == PATHS_ONLY:
        return {"prompt_lookup_num_tokens": 10, "adaflash_ngram": True}
    if method == "native_dflash":
        return {"assistant_model": drafter, "speculation_type": "dflash"}
    suffix = next((s for s in KERNEL_SUFFIXES if method.startswith("adaflash_") and method.endswith(s)), None)
    if suffix is not None:
        # the same method with every verification forward in one kernel (verify_layout.py): the A/B of the choice
        kernel = {"adaflash_verify_layout": KERNEL_SUFFIXES[suffix]}
        return {**method_kwargs(method.removesuffix(suffix), drafter), **kernel}
    policy = method.removeprefix("adaflash_")
    if policy.startswith("hybrid"):
        # the planner with n-gram paths from the context merged into its trees (adaflash_ngram); adaflash_hybrid<N>
        # bounds the tree at N tokens (default: the drafter's block plus the paths' nodes)
        budget = policy.removeprefix("hybrid")
        if budget and not budget.isdigit():
            raise ValueError(f"unknown method {method!r}: adaflash_hybrid takes a tree budget as adaflash_hybrid<N>")
        return {
            "assistant_model": drafter,
            "adaflash_length_policy": "planned",
            "adaflash_ngram": True,
            **({"adaflash_tree_budget": int(budget)} if budget else {}),
        }
    if policy.startswith(("tree", "planned_tree")):
        budget = policy.removeprefix("planned_").removeprefix("tree")
        if budget and not budget.isdigit():
            raise ValueError(f"unknown method {method!r}: adaflash_tree takes a node budget as adaflash_tree<N>")
        # adaflash_tree<N>: the whole block as the tree's depth, the budget bounds its nodes; adaflash_planned_tree<N>:
        # the planner's width is the budget, within N
        return {
            "assistant_model": drafter,
            "adaflash_length_policy": "planned" if policy.startswith("planned") else "fixed",
            "adaflash_tree_budget": int(budget or TREE_BUDGET),
        }
    return {"assistant_model": drafter, "adaflash_length_policy": policy}


def available_methods(methods, batch_size: int, drafter=None, ar_draft=None) -> list[str]:
    """The methods that can run at this batch size with these models."""
    usable = []
    for method in methods:
        if batch_size > 1 and method in BATCH_1_ONLY:
            continue
        if method == "hf_assisted" and ar_draft is None:
            continue
        if method.startswith(("native", "adaflash")) and drafter is None and method != PATHS_ONLY:
            continue
        if method == "adaflash_adaptive" and not drafter.config.use_length_head:
            continue
        usable.append(method)
    return usable


POOLED = "pooled"  # the domain label of a batch size's group of pooled domains: "pooled(code+docs+...)"


@dataclass
class BatchGroup:
    """The prompts one batch size serves as one group of records: one domain's, or the pool of the domains that
    cannot fill a batch of that size on their own (``pooled_from`` names them)."""

    domain: str
    batch_size: int
    prompts: list[str]
    pooled_from: tuple[str, ...] = ()

    @property
    def batches(self) -> list[list[str]]:
        """Whole batches only: the last ``len(prompts) % batch_size`` prompts are left out, never a short batch,
        whose padding and size would not be the batch size measured."""
        size = self.batch_size
        return [self.prompts[i : i + size] for i in range(0, len(self.prompts) - size + 1, size)]

    def describe(self) -> str:
        """What a pooled group is, for the log: which domains, how many prompts, how many batches."""
        used = len(self.batches) * self.batch_size
        left_out = f", {len(self.prompts) - used} left out" if used < len(self.prompts) else ""
        batches = f"{len(self.batches)} batch" + ("" if len(self.batches) == 1 else "es")
        return (
            f"batch {self.batch_size}: too few prompts per domain to fill a batch; the {len(self.prompts)} prompts of "
            f"{', '.join(self.pooled_from)} are pooled, interleaved, into {self.domain!r} ({batches} of "
            f"{self.batch_size}{left_out})"
        )


def plan_batches(prompts_by_domain: dict[str, list[str]], batch_sizes) -> list[BatchGroup]:
    """The groups `run_benchmark` serves, batch size by batch size: each domain with at least ``batch_size`` prompts
    on its own, and the domains with fewer pooled into one group (labelled ``pooled(a+b+...)``, their prompts
    interleaved, one of each domain in turn, so each batch mixes them and the prompts a last partial batch leaves out
    come from every domain); when those together still cannot fill a batch, every domain joins the pool. No batch
    size yields a record measured on no batch at all.

    Raises ValueError, before anything runs, when all the prompts together cannot fill one batch, naming the fix."""
    groups = []
    for batch_size in batch_sizes:
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size}: give batch sizes of at least 1")
        short = [domain for domain, prompts in prompts_by_domain.items() if len(prompts) < batch_size]
        if short and sum(len(prompts_by_domain[domain]) for domain in short) < batch_size:
            short = list(prompts_by_domain)  # too few even together: every domain joins the pool
        groups += [
            BatchGroup(domain, batch_size, list(prompts))
            for domain, prompts in prompts_by_domain.items()
            if domain not in short
        ]
        if not short:
            continue
        columns = itertools.zip_longest(*(prompts_by_domain[domain] for domain in short))
        pool = [prompt for column in columns for prompt in column if prompt is not None]
        if len(pool) < batch_size:
            counts = ", ".join(f"{domain} {len(prompts_by_domain[domain])}" for domain in short)
            raise ValueError(
                f"batch size {batch_size} cannot be filled: {counts} prompts, {len(pool)} even pooled; give smaller "
                "batch sizes, or more prompts (--prompts-per-domain, or a larger --prompts file)"
            )
        groups.append(BatchGroup(f"{POOLED}({'+'.join(short)})", batch_size, pool, tuple(short)))
    return groups


def run_benchmark(
    target,
    tokenizer,
    prompts_by_domain: dict[str, list[str]],
    *,
    drafter=None,
    ar_draft=None,
    methods=METHODS,
    batch_sizes=(1,),
    max_new_tokens: int = 128,
    repeats: int = 1,
    progress=None,
    on_output=None,
) -> list[BenchRecord]:
    """Runs every usable method on every group of `plan_batches` (each domain at each batch size, the domains too
    small for a batch size pooled), interleaving methods batch by batch.

    ``on_output(domain, method, rows)``, if given, receives each call's generated token ids per row.

    Each method that drafts runs its own copy of ``drafter``, so its own runtime profile (`profile.profile_for` keeps
    one per drafter object): what one method's calls measure and learn (step costs, drafting's rate, the length head's
    calibration) does not price another's steps, as a user running one method alone would see it. Shared, the
    hybrid's tree steps priced the planner's widths and moved its rate (BENCHMARKS.md section 30). With a profile
    folder each copy keeps its file in a subfolder named after its method (`own_profile`).
    """
    dtype = str(target.dtype).replace("torch.", "")
    counter = ForwardCounter(target)
    own = {
        method: own_profile(target, copy.deepcopy(drafter), method)
        for method in methods
        if drafter is not None and method_kwargs(method, drafter).get("assistant_model") is drafter
    }
    records = []
    for group in plan_batches(prompts_by_domain, batch_sizes):
        domain, batch_size = group.domain, group.batch_size
        usable = available_methods(methods, batch_size, drafter, ar_draft)
        tallies = {m: _Tally() for m in usable}
        for step, (_, batch) in enumerate(itertools.product(range(repeats), group.batches)):
            inputs = tokenizer(batch, return_tensors="pt", padding=True).to(target.device)
            rotation = usable[step % len(usable) :] + usable[: step % len(usable)]
            outputs = {
                method: _timed_generate(
                    target,
                    inputs,
                    method,
                    own.get(method, drafter),
                    ar_draft,
                    max_new_tokens,
                    counter,
                    tallies[method],
                )
                for method in rotation
            }
            for method, rows in outputs.items():
                tallies[method].identical += sum(r == p for r, p in zip(rows, outputs.get("plain", ())))
                if on_output is not None:
                    on_output(domain, method, rows)
            if progress is not None:
                progress.update(1)
        plain_speed = _speed(tallies.get("plain"))
        plain_decode = _decode_speed(tallies.get("plain"))
        for method, tally in tallies.items():
            speed = _speed(tally)
            low, high = speedup_interval(tally.calls, tallies["plain"].calls) if "plain" in tallies else (nan, nan)
            decode_low, decode_high = (
                speedup_interval(tally.decode_calls, tallies["plain"].decode_calls)
                if "plain" in tallies
                else (nan, nan)
            )
            records.append(
                BenchRecord(
                    method=method,
                    batch_size=batch_size,
                    domain=domain,
                    dtype=dtype,
                    tokens_per_s=speed,
                    speedup=speed / plain_speed if plain_speed else float("nan"),
                    mean_acceptance_length=(tally.tokens - tally.rows) / max(tally.row_forwards, 1),
                    verified_per_emitted=tally.processed / max(tally.tokens - tally.rows, 1),
                    identical_fraction=tally.identical / max(tally.rows, 1) if "plain" in tallies else float("nan"),
                    emitted_tokens=tally.tokens,
                    seconds=tally.seconds,
                    padding_fraction=1 - tally.real_verified / tally.padded_verified
                    if tally.padded_verified
                    else float("nan"),
                    speedup_low=low,
                    speedup_high=high,
                    calls=len(tally.calls),
                    copied_fraction=tally.copied / max(tally.accepted, 1) if tally.merged else float("nan"),
                    call_times=[list(call) for call in tally.calls],
                    steps_by_kind=tally.kinds,
                    prefill_seconds=tally.prefill_seconds,
                    decode_speedup=_decode_speed(tally) / plain_decode if plain_decode else nan,
                    decode_speedup_low=decode_low,
                    decode_speedup_high=decode_high,
                )
            )
    return records


nan = float("nan")


def speedup_interval(calls, plain_calls, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of a method's speedup over plain, by a paired bootstrap over the group's batches.

    calls, plain_calls: ``(tokens, seconds)`` per timed call, the method's and plain's on the same batches in the same
    order (the benchmark interleaves them batch by batch). The speedup is the ratio of the two throughputs over the
    whole group (tokens over seconds, summed), as the record reports it; resampling batches, not calls of one method
    alone, keeps each batch's pairing, so what the interval measures is how much the ratio depends on which batches
    were drawn and on the noise each pair of calls met. ``(nan, nan)`` with fewer than two batches."""
    if len(calls) != len(plain_calls) or len(calls) < 2:
        return nan, nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        drawn = [rng.randrange(len(calls)) for _ in calls]
        tokens, seconds = sum(calls[i][0] for i in drawn), sum(calls[i][1] for i in drawn)
        plain_tokens, plain_seconds = sum(plain_calls[i][0] for i in drawn), sum(plain_calls[i][1] for i in drawn)
        ratios.append((tokens / seconds) / (plain_tokens / plain_seconds))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def _speed(tally) -> float:
    return tally.tokens / tally.seconds if tally and tally.seconds else 0.0


def _decode_speed(tally) -> float:
    """Tokens per second of the calls' time after their prefill."""
    seconds = sum(s for _, s in tally.decode_calls) if tally else 0.0
    return tally.tokens / seconds if seconds else 0.0


def own_profile(target, drafter, name: str):
    """``drafter`` (a method's copy, not used yet), its runtime profile kept in the subfolder ``name`` of the profile
    folder, if there is one: the copies' files share a name (`profile.profile_for`), so that in one folder a copy
    first used after another's call would start from what that call saved, and they would overwrite each other's."""
    profile_for(target, drafter, subfolder=name)
    return drafter


def method_config(target, method: str, max_new_tokens: int, drafter=None, ar_draft=None):
    """``(generation_config, kwargs)`` that run ``method`` greedily for ``max_new_tokens``: the target's defaults
    with the method's ``adaflash_*`` settings, and the other `generate()` keyword arguments it takes."""
    kwargs = method_kwargs(method, drafter, ar_draft)
    adaflash = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("adaflash_")}
    defaults = target.generation_config.to_dict()
    # A generation config derived from the model config (GGUF-loaded targets, models saved without one) carries
    # `_from_model_config=True`, and GenerationConfig(**kwargs) then drops every attribute it does not know: the
    # `adaflash_*` policy would silently fall back to the drafter's default.
    defaults.pop("_from_model_config", None)
    config = GenerationConfig(**{**defaults, "do_sample": False, "max_new_tokens": max_new_tokens, **adaflash})
    missing = {key for key, value in adaflash.items() if getattr(config, key, None) != value}
    if missing:
        raise RuntimeError(f"GenerationConfig dropped {sorted(missing)}; the method would not run as named")
    return config, kwargs


def _timed_generate(target, inputs, method, drafter, ar_draft, max_new_tokens, counter, tally) -> list[list[int]]:
    config, kwargs = method_config(target, method, max_new_tokens, drafter, ar_draft)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    ours = method.startswith("adaflash_")
    before = tally.seconds
    with counter.counting(), record_stats() if ours else contextlib.nullcontext() as stats:
        sync()
        start = time.perf_counter()
        out = target.generate(**inputs, generation_config=config, **kwargs)
        sync()
        tally.seconds += time.perf_counter() - start
    if ours:
        for step in stats.steps:
            tally.real_verified += sum(step.candidate_lengths)
            tally.padded_verified += len(step.rows) * step.verify_width
            tally.accepted += sum(step.accepted)
            if step.ngram_accepted is not None:
                tally.copied += sum(step.ngram_accepted)
                tally.merged = True
        for kind, entry in stats.by_kind().items():
            summed = tally.kinds.setdefault(kind, dict.fromkeys(entry, 0))
            for name, value in entry.items():
                summed[name] += value
    tally.row_forwards += counter.row_forwards
    tally.processed += counter.processed_tokens
    rows = [cut_after_eos(row, config) for row in out[:, inputs["input_ids"].shape[1] :].tolist()]
    tally.tokens += sum(map(len, rows))
    tally.rows += len(rows)
    tally.calls.append((sum(map(len, rows)), tally.seconds - before))
    tally.decode_calls.append((sum(map(len, rows)), tally.seconds - before - counter.prefill_seconds))
    tally.prefill_seconds += counter.prefill_seconds
    return rows


def records_as_dicts(records) -> list[dict]:
    return [asdict(r) for r in records]
