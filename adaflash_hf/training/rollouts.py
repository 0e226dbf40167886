"""Training data for OPD: prompts encoded once, target rollouts generated per round and cached on disk.

A dataset row is either a prompt (`prompt` text or conversation, or `messages`) whose response the target generates
(on-policy, docs/algorithm.md §5), or a prompt with its response (`completion` or `response`, or `messages` ending in
an assistant turn) for offline runs. Rows of served traffic may come already tokenized (`prompt_ids` with
`completion_ids`), which keeps the target's exact tokens instead of a decode/encode round trip.

Rollouts of round ``r`` are written as a `datasets.Dataset` to ``<rollout_dir>/round-<r>`` atomically (temporary
directory + rename), so a resumed run loads them instead of generating again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from datasets import Dataset, load_from_disk
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..chat import render_prompt
from ..generation.stopping import cut_after_eos
from ..utils import atomic_directory

PROMPT_COLUMNS = ("prompt", "messages", "prompt_ids")
RESPONSE_COLUMNS = ("completion", "response", "completion_ids")


def check_columns(dataset: Dataset) -> None:
    """Raises one clear error when the dataset has neither prompts nor prompt/response pairs."""
    columns = set(dataset.column_names)
    if not columns & set(PROMPT_COLUMNS):
        raise ValueError(
            f"The dataset has columns {sorted(columns)} but needs a `prompt` or `messages` column (prompts the "
            "target answers), optionally with `completion`/`response` (offline prompt/response pairs), or token ids "
            "in `prompt_ids` + `completion_ids`."
        )


def is_offline(dataset: Dataset) -> bool:
    """Whether the dataset carries its responses (prompt/response pairs) instead of prompts only."""
    check_columns(dataset)
    columns = set(dataset.column_names)
    if columns & set(RESPONSE_COLUMNS):
        return True
    if "messages" in columns and "prompt" not in columns:
        last = dataset[0]["messages"][-1]
        return last.get("role") == "assistant"
    return False


def encode_example(example: dict, tokenizer, chat_template_kwargs: dict) -> dict:
    """``{"prompt_ids": [...]}`` plus ``"completion_ids"`` for offline rows. Conversations are rendered with the
    chat template and a generation prompt (docs/algorithm.md §4.1: loss on the last assistant turn only)."""
    if example.get("prompt_ids") is not None:
        return {key: list(example[key]) for key in ("prompt_ids", "completion_ids") if example.get(key) is not None}
    completion = next((example[c] for c in RESPONSE_COLUMNS if example.get(c) is not None), None)
    prompt = example.get("prompt")
    if prompt is None:
        messages = example["messages"]
        if messages[-1].get("role") == "assistant":
            messages, completion = messages[:-1], messages[-1]["content"]
        prompt_ids = render_prompt(tokenizer, messages, tokenize=True, **chat_template_kwargs)
    elif isinstance(prompt, str):
        prompt_ids = tokenizer(prompt)["input_ids"]
    else:
        prompt_ids = render_prompt(tokenizer, prompt, tokenize=True, **chat_template_kwargs)
    encoded = {"prompt_ids": prompt_ids}
    if completion is not None:
        if not isinstance(completion, str):  # conversational completion: [{"role": "assistant", "content": ...}]
            completion = completion[-1]["content"]
        encoded["completion_ids"] = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return encoded


def encode_dataset(dataset: Dataset, tokenizer, chat_template_kwargs: dict | None = None) -> Dataset:
    """Encodes every row once; adds ``row_index`` so rollouts can be looked up by row."""
    kwargs = chat_template_kwargs or {}
    encoded = dataset.map(
        lambda example, index: {**encode_example(example, tokenizer, kwargs), "row_index": index},
        with_indices=True,
        remove_columns=dataset.column_names,
        desc="Encoding prompts",
    )
    return encoded


@torch.no_grad()
def generate_completions(
    target,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    pad_token_id: int,
    batch_size: int = 8,
    assistant_model=None,
    stopping_criteria=None,
) -> list[list[int]]:
    """The one place rollouts are generated: the target answers each prompt; returns the new token ids per prompt,
    cut after the first end-of-sequence token (which is kept, like the reference's appended ``<|im_end|>``).

    ``assistant_model`` (the current drafter) makes ``target.generate`` speculative: faster, with the same outputs
    under greedy decoding and the same distribution under sampling. ``stopping_criteria`` (a
    `transformers.StoppingCriteriaList`) ends rows early; a row it ends is padded after its last token, so a caller
    whose pad token is also an end of sequence cuts such rows itself.
    """
    device = next(target.parameters()).device
    completions = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="Generating rollouts", leave=False):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        extra = {"assistant_model": assistant_model} if assistant_model is not None else {}
        if stopping_criteria is not None:
            extra["stopping_criteria"] = stopping_criteria
        output = target.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=generation_config,
            **extra,
        )
        completions += [cut_after_eos(new_tokens, generation_config) for new_tokens in output[:, width:].tolist()]
    return completions


def rollout_generation_config(args, tokenizer, eos_token_ids: list[int]) -> GenerationConfig:
    """Greedy when ``args.temperature == 0`` (every AdaFlash recipe), sampling at that temperature otherwise."""
    sampling = args.temperature > 0
    kwargs = dict(
        max_new_tokens=args.max_completion_length,
        do_sample=sampling,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_ids,
    )
    if sampling:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None)
    return GenerationConfig(**kwargs)


def rollout_fingerprint(prompt_ids: list[list[int]], generation_config: GenerationConfig) -> str:
    """Identifies what a rollout round answers: the prompts and the generation settings."""
    digest = hashlib.sha256(json.dumps([list(ids) for ids in prompt_ids]).encode())
    digest.update(generation_config.to_json_string(use_diff=True).encode())
    return digest.hexdigest()


class RolloutStore:
    """Rollout datasets by round under ``directory``; each round is written once, atomically, with the fingerprint
    of the prompts and settings it answers, so a resumed run never trains on rollouts of another dataset."""

    FINGERPRINT = "fingerprint.txt"

    def __init__(self, directory: str | os.PathLike, fingerprint: str):
        self.directory = Path(directory)
        self.fingerprint = fingerprint

    def path(self, round_index: int) -> Path:
        return self.directory / f"round-{round_index:05d}"

    def load_or_generate(self, round_index: int, generate) -> Dataset:
        """Loads round ``round_index`` if it was written before, else writes ``generate()`` (a `Dataset`) there."""
        final = self.path(round_index)
        if final.exists():
            stored = (final / self.FINGERPRINT).read_text().strip() if (final / self.FINGERPRINT).exists() else None
            if stored != self.fingerprint:
                raise ValueError(
                    f"{final} holds rollouts of other prompts or generation settings than this run's. Delete "
                    f"{self.directory}, or point rollout_dir elsewhere, to generate them anew."
                )
            return load_from_disk(str(final))
        with atomic_directory(final) as staging:
            generate().save_to_disk(str(staging))
            (staging / self.FINGERPRINT).write_text(self.fingerprint + "\n")
        return load_from_disk(str(final))


def collate_sequences(
    pairs: list[tuple[list[int], list[int]]], pad_token_id: int, max_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pads ``prompt + completion`` rows into ``input_ids``, ``attention_mask`` and ``loss_mask`` (1 on
    response tokens only), all ``[B, S]``; rows longer than ``max_length`` keep their first ``max_length`` tokens."""
    sequences = [(prompt + completion)[:max_length] for prompt, completion in pairs]
    width = max(map(len, sequences))
    input_ids = torch.full((len(pairs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros_like(input_ids)
    for row, ((prompt, _), tokens) in enumerate(zip(pairs, sequences)):
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        loss_mask[row, len(prompt) : len(tokens)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
