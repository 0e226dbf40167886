"""What the in-process A/B scripts share (`tree_chains`, `rate_prior`): the demo's target, drafter and held-out prompts
for the domains asked, the machine line, and a variant's speedup cell."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from adaflash_hf.machine import machine_info, machine_summary

from ..cli import chosen_prompts, load_demo_models
from .harness import speedup_interval


def load_for_ab(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``(target, tokenizer, drafter, prompts by domain)`` for ``args.domains`` (comma-separated shipped domains,
    ``args.prompts_per_domain`` each), float32 on the CPU; a domain without shipped prompts is the parser's error.
    Prints the machine. The prompts are plain text: render each with `adaflash_hf.chat.render_prompt` before
    tokenising it, as the benchmarks do (without the chat template the target answers most math prompts with EOS at
    once)."""
    options = SimpleNamespace(target=None, drafter=None, dtype="float32", device="cpu", prompts=None)
    options.prompts_per_domain = args.prompts_per_domain
    target, tokenizer, drafter = load_demo_models(options)
    prompts = chosen_prompts(options, args.prompts_per_domain)
    domains = args.domains.split(",")
    unknown = sorted(set(domains) - set(prompts))
    if unknown:
        parser.error(f"--domains: no shipped prompts for {unknown}; choose among {sorted(prompts)}")
    print(f"machine: {machine_summary(machine_info())}")
    return target, tokenizer, drafter, {domain: prompts[domain] for domain in domains}


def speedup_cell(calls, plain_calls) -> str:
    """``"1.234x [low, high]"``: the variant's throughput over plain's on the same calls, with its 95% interval
    (`harness.speedup_interval`); calls are ``(tokens, seconds)``."""
    speed = sum(t for t, _ in calls) / sum(s for _, s in calls)
    plain = sum(t for t, _ in plain_calls) / sum(s for _, s in plain_calls)
    low, high = speedup_interval(calls, plain_calls)
    return f"{speed / plain:.3f}x [{low:.2f}, {high:.2f}]"
