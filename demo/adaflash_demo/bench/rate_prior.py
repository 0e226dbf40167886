"""The planner's draft-or-plain rule with a length head, against the head's own policy (`planner._draft_or_plain`).

With a length head, the planner drafts while this call's drafted steps, summed, beat plain steps, beside two steps at
the pair's earlier rate (BENCHMARKS.md section 26); as shipped, a call drafts from its first step where the pair's
rate beats plain steps, probes' blocks are samples of that rate, and a call that is drafting stops only once an upper
bound of its rate loses (`planner.START_ON_RATE`, `PROBE_SAMPLES`, `DRAFTING_BOUND_Z`: sections 28 and 29). This
times the planner as shipped, the planner before section 29 (none of the three), optionally the shipped rule without
the bound and the rule before section 26 (the call's own steps alone), and the head's own policy beside them,
interleaved with plain ``generate()`` call by call (the order rotating), on the real target, float32 greedy, batch 1,
every output asserted identical to plain's; and the planner as before section 35, whose drafts were all projected
to logits in the head's ``linear`` product (``planner before section 35``: the A/B of `VerificationPlanner.projected`
and the head's measured kernels, `draft_head.py`); and the planner as before section 36, whose forwards rerouted the
target's linear layers from a `TorchFunctionMode` (``planner before section 36``: the A/B of `verify_layout.routed`);
and the planner whose probes stay within half the shipped budget (``planner with half the probe budget``,
`planner.PROBE_BUDGET`); and the planner as before section 44, whose forwards copied the keys and values of every
grouped-query layer for each forward of several tokens (``planner before section 44``: the A/B of
`attention.grouped_query_attention`). ``--ngram`` merges the context's n-gram paths into every planner variant's
steps (the demo's method, ``adaflash_hybrid``):

    python -m adaflash_demo.bench.rate_prior --domains code,shell,chat --prompts-per-domain 16 --repeats 2

It prints, per domain, each variant's speedup over plain with its 95% interval (paired bootstrap over calls,
`harness.speedup_interval`) and each variant's drafted steps. Each variant has its own copy of the drafter (its own
runtime profile, which starts empty unless ``ADAFLASH_HF_PROFILE_DIR`` holds one).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time

import torch
from transformers import GenerationConfig

from adaflash_hf import record_stats
from adaflash_hf.chat import render_prompt
from adaflash_hf.generation import decoding as decoding_module
from adaflash_hf.generation import planner as planner_module
from adaflash_hf.generation import verify_layout
from adaflash_hf.generation.draft_head import DraftHead
from adaflash_hf.generation.planner import VerificationPlanner

from .ab import load_for_ab, speedup_cell
from .harness import own_profile
from .kernels import FunctionMode

CONSTANTS = ("RATE_PRIOR_STEPS", "DRAFTED_EMA", "DRAFTING_BOUND_Z", "PROBE_SAMPLES", "START_ON_RATE", "PROBE_BUDGET")
SHIPPED = {name: getattr(planner_module, name) for name in CONSTANTS}
# probes within half the shipped share of the plain steps' time (`planner.PROBE_BUDGET`)
HALF_BUDGET = {**SHIPPED, "PROBE_BUDGET": SHIPPED["PROBE_BUDGET"] / 2}
WITHOUT_BOUND = {**SHIPPED, "DRAFTING_BOUND_Z": 0.0}
# before section 29: a call starts with a probe, its probes only start drafting, and its own mean alone stops it
BEFORE_29 = {**WITHOUT_BOUND, "START_ON_RATE": False, "PROBE_SAMPLES": False}
# before section 26: a call judges its drafted steps alone, drafting's rate a fast moving average
OWN_STEPS_ONLY = {**BEFORE_29, "RATE_PRIOR_STEPS": 0.0, "DRAFTED_EMA": planner_module.EMA}
# what sections 35 and 36 changed, as functions: the chosen drafts projected, in the head's measured kernel (35);
# the target's linear layers rerouted one by one, not by a mode that sees every torch call (36)
METHODS = {
    "projected": VerificationPlanner.projected,
    "_choice_key": DraftHead._choice_key,
    "routed": verify_layout.routed,
    "grouped_query_attention": decoding_module.grouped_query_attention,
}
BEFORE_35 = {
    "projected": lambda self, rows, length_prediction, max_drafts: max_drafts,
    # the head's dtype still measured, its float32 product never rerouted
    "_choice_key": lambda self, positions: (*METHODS["_choice_key"](self, positions)[:3], False),
}
BEFORE_36 = {
    "routed": lambda linears, kernel: contextlib.nullcontext() if kernel == "linear" else FunctionMode(kernel),
}
BEFORE_44 = {"grouped_query_attention": contextlib.nullcontext}  # transformers' sdpa, copying keys and values
ALL = (
    "planner",
    "planner before section 44",
    "planner before section 36",
    "planner before section 35",
    "planner without the bound",
    "planner before section 29",
    "planner on its own steps",
    "planner with half the probe budget",
    "head's policy",
)
DEFAULT = ("planner", "planner before section 29", "head's policy")


def variants(names: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    """Name -> (length policy, the planner's constants while it runs), of ``names`` (default: `DEFAULT`)."""
    every = {
        "planner": ("planned", SHIPPED),
        "planner before section 44": ("planned", {**SHIPPED, **BEFORE_44}),
        "planner before section 36": ("planned", {**SHIPPED, **BEFORE_36}),
        "planner before section 35": ("planned", {**SHIPPED, **BEFORE_36, **BEFORE_35}),
        "planner without the bound": ("planned", WITHOUT_BOUND),
        "planner before section 29": ("planned", BEFORE_29),
        "planner on its own steps": ("planned", OWN_STEPS_ONLY),
        "planner with half the probe budget": ("planned", HALF_BUDGET),
        "head's policy": ("adaptive", SHIPPED),
    }
    return {name: every[name] for name in (DEFAULT if names is None else names)}


def _set(constants: dict) -> None:
    constants = {**METHODS, **constants}
    VerificationPlanner.projected = constants.pop("projected")
    DraftHead._choice_key = constants.pop("_choice_key")
    verify_layout.routed = constants.pop("routed")
    decoding_module.grouped_query_attention = constants.pop("grouped_query_attention")
    for name, value in constants.items():
        setattr(planner_module, name, value)


def measure(
    target, tokenizer, drafter, texts: list[str], max_new_tokens: int, repeats: int, names, ngram: bool = False
) -> dict:
    """Per variant and plain: ``(tokens, seconds)`` per call; per planner variant, its drafted and all steps. Each
    variant has its own copy of the drafter, so its own runtime profile: what one variant's calls measured and
    learnt (drafting's rate above all) is not the other's prior. ``ngram``: the planner variants merge n-gram
    paths."""
    chosen = variants(names)
    copies = {name: own_profile(target, copy.deepcopy(drafter), name) for name in chosen}
    plain = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    configs = {
        name: GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            adaflash_length_policy=policy,
            adaflash_ngram=ngram and policy == "planned",
        )
        for name, (policy, _) in chosen.items()
    }
    inputs = [tokenizer(render_prompt(tokenizer, text), return_tensors="pt") for text in texts]
    calls = {name: [] for name in (*configs, "plain")}
    steps = {name: [0, 0] for name in configs}
    for ids in inputs[:2]:  # warm the paths and the pair's profile
        for name, config in configs.items():
            _set(chosen[name][1])
            target.generate(**ids, generation_config=config, assistant_model=copies[name])
    try:
        for repeat in range(repeats):
            for index, ids in enumerate(inputs):
                order = [*configs, "plain"]
                shift = (index + repeat * len(inputs)) % len(order)
                outputs = {}
                for name in order[shift:] + order[:shift]:
                    start = time.perf_counter()
                    if name == "plain":
                        out = target.generate(**ids, generation_config=plain)
                    else:
                        _set(chosen[name][1])
                        with record_stats() as stats:
                            out = target.generate(**ids, generation_config=configs[name], assistant_model=copies[name])
                        kinds = stats.summary()["steps_by_kind"]  # the head's policy: "drafted" unless width 1
                        steps[name][0] += kinds.get("drafted", 0)
                        steps[name][1] += sum(kinds.values())
                    calls[name].append((out.shape[1] - ids["input_ids"].shape[1], time.perf_counter() - start))
                    outputs[name] = out
                if not all(torch.equal(out, outputs["plain"]) for out in outputs.values()):
                    raise AssertionError("a variant's output differs from plain generate(): not lossless")
    finally:
        _set(SHIPPED)
    return {"calls": calls, "steps": steps}


def report(domain: str, measured: dict, names) -> str:
    calls, plain = measured["calls"], measured["calls"]["plain"]
    cells = []
    for name in names:
        drafted, total = measured["steps"][name]
        cells.append(f"{speedup_cell(calls[name], plain)} ({drafted}/{total} drafted)")
    return f"| {domain} | {len(plain)} | {' | '.join(cells)} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default="code,shell,chat", help="comma-separated shipped domains")
    parser.add_argument("--prompts-per-domain", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    every = list(ALL)
    parser.add_argument("--variants", default=",".join(DEFAULT), help=f"comma-separated, among {every}")
    parser.add_argument("--ngram", action="store_true", help="merge n-gram paths into the planner variants' steps")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    if set(names) - set(every):
        parser.error(f"--variants: unknown {sorted(set(names) - set(every))}; choose among {every}")
    target, tokenizer, drafter, prompts = load_for_ab(parser, args)
    print(f"| domain | calls | {' | '.join(names)} |")
    print("|---|---|" + "---|" * len(names))
    for domain in prompts:
        measured = measure(
            target, tokenizer, drafter, prompts[domain], args.max_new_tokens, args.repeats, names, args.ngram
        )
        print(report(domain, measured, names), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
