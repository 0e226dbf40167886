"""What verifying one-path trees as linear blocks saves: merged trees under their 4D tree mask, or, where a step's
tree is one path (`DraftTree.is_chain`), under the causal mask with no reorder after the walk.

Most trees of the hybrid method (``adaflash_ngram`` with the planner) are one path: a copied continuation the drafter
agrees with, or a confident drafter's top-1 path. This times the hybrid method on the real target with the shortcut
and with every tree forced through the tree mask (the same trees, the same outputs, asserted), interleaved with plain
``generate()`` call by call (order alternating), float32 greedy, at batch 1:

    python -m adaflash_demo.bench.tree_chains --domains math,shell --prompts-per-domain 8 --repeats 2

It prints, per domain, each variant's speedup over plain with its 95% interval (paired bootstrap over calls,
`harness.speedup_interval`) and the share of trees that were one path.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import GenerationConfig

from adaflash_hf.chat import render_prompt
from adaflash_hf.generation.tree import DraftTree

from .ab import load_for_ab, speedup_cell

VARIANTS = ("one-path shortcut", "tree mask always")


def measure(target, tokenizer, drafter, texts: list[str], max_new_tokens: int, repeats: int) -> dict:
    """Per variant and plain: ``(tokens, seconds)`` per call, and the count of one-path trees among all trees."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, adaflash_length_policy="planned", adaflash_ngram=True
    )
    plain = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    inputs = [tokenizer(render_prompt(tokenizer, text), return_tensors="pt") for text in texts]
    shortcut, chains = DraftTree.is_chain, []
    counted = property(lambda tree: chains.append(shortcut.fget(tree)) or chains[-1])
    forced = property(lambda tree: False)
    calls = {name: [] for name in (*VARIANTS, "plain")}
    for ids in inputs[:2]:  # warm both paths and the pair's profile
        target.generate(**ids, generation_config=config, assistant_model=drafter)
    try:
        for repeat in range(repeats):
            for index, ids in enumerate(inputs):
                order = [*VARIANTS, "plain"]
                outputs = {}
                for name in order if (index + repeat) % 2 == 0 else order[::-1]:
                    DraftTree.is_chain = counted if name == VARIANTS[0] else forced
                    start = time.perf_counter()
                    if name == "plain":
                        out = target.generate(**ids, generation_config=plain)
                    else:
                        out = target.generate(**ids, generation_config=config, assistant_model=drafter)
                    calls[name].append((out.shape[1] - ids["input_ids"].shape[1], time.perf_counter() - start))
                    outputs[name] = out
                if not all(torch.equal(out, outputs["plain"]) for out in outputs.values()):
                    raise AssertionError("a variant's output differs from plain generate(): not lossless")
    finally:
        DraftTree.is_chain = shortcut
    return {"calls": calls, "one_path": sum(chains), "trees": len(chains)}


def report(domain: str, measured: dict) -> str:
    calls, plain = measured["calls"], measured["calls"]["plain"]
    cells = [speedup_cell(calls[name], plain) for name in VARIANTS]
    ratio = sum(s for _, s in calls[VARIANTS[0]]) / sum(s for _, s in calls[VARIANTS[1]])
    share = measured["one_path"] / max(measured["trees"], 1)
    return f"| {domain} | {len(plain)} | {' | '.join(cells)} | {ratio:.3f} | {share:.0%} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default="math,shell", help="comma-separated shipped domains")
    parser.add_argument("--prompts-per-domain", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    target, tokenizer, drafter, prompts = load_for_ab(parser, args)
    print(f"| domain | calls | {' | '.join(VARIANTS)} | time, shortcut / tree mask | one-path trees |")
    print("|---|---|---|---|---|---|")
    for domain in prompts:
        measured = measure(target, tokenizer, drafter, prompts[domain], args.max_new_tokens, args.repeats)
        print(report(domain, measured), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
