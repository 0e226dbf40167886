"""Randomized differential test: speculative generate() against plain generate() on the same inputs.

Each case draws (from a fixed seed, so a failure names a reproducible case) a batch of left-padded prompts, a
drafter (random, or an oracle of plain's own output with random rejections) and a mix of generation options: EOS
sets (pad == eos included), block sizes and length policies, token budgets, min_new_tokens, repetition penalty,
n-gram bans, bad words, suppressed tokens, forced EOS, stop strings, scores and logits, a prefilled prefix cache and
a second turn continued from the returned cache. Greedy only: that is where plain's output is the exact reference.

`test_newer_options_equal_plain_generate` crosses the newer options the same way: the four length policies (the
planner included), tree budgets, batch sizes up to 5, custom criteria that fire mid-block beside EOS sets, budgets
and stop strings, and drafters with a reduced draft vocabulary, with oracle drafters that accept often so that
accepted blocks cross the stop points.
"""

import random
import re

import pytest
import torch
from helpers import oracle_drafter, tiny_drafter, tiny_target
from test_generate_batched import PAD
from test_generate_exactness import prefix_cache
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

CASES = 320
FAMILIES = ("qwen3", "llama", "qwen2")


@pytest.fixture(scope="module")
def targets():
    return {family: tiny_target(family) for family in FAMILIES}


def draw_case(rng: random.Random) -> dict:
    batch = rng.choice([1, 1, 2, 3, 4])
    prompts = [[0] + [rng.randrange(3, 127) for _ in range(rng.randrange(0, 9))] for _ in range(batch)]
    options = dict(max_new_tokens=rng.choice([1, 2, 3, 7, 12, 20, 24]))
    eos = rng.choice(["none", "one", "two", "pad"])
    options["eos_token_id"] = {"none": None, "one": rng.randrange(3, 127), "pad": PAD}.get(
        eos, [rng.randrange(3, 127), rng.randrange(3, 127)]
    )
    extras = {
        "min_new_tokens": lambda: rng.randrange(1, 6),
        "repetition_penalty": lambda: rng.choice([1.2, 1.5]),
        "no_repeat_ngram_size": lambda: rng.choice([2, 3]),
        "bad_words_ids": lambda: [[rng.randrange(3, 127)], [rng.randrange(3, 127), rng.randrange(3, 127)]],
        "suppress_tokens": lambda: [rng.randrange(3, 127) for _ in range(3)],
        "forced_eos_token_id": lambda: rng.randrange(3, 127),
        "stop_strings": lambda: ["".join(rng.choice("abcdefgh") for _ in range(rng.choice([1, 2])))],
    }
    for name in rng.sample(sorted(extras), rng.randrange(0, 4)):
        options[name] = extras[name]()
    if rng.random() < 0.4:
        options.update(
            return_dict_in_generate=True, output_scores=rng.random() < 0.7, output_logits=rng.random() < 0.5
        )
    return dict(
        family=rng.choice(FAMILIES),
        prompts=prompts,
        options=options,
        drafter=rng.choice(["random", "oracle"]),
        block_size=rng.choice([2, 4, 8]),
        policy=rng.choice(["fixed", "confidence", "adaptive"]),
        prefix=rng.random() < 0.2 and min(map(len, prompts)) > 2,
        second_turn=options.get("return_dict_in_generate", False) and rng.random() < 0.5,
        rejections=rng.random(),
    )


def left_pad(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run_case(target, case, word_tokenizer):
    ids, mask = left_pad(case["prompts"])
    options = dict(case["options"], do_sample=False, pad_token_id=PAD)
    if "stop_strings" in options:
        options["tokenizer"] = word_tokenizer
    width = ids.shape[1]

    def generate(**extra):
        fresh = dict(cache=prefix_cache(target, ids, mask, width - 1)) if case["prefix"] else {}
        return target.generate(ids, attention_mask=mask, **options, **fresh, **extra)

    try:
        plain = generate()
    except ValueError as error:  # an invalid mix of options: refused the same way
        with pytest.raises(ValueError, match=re.escape(str(error)[:60])):
            generate(assistant_model=tiny_drafter(target, block_size=case["block_size"]))
        return
    sequences = plain.sequences if options.get("return_dict_in_generate") else plain
    head = dict(use_length_head=True, length_head_bottleneck_dim=16) if case["policy"] == "adaptive" else {}
    if case["drafter"] == "random":
        drafter = tiny_drafter(target, block_size=case["block_size"], **head)
    else:
        # an oracle of plain's own output (plus filler past its end), wrong at random drafts
        references = [row[width - len(p) :].tolist() + [3] * 40 for row, p in zip(sequences, case["prompts"])]
        rng = random.Random(case["rejections"])
        marks = {(r, a): {rng.randrange(1, case["block_size"])} for r in range(len(references)) for a in range(80)}
        drafter = oracle_drafter(
            target,
            references,
            corrupt=lambda row, anchor: marks[row, anchor] if rng.random() < case["rejections"] else (),
            block_size=case["block_size"],
            **head,
        )
    drafter.config.length_policy = case["policy"]
    ours = generate(assistant_model=drafter)
    if not options.get("return_dict_in_generate"):
        assert torch.equal(ours, plain)
        return
    assert torch.equal(ours.sequences, plain.sequences)
    for name in ("scores", "logits"):
        got, want = getattr(ours, name), getattr(plain, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert len(got) == len(want), name
            for a, b in zip(got, want):
                assert torch.allclose(a, b, atol=1e-4), name
    if case["second_turn"]:
        turn = torch.tensor([[40, 41]] * ids.shape[0])
        second_ids = torch.cat([plain.sequences, turn], dim=1)
        second_mask = torch.cat([mask, torch.ones(ids.shape[0], second_ids.shape[1] - width, dtype=mask.dtype)], 1)
        continued = [
            target.generate(
                second_ids,
                attention_mask=second_mask,
                cache=result.cache,
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD,
            )
            for result in (plain, ours)
        ]
        assert torch.equal(continued[1], continued[0])


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # drawn min lengths beyond the budget: as plain
@pytest.mark.parametrize("chunk", range(4))
def test_random_cases_equal_plain_generate(targets, word_tokenizer, chunk):
    rng = random.Random(20261201)
    cases = [draw_case(rng) for _ in range(CASES)]
    for index in range(chunk, CASES, 4):
        case = cases[index]
        try:
            run_case(targets[case["family"]], case, word_tokenizer)
        except AssertionError as error:
            raise AssertionError(f"case {index}: {case}") from error


# ------------------------------------------------------------------ the newer options

EXTENDED_CASES = 480  # all of them under `pytest -m slow`
EXTENDED_CI_CASES = 48  # the seeded slice every run checks
# the options that make transformers add a processor reading the ids (trees refuse those, naming them)
READS_IDS = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "bad_words_ids")


class StopAtNewTokens(StoppingCriteria):
    """A custom criterion firing for row ``b`` once it holds ``new[b]`` generated tokens (mid-block, per row)."""

    def __init__(self, prompt_width, new):
        self.lengths = torch.tensor([prompt_width + n for n in new])

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.lengths[: input_ids.shape[0]]


def draw_extended_case(rng: random.Random) -> dict:
    """Length policy x tree budget x batch x stopping x processors x draft vocabulary, with oracle drafters that accept
    often, so that accepted blocks cross the stop points."""
    batch = rng.choice([1, 2, 3, 5])
    prompts = [[0] + [rng.randrange(3, 127) for _ in range(rng.randrange(0, 9))] for _ in range(batch)]
    options = dict(max_new_tokens=rng.choice([3, 7, 12, 20, 28]))
    eos = rng.choice(["none", "one", "two", "pad"])
    options["eos_token_id"] = {"none": None, "one": rng.randrange(3, 127), "pad": PAD}.get(
        eos, [rng.randrange(3, 127), rng.randrange(3, 127)]
    )
    processors = {
        "repetition_penalty": lambda: rng.choice([1.2, 1.5]),
        "no_repeat_ngram_size": lambda: rng.choice([2, 3]),
        "min_new_tokens": lambda: rng.randrange(1, 6),
        "suppress_tokens": lambda: [rng.randrange(3, 127) for _ in range(3)],
        "bad_words_ids": lambda: [[rng.randrange(3, 127)], [rng.randrange(3, 127), rng.randrange(3, 127)]],
    }
    for name in rng.sample(sorted(processors), rng.choice([0, 0, 1, 2])):
        options[name] = processors[name]()
    stopping = rng.choice(["none", "stop_strings", "criterion", "criterion"])
    if stopping == "stop_strings":
        options["stop_strings"] = ["".join(rng.choice("abcdefgh") for _ in range(rng.choice([1, 2])))]
    return dict(
        family=rng.choice(FAMILIES),
        prompts=prompts,
        options=options,
        stop_after=[rng.randrange(1, 14) for _ in range(batch)] if stopping == "criterion" else None,
        drafter=rng.choice(["random", "oracle", "oracle"]),
        draft_vocab=rng.random() < 0.4,
        block_size=rng.choice([4, 8, 16]),
        policy=rng.choice(["fixed", "confidence", "adaptive", "planned"]),
        tree=rng.choice([None, 4, 16, 64]),
        rejections=rng.random() * 0.5,
    )


def run_extended_case(target, case, word_tokenizer):
    ids, mask = left_pad(case["prompts"])
    width = ids.shape[1]
    options = dict(case["options"], do_sample=False, pad_token_id=PAD)
    call = {"tokenizer": word_tokenizer} if "stop_strings" in options else {}

    def generate(config_extra=None, **extra):
        criteria = {}
        if case["stop_after"] is not None:  # a fresh instance per call: criteria may keep state
            criteria["stopping_criteria"] = StoppingCriteriaList([StopAtNewTokens(width, case["stop_after"])])
        config = GenerationConfig(**options, **(config_extra or {}))
        return target.generate(ids, attention_mask=mask, generation_config=config, **call, **criteria, **extra)

    try:
        plain = generate()
    except ValueError as error:  # an invalid mix of options: refused the same way
        with pytest.raises(ValueError, match=re.escape(str(error)[:60])):
            generate(assistant_model=tiny_drafter(target, block_size=case["block_size"]))
        return
    references = [row[width - len(p) :].tolist() + [3] * 40 for row, p in zip(plain, case["prompts"])]
    draft_vocab = None
    if case["draft_vocab"]:
        # most of what plain generates, plus others, minus a few: some drafts cannot be proposed
        rng = random.Random(case["rejections"])
        wanted = {t for r in references for t in r} | {rng.randrange(3, 127) for _ in range(20)}
        draft_vocab = sorted(t for t in wanted if rng.random() < 0.85) or [3]
    head = dict(use_length_head=True, length_head_bottleneck_dim=16) if case["policy"] == "adaptive" else {}
    kwargs = dict(block_size=case["block_size"], draft_vocab=draft_vocab, **head)
    if case["drafter"] == "random":
        drafter = tiny_drafter(target, **kwargs)
    else:
        rng = random.Random(case["rejections"])
        marks = {(r, a): {rng.randrange(1, case["block_size"])} for r in range(len(references)) for a in range(80)}
        drafter = oracle_drafter(
            target,
            references,
            corrupt=lambda row, anchor: marks[row, anchor] if rng.random() < case["rejections"] else (),
            **kwargs,
        )
    drafter.config.length_policy = case["policy"]
    tree = {} if case["tree"] is None else {"adaflash_tree_budget": case["tree"]}
    if tree and any(name in options for name in READS_IDS):
        with pytest.raises(ValueError, match="adaflash_tree_budget does not support logits processors that read"):
            generate(config_extra=tree, assistant_model=drafter)
        return
    ours = generate(config_extra=tree, assistant_model=drafter)
    assert torch.equal(ours, plain)


def _extended_cases():
    rng = random.Random(20261202)
    return [draw_extended_case(rng) for _ in range(EXTENDED_CASES)]


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")
@pytest.mark.parametrize(
    "chunk", [pytest.param(c, marks=() if c == 0 else pytest.mark.slow) for c in range(EXTENDED_CASES // 48)]
)
def test_newer_options_equal_plain_generate(targets, word_tokenizer, chunk):
    """Length policies (the planner included) x tree budgets x batch sizes x stop points (EOS, budgets, stop strings,
    custom criteria firing mid-block) x processors x draft vocabularies: greedy identity with plain generate().
    The first chunk runs in every CI run; `pytest -m slow` runs all of them."""
    cases = _extended_cases()
    for index in range(chunk, EXTENDED_CASES, EXTENDED_CASES // EXTENDED_CI_CASES):
        case = cases[index]
        try:
            run_extended_case(targets[case["family"]], case, word_tokenizer)
        except AssertionError as error:
            raise AssertionError(f"extended case {index}: {case}") from error
