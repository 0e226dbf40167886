"""Online adaptation (docs/algorithm.md §5): buffer served requests, train the drafter (or per-domain LoRA adapters) on
them in the background, and hot-swap the published weights into the running generator between requests."""

from .buffer import Sample, SampleBuffer
from .config import OnlineConfig
from .generator import OnlineGenerator
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

_RENAMED = {"OnlineAdapter": "OnlineGenerator"}  # old name -> new name, kept for one release


def __getattr__(name: str):
    if name in _RENAMED:
        import warnings

        warnings.warn(
            f"`{name}` is renamed `{_RENAMED[name]}` (it is not a PEFT adapter) and will be removed in the next "
            "release; import `adaflash_hf.online.OnlineGenerator` instead.",
            FutureWarning,
            stacklevel=2,
        )
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MetricsLog",
    "OnlineConfig",
    "OnlineGenerator",
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
