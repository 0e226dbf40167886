"""Online-adaptation metrics: one JSON line per served request and per trainer or swap event, and their plot.

Request rows carry ``event="request"``, the ``version`` of the weights that drafted them (drafter version, or the
version of the row's domain adapter; 0 = the initial weights), ``domain``, ``mean_acceptance_length`` (tokens
committed per target verification), ``mean_verify_length`` (tokens the target verified per step) and
``tokens_per_s`` (the request's generate() call). Events: ``round`` (a version published), ``swap`` (the serving
side adopted one), ``swap_failed`` and ``trainer_error`` (with the reason).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path


class MetricsLog:
    """Appends rows to a JSONL file from any thread; each row is flushed as it is written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, event: str, **fields) -> dict:
        row = {"event": event, "time": round(time.time(), 3), **fields}
        with self._lock, self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        return row

    def rows(self, event: str | None = None) -> list[dict]:
        return read_metrics(self.path, event)


def read_metrics(path: str | os.PathLike, event: str | None = None) -> list[dict]:
    """Rows of a metrics file; a torn last line (a crash while appending) is skipped."""
    rows = []
    if not Path(path).exists():
        return rows
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if event is None or row.get("event") == event:
            rows.append(row)
    return rows


def acceptance_by_version(rows: list[dict]) -> list[dict]:
    """Per version: requests, mean acceptance length, mean verify length and tokens/s (request rows only)."""
    groups = defaultdict(list)
    for row in rows:
        if row.get("event") == "request":
            groups[row["version"]].append(row)
    return [
        {
            "version": version,
            "requests": len(group),
            "mean_acceptance_length": sum(r["mean_acceptance_length"] for r in group) / len(group),
            "mean_verify_length": sum(r["mean_verify_length"] for r in group) / len(group),
            "tokens_per_s": sum(r["tokens_per_s"] for r in group) / len(group),
        }
        for version, group in sorted(groups.items())
    ]


def _rolling_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot_acceptance(runs: dict[str, list[dict]], path: str | os.PathLike, title: str = "") -> Path:
    """Draws, for runs that served the same stream (e.g. ``{"adapted": rows, "not adapted": rows}``): acceptance
    length per request (rolling mean of 16) against the request index, and the mean acceptance length per drafter
    version of the *first* run, every run averaged over the requests that version served (a paired comparison)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_request, by_version) = plt.subplots(1, 2, figsize=(11, 4))
    served = [[row for row in rows if row.get("event") == "request"] for rows in runs.values()]
    versions = [row["version"] for row in served[0]]
    for label, requests in zip(runs, served):
        values = [row["mean_acceptance_length"] for row in requests]
        by_request.plot(range(len(values)), _rolling_mean(values, 16), label=label)
        groups = defaultdict(list)
        for version, value in zip(versions, values):
            groups[version].append(value)
        xs = sorted(groups)
        by_version.plot(xs, [sum(groups[x]) / len(groups[x]) for x in xs], "o-", label=label)
    first = next(iter(runs))
    by_request.set(xlabel="request", ylabel="acceptance length (rolling mean of 16)", title=title or "served stream")
    by_version.set(
        xlabel=f"drafter version serving the request ({first})", ylabel="mean acceptance length", title="per version"
    )
    for axes in (by_request, by_version):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
