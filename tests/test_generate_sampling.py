"""Lossless sampling: speculative sampling reproduces the target's processed sampling distribution exactly.

Goodness of fit against the *exact* joint distribution of the first three generated tokens, computed from the
target's own processed scores (transformers' processors: temperature, top-k, top-p). Fixed seeds make the test
deterministic; the tolerance is a chi-square p-value above 1e-3 for the real sampler, and a negative control shows
that the same statistic rejects a sampler that is off by a temperature of 0.8 instead of 0.7.
"""

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from scipy.stats import chisquare
from transformers import GenerationConfig

import adaflash_hf

VOCAB, PROMPT, NEW = 12, [0, 5, 9, 4, 7], 3
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=6, top_p=0.9, eos_token_id=None, pad_token_id=2)


@pytest.fixture(scope="module")
def models():
    target = tiny_target(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return target, tiny_drafter(target, block_size=4, mask_token_id=VOCAB - 1)


def _next_token_probs(target, prefix, **sampling):
    out = target.generate(
        torch.tensor([prefix]),
        max_new_tokens=1,
        output_scores=True,
        return_dict_in_generate=True,
        **{**SAMPLING, **sampling},
    )
    return torch.softmax(out.scores[0][0].double(), -1)


def exact_joint(target, **sampling) -> dict[tuple, float]:
    joint = {}
    first = _next_token_probs(target, PROMPT, **sampling)
    for a in first.nonzero().flatten().tolist():
        second = _next_token_probs(target, PROMPT + [a], **sampling)
        for b in second.nonzero().flatten().tolist():
            third = _next_token_probs(target, PROMPT + [a, b], **sampling)
            for c in third.nonzero().flatten().tolist():
                joint[(a, b, c)] = float(first[a] * second[b] * third[c])
    return joint


def p_value(samples: list[tuple], joint: dict[tuple, float]) -> float:
    """Chi-square goodness of fit; cells expected to hold fewer than 5 samples are pooled."""
    n = len(samples)
    counts = {cell: 0 for cell in joint}
    unexpected = 0
    for cell in samples:
        if cell in counts:
            counts[cell] += 1
        else:
            unexpected += 1
    assert unexpected == 0, f"{unexpected} samples outside the support of the processed distribution"
    big = [c for c in joint if joint[c] * n >= 5]
    small = [c for c in joint if joint[c] * n < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    expected = [joint[c] * n for c in big] + [sum(joint[c] for c in small) * n]
    return chisquare(observed, expected).pvalue


def _speculative_samples(target, drafter, n, batch_size):
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(n // batch_size):
            out = target.generate(
                torch.tensor([PROMPT] * batch_size), max_new_tokens=NEW, assistant_model=drafter, **SAMPLING
            )
            samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    return samples, stats


def test_speculative_sampling_matches_plain_sampling_batch_1(models):
    target, drafter = models
    torch.manual_seed(1234)
    samples, stats = _speculative_samples(target, drafter, 1500, batch_size=1)
    accepted = sum(sum(s.accepted) for s in stats.steps)
    assert 0 < accepted < sum(sum(c - 1 for c in s.candidate_lengths) for s in stats.steps)  # accepts and rejects
    assert p_value(samples, exact_joint(target)) > 1e-3


def test_the_statistic_rejects_a_slightly_wrong_sampler(models):
    target, _ = models
    torch.manual_seed(1234)
    out = target.generate(torch.tensor([PROMPT] * 1500), max_new_tokens=NEW, **{**SAMPLING, "temperature": 0.8})
    samples = [tuple(row[len(PROMPT) :].tolist()) for row in out]
    joint = exact_joint(target)
    in_support = [s for s in samples if s in joint]
    assert p_value(in_support, joint) < 1e-3


def test_plain_sampling_passes_the_same_test(models):
    target, _ = models
    torch.manual_seed(99)
    out = target.generate(torch.tensor([PROMPT] * 1500), max_new_tokens=NEW, **SAMPLING)
    assert p_value([tuple(row[len(PROMPT) :].tolist()) for row in out], exact_joint(target)) > 1e-3


def test_ids_dependent_processors_stay_lossless(models):
    """Repetition penalty depends on the ids before each position: drafts are processed with their own prefix."""
    target, drafter = models
    penalty = dict(repetition_penalty=1.8, top_k=None, top_p=None, temperature=0.9)
    torch.manual_seed(4321)
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(3):
            out = target.generate(
                torch.tensor([PROMPT] * 500), max_new_tokens=NEW, assistant_model=drafter, **{**SAMPLING, **penalty}
            )
            samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    assert sum(sum(s.accepted) for s in stats.steps) > 0
    assert p_value(samples, exact_joint(target, **penalty)) > 1e-3


def test_a_bfloat16_draft_head_keeps_sampling_exact(models):
    """Drafts sampled from the bfloat16 head's distribution and accepted against that same distribution: the output
    is still the target's processed distribution (batch 50, the batched path)."""
    target, drafter = models
    # The sampling settings go as keyword arguments, as in `exact_joint`: a config object's None (eos_token_id)
    # would read as unset and take the model's own.
    config = GenerationConfig(adaflash_draft_head_dtype="bfloat16")
    torch.manual_seed(2468)
    samples = []
    with adaflash_hf.record_stats() as stats:
        for _ in range(30):
            out = target.generate(
                torch.tensor([PROMPT] * 50),
                generation_config=config,
                assistant_model=drafter,
                max_new_tokens=NEW,
                **SAMPLING,
            )
            samples += [tuple(row[len(PROMPT) :].tolist()) for row in out]
    assert sum(sum(s.accepted) for s in stats.steps) > 0
    assert p_value(samples, exact_joint(target)) > 1e-3
