"""The training view of one drafter step: target features and the many-block drafter forward.

Shared by the trainer, the acceptance measurement and the offline length-head initialisation, so all three see the
drafter exactly as it runs at inference (the block mask makes one forward over N blocks equal N cached inference
steps; see `tests/test_modeling.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..draft_vocab_rows import vocab_ids, vocab_rows
from ..utils import atomic_path, write_json_atomic
from .blocks import BlockLayout, block_attention_mask, block_label_positions, block_noise_ids, block_position_ids
from .losses import TeacherTop, teacher_top


@dataclass
class TargetFeatures:
    """One no-grad target forward over ``[B, S]`` tokens.

    context (`[B, S, K*H]`): ``hidden_states[i + 1]`` for each of the drafter's ``target_layer_ids``, concatenated.
    last_hidden (`[B, S, H]`): the final-normed last hidden state; the target's ``lm_head`` of row ``t`` is its
        distribution for the token at ``t + 1``.
    teacher (`TeacherTop` of `[B, S]` tensors, *optional*): the argmax and log-sum-exp of those logits over the
        whole vocabulary, which is all a drafter with a reduced draft vocabulary needs of the whole head
        (`FeatureCache` stores them, so such a training step never projects the whole vocabulary).
    """

    context: torch.Tensor
    last_hidden: torch.Tensor
    teacher: TeacherTop | None = None


@torch.no_grad()
def target_features(target, input_ids, attention_mask, target_layer_ids) -> TargetFeatures:
    outputs = target.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in target_layer_ids],
        use_cache=False,
    )
    context = torch.cat([outputs.hidden_states[i + 1] for i in target_layer_ids], dim=-1)
    return TargetFeatures(context=context, last_hidden=outputs.last_hidden_state)


class FeatureCache:
    """The target's features of each training sequence on disk, so that only the first time a sequence is seen pays
    the target forward: later epochs, evaluations and resumed runs read them back.

    With fixed responses (offline pairs, or rollouts generated once) the target forward is the same every epoch, and
    for a small drafter it is a large part of each training step; reading stored features replaces it with a file
    read (the demo recipe's build: BENCHMARKS.md §1).

    One safetensors file per sequence (``context [L, K*H]``, ``last_hidden [L, H]``, and the teacher's
    whole-vocabulary ``teacher_argmax [L]`` / ``teacher_logsumexp [L]`` computed from the stored ``last_hidden``),
    named by a hash of its ``L`` token ids, written atomically, so concurrent processes and interrupted runs never
    leave a torn entry. The
    directory records which target and layers it holds (``fingerprint.json``); another target's directory is
    refused. Features are stored in ``dtype``: bfloat16 is exactly what a drafter trained under bf16 autocast
    receives (its ``fc`` casts to bfloat16), float32 keeps a float32 run exact. Features computed for a batch are
    rounded to ``dtype`` before use, so the first epoch trains on the same values as the ones read back later.

    Args:
        directory (`str` or `os.PathLike`): where the features live; created when missing.
        target ([`~transformers.PreTrainedModel`]): the frozen target.
        target_layer_ids (`list[int]`): the drafter's target layers.
        dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): storage dtype.
    """

    FINGERPRINT = "fingerprint.json"

    def __init__(self, directory: str | os.PathLike, target, target_layer_ids, dtype: torch.dtype = torch.bfloat16):
        self.directory = Path(directory)
        self.target = target
        self.target_layer_ids = list(target_layer_ids)
        self.dtype = dtype
        self._check_fingerprint()

    def _fingerprint(self) -> dict:
        # The first values of every weight tell two checkpoints of one architecture apart at no real cost.
        digest = hashlib.sha256()
        for name, parameter in self.target.named_parameters():
            digest.update(name.encode())
            digest.update(parameter.detach().flatten()[:64].float().cpu().numpy().tobytes())
        return {
            "target": self.target.config.name_or_path or type(self.target).__name__,
            "target_weights_sha256": digest.hexdigest(),
            "target_layer_ids": self.target_layer_ids,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def _check_fingerprint(self):
        expected = self._fingerprint()
        path = self.directory / self.FINGERPRINT
        if path.exists():
            stored = json.loads(path.read_text())
            if stored != expected:
                changed = sorted(key for key in expected if stored.get(key) != expected[key])
                raise ValueError(
                    f"The feature cache {self.directory} holds features of another {' / '.join(changed)} than this "
                    "run's (see its fingerprint.json). Point feature_cache_dir at a new directory, or delete this one."
                )
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, expected)

    @staticmethod
    def key(token_ids: torch.Tensor) -> str:
        return hashlib.sha1(token_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def features(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> TargetFeatures:
        """`target_features` of a right-padded ``[B, S]`` batch, from the cache where every row is stored, else from
        one target forward whose rows are then stored. Padded positions hold zeros (no block ever reads them)."""
        lengths = attention_mask.sum(dim=1).tolist()
        keys = [self.key(row[:length]) for row, length in zip(input_ids, lengths)]
        # Returned in the target's dtype, as target_features returns them: the loss projects last_hidden with the
        # target's head.
        dtype = next(self.target.parameters()).dtype
        width, device = input_ids.shape[1], input_ids.device
        if all(self.path(key).exists() for key in keys):
            rows = [load_file(self.path(key)) for key in keys]
            context = self._pad([row["context"] for row in rows], width)
            last_hidden = self._pad([row["last_hidden"] for row in rows], width)
            teacher = None
            if all(
                set(TEACHER_KEYS) <= row.keys() for row in rows
            ):  # entries written before they were stored lack them
                argmax, lse = (self._pad([row[name][:, None] for row in rows], width)[..., 0] for name in TEACHER_KEYS)
                teacher = TeacherTop(argmax.to(device, torch.long), lse.to(device, torch.float32))
            return TargetFeatures(
                context=context.to(device, dtype), last_hidden=last_hidden.to(device, dtype), teacher=teacher
            )
        computed = target_features(self.target, input_ids, attention_mask, self.target_layer_ids)
        context, last_hidden = computed.context.to(self.dtype), computed.last_hidden.to(self.dtype)
        # From the rounded states, so a step reading them back trains on exactly what this one does.
        head = self.target.get_output_embeddings()
        flat = teacher_top(last_hidden.flatten(0, 1), head.weight, head.bias)
        teacher = TeacherTop(flat.argmax.view(last_hidden.shape[:2]), flat.logsumexp.view(last_hidden.shape[:2]))
        for row, (key, length) in enumerate(zip(keys, lengths)):
            if not self.path(key).exists():
                stored = {
                    "context": context[row, :length],
                    "last_hidden": last_hidden[row, :length],
                    "teacher_argmax": teacher.argmax[row, :length].to(torch.int32),
                    "teacher_logsumexp": teacher.logsumexp[row, :length],
                }
                self._write(key, stored)
        return TargetFeatures(context=context.to(dtype), last_hidden=last_hidden.to(dtype), teacher=teacher)

    def fill(self, sequences: list[list[int]], batch_size: int = 8, worker: int = 0, num_workers: int = 1) -> int:
        """Stores the features of every sequence not yet stored (``worker`` of ``num_workers`` takes every
        ``num_workers``-th one, so processes can share the work); returns how many it computed. Each batch skips
        what another process stored meanwhile, so processes started over overlapping sequences share them too."""

        def stored(ids) -> bool:
            return self.path(self.key(torch.tensor(ids))).exists()

        todo = [ids for index, ids in enumerate(sequences) if index % num_workers == worker]
        todo = sorted((ids for ids in todo if not stored(ids)), key=len)
        device = next(self.target.parameters()).device
        computed = 0
        for start in range(0, len(todo), batch_size):  # similar lengths together: little padding to compute
            batch = [ids for ids in todo[start : start + batch_size] if not stored(ids)]
            if not batch:
                continue
            computed += len(batch)
            width = max(map(len, batch))
            input_ids = torch.zeros((len(batch), width), dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            self.features(input_ids.to(device), attention_mask.to(device))
        return computed

    def _write(self, key: str, tensors: dict[str, torch.Tensor]):
        tensors = {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}
        with atomic_path(self.path(key)) as staging:
            save_file(tensors, str(staging))

    def _pad(self, rows: list[torch.Tensor], width: int) -> torch.Tensor:
        out = rows[0].new_zeros((len(rows), width, rows[0].shape[-1]))
        for index, row in enumerate(rows):
            out[index, : row.shape[0]] = row
        return out


TEACHER_KEYS = ("teacher_argmax", "teacher_logsumexp")


def draft_blocks(drafter, target, input_ids, features: TargetFeatures, layout: BlockLayout):
    """Runs the drafter on every block of ``layout`` at once; returns its output (``last_hidden_state [B, Q, H]``,
    ``length_prediction [B, N]`` when it has a length head). The noise embeddings come from the target's frozen
    input embeddings, so no gradient reaches them."""
    config = drafter.config
    with torch.no_grad():
        noise_embeds = target.get_input_embeddings()(block_noise_ids(input_ids, layout, config.mask_token_id))
    seq_len = input_ids.shape[1]
    return drafter(
        noise_embeds=noise_embeds,
        context_hidden_states=features.context,
        position_ids=block_position_ids(seq_len, layout),
        attention_mask=block_attention_mask(seq_len, layout),
    )


def slot_targets(input_ids, features: TargetFeatures, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data_labels [B, Q], teacher_hidden [B, Q, H])`` of every slot: the token at ``a_n + k`` and the target's
    last hidden state at ``a_n + k - 1``, whose logits are the teacher's distribution for that token."""
    seq_len = input_ids.shape[1]
    positions = block_label_positions(seq_len, layout).flatten(1)
    data_labels = input_ids.gather(1, positions)
    hidden = features.last_hidden
    before = (positions - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return data_labels, hidden.gather(1, before)


def slot_teacher(features: TargetFeatures, layout: BlockLayout) -> TeacherTop | None:
    """The teacher's whole-vocabulary argmax and log-sum-exp for every slot (``[B, Q]`` each), where the features
    carry them: the rows `slot_targets` takes ``teacher_hidden`` from."""
    if features.teacher is None:
        return None
    positions = block_label_positions(features.last_hidden.shape[1], layout).flatten(1)
    before = (positions - 1).clamp(min=0)
    return TeacherTop(features.teacher.argmax.gather(1, before), features.teacher.logsumexp.gather(1, before))


@torch.no_grad()
def draft_top1(
    target, hidden: torch.Tensor, chunk_size: int = 1024, draft_vocab: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax [B, Q], top probability [B, Q])`` of the drafter's distributions, projected with the target's
    output head (only the ``draft_vocab`` rows when the drafter has one, as at inference) ``chunk_size`` rows at a
    time so that a large vocabulary never materialises for every row."""
    head = target.get_output_embeddings()
    weight, bias = head.weight, head.bias
    vocab = None
    if draft_vocab is not None:
        vocab = vocab_ids(draft_vocab, weight.device)
        weight, bias = vocab_rows(weight, vocab), vocab_rows(bias, vocab)
    rows = hidden.flatten(0, 1).to(weight.dtype)
    argmax, top = [], []
    for start in range(0, rows.shape[0], chunk_size):
        probs = torch.nn.functional.linear(rows[start : start + chunk_size], weight, bias).float().softmax(-1)
        values, indices = probs.max(-1)
        argmax.append(indices if vocab is None else vocab[indices])
        top.append(values)
    return torch.cat(argmax).view(hidden.shape[:2]), torch.cat(top).view(hidden.shape[:2])
