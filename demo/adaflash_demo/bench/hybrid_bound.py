"""How fast drafting, copying and both together could be on a domain's prompts: an oracle's bound from measured costs.

The planner chooses each step without knowing what the target will accept. An oracle that knew it would, at each
step, verify exactly the drafts and copied tokens that get accepted, and step plainly where nothing would be. Its
time is a bound that no method using those sources at those step costs can beat, so it says how far a method is
from what its sources allow, and whether a goal is within reach at all (issue 27's hybrid at 1.15 times the best
single method's mean, for one).

At batch 1 and greedy decoding everything the oracle needs is counted from the target's own answer: for every
prefix of it (``g`` tokens generated), ``A_dr(g)``, the drafts of the drafter's block (from the last committed token,
the target's hidden states of everything before it as its context, as the loop drafts) that match the answer's next
tokens, and ``A_ng(g)``, the tokens of the best of the context's n-gram continuations (`ngram.SuffixIndex`, the loop's
lookup, up to ``--path-tokens`` tokens) that match them. Acceptance is a prefix, so a step that verifies ``w - 1``
drafts and ``n`` path tokens commits ``1 + max(min(A_dr, w - 1), min(A_ng, n))`` tokens. Priced by the step-cost
model (`cost_model`: the target's forward of ``k`` tokens, with the fastest kernel where the loop measures kernels,
and the drafter's forward ``D``), a plain step costs ``T(1)``, a path alone ``T(1 + n)``, a drafted step
``D + T(w)``; knowing the outcome, the oracle verifies exactly the accepted tokens of the source that reaches further
(merging both never wins then), and a dynamic programme over ``g`` gives the least time to the answer's end. The
bound is per prompt; a domain's speedup is its answers' tokens over the least time at plain steps' cost (decode
only), and, beside it, with each prompt's prefill (one forward, timed) added to both sides, as the benchmark's cells
count a call.

The oracle is optimistic on purpose: it chooses the better continuation for free (the loop verifies both as a tree),
ignores the loop's own work a step (a tree's mask, the acceptance walk) and the draft head's dtype and kernel trials
of a new process; the drafter's block is its argmax chain (the loop's trees add branches, which the oracle's linear
bound leaves out). So a measured speedup near the bound leaves nothing to win, and a goal above it is out of reach
with this drafter and these costs::

    python -m adaflash_demo.bench.cost_model --batch-sizes 1 --lengths 1,2,3,4,5,6,8,10,12,16,20,24 --json cost.json
    python -m adaflash_demo.bench.hybrid_bound --cost-json cost.json --prompts-per-domain 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.cache_utils import DFlashCache

from adaflash_hf.chat import render_prompt
from adaflash_hf.generation.ngram import SuffixIndex
from adaflash_hf.generation.options import AdaFlashGenerationOptions
from adaflash_hf.generation.planner import match_committed
from adaflash_hf.machine import machine_info, machine_summary
from adaflash_hf.utils import write_json_atomic

from ..cli import chosen_prompts, load_demo_models


class StepCosts:
    """Seconds of a plain step, a path alone and a drafted step at batch 1, from `cost_model`'s rows (``k``, the
    target's forward in ms, the fastest kernel's where measured, and the drafter's); widths between measured ones
    are interpolated linearly and beyond the widest extrapolated from its last two."""

    def __init__(self, rows: list[dict]):
        rows = sorted((r for r in rows if r["batch_size"] == 1), key=lambda r: r["k"])
        if not rows or rows[0]["k"] != 1:
            raise SystemExit("--cost-json: needs cost_model rows at batch 1 with k = 1 (a plain step)")
        self.widths = [r["k"] for r in rows]
        self.ms = [r.get("target_best_ms", r["target_ms"]) for r in rows]
        self.draft = rows[0]["drafter_ms"] / 1000

    def forward(self, k: int) -> float:
        widths, ms = self.widths, self.ms
        if k in widths:
            return ms[widths.index(k)] / 1000
        if k > widths[-1]:
            if len(widths) == 1:
                return ms[0] * k / 1000
            slope = (ms[-1] - ms[-2]) / (widths[-1] - widths[-2])
            return (ms[-1] + slope * (k - widths[-1])) / 1000
        above = next(i for i, w in enumerate(widths) if w > k)
        w0, w1, m0, m1 = widths[above - 1], widths[above], ms[above - 1], ms[above]
        return (m0 + (m1 - m0) * (k - w0) / (w1 - w0)) / 1000


def matched(proposal: list[int], truth: list[int]) -> int:
    """Leading tokens of ``proposal`` equal to ``truth``'s (as the planner scores a probe's block)."""
    return match_committed(proposal, 0, truth)[0]


@torch.no_grad()
def answer_trace(target, tokenizer, drafter, text: str, max_new_tokens: int, path_tokens: int, continuations: int):
    """One prompt's trace (module docstring): ``{"a_dr": [...], "paths": [...], "prefill_s": ...}``, per ``g`` in
    ``1 .. len(answer) - 1`` (the prefill commits the first token) the drafter block's matched drafts and, per n-gram
    continuation the context offers, ``[its length, its matched tokens]``."""
    config = drafter.config
    block = config.block_size
    ids = tokenizer(render_prompt(tokenizer, text), return_tensors="pt").input_ids
    prompt = ids.shape[1]
    out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    answer = out[0, prompt:].tolist()
    eos = target.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    end = next((i + 1 for i, t in enumerate(answer) if t in stops), len(answer))
    answer = answer[:end]
    full = out[0, : prompt + end]
    prefill_s = float("inf")
    for _ in range(2):  # the faster of two: the first may pay a one-off
        start = time.perf_counter()
        target(ids)
        prefill_s = min(prefill_s, time.perf_counter() - start)
    hidden = target(full[None], output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1] for i in config.target_layer_ids], -1)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    allowed = None
    if config.draft_vocab is not None:
        allowed = torch.full((head.weight.shape[0],), float("-inf"))
        allowed[torch.tensor(list(config.draft_vocab))] = 0.0
    fields = AdaFlashGenerationOptions.__dataclass_fields__  # the loop's default match lengths
    index = SuffixIndex(
        fields["ngram_max_match"].default, fields["ngram_min_match"].default, full[: prompt + 1].tolist()
    )
    a_dr, paths = [], []
    for g in range(1, end):
        anchor = prompt + g - 1
        truth = answer[g:]
        context = features[:, :anchor]
        positions = torch.arange(anchor + block)[None]
        noise = torch.full((1, block), config.mask_token_id)
        noise[0, 0] = full[anchor]
        cache = DFlashCache(config=config)
        cache.set_previous_accepted_tokens(anchor)
        states = drafter(
            noise_embeds=embed(noise), context_hidden_states=context, position_ids=positions, cache=cache
        ).last_hidden_state[:, 1:]
        logits = head(states)[0]
        if allowed is not None:
            logits = logits + allowed
        a_dr.append(matched(logits.argmax(-1).tolist(), truth))
        _, found = index.lookup(path_tokens, continuations)
        paths.append([[len(path), matched(path, truth)] for path in found])
        index.extend([answer[g]])
    return {"a_dr": a_dr, "paths": paths, "prefill_s": prefill_s}


def least_time(trace: dict, costs: StepCosts, block: int, drafter: bool, longest: int) -> float:
    """The oracle's least seconds from the first generated token to the answer's end: each step verifies at most
    ``block - 1`` drafts (if ``drafter``) and ``longest`` copied tokens, exactly those that are accepted."""
    a_dr = trace["a_dr"]
    total = len(a_dr) + 1
    best = [0.0] * (total + 1)  # best[g]: least seconds from g tokens generated to the end
    plain = costs.forward(1)
    for g in range(total - 1, 0, -1):
        room = total - g
        choices = [plain + best[g + 1]]
        # a path alone: exactly its accepted tokens (more would cost without committing)
        n = min(max((m for _, m in trace["paths"][g - 1]), default=0), longest, room - 1)
        if n > 0:
            choices.append(costs.forward(1 + n) + best[g + 1 + n])
        if drafter:
            d = min(a_dr[g - 1], block - 1, room - 1)
            if d > 0:
                choices.append(costs.draft + costs.forward(1 + d) + best[g + 1 + d])
            # (knowing the outcome, merging the sources never wins: the one that reaches further, alone, costs less)
        best[g] = min(choices)
    return best[1]


def fixed_time(trace: dict, costs: StepCosts, width: int, longest: int) -> float:
    """Seconds to the answer's end when every step verifies ``width - 1`` drafts (none: ``width`` 1, and the drafter
    does not run) and up to ``longest`` tokens of each continuation the context offers, merged without a shared
    prefix (the dearest tree); a row commits the longer of its accepted drafts and accepted path tokens."""
    a_dr = trace["a_dr"]
    total = len(a_dr) + 1
    g, seconds = 1, 0.0
    while g < total:
        room = total - g
        drafts = min(width - 1, room - 1)
        paths = [(min(n, longest, room - 1), min(m, longest, room - 1)) for n, m in trace["paths"][g - 1]]
        nodes = sum(n for n, _ in paths)
        seconds += (costs.draft if drafts > 0 else 0.0) + costs.forward(1 + drafts + nodes)
        g += 1 + max([min(a_dr[g - 1], drafts)] + [m for _, m in paths])
    return seconds


FIXED_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
FIXED_PATHS = (0, 2, 4, 6, 10)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-json", required=True, help="cost_model's --json rows (batch 1)")
    parser.add_argument("--domains", default="chat,code,docs,shell,math,changelog")
    parser.add_argument("--prompts-per-domain", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--path-tokens", default="10,20", help="longest copied paths to bound, comma-separated")
    parser.add_argument("--continuations", type=int, default=2, help="n-gram continuations a step may verify")
    parser.add_argument("--traces", help="keep the traces in this JSON file, and reuse the domains it holds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with open(args.cost_json) as f:
        costs = StepCosts(json.load(f))
    options = SimpleNamespace(target=None, drafter=None, dtype="float32", device="cpu", prompts=None)
    options.prompts_per_domain = args.prompts_per_domain
    target, tokenizer, drafter = load_demo_models(options)
    prompts = chosen_prompts(options, args.prompts_per_domain)
    lengths = [int(x) for x in args.path_tokens.split(",")]
    block = drafter.config.block_size
    kept = {}
    if args.traces and os.path.exists(args.traces):
        with open(args.traces) as f:
            kept = json.load(f)
    print(f"machine: {machine_summary(machine_info())}")
    shown = ", ".join(f"verify {k} {1000 * costs.forward(k):.1f}" for k in (2, 4, 8, 16, 24))
    print(f"costs (ms): plain {1000 * costs.forward(1):.1f}, draft {1000 * costs.draft:.1f}, {shown}")
    names = ["drafter"] + [f"{source} <={n}" for n in lengths for source in ("copying", "both")]
    fixed = ["fixed drafter", "fixed copying", "fixed both"]
    print("speedup over plain steps, decode only (with each prompt's prefill on both sides)")
    print(
        "| domain | tokens | mean A_dr | mean A_ng | "
        + " | ".join([f"oracle: {n}" for n in names] + [f"best {n}" for n in fixed])
        + " |"
    )
    print("|---" * (4 + len(names) + len(fixed)) + "|")
    means = {name: [] for name in names + fixed}
    for domain in args.domains.split(","):
        traces = kept.get(domain)
        if traces is None or len(traces) < args.prompts_per_domain:
            traces = [
                answer_trace(target, tokenizer, drafter, text, args.max_new_tokens, max(lengths), args.continuations)
                for text in prompts[domain][: args.prompts_per_domain]
            ]
            if args.traces:
                kept[domain] = traces
                write_json_atomic(args.traces, kept)
        traces = traces[: args.prompts_per_domain]
        tokens = sum(len(t["a_dr"]) for t in traces)  # after the prefill's token
        plain = tokens * costs.forward(1)
        prefill = sum(t["prefill_s"] for t in traces)

        def cell(seconds, name, plain=plain, prefill=prefill):
            means[name].append(plain / seconds)
            return f"{plain / seconds:.2f}x ({(prefill + plain) / (prefill + seconds):.2f}x)"

        cells = []
        for name in names:
            use_drafter = name == "drafter" or name.startswith("both")
            longest = 0 if name == "drafter" else int(name.split("<=")[1])
            cells.append(cell(sum(least_time(t, costs, block, use_drafter, longest) for t in traces), name))
        for name, widths, paths in (
            ("fixed drafter", FIXED_WIDTHS, (0,)),
            ("fixed copying", (1,), FIXED_PATHS),
            ("fixed both", FIXED_WIDTHS, FIXED_PATHS),
        ):
            timed = {(w, n): sum(fixed_time(t, costs, w, n) for t in traces) for w in widths for n in paths}
            (w, n), seconds = min(timed.items(), key=lambda item: item[1])
            cells.append(cell(seconds, name) + f" w{w} n{n}")
        a_dr = statistics.mean(x for t in traces for x in t["a_dr"])
        a_ng = statistics.mean(max((m for _, m in p), default=0) for t in traces for p in t["paths"])
        print(f"| {domain} | {tokens} | {a_dr:.2f} | {a_ng:.2f} | " + " | ".join(cells) + " |", flush=True)
    print("| mean | | | | " + " | ".join(f"{statistics.mean(v):.2f}x" for v in means.values()) + " |")


if __name__ == "__main__":
    main()
