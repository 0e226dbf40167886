"""The step-cost model of a target and drafter pair on this machine: what one speculative step costs.

For each batch size B and verified length k it times (median of ``--repeats``, after a warm-up):

* ``target_ms[B][k]``: one target forward of k new tokens per row over a cached context of ``--context`` tokens
  (k = 1 is a plain decoding step), with the model's own linear layers, and ``target_best_ms`` with the fastest
  kernel of `adaflash_hf.generation.verify_layout.KERNELS` (``best_kernel``), where the loop measures kernels
  (`verify_layout.measured_key`); the forwards are timed by `kernels.measure` (interleaved rounds; every kernel
  side by side: ``python -m adaflash_demo.bench.kernels``);
* ``drafter_ms[B]``: one drafter forward over a block (features of a few new context tokens + ``block_size`` queries),
  split into its decoder layers and its LM head over the ``block_size - 1`` draft positions.

A step that verifies k tokens costs ``drafter_ms + target_ms[k]``; in units of a plain step it is
``(drafter_ms + target_ms[k]) / target_ms[1]``, and speculative decoding pays when the tokens it commits per step
(the acceptance length) exceed that. ``python -m adaflash_demo.bench.cost_model`` prints one JSON line per
(batch, k) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.generation.verify_layout import measured_key
from adaflash_hf.utils import write_json_atomic

from . import kernels

NEW_CONTEXT = 4


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def drafter_ms(target, drafter, batch: int, context: int, repeats: int) -> dict:
    """The drafter's decoder layers over one block, and its draft head over the block's draft positions: the target's
    LM head through `adaflash_hf.generation.draft_head.DraftHead`, as the loop projects drafts (only the rows of the
    drafter's draft vocabulary when it has one), in float32 and in bfloat16, beside the whole float32 head for
    reference. In decoding the drafter caches its context, so a step feeds only the features of the tokens committed
    since the last step; ``NEW_CONTEXT`` of them stand for that (attention over the cached rest is a small part of a
    few-layer drafter's time)."""
    from adaflash_hf.generation.draft_head import DraftHead

    config = drafter.config
    hidden = config.hidden_size
    features = torch.randn(batch, NEW_CONTEXT, hidden * len(config.target_layer_ids))
    noise = torch.randn(batch, config.block_size, hidden)
    positions = torch.arange(context - NEW_CONTEXT, context + config.block_size).expand(batch, -1)
    head = target.get_output_embeddings()

    def layers():
        return drafter(noise_embeds=noise, context_hidden_states=features, position_ids=positions).last_hidden_state

    out = layers()[:, 1:]
    layers_ms = _median_ms(layers, repeats)
    heads = {name: DraftHead(head, name, vocab=config.draft_vocab) for name in ("float32", "bfloat16")}
    head_ms = {name: _median_ms(lambda h=h: h(out), repeats) for name, h in heads.items()}
    return {
        "layers_ms": layers_ms,
        "lm_head_ms": head_ms["float32"],
        "lm_head_bf16_ms": head_ms["bfloat16"],
        "whole_vocab_head_ms": _median_ms(lambda: head(out), repeats),
        "draft_vocab": None if config.draft_vocab is None else len(config.draft_vocab),
        "drafter_ms": layers_ms + head_ms["float32"],
        "drafter_bf16_head_ms": layers_ms + head_ms["bfloat16"],
    }


def measure(target, drafter, batch_sizes, lengths, context: int, repeats: int) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        forwards = kernels.measure(target, batch, [k for k in lengths if k > 1], context, repeats)
        plain = forwards["plain_ms"]
        draft = drafter_ms(target, drafter, batch, context, repeats)
        for k in lengths:
            relative = forwards.get(k, {"linear": 1.0})
            verify = plain * relative["linear"]
            best = {}
            if measured_key(batch * k) is not None:
                kernel = min(relative, key=relative.get)
                best = {"target_best_ms": round(plain * relative[kernel], 2), "best_kernel": kernel}
            rows.append(
                {
                    "batch_size": batch,
                    "k": k,
                    "target_ms": round(verify, 2),
                    "target_rel": round(verify / plain, 3),
                    **best,
                    **{key: round(v, 2) if isinstance(v, float) else v for key, v in draft.items()},
                    "drafter_rel": round(draft["drafter_ms"] / plain, 3),
                    "drafter_bf16_head_rel": round(draft["drafter_bf16_head_ms"] / plain, 3),
                    "step_rel": round((draft["drafter_ms"] + verify) / plain, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lengths = sorted({r["k"] for r in rows})
    lines = [
        "| batch | plain step ms | drafter / plain (layers + draft head ms) | drafter / plain, bf16 draft head | "
        + " | ".join(f"verify {k} / plain" for k in lengths)
        + " |",
        "|---" * (4 + len(lengths)) + "|",
    ]
    for batch in sorted({r["batch_size"] for r in rows}):
        group = {r["k"]: r for r in rows if r["batch_size"] == batch}
        first = group[lengths[0]]
        plain_ms = first["target_ms"] / first["target_rel"]
        lines.append(
            f"| {batch} | {plain_ms:.1f} | {first['drafter_rel']:.2f} ({first['layers_ms']:.1f} + "
            f"{first['lm_head_ms']:.1f}) | {first['drafter_bf16_head_rel']:.2f} ({first['lm_head_bf16_ms']:.1f}) | "
            + " | ".join(f"{group[k]['target_rel']:.2f}" for k in lengths)
            + " |"
        )
        if any("best_kernel" in r for r in group.values()):
            lines.append(
                f"| {batch}, fastest kernel | | | | "
                + " | ".join(
                    f"{group[k]['target_best_ms'] / plain_ms:.2f} ({group[k]['best_kernel']})"
                    if "best_kernel" in group[k]
                    else ""
                    for k in lengths
                )
                + " |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    from .. import demo, smollm2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=str(demo.drafter_path(None)))
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument("--lengths", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    target, _ = smollm2.load_target()
    drafter = AdaFlashDrafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    rows = measure(
        target,
        drafter,
        [int(b) for b in args.batch_sizes.split(",")],
        [int(k) for k in args.lengths.split(",")],
        args.context,
        args.repeats,
    )
    print(markdown(rows))
    if args.json:
        write_json_atomic(args.json, rows, indent=1)


if __name__ == "__main__":
    main()
