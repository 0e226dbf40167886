"""Tokenized, packed token streams: one uint16 array per domain and split, documents separated by eos.

Packing once (a few seconds for 24 MB) lets every training stage sample windows from memory-mapped arrays
instead of re-tokenizing text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from .corpus import DOMAINS, SPLITS, Document, load_documents

_ENCODE_BATCH = 256


def pack_documents(tokenizer: PreTrainedTokenizerFast, documents: list[Document]) -> np.ndarray:
    """Concatenates the documents' tokens, each followed by eos, so the model learns where documents end."""
    if len(tokenizer) > np.iinfo(np.uint16).max:
        raise ValueError(f"Vocabulary of {len(tokenizer)} tokens does not fit the uint16 token streams.")
    pieces = []
    for start in range(0, len(documents), _ENCODE_BATCH):
        batch = [document.text for document in documents[start : start + _ENCODE_BATCH]]
        for encoding in tokenizer.backend_tokenizer.encode_batch(batch, add_special_tokens=False):
            pieces.append(np.asarray(encoding.ids + [tokenizer.eos_token_id], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def stream_path(tokens_dir: Path, domain: str, split: str) -> Path:
    return Path(tokens_dir) / f"{domain}.{split}.npy"


def pack_corpus(corpus_dir: Path, tokenizer: PreTrainedTokenizerFast, tokens_dir: Path) -> dict:
    """Packs every domain and split; returns tokens and characters per token for each (the tokenizer's stats)."""
    Path(tokens_dir).mkdir(parents=True, exist_ok=True)
    summary = {}
    for domain, split in tqdm([(d, s) for d in DOMAINS for s in SPLITS], desc="pack", leave=False):
        documents = load_documents(corpus_dir, domain, split)
        stream = pack_documents(tokenizer, documents)
        np.save(stream_path(tokens_dir, domain, split), stream)
        chars = sum(len(document.text) for document in documents)
        tokens = int(stream.size) - len(documents)
        summary.setdefault(domain, {})[split] = {
            "tokens": int(stream.size),
            "chars_per_token": round(chars / max(tokens, 1), 3),
        }
    return summary


def load_streams(tokens_dir: Path, split: str) -> dict[str, np.ndarray]:
    """Memory-mapped token streams of one split, keyed by domain."""
    streams = {}
    for domain in DOMAINS:
        path = stream_path(tokens_dir, domain, split)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run the `tokenizer` stage (it packs the corpus) first.")
        streams[domain] = np.load(path, mmap_mode="r")
    return streams
