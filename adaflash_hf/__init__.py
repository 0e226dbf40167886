"""adaflash-hf: AdaFlash / DFlash block-diffusion speculative decoding for transformers, TRL and PEFT.

`import adaflash_hf` registers the Auto classes and routes `target.generate(..., assistant_model=drafter)` to
AdaFlash's speculative decoding whenever the assistant is an AdaFlash drafter (see `adaflash_hf.generation`).
"""

from transformers import AutoConfig, AutoModel

from .configuration import AdaFlashConfig, build_target_layer_ids
from .formats import CheckpointError
from .generation import (
    AdaFlashCandidateGenerator,
    LengthPolicy,
    SpeculativeStats,
    generate_loop,
    install,
    record_stats,
    uninstall,
)
from .modeling import AdaFlashDrafter, AdaFlashDrafterOutput, AdaptiveLengthHead, AdaptiveLengthHeadConfig

__version__ = "0.1.0"

AutoConfig.register(AdaFlashConfig.model_type, AdaFlashConfig, exist_ok=True)
AutoModel.register(AdaFlashConfig, AdaFlashDrafter, exist_ok=True)
AutoConfig.register(AdaptiveLengthHeadConfig.model_type, AdaptiveLengthHeadConfig, exist_ok=True)
AutoModel.register(AdaptiveLengthHeadConfig, AdaptiveLengthHead, exist_ok=True)
install()

__all__ = [
    "AdaFlashCandidateGenerator",
    "AdaFlashConfig",
    "AdaFlashDrafter",
    "AdaFlashDrafterOutput",
    "AdaptiveLengthHead",
    "AdaptiveLengthHeadConfig",
    "CheckpointError",
    "LengthPolicy",
    "SpeculativeStats",
    "build_target_layer_ids",
    "generate_loop",
    "install",
    "record_stats",
    "uninstall",
]
