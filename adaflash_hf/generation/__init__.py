"""Speculative decoding with AdaFlash drafters inside `target.generate()`."""

from .acceptance import greedy_acceptance, speculative_sampling
from .candidate_generator import AdaFlashCandidateGenerator, Drafts
from .decoding import adaflash_decoding
from .length_policy import LengthPolicy
from .routing import generate_loop, install, is_adaflash_drafter, is_installed, uninstall
from .stats import SpeculativeStats, record_stats

__all__ = [
    "AdaFlashCandidateGenerator",
    "Drafts",
    "LengthPolicy",
    "SpeculativeStats",
    "adaflash_decoding",
    "generate_loop",
    "greedy_acceptance",
    "install",
    "is_adaflash_drafter",
    "is_installed",
    "record_stats",
    "speculative_sampling",
    "uninstall",
]
