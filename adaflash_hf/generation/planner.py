"""The verification planner behind ``length_policy="planned"``: every step, how many tokens the batch verifies, zero
drafts included, to commit the most tokens per second.

Speculation pays only when the tokens a step is expected to commit outweigh what the step costs over a plain
decoding step. Both sides are measured, never assumed:

* **cost**: the wall time of whole loop steps, per number of active rows ``R`` and verify width ``w`` (the anchor
  plus ``w - 1`` drafts): ``S(R, 1)`` is a plain step (no drafter forward at all), ``S(R, w)`` a drafted one. Each is
  the median of the loop's last `COST_WINDOW` steps of its kind (one step slowed by the machine, a page fault or a
  neighbour's burst, must not set a price: a plain step priced too high makes every drafted step look good, and the
  planner then stops stepping plainly, which is what would correct it), and the plain step's cost is trusted once
  `PLAIN_SAMPLES` steps measured it. A wider step's cost is kept in plain steps of its row count: when the plain
  step's cost moves (a longer context, a slower moment of a shared machine), the wider costs move with it
  (`CostTable._follow_plain`), so a timing burst that lifts the plain step's price does not make every wider step
  look good. An unmeasured width is interpolated linearly between the measured widths of the same ``R``; narrower
  than the narrowest it costs the narrowest's cost, one token wider than the widest the widest's (a lower bound, so
  it runs once where drafting pays and is measured), wider still in proportion to width (an upper bound); an ``R``
  that did not measure a width borrows, in its own plain steps, the nearest row count's that did (rows leave a batch
  one by one as they finish; `_estimate`). A drafted width never costs more than a wider one of its ``R`` (one
  slow step would otherwise price it out for good: a width priced too dear is not run, so not measured again), and a
  step that timed a candidate kernel prices its width at most what the widths timed with their kernels kept imply
  (`CostTable._drafted_prices`). The table lives in the pair's
  `profile.RuntimeProfile`, per device and dtype, so a later ``generate()`` call starts from what earlier ones
  measured.
* **acceptance**: the drafts of a row are accepted one after another until the first rejection, each with
  probability ``p`` (a geometric model), so ``k`` offered drafts commit ``1 + p + ... + p^k`` tokens in expectation.
  ``p`` is estimated per row from its accepted and offered drafts (accepted drafts are successes, a rejection is one
  failure), shrunk towards the batch's pooled estimate, which starts from the process's last value for this pair.

The choice is ``argmax_w rate(w)``; ``w = 1`` is a plain step. At one row ``rate(w) = E[committed | w] / S(1, w)``.
Every row verifies the same ``w - 1`` drafts: rows are padded to the widest one anyway, so offering a row fewer drafts
would save nothing. At batch > 1 the rate is the batch's (`finish_rates`): a ``generate()`` batch ends with its last
row, so a choice is worth how soon the batch would finish were every later step that choice, each row finishing after
its tokens left (its budget) over what it commits a step, and the steps after a row's finish costing a plain step of
the rows left (the table's plain costs by row count). Where rows commit alike this is ``sum_rows E[committed | w] /
S(R, w)``, the rate a server that replaces finished rows sees; where some rows get ahead (a copied path, a row whose
drafts are accepted), their tokens are worth only what their earlier finish saves, which at batch 8 on a CPU, where a
step costs about the same whatever its rows, is little: valued as the sum, the hybrid's copied paths paid 1.03x by rate
step by step and lost 9% of changelog's time at batch 8 (BENCHMARKS.md section 31). A row's budget bounds what it may
commit, not when it stops: a row that will end early at EOS is valued as one that runs to its budget. The measured
rates of drafting (with a length head, below) still sum the rows' tokens: counted as what each step brought the batch's
finish closer by, a step's worth waits for the rows behind to catch up, and a call judged on its first drafted steps
stopped drafting where it paid (math at batch 8: 1.06x against 1.18x, BENCHMARKS.md section 32). Wider widths are
measured one at a time: the next width beyond the widest measured wins where drafting pays at the widest's cost, and a
width between measured ones runs once when the width below it wins (once per width, pair and process). While plain
steps win, no acceptance is observed, so the planner probes after ``probe_interval`` plain steps, and the interval
doubles (up to `MAX_PROBE_INTERVAL`) each time the probe did not change the choice; it is never shorter than keeps the
probes' cost within `PROBE_BUDGET` (0.5%) of the plain steps' time (`VerificationPlanner.probe_interval`). A probe
costs its draft and the drafter's reading of the context queued since the last draft (`CostTable.probe_s`, apart from
a drafted step's draft, `CostTable.draft_s`): a small part of a plain step at batch 1; at batch 8 a probe of every row
before the call's first real draft reads every prompt, more than a plain step (BENCHMARKS.md sections 18 and 31), so
until the call drafts for real (`SAMPLE_PROBES`) a probe drafts one row, the rows taking turns, in a drafter cache of
its own (`AdaFlashCandidateGenerator.probe`), and that row's block stands for the others' acceptance.

**Probes verify nothing.** A probe is a *shadow* step: the drafter drafts its block, but the target verifies only the
anchor, as in a plain step, and the block is scored against the tokens the target then commits on its own: the
drafts before the first disagreement are exactly what verifying the block would have accepted under greedy decoding
(under sampling, agreement with the target's own samples, ``sum_x p(x) q(x)``, is a lower bound of speculative
sampling's ``sum_x min(p(x), q(x))``, so the estimate errs towards plain steps). A probe thus costs one draft, a
fraction of a plain step, instead of a verification. Drafting resumes (a real drafted step, which measures the cost of
its width) only when the acceptance that the probe's block shows, as evidence beside the call's earlier observations
(one block is one sample, and lucky ones come by), makes drafting pay at the drafted steps' measured costs (before
any was measured, at the cheapest a drafted step can cost: a plain step plus the measured draft; `shadow_gain`).
A new call knows nothing of its own prompts, so its first decision is a probe where drafting paid lately at its row
count; elsewhere the call's first probe waits until the plain steps since the last one, counted across calls
(`CostTable.idle_steps`), keep it within the budget (`_first_probe_due`). With a drafter that never agrees, the loop
verifies nothing but anchors after the first step, and drafts once per probe interval.

**With a length head** (a drafter that has AdaFlash's head), the head reads each drafted block and predicts how many of
its drafts the target will accept; that sees easy and hard spans, which a row's average acceptance cannot. The step
then has two decisions. *Before* drafting: draft or step plainly, by comparing the measured rate of this call's drafted
steps (committed tokens per second, all of them summed per row count, head-chosen widths included) with a plain step's
``R / S(R, 1)``, the call's speedup counted beside `RATE_PRIOR_STEPS` steps at the earlier calls' (a slow moving
average: one step's speedup is noisy, and a call judged on its first one or two stops where drafting pays), and a
call that is drafting goes on while an upper bound of that rate beats plain steps. A call drafts from its first step
where the pair's rate beats plain steps (an answer's first steps are where code's drafts are accepted most), and
otherwise starts drafting when a probe's block would have paid; a probe's block is also one more sample of the pair's
rate (not of the call's), so a pair whose probes never start drafting still learns its rate. Probes come after plain
streaks as above. *After*
drafting (`refine`): the width, with each row's ``p`` taken from its head prediction instead of its history (a
predicted ``a`` accepted drafts is a geometric ``p = a / (1 + a)``), the predictions scaled by a calibration factor
that follows the ratio of accepted to expected drafts. The width maximises the same expected rate
over ``2 .. block_size`` (the drafter has run; every drafted width is costed by the same table).

**With merged n-gram paths** (``adaflash_ngram``, `ngram.py`), the loop tells the planner before each step how
long a continuation each row's context offers, and the planner chooses, with the drafter's width, how many path
tokens join the step's tree (`plan_paths`): each choice at its rate (as above) from each row's expected tokens,
a path's expected tokens following its own acceptance per depth ``c_j``, the chance that its ``j``-th token is
accepted given the ones before (per row, shrunk towards the call's pooled estimate and that towards the last call's),
a row committing the longer of the drafter's and the path's expectation (an underestimate: where one source's path
is refuted the other's may go on, so paths join a drafted step where some rows copy and others need the drafter, and
replace the drafter where copying alone pays). Per depth and not one geometric rate, because copied paths are
bimodal: the context either repeats here, and the path holds to its end, or it does not, and its first token fails;
one rate fitted to both over-predicts exactly the first tokens that decide whether a short path pays. ``c_j`` is
observed at no cost whether the path was verified or not: each row's path is compared with the tokens the row then
commits, over as many steps as it takes, until the first disagreement (the target's own tokens: under greedy decoding
what verifying it would accept; under sampling, a deterministic path's token is accepted exactly when the target
samples it, so this is speculative sampling's acceptance too), so a call whose paths stopped paying goes on measuring
them. A step whose drafter is not worth its draft (a plain step, or a long and reliable path) verifies the
path alone without running the drafter, at the measured cost of such undrafted widths (`CostTable.undrafted_s`).
A width is priced by the target's forward that width costs at its row count, from every step measured (plain,
undrafted, drafted less its draft: `CostTable.path_costs`), and the draft where the drafter runs; one token beyond the
widest measured costs at least the widest's cost (a lower bound: it wins and runs once, which measures it, and is then
priced by what it cost), wider still in proportion to width (an upper bound), so the paths' widths are explored one
token at a time: at batch 8 and 32 each token a row verifies costs most of a plain step, and one row's long path
would otherwise make every row verify a wide step priced as a narrow one.
Probes stay pure (no paths), so that they time the draft alone.

The planner only chooses how many drafts are verified; acceptance is the usual rule, so outputs stay exact. It is
the loop's `length_policy.StepPlan` for ``length_policy="planned"``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .length_policy import LengthPolicy, PolicyPlan, StepPlan

EMA = 0.3  # weight of a new value in the moving averages (draft and probe costs, the head's calibration)
# Drafting's rate moves slower: one drafted step's speedup ranges over 0.7-2x where the mean is 1.2 (shell at batch 1),
# and a call stops drafting right after its losing steps, which a fast average would make the next call's prior.
DRAFTED_EMA = 0.1
COST_WINDOW = 5  # a step cost is the median of this many latest steps of its rows and width
PLAIN_SAMPLES = 3  # timed plain steps before their cost is compared with anything (`CostTable.plain_known`)
PRIOR_ACCEPTANCE = 0.5  # per-draft acceptance assumed before anything was observed
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the pooled estimate when a row's own are few
FIRST_PROBE_INTERVAL = 4
# The first real drafted step after a probe (with no drafted width measured yet) verifies one draft per row: it
# measures the cheapest drafted width, from which wider ones are explored one at a time (`width`).
PROBE_WIDTH = 2
MAX_PROBE_INTERVAL = 256
# The most that probes may add to the time of plain steps: a probe is one draft, whose cost relative to a plain step
# grows with the batch (BENCHMARKS.md section 17), so the plain steps between probes are at least the draft's cost
# over this share of a plain step's. A drafter that never agrees costs its probes at this share exactly (the budget,
# not the back-off, sets their pace in calls of a few dozen tokens: BENCHMARKS.md section 40), beside the loop's own
# work; at 1% such a drafter cost 1.1% at batch 1 pooled, and half of it changed no drafted cell of the shipped
# drafter beyond its interval (section 41).
PROBE_BUDGET = 0.005
CALL_PROBE_INTERVAL = 16  # the longest back-off a new call starts from
# With a length head, how many drafted steps the pair's earlier calls' rate counts as beside a call's own
# (`_draft_or_plain`): half of a call's drafted steps on code accept nothing, and a call that judged drafting on its
# first one or two alone stopped where drafting paid (BENCHMARKS.md section 26).
RATE_PRIOR_STEPS = 2.0
RATE_PRIOR_CAP = 1.5
# With a length head (`_draft_or_plain`): a call drafts from its first step where the pair's rate says drafting pays
# (`START_ON_RATE`: an answer's first steps are where code's and shell's drafts are accepted most), else it steps
# plainly with probes at the pace counted across calls; a probe's block is one more sample of the pair's rate, not of
# the call's (`PROBE_SAMPLES`, `_observe_shadow_rate`: a pair whose probes never start drafting still learns its
# rate); and a call that is drafting goes on while an upper bound of its rate, `DRAFTING_BOUND_Z` standard errors of
# its steps' speedups above their mean, beats plain steps (one drafted step's speedup ranges over 0.4-3x on code and
# shell where the mean is about 1.1; before a call has seen enough of its own, the spread is `SPREAD_PRIOR`, shell's
# measured standard deviation, counted as `SPREAD_PRIOR_STEPS` samples). Chosen by A/B against the rule without them
# on two machines, the domains in both orders (BENCHMARKS.md sections 28 and 29); `adaflash_demo.bench.rate_prior`
# switches them off for that rule.
DRAFTING_BOUND_Z = 1.0
SPREAD_PRIOR = 0.5
SPREAD_PRIOR_STEPS = 2.0
PROBE_SAMPLES = True
START_ON_RATE = True
# At batch > 1, a step's choices are valued by how much sooner the call's batch finishes (`finish_rates`: a
# `generate()` batch ends with its last row) rather than by all rows' tokens alike (a server's view, which made the
# hybrid's copied paths lose 9% on changelog at batch 8: BENCHMARKS.md section 31);
# `adaflash_demo.bench.batch_objective` switches it off for its A/B.
FINISH_TIME = True
# At batch > 1, a call's probes before its first real draft draft one row (`VerificationPlanner.plan`);
# `adaflash_demo.bench.batch_objective --switch SAMPLE_PROBES` switches it off for its A/B.
SAMPLE_PROBES = True
# A row that such a probe drafted is one observation of the acceptance of the rows no probe drafted, beside the other
# rows this call's probes drafted and `ROW_PRIOR_WEIGHT` rows at the call's pooled estimate (`shadow_gain`): counted
# as its drafts' number of observations, one math row's matched block stood for 31 rows of other content at batch 32
# and promoted drafted steps the batch did not repay (BENCHMARKS.md section 33; the A/B: section 34).
# `batch_objective --switch ROW_EVIDENCE` switches it off for its A/B.
ROW_EVIDENCE = True
ROW_PRIOR_WEIGHT = 2.0
# A probe of several rows prices each row by its expected tokens scaled down to what the blocks matched in all
# (`shadow_gain`), not by the fewer of its own block's and its expected ones: a batch finishes with its slowest row,
# and with each row's one block as its rate, the one block of eight that happened to match nothing priced the whole
# batch at one token a step, so that such probes promoted nothing at batch 8, math included.
# `batch_objective --switch BLOCK_TOTALS` switches it off for its A/B.
BLOCK_TOTALS = True
# Merged paths' acceptance is modelled per depth up to this one; deeper tokens share its estimate (paths that reach it
# are copies in progress, whose later tokens are accepted alike).
PATH_DEPTHS = 8


def match_committed(proposal: list[int], matched: int, committed: list[int]) -> tuple[int, bool]:
    """Scores a proposal (a probe's block, a merged n-gram path) against tokens a row just committed, its first
    ``matched`` tokens already matched in earlier steps: returns ``(matched, refuted)``, ``refuted`` when a committed
    token disagreed before the proposal's end (under greedy decoding, where verifying it would have stopped)."""
    for token in committed:
        if matched == len(proposal):
            break
        if token != proposal[matched]:
            return matched, True
        matched += 1
    return matched, False


@dataclass
class CostTable:
    """Measured seconds per loop step, by active rows and verify width; shared by the calls of one pair."""

    step_s: dict[tuple[int, int], float] = field(default_factory=dict)
    acceptance: float = PRIOR_ACCEPTANCE  # pooled per-draft acceptance of the last call
    probe_interval: int = FIRST_PROBE_INTERVAL
    # rows -> committed tokens per second of drafted steps (and, with `PROBE_SAMPLES`, of probes' blocks at the head's
    # width: `VerificationPlanner._observe_shadow_rate`) over a plain step's (rows / S(rows, 1)), moving average by
    # `DRAFTED_EMA`
    drafted_speedup: dict[int, float] = field(default_factory=dict)
    head_scale: float = 1.0  # calibration of the length head's predicted accepted drafts
    # rows -> seconds the draft of a drafted step takes (moving average): what drafting adds to a step's forward
    draft_s: dict[int, float] = field(default_factory=dict)
    # rows -> seconds a shadow probe adds to a plain step (moving average): its draft, and the drafter reading all
    # the context queued since the last draft (at a call's first probe, the prompt: several times a step's draft)
    probe_s: dict[int, float] = field(default_factory=dict)
    idle_steps: int = 0  # plain steps since the last probe or drafted step, across calls (`VerificationPlanner.width`)
    # (rows, width) -> seconds of a step that verified merged n-gram paths without running the drafter
    undrafted_s: dict[tuple[int, int], float] = field(default_factory=dict)
    # the last call's pooled acceptance of a merged n-gram path's j-th token given the ones before, per depth
    path_acceptance: list[float] = field(default_factory=lambda: [PRIOR_ACCEPTANCE] * PATH_DEPTHS)

    # (cost, key) -> the latest timed seconds of a step cost (`_record`); a cost without any came from a profile file
    _windows: dict[tuple[str, tuple[int, int]], deque] = field(default_factory=dict, repr=False, compare=False)
    # the costs priced by a kernel trial's step only (`_record`), replaced by the first timed step of their key
    _provisional: set[tuple[str, tuple[int, int]]] = field(default_factory=set, repr=False, compare=False)
    # the row counts whose probe cost untimed probes alone priced (`observe_probe`)
    _untimed_probes: set[int] = field(default_factory=set, repr=False, compare=False)

    def _record(self, name: str, key: tuple[int, int], seconds: float, provisional: bool) -> None:
        """Adds a step's ``seconds`` to the cost ``getattr(self, name)[key]``: the median of the latest
        `COST_WINDOW` (a cost loaded from a profile file counts as one of them). A ``provisional`` step (its forward
        timed one of the candidate kernels, `verify_layout.py`, maybe the slow one) prices only a key nothing else
        prices, by the fastest such step (the kernel kept will be the fastest), until the first timed step of the key
        replaces it."""
        costs, tag = getattr(self, name), (name, key)
        if provisional:
            if key not in costs or tag in self._provisional:
                costs[key] = seconds if key not in costs else min(costs[key], seconds)
                self._provisional.add(tag)
            return
        window = self._windows.get(tag)
        if window is None or tag in self._provisional:
            loaded = key in costs and tag not in self._provisional
            window = self._windows[tag] = deque([costs[key]] if loaded else [], maxlen=COST_WINDOW)
            self._provisional.discard(tag)
        window.append(seconds)
        costs[key] = statistics.median(window)

    def observe_undrafted(self, rows: int, width: int, seconds: float, provisional: bool = False) -> None:
        self._record("undrafted_s", (rows, width), seconds, provisional)

    def path_costs(self, rows: int, widths, drafted: bool) -> list[float | None]:
        """Seconds of a step of each of ``widths`` tokens whose tree holds merged paths
        (`VerificationPlanner.plan_paths`): the target's forward at ``(rows, width)`` (`forward_costs`, priced by
        `_estimate` in plain steps of ``rows``), plus the draft for a ``drafted`` one. Beyond the widest width
        measured, one token wider costs at least the widest's cost (a lower bound, so the next width is tried once
        and then priced by what it cost), and wider still in proportion to width (an upper bound: a forward's cost
        grows sublinearly with its tokens): paths are as long as the context offers, and a step of 11 tokens a row
        priced at the widest measured step's cost would be tried at once, at batch 8 four plain steps' cost
        (BENCHMARKS.md section 21). ``None`` before any step. The widths of one step are priced together: the
        table's curves are built once (the planner prices every path length each step)."""
        curves = _curves(self.forward_costs())
        draft = (self.draft(rows) or 0.0) if drafted else 0.0
        priced = []
        for width in widths:
            forward = _estimate(curves, rows, width, _beyond_widest(width), self.plain_cost)
            priced.append(None if forward is None else forward + draft)
        return priced

    def forward_costs(self) -> dict[tuple[int, int], float]:
        """Seconds of the target's forward alone, by ``(rows, width)``, from every step measured: plain steps,
        steps that verified paths without drafting, and drafted steps less their draft where no undrafted step of
        that key was measured (the forward of a drafted step is the forward an undrafted one of its width runs)."""
        points = {}
        for (rows, width), seconds in self.step_s.items():
            less = self.plain_cost(rows) if width == 1 else max(seconds - (self.draft(rows) or 0.0), 0.0)
            points[(rows, width)] = less
        points.update(self.undrafted_s)
        return points

    @staticmethod
    def _nearest(costs: dict[int, float], rows: int) -> float | None:
        """``costs[rows]``, or the nearest measured row count's; ``None`` when empty."""
        if not costs:
            return None
        return costs[_nearest_rows(costs, rows)]

    def observe_draft(self, rows: int, seconds: float) -> None:
        _moving(self.draft_s, rows, seconds)

    def observe_probe(self, rows: int, seconds: float, provisional: bool = False) -> None:
        """Moves a probe's cost at ``rows`` towards ``seconds``. A ``provisional`` probe (it timed the draft head's
        dtypes, whose slow candidate can cost a plain step, or ran beside a kernel trial) prices ``rows`` only until
        the first timed probe replaces it: averaged in, such a probe kept probes priced at 1.6 plain steps for a
        whole process, five times their cost, so that the budget allowed one probe in 160 plain steps and the first
        drafted steps were priced as dear (BENCHMARKS.md section 30)."""
        if provisional:
            if rows not in self.probe_s or rows in self._untimed_probes:
                self.probe_s[rows] = min(self.probe_s.get(rows, seconds), seconds)
                self._untimed_probes.add(rows)
            return
        if rows in self._untimed_probes:
            self._untimed_probes.discard(rows)
            del self.probe_s[rows]
        _moving(self.probe_s, rows, seconds)

    def settled_probes(self) -> dict[int, float]:
        """The probe costs that timed probes measured (what a profile file keeps)."""
        return {rows: s for rows, s in self.probe_s.items() if rows not in self._untimed_probes}

    def draft(self, rows: int) -> float | None:
        """Seconds a drafted step's draft takes at ``rows`` rows (or the nearest measured count); before a drafted
        step, what a probe added (an upper bound: it read the queued context too); ``None`` before either."""
        draft = self._nearest(self.draft_s, rows)
        return self._nearest(self.probe_s, rows) if draft is None else draft

    def probe(self, rows: int, settled: bool = False) -> float | None:
        """Seconds a probe adds to a plain step at ``rows`` rows (or the nearest measured count; ``settled``: timed
        probes only, not those that timed one-off trials); before a probe, a drafted step's draft (a lower bound);
        ``None`` before either."""
        probe = self._nearest(self.settled_probes() if settled else self.probe_s, rows)
        return self._nearest(self.draft_s, rows) if probe is None else probe

    def drafted_cost(self, rows: int, width: int) -> float | None:
        """Seconds of a drafted step of ``width`` at ``rows``: its price (`cost`), or, before any drafted width
        can price it, the cheapest a drafted step can cost (a plain step plus the draft); ``None`` before either is
        known."""
        cost = self.cost(rows, width)
        if cost is not None:
            return cost
        plain, draft = self.cost(rows, 1), self.draft(rows)
        return None if plain is None or draft is None else plain + draft

    def observe_drafted(self, rows: int, tokens: float, seconds: float) -> float | None:
        """Moves drafting's speedup at ``rows`` towards this drafted step's; returns the step's (``None`` before a
        plain step's cost is known)."""
        plain = self.cost(rows, 1)
        if plain is None:
            return None
        speedup = (tokens / max(seconds, 1e-9)) / (rows / plain)
        _moving(self.drafted_speedup, rows, speedup, DRAFTED_EMA)
        return speedup

    def drafting_speedup(self, rows: int) -> float | None:
        """How much faster than plain steps drafted steps have committed tokens, at ``rows`` rows (or the nearest
        measured count); ``None`` before any drafted step."""
        return self._nearest(self.drafted_speedup, rows)

    def observe(self, rows: int, width: int, seconds: float, provisional: bool = False) -> None:
        """Adds a step of ``rows`` rows verifying ``width`` tokens to its cost (`_record`). When a plain step's cost
        moves, the wider steps' costs at its row count move in proportion (`_follow_plain`)."""
        key = (rows, width)
        before = self.step_s.get(key) if width == 1 and ("step_s", key) not in self._provisional else None
        self._record("step_s", key, seconds, provisional)
        if before and not provisional and self.step_s[key] != before:
            self._follow_plain(rows, self.step_s[key] / before)

    def _follow_plain(self, rows: int, factor: float) -> None:
        """Scales the drafted and undrafted costs at ``rows`` rows, and the steps behind them, by ``factor``: a wider
        step costs as many plain steps as when it was measured. A step's seconds follow the context's length (a
        call on long passages steps slower than one on short questions) and the machine's moment (a neighbour's
        burst on a shared core), and a plain step is measured every few steps while a wider width may not be
        measured again for many calls; priced in the seconds of its last measurement, a wider step would look cheap
        beside a plain step of a longer context, or dear beside one of a shorter. In plain steps, the choice between
        them depends on what was measured of their ratio, not on when each was last measured."""
        for name in ("step_s", "undrafted_s"):
            costs = getattr(self, name)
            for key in [key for key in costs if key[0] == rows and key[1] > 1]:
                costs[key] *= factor
                window = self._windows.get((name, key))
                if window is not None:
                    self._windows[(name, key)] = deque((s * factor for s in window), maxlen=COST_WINDOW)

    def plain_known(self) -> bool:
        """Whether plain steps' costs can be compared with others: `PLAIN_SAMPLES` plain steps timed in this process
        (at any row counts: rows leave a batch one by one, and each count measured anew would keep a batch that
        drafts well stepping plainly), or a cost loaded from a profile file."""
        timed = 0
        for rows, width in self.step_s:
            tag = ("step_s", (rows, width))
            if width == 1 and tag not in self._provisional:
                window = self._windows.get(tag)
                if window is None:
                    return True
                timed += len(window)
        return timed >= PLAIN_SAMPLES

    def measured(self, width: int) -> bool:
        """Whether a step of this width was measured at any row count."""
        return any(w == width for _, w in self.step_s)

    def cost(self, rows: int, width: int) -> float | None:
        """Seconds of a step of ``rows`` rows at ``width``: a plain step's (``width == 1``, `plain_cost`), or a drafted
        step's from the drafted steps measured (`_estimate`, which prices a row count without them in plain steps of
        its own); ``None`` when none of that kind was measured. Beyond the widest measured width as `_beyond_widest`
        prices it: the next width at the widest's cost, so it runs once where drafting pays and is then priced by what
        it cost. An upper bound alone would lock drafting out wherever the widest measured step was dear: a profile
        whose one drafted width, 2 tokens, cost two plain steps (the draft, and a BLAS whose products of a few rows are
        slow) prices 16 tokens at 16 plain steps, so no probe, however well its block matched, would start drafting,
        and no wider width would ever be measured (BENCHMARKS.md section 23)."""
        return self.costs(rows, [width])[0]

    def costs(self, rows: int, widths) -> list[float | None]:
        """`cost` of each of ``widths`` at ``rows``, the table's curves built once (the planner prices every width
        of a block each drafted step)."""
        curves = _curves(self._drafted_prices()) if any(width > 1 for width in widths) else {}
        return [
            self.plain_cost(rows)
            if width == 1
            else _estimate(curves, rows, width, _beyond_widest(width), self.plain_cost)
            for width in widths
        ]

    def _drafted_prices(self) -> dict[tuple[int, int], float]:
        """The drafted steps' costs `cost` prices from. A kernel trial's price (`_record`'s provisional) is an upper
        bound of what the width will cost once its kernel is chosen, and a width priced too dear is not chosen again,
        so its trials never end: the first trial of width 2 at two plain steps (the slow candidate) kept a new
        process from drafting on shell for good (BENCHMARKS.md section 30). So a trial's price is at most what the
        widths of its row count timed with their kernels kept imply (between two of them, the line between; beyond
        the widest, its cost in proportion to width: an upper bound), and a row count with trials only prices its
        narrowest at most a plain step plus the draft (the cheapest a drafted step can cost), where exploring starts
        again. Not lower: a width priced by the lower bound would win and run again and again until its trials end,
        several slow candidate kernels each, width after width."""
        drafted = {key: s for key, s in self.step_s.items() if key[1] > 1}
        trials = {key for key in drafted if ("step_s", key) in self._provisional}
        timed = _curves({key: s for key, s in drafted.items() if key not in trials})
        prices = dict(drafted)
        for rows, width in trials:
            if rows in timed:
                bound = _interpolate(timed[rows], width, _in_proportion(width))
                prices[(rows, width)] = min(prices[(rows, width)], bound)
        for rows in {rows for rows, _ in trials} - set(timed):
            narrowest = min(width for count, width in prices if count == rows)
            plain, draft = self.plain_cost(rows), self.draft(rows)
            if plain is not None and draft is not None:
                prices[(rows, narrowest)] = min(prices[(rows, narrowest)], plain + draft)
        return prices

    def plain_cost(self, rows: int) -> float | None:
        """Seconds of a plain step of ``rows`` rows: its measured cost, or the nearest measured row count's; at most
        what a plain step of more rows costs: fewer rows never cost more, while a row count that rows reach as they
        finish is priced from its first step or two, and a plain step priced too dear makes every wider step look
        good (BENCHMARKS.md section 21). ``None`` before any."""
        return self.plain_costs([rows])[0]

    def plain_costs(self, counts) -> list[float | None]:
        """`plain_cost` at each of ``counts`` rows, the table read once (the planner prices every row count of a
        batch each step: `VerificationPlanner.rates`)."""
        plain = {count: seconds for (count, width), seconds in self.step_s.items() if width == 1}
        if not plain:
            return [None] * len(counts)
        return [
            min([plain[_nearest_rows(plain, rows)], *(s for count, s in plain.items() if count > rows)])
            for rows in counts
        ]


def _add_depths(counts: torch.Tensor, tokens: int) -> None:
    """Counts a path's first ``tokens`` tokens into ``counts [PATH_DEPTHS]``, one at each depth (the last depth holds
    all the deeper ones)."""
    if tokens > 0:
        counts[: min(tokens, PATH_DEPTHS)] += 1.0
    if tokens > PATH_DEPTHS:
        counts[-1] += tokens - PATH_DEPTHS


def _summed(rows: list[list[float]]) -> list[float]:
    """Per column, the sum over ``rows`` (every row's path observations at each depth)."""
    return [sum(column) for column in zip(*rows)]


def batch_steps(steps: torch.Tensor, shrink: torch.Tensor) -> torch.Tensor:
    """How many steps of all ``R`` rows a batch's steps cost in all when row ``b`` leaves after ``steps [R, ...]``
    of them (one column per alternative): in the order the rows leave, the span of steps before the ``i``-th leaves
    runs at ``R - i`` rows, each step of it costing ``shrink[R - i - 1]`` of a step of all rows (``shrink [R]``: a
    step's cost at ``1 .. R`` rows over its cost at ``R``)."""
    ordered = steps.sort(0).values
    spans = torch.diff(ordered, dim=0, prepend=torch.zeros_like(ordered[:1]))
    weights = shrink.flip(0).view(-1, *[1] * (steps.dim() - 1))
    return (spans * weights).sum(0)


def finish_rates(
    committed: torch.Tensor, costs: list[float | None], remaining: torch.Tensor, shrink: torch.Tensor
) -> list[float | None]:
    """The rate of each of ``C`` step choices for a batch that ends with its last row (a ``generate()`` call):
    ``remaining.sum() / T``, where ``T`` is the seconds the batch would take to finish were every later step that
    choice; ``None`` where the choice has no cost.

    committed ``[R, C]``: the tokens each row is expected to commit in one step of each choice; costs ``[C]``: the
    seconds of such a step at ``R`` rows; remaining ``[R]``: the tokens each row may still commit (its budget);
    shrink ``[R]``: a plain step's cost at ``1 .. R`` rows over its cost at ``R`` (rows that finish leave the batch,
    and the steps after them cost that much less). Row ``b`` finishes after ``remaining[b] / committed[b, c]`` steps
    (`batch_steps`). At one row, and wherever the rows commit and may commit alike, this is
    ``sum_b committed[b, c] / costs[c]``, the rate at which a server that replaces finished rows serves tokens; where
    some rows commit more (a copied path, a row whose drafts are accepted), their tokens are worth what their earlier
    finish saves, the steps of the rest at fewer rows."""
    known = [c for c, cost in enumerate(costs) if cost is not None]
    rates: list[float | None] = [None] * len(costs)
    if not known:
        return rates
    steps = batch_steps(remaining[:, None] / committed[:, known], shrink)
    seconds = torch.tensor([costs[c] for c in known], dtype=torch.float64) * steps
    total = float(remaining.sum())
    for c, spent in zip(known, seconds.tolist()):
        rates[c] = total / spent
    return rates


def _beyond_widest(width: int):
    """How `_estimate` prices ``width`` beyond the widest measured width: one token wider at the widest's cost (a
    lower bound: a forward's cost never falls as it widens, so the next width wins where drafting pays, runs once and
    is measured), wider still in proportion to width (an upper bound: a forward's cost grows sublinearly with its
    tokens). Widths are thus explored one token at a time, and a wide step is never priced as a narrow one (at batch 8
    and 32 each token a row verifies costs most of a plain step)."""

    def beyond(widest: int, seconds: float) -> float:
        return seconds if width == widest + 1 else _in_proportion(width)(widest, seconds)

    return beyond


def _in_proportion(width: int):
    """An upper bound of ``width``'s cost beyond the widest measured width: the widest's cost in proportion to width
    (a forward's cost grows sublinearly with its tokens)."""

    def beyond(widest: int, seconds: float) -> float:
        return seconds * width / widest

    return beyond


def _nearest_rows(counts, rows: int) -> int:
    """The measured row count (of non-empty ``counts``) nearest to ``rows``, the smaller one on a tie."""
    return min(counts, key=lambda r: (abs(r - rows), r))


def _moving(averages: dict[int, float], rows: int, value: float, weight: float = EMA) -> None:
    """Moves ``averages[rows]`` towards ``value`` by ``weight`` (sets it, the first time)."""
    old = averages.get(rows)
    averages[rows] = value if old is None else (1 - weight) * old + weight * value


def _curves(costs: dict) -> dict[int, dict[int, float]]:
    """Measured ``costs`` (``{(rows, width): seconds}``) as ``{rows: {width: seconds}}``, widths ascending, each
    drafted width (2 and more) at most what a wider one of its row count costs: fewer tokens never cost more to verify
    (the verification could pad them), while a price set too high by one slow step is never corrected, since a width
    priced too dear is not chosen and so not measured again (a width-3 step that cost 2.4 plain steps kept shell's
    drafted steps at width 2 for whole calls, beside width 4 at 1.6: BENCHMARKS.md section 30). A price too low
    corrects itself: its width wins, runs, and is measured."""
    curves: dict[int, dict[int, float]] = {}
    for (rows, width), seconds in sorted(costs.items()):
        curves.setdefault(rows, {})[width] = seconds
    for curve in curves.values():
        cheapest = math.inf
        for width in sorted(curve, reverse=True):
            if width > 1:
                cheapest = curve[width] = min(curve[width], cheapest)
    return curves


def _estimate(curves: dict, rows: int, width: int, beyond, plain) -> float | None:
    """A step's seconds at ``(rows, width)`` from measured costs (`_curves`); ``None`` when there are none. Within a
    row count the cost is linear between two measured widths, below the narrowest the narrowest's, and beyond the
    widest ``beyond(widest, its seconds)`` (the caller's bound). A row count whose measured widths do not reach
    ``width`` borrows the nearest row count's that do (rows leave a batch one by one as they finish; measuring each
    count anew would cost more than the estimate's error), or, where none does and it has no measurement of its own,
    the nearest row count's bound; a borrowed cost is taken *in plain steps* of its own row count (``plain(rows)``:
    a step of width ``w`` at 8 rows costs about as many plain steps of 8 rows as one at 1 row costs plain steps of 1
    row, more where the wider forward is arithmetic-bound, while in seconds it costs several times more:
    BENCHMARKS.md section 20), and at least the widest step its own row count measured."""
    own = curves.get(rows)
    if own is not None and (width in own or max(own) >= width):
        return own[width] if width in own else _interpolate(own, width, beyond)
    others = {count: curve for count, curve in curves.items() if count != rows}
    reaching = [count for count, curve in others.items() if max(curve) >= width]
    if not reaching and own is not None:
        return _interpolate(own, width, beyond)
    if not others:
        return None
    near = _nearest_rows(reaching or others, rows)
    borrowed = _interpolate(others[near], width, beyond)
    plain_rows, plain_near = plain(rows), plain(near)
    if plain_rows is not None and plain_near:
        borrowed *= plain_rows / plain_near
    return borrowed if own is None else max(borrowed, own[max(own)])


def _interpolate(curve: dict[int, float], x: int, beyond) -> float:
    """``curve`` (non-empty, sorted by key) at ``x``: linear between its keys, below the smallest the smallest's
    value, beyond the largest ``beyond(largest, its value)``."""
    if x in curve:
        return curve[x]
    below, above = [k for k in curve if k < x], [k for k in curve if k > x]
    if below and above:
        k0, k1 = below[-1], above[0]
        return curve[k0] + (curve[k1] - curve[k0]) * (x - k0) / (k1 - k0)
    if below:
        return beyond(below[-1], curve[below[-1]])
    return curve[above[0]]


class VerificationPlanner:
    """Chooses each step's verify width for one generate() call (see the module docstring).

    Args:
        table (`CostTable`): the pair's measured costs (`profile.RuntimeProfile.cost_table`).
        block_size (`int`): the drafter's block; widths lie in ``[1, block_size]``.
        batch_size (`int`): rows of the call.
        device (`torch.device`): timings synchronise CUDA devices before they read the clock.
        length_head (`bool`): the drafter has a length head: draft-or-plain by the measured rate of drafted steps,
            and the width after drafting from the head's predictions (`refine`).
        lock (*optional*): held while the shared table is updated (the profile's).
        probe_first (`bool`): start with a probe (within the budget, `_first_probe_due`), as the content of a new call
            is unknown (the last call's acceptance says little about new prompts); ``False`` decides from the
            table's prior at once.
    """

    def __init__(
        self,
        table: CostTable,
        block_size: int,
        batch_size: int,
        device: torch.device,
        length_head: bool = False,
        lock=None,
        probe_first: bool = True,
    ):
        self.table = table
        self._lock = contextlib.nullcontext() if lock is None else lock
        self.block_size = block_size
        self.length_head = length_head
        self._expected_accepted: torch.Tensor | None = None  # per row of the refined step, for the head's calibration
        self._head_choice: tuple | None = None  # this step's width from the head, before projection (`projected`)
        self.successes = torch.zeros(batch_size, dtype=torch.float64)
        # tokens each row may still commit (its budget), as of its last step (`before_draft`; until then alike, and
        # more than any step commits)
        self._remaining = torch.full((batch_size,), float(2**20), dtype=torch.float64)
        self.trials = torch.zeros(batch_size, dtype=torch.float64)
        self.plain_streak = 0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._started: float | None = None
        self._drafted_at: float | None = None  # when this step's draft ended (`after_draft`); None: no draft ran
        self._probing = False
        self._untimed = False
        self._read_prompts = False
        self._trial = False
        self._shadow_now = False  # this step is a probe: the drafter drafts, the target verifies the anchor only
        self._shadow_drafted = False  # and the drafter did draft (no row's budget left room: a plain step)
        self._shadow_width: int | None = None  # with a length head, the width the head chose for the probe's block
        self._shadow_rows: list[int] = []  # the rows active at the pending probe, whether it drafted them or not
        self._sampled = False  # this step is a probe of one row (`plan`)
        # this call's drafter has read its context (a real draft, or a probe of every row): until then a probe at
        # batch > 1 drafts one row (`plan`), which reads that row's context alone
        self._read = False
        # row -> [its probe's drafts, drafts matched so far, resolved, refuted (a committed token disagreed)]
        self._shadows: dict[int, list] = {}
        # row -> its acceptance as the last probe that drafted it alone estimated it (`ROW_EVIDENCE`)
        self._probed_rows: dict[int, float] = {}
        self._promoted = False  # a probe showed drafting may pay: the next step drafts for real
        self._probes = 0  # probes this call
        # row count -> [committed tokens, seconds, steps] of this call's drafted steps (`_draft_or_plain`), and the
        # earlier calls' drafting speedups, taken before this call's own steps move them
        self._drafted: dict[int, list[float]] = {}
        self._earlier_speedup = dict(table.drafted_speedup)
        self._drafting = False  # the last step was a drafted one
        # whether this call has scored a probe or verified drafts: until then its content is unknown (the last call's
        # acceptance says little about a new prompt), so it starts with a probe instead of drafting on that prior
        self._evidence = not probe_first
        # with a length head, draft on the pair's rate from the first step (`_draft_or_plain`, `START_ON_RATE`), probes
        # still coming at the pace counted across calls (`_first_probe_due`) while it says drafting loses
        self._prior_rate = not probe_first or (START_ON_RATE and length_head)
        self.last_prediction: dict | None = None
        # merged n-gram paths (`plan_paths`): their tokens in this step's tree per row, whether the drafter runs, and
        # each row's observed acceptance of path tokens
        self._path_nodes, self._undrafted = 0, False
        # [row, depth - 1]: accepted and scored path tokens at each depth (`score_paths`)
        self.path_successes = torch.zeros(batch_size, PATH_DEPTHS, dtype=torch.float64)
        self.path_trials = torch.zeros(batch_size, PATH_DEPTHS, dtype=torch.float64)
        self._path_prior = list(table.path_acceptance)  # this call's prior
        self._path_shadows: dict[int, list] = {}  # row -> [its path being scored, tokens matched so far]
        # A new call's prompts may draft well where the last call's did not: with `probe_first` it probes first
        # (within the budget), and the back-off the last call reached is kept up to `CALL_PROBE_INTERVAL`, so that
        # one unlucky first probe does not leave a call that drafts well plain to its end, while a never-agreeing
        # drafter costs a few drafts a call. Without it, the back-off starts again. The costs are the machine's: kept.
        table.probe_interval = min(table.probe_interval, CALL_PROBE_INTERVAL) if probe_first else FIRST_PROBE_INTERVAL

    # ------------------------------------------------------------------ the loop's StepPlan

    def before_draft(
        self, rows: list[int], room: torch.LongTensor, paths: list[list[int]] | None = None
    ) -> torch.LongTensor:
        self.begin()
        if len(rows) > 1:  # only `rates` of several rows read them
            self._remaining[rows] = room.detach().to("cpu", torch.float64) + 1
        drafts = self.plan(rows, room)
        self._path_nodes, self._undrafted = 0, False
        if paths is not None:
            for row, path in zip(rows, paths):
                if path and row not in self._path_shadows:
                    self._path_shadows[row] = [path, 0]
            if any(paths):
                drafts = self.plan_paths(rows, [len(path) for path in paths], drafts)
        return drafts

    def path_nodes(self, cap: int) -> int:
        return min(cap, self._path_nodes)

    def projected(
        self, rows: list[int], length_prediction: torch.Tensor | None, max_drafts: torch.LongTensor
    ) -> torch.LongTensor:
        """With a length head, the width is chosen from the head's predictions (`refine`) before the drafts are
        projected, and only the drafts it verifies are: the head over the vocabulary costs a few milliseconds for a
        whole block at batch 1, a sizeable part of a draft, while the width is 2-4 on most steps."""
        if not self.length_head or length_prediction is None:
            return max_drafts
        self._head_choice = self._head_width(rows, length_prediction, max_drafts)
        return torch.clamp(max_drafts, max=self._head_choice[0] - 1)

    def after_draft(self, rows: list[int], drafts) -> torch.LongTensor:
        self._sync()
        self._drafted_at = time.perf_counter()
        if self._shadow_now:  # a probe: keep the drafts to score, verify none
            self._shadow_drafted = True
            # a probe of every row read their context into the call's drafter; one of a sample scores its rows
            self._read = self._read or not self._sampled
            asked = drafts.num_drafts.gt(0).cpu() if self._sampled else torch.ones(len(rows), dtype=torch.bool)
            self._shadow_rows = list(rows)
            for slot, row in enumerate(rows):
                if asked[slot]:
                    block = drafts.tokens[slot, : int(drafts.num_drafts[slot])].tolist()
                    self._shadows[row] = [block, 0, False, False]
            self._shadow_width = None
            if PROBE_SAMPLES and self.length_head and drafts.length_prediction is not None and drafts.num_drafts.any():
                index = asked.nonzero().flatten()
                probed = [rows[i] for i in index.tolist()]
                prediction, offered = drafts.length_prediction[index], drafts.num_drafts[index]
                self._shadow_width = self._head_width(probed, prediction, offered, count=len(rows))[0]
            return torch.zeros_like(drafts.num_drafts)
        self._read = True
        if self.length_head and drafts.length_prediction is not None:
            choice, self._head_choice = self._head_choice, None
            return self.refine(rows, drafts.length_prediction, drafts.num_drafts, choice)
        return drafts.num_drafts

    def tree_shape(self, num_drafts, room, drafted: int, budget: int) -> tuple[torch.LongTensor, int]:
        """The planner's width (the tokens it found worth verifying, anchor included) is the tree's budget, within
        ``adaflash_tree_budget``, and a tree may reach as deep as the row's room and the drafted positions allow:
        the planner decides how many tokens a step verifies, the tree which ones, and a tree of ``w`` tokens commits
        at least what the linear ``w`` would in expectation (it holds the likeliest paths)."""
        budget = min(budget, int(num_drafts.max()) + 1 + self._path_nodes)  # merged paths: `plan_paths`
        return torch.where(num_drafts > 0, room.clamp(max=drafted), 0), budget

    def after_verify(self, rows: list[int], verified, emitted: torch.LongTensor) -> dict:
        accepted, offered = verified.accepted, verified.depth
        if verified.by_source is not None:  # the drafter's share of the step (the paths are scored apart)
            accepted, offered = verified.by_source["drafter"]
        committed = None
        if self._path_shadows or self._shadows:
            committed = [tokens[:n] for tokens, n in zip(verified.committed.tolist(), emitted.tolist())]
        return self._after(rows, verified.width, accepted.tolist(), offered.tolist(), committed)

    def after_plain(self, rows: list[int], committed: list[list[int]]) -> dict:
        zeros = [0] * len(rows)
        return self._after(rows, 1, zeros, zeros, committed)

    def _after(self, rows, width: int, accepted: list[int], offered: list[int], committed) -> dict:
        """The step's bookkeeping: merged paths and probes scored against the tokens each row ``committed``
        (per row of ``rows``), and the step observed (`observe`)."""
        if self._path_shadows:
            self.score_paths(rows, committed)
        step_s = self.observe(rows, width, accepted, offered)
        if self._shadows:
            self.score_shadows(rows, committed)
        return {"step_time_s": step_s, **(self.last_prediction or {})}

    # ------------------------------------------------------------------ choice

    def acceptance(self, rows: list[int]) -> torch.Tensor:
        """Per-row probability that a draft is accepted, ``[len(rows)]``."""
        pooled = (self.successes.sum() + PRIOR_WEIGHT * self.table.acceptance) / (self.trials.sum() + PRIOR_WEIGHT)
        index = torch.tensor(rows, dtype=torch.long)
        own_s, own_t = self.successes[index], self.trials[index]
        return ((own_s + PRIOR_WEIGHT * pooled) / (own_t + PRIOR_WEIGHT)).clamp(0.0, 0.999)

    def expected_committed(self, rows: list[int], max_width: int) -> torch.Tensor:
        """Expected tokens a step commits in each row at each width ``1 .. max_width``, ``[len(rows), max_width]``
        (column ``w - 1``: ``1 + p_b + ... + p_b^(w-1)``)."""
        powers = self.acceptance(rows)[:, None] ** torch.arange(max_width, dtype=torch.float64)
        return powers.cumsum(1)

    def rates(self, rows: list[int], committed: torch.Tensor, costs: list[float | None]) -> list[float | None]:
        """The rate of each step choice (`finish_rates`: ``committed [len(rows), C]``, ``costs [C]``) for this call's
        batch, whose rows' budgets `before_draft` saw last, each plain step's cost by row count from the table."""
        if len(rows) == 1 or not FINISH_TIME:  # one row: the summed rate, without the batch's arithmetic
            totals = committed.sum(0).tolist()
            return [None if cost is None else totals[c] / cost for c, cost in enumerate(costs)]
        return finish_rates(committed, costs, self._remaining[rows], self._shrink(len(rows)))

    def _shrink(self, count: int) -> torch.Tensor:
        """``[count]``: a plain step's cost at ``1 .. count`` rows over its cost at ``count`` (the table's; alike
        where it knows none)."""
        plain = self.table.plain_costs(range(1, count + 1))
        if not plain[-1]:
            return torch.ones(count, dtype=torch.float64)
        return (torch.tensor([plain[-1] if p is None else p for p in plain]) / plain[-1]).clamp(max=1.0)

    def plan(self, rows: list[int], max_drafts: torch.LongTensor) -> torch.LongTensor:
        """Drafts each active row verifies in the next step, ``[R]``, at most ``max_drafts [R]`` (a row's token
        budget); all zero = a plain step. A probe at batch > 1 before the call's drafter has read its context
        drafts one row, the rows taking turns: its block costs a draft of one row's context (a call's first draft of
        every row reads every prompt, at batch 8 more than a plain step: BENCHMARKS.md section 31), and its
        acceptance stands for the rows it did not draft (`shadow_gain`)."""
        width = self.width(rows, int(max_drafts.max()) + 1)
        drafts = torch.clamp(max_drafts, min=0, max=width - 1)
        self._sampled = False
        if SAMPLE_PROBES and self._shadow_now and len(rows) > 1 and not self._read:
            able = drafts.gt(0).nonzero().flatten()
            if able.numel():
                self._sampled = True
                chosen = able[(self._probes - 1) % able.numel()]
                drafts = torch.where(torch.arange(len(rows), device=drafts.device) == chosen, drafts, 0)
        return drafts

    def probing(self) -> bool:
        return self._shadow_now

    def width(self, rows: list[int], max_width: int) -> int:
        """The verify width of the next step for the active ``rows`` (at most ``max_width``); 1 = a plain step."""
        count, table = len(rows), self.table
        max_width = max(1, min(max_width, self.block_size))
        plain = table.cost(count, 1)
        self._probing, self._shadow_now, self._shadow_drafted, self.last_prediction = False, False, False, None
        if plain is None or max_width == 1 or not table.plain_known():
            return 1  # measure plain steps first: every other choice is compared with them
        full = None if self.length_head else table.cost(count, max_width)  # with a head, the rate decides
        unmeasured = (table.drafting_speedup(count) if self.length_head else full) is None
        if self._promoted:  # a probe's block would have paid: draft for real, and measure what it costs
            self._promoted, self._probing = False, True
            if self.length_head:
                return max_width
            width = min(max_width, PROBE_WIDTH) if full is None else self._best_width(rows, max_width)
            return width
        if unmeasured or not (self._evidence or self._prior_rate):
            width = 1  # no drafted cost, or nothing yet of this call's content: a probe first (below)
        elif self.length_head:
            width = self._draft_or_plain(count, max_width)
        else:
            width = self._best_width(rows, max_width)
        first = not self._evidence or (unmeasured and not self._probes)  # nothing known yet of this call
        due = self._first_probe_due(count) if first else self.plain_streak >= self.probe_interval(count)
        if width == 1 and not self._shadows and due:
            self._shadow_now = True  # a probe: the drafter drafts the block, the target verifies the anchor
            self._probes += 1
            self.plain_streak = table.idle_steps = 0
            return max_width
        return width

    def _first_probe_due(self, count: int) -> bool:
        """Whether a call that knows nothing yet of its own content probes now: at once where drafting paid lately
        at this row count, else once the plain steps since the last probe, counted across calls, keep probes
        within their budget (`probe_floor`). A call's first probe reads its whole prompt into the drafter, which at
        batch 8 costs more than a plain step: a probe at the start of every call would spend several percent of
        calls that never draft, while a call whose drafting pays is looked at at once."""
        speedup = self.table.drafting_speedup(count)
        return (speedup is not None and speedup >= 1.0) or self.table.idle_steps >= self.probe_floor(count)

    def probe_interval(self, count: int) -> int:
        """Plain steps before the next probe at ``count`` rows: the back-off (`CostTable.probe_interval`), and at
        least as many as keep the probes' drafts within `PROBE_BUDGET` of the plain steps' time."""
        return max(self.table.probe_interval, self.probe_floor(count))

    def probe_floor(self, count: int) -> int:
        """Plain steps per probe that keep the probes' cost within `PROBE_BUDGET` of the plain steps' time at
        ``count`` rows (0 before a probe's cost is known). Priced by timed probes: the first probes of a pair on a
        machine time the draft head's dtypes (`draft_head.py`), a one-off of a plain step or more each, kept in the
        profile once decided; priced by them, five such probes spread over 500 plain steps, and drafting where it
        pays waited several calls for them (BENCHMARKS.md section 30)."""
        plain, probe = self.table.cost(count, 1), self.table.probe(count, settled=True)
        if plain is None or probe is None:
            return 0
        return math.ceil(probe / (PROBE_BUDGET * plain))

    def score_paths(self, rows: list[int], committed: list[list[int]]) -> None:
        """Compares each row's pending path with the tokens it committed this step (``committed``, per row of
        ``rows``): a disagreement or the path's end observes its matched tokens (module docstring)."""
        present, resolved = dict(zip(rows, committed)), False
        for row in list(self._path_shadows):
            path, matched = self._path_shadows[row]
            if row not in present:  # the row finished
                del self._path_shadows[row]
                continue
            matched, failed = match_committed(path, matched, present[row])
            if failed or matched == len(path):
                # depths 1 .. matched accepted; the next one, where the path failed, scored and refused
                _add_depths(self.path_successes[row], matched)
                _add_depths(self.path_trials[row], matched + failed)
                del self._path_shadows[row]
                resolved = True
            else:
                self._path_shadows[row][1] = matched
        if not resolved:
            return
        successes, trials = (_summed(counts.tolist()) for counts in (self.path_successes, self.path_trials))
        if any(trials):
            self.table.path_acceptance = [
                s / t if t > 0 else p for s, t, p in zip(successes, trials, self._path_prior)
            ]

    def _path_conditional(self, rows: list[int]) -> list[list[float]]:
        """Per row of ``rows``, the probability that a merged path's ``j``-th token is accepted given the ones
        before, at each of `PATH_DEPTHS`: the row's observations at each depth shrunk towards the call's pooled
        ones, themselves shrunk towards the last call's. In Python floats: the planner prices paths on every step
        that has one, and the same arithmetic in small tensors took a few dozen operations, about 0.4 ms a step
        between two forwards of the target (BENCHMARKS.md section 43)."""
        every_s, every_t = self.path_successes.tolist(), self.path_trials.tolist()
        pooled = [
            (s + PRIOR_WEIGHT * p) / (t + PRIOR_WEIGHT)
            for s, t, p in zip(_summed(every_s), _summed(every_t), self._path_prior)
        ]
        own_s, own_t = [every_s[row] for row in rows], [every_t[row] for row in rows]
        return [
            [
                min(max((s + PRIOR_WEIGHT * q) / (t + PRIOR_WEIGHT), 0.0), 0.999)
                for s, t, q in zip(row_s, row_t, pooled)
            ]
            for row_s, row_t in zip(own_s, own_t)
        ]

    def _path_reach(self, rows: list[int], longest: int) -> list[list[float]]:
        reach = []
        for conditional in self._path_conditional(rows):
            row, through = [1.0], 1.0
            for depth in range(longest):
                through *= conditional[min(depth, PATH_DEPTHS - 1)]
                row.append(through)
            reach.append(row)
        return reach

    def path_reach(self, rows: list[int], longest: int) -> torch.Tensor:
        """``[len(rows), longest + 1]``: the probability that a row's path is accepted through its first ``k``
        tokens (``k = 0``: 1, the step's own token)."""
        return torch.tensor(self._path_reach(rows, longest), dtype=torch.float64)

    def plan_paths(self, rows: list[int], lengths: list[int], drafts: torch.LongTensor) -> torch.LongTensor:
        """How many tokens of merged n-gram paths join this step's tree (kept for `path_nodes`), given each row's
        longest path (``lengths``) and the drafts `plan` chose (``[R]``); returns the drafts, all zero when the
        paths alone verify at a better rate than with the drafter (module docstring)."""
        count, table = len(rows), self.table
        if self._shadow_now or table.cost(count, 1) is None:
            return drafts  # a probe times the draft alone; the first step measures a plain step
        longest = max(lengths)
        # path_committed[b, k]: expected tokens row b commits from k path tokens (1 + c_1 + c_1 c_2 + ... over its
        # path's length)
        path_committed = torch.tensor(
            [
                list(itertools.accumulate(row[: length + 1] + [0.0] * (longest - length)))
                for row, length in zip(self._path_reach(rows, longest), lengths)
            ],
            dtype=torch.float64,
        )
        costs = table.path_costs(count, range(1, longest + 2), drafted=False)
        rates = self.rates(rows, path_committed, costs)
        undrafted = {k: (rate, cost) for k, (rate, cost) in enumerate(zip(rates, costs)) if cost is not None}
        width = int(drafts.max()) + 1
        hybrid = {}
        if width > 1:
            drafted = (self.acceptance(rows)[:, None] ** torch.arange(width, dtype=torch.float64)).sum(1)
            both = torch.maximum(drafted[:, None], path_committed)
            costs = table.path_costs(count, range(width, width + longest + 1), drafted=True)
            rates = self.rates(rows, both, costs)
            hybrid = {k: (rate, cost) for k, (rate, cost) in enumerate(zip(rates, costs)) if cost is not None}
        best_alone = max(undrafted, key=lambda k: undrafted[k][0], default=None)
        best_hybrid = max(hybrid, key=lambda k: hybrid[k][0], default=None)
        if best_hybrid is not None and (
            self._probing or best_alone is None or hybrid[best_hybrid][0] >= undrafted[best_alone][0]
        ):
            self._path_nodes, chosen = best_hybrid, hybrid[best_hybrid]
            committed = float(torch.maximum(drafted, path_committed[:, best_hybrid]).sum())
        elif best_alone is not None and not self._probing:
            self._path_nodes, chosen = best_alone, undrafted[best_alone]
            committed = float(path_committed[:, best_alone].sum())
            drafts = torch.zeros_like(drafts)  # the drafter is not worth its draft this step
            self._undrafted = best_alone > 0
        else:
            return drafts
        self.last_prediction = {"predicted_step_s": chosen[1], "predicted_tokens": committed}
        return drafts

    def _best_width(self, rows: list[int], max_width: int) -> int:
        """The width of the highest expected rate under the measured costs and the rows' acceptance."""
        count, table = len(rows), self.table
        committed = self.expected_committed(rows, max_width)
        committed[:, 0] = 1.0  # a plain step commits exactly one token per row
        widths = range(1, max_width + 1)
        rates = dict(zip(widths, self.rates(rows, committed, table.costs(count, widths))))
        width = max(rates, key=rates.get)
        if 1 < width < max_width and table.measured(width) and not table.measured(width + 1):
            # The next width is costed by an interpolation between measured widths, so it may win only once
            # measured: one step there measures it (each width once per pair and process). One beyond the widest
            # measured is priced at the widest's cost (`_beyond_widest`) and wins on its own where drafting pays.
            width += 1
        predicted = float(committed[:, width - 1].sum())
        self.last_prediction = {"predicted_step_s": table.cost(count, width), "predicted_tokens": predicted}
        return width

    def _draft_or_plain(self, count: int, max_width: int) -> int:
        """With a length head: the whole block (for `refine` to cut) when this call's drafted steps, all of them
        summed, have been committing tokens faster than plain steps (a moving average would let one lucky step
        outweigh several losing ones, and drafting would go on exactly while it is lucky), their speedup counted
        beside `RATE_PRIOR_STEPS` steps at the earlier calls' (`CostTable.drafting_speedup`, as the call began): a
        call's first drafted steps are few, and on their own one unlucky step would stop a call where drafting pays,
        to resume only at the next promoted probe. Before the call has drafted, the pair's rate (which probes' blocks
        inform) where it beats plain steps (`START_ON_RATE`, or a call that does not start with a probe), or a
        probe's block that would have paid (`score_shadows`), starts drafting; else a plain step. A call that is
        drafting goes on while the upper bound (`DRAFTING_BOUND_Z`) beats plain steps, and one that is not starts on
        the mean itself: exploring is paid for only while drafting."""
        sums = CostTable._nearest(self._drafted, count)
        if sums is None:
            prior = self._prior_rate and self.table.drafting_speedup(count) >= 1.0
            return max_width if prior else 1
        tokens, seconds, steps, speedups, squares = sums
        own = (tokens / seconds) / (count / self.table.cost(count, 1))
        earlier = CostTable._nearest(self._earlier_speedup, count)
        weight = steps
        if earlier is not None:  # capped: after a domain where drafting doubled the rate, a losing call stops soon
            earlier = min(earlier, RATE_PRIOR_CAP)
            own = (steps * own + RATE_PRIOR_STEPS * earlier) / (steps + RATE_PRIOR_STEPS)
            weight += RATE_PRIOR_STEPS
        if DRAFTING_BOUND_Z > 0 and self._drafting:
            mean = speedups / steps
            spread = (max(squares - steps * mean * mean, 0.0) + SPREAD_PRIOR_STEPS * SPREAD_PRIOR**2) / (
                steps - 1 + SPREAD_PRIOR_STEPS
            )
            own += DRAFTING_BOUND_Z * math.sqrt(spread / weight)
        return max_width if own >= 1.0 else 1

    # ------------------------------------------------------------------ probes

    def score_shadows(self, rows: list[int], committed: list[list[int]]) -> None:
        """Compares the pending probes' drafts with the tokens the rows committed this step (``committed``, per row
        of ``rows``); resolves the probe once every row disagreed, matched its whole block or left the batch."""
        present = dict(zip(rows, committed))
        for row, shadow in self._shadows.items():
            drafts, matched, resolved, _ = shadow
            if resolved:
                continue
            if row not in present:  # the row finished
                shadow[2] = True
                continue
            matched, refuted = match_committed(drafts, matched, present[row])
            shadow[1], shadow[3] = matched, refuted
            if refuted or matched == len(drafts):
                shadow[2] = True
        gain = self.shadow_gain()
        if gain is not None and gain > 1.0:
            self._promoted = True  # drafting is expected to pay, even if no more of this block matches
        elif all(resolved for _, _, resolved, _ in self._shadows.values()):
            self.table.probe_interval = min(2 * self.table.probe_interval, MAX_PROBE_INTERVAL)
        else:
            return
        self._evidence = True
        if self._sampled_probe():
            self._probed_rows.update(zip(self._shadows, self._probed_acceptance().tolist()))
        if PROBE_SAMPLES and self._shadow_width is not None:
            self._observe_shadow_rate(self._shadow_width)
        if not self.length_head:  # the geometric model's observations: accepted drafts, then one rejection
            for row, (drafts, matched, _, refuted) in self._shadows.items():
                if drafts:  # a row still matching when the probe ended early has seen no rejection yet
                    self.successes[row] += matched
                    self.trials[row] += matched + refuted
        self._shadows = {}

    def _observe_shadow_rate(self, width: int) -> None:
        """With a length head and `PROBE_SAMPLES`, a probe is one more sample of drafting's rate: the tokens its
        block would have committed at the width the head chose for it (exactly, under greedy decoding; a row still
        matching when the probe ended counts what it matched so far), over what that width costs. None before a
        drafted step measured one: priced by a plain step and a probe's draft, which read the prompt too and may have
        timed the draft head's dtypes, such samples put shell's rate at 0.4 of plain steps' in a new process, and
        drafting never started there (BENCHMARKS.md section 30). It moves the pair's moving average, so that
        drafting's rate is known where probes did not start drafting (a pair whose probes never win would otherwise
        keep an old rate for ever), and a later call, or this one once the rate beats plain steps, drafts on it
        (`_draft_or_plain`). Not the call's own samples: counted there, probes' lucky blocks started drafting on chat
        and changelog, where it loses (BENCHMARKS.md section 27)."""
        rows = max(len(self._shadow_rows), len(self._shadows))
        cost = self.table.cost(rows, width)
        if cost is None or not self._shadows:
            return
        tokens = sum(1 + min(matched, width - 1) for _, matched, _, _ in self._shadows.values())
        self.table.observe_drafted(rows, tokens * rows / len(self._shadows), cost)  # the probed rows stand for all

    def _add_drafted_sample(self, rows: int, tokens: float, seconds: float) -> None:
        """One drafted step's committed ``tokens`` in ``seconds`` at ``rows``: the pair's moving average and this
        call's sums (`_draft_or_plain`)."""
        speedup = self.table.observe_drafted(rows, tokens, seconds)
        if speedup is not None:
            sums = self._drafted.setdefault(rows, [0.0, 0.0, 0, 0.0, 0.0])
            sums[0], sums[1], sums[2] = sums[0] + tokens, sums[1] + seconds, sums[2] + 1
            sums[3], sums[4] = sums[3] + speedup, sums[4] + speedup * speedup

    def shadow_gain(self) -> float | None:
        """How much faster than plain steps a drafted step would commit tokens after this probe, at the best width,
        each width at what the table says it costs (`CostTable.cost`: measured, interpolated between measured widths,
        the next width beyond them at the widest's cost, wider ones bounded above) or, before any drafted step was
        measured, at the cheapest a drafted step can cost (a plain step plus the measured draft); ``None`` before
        anything can be said.

        A width's tokens are what the geometric model expects (`expected_committed`) with each row's ``p`` estimated
        from the probe's matched drafts and its rejection (if one came yet) beside the call's earlier observations,
        shrunk towards `PRIOR_ACCEPTANCE` (the last call's acceptance says little about this one's content), scaled
        down where the probed rows' blocks would have committed fewer in all (`BLOCK_TOTALS`; at one row: the fewer
        of its block's and its expected tokens). One block is one sample: promoting on what it
        matched alone would start drafting on every lucky block (where a draft is accepted with probability 0.45,
        half of all probes match one draft or more, which pays for a step of 1.75 plain steps, while drafting there
        commits 1.45 tokens per such step: BENCHMARKS.md section 20); and the estimate alone, with its prior, could
        start drafting on a block that matched nothing.

        A probe that drafted some of the rows (`plan`) prices a step of all of them: a row it did not draft expects
        what its own observations say, shrunk towards the acceptance of the rows this call's probes drafted, each
        one observation, beside `ROW_PRIOR_WEIGHT` rows at the call's pooled estimate (`ROW_EVIDENCE`): a batch's
        rows may hold other content than the one row drafted, which its block's length says nothing about."""
        if not self._shadows:
            return None
        probed = list(self._shadows)
        others = [row for row in self._shadow_rows if row not in self._shadows]
        rows = len(probed) + len(others)
        plain, draft = self.table.cost(rows, 1), self.table.draft(rows)
        if plain is None or draft is None:
            return None
        matched, refuted = self._shadow_counts()
        p = self._probed_acceptance()
        longest = max(len(d) for d, _, _, _ in self._shadows.values())
        steps = torch.arange(longest + 1, dtype=torch.float64)
        expected = (p[:, None] ** steps).cumsum(1)  # [rows, w - 1]: expected tokens at width w
        realized = 1 + torch.minimum(matched[:, None], steps)  # what the block would have committed at width w
        if BLOCK_TOTALS:  # each row as expected, all of them no more than their blocks committed in all
            committed = (expected * (realized.sum(0) / expected.sum(0)).clamp(max=1.0))[:, 1:]  # column w - 2: width w
        else:
            committed = torch.minimum(expected, realized)[:, 1:]
        if others:
            if ROW_EVIDENCE:  # one observation a probed row, this probe's and the call's earlier ones'
                estimates = {**self._probed_rows, **dict(zip(probed, p.tolist()))}
                seen = (sum(estimates.values()) + ROW_PRIOR_WEIGHT * self._pooled_acceptance()) / (
                    len(estimates) + ROW_PRIOR_WEIGHT
                )
            else:  # the probed rows' drafts, each an observation
                seen = (self.successes.sum() + matched.sum() + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (
                    self.trials.sum() + matched.sum() + refuted.sum() + PRIOR_WEIGHT
                )
            rest = torch.tensor(others, dtype=torch.long)
            q = ((self.successes[rest] + PRIOR_WEIGHT * seen) / (self.trials[rest] + PRIOR_WEIGHT)).clamp(0.0, 0.999)
            committed = torch.cat([committed, (q[:, None] ** steps).cumsum(1)[:, 1:]])
        costs = [self.table.drafted_cost(rows, width) for width in range(2, longest + 2)]
        best = max(rate for rate in self.rates(probed + others, committed, costs) if rate is not None)
        return best / self.rates(probed + others, torch.ones(rows, 1, dtype=torch.float64), [plain])[0]

    def _pooled_acceptance(self) -> float:
        """Per-draft acceptance over this call's observations of every row, shrunk towards `PRIOR_ACCEPTANCE`."""
        return float((self.successes.sum() + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self.trials.sum() + PRIOR_WEIGHT))

    def _probed_acceptance(self) -> torch.Tensor:
        """``[len(_shadows)]``: each probed row's per-draft acceptance from its own observations and the pending
        probe's matched drafts and rejection, shrunk towards the call's pooled estimate."""
        index = torch.tensor(list(self._shadows), dtype=torch.long)
        matched, refuted = self._shadow_counts()
        own_s, own_t = self.successes[index] + matched, self.trials[index] + matched + refuted
        pooled = self._pooled_acceptance()
        return ((own_s + PRIOR_WEIGHT * pooled) / (own_t + PRIOR_WEIGHT)).clamp(0.0, 0.999)

    def _shadow_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(matched, refuted)``, ``[len(_shadows)]`` each: the pending probe's drafts matched so far per row, and
        whether a committed token refuted its block."""
        shadows = self._shadows.values()
        matched = torch.tensor([m for _, m, _, _ in shadows], dtype=torch.float64)
        return matched, torch.tensor([float(r) for _, _, _, r in shadows], dtype=torch.float64)

    def _sampled_probe(self) -> bool:
        """Whether the pending probe drafted some of its rows, not all."""
        return any(row not in self._shadows for row in self._shadow_rows)

    def refine(
        self, rows: list[int], length_prediction: torch.Tensor, num_drafts: torch.LongTensor, choice=None
    ) -> torch.LongTensor:
        """The drafts each row verifies once the drafter has run, from its length head's prediction
        (``length_prediction [R]``: predicted ``(accepted + 1) / block_size``), at most ``num_drafts [R]``;
        ``choice``: `_head_width`'s, made before the drafts were projected (`projected`)."""
        width, powers = self._head_width(rows, length_prediction, num_drafts) if choice is None else choice
        if powers is None:
            return torch.clamp(num_drafts, max=width - 1)
        # expected accepted drafts at this width, for the calibration: sum_{j=1}^{w-1} p^j
        self._expected_accepted = powers[:, 1:width].sum(1)
        committed = float(powers[:, :width].sum())
        self.last_prediction = {"predicted_step_s": self.table.cost(len(rows), width), "predicted_tokens": committed}
        return torch.clamp(num_drafts, max=width - 1)

    def _head_width(
        self, rows: list[int], length_prediction: torch.Tensor, num_drafts: torch.LongTensor, count: int | None = None
    ):
        """``(width, powers)``: the width of the highest expected rate under the head's predictions, and the rows'
        ``p ** j`` behind it (``[R, max_width]``; ``None`` where the width was not chosen by rate: the block allows
        one draft at most, or no drafted width is measured yet, which the cheapest one measures). ``count``: the
        rows a step of that width would verify, if more than ``rows`` (a probe of some of them)."""
        table = self.table
        count = len(rows) if count is None else count
        max_width = int(num_drafts.max()) + 1
        if max_width <= 2:
            return max_width, None
        if table.cost(count, 2) is None:
            return PROBE_WIDTH, None
        predicted = (length_prediction.double().cpu() * self.block_size - 1).clamp(min=0) * table.head_scale
        p = (predicted / (1 + predicted)).clamp(0.0, 0.999)
        powers = p[:, None] ** torch.arange(max_width, dtype=torch.float64)
        widths = range(2, max_width + 1)
        committed = powers.cumsum(1)[:, 1:]  # column w - 2: each row's expected tokens at width w
        rates = dict(zip(widths, self.rates(rows, committed, table.costs(count, widths))))
        width = max(rates, key=rates.get)
        if width < max_width and table.measured(width) and not table.measured(width + 1):
            width += 1  # measure the next width once (as `width` does)
        return width, powers

    # ------------------------------------------------------------------ feedback

    def begin(self) -> None:
        """Starts the clock of a step (before anything of it runs, the planner's choice included)."""
        self._sync()
        self._started, self._drafted_at = time.perf_counter(), None

    def untimed(self) -> None:
        """Keeps the next observed step out of the cost table and the rates: it ran a one-off cost (the draft head's
        dtype trials of a pair's first drafts time bfloat16 products that can cost several times the float32 ones),
        which would price its width and tell drafting apart from plain steps wrongly."""
        self._untimed = True

    def read_prompts(self) -> None:
        """The next observed step's draft read every row's prompt (a call's first draft): at batch 8 two to three
        times a later draft, once a call. Kept out of the draft's price (`CostTable.draft_s`, a moving average that
        prices every later drafted width: on a Zen 4 at 0.111 s against 44-55 ms, BENCHMARKS.md section 38), it still
        counts where the call paid it: in its width's cost (the median of several steps) and in drafting's rate,
        where a math call's first drafted step is often its most productive one (section 39)."""
        self._read_prompts = True

    def trial(self) -> None:
        """The next observed step's forward timed one of the candidate kernels for its token count
        (`verify_layout.py`): a real step, at most as much slower than later ones as the candidate kernels differ
        (a fraction of the forward), so it counts in this call's rates and prices its width until a step with the
        kernel kept does (`CostTable.observe`'s ``provisional``). Excluding it would make the planner draft again
        just to measure, once per kernel trial: several drafted steps per new token count, each a loss where
        drafting does not pay."""
        self._trial = True

    def observe(self, rows: list[int], width: int, accepted: list[int], offered: list[int]) -> float:
        """Records the step just run (started at the last `begin`); returns its measured seconds."""
        self._sync()
        seconds = time.perf_counter() - self._started
        with self._lock:
            return self._observe(rows, width, accepted, offered, seconds)

    def _observe(self, rows, width, accepted, offered, seconds) -> float:
        timed, self._untimed = not self._untimed, False
        read, self._read_prompts = self._read_prompts, False
        trial, self._trial = self._trial and timed, False
        if self._shadow_drafted:  # a plain step plus a draft: what it adds to a plain step is the probe's cost
            plain = self.table.cost(len(rows), 1)
            # a draft that timed the head's dtypes, or beside a plain forward timing a kernel, costs more than later
            # ones: taken only while nothing better is known
            if plain is not None:
                self.table.observe_probe(len(rows), max(seconds - plain, 0.0), provisional=not timed or trial)
            timed = False
        self._drafting = width > 1 and not self._undrafted
        if self._undrafted and width > 1:  # merged paths without the drafter: costed apart, and say nothing of drafts
            if timed:
                self.table.observe_undrafted(len(rows), width, seconds, provisional=trial)
            self.plain_streak += 1
            self.table.idle_steps += 1
            return seconds
        if timed:
            self.table.observe(len(rows), width, seconds, provisional=trial)
        if width == 1:  # a plain step offers no drafts, so it tells nothing about acceptance
            self.plain_streak += 1
            self.table.idle_steps += 1
            return seconds
        self._evidence = True
        got, out_of = torch.tensor(accepted, dtype=torch.float64), torch.tensor(offered, dtype=torch.float64)
        if not timed and self._probing and not self.table.measured(width):
            # The step that was to measure a drafted width ran a one-off cost (the head's dtype trials). If it beat
            # plain steps even so, drafting pays: measure again at once. If not, nothing is known, and drafting again
            # at once would be one loss per trial (at batch 8 a drafted step costs two plain steps): the next probe
            # decides.
            plain = self.table.cost(len(rows), 1)
            self._promoted = plain is not None and (float(got.sum()) + len(rows)) / seconds >= len(rows) / plain
        if timed:
            if self._drafted_at is not None and not read:
                self.table.observe_draft(len(rows), self._drafted_at - self._started)
            self._add_drafted_sample(len(rows), float(got.sum()) + len(rows), seconds)
        if self._expected_accepted is not None:
            # The head's predictions, scaled, should expect as many accepted drafts as the target accepts. The log of
            # the ratio drifts down wherever outcomes scatter (log E > E log: a head right on average settles near
            # 0.7), and the widths with it. An update without the drift (the error over what was expected), tried
            # with section 30's pricing fixes, left math 3-4% further behind the head's policy in two A/B runs, its
            # steps wider and dearer (BENCHMARKS.md section 30): the geometric model over-values wide widths.
            ratio = (float(got.sum()) + 1.0) / (float(self._expected_accepted.sum()) + 1.0)
            self.table.head_scale = min(max(self.table.head_scale * ratio**EMA, 0.1), 10.0)
            self._expected_accepted = None
        index = torch.tensor(rows, dtype=torch.long)
        drafted = out_of > 0  # accepted drafts are successes, a rejection is one failure
        self.successes.index_add_(0, index, torch.where(drafted, got, 0.0))
        self.trials.index_add_(0, index, torch.where(drafted, got + (got < out_of).double(), 0.0))
        if self._probing:
            # a probe that does not make drafting win next time waits twice as long before the next one
            self.table.probe_interval = min(2 * self.table.probe_interval, MAX_PROBE_INTERVAL)
        else:
            self.table.probe_interval = FIRST_PROBE_INTERVAL
        self.plain_streak = self.table.idle_steps = 0
        trials = float(self.trials.sum())
        if trials > 0:
            self.table.acceptance = float(self.successes.sum()) / trials
        return seconds


def step_plan(policy: LengthPolicy, profile, drafter_config, batch_size: int, device, dtype) -> StepPlan:
    """The loop's `StepPlan` for a call: the planner for ``planned`` (its table the pair's `RuntimeProfile`'s for this
    device and dtype), else `PolicyPlan`. Without a drafter (``drafter_config=None``, n-gram paths only), the planner
    with a block of one token: it never drafts, and chooses each step's path tokens (`plan_paths`)."""
    if policy.length_policy != "planned":
        return PolicyPlan()
    return VerificationPlanner(
        profile.cost_table(device, dtype),
        1 if drafter_config is None else drafter_config.block_size,
        batch_size,
        device,
        length_head=drafter_config is not None and bool(drafter_config.use_length_head),
        lock=profile.lock,
    )
