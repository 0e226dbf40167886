"""Training batches balanced across domains."""

from __future__ import annotations

import numpy as np
import torch


class BalancedBatchSampler:
    """Endless ``[batch_size, seq_len + 1]`` batches with the same number of random windows from every domain.

    Balancing per batch (rather than sampling by corpus size) keeps every domain equally learned whatever the
    caps turned out to be, and a seeded generator makes the batch sequence a function of the seed.
    """

    def __init__(self, streams: dict[str, np.ndarray], batch_size: int, seq_len: int, seed: int):
        if batch_size % len(streams):
            raise ValueError(f"batch_size {batch_size} must be a multiple of the {len(streams)} domains.")
        short = {domain: stream.size for domain, stream in streams.items() if stream.size <= seq_len + 1}
        if short:
            raise ValueError(
                f"Domains {short} have no more tokens than seq_len + 1 = {seq_len + 1}; "
                f"build a bigger corpus or lower seq_len."
            )
        self.streams = list(streams.values())
        self.rows_per_domain = batch_size // len(streams)
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        rows = []
        for stream in self.streams:
            starts = torch.randint(
                0, stream.size - self.seq_len - 1, (self.rows_per_domain,), generator=self.generator
            )
            rows.extend(
                np.asarray(stream[start : start + self.seq_len + 1], dtype=np.int64) for start in starts.tolist()
            )
        return torch.from_numpy(np.stack(rows))
