"""adaflash-hf: AdaFlash / DFlash block-diffusion speculative decoding for transformers, TRL and PEFT.

`import adaflash_hf` registers the Auto classes and routes `target.generate(..., assistant_model=drafter)` to
AdaFlash's speculative decoding whenever the assistant is an AdaFlash drafter (see `adaflash_hf.generation`).

Training and online adaptation are importable from the top level too (`from adaflash_hf import OPDConfig,
OPDTrainer, OnlineGenerator`), as TRL exports its trainers; they load on first use, because they import TRL and
accelerate, which inference does not need.
"""

import importlib
from typing import TYPE_CHECKING

from transformers import AutoConfig, AutoModel

from .configuration import AdaFlashConfig, AdaptiveLengthHeadConfig, build_target_layer_ids
from .generation import (
    AdaFlashCandidateGenerator,
    LengthPolicy,
    SpeculativeStats,
    generate_loop,
    install,
    record_stats,
    uninstall,
)
from .modeling import AdaFlashDrafter, AdaFlashDrafterOutput, AdaptiveLengthHead
from .schema import CheckpointError

__version__ = "0.1.0"

# name -> subpackage, imported on first access (PEP 562)
_LAZY_EXPORTS = {
    "AcceptanceStats": "training",
    "OPDConfig": "training",
    "OPDTrainer": "training",
    "measure_acceptance": "training",
    "OnlineGenerator": "online",
    "OnlineAdapter": "online",  # deprecated: renamed OnlineGenerator (warns on use)
    "OnlineConfig": "online",
    "VersionStore": "online",
    "serve_stream": "online",
}

if TYPE_CHECKING:
    from .online import OnlineConfig, OnlineGenerator, VersionStore, serve_stream
    from .training import AcceptanceStats, OPDConfig, OPDTrainer, measure_acceptance


def __getattr__(name: str):
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY_EXPORTS[name]}", __name__), name)
    if name != "OnlineAdapter":  # the deprecated name warns on every use, so it is never cached
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_EXPORTS})


AutoConfig.register(AdaFlashConfig.model_type, AdaFlashConfig, exist_ok=True)
AutoModel.register(AdaFlashConfig, AdaFlashDrafter, exist_ok=True)
AutoConfig.register(AdaptiveLengthHeadConfig.model_type, AdaptiveLengthHeadConfig, exist_ok=True)
AutoModel.register(AdaptiveLengthHeadConfig, AdaptiveLengthHead, exist_ok=True)
install()

__all__ = [
    "AcceptanceStats",
    "AdaFlashCandidateGenerator",
    "AdaFlashConfig",
    "AdaFlashDrafter",
    "AdaFlashDrafterOutput",
    "AdaptiveLengthHead",
    "AdaptiveLengthHeadConfig",
    "CheckpointError",
    "LengthPolicy",
    "OPDConfig",
    "OPDTrainer",
    "OnlineConfig",
    "OnlineGenerator",
    "SpeculativeStats",
    "build_target_layer_ids",
    "generate_loop",
    "install",
    "measure_acceptance",
    "record_stats",
    "serve_stream",
    "uninstall",
    "VersionStore",
]
