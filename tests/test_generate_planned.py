"""`length_policy="planned"`: the cost-aware planner only chooses how many drafts are verified, so outputs stay those
of plain decoding whatever it chooses (zero drafts for every row, for some rows, a width that changes every step);
and it chooses what its measured costs and observed acceptance say pays."""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import TickingClock, oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD, PROMPTS, alone, common_token, left_pad, rows_of
from test_generate_sampling import NEW, PROMPT, SAMPLING, exact_joint, p_value
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import adaflash_hf
from adaflash_hf.generation import draft_head as draft_head_module
from adaflash_hf.generation import planner as planner_module
from adaflash_hf.generation.candidate_generator import AdaFlashCandidateGenerator
from adaflash_hf.generation.measured import MeasuredChoice
from adaflash_hf.generation.planner import CostTable, VerificationPlanner
from adaflash_hf.generation.profile import HEAD_KERNEL_TRIALS, profile_for
from adaflash_hf.generation.verify_layout import VerifyLayout

PLANNED = dict(adaflash_length_policy="planned")


@pytest.fixture
def unbudgeted_probes(monkeypatch):
    """Probes as often as the back-off alone allows. A tiny model's draft costs more than its plain step, and
    drafting never pays at its timings, so within the budget (`PROBE_BUDGET`) a call after the first would hardly
    probe; the tests using this are about what probes do, not how often they may."""
    monkeypatch.setattr(planner_module, "PROBE_BUDGET", 1e9)


def _generate(target, drafter, ids, mask, eos, **kwargs):
    config = GenerationConfig(
        max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=PAD, **PLANNED, **kwargs
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
    return out, stats


def _forced(monkeypatch, choose):
    """Replaces the planner's choice by ``choose(step, rows, max_drafts) -> drafts per row``."""
    calls = []

    def plan(self, rows, max_drafts):
        calls.append(rows)
        return torch.as_tensor(choose(len(calls), rows, max_drafts), dtype=torch.long).clamp(max=max_drafts)

    monkeypatch.setattr(VerificationPlanner, "plan", plan)
    return calls


CHOICES = {
    "zero for every row": lambda step, rows, cap: [0] * len(rows),
    "zero for odd rows": lambda step, rows, cap: [0 if row % 2 else 7 for row in rows],
    "zero every other step": lambda step, rows, cap: [7 * (step % 2)] * len(rows),
    "a random width": lambda step, rows, cap: [int(torch.randint(0, 8, ()))] * len(rows),
}


class _StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class _Chunks:
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        pass


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_one_row_calls_plain_steps_give_what_plain_decoding_gives(monkeypatch, do_sample):
    """Every step plain: a call of one row takes them with Python integers (`SpeculativeDecoding._plain_step`).
    Its tokens, scores, logits, streamed chunks, returned cache and stops (EOS, the budget, and a criterion of the
    caller's, which the general commit cuts) are plain decoding's. Sampling draws the same tokens from the same
    seed: no draft runs, and a plain step samples as plain decoding does."""
    target, prompt = tiny_target(), PROMPTS[0]
    drafter = tiny_drafter(target)
    calls = _forced(monkeypatch, CHOICES["zero for every row"])
    output = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    sampling = dict(do_sample=True, top_k=20) if do_sample else dict(do_sample=False)
    free = alone(target, prompt, max_new_tokens=30, eos_token_id=None)
    eos = free[12]
    criteria = StoppingCriteriaList([_StopOnToken(free[6])])
    ends = {"eos": ({"eos_token_id": eos}, None), "budget": ({"eos_token_id": None, "max_new_tokens": 9}, None)}
    ends["criterion"] = ({"eos_token_id": None}, criteria)
    for end, (kwargs, stopping_criteria) in ends.items():
        kwargs = {"max_new_tokens": 30, "pad_token_id": PAD, **sampling, **output, **kwargs}
        torch.manual_seed(0)
        expected = target.generate(
            torch.tensor([prompt]), generation_config=GenerationConfig(**kwargs), stopping_criteria=stopping_criteria
        )
        chunks, steps = _Chunks(), len(calls)
        torch.manual_seed(0)
        with adaflash_hf.record_stats() as stats:
            out = target.generate(
                torch.tensor([prompt]),
                generation_config=GenerationConfig(**kwargs, **PLANNED),
                assistant_model=drafter,
                streamer=chunks,
                stopping_criteria=stopping_criteria,
            )
        new = expected.sequences[0, len(prompt) :].tolist()
        assert out.sequences.tolist() == expected.sequences.tolist(), end
        assert len(new) < 30 or end == "eos" and do_sample
        assert chunks.chunks == [prompt] + [[token] for token in new]
        assert len(calls) - steps == len(new) - 1 == len(stats.steps)
        assert all(step.verify_width == 1 and not step.drafter_ran for step in stats.steps)
        for ours, theirs in zip(out.scores + out.logits, expected.scores + expected.logits, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        for ours, theirs in zip(out.cache.layers, expected.cache.layers, strict=True):
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("choice", sorted(CHOICES))
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_any_choice_of_the_planner_keeps_greedy_exact(monkeypatch, choice, batch_size):
    target = tiny_target()
    prompts = PROMPTS[:batch_size]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = common_token(free)
    references = [alone(target, p, max_new_tokens=30, eos_token_id=eos) for p in prompts]
    ids, mask = left_pad(prompts)
    full_refs = [p + r for p, r in zip(prompts, free)]
    drafters = {
        "random": tiny_drafter(target),
        "oracle": oracle_drafter(target, full_refs, corrupt=lambda row, anchor: {1 + (row + anchor) % 7}),
    }
    _forced(monkeypatch, CHOICES[choice])
    for name, drafter in drafters.items():
        drafter_calls = []
        drafter.register_forward_hook(lambda *args, calls=drafter_calls: calls.append(1))
        out, stats = _generate(target, drafter, ids, mask, eos)
        for got, want in zip(rows_of(out, prompts), references):
            assert got[: len(want)] == want, (name, choice)
            assert all(t == PAD for t in got[len(want) :]), (name, choice)
        offered = [n - 1 for step in stats.steps for n in step.candidate_lengths]
        plain_steps = sum(step.verify_width == 1 for step in stats.steps)
        if choice == "zero for every row":
            assert drafter_calls == [] and set(offered) == {0}  # no drafter forward at all
        elif choice == "zero every other step":
            assert len(drafter_calls) == len(stats.steps) - plain_steps and 0 < plain_steps < len(stats.steps)


def test_the_unforced_planner_is_exact_and_its_predictions_are_recorded(unbudgeted_probes):
    target = tiny_target()
    prompts = PROMPTS[:4]
    references = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    oracle = oracle_drafter(target, [p + r for p, r in zip(prompts, references)])
    for drafter in (tiny_drafter(target), oracle):
        for _ in range(2):  # the second call starts from the costs the first measured
            # the head's dtype as the drafter's: its trials would leave these few calls' drafted steps unpriced
            out, stats = _generate(target, drafter, ids, mask, None, adaflash_draft_head_dtype="same")
            assert rows_of(out, prompts) == references
    steps = stats.steps
    assert all(step.step_time_s > 0 for step in steps)
    assert any(step.predicted_step_s is not None and step.predicted_tokens > 0 for step in steps)


def test_context_queued_across_plain_steps_drafts_as_if_fed_step_by_step():
    from adaflash_hf.generation.candidate_generator import AdaFlashCandidateGenerator

    target = tiny_target()
    drafter = tiny_drafter(target)
    config = GenerationConfig(max_length=64, do_sample=False)
    features = torch.randn(1, 9, drafter.fc.in_features)
    positions = torch.arange(9)[None]
    ids = torch.randint(3, 100, (1, 10))

    def drafts(pieces):
        generator = AdaFlashCandidateGenerator(target, drafter, config)
        for start, end in pieces:
            generator.add_context(features[:, start:end], positions[:, start:end])
        return generator.draft(ids[:, 9], torch.tensor([9]), ids, torch.tensor([10]), torch.tensor([7])).tokens

    # the prompt, then three plain steps of one token each, queued for one draft()
    assert torch.equal(drafts([(0, 6), (6, 7), (7, 8), (8, 9)]), drafts([(0, 9)]))


def test_a_probe_of_some_rows_drafts_them_as_a_draft_of_every_row_would_and_leaves_the_context_queued():
    from adaflash_hf.generation.candidate_generator import AdaFlashCandidateGenerator

    target = tiny_target()
    drafter = tiny_drafter(target)
    # the head in the target's dtype: a new pair's first drafts alternate the dtypes it times (`draft_head.py`)
    config = GenerationConfig(max_length=64, do_sample=False, adaflash_draft_head_dtype="same")
    torch.manual_seed(0)
    features = torch.randn(3, 9, drafter.fc.in_features)
    valid = torch.ones(3, 9, dtype=torch.bool)
    valid[0, :3] = False  # row 0 left-padded, as a batch's shorter prompt is
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    ids = torch.randint(3, 100, (3, 10))
    anchors, anchor_positions, lengths = ids[:, 9], positions[:, -1] + 1, torch.full((3,), 10)

    def generator():
        made = AdaFlashCandidateGenerator(target, drafter, config)
        for start, end in ((0, 6), (6, 9)):  # the prompt, then plain steps' context, queued
            made.add_context(features[:, start:end], positions[:, start:end], valid[:, start:end])
        return made

    every = generator().draft(anchors, anchor_positions, ids, lengths, torch.tensor([7, 7, 7]))
    probing = generator()
    for row in (1, 0):  # a row alone (the padded one too): the drafts a draft of every row gives it
        asked = torch.tensor([7 if r == row else 0 for r in range(3)])
        drafts = probing.probe(anchors, anchor_positions, ids, lengths, asked)
        assert drafts.num_drafts.tolist() == asked.tolist()
        assert torch.equal(drafts.tokens[row, :7], every.tokens[row, :7])
        assert probing.cache.get_seq_length() == 0  # the call's drafter read nothing
    # the call's first real draft reads the whole queue, as if no probe had run
    assert torch.equal(
        probing.draft(anchors, anchor_positions, ids, lengths, torch.tensor([7, 7, 7])).tokens, every.tokens
    )
    # once the call's drafter has read its context, a probe drafts every row (reading only what is new)
    probing.add_context(features[:, -1:], positions[:, -1:] + 1)
    drafts = probing.probe(anchors, anchor_positions + 1, ids, lengths, torch.tensor([0, 7, 0]))
    assert drafts.num_drafts.tolist() == [0, 7, 0] and probing.cache.get_seq_length() == 10


def test_at_batch_greater_than_one_a_calls_probes_draft_one_row_in_turn_until_it_drafts(
    monkeypatch, unbudgeted_probes
):
    target = tiny_target()
    prompts = PROMPTS[:3]
    references = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    scored = []  # per probe scored: whether a committed token refuted its block, per row it drafted
    real_gain = VerificationPlanner.shadow_gain

    def shadow_gain(self):
        scored.append({row: refuted for row, (_, _, _, refuted) in self._shadows.items()})
        return real_gain(self)

    monkeypatch.setattr(VerificationPlanner, "shadow_gain", shadow_gain)

    def run(corrupt):
        drafter = oracle_drafter(target, [p + r for p, r in zip(prompts, references)], corrupt=corrupt)
        forwards = []  # per drafter forward: the reference rows it drafted
        drafter.register_forward_hook(
            lambda module, args, kwargs, out: forwards.append(module.rows_of(kwargs["cache"])), with_kwargs=True
        )
        scored.clear()
        out, stats = _generate(target, drafter, ids, mask, None)
        assert rows_of(out, prompts) == references
        return forwards, stats

    # drafts that are wrong at first: the call's probes each draft one row, the rows taking turns, and each is
    # refuted by its own row's next token
    forwards, stats = run(lambda row, anchor: {1} if anchor < 24 else ())
    assert all(step.verify_width == 1 for step in stats.steps)
    assert len(forwards) >= 2 and forwards == [[i % 3] for i in range(len(forwards))]
    assert all(list(probe) == rows for probe, rows in zip(scored, forwards)) and all(scored[0].values())
    # right drafts: each probe's row matches what it commits (the oracle drafted that row's own continuation); the
    # probes draft one row in turn until one promotes drafting (how many it takes follows the measured step costs:
    # each probed row is one row's evidence for the others), and from then on every row drafts in the call's cache
    forwards, stats = run(None)
    assert scored and not any(refuted for probe in scored for refuted in probe.values())
    first = next(i for i, rows in enumerate(forwards) if rows == [0, 1, 2])
    assert first >= 1 and forwards[:first] == [[i % 3] for i in range(first)]
    assert all(rows == [0, 1, 2] for rows in forwards[first:])
    assert any(step.verify_width > 1 for step in stats.steps)


def test_a_probe_of_one_row_prices_a_step_of_every_row():
    # three rows at batch-3 prices: a drafted step of width 2 costs 1.5 plain steps, of 16 tokens 2.5
    costs = {(3, 1): 1.0, (3, 2): 1.5, (3, 16): 2.5}

    def probe(committed):
        table = CostTable(step_s=dict(costs), draft_s={3: 0.2}, probe_s={3: 0.1}, acceptance=0.3)
        planner = VerificationPlanner(table, 16, 3, torch.device("cpu"))
        planner._shadows, planner._shadow_rows = {1: [[7] * 15, 0, False, False]}, [0, 1, 2]
        gain = planner.shadow_gain()
        planner.score_shadows([0, 1, 2], [[5], committed, [5]])
        return gain, planner

    # the row's whole block matched: drafting pays for every row, whose acceptance the sample stands for
    _, whole = probe([7] * 15)
    assert whole._promoted
    # it matched nothing: a step of all three would not pay, and the probe is resolved
    _, nothing = probe([8])
    assert not nothing._promoted and not nothing._shadows
    # the same evidence as a probe of all three rows where the other two matched as much: alike
    table = CostTable(step_s=dict(costs), draft_s={3: 0.2}, probe_s={3: 0.1}, acceptance=0.3)
    alike = VerificationPlanner(table, 16, 3, torch.device("cpu"))
    alike._shadows = {row: [[7] * 15, 0, False, False] for row in range(3)}
    alike._shadow_rows = [0, 1, 2]
    alike.score_shadows([0, 1, 2], [[7] * 15] * 3)
    assert alike._promoted


def test_a_probe_of_every_row_is_priced_by_its_blocks_in_all_not_by_its_unluckiest_block(monkeypatch):
    # eight rows at batch-8 prices (width 16 costs 2.7 plain steps), a call whose drafts were accepted 4 times in 5
    costs = {(8, 1): 1.0, (8, 2): 1.3, (8, 16): 2.7}

    def gain(matched):
        table = CostTable(step_s=dict(costs), draft_s={8: 0.2}, probe_s={8: 0.2}, acceptance=0.8)
        planner = VerificationPlanner(table, 16, 8, torch.device("cpu"))
        planner.successes += 4.0
        planner.trials += 5.0
        planner._shadows = {row: [[7] * 15, m, m < 15, m < 15] for row, m in enumerate(matched)}
        planner._shadow_rows = list(range(8))
        return planner.shadow_gain()

    # a math batch's probe (section 38): one block of eight matched nothing, the rest 1-15 drafts
    math = [1, 6, 15, 1, 2, 4, 0, 3]
    assert gain(math) > 1.5
    assert gain([0] * 8) < 1.0  # blocks that matched nothing promote nothing
    assert gain([15] * 8) > 3.0
    # the negative control: each row priced by the fewer of its block's and its expected tokens, the row whose block
    # matched nothing stood for a row that never drafts, and the batch's finish hung on it
    monkeypatch.setattr(planner_module, "BLOCK_TOTALS", False)
    assert gain(math) < 1.0
    assert gain([15] * 8) > 3.0


def test_a_probed_row_is_one_rows_evidence_for_the_rows_no_probe_drafted(monkeypatch):
    # 32 rows at prices where a wide verification is compute-bound: width 2 costs 1.8 plain steps, 16 tokens 8
    costs = {(32, 1): 1.0, (32, 2): 1.8, (32, 16): 8.0}
    rows = list(range(32))

    def probe(probed, earlier=None):
        table = CostTable(step_s=dict(costs), draft_s={32: 0.2}, probe_s={32: 0.1}, acceptance=0.3)
        planner = VerificationPlanner(table, 16, 32, torch.device("cpu"))
        planner._shadows = {row: [[7] * 15, 0, False, False] for row in probed}
        planner._shadow_rows, planner._probed_rows = rows, dict(earlier or {})
        planner.score_shadows(rows, [[7] * 15 if row in probed else [5] for row in rows])
        return planner

    # one row's whole block matched: the 31 others may hold other content, so it does not promote a step of 32 rows
    assert not probe([3])._promoted
    # counted as its 15 drafts' observations, the same block stood for all 32 rows and promoted (the negative control)
    monkeypatch.setattr(planner_module, "ROW_EVIDENCE", False)
    assert probe([3])._promoted
    monkeypatch.setattr(planner_module, "ROW_EVIDENCE", True)
    # the same block in every row pays; and the call's earlier probes of other rows add their evidence to this one's
    assert probe(rows)._promoted
    twice = probe([3])
    assert twice._probed_rows.keys() == {3}
    assert probe([4], earlier={row: twice._probed_rows[3] for row in range(8)})._promoted


def test_the_draft_head_projects_only_the_positions_a_row_can_verify(monkeypatch):
    """The LM head over the vocabulary is most of a draft's cost: a step that verifies 3 drafts projects 3."""
    from adaflash_hf.generation.draft_head import DraftHead

    projected = []
    real = DraftHead.__call__
    monkeypatch.setattr(
        DraftHead, "__call__", lambda self, hidden: projected.append(hidden.shape[1]) or real(self, hidden)
    )
    target = tiny_target()
    prompts = PROMPTS[:3]
    ids, mask = left_pad(prompts)
    _forced(monkeypatch, lambda step, rows, cap: [3 if row else 1 for row in rows])
    out, stats = _generate(target, tiny_drafter(target), ids, mask, None)
    assert max(projected) == 3 and len(projected) == sum(s.verify_width > 1 for s in stats.steps)  # budget cuts
    for got, prompt in zip(rows_of(out, prompts), prompts):
        assert got == alone(target, prompt, max_new_tokens=30, eos_token_id=None)


def test_with_a_length_head_only_the_drafts_its_width_verifies_are_projected(monkeypatch):
    """The planner picks the width from the head's prediction before the head over the vocabulary runs: a step of
    width 3 projects 2 positions of the block, not all of them."""
    from adaflash_hf.generation.draft_head import DraftHead

    projected = []
    real = DraftHead.__call__
    monkeypatch.setattr(
        DraftHead, "__call__", lambda self, hidden: projected.append(hidden.shape[1]) or real(self, hidden)
    )
    _forced(monkeypatch, lambda step, rows, cap: cap.tolist())  # every step drafts the whole block
    monkeypatch.setattr(VerificationPlanner, "_head_width", lambda self, rows, prediction, cap, count=None: (3, None))
    target = tiny_target()
    prompts = PROMPTS[:3]
    ids, mask = left_pad(prompts)
    out, stats = _generate(target, tiny_drafter(target, use_length_head=True), ids, mask, None)
    assert len(projected) == len(stats.steps) - 1 and max(projected) == 2  # the prefill's step drafts nothing
    assert max(step.verify_width for step in stats.steps) == 3
    for got, prompt in zip(rows_of(out, prompts), prompts):
        assert got == alone(target, prompt, max_new_tokens=30, eos_token_id=None)


@pytest.mark.parametrize("length_head", [False, True], ids=["no head", "length head"])
def test_planned_sampling_matches_the_processed_distribution(monkeypatch, length_head):
    """With a length head, the drafts a step verifies are sampled from a projection of those positions alone."""
    target = tiny_target(vocab_size=12, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=11, use_length_head=length_head)
    _forced(monkeypatch, lambda step, rows, cap: [3 * (step % 2)] * len(rows))  # plain and drafted steps alternate
    drafter.config.length_policy = "planned"  # a GenerationConfig object would drop the model's sampling defaults
    torch.manual_seed(0)
    samples = []
    for _ in range(100):
        out = target.generate(torch.tensor([PROMPT] * 20), max_new_tokens=NEW, assistant_model=drafter, **SAMPLING)
        samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    assert p_value(samples, exact_joint(target)) > 1e-3


# ------------------------------------------------------------------ the choice itself


def _planner(step_s: dict, acceptance: float, rows: int = 1) -> VerificationPlanner:
    table = CostTable(step_s=dict(step_s), acceptance=acceptance)
    return VerificationPlanner(table, block_size=16, batch_size=rows, device=torch.device("cpu"), probe_first=False)


def test_it_drafts_where_speculation_pays_and_steps_plainly_where_it_cannot():
    # a CPU-like cost: verifying 16 tokens costs 2 plain steps, the drafter a third of one
    costs = {(1, 1): 1.0, (1, 2): 1.4, (1, 16): 2.3}
    assert _planner(costs, acceptance=0.9).width([0], 16) >= 12
    assert _planner(costs, acceptance=0.05).width([0], 16) == 1
    # in between, a short block: two or three drafts commit 1.5-1.9 tokens for 1.4-1.5 steps' cost
    assert 1 < _planner(costs, acceptance=0.5).width([0], 16) < 6
    # a row's own record outweighs the pooled prior once it has some
    planner = _planner(costs, acceptance=0.9, rows=2)
    planner.successes[:], planner.trials[:] = torch.tensor([45.0, 0.0]), torch.tensor([50.0, 50.0])
    assert planner.acceptance([1])[0] < 0.1 < 0.8 < planner.acceptance([0])[0]


def test_a_fixed_batch_is_worth_what_advances_the_rows_that_end_it():
    """`finish_rates`: a batch ends with its last row, so a step is worth the time it saves until then."""
    # one row, or rows alike: the tokens of a step over its cost, as a server that replaces finished rows counts them
    one = planner_module.finish_rates(torch.tensor([[1.0, 3.0]]), [1.0, 2.0], torch.tensor([30.0]), torch.ones(1))
    assert one == pytest.approx([1.0, 1.5])
    alike = torch.tensor([[1.0, 3.0]] * 4)
    rates = planner_module.finish_rates(alike, [1.0, 2.0], torch.full((4,), 30.0), torch.ones(4))
    assert rates == pytest.approx([4.0, 6.0])
    # one row of four commits 9 tokens a step and the others 1: where a step costs the same whatever its rows, that
    # row's lead saves nothing (the others end the call as late as with plain steps: the sum would say 3x plain's
    # rate); where a step costs in proportion to its rows, the three finish a quarter sooner in its wake
    ahead = torch.tensor([[1.0, 9.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    flat = planner_module.finish_rates(ahead, [1.0, 1.0], torch.full((4,), 36.0), torch.ones(4))
    assert flat == pytest.approx([4.0, 4.0])
    shrink = torch.arange(1, 5, dtype=torch.float64) / 4
    proportional = planner_module.finish_rates(ahead, [1.0, 1.0], torch.full((4,), 36.0), shrink)
    assert proportional[1] == pytest.approx(4 * 36 / (4 + 32 * 0.75))
    # a row with fewer tokens left does not hold the others back: the row with most left bounds the call
    behind = planner_module.finish_rates(ahead, [1.0, 1.0], torch.tensor([72.0, 8.0, 8.0, 8.0]), torch.ones(4))
    assert behind[1] == pytest.approx(8.0 * 12 / 8) and behind[0] == pytest.approx(96 / 72)
    assert planner_module.finish_rates(ahead, [None, 2.0], torch.ones(4), torch.ones(4))[0] is None


def test_at_batch_greater_than_one_the_width_follows_the_rows_that_end_the_call():
    # two rows, a step costing the same at one or two rows: one row accepts 90% of its drafts, the other 5%
    costs = {(2, 1): 1.0, (2, 2): 1.3, (2, 16): 2.0}
    planner = _planner(costs, acceptance=0.5, rows=2)
    planner.successes[:], planner.trials[:] = torch.tensor([900.0, 5.0]), torch.tensor([1000.0, 100.0])
    planner.before_draft([0, 1], torch.tensor([40, 40]))
    assert planner.width([0, 1], 16) == 1  # the second row ends the call, and drafting cannot speed it up
    planner.before_draft([0, 1], torch.tensor([40, 4]))
    assert planner.width([0, 1], 16) > 8  # the first row has the most left: it ends the call, and drafts well


def test_wider_widths_are_measured_one_at_a_time_while_drafting_wins():
    # only the probe's width measured: wider ones are costed in proportion (an upper bound) and would never run
    planner = _planner({(1, 1): 1.0, (1, 2): 1.1}, acceptance=0.6)
    assert planner.width([0], 16) == 3  # width 2 wins, so width 3 runs once and is measured
    planner.table.observe(1, 3, 1.15)
    assert planner.width([0], 16) == 4  # and so on while the measured costs keep paying
    planner.table.observe(1, 4, 1.2)
    planner.table.observe(1, 5, 3.0)  # too expensive: measured, so no more exploring
    assert planner.width([0], 16) == 4
    assert _planner({(1, 1): 1.0, (1, 2): 1.1}, acceptance=0.05).width([0], 16) == 1  # nothing to explore


def test_costs_interpolate_between_measured_widths_and_unknown_batches_are_measured_first():
    table = CostTable(step_s={(4, 1): 1.0, (4, 2): 2.0, (4, 10): 4.0})
    assert table.cost(4, 6) == pytest.approx(3.0)
    assert table.cost(4, 16) == pytest.approx(6.4)  # beyond the widest: in proportion to width, an upper bound
    assert table.cost(5, 6) == pytest.approx(3.0)  # an unmeasured row count borrows the nearest measured one's
    assert CostTable(step_s={(4, 1): 1.0}).cost(4, 6) is None  # nothing drafted measured yet
    probed = CostTable(step_s={(4, 1): 1.0, (4, 4): 2.0})  # only a probe's width: wider costs in proportion
    assert probed.cost(4, 16) == pytest.approx(8.0) and probed.cost(4, 2) == pytest.approx(2.0)
    planner = VerificationPlanner(CostTable(), block_size=16, batch_size=8, device=torch.device("cpu"))
    for _ in range(planner_module.PLAIN_SAMPLES):  # plain steps first: everything is compared with them
        assert planner.width(list(range(8)), 16) == 1
        planner.begin()
        planner.observe(list(range(8)), 1, [0] * 8, [0] * 8)
    # then a probe: the drafter drafts the block, and the target verifies none of it
    assert planner.width(list(range(8)), 16) == 16
    drafts = SimpleNamespace(tokens=torch.zeros(8, 15, dtype=torch.long), num_drafts=torch.full((8,), 15))
    assert planner.after_draft(list(range(8)), drafts).tolist() == [0] * 8


class _Clock:
    """Stands for `time` in the planner's module: the steps `_drive` runs take the seconds their costs say."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


# a draft whose probes the budget allows once in 20 plain steps of 1 s
DRAFT_S = 20 * planner_module.PROBE_BUDGET


def _drive(planner, steps: int, agrees, costs: dict, draft_s: float = DRAFT_S):
    """Runs the planner's side of ``steps`` loop steps of one row (a block of 15 drafts of token 7); the target
    commits 7 while ``agrees(step)``, else 8. Each step takes what ``costs`` say (a width they do not name, what the
    planner's table says), a probe a plain step and ``draft_s``. Returns per step (drafter ran, tokens verified)."""
    history, clock, real = [], _Clock(), planner_module.time
    planner_module.time = clock
    try:
        for step in range(steps):
            history.append(_drive_step(planner, step, agrees, costs, draft_s, clock))
    finally:
        planner_module.time = real
    return history


def _drive_step(planner, step: int, agrees, costs: dict, draft_s: float, clock: _Clock) -> tuple[bool, int]:
    # hold the costs still (a probe's costs a draft here: no context waits for it)
    planner.table.step_s, planner.table.draft_s, planner.table.probe_s = dict(costs), {1: draft_s}, {1: draft_s}
    started = clock.now
    max_drafts = planner.before_draft([0], torch.tensor([15]))
    drafted = bool(max_drafts.gt(0).any())
    num_drafts = torch.zeros(1, dtype=torch.long)
    if drafted:
        clock.now += draft_s
        drafts = SimpleNamespace(tokens=torch.full((1, 15), 7), num_drafts=max_drafts, length_prediction=None)
        num_drafts = planner.after_draft([0], drafts)
    width = int(num_drafts.max()) + 1
    cost = costs.get((1, width)) or planner.table.cost(1, width)
    clock.now = started + cost + (draft_s if drafted and width == 1 else 0.0)
    token = 7 if agrees(step) else 8
    accepted = width - 1 if token == 7 else 0
    committed = torch.tensor([[7] * accepted + [token]])
    verified = SimpleNamespace(
        width=width, accepted=torch.tensor([accepted]), depth=num_drafts, committed=committed, by_source=None
    )
    planner.after_verify([0], verified, torch.tensor([accepted + 1]))
    return drafted, width


@pytest.mark.parametrize("length_head", [False, True])
def test_with_a_drafter_that_never_agrees_probes_verify_nothing_and_back_off(length_head):
    costs = {(1, 1): 1.0, (1, 2): 1.2, (1, 16): 2.0}
    table = CostTable(step_s=dict(costs), acceptance=0.5, drafted_speedup={1: 0.8} if length_head else {})
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=length_head)
    history = _drive(planner, 200, agrees=lambda step: False, costs=costs)
    probes = [i for i, (drafted, _) in enumerate(history) if drafted]
    # a new call probes first (once the budget allows); the last call's acceptance (0.5) may still make a few steps
    # right after it draft, after which nothing but anchors is verified
    drafted = [i for i, (_, width) in enumerate(history) if width > 1]
    assert len(drafted) <= 3 and all(i <= probes[0] + 5 for i in drafted)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and gaps[-1] > gaps[1]  # ever rarer
    # and never closer than keeps the draft within the budget (after the call's first)
    assert min(gaps[1:]) >= math.ceil(DRAFT_S / planner_module.PROBE_BUDGET)
    assert len(probes) <= 7  # the back-off: probes ever rarer, within the budget


def test_a_drafted_step_at_a_new_row_count_is_priced_in_plain_steps_of_that_row_count():
    # measured: plain steps at 1 and 8 rows, drafted ones at 1 row only (a batch-1 call, then a batch of 8)
    table = CostTable(step_s={(1, 1): 0.1, (1, 2): 0.15, (1, 4): 0.2, (8, 1): 0.3})
    # 1.5 and 2 plain steps at 1 row are 1.5 and 2 plain steps at 8 rows, not 0.15 s: below a plain step there
    assert table.cost(8, 2) == pytest.approx(0.45) and table.cost(8, 4) == pytest.approx(0.6)
    assert table.cost(8, 3) == pytest.approx(0.525)  # interpolated, then scaled
    assert table.cost(1, 2) == pytest.approx(0.15) and table.cost(8, 1) == pytest.approx(0.3)
    # a row count without a plain step of its own borrows the nearest plain step (8 rows) and is scaled by it
    assert table.cost(5, 1) == pytest.approx(0.3) and table.cost(5, 2) == pytest.approx(0.45)
    assert CostTable(step_s={(1, 2): 0.15}).cost(8, 2) == pytest.approx(0.15)  # no plain step: nothing to scale by
    table.step_s[(8, 2)] = 0.5  # once measured, its own cost
    assert table.cost(8, 2) == pytest.approx(0.5)


@pytest.mark.parametrize("length_head", [False, True])
def test_one_lucky_probe_does_not_start_drafting_where_the_acceptance_it_shows_cannot_pay(length_head):
    # a Zen 1 core's prices (BENCHMARKS.md section 20): a drafted step of width 2 costs 1.75 plain steps, of width 4
    # 1.9, the whole block 3.3; drafts are accepted with probability 0.45 (the code domain's)
    costs = {(1, 1): 1.0, (1, 2): 1.75, (1, 4): 1.9, (1, 16): 3.3}

    def probe(committed, costs=costs):
        table = CostTable(step_s=dict(costs), draft_s={1: 0.3}, probe_s={1: 0.3}, acceptance=0.45)
        planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=length_head)
        planner._shadows = {0: [[7] * 15, 0, False, False]}  # a probe's block of 15 drafts of token 7
        planner.score_shadows([0], [committed])
        return planner

    # one draft matched, then refuted: its block alone would have paid for a width-2 step (2 tokens for 1.75 plain
    # steps), which is what used to start drafting; drafts accepted with probability about 0.47 do not pay here
    lucky = probe([7, 8])
    assert not lucky._promoted and not lucky._shadows and lucky._evidence  # resolved: scored, and drafting waits
    # six matched drafts are evidence of an acceptance that pays at width 4 and above
    assert probe([7] * 6 + [8])._promoted
    # where a drafted step of width 2 costs 1.2 plain steps, the prior's acceptance (0.5) would pay on its own: a
    # block that matched nothing still does not start drafting, one that matched a draft does
    cheap = {(1, 1): 1.0, (1, 2): 1.2, (1, 16): 2.0}
    assert not probe([8], costs=cheap)._promoted and probe([7, 8], costs=cheap)._promoted


def test_a_profile_whose_only_drafted_width_was_dear_does_not_lock_drafting_out():
    # a profile persisted by calls on prompts that drafted badly: the one drafted width it measured, 2 tokens, cost
    # two plain steps (a step's fixed costs; a forward's cost hardly grows from 2 tokens to 16 on a CPU core)
    costs = {(1, 1): 1.0, (1, 2): 2.0}
    table = CostTable(step_s=dict(costs), draft_s={1: 0.2}, probe_s={1: 0.2}, acceptance=0.1)
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"))
    planner._shadows = {0: [[7] * 15, 0, False, False]}
    planner.score_shadows([0], [[7] * 15])  # the probe's whole block matched
    # priced in proportion to width beyond width 2, no width could ever pay, and nothing wider would be measured
    assert planner._promoted
    widths = []
    for cost in (2.05, 2.1, 2.1, 2.15, 2.2):  # each width runs once, is measured, and the next one is tried
        width = planner.width([0], 16)
        widths.append(width)
        planner.table.observe(1, width, cost)
        planner.successes[0] += width - 1
        planner.trials[0] += width - 1
    assert widths == [3, 4, 5, 6, 7]
    # one token beyond the widest measured is priced at the widest's cost, wider ones still in proportion
    assert table.cost(1, 8) == pytest.approx(2.2) and table.cost(1, 9) == pytest.approx(2.2 * 9 / 7)


def test_probes_stay_within_their_budget_where_a_draft_costs_a_whole_plain_step():
    # at batch 8 a draft can cost as much as a plain step: the back-off alone (4, 8, 16 steps) would spend a tenth
    # of the time on probes
    costs = {(1, 1): 1.0, (1, 2): 2.5, (1, 16): 4.0}
    planner = VerificationPlanner(CostTable(step_s=dict(costs)), 16, 1, torch.device("cpu"), length_head=True)
    history = _drive(
        planner, int(3 / planner_module.PROBE_BUDGET), agrees=lambda step: False, costs=costs, draft_s=1.0
    )
    probes = [i for i, (drafted, _) in enumerate(history) if drafted]
    assert all(width == 1 for _, width in history)
    assert min(b - a for a, b in zip(probes, probes[1:])) >= 1.0 / planner_module.PROBE_BUDGET
    assert (len(probes) - 1) * 1.0 / len(history) <= planner_module.PROBE_BUDGET  # after the call's first


def _drafted_run(planner, committed_per_step, seconds: float, limit: int = 40) -> int:
    """Drafted steps of one row, each committing the next of ``committed_per_step`` (cycled) in ``seconds``, while
    the planner goes on drafting (at most ``limit``); returns how many ran."""
    steps = 0
    while steps < limit and planner.width([0], 16) == 16:
        tokens = committed_per_step[steps % len(committed_per_step)]
        planner._observe([0], 16, [tokens - 1], [15], seconds)
        steps += 1
    return steps


def test_with_a_length_head_a_call_drafts_until_its_drafted_steps_show_drafting_loses():
    # a plain step 1 s; a drafted one 1.25 s: 1 token is 0.8x plain's rate, 4 tokens 3.2x. Drafted steps are noisy
    # (half of them accept nothing on code): a call that stopped at its first losing step stopped where drafting
    # paid; one that stops once the bound says drafting loses goes on through them, and stops a steady loser soon
    costs = {(1, 1): 1.0, (1, 16): 1.25}
    noisy = VerificationPlanner(CostTable(step_s=dict(costs)), 16, 1, torch.device("cpu"), length_head=True)
    noisy._promoted = True  # a probe's block would have paid
    assert _drafted_run(noisy, [1, 1, 4], 1.25) == 40  # 0.8x, 0.8x, 3.2x, ...: never stopped
    steady = VerificationPlanner(CostTable(step_s=dict(costs)), 16, 1, torch.device("cpu"), length_head=True)
    steady._promoted = True
    # 0.8x every step: the bound 0.8 + sqrt(0.5 / (n + 1) / n) (the spread all prior) falls under 1 at the 4th step
    assert _drafted_run(steady, [1], 1.25) == 4
    # stopped, it starts again on the mean itself, not its bound (exploring is paid for only while drafting): after
    # drafted steps that a promoted probe started
    steady.untimed()  # (a plain step's timing would start the table's plain-cost window anew)
    steady._observe([0], 1, [0], [0], 1.0)  # the plain step it chose
    steady._add_drafted_sample(1, 1.0, 0.5)  # a drafted step at 2x: the mean 5 / 5.5 = 0.91, its bound above 1
    assert steady.width([0], 16) == 1 and not steady._shadow_now
    steady._add_drafted_sample(1, 4.0, 1.25)  # and one at 3.2x: the mean 9 / 6.75 = 1.33
    assert steady.width([0], 16) == 16 and not steady._shadow_now


def test_with_a_length_head_a_probes_block_is_a_sample_of_the_pairs_rate_at_the_heads_width(monkeypatch):
    costs = {(1, 1): 1.0, (1, 2): 1.2, (1, 16): 2.0}
    table = CostTable(step_s=dict(costs), draft_s={1: 0.2}, probe_s={1: 0.2}, drafted_speedup={1: 0.9})
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
    planner._shadow_now = True  # this step is a probe
    prediction = torch.tensor([6 / 16])  # the head expects 5 drafts accepted
    drafts = SimpleNamespace(
        tokens=torch.full((1, 15), 7), num_drafts=torch.tensor([15]), length_prediction=prediction
    )
    assert planner.after_draft([0], drafts).tolist() == [0]  # a probe verifies nothing
    width = planner._head_width([0], prediction, torch.tensor([15]))[0]
    assert 2 < width < 16
    # one draft matched the target's token, which makes drafting pay here (`shadow_gain`): the probe ends, its block
    # having committed 2 tokens so far
    planner.score_shadows([0], [[7]])
    assert planner._promoted and not planner._shadows
    # the pair's rate moves by 2 tokens over the width's cost; the call's own drafted steps are only real ones
    # (counted there, probes' lucky blocks started drafting where it loses: BENCHMARKS.md section 27)
    assert planner._drafted == {}
    speedup = 2 / table.cost(1, width)
    assert table.drafting_speedup(1) == pytest.approx(0.9 + planner_module.DRAFTED_EMA * (speedup - 0.9))
    # without `PROBE_SAMPLES` (the rule before section 29) a probe leaves the rate alone
    monkeypatch.setattr(planner_module, "PROBE_SAMPLES", False)
    table = CostTable(step_s=dict(costs), draft_s={1: 0.2}, probe_s={1: 0.2}, drafted_speedup={1: 0.9})
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
    planner._shadow_now = True
    planner.after_draft([0], drafts)
    planner.score_shadows([0], [[7]])
    assert planner._promoted and table.drafting_speedup(1) == 0.9


def test_with_a_length_head_a_call_drafts_at_once_where_drafting_paid_and_probes_at_the_pace_across_calls():
    # `START_ON_RATE` (BENCHMARKS.md sections 28, 29): a call whose pair's drafting paid lately drafts from its first
    # step (an answer's first steps are where a code answer's drafts are accepted most), with no probe first
    costs = {(1, 1): 1.0, (1, 2): 1.3, (1, 16): 2.0}
    table = CostTable(step_s=dict(costs), draft_s={1: DRAFT_S}, probe_s={1: DRAFT_S}, drafted_speedup={1: 1.3})
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
    assert planner.width([0], 16) == 16 and not planner._shadow_now
    # where it lost, plain steps, with probes at the budget's pace counted across calls: a call of 64 tokens whose
    # own plain steps had to reach the floor (here 20) would probe once at most, and never again
    floor = math.ceil(DRAFT_S / planner_module.PROBE_BUDGET)
    for idle, first_probe in ((floor, 0), (floor - 5, 5)):
        table = CostTable(step_s=dict(costs), draft_s={1: DRAFT_S}, probe_s={1: DRAFT_S}, drafted_speedup={1: 0.7})
        table.idle_steps = idle
        planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
        history = _drive(planner, 8, agrees=lambda step: False, costs=costs)
        assert [i for i, (drafted, _) in enumerate(history) if drafted] == [first_probe], idle
        assert all(width == 1 for _, width in history)


def test_a_probe_whose_block_would_have_paid_resumes_drafting():
    costs = {(1, 1): 1.0, (1, 2): 1.2, (1, 16): 2.0}
    planner = _planner(costs, acceptance=0.05)  # the last call's prompts did not draft well
    history = _drive(planner, 40, agrees=lambda step: step >= 10, costs=costs)
    first_probe = next(i for i, (drafted, _) in enumerate(history) if drafted and i >= 10)
    assert all(width == 1 for _, width in history[: first_probe + 1])  # the probe itself verified nothing
    assert max(width for _, width in history[first_probe:]) > 2  # then it drafts, and wide


def test_a_new_call_probes_at_once_and_keeps_the_measured_costs():
    # where drafting did not pay lately, the last call's prompts say little about this call's: it probes first, and
    # the probe's block decides; the measured costs and the probes' back-off stay
    costs = {(1, 1): 1.0, (1, 2): 1.4}
    table = CostTable(step_s=dict(costs), drafted_speedup={1: 0.7}, probe_interval=256, idle_steps=100)
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
    assert table.probe_interval == planner_module.CALL_PROBE_INTERVAL  # kept, up to a bound
    assert table.step_s == costs and table.drafted_speedup == {1: 0.7}
    history = _drive(planner, planner_module.FIRST_PROBE_INTERVAL + 2, agrees=lambda step: False, costs=costs)
    assert history[0] == (True, 1)  # a probe: the block drafted, only the anchor verified
    assert all(width == 1 for _, width in history)  # its block disagreed at once: no drafted step follows


def test_a_calls_first_probe_waits_for_the_budget_unless_drafting_paid_lately():
    # at batch 8 a call's first probe reads the whole prompt into the drafter: here a whole plain step's cost, so
    # within the budget one probe per 50 plain steps, counted across calls
    costs = {(1, 1): 1.0, (1, 2): 1.4}
    floor = math.ceil(1.0 / planner_module.PROBE_BUDGET)
    for drafted_speedup, idle, first_probe in ((0.7, 0, floor), (0.7, floor - 10, 10), (1.5, 0, 0)):
        table = CostTable(step_s=dict(costs), drafted_speedup={1: drafted_speedup}, idle_steps=idle)
        planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
        history = _drive(planner, floor + 2, agrees=lambda step: False, costs=costs, draft_s=1.0)
        probes = [i for i, (drafted, _) in enumerate(history) if drafted]
        assert probes[0] == first_probe, (drafted_speedup, idle)


def test_a_step_marked_untimed_leaves_the_costs_alone_but_counts_its_acceptance():
    planner = _planner({(1, 1): 1.0, (1, 2): 1.4}, acceptance=0.5)
    planner.begin()
    planner.untimed()  # e.g. the draft head timed its dtypes during this step's draft
    planner.observe([0], 3, [2], [2])
    assert (1, 3) not in planner.table.step_s and planner.table.drafted_speedup == {}
    assert float(planner.successes[0]) == 2.0
    planner.begin()
    planner.observe([0], 3, [2], [2])  # the mark lasts one step
    assert (1, 3) in planner.table.step_s


def test_one_slow_step_does_not_set_a_price_and_plain_steps_are_timed_before_anything_is_compared():
    table = CostTable()
    table.observe(8, 1, 0.56)  # the process's first timed plain step, slowed by the machine
    assert not table.plain_known()
    table.observe(8, 1, 0.15)
    table.observe(8, 1, 0.16)
    assert table.plain_known() and table.cost(8, 1) == pytest.approx(0.16)  # the median of the window
    for _ in range(planner_module.COST_WINDOW):
        table.observe(8, 1, 0.2)
    assert table.cost(8, 1) == pytest.approx(0.2)  # and it follows the machine
    assert CostTable(step_s={(8, 1): 0.15}).plain_known()  # a cost from a profile file is trusted


def test_drafting_that_loses_to_plain_steps_stops_even_after_a_slowed_first_plain_step():
    # batch 8 on a CPU: a drafted step commits 13 tokens in 0.33 s (39 tokens/s), a plain one 8 in 0.15 s (53/s).
    # A moving average started from a slowed first plain step (0.56 s) priced plain steps at 0.35 s (23 tokens/s)
    # after three, so drafting looked 1.7x faster, and the planner, no longer stepping plainly, never corrected it.
    rows = list(range(8))
    planner = VerificationPlanner(CostTable(), 16, 8, torch.device("cpu"), length_head=True)
    for seconds in (0.56, 0.15, 0.15):
        assert planner.width(rows, 16) == 1
        planner._observe(rows, 1, [0] * 8, [0] * 8, seconds)
    planner._promoted = True  # a probe's block would have paid: a drafted step measures what drafting costs
    # each drafted step at 0.74x plain's rate: the upper bound 0.74 + sqrt(0.5 / (n (n + 1))) (`DRAFTING_BOUND_Z`,
    # the spread all prior) falls under 1 at the third
    for _ in range(3):
        assert planner.width(rows, 16) == 16
        planner._observe(rows, 3, [1, 1, 1, 1, 1, 0, 0, 0], [2] * 8, 0.33)
    assert planner.width(rows, 16) == 1


@pytest.mark.parametrize(
    "bound, earlier, drafted_steps",
    [(0.0, None, 1), (0.0, 0.9, 1), (0.0, 1.25, 3), (1.0, None, 4), (1.0, 0.9, 3), (1.0, 1.25, 7)],
)
def test_a_calls_first_unlucky_drafted_steps_stop_it_as_the_earlier_calls_rate_says(
    monkeypatch, bound, earlier, drafted_steps
):
    # batch 1: a plain step 40 ms; a drafted one 50 ms that accepted nothing (0.8x plain's rate). Alone, the first such
    # step stops the call; beside two steps at the earlier calls' 1.25x it takes three: (0.8 n + 2.5) / (n + 2) < 1.
    # With section 27's bound (`DRAFTING_BOUND_Z` = 1), the mean plus its spread's standard error: with no earlier
    # rate 0.8 + sqrt(0.5 / (n + 1) / n) < 1 from n = 4; beside 0.9x, (0.8 n + 1.8) / (n + 2) + sqrt(0.5 / (n + 1)
    # / (n + 2)) < 1 from n = 3; beside 1.25x, from n = 7.
    monkeypatch.setattr(planner_module, "DRAFTING_BOUND_Z", bound)
    table = CostTable(step_s={(1, 1): 0.04, (1, 16): 0.05})
    if earlier is not None:
        table.drafted_speedup[1] = earlier
    planner = VerificationPlanner(table, 16, 1, torch.device("cpu"), length_head=True)
    planner._promoted = True
    assert _drafted_run(planner, [1], 0.05) == drafted_steps
    assert earlier is None or table.drafting_speedup(1) < earlier  # the table follows what this call measured


def test_a_kernel_trial_step_counts_in_the_rates_and_prices_its_width_until_a_timed_step_does():
    rows = list(range(8))
    table = CostTable(step_s={(8, 1): 0.15}, draft_s={8: 0.2})
    planner = VerificationPlanner(table, 16, 8, torch.device("cpu"), length_head=True)
    planner._promoted = True
    assert planner.width(rows, 16) == 16
    planner.trial()  # this step's forward timed a candidate kernel
    planner._observe(rows, 2, [1] * 8, [1] * 8, 0.40)
    # no drafted step again just to measure: the trial priced width 2, and the call's rate has the step
    assert not planner._promoted and table.step_s[(8, 2)] == pytest.approx(0.40)
    assert planner._drafted[8] == pytest.approx([16.0, 0.40, 1, 0.75, 0.75**2])  # 40 tokens/s over 53.3
    planner.trial()
    planner._observe(rows, 2, [1] * 8, [1] * 8, 0.35)  # trials price by the fastest of them (the kernel kept)
    assert table.step_s[(8, 2)] == pytest.approx(0.35)
    planner._observe(rows, 2, [1] * 8, [1] * 8, 0.38)  # the first timed step replaces the trials' price
    assert table.step_s[(8, 2)] == pytest.approx(0.38)
    planner.trial()
    planner._observe(rows, 2, [1] * 8, [1] * 8, 0.30)  # and later trials leave it alone
    assert table.step_s[(8, 2)] == pytest.approx(0.38)


def test_a_probes_cost_is_kept_apart_from_a_drafted_steps_draft():
    # a call's first probe reads the whole prompt into the drafter; a drafted step's draft reads a few tokens
    rows = list(range(8))
    table = CostTable(step_s={(8, 1): 0.15, (8, 2): 0.3})
    assert table.draft(8) is None and table.probe(8) is None
    planner = VerificationPlanner(table, 16, 8, torch.device("cpu"), length_head=True)
    planner._shadow_drafted = True  # a probe step: 0.40 s where a plain step takes 0.15
    planner._observe(rows, 1, [0] * 8, [0] * 8, 0.40)
    assert table.probe(8) == pytest.approx(0.25) and table.draft(8) == pytest.approx(0.25)  # all that is known
    planner._promoted = True
    planner.begin()
    planner.width(rows, 16)
    planner.after_draft(rows, SimpleNamespace(num_drafts=torch.ones(8, dtype=torch.long), length_prediction=None))
    planner._drafted_at = planner._started + 0.06  # the draft ended 60 ms into the step
    planner._observe(rows, 2, [1] * 8, [1] * 8, 0.3)
    assert table.draft(8) == pytest.approx(0.06) and table.probe(8) == pytest.approx(0.25)
    # the budget is the probe's: one per ceil(0.25 / (0.02 x 0.15)) plain steps
    assert planner.probe_floor(8) == math.ceil(0.25 / (planner_module.PROBE_BUDGET * 0.15))


@pytest.mark.parametrize("seconds, again", [(0.6, False), (0.2, True)])
def test_a_drafted_step_slowed_by_the_heads_trials_drafts_again_only_if_it_beat_plain_steps_even_so(seconds, again):
    rows = list(range(8))
    table = CostTable(step_s={(8, 1): 0.15}, probe_s={8: 0.25})
    planner = VerificationPlanner(table, 16, 8, torch.device("cpu"), length_head=True)
    planner._promoted = True
    assert planner.width(rows, 16) == 16
    planner.untimed()  # the draft timed the head's dtypes
    planner._observe(rows, 2, [1] * 8, [1] * 8, seconds)  # 16 tokens: 27/s at 0.6 s, 80/s at 0.2 s; plain 53/s
    assert (2 not in {w for _, w in table.step_s}) and planner._promoted == again
    assert planner.width(rows, 16) == (16 if again else 1)


def test_the_loop_keeps_the_draft_heads_dtype_trials_out_of_the_cost_table(monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target)
    marked, timed = [], []
    monkeypatch.setattr(VerificationPlanner, "untimed", lambda self: marked.append(True))
    monkeypatch.setattr(planner_module, "FIRST_PROBE_INTERVAL", 1)
    real_timed = draft_head_module._timed

    def recording(head, hidden, dtype, *args):
        timed.append(dtype)
        return real_timed(head, hidden, dtype, *args)

    monkeypatch.setattr(draft_head_module, "_timed", recording)
    config = GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD, adaflash_length_policy="planned"
    )
    profile_for(target, drafter).reset()  # the pair measures its draft head's dtype afresh
    config.adaflash_verify_layout = "linear"  # no layout trials: every mark is a dtype trial (test_verify_layout.py)
    for prompt in PROMPTS:  # until the options took turns: float32 first, then the bfloat16 copy
        target.generate(torch.tensor([prompt]), assistant_model=drafter, generation_config=config)
        if torch.bfloat16 in timed:
            break
    # a float32 head on a CPU decides its dtype from TRIALS timed calls of each dtype per number of projected
    # positions (a probe's block and a drafted step's few drafts are two counts): the drafts that timed the bfloat16
    # copy are marked, and only they (a float32 trial is timed as a trial, in drafting's rates)
    choice = profile_for(target, drafter).head_kernels
    counts = {key[1] for key in [*choice.choices, *choice.timings]}
    bfloat16 = sum(dtype == torch.bfloat16 for dtype in timed)
    assert counts and torch.float32 in timed and 0 < bfloat16 <= HEAD_KERNEL_TRIALS * len(counts)
    assert len(marked) == bfloat16


@pytest.mark.parametrize("kept_out", [True, False])
def test_a_calls_first_draft_reading_every_prompt_is_kept_out_of_the_drafts_price(monkeypatch, kept_out):
    target = tiny_target()
    drafter = tiny_drafter(target)
    profile_for(target, drafter).reset()
    clock = TickingClock()  # a plain step costs 1 s and a draft 1 s more
    monkeypatch.setattr(planner_module, "time", clock)
    reads, draft = [], AdaFlashCandidateGenerator.draft

    def reading(self, *args, **kwargs):
        if self.reads_prompts:
            reads.append(True)
            clock.now += 10.0  # reading every row's prompt costs ten more
        return draft(self, *args, **kwargs)

    monkeypatch.setattr(AdaFlashCandidateGenerator, "draft", reading)
    if not kept_out:  # the negative control: nothing marks the read
        monkeypatch.setattr(VerificationPlanner, "read_prompts", lambda self: None)
    _forced(monkeypatch, lambda step, rows, cap: [2] * len(rows))  # the first step drafts every row
    ids, mask = left_pad(PROMPTS[:3])
    _generate(target, drafter, ids, mask, None, adaflash_draft_head_dtype="same", adaflash_verify_layout="linear")
    prices = profile_for(target, drafter).cost_table(torch.device("cpu"), torch.float32).draft_s
    assert reads == [True] and prices
    assert (set(prices.values()) == {1.0}) == kept_out


def test_a_step_whose_draft_head_timed_a_kernel_is_priced_as_a_trial(monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target)
    profile_for(target, drafter).reset()
    marked, timed = [], []
    monkeypatch.setattr(VerificationPlanner, "trial", lambda self: marked.append(True))
    monkeypatch.setattr(VerifyLayout, "layout", lambda self, tokens: ("linear", False))  # no verification trials
    record = MeasuredChoice.record
    monkeypatch.setattr(MeasuredChoice, "record", lambda self, *args: timed.append(args) or record(self, *args))
    _forced(monkeypatch, lambda step, rows, cap: [2] * len(rows))
    ids, mask = left_pad(PROMPTS[:1])
    _generate(target, drafter, ids, mask, None, adaflash_draft_head_dtype="same")
    assert len(marked) == len(timed) > 0  # each kernel trial of the head, and nothing else


def test_the_cost_table_is_kept_per_pair_for_the_process():
    target = tiny_target()
    first, second = tiny_drafter(target), tiny_drafter(target)
    cpu = torch.device("cpu")
    table = profile_for(target, first).cost_table(cpu, torch.float32)
    assert profile_for(target, first).cost_table(cpu, torch.float32) is table
    assert profile_for(target, second).cost_table(cpu, torch.float32) is not table
    assert profile_for(target, first).cost_table(cpu, torch.bfloat16) is not table
    profile_for(target, first).reset()
    assert profile_for(target, first).cost_table(cpu, torch.float32) is not table


# ------------------------------------------------------------------ with a length head


def _head_planner(step_s: dict, rows: int = 1, **table) -> VerificationPlanner:
    return VerificationPlanner(
        CostTable(step_s=dict(step_s), **table),
        block_size=16,
        batch_size=rows,
        device=torch.device("cpu"),
        length_head=True,
        probe_first=False,
    )


def test_with_a_length_head_the_width_follows_each_blocks_prediction():
    # widths 2..16 measured, a CPU-like cost: 16 tokens cost twice a plain step, the drafter a third of one
    costs = {(1, 1): 1.0, **{(1, w): 1.3 + 0.05 * w for w in range(2, 17)}}
    planner = _head_planner(costs)
    drafts = torch.tensor([15])
    # a block the head expects to be accepted whole is verified whole; one it expects to fail at once, short
    assert int(planner.refine([0], torch.tensor([15 / 16]), drafts)[0]) >= 12
    assert int(planner.refine([0], torch.tensor([1 / 16]), drafts)[0]) == 1
    middle = int(planner.refine([0], torch.tensor([4 / 16]), drafts)[0])
    assert 2 <= middle <= 8
    assert planner.last_prediction["predicted_tokens"] > 1
    # a row's token budget still caps it
    assert int(planner.refine([0], torch.tensor([15 / 16]), torch.tensor([3]))[0]) == 3


def test_with_a_length_head_it_drafts_while_drafted_steps_beat_plain_ones_and_probes_otherwise():
    costs = {(1, 1): 1.0, (1, 2): 1.4, (1, 16): 2.3}
    assert _head_planner(costs, drafted_speedup={1: 1.3}).width([0], 16) == 16  # drafts: refine cuts the block
    losing = _head_planner(costs, drafted_speedup={1: 0.7})
    history = _drive(losing, 30, agrees=lambda step: False, costs=costs)
    probes = [i for i, (drafted, _) in enumerate(history) if drafted]
    assert history[0] == (False, 1) and probes  # plain while drafting loses, with probes
    assert all(width == 1 for _, width in history)  # which verify nothing
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps)  # ever rarer
    # the first drafted step of a pair (nothing drafted measured) verifies the cheapest drafted width
    fresh = _head_planner({(1, 1): 1.0})
    assert fresh.width([0], 16) == 16 and int(fresh.refine([0], torch.tensor([0.9]), torch.tensor([15]))[0]) == 1


def test_the_head_calibration_follows_what_the_target_accepts():
    costs = {(1, 1): 1.0, **{(1, w): 1.3 + 0.05 * w for w in range(2, 17)}}
    planner = _head_planner(costs)
    for _ in range(20):  # the head promises long blocks, the target accepts one draft of each
        planner.begin()
        drafts = planner.refine([0], torch.tensor([12 / 16]), torch.tensor([15]))
        planner.observe([0], int(drafts[0]) + 1, [1], [int(drafts[0])])
        planner.table.step_s = dict(costs)
    assert planner.table.head_scale < 0.5
    assert int(planner.refine([0], torch.tensor([12 / 16]), torch.tensor([15]))[0]) <= 4


def test_a_width_priced_above_a_wider_one_is_priced_as_the_wider():
    # one slow width-3 step priced it above width 4: never chosen, it would never be measured again
    table = CostTable(step_s={(1, 1): 1.0, (1, 2): 1.3, (1, 3): 2.4, (1, 4): 1.6, (1, 8): 2.0})
    assert table.cost(1, 3) == 1.6 and table.cost(1, 2) == 1.3 and table.cost(1, 4) == 1.6
    assert table.cost(1, 6) == 1.8  # between measured widths, still linear
    assert table.cost(1, 1) == 1.0  # a plain step is its own
    assert table.path_costs(1, [3], drafted=False)[0] <= table.path_costs(1, [4], drafted=False)[0]


def test_a_kernel_trial_prices_a_width_at_most_what_timed_widths_imply():
    table = CostTable(step_s={(1, 1): 1.0}, draft_s={1: 0.2})
    table.observe(1, 2, 2.0, provisional=True)  # the first trial of width 2 ran the slow candidate kernel
    assert table.cost(1, 2) == pytest.approx(1.2)  # the narrowest is priced at most a plain step and the draft
    table.observe(1, 3, 2.4, provisional=True)
    assert table.cost(1, 3) == 2.4  # trials only: priced by them
    table.observe(1, 2, 1.3)  # width 2 timed with its kernel kept
    assert table.cost(1, 2) == 1.3
    assert table.cost(1, 3) == pytest.approx(1.95)  # at most width 2's cost in proportion to width
    table.observe(1, 4, 1.5)
    assert table.cost(1, 3) == pytest.approx(1.4)  # between timed widths, at most the line between them
    table.observe(1, 3, 1.45)
    assert table.cost(1, 3) == 1.45


def test_a_probe_that_timed_a_one_off_trial_prices_probes_only_until_a_timed_one():
    table = CostTable(step_s={(1, 1): 1.0})
    table.observe_probe(1, 1.6, provisional=True)  # it timed the draft head's dtypes
    table.observe_probe(1, 1.2, provisional=True)
    assert table.probe(1) == 1.2 and table.probe(1, settled=True) is None and table.settled_probes() == {}
    planner = VerificationPlanner(table, block_size=16, batch_size=1, device=torch.device("cpu"), probe_first=False)
    assert planner.probe_floor(1) == 0  # a one-off does not stretch the probes' budget
    table.observe_probe(1, 0.3)
    assert table.probe(1) == 0.3 and table.settled_probes() == {1: 0.3}  # replaced, not averaged in
    assert planner.probe_floor(1) == math.ceil(0.3 / planner_module.PROBE_BUDGET)
    table.observe_probe(1, 2.0, provisional=True)  # a later trial does not move a timed price
    assert table.probe(1) == 0.3


def test_a_probe_is_a_sample_of_drafting_s_rate_only_once_a_drafted_width_is_priced():
    planner = _head_planner({(1, 1): 1.0}, probe_s={1: 1.5})
    planner._shadows = {0: [[7, 7, 7], 3, True, False]}  # a probe whose block would have matched three drafts
    planner._observe_shadow_rate(4)
    assert planner.table.drafted_speedup == {}  # priced by a plain step and the probe's 1.5, it would say 1.6
    planner.table.step_s[(1, 4)] = 1.6
    planner._observe_shadow_rate(4)
    assert planner.table.drafted_speedup == {1: pytest.approx(4 / 1.6)}


def test_the_planner_with_a_length_head_is_exact(unbudgeted_probes):
    target = tiny_target()
    prompts = PROMPTS[:3]
    references = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    full = [p + r for p, r in zip(prompts, references)]
    for drafter in (
        tiny_drafter(target, use_length_head=True),
        oracle_drafter(target, full, use_length_head=True, corrupt=lambda row, anchor: {1 + (row + anchor) % 5}),
    ):
        widths = []
        for _ in range(2):
            out, stats = _generate(target, drafter, ids, mask, None)
            assert rows_of(out, prompts) == references
            widths += [step.verify_width for step in stats.steps]
    # the oracle's calls drafted (in either one: the choice follows this machine's timings, noisy under load)
    assert max(widths) > 1


def test_a_probe_with_no_room_to_draft_is_timed_as_the_plain_step_it_was():
    planner = _planner({(1, 1): 1.0, (1, 2): 1.2}, acceptance=0.05)
    planner.table.draft_s = {1: 0.2}
    planner.plain_streak = planner.table.probe_interval  # a probe is due
    assert planner.before_draft([0], torch.tensor([0])).tolist() == [0]  # the token budget leaves no draft
    verified = SimpleNamespace(
        width=1, accepted=torch.tensor([0]), depth=torch.tensor([0]), committed=torch.tensor([[5]]), by_source=None
    )
    planner.after_verify([0], verified, torch.tensor([1]))
    assert planner.table.draft_s == {1: 0.2}  # no draft ran: its cost is not measured from this step
    assert planner.table.step_s[(1, 1)] != 1.0  # the step is priced as the plain step it was


# ------------------------------------------------------------------ probes through the whole loop


def _counting(drafter) -> list:
    """A list that grows by one per drafter forward."""
    forwards = []
    drafter.register_forward_hook(lambda *args: forwards.append(1))
    return forwards


def _probes(stats, forwards: list) -> int:
    """The planner's probes among the steps of `stats`: drafter forwards (``forwards``, counted over the same calls)
    on steps that verified the anchor only, i.e. all but those of the drafted steps."""
    return len(forwards) - sum(step.verify_width > 1 for step in stats.steps)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_greedy_stays_exact_with_probes(kind, batch_size, unbudgeted_probes):
    target = tiny_target()
    prompts = PROMPTS[:batch_size]
    references = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    if kind == "random":
        drafter = tiny_drafter(target)
    else:  # right now and then, so that probes both fail and promote drafting
        full = [p + r for p, r in zip(prompts, references)]
        drafter = oracle_drafter(target, full, corrupt=lambda row, anchor: {1} if anchor % 3 == 0 else ())
    forwards, probes = _counting(drafter), 0
    for _ in range(2):
        forwards.clear()
        out, stats = _generate(target, drafter, ids, mask, None)
        assert rows_of(out, prompts) == references
        probes += _probes(stats, forwards)
    assert probes >= 2  # every call starts with one


def test_planned_sampling_with_probes_matches_the_processed_distribution(unbudgeted_probes):
    target = tiny_target(vocab_size=12, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=11)
    drafter.config.length_policy = "planned"
    torch.manual_seed(0)
    samples, probes, forwards = [], 0, _counting(drafter)
    for _ in range(100):
        forwards.clear()
        with adaflash_hf.record_stats() as stats:
            # the model's own kernel: the first calls' kernel trials (verify_layout.py) would price their plain steps
            # only provisionally, which delays the first calls' probes past their few tokens
            out = target.generate(
                torch.tensor([PROMPT] * 20),
                max_new_tokens=NEW,
                assistant_model=drafter,
                generation_config=GenerationConfig(adaflash_verify_layout="linear"),
                **SAMPLING,
            )
        samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
        probes += _probes(stats, forwards)
    # each call starts with a probe, once the pair has timed `PLAIN_SAMPLES` plain steps: here the first two calls'
    # (of their two steps, only the first has room for a draft)
    assert probes >= 98
    assert p_value(samples, exact_joint(target)) > 1e-3


def test_a_never_agreeing_drafter_costs_a_bounded_number_of_drafts_and_no_verification(monkeypatch):
    """Counted through real generate() calls, not timed: the step costs are held at a CPU's (verifying 16 tokens
    costs 2 plain steps, a draft a fifth of one) so that the planner's choices do not depend on this machine."""
    for name in ("observe", "observe_draft", "observe_drafted"):
        monkeypatch.setattr(CostTable, name, lambda self, *args, **kwargs: None)
    target = tiny_target()
    prompts = PROMPTS[:1]
    references = [alone(target, p, max_new_tokens=48, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    # its first draft is always wrong: it never agrees with the target
    drafter = oracle_drafter(target, [p + r for p, r in zip(prompts, references)], corrupt=lambda row, anchor: {1})
    table = profile_for(target, drafter).cost_table(target.device, target.dtype)
    table.step_s = {(1, 1): 1.0, (1, 2): 1.2, (1, drafter.config.block_size): 2.0}
    table.draft_s = {1: 0.2}
    forwards = []
    drafter.register_forward_hook(lambda *args: forwards.append(1))
    per_call = []
    for _ in range(5):
        forwards.clear()
        config = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=PAD, **PLANNED)
        with adaflash_hf.record_stats() as stats:
            out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
        assert rows_of(out, prompts) == references
        verified_beyond_anchor = sum(step.verify_width - 1 for step in stats.steps)
        per_call.append((len(stats.steps), len(forwards), verified_beyond_anchor))
        # the stats name each step: the drafter's forwards are the probes, and the rest plain steps
        kinds = stats.summary()["steps_by_kind"]
        assert kinds.get("probe", 0) + kinds.get("drafted", 0) == len(forwards)
        assert kinds.get("plain", 0) + kinds.get("probe", 0) + kinds.get("drafted", 0) == len(stats.steps)
    for steps, drafts, verified in per_call[1:]:
        # after the first call: nothing but anchors verified, and a probe every 16 or more steps (a first one, then
        # one after `CALL_PROBE_INTERVAL` plain steps, then ever rarer)
        assert verified == 0
        assert drafts <= 1 + steps // planner_module.CALL_PROBE_INTERVAL
    # what the drafts cost at these prices (a fifth of a plain step each): under 2% of the plain steps' time
    steps, drafts = sum(s for s, _, _ in per_call[1:]), sum(d for _, d, _ in per_call[1:])
    assert drafts * 0.2 / steps < 0.02, per_call
