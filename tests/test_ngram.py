"""N-gram paths merged into the draft tree (`adaflash_ngram`): the suffix index equals one built from scratch and its
lookups a brute-force scan; merged trees keep one node per prefix within the budget; outputs stay plain decoding's,
greedy token for token and sampling in distribution (with a negative control on the merged paths)."""

import random

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD, PROMPTS, alone, common_token, left_pad, rows_of
from test_generate_sampling import NEW, PROMPT, SAMPLING, _next_token_probs, exact_joint, p_value
from test_generate_tree import _runner_up_oracle
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf.generation import tree as tree_module
from adaflash_hf.generation.ngram import SCAN_PER_CONTINUATION, NgramIndex, SuffixIndex
from adaflash_hf.generation.options import AdaFlashGenerationOptions
from adaflash_hf.generation.planner import PRIOR_ACCEPTANCE, CostTable, VerificationPlanner
from adaflash_hf.generation.tree import DRAFTER, PATHS, build_trees, walk_trees

# ------------------------------------------------------------------ the suffix index


def _brute_force(context: list[int], max_match: int, min_match: int, length: int, continuations: int):
    """The documented lookup by scanning the whole context (no index)."""
    end = len(context)
    for n in range(min(max_match, end - 1), min_match - 1, -1):
        suffix = context[end - n :]
        starts = [p for p in range(end - 1, n - 1, -1) if context[p - n : p] == suffix]  # most recent first
        if not starts:
            continue
        chosen = []
        for scanned, start in enumerate(starts, 1):
            found = context[start : start + length]
            if any(c[: len(found)] == found for c in chosen):
                pass
            elif any(found[: len(c)] == c for c in chosen):
                chosen = [found if found[: len(c)] == c else c for c in chosen]
                # several chosen ones cannot both be prefixes of `found`: they would be prefixes of each other
            else:
                chosen.append(found)
            if len(chosen) >= continuations or scanned >= SCAN_PER_CONTINUATION * continuations:
                break
        return n, chosen
    return 0, []


@pytest.mark.parametrize("seed", range(12))
def test_incremental_index_equals_scratch_and_lookups_equal_a_scan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat a lot, large ones rarely
    max_match = rng.randint(1, 4)
    min_match = rng.randint(1, max_match)
    context = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
    index = SuffixIndex(max_match, min_match, context)
    for _ in range(30):
        new = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        if rng.random() < 0.3:  # copy an earlier span, as generated text does
            start = rng.randrange(len(context) + 1)
            new += context[start : start + rng.randint(1, 6)]
        index.extend(new)
        context += new
        scratch = SuffixIndex(max_match, min_match, context)
        assert index.tokens == scratch.tokens == context
        assert index.follow == scratch.follow
        for length in (1, 3, 10):
            for continuations in (1, 2, 4):
                got = index.lookup(length, continuations)
                assert got == _brute_force(context, max_match, min_match, length, continuations)
                n, paths = got
                for path in paths:  # each one follows an earlier occurrence of the matched suffix
                    assert 1 <= len(path) <= length and n >= min_match


def test_a_lookup_is_the_longest_match_most_recent_first():
    index = SuffixIndex(max_match=3, tokens=[7, 1, 2, 3, 9, 1, 2, 4, 4, 5, 1, 2])
    assert index.lookup(3, 1) == (2, [[4, 4, 5]])  # "1 2" last followed by 4 4 5
    assert index.lookup(3, 3) == (2, [[4, 4, 5], [3, 9, 1]])
    index.extend([3])
    assert index.lookup(2, 2) == (3, [[9, 1]])  # "1 2 3" occurred once
    assert SuffixIndex(2, tokens=[1, 2, 3]).lookup(5) == (0, [])  # nothing repeats
    assert SuffixIndex(2, tokens=[5, 5]).lookup(4) == (1, [[5]])  # the continuation ends at the context's end


def test_a_step_costs_the_same_however_long_the_context(monkeypatch):
    """Extending indexes one n-gram per match length and token; a lookup reads one entry per match length and scans
    a bounded number of occurrences, however often the suffix occurred (counted, not timed)."""
    from adaflash_hf.generation import ngram

    scanned = []
    real = ngram._add_distinct
    monkeypatch.setattr(ngram, "_add_distinct", lambda chosen, found: (scanned.append(found), real(chosen, found)))
    rng = random.Random(0)
    for size in (100, 5000):
        index = SuffixIndex(3, tokens=[rng.randrange(3) for _ in range(size)])  # every suffix occurred many times
        assert len(index.follow) <= 3 + 9 + 27  # the distinct n-grams, not the context, bound the table
        scanned.clear()
        _, paths = index.lookup(10, 2)
        assert len(paths) == 2 and len(scanned) <= 2 * SCAN_PER_CONTINUATION


def test_the_batch_index_follows_rows_and_cuts_paths():
    index = NgramIndex([[1, 2, 3, 1, 2], [4, 4], [6]], max_match=2)
    assert index.paths([10, 10, 10], 4, 1) == [[[3, 1, 2]], [[4]], []]
    assert index.paths([2, 10, 10], 4, 1, stop=[3]) == [[[3]], [[4]], []]  # room, and the first stop token ends it
    index.extend([[3], [], [6, 6]])
    index.select_rows([2, 0])
    assert index.paths([5, 5], 4, 1) == [[[6]], [[1, 2, 3]]]


# ------------------------------------------------------------------ merged trees


def _paths_of(tree, b):
    paths = {0: ()}
    for i, (token, parent) in enumerate(zip(tree.tokens[b].tolist(), tree.parents[b].tolist())):
        if tree.valid[b, i]:
            assert parent in paths  # parents come first
            paths[i + 1] = paths[parent] + (token,)
    return paths


def test_paths_merge_into_the_drafters_tree_once_within_the_budget():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6) * 3
    alone = build_trees(logits, torch.tensor([4, 4]), 9)
    top = logits.argmax(-1)[0].tolist()
    paths = [[[top[0], top[1], 5, 5], [top[0], 0]], [[3, 3, 3]]]
    merged = build_trees(logits, torch.tensor([4, 4]), 9, paths=paths, path_nodes=16)
    assert merged.num_nodes.tolist() == [8, 8]  # the budget holds
    for b in range(2):
        found = _paths_of(merged, b)
        assert len(set(found.values())) == len(found)  # one node per prefix
        sources = dict(zip(range(1, 9), merged.sources[b].tolist()))
        for path in paths[b]:
            for d in range(1, len(path) + 1):
                assert tuple(path[:d]) in found.values()
        for i, path in found.items():
            if i:
                is_path = any(tuple(p[: len(path)]) == path for p in paths[b])
                assert bool(sources[i] & PATHS) == is_path
    # row 0's paths share the drafter's first two nodes: those carry both sources
    row0 = {path: merged.sources[0, i - 1].item() for i, path in _paths_of(merged, 0).items() if i}
    assert row0[tuple(top[:1])] == row0[tuple(top[:2])] == DRAFTER | PATHS
    # the paths' own nodes are capped, the drafter fills the rest of the budget
    capped = build_trees(logits, torch.tensor([4, 4]), 9, paths=paths, path_nodes=1)
    assert (capped.sources[1] & PATHS).ne(0).sum() == 1 and capped.num_nodes.tolist() == [8, 8]
    # without the drafter, the paths alone (a row without paths has no nodes)
    only = build_trees(None, torch.tensor([0, 0]), 9, paths=[[[4, 5]], []], path_nodes=16)
    assert only.num_nodes.tolist() == [2, 0] and only.sources[0].tolist() == [PATHS, PATHS]
    assert alone.sources.eq(DRAFTER).all()


# ------------------------------------------------------------------ greedy exactness


def _generate(target, drafter, ids, mask, eos, max_new_tokens=30, **kwargs):
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        adaflash_ngram=True,
        **kwargs,
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
    return out, stats


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_with_merged_paths_equals_plain_greedy(family, batch_size):
    target = tiny_target(family)
    prompts = PROMPTS[:batch_size]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = common_token(free)  # tiny random models loop: the EOS lies inside spans the paths copy
    references = [alone(target, p, max_new_tokens=30, eos_token_id=eos) for p in prompts]
    ids, mask = left_pad(prompts)
    if batch_size == 1:
        mask = None
    full_refs = [p + r for p, r in zip(prompts, free)]
    drafters = {
        "random": tiny_drafter(target),
        "oracle, runner-up right": _runner_up_oracle(target, full_refs, lambda row, anchor: {1 + (row + anchor) % 5}),
    }
    settings = [
        {},
        {"adaflash_tree_budget": 6, "adaflash_ngram_nodes": 3, "adaflash_ngram_continuations": 1},
        {"adaflash_length_policy": "planned", "adaflash_ngram_max_match": 1},
    ]
    copied = 0
    for name, drafter in drafters.items():
        for kwargs in settings:
            out, stats = _generate(target, drafter, ids, mask, eos, **kwargs)
            for got, want in zip(rows_of(out, prompts), references):
                assert got[: len(want)] == want, (name, kwargs)
                assert all(t == PAD for t in got[len(want) :]), (name, kwargs)
            assert max(step.verify_width for step in stats.steps) <= kwargs.get("adaflash_tree_budget", 8 + 16)
            copied += stats.source_acceptance("ngram")["accepted"]
    assert copied > 0


def test_contexts_with_many_matches_and_with_none():
    target = tiny_target()
    drafter = tiny_drafter(target)
    many = [0] + [5, 9, 33, 17] * 6  # a prompt that repeats itself
    none = [0, 44]  # nothing repeats in the prompt: the first steps have no path
    for prompt in (many, none):
        want = alone(target, prompt, max_new_tokens=40, eos_token_id=None)
        out, stats = _generate(target, drafter, torch.tensor([prompt]), None, None, max_new_tokens=40)
        assert out[0, len(prompt) :].tolist() == want
        offered = [o for step in stats.steps for o in (step.ngram_offered or [0])]
        if prompt is none:
            assert offered[0] == 0
    assert stats.source_acceptance("ngram")["accepted"] > 0  # the generated text repeats itself later


def test_rows_leave_and_the_index_follows_them():
    """Batch 8 with an EOS that stops rows at different steps: every row's paths come from its own context."""
    target = tiny_target()
    prompts = PROMPTS
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = common_token(free)
    references = [alone(target, p, max_new_tokens=30, eos_token_id=eos) for p in prompts]
    ids, mask = left_pad(prompts)
    oracle = oracle_drafter(target, [p + r for p, r in zip(prompts, free)])
    for drafter in (tiny_drafter(target), oracle):
        out, stats = _generate(target, drafter, ids, mask, eos)
        for got, want in zip(rows_of(out, prompts), references):
            assert got[: len(want)] == want
        assert len({len(step.rows) for step in stats.steps}) > 1  # rows left the batch


@pytest.mark.parametrize("with_eos", [False, True])
def test_output_scores_and_returned_cache_follow_the_accepted_path(with_eos):
    """Returned scores and cache keep stopped rows in the batch, padded (with an EOS) as plain decoding pads them."""
    target = tiny_target()
    prompts = [[0] + [5, 9, 33] * 3, [0, 44], PROMPTS[2]]
    ids, mask = left_pad(prompts)
    eos = common_token([alone(target, p, max_new_tokens=20, eos_token_id=None) for p in prompts]) if with_eos else None
    common = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    plain = target.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **common)
    config = GenerationConfig(adaflash_ngram=True, output_scores=True, return_dict_in_generate=True, **common)
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=tiny_drafter(target))
    assert stats.source_acceptance("ngram")["accepted"] > 0
    assert torch.equal(out.sequences, plain.sequences)
    for got, want in zip(out.scores, plain.scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert out.cache.get_seq_length() == plain.cache.get_seq_length()


def test_the_planner_verifies_paths_without_the_drafter_when_it_does_not_pay():
    """A drafter that never agrees: the planner stops drafting, and still verifies the paths, undrafted."""
    target = tiny_target()
    prompt = [0] + [5, 9, 33, 17] * 6
    want = alone(target, prompt, max_new_tokens=60, eos_token_id=None)
    out, stats = _generate(
        target, tiny_drafter(target), torch.tensor([prompt]), None, None, 60, adaflash_length_policy="planned"
    )
    assert out[0, len(prompt) :].tolist() == want
    undrafted = [s for s in stats.steps if s.verify_width > 1 and not any(s.drafter_offered or [0])]
    assert undrafted and sum(a for s in undrafted for a in s.ngram_accepted) > 0
    assert undrafted == [s for s in stats.steps if s.kind == "paths"]  # the stats name them
    paths = stats.by_kind()["paths"]
    assert paths["steps"] == len(undrafted) and paths["emitted_tokens"] == sum(sum(s.emitted) for s in undrafted)


def test_undrafted_widths_are_costed_apart_and_explored_one_token_at_a_time():
    table = CostTable()
    table.observe(1, 1, 1.0)
    assert table.path_costs(1, [2], drafted=False)[0] == 1.0  # one token wider: the widest's cost, a lower bound
    assert table.path_costs(1, [6], drafted=False)[0] == 6.0  # wider still: in proportion to width, an upper bound
    table.observe_draft(1, 0.5)
    table.observe(1, 4, 2.0)
    table.observe(1, 8, 2.5)
    # forwards without the draft: 1 token 1.0 s, 4 tokens 1.5 s, 8 tokens 2.0 s
    assert table.path_costs(1, [6], drafted=False)[0] == pytest.approx(
        1.75
    )  # between the drafted widths, less the draft
    assert table.path_costs(1, [9], drafted=True)[0] == pytest.approx(2.5)  # the next width: 8's forward, + draft
    assert table.path_costs(1, [10], drafted=True)[0] == pytest.approx(2.0 * 10 / 8 + 0.5)
    table.observe_undrafted(1, 5, 1.2)
    assert table.path_costs(1, [5], drafted=False)[0] == 1.2 and table.path_costs(3, [5], drafted=False)[0] == 1.2
    assert table.cost(1, 5) != 1.2  # drafted costs do not see undrafted steps
    table.observe(3, 1, 2.0)  # a plain step of 3 rows costs two of 1 row: so does every width
    assert table.path_costs(3, [5], drafted=False)[0] == pytest.approx(2.4)


def test_a_path_width_is_priced_in_plain_steps_of_its_row_count():
    """A batch-8 step of 11 tokens a row costs four plain steps on an AVX2-only core (BENCHMARKS.md section 21): it
    must not be priced at the widest measured step's cost, nor at batch 1's seconds."""
    table = CostTable(step_s={(8, 1): 0.32})
    assert table.path_costs(8, [11], drafted=False)[0] == pytest.approx(11 * 0.32)
    table = CostTable(step_s={(8, 1): 0.3, (1, 1): 0.1, (1, 2): 0.15, (1, 3): 0.16}, draft_s={1: 0.02})
    # 8 rows measured plain steps only: the widths batch 1 measured, in batch 1's plain steps, times 8 rows' plain step
    assert table.path_costs(8, [2], drafted=False)[0] == pytest.approx(0.13 * 3)
    assert table.path_costs(8, [3], drafted=False)[0] == pytest.approx(0.14 * 3)
    assert table.path_costs(8, [5], drafted=False)[0] == pytest.approx(5 * 0.3)  # measured nowhere: the upper bound
    table.observe_undrafted(8, 2, 0.6)  # measured at 8 rows: its own price, and a floor for the next width
    assert table.path_costs(8, [2], drafted=False)[0] == 0.6 and table.path_costs(8, [3], drafted=False)[0] == 0.6
    # rows finishing: 7 rows borrow 8 rows' widths in their own plain steps
    table.observe(7, 1, 0.28)
    assert table.path_costs(7, [2], drafted=False)[0] == pytest.approx(0.6 * 0.28 / 0.3)


def test_a_plain_step_of_fewer_rows_costs_at_most_one_of_more_rows():
    """Rows leave a batch as they finish: a row count's plain cost comes from its first step or two, and priced
    too dear it makes every wider step of that count look good."""
    table = CostTable(step_s={(8, 1): 0.32, (7, 1): 0.40})
    assert table.cost(7, 1) == 0.32 and table.cost(4, 1) == 0.32 and table.cost(8, 1) == 0.32
    assert CostTable(step_s={(8, 1): 0.32, (2, 1): 0.2}).cost(4, 1) == 0.2  # the nearest count, when cheaper


def _planned_step(planner, paths, drafter_width, room=None):
    """The planner's choice for rows offering `paths` (each row's token budget `room`, 30 by default), its drafter at
    `drafter_width` when it drafts: ``(drafter runs, path tokens)``."""
    rows = list(range(len(paths)))
    planner.plan = lambda rows, room: torch.full((len(rows),), drafter_width - 1)
    room = torch.full((len(rows),), 30) if room is None else torch.tensor(room)
    drafts = planner.before_draft(rows, room, paths)
    return bool(drafts.gt(0).any()), planner.path_nodes(16)


def test_the_planner_prices_each_source_by_its_own_acceptance():
    table = CostTable(step_s={(1, 1): 1.0, (1, 4): 1.3, (1, 12): 1.6}, undrafted_s={(1, 11): 1.2}, draft_s={1: 0.2})
    reliable = VerificationPlanner(table, block_size=16, batch_size=1, device=torch.device("cpu"))
    reliable.path_successes[0], reliable.path_trials[0] = 90.0, 100.0  # paths right 90% of their tokens
    reliable.successes[0], reliable.trials[0] = 10.0, 100.0  # the drafter 10%
    path = list(range(10))
    assert _planned_step(reliable, [path], 4) == (False, 10)  # the path alone: the drafter is not worth its draft
    unreliable = VerificationPlanner(table, block_size=16, batch_size=1, device=torch.device("cpu"))
    unreliable.path_successes[0], unreliable.path_trials[0] = 0.0, 100.0
    unreliable.successes[0], unreliable.trials[0] = 80.0, 100.0
    assert _planned_step(unreliable, [path], 4) == (True, 0)  # the drafter's width, no path token
    # a row that copies and a row that needs the drafter: both in one step where the copying row bounds the call (the
    # most tokens left), the drafter alone where the other does: a batch ends with its last row, and a step costs
    # the same for either row here, so the copying row's earlier finish would save nothing
    table = CostTable(step_s={(2, 1): 1.0, (2, 4): 1.3}, undrafted_s={(2, 11): 1.5}, draft_s={2: 0.2})

    def both():
        planner = VerificationPlanner(table, 16, 2, torch.device("cpu"))
        planner.path_successes[0], planner.path_trials[0] = 90.0, 100.0
        planner.successes[:], planner.trials[:] = 80.0, 100.0
        return planner

    drafter_runs, nodes = _planned_step(both(), [path, []], 4, room=[59, 19])
    assert drafter_runs and nodes > 0
    assert _planned_step(both(), [path, []], 4, room=[29, 29]) == (True, 0)


def test_one_rows_path_does_not_make_a_wide_batch_verify_it():
    """At 32 rows a step is as wide as its widest row: a path of 10 tokens in one row makes a forward of 352 tokens,
    priced from the measured forwards of 32 and 64 tokens; it pays only when most rows copy."""

    def planner(reliable_rows):
        table = CostTable(step_s={(32, 1): 1.0, (32, 2): 1.9}, draft_s={32: 0.3})
        planner = VerificationPlanner(table, block_size=16, batch_size=32, device=torch.device("cpu"))
        planner.successes[:], planner.trials[:] = 5.0, 100.0  # the drafter 5%: plain steps win
        planner.path_successes[:reliable_rows], planner.path_trials[:reliable_rows] = 95.0, 100.0
        return planner

    path = list(range(10))
    assert _planned_step(planner(1), [path] + [[]] * 31, 1) == (False, 0)
    drafter_runs, nodes = _planned_step(planner(32), [path] * 32, 1)
    assert not drafter_runs and 0 < nodes < 10  # every row copies: as far as each token's cost pays


def test_paths_are_scored_against_what_the_rows_commit_whether_verified_or_not():
    planner = VerificationPlanner(CostTable(), block_size=16, batch_size=2, device=torch.device("cpu"))
    planner.before_draft([0, 1], torch.tensor([30, 30]), [[5, 6, 7], [9]])
    planner.score_paths([0, 1], [[5], [8]])  # one token each (a plain step): row 1's path is refuted at depth 1
    assert planner.path_trials[:, :3].tolist() == [[0, 0, 0], [1, 0, 0]] and planner.path_successes.sum() == 0
    planner.score_paths([0], [[6, 7, 1]])  # row 0's path matched to its end over two steps (row 1 left)
    assert planner.path_trials[:, :3].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert planner.path_successes[:, :3].tolist() == [[1, 1, 1], [0, 0, 0]]
    # per depth: the first token accepted once in two, the second and third always, deeper ones still the prior
    assert planner.table.path_acceptance[:4] == [0.5, 1.0, 1.0, PRIOR_ACCEPTANCE] and not planner._path_shadows


def test_a_paths_acceptance_is_modelled_per_depth():
    """Copied paths are bimodal: right to their end where the context repeats, wrong at their first token where it
    does not. One geometric rate fitted to both (8 of 9 tokens here) would expect a one-token path to commit 1.89
    tokens; per depth it is 1.5, and a path of 8 tokens 5.0."""
    planner = VerificationPlanner(CostTable(), block_size=16, batch_size=1, device=torch.device("cpu"))
    for _ in range(40):
        planner.before_draft([0], torch.tensor([30]), [list(range(8))])
        planner.score_paths([0], [list(range(8))])  # matched to its end
        planner.before_draft([0], torch.tensor([30]), [[9]])
        planner.score_paths([0], [[10]])  # refuted at its first token
    reach = planner.path_reach([0], 8)[0]
    assert float(reach[1]) == pytest.approx(0.5, abs=0.03)
    assert float(reach.sum()) == pytest.approx(1 + 8 * 0.5, abs=0.3)
    geometric = planner.path_successes.sum() / planner.path_trials.sum()
    assert float(geometric) == pytest.approx(8 / 9)  # what one rate would have said of the first token
    # a new call starts from the last call's depths
    follower = VerificationPlanner(planner.table, block_size=16, batch_size=1, device=torch.device("cpu"))
    assert float(follower.path_reach([0], 1)[0, 1]) == pytest.approx(0.5, abs=0.01)


def test_a_short_path_is_not_verified_on_the_strength_of_long_ones():
    """At 8 rows each path token costs most of a plain step: a one-token path pays only if its first token is
    accepted more often than the step's extra cost; a geometric fit to bimodal paths said it was (0.89) when it was
    not (0.5)."""
    table = CostTable(step_s={(8, 1): 1.0}, undrafted_s={(8, 2): 1.7})
    planner = VerificationPlanner(table, block_size=16, batch_size=8, device=torch.device("cpu"))
    planner.path_successes[:, 0], planner.path_trials[:, 0] = 50.0, 100.0  # the first token: one in two
    planner.path_successes[:, 1:], planner.path_trials[:, 1:] = 100.0, 100.0  # the rest of a copy: always
    assert _planned_step(planner, [[7]] * 8, 1) == (False, 0)  # 1.5 tokens for 1.7 plain steps: plain
    planner.path_successes[:, 0] = 80.0
    assert _planned_step(planner, [[7]] * 8, 1) == (False, 1)  # 1.8 tokens for 1.7: the path


# ------------------------------------------------------------------ sampling exactness


def _hybrid_samples(target, drafter, n, batch_size, prompt=PROMPT):
    config = GenerationConfig(adaflash_ngram=True, adaflash_tree_budget=8, adaflash_ngram_nodes=4)
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(n // batch_size):
            out = target.generate(
                torch.tensor([prompt] * batch_size),
                generation_config=config,
                assistant_model=drafter,
                max_new_tokens=NEW,
                **SAMPLING,
            )
            samples += [tuple(row[len(prompt) :].tolist()) for row in out]
    return samples, stats


def _joint(target, prompt) -> dict[tuple, float]:
    """`exact_joint` after another prompt (the attention mask given: a sampled pad token is attended to, as the
    generation attends to it)."""
    joint = {(): 1.0}
    for _ in range(NEW):
        grown = {}
        for cell, p in joint.items():
            prefix = prompt + list(cell)
            probs = _next_token_probs(target, prefix, attention_mask=torch.ones(1, len(prefix), dtype=torch.long))
            for token in probs.nonzero().flatten().tolist():
                grown[cell + (token,)] = p * float(probs[token])
        joint = grown
    return joint


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny_target(vocab_size=12, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return target, tiny_drafter(target, block_size=4, mask_token_id=11)


@pytest.mark.parametrize("batch_size", [1, 50])
def test_sampling_with_merged_paths_matches_the_processed_distribution(sampling_models, batch_size):
    target, drafter = sampling_models
    torch.manual_seed(2027)
    samples, stats = _hybrid_samples(target, drafter, 1500, batch_size)
    assert stats.source_acceptance("ngram")["accepted"] > 0
    assert p_value(samples, exact_joint(target)) > 1e-3


def test_sampling_stays_exact_where_the_paths_are_often_accepted(sampling_models):
    """A prompt that the target tends to continue as it did before (its own greedy continuation of `PROMPT`,
    looping): half the path tokens verified are accepted, and the distribution is still the target's."""
    target, drafter = sampling_models
    prompt = target.generate(torch.tensor([PROMPT]), max_new_tokens=11, do_sample=False, eos_token_id=None)
    prompt = prompt[0].tolist()
    torch.manual_seed(2028)
    samples, stats = _hybrid_samples(target, drafter, 1500, 50, prompt)
    assert stats.source_acceptance("ngram")["rate"] > 0.3
    assert p_value(samples, _joint(target, prompt)) > 1e-3


def test_a_walk_that_takes_the_paths_token_fails_the_same_test(sampling_models, monkeypatch):
    """Negative control: at the anchor, descend into the first merged path whatever the target sampled."""
    target, drafter = sampling_models
    real = walk_trees

    def biased(tree, choices):
        choices = choices.clone()
        on_path = tree.valid[:, 0] & (tree.sources[:, 0] & PATHS).ne(0)
        choices[:, 0] = torch.where(on_path, tree.tokens[:, 0], choices[:, 0])
        return real(tree, choices)

    monkeypatch.setattr(tree_module, "walk_trees", biased)
    torch.manual_seed(2027)
    samples, _ = _hybrid_samples(target, drafter, 1500, 50)
    joint = exact_joint(target)
    assert p_value([s for s in samples if s in joint], joint) < 1e-3


# ------------------------------------------------------------------ options and refusals


def test_options_are_validated_once_and_refused_where_trees_are():
    target = tiny_target()
    drafter = tiny_drafter(target)
    options = AdaFlashGenerationOptions.from_generation_config(GenerationConfig(adaflash_ngram=True), drafter.config)
    assert options.ngram and options.tree_budget == drafter.config.block_size + options.ngram_nodes
    assert (options.ngram_max_match, options.ngram_min_match, options.ngram_tokens) == (3, 1, 10)
    config = GenerationConfig(adaflash_ngram=True, prompt_lookup_num_tokens=5, max_matching_ngram_size=4)
    options = AdaFlashGenerationOptions.from_generation_config(config, drafter.config)
    assert (options.ngram_tokens, options.ngram_max_match) == (5, 4)  # transformers' names, read as ours
    bad = GenerationConfig(adaflash_ngram="yes", adaflash_ngram_tokens=0, adaflash_ngram_min_match=4)
    with pytest.raises(ValueError) as error:
        AdaFlashGenerationOptions.from_generation_config(bad, drafter.config)
    for part in ("adaflash_ngram must be True or False", "adaflash_ngram_tokens must be a positive int"):
        assert part in str(error.value)
    with pytest.raises(ValueError, match="adaflash_ngram_min_match \\(4\\) exceeds adaflash_ngram_max_match"):
        config = GenerationConfig(adaflash_ngram=True, adaflash_ngram_min_match=4)
        AdaFlashGenerationOptions.from_generation_config(config, drafter.config)
    with pytest.raises(ValueError, match="adaflash_ngram_nodes is set without adaflash_ngram=True"):
        AdaFlashGenerationOptions.from_generation_config(GenerationConfig(adaflash_ngram_nodes=4), drafter.config)
    ids = torch.tensor([PROMPTS[0]])
    config = GenerationConfig(adaflash_ngram=True, repetition_penalty=1.3, max_new_tokens=5)
    with pytest.raises(ValueError, match="adaflash_ngram does not support logits processors that read the ids"):
        target.generate(ids, generation_config=config, assistant_model=drafter)
    config = GenerationConfig(adaflash_ngram=True, adaflash_decoding_loop="transformers", max_new_tokens=5)
    with pytest.raises(ValueError, match="adaflash_ngram needs adaflash_hf's loop"):
        target.generate(ids, generation_config=config, assistant_model=drafter)


# ------------------------------------------------------------------ n-gram paths only (no drafter)


def _lookup(target, ids, mask, eos, **kwargs):
    config = GenerationConfig(
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        prompt_lookup_num_tokens=10,
        adaflash_ngram=True,
        **kwargs,
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config)
    return out, stats


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_prompt_lookup_in_our_loop_equals_plain_greedy_at_any_batch_size(family, batch_size):
    target = tiny_target(family)
    prompts = [[0] + [5, 9, 33, 17] * 3, *PROMPTS[1:3]][:batch_size]
    free = [alone(target, p, max_new_tokens=40, eos_token_id=None) for p in prompts]
    eos = common_token(free)
    references = [alone(target, p, max_new_tokens=40, eos_token_id=eos) for p in prompts]
    ids, mask = left_pad(prompts)
    out, stats = _lookup(target, ids, None if batch_size == 1 else mask, eos)
    for got, want in zip(rows_of(out, prompts), references):
        assert got[: len(want)] == want
        assert all(t == PAD for t in got[len(want) :])
    assert stats.source_acceptance("ngram")["accepted"] > 0 and stats.source_acceptance("drafter")["offered"] == 0
    if batch_size == 1:  # transformers' own prompt lookup (batch 1 only) gives the same output
        theirs = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=PAD,
                                 prompt_lookup_num_tokens=10)  # fmt: skip
        assert torch.equal(out, theirs)


def test_prompt_lookup_in_our_loop_samples_the_processed_distribution(sampling_models, monkeypatch):
    target, _ = sampling_models

    # 50 rows alike in budget, where a step costs the same whatever its rows: a path accepted in some rows only
    # cannot end the call sooner, and the planner would verify few; priced as a server values them (every row's
    # tokens alike), paths are verified often enough to test their acceptance under sampling
    def summed(self, rows, committed, costs):
        return [None if cost is None else float(committed[:, c].sum()) / cost for c, cost in enumerate(costs)]

    monkeypatch.setattr(VerificationPlanner, "rates", summed)
    prompt = target.generate(torch.tensor([PROMPT]), max_new_tokens=11, do_sample=False, eos_token_id=None)
    prompt = prompt[0].tolist()
    config = GenerationConfig(adaflash_ngram=True)
    torch.manual_seed(2029)
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(30):
            out = target.generate(
                torch.tensor([prompt] * 50),
                generation_config=config,
                prompt_lookup_num_tokens=4,
                max_new_tokens=NEW,
                **SAMPLING,
            )
            samples += [tuple(row[len(prompt) :].tolist()) for row in out]
    assert stats.source_acceptance("ngram")["accepted"] > 0
    assert p_value(samples, _joint(target, prompt)) > 1e-3


def test_prompt_lookup_settings_are_read_and_refused_clearly():
    options = AdaFlashGenerationOptions.from_generation_config(
        GenerationConfig(adaflash_ngram=True, prompt_lookup_num_tokens=7, max_matching_ngram_size=4), None
    )
    assert (options.ngram_tokens, options.ngram_max_match, options.ngram_continuations) == (7, 4, 1)
    assert options.length_policy.length_policy == "planned" and options.tree_budget == 1 + options.ngram_nodes
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=7 and adaflash_ngram_tokens=5 disagree"):
        config = GenerationConfig(adaflash_ngram=True, prompt_lookup_num_tokens=7, adaflash_ngram_tokens=5)
        AdaFlashGenerationOptions.from_generation_config(config, None)
    with pytest.raises(ValueError, match="adaflash_length_policy need a drafter"):
        config = GenerationConfig(adaflash_ngram=True, adaflash_length_policy="fixed")
        AdaFlashGenerationOptions.from_generation_config(config, None)
    target = tiny_target()
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="pass prompt_lookup_num_tokens=k"):
        target.generate(ids, generation_config=GenerationConfig(adaflash_ngram=True, max_new_tokens=4))
    out = target.generate(
        ids,
        custom_generate=adaflash_hf.generate_loop,
        generation_config=GenerationConfig(
            adaflash_ngram=True, prompt_lookup_num_tokens=10, max_new_tokens=8, do_sample=False
        ),
    )
    assert out[0, len(PROMPTS[0]) :].tolist() == alone(target, PROMPTS[0], max_new_tokens=8)


def test_wider_costs_follow_the_plain_steps_cost_of_their_row_count():
    """A call on long passages steps slower than one on short questions, and a neighbour's burst slows every step for
    a while: a wider step keeps the price in plain steps it was measured at, so the choice between them does not
    depend on when each was last measured."""
    table = CostTable()
    for _ in range(3):
        table.observe(8, 1, 0.3)
        table.observe(1, 1, 0.1)
    table.observe_undrafted(8, 2, 0.6)
    table.observe(8, 4, 0.9)
    table.observe(1, 2, 0.15)
    for _ in range(3):
        table.observe(8, 1, 0.4)  # the median moves once three of the last five steps took 0.4 s
    assert table.cost(8, 1) == pytest.approx(0.4)
    assert table.undrafted_s[(8, 2)] == pytest.approx(0.8) and table.cost(8, 4) == pytest.approx(1.2)
    assert table.cost(1, 2) == pytest.approx(0.15)  # another row count's plain step did not move
    table.observe_undrafted(8, 2, 0.8)  # measured again in the same units: the price holds
    assert table.undrafted_s[(8, 2)] == pytest.approx(0.8)
