"""Tree verification (`adaflash_tree_budget`): one target forward over a best-first draft tree, and the output stays
plain decoding's, greedy token for token and sampling in distribution (with a negative control: a walk that ignores
the target's choice fails the same test)."""

import heapq
import itertools

import pytest
import torch
from helpers import OracleDrafter, oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD, PROMPTS, alone, common_token, left_pad, rows_of
from test_generate_sampling import NEW, PROMPT, SAMPLING, exact_joint, p_value
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf.generation import tree as tree_module
from adaflash_hf.generation.tree import DraftTree, build_trees, tree_attention_mask, walk_trees


def _generate(target, drafter, ids, mask, eos, budget, **kwargs):
    config = GenerationConfig(
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        **({} if budget is None else {"adaflash_tree_budget": budget}),
        **kwargs,
    )
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
    return out, stats


class RunnerUpOracle(OracleDrafter):
    """An oracle whose corrupted drafts keep the right token as their second choice: the linear path stops there,
    a tree with a second branch goes on."""

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, attention_mask=None, cache=None, **kw):
        out = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache, **kw)
        bs = self.config.block_size
        hidden = out.last_hidden_state.clone()
        for slot, row in enumerate(self.rows_of(cache)):
            reference, anchor = self.references[row], int(position_ids[slot, -bs])
            for k in self.corrupt(row, anchor):
                if anchor + k < len(reference):
                    hidden[slot, k] += 0.7 * self.token_hidden[reference[anchor + k]].to(hidden.dtype)
        out.last_hidden_state = hidden
        return out


def _runner_up_oracle(target, references, corrupt):
    drafter = tiny_drafter(target)
    oracle = RunnerUpOracle(drafter.config)
    oracle.load_state_dict(drafter.state_dict())
    return oracle.eval().setup(target, references, corrupt)


# ------------------------------------------------------------------ tree construction


def _brute_force(scores: torch.Tensor, nodes: int, max_depth: int) -> set[tuple]:
    """The `nodes` best paths (as token tuples) over all paths of depth <= max_depth, by summed log-probability."""
    log_probs = torch.log_softmax(scores, -1)
    paths = []
    for depth in range(1, max_depth + 1):
        for path in itertools.product(range(scores.shape[-1]), repeat=depth):
            paths.append((float(sum(log_probs[d, t] for d, t in enumerate(path))), path))
    return {path for _, path in heapq.nlargest(nodes, paths)}


@pytest.mark.parametrize("budget,max_depth", [(1, 3), (2, 3), (8, 3), (20, 2), (30, 3)])
def test_best_first_keeps_the_most_probable_paths_with_parents_first(budget, max_depth):
    torch.manual_seed(budget)
    logits = torch.randn(1, 4, 5) * 2
    tree = build_trees(logits, torch.tensor([max_depth]), budget)
    assert tree.width == 1 + min(budget - 1, sum(5**d for d in range(1, max_depth + 1)))
    paths = {0: ()}
    for i, (token, parent, depth) in enumerate(
        zip(tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.depths[0].tolist())
    ):
        assert parent in paths  # parents come first
        paths[i + 1] = paths[parent] + (token,)
        assert len(paths[i + 1]) == depth <= max_depth
    got = set(paths.values()) - {()}
    assert len(got) == tree.width - 1  # no node twice
    assert got == _brute_force(logits[0, :max_depth], budget - 1, max_depth)


def test_rows_get_their_own_depth_and_padding():
    logits = torch.randn(3, 5, 7)
    tree = build_trees(logits, torch.tensor([0, 1, 5]), 9, pad_token_id=PAD)
    assert tree.num_nodes.tolist() == [0, 7, 8]  # depth 1 holds at most the 7 tokens of the vocabulary
    assert not tree.valid[0].any() and (tree.tokens[0] == PAD).all()
    assert tree.depths[1][tree.valid[1]].eq(1).all() and tree.depths[2][tree.valid[2]].max() <= 5


def test_the_mask_shows_each_node_the_cache_and_its_ancestors_only():
    # anchor -> 1 -> 3, anchor -> 2; node 4 is padding
    tree = DraftTree(
        tokens=torch.tensor([[5, 6, 7, 0]]),
        parents=torch.tensor([[0, 0, 1, 0]]),
        depths=torch.tensor([[1, 1, 2, 1]]),
        valid=torch.tensor([[True, True, True, False]]),
    )
    past = torch.tensor([[True, False]])  # one hole in the cache
    mask = tree_attention_mask(tree, past, 2, torch.float32)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 0, 1, 0, 0, 0, 0],
            [1, 0, 1, 1, 0, 0, 0],
            [1, 0, 1, 0, 1, 0, 0],
            [1, 0, 1, 1, 0, 1, 0],
            [1, 0, 1, 0, 0, 0, 0],  # padding sees the cache and the anchor, not even itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_the_walk_follows_the_target_and_orders_the_accepted_path_first():
    tree = DraftTree(
        tokens=torch.tensor([[5, 6, 7, 8]]),
        parents=torch.tensor([[0, 0, 2, 2]]),
        depths=torch.tensor([[1, 1, 2, 2]]),
        valid=torch.ones(1, 4, dtype=torch.bool),
    )
    # the target picks 6 at the anchor (node 2), then 8 (node 4), then 9 (no child)
    choices = torch.tensor([[6, 0, 8, 0, 9]])
    accepted, order, following = walk_trees(tree, choices)
    assert accepted.tolist() == [2] and following.tolist() == [9]
    assert order.tolist() == [[0, 2, 4, 1, 3]]
    accepted, order, following = walk_trees(tree, torch.tensor([[3, 0, 0, 0, 0]]))
    assert accepted.tolist() == [0] and following.tolist() == [3] and order.tolist() == [[0, 1, 2, 3, 4]]


# ------------------------------------------------------------------ greedy exactness


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_with_trees_equals_plain_greedy(family, batch_size):
    target = tiny_target(family)
    prompts = PROMPTS[:batch_size]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = common_token(free)  # inside accepted paths, at different steps per row
    references = [alone(target, p, max_new_tokens=30, eos_token_id=eos) for p in prompts]
    ids, mask = left_pad(prompts)
    if batch_size == 1:
        mask = None
    full_refs = [p + r for p, r in zip(prompts, free)]
    corrupt = lambda row, anchor: {1 + (row + anchor) % 5}  # noqa: E731
    drafters = {
        "random": tiny_drafter(target),
        "oracle, runner-up right": _runner_up_oracle(target, full_refs, corrupt),
        "oracle, all right": oracle_drafter(target, full_refs),
    }
    for budget in (1, 16, 64):
        for name, drafter in drafters.items():
            out, stats = _generate(target, drafter, ids, mask, eos, budget)
            for got, want in zip(rows_of(out, prompts), references):
                assert got[: len(want)] == want, (name, budget)
                assert all(t == PAD for t in got[len(want) :]), (name, budget)
            assert max(step.verify_width for step in stats.steps) <= budget
            if name == "oracle, all right" and budget == 64:
                assert max(a for step in stats.steps for a in step.accepted) == 7  # the whole block, deep path


def test_a_tree_accepts_what_the_linear_block_cannot():
    target = tiny_target()
    prompts = PROMPTS[:3]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    oracle = _runner_up_oracle(target, [p + r for p, r in zip(prompts, free)], lambda row, anchor: {2})
    mean = {}
    for budget in (None, 32):
        out, stats = _generate(target, oracle, ids, mask, None, budget)
        assert rows_of(out, prompts) == free
        mean[budget] = stats.mean_acceptance_length
    assert mean[None] <= 3.0 + 1e-6  # linear: the anchor's token, one right draft, then the wrong top-1
    assert mean[32] > 1.5 * mean[None]  # the tree takes the right runner-up and goes on


@pytest.mark.parametrize("batch_size", [1, 3])
def test_planned_trees_verify_the_planners_width_as_a_tree(monkeypatch, batch_size):
    """With the planner, its width is the tree's budget (within adaflash_tree_budget): the same tokens verified as the
    linear candidate it chose, at least as many accepted (here exactly as many: the oracle is confident at every
    depth, so the best 3 nodes are its top-1 path, and the right runner-up at depth 2 would need a 4th), the output
    plain greedy's."""
    from test_generate_planned import _forced

    target = tiny_target()
    prompts = PROMPTS[:batch_size]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    oracle = _runner_up_oracle(target, [p + r for p, r in zip(prompts, free)], lambda row, anchor: {2})
    _forced(monkeypatch, lambda step, rows, max_drafts: [3] * len(rows))  # width 4: the anchor and 3 tokens
    mean = {}
    for budget in (None, 16):
        out, stats = _generate(target, oracle, ids, mask, None, budget, adaflash_length_policy="planned")
        assert rows_of(out, prompts) == free
        assert {step.verify_width for step in stats.steps} <= {1, 2, 3, 4}  # the planner's width, not 16
        mean[budget] = stats.mean_acceptance_length
    assert mean[None] <= 2.0 + 1e-6  # linear: the anchor's token and one right draft, then the wrong top-1
    assert mean[16] >= mean[None] - 1e-6


def test_output_scores_and_returned_cache_follow_the_accepted_path():
    target = tiny_target()
    prompts = PROMPTS[:3]
    ids, mask = left_pad(prompts)
    common = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    plain = target.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **common)
    config = GenerationConfig(adaflash_tree_budget=16, output_scores=True, return_dict_in_generate=True, **common)
    out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=tiny_drafter(target))
    assert torch.equal(out.sequences, plain.sequences)
    for got, want in zip(out.scores, plain.scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the returned cache continues exactly: one more plain step from it gives plain decoding's next token
    assert out.cache.get_seq_length() == plain.cache.get_seq_length()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_tree_that_is_one_path_is_verified_as_a_linear_block(monkeypatch, batch_size):
    """A chain (each node the previous one's child, as a confident drafter's or a copied path's) runs under the
    causal mask (at batch 1 none at all: attention keeps its fast kernels) and is not reordered; it commits what the
    same tree under its 4D tree mask commits, scores and returned cache alike. Branching trees keep the tree mask."""
    target = tiny_target()
    prompts = PROMPTS[:batch_size]
    free = [alone(target, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    ids, mask = left_pad(prompts)
    if batch_size == 1:
        mask = None
    references = [p + r for p, r in zip(prompts, free)]
    masks, chains = [], []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    is_chain = DraftTree.is_chain
    monkeypatch.setattr(DraftTree, "is_chain", property(lambda tree: chains.append(is_chain.fget(tree)) or chains[-1]))
    common = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    # the block's 7 drafts and the anchor: a confident drafter's best 7 nodes are its top-1 path, where the row's
    # token budget leaves room for it
    config = GenerationConfig(adaflash_tree_budget=8, output_scores=True, return_dict_in_generate=True, **common)

    def run(drafter):
        masks.clear(), chains.clear()
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
        steps = list(zip(masks[1:], chains))  # the prefill, then one forward per step
        return out, [m for m, chain in steps if chain], [m for m, chain in steps if not chain]

    oracle = oracle_drafter(target, references)
    out, linear, tree = run(oracle)
    assert len(linear) > len(tree)  # branching only where the token budget cuts the path short
    assert all(m.dim() == 4 for m in tree)
    assert all(m is None or m.dim() == 2 for m in linear)
    if batch_size == 1:
        assert all(m is None for m in linear)
    assert rows_of(out.sequences, prompts) == [row[:20] for row in free]
    monkeypatch.setattr(DraftTree, "is_chain", property(lambda tree: chains.append(False) or False))
    as_tree, _, tree = run(oracle)
    assert tree and all(m.dim() == 4 for m in tree)
    assert torch.equal(out.sequences, as_tree.sequences)
    for got, want in zip(out.scores, as_tree.scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (key, value), (key_, value_) in zip(
        ((layer.keys, layer.values) for layer in out.cache.layers),
        ((layer.keys, layer.values) for layer in as_tree.cache.layers),
    ):
        torch.testing.assert_close(key, key_, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(value, value_, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(DraftTree, "is_chain", property(lambda tree: chains.append(is_chain.fget(tree)) or chains[-1]))
    runner_up = _runner_up_oracle(target, references, lambda row, anchor: {2})
    out, _, tree = run(runner_up)
    assert tree and all(m.dim() == 4 for m in tree)  # the right runner-up makes a second branch
    assert rows_of(out.sequences, prompts) == [row[:20] for row in free]


# ------------------------------------------------------------------ sampling exactness


def _tree_samples(target, drafter, n, batch_size, budget=8):
    config = GenerationConfig(adaflash_tree_budget=budget)
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(n // batch_size):
            out = target.generate(
                torch.tensor([PROMPT] * batch_size),
                generation_config=config,
                assistant_model=drafter,
                max_new_tokens=NEW,
                **SAMPLING,
            )
            samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    return samples, stats


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny_target(vocab_size=12, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return target, tiny_drafter(target, block_size=4, mask_token_id=11)


@pytest.mark.parametrize("batch_size", [1, 50])
def test_sampling_with_trees_matches_the_processed_distribution(sampling_models, batch_size):
    target, drafter = sampling_models
    torch.manual_seed(1357)
    samples, stats = _tree_samples(target, drafter, 1500, batch_size)
    accepted = [a for step in stats.steps for a in step.accepted]
    assert 0 < sum(accepted) and max(step.verify_width for step in stats.steps) > 4  # a tree wider than the block
    assert p_value(samples, exact_joint(target)) > 1e-3


def test_a_walk_that_takes_the_drafters_choice_fails_the_same_test(sampling_models, monkeypatch):
    """Negative control: descend to the first child whatever the target sampled (the drafter's top choice)."""
    target, drafter = sampling_models
    real = walk_trees

    def biased(tree, choices):
        choices = choices.clone()
        first_child = torch.cat([tree.tokens[:, :1], choices[:, 1:]], dim=1)  # the anchor "chooses" node 1
        return real(tree, torch.where(tree.valid[:, :1], first_child, choices))

    monkeypatch.setattr(tree_module, "walk_trees", biased)
    torch.manual_seed(1357)
    samples, _ = _tree_samples(target, drafter, 1500, 50)
    joint = exact_joint(target)
    assert p_value([s for s in samples if s in joint], joint) < 1e-3


# ------------------------------------------------------------------ refusals


def test_refusals_name_the_problem_and_the_fix():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.tensor([PROMPTS[0]])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="adaflash_tree_budget must be a positive int"):
            target.generate(ids, generation_config=GenerationConfig(adaflash_tree_budget=bad), assistant_model=drafter)
    config = GenerationConfig(adaflash_tree_budget=16, repetition_penalty=1.3, max_new_tokens=5)
    with pytest.raises(ValueError, match="processors that read the ids.*RepetitionPenalty"):
        target.generate(ids, generation_config=config, assistant_model=drafter)
    config = GenerationConfig(adaflash_tree_budget=16, adaflash_decoding_loop="transformers", max_new_tokens=5)
    with pytest.raises(ValueError, match="needs adaflash_hf's loop"):
        target.generate(ids, generation_config=config, assistant_model=drafter)
