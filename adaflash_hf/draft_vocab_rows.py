"""The output-head rows of a reduced draft vocabulary (`AdaFlashConfig.draft_vocab`): one implementation of the
projection over it, shared by inference (`generation.draft_head`), training (`training.features`,
`training.losses`) and export (`formats`).

A drafter with a draft vocabulary is a distribution over those tokens only: its logits use only their rows of the
target's LM head (``V_d / V`` of the cost), so position ``i`` of such logits is token ``ids[i]``. Inference scatters
them back into the whole vocabulary (`full_vocab_logits`); training keeps them at ``V_d`` and maps argmaxes back
with ``ids[position]``. The rows come from the caller's tensors as they are (no detach, no dtype change), because
the callers differ there: inference caches a copy per dtype, training lets no gradient reach the frozen head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def vocab_ids(draft_vocab: Sequence[int] | torch.Tensor, device=None) -> torch.LongTensor:
    """The draft vocabulary's token ids as a ``[V_d]`` long tensor on ``device``."""
    if isinstance(draft_vocab, torch.Tensor):
        return draft_vocab.to(device=device, dtype=torch.long)
    return torch.tensor([int(i) for i in draft_vocab], dtype=torch.long, device=device)


def vocab_rows(tensor: torch.Tensor | None, ids: torch.LongTensor) -> torch.Tensor | None:
    """The rows of the token ``ids``, in that order, of a head's ``weight [V, H]`` or ``bias [V]`` (``None``, a
    head without bias, stays ``None``): a linear map with them gives the draft vocabulary's logits."""
    return None if tensor is None else tensor.index_select(0, ids.to(tensor.device))


def full_vocab_logits(logits: torch.Tensor, ids: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """Logits ``[..., V_d]`` over the draft vocabulary scattered into ``[..., vocab_size]``, ``-inf`` elsewhere, so
    logits processors, sampling and acceptance see the whole vocabulary and never pick a token outside it."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, ids.to(full.device), logits)
