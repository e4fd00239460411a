"""The sync family's all-reduce started during backward, in buckets, as DDP does it (Li et al.,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020).

Where every update takes one gradient from every learner (Fully sync, K-sync with K = P), each
gradient goes, weighted 1/P, into a bucket as backward produces it, a full bucket round the
all-reduce at once; buffers and presence mask follow. Buckets, cut at tensor boundaries, launch in
one order on every learner; a round is armed when the server says the next update takes every
learner, and the rounds a stop cut short run with zeros at the end (docs/concepts/paths.md).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_stale.engine.state import ModelVectors

FIRST_BUCKET_BYTES = 1 << 20  # DDP's defaults: a small first bucket starts the reduce early
BUCKET_BYTES = 25 << 20


def bucket_ranges(sizes: list[int], element_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES,
                  bytes_per_bucket: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """Runs of parameter indices [lo, hi), from the last back, each closed once it holds
    ``first_bytes`` (the first) or ``bytes_per_bucket``."""
    ranges: list[tuple[int, int]] = []
    hi, held = len(sizes), 0
    for i in reversed(range(len(sizes))):
        held += sizes[i] * element_bytes
        if held >= (first_bytes if not ranges else bytes_per_bucket):
            ranges.append((i, hi))
            hi, held = i, 0
    if hi > 0:
        ranges.append((0, hi))
    return ranges


class OverlappedAllReduce:
    """A learner's gradient, averaged over ``learners`` in buckets while backward runs (see the module docstring)."""

    def __init__(self, vectors: ModelVectors, learners: int, group, control_group,
                 device: torch.device, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.vectors, self.learners, self.group, self.control_group = vectors, learners, group, control_group
        sizes = [p.numel() for p in vectors.params]
        self._offsets = [0]
        for size in sizes:
            self._offsets.append(self._offsets[-1] + size)
        element = torch.empty(0, dtype=vectors.dtype).element_size()
        self._ranges = bucket_ranges(sizes, element, first_bucket_bytes, bucket_bytes)
        # All-reduces now, at set-up, have NCCL create the communicator beside nothing, not in the
        # first backward (it allocates device memory, which can wait for running kernels); of the
        # first bucket's size and the largest, as NCCL connects the algorithms it picks by size
        # at their first use (NCCL_RUNTIME_CONNECT, NCCL >= 2.22).
        spans = [self._offsets[hi] - self._offsets[lo] for lo, hi in self._ranges] or [1]
        for numel in sorted({max(1, spans[0]), max(spans)}):
            dist.all_reduce(torch.zeros(numel, dtype=vectors.dtype, device=device), group=group)
        self._bucket_of = [0] * len(sizes)
        for b, (lo, hi) in enumerate(self._ranges):
            for i in range(lo, hi):
                self._bucket_of[i] = b
        size = vectors.state_numel + len(sizes)
        # Two vectors in turn: after an update the .grad are views of the one just reduced.
        self._vectors = [torch.zeros(size, dtype=vectors.dtype, device=device) for _ in range(2)]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(vectors.params)]
        self.armed = False
        self.rounds = 0  # rounds launched (taken or not)
        self._works: list = []
        self._vector = self._vectors[0]
        self._filled: list[bool] = []
        self._left: list[int] = []
        self._next = 0  # the next bucket to launch

    def arm(self) -> None:
        """The next backward is the next round."""
        self._wait()  # (nothing is pending: the update before took the last round)
        self.armed = True
        self._vector = self._vectors[self.rounds % 2]
        self._filled = [False] * len(self.vectors.params)
        self._left = [hi - lo for lo, hi in self._ranges]
        self._next = 0

    def _hook(self, index: int):
        def ready(param: Tensor) -> None:
            if not self.armed:
                return
            bucket = self._bucket_of[index]
            if bucket < self._next:
                raise RuntimeError("a second backward pass reached a gradient whose bucket is already "
                                   "being reduced; the overlapped all-reduce takes one backward per "
                                   "step (pass overlap_allreduce=False to the strategy)")
            grad = param.grad
            assert grad is not None, "the hook runs once the gradient is accumulated"
            grad = grad.to_dense() if grad.is_sparse else grad
            a, z = self._offsets[index], self._offsets[index + 1]
            part = self._vector[a:z]
            torch.mul(grad.detach().reshape(-1).to(part.device), 1.0 / self.learners, out=part)
            if not self._filled[index]:
                self._filled[index] = True
                self._left[bucket] -= 1
            while self._next < len(self._ranges) and self._left[self._next] == 0:
                self._launch(*self._span(self._next))
                self._next += 1
        return ready

    def _span(self, bucket: int) -> tuple[int, int]:
        lo, hi = self._ranges[bucket]
        return self._offsets[lo], self._offsets[hi]

    def _launch(self, a: int, z: int) -> None:
        if z > a:
            self._works.append(dist.all_reduce(self._vector[a:z], group=self.group, async_op=True))

    def finish(self) -> bool:
        """After backward: the rest of the round (gradients not reached are zeros, absent from the
        mask; the buffers as forward left them); False where this backward was no round."""
        if not self.armed:
            return False
        self.armed = False
        vector, n, s = self._vector, self.vectors.numel, self.vectors.state_numel
        for i, filled in enumerate(self._filled):
            if not filled:
                vector[self._offsets[i]:self._offsets[i + 1]].zero_()
        for bucket in range(self._next, len(self._ranges)):
            self._launch(*self._span(bucket))
        if self.vectors.buffers:
            torch.cat([b.detach().reshape(-1).to(vector.dtype) for b in self.vectors.buffers],
                      out=vector[n:s])
            vector[n:s].mul_(1.0 / self.learners)
        vector[s:] = torch.tensor(self._filled, dtype=vector.dtype)
        self._launch(n, vector.numel())
        self.rounds += 1
        return True

    def result(self) -> Tensor:
        """The last round's average (waited for); the .grad may view it until the round after next."""
        self._wait()
        return self._vector

    def owns(self, vector: Tensor) -> bool:
        """Whether ``vector`` is one of the rounds' (never to be recycled for packing)."""
        return any(vector is v for v in self._vectors)

    def _wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def balance(self, timeout: float) -> None:
        """At the end: rounds the others launched and this learner did not (it heard the stop
        first) run with zeros, then every all-reduce is waited for."""
        self.armed = False
        for _ in range(self._most_rounds(timeout) - self.rounds):
            self._vector = self._vectors[self.rounds % 2]
            for a, z in [self._span(b) for b in range(len(self._ranges))] + [(self.vectors.numel, None)]:
                self._launch(a, self._vector.numel() if z is None else z)
            self.rounds += 1
        self._wait()

    def _most_rounds(self, timeout: float) -> int:
        """The largest round count over the learners (the control group's all-reduce)."""
        count = torch.tensor([self.rounds], dtype=torch.int64)
        work = dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        if not work.wait(datetime.timedelta(seconds=timeout)):
            raise RuntimeError(f"learners did not agree on their overlapped rounds within {timeout} s")
        return int(count)

    def close(self, timeout: float) -> None:
        """The clean end: rounds balanced, hooks removed, the groups destroyed (after a failure they
        are left to the exit: destroying a group under a blocked collective aborts the process)."""
        self.balance(timeout)
        self.release()
        for group in (self.group, self.control_group):
            if group is not None and group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        self.group = self.control_group = None

    def release(self) -> None:
        """Remove the hooks from the module (they stay inert until then)."""
        self.armed = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
