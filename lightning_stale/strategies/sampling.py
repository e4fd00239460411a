"""Mini-batches drawn independently by every learner, for as long as the server's epoch lasts."""

from __future__ import annotations

from typing import Callable, Iterator

import torch


class IndependentBatchSampler:
    """Yields batches of indices drawn uniformly with replacement from a seeded generator of
    this learner's own, as docs/method.md's setting assumes (xi_{l,j} i.i.d. across learners and
    mini-batches). A fast learner simply draws more; nobody waits for a shard to run out.

    The epoch ends when ``epoch_over()`` turns true (the server says so), not after a fixed
    count, so the sampler has no length: Lightning then validates at the end of each epoch.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"need at least one sample and batch_size >= 1, got {num_samples}, {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(rank))
        self.epoch_over: Callable[[], bool] = lambda: False

    def __iter__(self) -> Iterator[list[int]]:
        while not self.epoch_over():
            yield torch.randint(self.num_samples, (self.batch_size,), generator=self.generator).tolist()
