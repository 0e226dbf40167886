"""Online-adaptation metrics: one JSON line per served request and per trainer or swap event, and their plot.

Request rows carry ``event="request"``, the ``version`` of the weights that drafted them (drafter version, or the
version of the row's domain adapter; 0 = the initial weights), ``domain``, ``mean_acceptance_length`` (tokens
committed per target verification), ``mean_verify_length`` (tokens the target verified per step) and
``tokens_per_s`` (the request's generate() call). Events: ``round`` (a version published), ``swap`` (the serving
side adopted one), ``swap_failed`` and ``trainer_error`` (with the reason).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from ..utils import append_jsonl, read_jsonl


class MetricsLog:
    """Appends rows to a JSONL file from any thread; each row is flushed as it is written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, event: str, **fields) -> dict:
        row = {"event": event, "time": round(time.time(), 3), **fields}
        with self._lock:
            append_jsonl(self.path, row)
        return row

    def rows(self, event: str | None = None) -> list[dict]:
        return read_metrics(self.path, event)


def read_metrics(path: str | os.PathLike, event: str | None = None) -> list[dict]:
    """Rows of a metrics file; a torn last line (a crash while appending) is skipped."""
    if not Path(path).exists():
        return []
    return [row for row in read_jsonl(path, skip_invalid=True) if event is None or row.get("event") == event]


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


def pair_with_baseline(by_version: list[dict], adapted: list[dict], baseline: list[dict]) -> None:
    """Adds, per drafter version, the not-adapted run's acceptance on exactly the requests that version served (both
    runs serve the same stream in the same order, so request rows align)."""
    adapted = [row for row in adapted if row["event"] == "request"]
    baseline = [row for row in baseline if row["event"] == "request"]
    for entry in by_version:
        served = [i for i, row in enumerate(adapted) if row["version"] == entry["version"]]
        entry["not_adapted_same_requests"] = sum(baseline[i]["mean_acceptance_length"] for i in served) / len(served)


def online_summary(rows: list[dict]) -> dict:
    """Acceptance per version, and per domain over the first and the last quarter of the stream."""
    requests = [row for row in rows if row["event"] == "request"]
    quarter = max(len(requests) // 4, 1)
    by_domain = {}
    for domain in dict.fromkeys(str(row["domain"]) for row in requests):
        own = [row["mean_acceptance_length"] for row in requests if str(row["domain"]) == domain]
        part = max(len(own) // 4, 1)
        by_domain[domain] = (sum(own[:part]) / part, sum(own[-part:]) / part)
    return {
        "requests": len(requests),
        "first_quarter": sum(r["mean_acceptance_length"] for r in requests[:quarter]) / quarter,
        "last_quarter": sum(r["mean_acceptance_length"] for r in requests[-quarter:]) / quarter,
        "by_version": acceptance_by_version(rows),
        "by_domain": by_domain,
    }


def _rolling_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; matplotlib is an optional extra of the library."""
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "Plotting needs matplotlib, an optional extra: pip install 'adaflash-hf[plot]'", name=error.name
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(runs: dict[str, list[dict]], path: str | os.PathLike, title: str = "") -> Path:
    """Draws, for runs that served the same stream (e.g. ``{"adapted": rows, "not adapted": rows}``): acceptance
    length per request (rolling mean of 16) against the request index, and the mean acceptance length per drafter
    version of the *first* run, every run averaged over the requests that version served (a paired comparison)."""
    plt = pyplot()
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
