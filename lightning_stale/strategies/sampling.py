"""Mini-batches drawn independently by every learner, for as long as the server's epoch lasts."""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader


def pushes_per_epoch(num_samples: int, batch_size: int, drop_last: bool, p: int,
                     limit_train_batches: int | float, accumulate_grad_batches: int) -> int:
    """One pass worth of pushes by all learners together: P times the optimizer steps a DDP rank
    makes per epoch (its 1/P shard in mini-batches, cut by ``limit_train_batches`` as Lightning
    cuts it: an int caps the batches, a float is a fraction of them)."""
    shard = math.ceil(num_samples / p)
    batches = shard // batch_size if drop_last else math.ceil(shard / batch_size)
    limit = limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    return p * max(1, math.ceil(batches / accumulate_grad_batches))


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

    def loader(self, dataloader: DataLoader) -> DataLoader:
        """``dataloader`` drawing its batches with this sampler."""
        return DataLoader(dataloader.dataset, batch_sampler=self, num_workers=dataloader.num_workers,
                          collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                          worker_init_fn=dataloader.worker_init_fn,
                          persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0)

    def __iter__(self) -> Iterator[list[int]]:
        while not self.epoch_over():
            yield torch.randint(self.num_samples, (self.batch_size,), generator=self.generator).tolist()
