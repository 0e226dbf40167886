"""The world's byte-level BPE tokenizer, trained on the training split of all four domains.

Byte-level BPE never produces an unknown token, so any prompt (code, man page box drawing, non-ASCII prose)
round-trips exactly. The three special tokens get fixed ids: ``<|endoftext|>`` (0) separates documents and is the
eos, ``<|mask|>`` (1) is the drafter's ``mask_token_id`` and ``<|pad|>`` (2) pads batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, PAD_TOKEN)


@dataclass
class TokenizerConfig:
    """Byte-level BPE settings."""

    vocab_size: int = field(
        default=8192,
        metadata={
            "help": "Vocabulary size including the 256 byte tokens and 3 specials. 8k gives about 3.6 chars/token "
            "here while keeping the embedding (vocab x hidden) a quarter of an 8M-parameter target."
        },
    )
    min_frequency: int = field(default=2, metadata={"help": "Pairs seen fewer times are never merged."})
    model_max_length: int = field(default=2048, metadata={"help": "Longest sequence the tokenizer advertises."})


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig) -> PreTrainedTokenizerFast:
    """Trains the BPE on ``texts`` (training documents only, so held-out text cannot shape the vocabulary)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=config.model_max_length,
    )


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """Loads a saved world tokenizer and checks the special-token ids the models and drafter rely on."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    expected = dict(zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))))
    actual = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if actual != expected:
        raise ValueError(f"{path} is not a world tokenizer: special token ids are {actual}, expected {expected}.")
    return tokenizer
