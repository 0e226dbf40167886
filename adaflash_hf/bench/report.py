"""Markdown tables and PNG plots of benchmark records."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

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
)


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown_table(records) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in sorted(records, key=lambda r: (r.batch_size, r.domain, r.method)):
        lines.append("| " + " | ".join(_cell(getattr(r, c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


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
