"""DFlash 2 drafters in the decoding loop: the selector's path is the linear draft and its candidates the tree's
branches; outputs stay exactly plain generate()'s (greedy) or its distribution (sampling, with the selector's q)."""

import pytest
import torch
from helpers import FAMILIES, tiny_drafter, tiny_target
from scipy.stats import chisquare
from test_generate_batched import left_pad, rows_of
from test_generate_sampling import NEW, PROMPT, SAMPLING, exact_joint, p_value
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf.dflash2 import walk_selector
from adaflash_hf.generation import candidate_generator

PROMPTS = [[0, 5, 9, 33, 17, 4, 80], [0, 44], [0, 7, 7, 7, 7, 7, 101, 3, 9, 12, 5]]
DFLASH2 = dict(drafter_type="dflash2", selector_rank=8, selector_top_k=4)


def dflash2_drafter(target, strength: float = 3.0, seed: int = 1, **overrides):
    """A random DFlash 2 drafter whose convolutions are not the identity and whose selector outweighs the unary
    logits often enough to change the drafted tokens."""
    drafter = tiny_drafter(target, seed=seed, **{**DFLASH2, **overrides})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.copy_(
                    torch.randn(conv.kernel_projection.weight.shape, generator=generator) * 0.1
                )
        selector = drafter.candidate_selector
        for table in (selector.predecessor_codebook, selector.successor_codebook):
            table.copy_(torch.randn(table.shape, generator=generator) * strength)
    return drafter


def record_walks(monkeypatch):
    """Every selector walk of the loop: (its path, the unary argmax path) per call."""
    walks = []

    def recording(selector, hidden, logits, anchors, temperature, process=None):
        unary = logits.argmax(-1)
        tokens, scores = walk_selector(selector, hidden, logits, anchors, temperature, process)
        walks.append((tokens.clone(), unary))
        return tokens, scores

    monkeypatch.setattr(candidate_generator, "walk_selector", recording)
    return walks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_identity_batch_1_and_3(family, monkeypatch):
    target = tiny_target(family)
    drafter = dflash2_drafter(target)
    walks = record_walks(monkeypatch)
    for prompt in PROMPTS:
        reference = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
        out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert torch.equal(out, reference)
    ids, mask = left_pad(PROMPTS)
    references = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)[0, len(p) :] for p in PROMPTS]
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, assistant_model=drafter)
    assert rows_of(out, PROMPTS) == [r.tolist() for r in references]
    assert stats.steps  # the drafter ran
    # the selector drafted, and not merely the unary argmax: its path leaves the argmax somewhere
    assert walks and any(not torch.equal(path, unary) for path, unary in walks)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_with_trees_over_the_selector_candidates(batch, monkeypatch):
    target = tiny_target()
    drafter = dflash2_drafter(target)
    prompts = PROMPTS[:batch]
    ids, mask = left_pad(prompts)
    references = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=30)[0, len(p) :] for p in prompts]
    config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=2, adaflash_tree_budget=12)
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=drafter)
    assert rows_of(out, prompts) == [r.tolist() for r in references]
    assert any(max(s.candidate_lengths) > 1 for s in stats.steps)


def test_tree_branches_are_the_selector_candidates():
    """`Drafts.logits` of a DFlash 2 drafter are finite exactly on each slot's K candidates, so `build_trees` branches
    over them."""
    target = tiny_target()
    drafter = dflash2_drafter(target)
    hidden = torch.randn(2, 5, 64)
    logits = torch.randn(2, 5, 128)
    tokens, scores = walk_selector(drafter.candidate_selector, hidden, logits.clone(), torch.tensor([3, 4]), None)
    candidates = logits.topk(4, dim=-1).indices
    finite = torch.isfinite(scores)
    assert torch.equal(finite.sum(-1), torch.full((2, 5), 4))
    assert torch.equal(finite.gather(-1, candidates), torch.ones_like(candidates, dtype=torch.bool))
    assert torch.equal(tokens, scores.argmax(-1))


def test_greedy_walk_is_the_engines_walk():
    """Slot by slot: the best of unary + transition after the token chosen before (the anchor for slot 1)."""
    target = tiny_target()
    selector = dflash2_drafter(target).candidate_selector
    hidden, logits, anchors = torch.randn(3, 6, 64), torch.randn(3, 6, 128), torch.tensor([5, 6, 7])
    tokens, _ = walk_selector(selector, hidden, logits.clone(), anchors, None)
    for b in range(3):
        previous = int(anchors[b])
        for i in range(6):
            candidates = logits[b, i].topk(4).indices
            with torch.no_grad():
                context = selector.predecessor_codebook[previous] * selector.hidden_projection(hidden[b, i])
                score = logits[b, i, candidates] + (context * selector.successor_codebook[candidates]).sum(-1)
            previous = int(candidates[score.argmax()])
            assert int(tokens[b, i]) == previous


# ------------------------------------------------------------------ sampling: q is the selector's softmax


def test_sampled_walk_draws_from_q():
    """At each slot the walk's token is a sample from q = softmax(scores) of that slot (given the drafted token
    before it): the scores it reports are the proposal it samples from."""
    target = tiny_target()
    selector = dflash2_drafter(target, strength=1.0).candidate_selector
    n = 4000
    torch.manual_seed(0)
    hidden = torch.randn(1, 2, 64).expand(n, -1, -1)
    logits = (torch.randn(1, 2, 128) * 0.3).expand(n, -1, -1).contiguous()
    with torch.no_grad():
        tokens, scores = walk_selector(selector, hidden, logits.clone(), torch.full((n,), 5), temperature=0.8)
    q_first = torch.softmax(scores[0, 0].double(), -1)  # slot 1 has one predecessor (the anchor): one q for all rows
    support = q_first.nonzero().flatten()
    observed = torch.stack([(tokens[:, 0] == t).sum() for t in support]).double()
    assert chisquare(observed, q_first[support] * n).pvalue > 1e-3
    # slot 2's q depends on slot 1's token: each row's reported q is the one after its own drafted token
    first = int(tokens[0, 0])
    rows = (tokens[:, 0] == first).nonzero().flatten()
    q_second = torch.softmax(scores[rows[0], 1].double(), -1)
    assert all(torch.allclose(torch.softmax(scores[r, 1].double(), -1), q_second) for r in rows[:50].tolist())
    support = q_second.nonzero().flatten()
    observed = torch.stack([(tokens[rows, 1] == t).sum() for t in support]).double()
    assert chisquare(observed, q_second[support] * len(rows)).pvalue > 1e-3


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny_target(vocab_size=12, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return target, dflash2_drafter(target, block_size=4, mask_token_id=11, strength=2.0, selector_top_k=4)


def _samples(target, drafter, n=1500, batch=50):
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(n // batch):
            out = target.generate(
                torch.tensor([PROMPT] * batch), max_new_tokens=NEW, assistant_model=drafter, **SAMPLING
            )
            samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    return samples, stats


def test_sampling_with_the_selector_is_lossless(sampling_models):
    target, drafter = sampling_models
    torch.manual_seed(1357)
    samples, stats = _samples(target, drafter)
    accepted = sum(sum(s.accepted) for s in stats.steps)
    assert 0 < accepted < sum(sum(c - 1 for c in s.candidate_lengths) for s in stats.steps)  # accepts and rejects
    assert p_value(samples, exact_joint(target)) > 1e-3


def test_a_wrong_q_is_detected(sampling_models, monkeypatch):
    """Negative control: accepting the selector's drafts against the unary softmax (not the q they were drawn from)
    biases the output, and the same statistic sees it."""
    target, drafter = sampling_models

    def wrong_q(selector, hidden, logits, anchors, temperature, process=None):
        tokens, _ = walk_selector(selector, hidden, logits, anchors, temperature, process)
        return tokens, logits  # the processed unary logits: not the selector's proposal

    monkeypatch.setattr(candidate_generator, "walk_selector", wrong_q)
    torch.manual_seed(1357)
    samples, _ = _samples(target, drafter)
    joint = exact_joint(target)
    assert p_value([s for s in samples if s in joint], joint) < 1e-3


@pytest.mark.parametrize("policy", ["adaptive", "confidence"])
def test_length_head_and_confidence_policies_combine_with_the_selector(policy):
    """AdaFlash's length head (and the confidence policy, which reads the selector's q) size DFlash 2 drafts too."""
    target = tiny_target()
    drafter = dflash2_drafter(target, use_length_head=policy == "adaptive", length_policy=policy)
    ids, mask = left_pad(PROMPTS)
    references = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20)[0, len(p) :] for p in PROMPTS]
    with adaflash_hf.record_stats() as stats:
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    assert rows_of(out, PROMPTS) == [r.tolist() for r in references]
    assert len({c for s in stats.steps for c in s.candidate_lengths}) > 1  # lengths vary with the policy
