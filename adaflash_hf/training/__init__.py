"""Training AdaFlash / DFlash drafters: `OPDConfig` + `OPDTrainer` (TRL-style), offline length-head init, recipes."""

from .config import OPDConfig
from .draft_vocab import build_draft_vocab
from .evaluation import AcceptanceStats, measure_acceptance
from .features import FeatureCache
from .trainer import OPDTrainer

__all__ = ["AcceptanceStats", "FeatureCache", "OPDConfig", "OPDTrainer", "build_draft_vocab", "measure_acceptance"]
