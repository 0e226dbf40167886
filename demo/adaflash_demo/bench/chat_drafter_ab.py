"""The chat drafter's shape, chosen by measurement at small scale (issue 25): drafter variants trained for an equal
wall-clock budget on one fixed slice of the chat build's answers, then measured through the real loop.

Each variant is a run of the recipe (`adaflash_demo.recipe`, a ``run_name`` of its own) on the same answer shards
and, where it taps the same target layers, the same stored features. Per variant:

1. **calibrate**: a few training steps time the variant's step on this machine;
2. **train**: as many steps as the budget allows at that pace (cosine schedule to the end, one evaluation);
3. **measure**: greedy acceptance with the whole block verified, through ``target.generate(assistant_model=...)``
   (float32, batch 8), on the first held-out prompts of the chat domain and of each old domain; and what a step
   costs at batch 1 (the loop's own step records: the draft, the block's verification) against a plain step of
   the target timed by hooks, so that the variants are compared by acceptance per unit of cost:
   ``modelled speedup = acceptance length x plain step / (draft + verification)``.

Results go to ``--out`` (one entry per variant, written atomically after each one, so an interrupted run resumes
with the variants it lacks). Two processes, one thread each, share the variants with ``--variants``:

    OMP_NUM_THREADS=1 taskset -c 0 python -m adaflash_demo.bench.chat_drafter_ab --variants base,block8
    OMP_NUM_THREADS=1 taskset -c 1 python -m adaflash_demo.bench.chat_drafter_ab --variants taps6,layers3

A drafter built outside the A/B (the recipe's full build) is measured by the same harness beside the one the demo
ships, without training anything:

    python -m adaflash_demo.bench.chat_drafter_ab --variants shipped \
        --drafter chat-b8=build/smollm2-chat-drafter/drafter --old_prompts 16 --out <file>
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from adaflash_hf.chat import render_prompt
from adaflash_hf.machine import machine_info, machine_summary
from adaflash_hf.utils import write_json_atomic

from .. import recipe
from ..demo import drafter_path

CONFIG = "demo/recipes/smollm2-chat-drafter.yaml"
# The variants against the shipped drafter's shape (`base`: 2 layers, target layers [1, 10, 19, 27], block 16, OPD,
# 16 anchors a sequence, an 8,192-token draft vocabulary), each a change of the recipe's settings (which the A/B set
# to block 8, BENCHMARKS.md section 1d). Six target layers spread as DFlash spreads them
# (`build_target_layer_ids(30, 6)`); DFlash 2 drafts over the whole vocabulary.
VARIANTS: dict[str, dict] = {
    "base": {"block_size": 16},
    "layers3": {"block_size": 16, "num_hidden_layers": 3},
    "taps6": {"block_size": 16, "target_layer_ids": [1, 6, 11, 17, 22, 27], "features_dir": "{work}/features-taps6"},
    "block8": {"block_size": 8},
    "anchors32": {"block_size": 16, "num_anchors": 32},
    "ce": {"block_size": 16, "loss_type": "ce"},
    "dflash2": {"block_size": 16, "drafter_type": "dflash2", "draft_vocab_size": 0},
    "shipped": {},
}
OLD_DOMAINS = ("code", "docs", "shell", "math")
UNSEEN_DOMAIN = "changelog"
# `shipped` trains nothing: it measures the drafter the demo ships, for a side-by-side with the variants.
SHIPPED_DRAFTER = drafter_path(None)
CURVE_KEYS = ("eval_acceptance_length", "eval_step_acceptance_length", recipe.LOOP_METRIC)


def variant_config(name: str, args) -> recipe.RecipeConfig:
    overrides = {
        key: value.format(work=args.work_dir) if isinstance(value, str) else value
        for key, value in VARIANTS[name].items()
    }
    argv = [
        "--config",
        args.config,
        "--work_dir",
        args.work_dir,
        "--run_name",
        f"{getattr(args, 'run_prefix', 'ab')}-{name}",
    ]
    argv += ["--answer_shards", *map(str, args.shards)]
    # By default checkpoints are chosen by the trainer's anchor average (one evaluation, at the end), and `measure`
    # runs the loop itself; a longer run can evaluate through the loop along the way (`--select_prompts`).
    argv += ["--select_prompts_per_domain", str(getattr(args, "select_prompts", 0))]
    for key, value in overrides.items():
        argv += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    (config,) = recipe.make_parser().parse_args_and_config(argv)
    return config


def calibrate(config: recipe.RecipeConfig, steps: int) -> float:
    """Seconds a training step of this variant takes here (a short run of its own, then discarded)."""
    calibration = recipe.RecipeConfig(
        **{
            **vars(config),
            "run_name": f"{config.run_name}-calibration",
            "max_steps": steps,
            "save_steps": 10 * steps,
            "warmup_steps": 1,
        }
    )
    layout = recipe.Layout(calibration)
    if not (layout.drafter / "config.json").exists():
        recipe.stage_train(calibration, layout)
    log = json.loads((layout.drafter / "training_log.json").read_text())
    # The trainer's logged step times, the first window apart: it pays the start (features read cold, allocation).
    times = [float(entry["step_time"]) for entry in log["log_history"] if "step_time" in entry]
    return statistics.median(times[1:] or times)


def measure(config: recipe.RecipeConfig, args, drafter_dir: Path | None = None, label: str | None = None) -> dict:
    """Held-out acceptance (whole block) per domain at batch 8, and step costs at batch 1, of the variant's drafter
    (or the one in ``drafter_dir``, printed as ``label``)."""
    from transformers import GenerationConfig

    import adaflash_hf
    from adaflash_hf import AdaFlashDrafter

    from ..smollm2 import load_target

    layout = recipe.Layout(config)
    target, tokenizer = load_target()
    drafter = AdaFlashDrafter.from_pretrained(drafter_dir or layout.drafter, dtype=torch.float32).eval()
    acceptance = {}
    counts = [("chat", args.chat_prompts)] + [(d, args.old_prompts) for d in OLD_DOMAINS]
    for domain, count in counts + [(UNSEEN_DOMAIN, args.old_prompts)]:
        stats = recipe.heldout_acceptance(target, tokenizer, drafter, layout.prompts, domain, count, args.new_tokens)
        acceptance[domain] = round(stats.mean_acceptance_length, 3)
        print(f"  {label or config.run_name} {domain}: acceptance {acceptance[domain]}", flush=True)

    # Costs at batch 1 on chat prompts: plain forwards timed by hooks, the loop's draft and verification per step.
    rows = recipe.evaluation_prompts(layout.prompts, "chat", args.cost_prompts)
    forwards, started = [], [0.0]
    pre = target.register_forward_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
    post = target.register_forward_hook(lambda *_: forwards.append(time.perf_counter() - started[0]))
    plain_steps, draft, verify = [], [], []
    fixed = GenerationConfig(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        adaflash_length_policy="fixed",
    )
    plain = GenerationConfig(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    for row in rows:
        ids = tokenizer(render_prompt(tokenizer, row["prompt"]), return_tensors="pt")
        forwards.clear()
        target.generate(**ids, generation_config=plain)
        plain_steps += forwards[1:]  # the prefill apart
        with adaflash_hf.record_stats() as stats:
            target.generate(**ids, generation_config=fixed, assistant_model=drafter)
        for step in stats.calls[-1].steps:
            draft.append(step.draft_time_s)
            verify.append(step.target_time_s)
    pre.remove()
    post.remove()
    plain_s, draft_s, verify_s = (statistics.median(values) for values in (plain_steps, draft, verify))
    speedup = {domain: round(value * plain_s / (draft_s + verify_s), 3) for domain, value in acceptance.items()}
    return {
        "acceptance": acceptance,
        "plain_step_s": round(plain_s, 5),
        "draft_s": round(draft_s, 5),
        "verify_s": round(verify_s, 5),
        "draft_in_plain_steps": round(draft_s / plain_s, 3),
        "verify_in_plain_steps": round(verify_s / plain_s, 3),
        "modelled_speedup": speedup,
        "parameters": sum(p.numel() for p in drafter.parameters()),
    }


def report(results: dict) -> str:
    """The results as a markdown table: acceptance and modelled speedup per domain (the unseen changelog domain where
    it was measured), costs in plain steps."""
    domains = ("chat", *OLD_DOMAINS, UNSEEN_DOMAIN)
    lines = [
        "| variant | steps (s a step) | " + " | ".join(domains) + " | old mean | draft / verify (plain steps) |",
        "|---" * (len(domains) + 4) + "|",
    ]
    for name, row in results.items():
        if name in ("machine", "slice"):
            continue
        accepted, modelled = row["acceptance"], row["modelled_speedup"]
        cells = [f"{accepted[d]:.2f} / {modelled[d]:.2f}x" if d in accepted else "-" for d in domains]
        old = sum(accepted[d] for d in OLD_DOMAINS) / len(OLD_DOMAINS)
        steps = "-" if row["steps"] is None else str(row["steps"])
        if row["calibrated_step_s"] is not None:
            steps += f" ({row['calibrated_step_s']:.2f})"
        lines.append(
            f"| {name} | {steps} | " + " | ".join(cells) + f" | {old:.2f} | "
            f"{row['draft_in_plain_steps']:.2f} / {row['verify_in_plain_steps']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated, of {', '.join(VARIANTS)}.")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--work_dir", default="build/smollm2-chat-drafter")
    parser.add_argument(
        "--shards",
        type=int,
        nargs="+",
        default=[0, 1, 2, 24, 25],
        help="Answer shards trained on (the chat build: 0-23 chat, 24-39 the four old domains).",
    )
    parser.add_argument("--run_prefix", default="ab", help="Variants train as recipe runs named <prefix>-<variant>.")
    parser.add_argument("--budget_minutes", type=float, default=22.0, help="Training wall-clock per variant.")
    parser.add_argument("--calibration_steps", type=int, default=30)
    parser.add_argument(
        "--evaluations", type=int, default=1, help="Evaluations (and checkpoints) spread over each variant's steps."
    )
    parser.add_argument(
        "--select_prompts",
        type=int,
        default=0,
        help="Validation prompts per domain measured through the loop at each evaluation, the best checkpoint "
        "chosen by their mean (the recipe's select_prompts_per_domain); 0: by the trainer's anchor average.",
    )
    parser.add_argument("--chat_prompts", type=int, default=16, help="Held-out chat prompts measured.")
    parser.add_argument("--old_prompts", type=int, default=8, help="Held-out prompts measured per old domain.")
    parser.add_argument("--cost_prompts", type=int, default=3, help="Chat prompts the batch-1 costs are timed on.")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--out", default="demo/adaflash_demo/bench/results/smollm2_chat_drafter_ab.json")
    parser.add_argument("--report", action="store_true", help="Only print the results in --out as a markdown table.")
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="Also measure a drafter already built (a recipe's `drafter` folder or any saved drafter), beside the "
        "variants and without training, as the row NAME; repeatable.",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report:
        print(report(json.loads(out.read_text())))
        return
    built = {}
    for entry in args.drafter:
        name, _, path = entry.partition("=")
        if not name or not path or name in VARIANTS or not (Path(path) / "config.json").exists():
            parser.error(
                f"--drafter {entry!r}: give NAME=PATH, a name other than the variants' and the folder of a saved "
                "drafter (with its config.json)"
            )
        built[name] = Path(path)
    for name, path in built.items():
        if name in (json.loads(out.read_text()) if out.exists() else {}):
            continue
        log = path / "training_log.json"
        steps = json.loads(log.read_text())["steps"] if log.exists() else None
        result = {"overrides": {}, "calibrated_step_s": None, "steps": steps, "train_s": None, "path": str(path)}
        _save(out, name, {**result, **measure(variant_config("shipped", args), args, path, label=name)}, args)
    for name in filter(None, args.variants.split(",")):
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; the variants are {', '.join(VARIANTS)}")
        done = json.loads(out.read_text()) if out.exists() else {}
        if name in done:
            continue
        config = variant_config(name, args)
        layout = recipe.Layout(config)
        if name == "shipped":
            result = {"overrides": {}, "calibrated_step_s": None, "steps": None, "train_s": None}
            _save(out, name, {**result, **measure(config, args, SHIPPED_DRAFTER)}, args)
            continue
        recipe.stage_features(config, layout)
        step_s = calibrate(config, args.calibration_steps)
        steps = max(10, int(args.budget_minutes * 60 / step_s))
        evaluations = max(1, min(args.evaluations, steps))
        config.max_steps, config.save_steps, config.warmup_steps = steps, steps // evaluations, max(1, steps // 10)
        print(f"{name}: {step_s:.3f} s a step here, {steps} steps in {args.budget_minutes} min", flush=True)
        started = time.perf_counter()
        recipe.stage_train(config, layout)
        trained_s = time.perf_counter() - started
        result = {
            "overrides": VARIANTS[name],
            "calibrated_step_s": round(step_s, 4),
            "steps": steps,
            "train_s": round(trained_s, 1),
            **measure(config, args),
        }
        log = json.loads((layout.drafter / "training_log.json").read_text())
        result["selected_by"], result["best_metric"] = log["selected_by"], log["best_metric"]
        result["best_checkpoint"] = log["best_checkpoint"]
        # the evaluations along the way: the trainer's anchor average and, with --select_prompts, the loop's
        result["curve"] = [
            {key: value for key, value in entry.items() if key == "step" or key.startswith(CURVE_KEYS)}
            for entry in log["log_history"]
            if any(key.startswith(CURVE_KEYS) for key in entry)
        ]
        _save(out, name, result, args)


def _save(out: Path, name: str, result: dict, args) -> None:
    """Adds one variant's result to ``out`` (atomically: another process may have added its variants)."""
    done = json.loads(out.read_text()) if out.exists() else {}
    done.setdefault("machine", machine_summary(machine_info()))
    done.setdefault(
        "slice",
        {
            "shards": args.shards,
            "budget_minutes": args.budget_minutes,
            "evaluations": args.evaluations,
            "select_prompts": args.select_prompts,
            "new_tokens": args.new_tokens,
            "chat_prompts": args.chat_prompts,
            "old_prompts": args.old_prompts,
        },
    )
    done[name] = result
    write_json_atomic(out, done, indent=1)
    print(f"{name}: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
