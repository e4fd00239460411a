"""Mini-batches drawn independently by every learner, for as long as the server's epoch lasts,
and the Trainer options that epochs shaped by the server rule out."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_stale.strategies.lightning_api import sync_batchnorm_requested


def check_trainer_options(strategy: Any, trainer: Any) -> None:
    """Refuse, before training, the Trainer options that learners at their own pace cannot run."""
    problems = []
    if sync_batchnorm_requested(strategy):
        problems.append("sync_batchnorm must be False: SyncBatchNorm runs a collective in every "
                        "forward, which learners at their own pace cannot join")
    if trainer.val_check_interval != 1.0:
        problems.append("val_check_interval must be 1.0: validation runs when the server pauses "
                        "every learner at an epoch's end (validate less often with "
                        "check_val_every_n_epoch, more often with shorter epochs: "
                        "limit_train_batches)")
    if problems:
        raise ValueError(f"{type(strategy).__name__} cannot run this Trainer: " + "; ".join(problems))


def independent_sampler(dataloader: DataLoader, seed: int, rank: int, p: int,
                        limit_train_batches: int | float, accumulate_grad_batches: int,
                        local_steps: int = 1) -> tuple[IndependentBatchSampler, int]:
    """This learner's sampler for a training ``dataloader``, and the pushes of one epoch
    (`pushes_per_epoch`); refuses loaders it cannot draw from independently."""
    if isinstance(dataloader.dataset, IterableDataset):
        raise ValueError("StaleStrategy needs a map-style training dataset: each learner draws "
                         "its own mini-batches independently")
    batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None:
        raise ValueError("StaleStrategy needs a training DataLoader with a batch_size")
    n = len(cast(Sized, dataloader.dataset))  # (a map-style dataset: checked above)
    pushes = pushes_per_epoch(n, batch_size, dataloader.drop_last, p, limit_train_batches,
                              accumulate_grad_batches, local_steps)
    return IndependentBatchSampler(n, batch_size, seed, rank), pushes


def pushes_per_epoch(num_samples: int, batch_size: int, drop_last: bool, p: int,
                     limit_train_batches: int | float, accumulate_grad_batches: int,
                     local_steps: int = 1) -> int:
    """One pass worth of pushes by all learners together: P times the optimizer steps a DDP rank
    makes per epoch (its 1/P shard in mini-batches, cut by ``limit_train_batches`` as Lightning
    cuts it: an int caps the batches, a float is a fraction of them), divided by H = ``local_steps``
    with local updates (a push ends H optimizer steps)."""
    shard = math.ceil(num_samples / p)
    batches = shard // batch_size if drop_last else math.ceil(shard / batch_size)
    limit = limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    return p * max(1, math.ceil(batches / accumulate_grad_batches / local_steps))


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
        self.drawn: deque[list[int]] | None = None  # each batch's indices, kept for an event log

    def loader(self, dataloader: DataLoader) -> DataLoader:
        """``dataloader`` drawing its batches with this sampler."""
        return DataLoader(dataloader.dataset, batch_sampler=self, num_workers=dataloader.num_workers,
                          collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                          worker_init_fn=dataloader.worker_init_fn,
                          persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0)

    def __iter__(self) -> Iterator[list[int]]:
        while not self.epoch_over():
            batch = torch.randint(self.num_samples, (self.batch_size,), generator=self.generator).tolist()
            if self.drawn is not None:
                self.drawn.append(batch)
            yield batch
