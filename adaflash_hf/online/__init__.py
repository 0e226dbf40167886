"""Online adaptation (docs/algorithm.md §5): buffer served requests, train the drafter (or per-domain LoRA adapters) on
them in the background, and hot-swap the published weights into the running generator between requests."""

from .adapter import OnlineAdapter
from .buffer import Sample, SampleBuffer
from .config import OnlineConfig
from .metrics import (
    MetricsLog,
    acceptance_by_version,
    online_summary,
    pair_with_baseline,
    plot_acceptance,
    read_metrics,
)
from .publishing import Publication, PublishError, VersionStore
from .rounds import RoundTrainer
from .simulate import serve_stream

__all__ = [
    "MetricsLog",
    "OnlineAdapter",
    "OnlineConfig",
    "Publication",
    "PublishError",
    "RoundTrainer",
    "Sample",
    "SampleBuffer",
    "VersionStore",
    "acceptance_by_version",
    "online_summary",
    "pair_with_baseline",
    "plot_acceptance",
    "read_metrics",
    "serve_stream",
]
