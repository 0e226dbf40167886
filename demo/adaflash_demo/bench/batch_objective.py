"""The planner's objective at batch > 1: how much sooner the call's batch finishes, against all rows' tokens alike.

A `generate()` batch ends with its last row, so the planner values a step's choices by the time they save until
then (`planner.finish_rates`, `planner.FINISH_TIME`); before, it valued every row's tokens alike, as a server that
replaces finished rows would (BENCHMARKS.md section 31: the hybrid's copied paths made the rows that copy finish
early, and at batch 8 its changelog cell lost 9%). This times each method both ways, interleaved with plain
``generate()`` batch by batch (the order rotating), on the real target, float32 greedy, left-padded batches of the
shipped held-out prompts of one domain, every output asserted identical to plain's:

    python -m adaflash_demo.bench.batch_objective --domains changelog,docs --batch-size 8 --repeats 10

``--switch SAMPLE_PROBES`` compares another switch of the planner at batch > 1 the same way: a call's probes before
its first real draft drafting one row (`planner.SAMPLE_PROBES`) against every row, which reads every prompt;
``--switch ROW_EVIDENCE``: such a probe's row counting as one row's evidence for the rows it did not draft
(`planner.ROW_EVIDENCE`) against its drafts' count; ``--switch BLOCK_TOTALS``: a probe of several rows pricing
each row by its expected tokens scaled to what all the blocks matched (`planner.BLOCK_TOTALS`) against the fewer of
its own block's and its expected ones. ``--pool`` measures the domains' prompts as one set, the domains
taking turns within every batch (as a server's batch of mixed requests), for batch sizes one domain cannot fill:

    python -m adaflash_demo.bench.batch_objective --switch ROW_EVIDENCE --pool --batch-size 32 --repeats 4 \
        --domains changelog,chat,code,docs,math,shell --methods adaflash_planned

It prints, per domain, each variant's speedup over plain with its 95% interval (paired bootstrap over calls,
`harness.speedup_interval`) and the share of its steps that verified merged paths or drafts. Each variant has its own
copy of the drafter (its own runtime profile, which starts empty unless ``ADAFLASH_HF_PROFILE_DIR`` holds one).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from adaflash_hf import record_stats
from adaflash_hf.chat import render_prompt
from adaflash_hf.generation import planner as planner_module

from .ab import load_for_ab, speedup_cell
from .harness import method_config, own_profile

# the planner's switches this compares, on and off, with their variants' labels
SWITCHES = {
    "FINISH_TIME": ("finish", "summed"),
    "SAMPLE_PROBES": ("one-row probes", "every-row probes"),
    "ROW_EVIDENCE": ("a row's evidence", "its drafts' count"),
    "BLOCK_TOTALS": ("blocks' totals", "each row's block"),
}


def variants(methods: list[str], switch: str = "FINISH_TIME") -> list[tuple[str, str, bool]]:
    """``(name, method, the switch's value)`` of each method with the planner's `switch` on and off."""
    labels = dict(zip((True, False), SWITCHES[switch]))
    return [(f"{method} ({labels[value]})", method, value) for method in methods for value in (True, False)]


def interleaved(groups: list[list[str]]) -> list[str]:
    """The groups' items taking turns (the first of each group, then the second, ...), so that every batch cut from
    the list mixes the groups; a shorter group drops out when it runs out."""
    longest = max((len(group) for group in groups), default=0)
    return [group[i] for i in range(longest) for group in groups if i < len(group)]


def measure(
    target,
    tokenizer,
    drafter,
    texts,
    batch_size: int,
    max_new_tokens: int,
    repeats: int,
    methods,
    switch="FINISH_TIME",
) -> dict:
    """Per variant and plain: ``(tokens, seconds)`` per call; per variant, its steps by kind."""
    chosen = variants(methods, switch)
    copies = {name: own_profile(target, copy.deepcopy(drafter), name) for name, _, _ in chosen}
    tokenizer.padding_side = "left"
    rendered = [render_prompt(tokenizer, text) for text in texts]
    batches = [rendered[i : i + batch_size] for i in range(0, len(rendered) - batch_size + 1, batch_size)]
    if not batches:
        raise SystemExit(f"{len(texts)} prompts cannot fill a batch of {batch_size}")
    inputs = [tokenizer(batch, return_tensors="pt", padding=True) for batch in batches]
    configs = {name: method_config(target, method, max_new_tokens, copies[name]) for name, method, _ in chosen}
    configs["plain"] = method_config(target, "plain", max_new_tokens)
    values = {name: value for name, _, value in chosen}
    calls = {name: [] for name in configs}
    kinds = {name: {} for name in values}
    shipped = getattr(planner_module, switch)

    def run(name, ids):
        setattr(planner_module, switch, values.get(name, shipped))
        config, kwargs = configs[name]
        return target.generate(**ids, generation_config=config, **kwargs)

    for name in configs:  # warm the paths, plain decoding and each copy's profile
        run(name, inputs[0])
    try:
        for repeat in range(repeats):
            for index, ids in enumerate(inputs):
                order = list(configs)
                shift = (index + repeat * len(inputs)) % len(order)
                outputs = {}
                for name in order[shift:] + order[:shift]:
                    start = time.perf_counter()
                    with record_stats() as stats:
                        out = run(name, ids)
                    seconds = time.perf_counter() - start
                    if name != "plain":
                        for kind, steps in stats.summary()["steps_by_kind"].items():
                            kinds[name][kind] = kinds[name].get(kind, 0) + steps
                    calls[name].append((out[:, ids["input_ids"].shape[1] :].numel(), seconds))
                    outputs[name] = out
                if not all(torch.equal(out, outputs["plain"]) for out in outputs.values()):
                    raise AssertionError("a variant's output differs from plain generate(): not lossless")
    finally:
        setattr(planner_module, switch, shipped)
    return {"calls": calls, "kinds": kinds}


def report(domain: str, measured: dict) -> str:
    calls, plain = measured["calls"], measured["calls"]["plain"]
    cells = []
    for name, kinds in measured["kinds"].items():
        total = sum(kinds.values()) or 1
        busy = ", ".join(f"{kind} {count / total:.0%}" for kind, count in sorted(kinds.items()) if kind != "plain")
        cells.append(f"{speedup_cell(calls[name], plain)} ({busy or 'plain only'})")
    return f"| {domain} | {len(plain)} | {' | '.join(cells)} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default="changelog,docs", help="comma-separated shipped domains")
    parser.add_argument("--methods", default="adaflash_hybrid", help="comma-separated benchmark methods")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompts-per-domain", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--switch", choices=sorted(SWITCHES), default="FINISH_TIME", help="the planner's switch to compare on and off"
    )
    parser.add_argument(
        "--pool", action="store_true", help="one set of all the domains' prompts, the domains taking turns in a batch"
    )
    args = parser.parse_args(argv)
    if args.batch_size < 2:
        parser.error("--batch-size: the switches differ only at batch > 1")
    methods = args.methods.split(",")
    target, tokenizer, drafter, prompts = load_for_ab(parser, args)
    if args.pool:
        prompts = {f"pooled({'+'.join(prompts)})": interleaved(list(prompts.values()))}
    names = [name for name, _, _ in variants(methods, args.switch)]
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens")
    print(f"| domain | calls | {' | '.join(names)} |")
    print("|---|---|" + "---|" * len(names))
    for domain in prompts:
        measured = measure(
            target,
            tokenizer,
            drafter,
            prompts[domain],
            args.batch_size,
            args.max_new_tokens,
            args.repeats,
            methods,
            args.switch,
        )
        print(report(domain, measured), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
