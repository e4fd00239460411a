"""Collectives over ranks played by threads of one process, for code that calls a few of
``torch.distributed``'s functions (patched in as the module's ``dist``)."""

import threading

import torch.distributed as dist


class ThreadRanks:
    """``all_gather``, ``broadcast`` and ``all_reduce`` (sum, max) among ``world`` threads (one
    per rank, `run`, or threads that set ``local.rank`` themselves), met at a barrier; ``calls``
    counts the collectives each rank made."""

    ReduceOp = dist.ReduceOp

    def __init__(self, world: int) -> None:
        self.world, self.barrier, self.local = world, threading.Barrier(world, timeout=30), threading.local()
        self.table: list = [None] * world
        self.calls = [0] * world

    def get_world_size(self, group=None) -> int:
        return self.world

    def all_gather(self, out: list, tensor, group=None) -> None:
        self.calls[self.local.rank] += 1
        self.table[self.local.rank] = tensor.clone()
        self.barrier.wait()
        for i, t in enumerate(self.table):
            out[i].copy_(t)
        self.barrier.wait()

    def broadcast(self, tensor, src: int, group=None) -> None:
        self.calls[self.local.rank] += 1
        if self.local.rank == src:
            self.table[src] = tensor.clone()
        self.barrier.wait()
        tensor.copy_(self.table[src])
        self.barrier.wait()

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False) -> None:
        """Summed (or the largest) in rank order, the same result on every rank."""
        assert not async_op and op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX), "sum or max, waited for"
        self.calls[self.local.rank] += 1
        self.table[self.local.rank] = tensor.clone()
        self.barrier.wait()
        result = self.table[0].clone()
        for t in self.table[1:]:
            result = result + t if op == dist.ReduceOp.SUM else result.maximum(t)
        self.barrier.wait()
        tensor.copy_(result)

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank's thread; their results, or the first rank's error raised."""
        results: list = [None] * self.world
        errors: list = []

        def one(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # (the others then fail at the barrier)
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results
