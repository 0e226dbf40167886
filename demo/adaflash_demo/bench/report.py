"""Markdown tables, JSON files and PNG plots of benchmark records, each naming the machine that measured them."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from adaflash_hf.machine import machine_summary
from adaflash_hf.utils import write_json_atomic

from .harness import BenchRecord, records_as_dicts

COLUMNS = (
    "method",
    "batch_size",
    "domain",
    "dtype",
    "tokens_per_s",
    "speedup",
    "mean_acceptance_length",
    "verified_per_emitted",
    "identical_fraction",
    "padding_fraction",
    "speedup_95",
    "calls",
    "prefill_seconds",
    "decode_speedup",
    "decode_95",
)


def write_results(path, records, machine: dict) -> None:
    """The ``--json`` file: ``{"machine": machine_info(), "records": [...]}``."""
    write_json_atomic(path, {"machine": machine, "records": records_as_dicts(records)}, indent=2)


def read_results(path) -> tuple[dict | None, list[BenchRecord]]:
    """``(machine, records)`` of a ``--json`` file; files written before the machine was recorded (a bare list of
    records) give ``machine=None``. Fields a record does not know are skipped, missing ones take their defaults."""
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    machine, rows = (None, payload) if isinstance(payload, list) else (payload.get("machine"), payload["records"])
    fields = {field.name for field in dataclasses.fields(BenchRecord)}
    return machine, [BenchRecord(**{key: value for key, value in row.items() if key in fields}) for row in rows]


def machine_line(machine: dict | None) -> str:
    """The line that heads a report: the machine the numbers are from."""
    return "Machine: " + (machine_summary(machine) if machine else "not recorded")


def markdown_report(records, machine: dict | None) -> str:
    """The ``--markdown`` file and the printed report: the machine, every record, then the summaries."""
    kinds = step_kinds_table(records)
    return f"{machine_line(machine)}\n\n{markdown_table(records)}\n\n{summary_tables(records)}" + (
        f"\n\n{kinds}" if kinds else ""
    )


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def interval(record, of: str = "speedup") -> str:
    """A speedup's 95% interval, ``[low, high]`` (``-`` where it could not be computed); ``of="decode_speedup"``:
    the decoding's after the prefill."""
    low, high = getattr(record, f"{of}_low"), getattr(record, f"{of}_high")
    return "-" if low != low or high != high else f"[{low:.2f}, {high:.2f}]"


def _column(record, column: str) -> str:
    if column in ("speedup_95", "decode_95"):
        return interval(record, "speedup" if column == "speedup_95" else "decode_speedup")
    return _cell(getattr(record, column))


def markdown_table(records) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in sorted(records, key=lambda r: (r.batch_size, r.domain, r.method)):
        lines.append("| " + " | ".join(_column(r, c) for c in COLUMNS) + " |")
    return "\n".join(lines)


def summary_tables(records) -> str:
    """The two summaries of BENCHMARKS.md: batch 1 per domain (tokens/s / speedup / acceptance length, with the
    mean speedup over domains and the pooled one, `pooled_speedup`), and the batch sweep averaged over domains."""
    # the domains measured at batch 1: a larger batch size's pooled group is no column of it
    domains = sorted({r.domain for r in records if r.batch_size == 1})
    batch_one = defaultdict(dict)
    for r in records:
        if r.batch_size == 1:
            batch_one[r.method][r.domain] = r
    lines = []
    if domains:  # a run of larger batch sizes only has the sweep
        lines = ["| method | " + " | ".join(domains) + " | mean speedup | pooled |", "|" + "---|" * (len(domains) + 3)]
    for method, by_domain in sorted(batch_one.items()):
        cells = [_batch_one_cell(by_domain[d]) if d in by_domain else "-" for d in domains]
        mean = sum(r.speedup for r in by_domain.values()) / len(by_domain)
        pooled = pooled_speedup(by_domain.values(), batch_one.get("plain", {}).values())
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {mean:.2f}x | {pooled} |")
    sweep = defaultdict(list)
    for r in records:
        sweep[(r.batch_size, r.method)].append(r)
    lines += [
        *([""] if lines else []),
        "| batch | method | tokens/s | speedup vs plain | pooled | acceptance length | verified tokens per emitted "
        "token | padding share of verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (batch, method), group in sorted(sweep.items()):
        if batch == 1 and method not in ("plain", "adaflash_fixed", "adaflash_adaptive", "adaflash_planned"):
            continue
        mean = {c: sum(getattr(r, c) for r in group) / len(group) for c in (*COLUMNS[4:8], "padding_fraction")}
        padding = "-" if mean["padding_fraction"] != mean["padding_fraction"] else f"{mean['padding_fraction']:.2f}"
        pooled = pooled_speedup(group, sweep.get((batch, "plain"), ()))
        lines.append(
            f"| {batch} | {method} | {mean['tokens_per_s']:.1f} | {mean['speedup']:.2f}x | {pooled} | "
            f"{mean['mean_acceptance_length']:.2f} | {mean['verified_per_emitted']:.2f} | {padding} |"
        )
    return "\n".join(lines)


STEP_KINDS = ("plain", "probe", "drafted", "paths")


def step_kinds_table(records) -> str:
    """Where our loop's time went, per batch size and method over its domains: each step kind's steps and share of
    the time (`BenchRecord.steps_by_kind`), and for the steps that verify more than the anchor, what the planner
    predicted against what they cost and committed (its policy only; ``-`` elsewhere). Empty without such records."""
    summed: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for r in records:
        for kind, entry in (r.steps_by_kind or {}).items():
            for name, value in entry.items():
                summed[(r.batch_size, r.method)][kind][name] += value
    if not summed:
        return ""
    lines = [
        "| batch | method | "
        + " | ".join(f"{kind}: steps / time" for kind in STEP_KINDS)
        + " | wider steps: predicted / measured seconds | wider steps: predicted / committed tokens |",
        "|" + "---|" * (len(STEP_KINDS) + 4),
    ]
    for (batch, method), kinds in sorted(summed.items()):
        total = sum(entry["seconds"] for entry in kinds.values()) or 1.0
        cells = [
            f"{int(kinds[kind]['steps'])} / {kinds[kind]['seconds'] / total:.0%}" if kind in kinds else "-"
            for kind in STEP_KINDS
        ]
        wider = [kinds[kind] for kind in ("drafted", "paths") if kind in kinds]
        predicted_s, seconds = sum(e["predicted_s"] for e in wider), sum(e["seconds"] for e in wider)
        predicted_tokens, tokens = sum(e["predicted_tokens"] for e in wider), sum(e["emitted_tokens"] for e in wider)
        priced = f"{predicted_s:.1f} / {seconds:.1f} s" if predicted_s else "-"
        expected = f"{predicted_tokens:.0f} / {tokens:.0f}" if predicted_tokens else "-"
        lines.append(f"| {batch} | {method} | " + " | ".join(cells) + f" | {priced} | {expected} |")
    return "\n".join(lines)


def pooled_speedup(records, plain_records) -> str:
    """All of a method's tokens over all its seconds against plain's, over the same domains (issue 24's "pooled
    over all prompts": a slow domain weighs by its time, where the mean speedup weighs every domain alike); ``-``
    without plain records."""
    plain = {r.domain: r for r in plain_records}
    records = [r for r in records if r.domain in plain]
    if not records:
        return "-"
    tokens, seconds = sum(r.emitted_tokens for r in records), sum(r.seconds for r in records)
    plain_tokens, plain_seconds = (
        sum(plain[r.domain].emitted_tokens for r in records),
        sum(plain[r.domain].seconds for r in records),
    )
    return f"{(tokens / seconds) / (plain_tokens / plain_seconds):.2f}x"


def _batch_one_cell(record) -> str:
    speedup = f"{record.speedup:.2f}x" + ("" if interval(record) == "-" else f" {interval(record)}")
    return f"{record.tokens_per_s:.1f} / {speedup} / {record.mean_acceptance_length:.2f}"


def plot_records(records, folder) -> list[Path]:
    """`acceptance_per_domain.png` (batch 1) and `throughput_vs_batch.png` (mean over domains)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    paths = []
    batch_1 = [r for r in records if r.batch_size == 1 and r.method != "plain"]
    if batch_1:
        domains = sorted({r.domain for r in batch_1})
        methods = sorted({r.method for r in batch_1})
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = {r.domain: r.mean_acceptance_length for r in batch_1 if r.method == method}
            ax.bar(
                [d + i * width for d in range(len(domains))], [values.get(d, 0) for d in domains], width, label=method
            )
        ax.set_xticks([d + 0.4 - width / 2 for d in range(len(domains))], domains)
        ax.set_ylabel("mean acceptance length (tokens per target forward)")
        ax.set_title("Acceptance per domain, batch 1")
        ax.legend(fontsize=8)
        paths.append(_save(fig, folder / "acceptance_per_domain.png"))
    speeds = defaultdict(lambda: defaultdict(list))
    for r in records:
        speeds[r.method][r.batch_size].append(r.tokens_per_s)
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, by_batch in sorted(speeds.items()):
        sizes = sorted(by_batch)
        ax.plot(sizes, [sum(by_batch[b]) / len(by_batch[b]) for b in sizes], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (mean over domains)")
    ax.set_title("Throughput vs batch size")
    ax.legend(fontsize=8)
    paths.append(_save(fig, folder / "throughput_vs_batch.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
