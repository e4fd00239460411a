"""The byte counts of benchmarks/local_updates_vs_ddp.py (docs/benchmarks/local_updates_vs_ddp.md):
they fall as 1/H on both paths, and the collective path's count is what its learners all-reduce,
recorded on the real collective path's learners (threads as ranks, tests/inprocess.py) with a
module that has floating and integer buffers (BatchNorm's statistics and its counter)."""


import pytest
import thread_ranks
import torch
import user_modules as um
from benchmark_scripts import import_benchmark
from inprocess import InProcessRun, blob_batches

from lightning_stale.engine.distributed.messages import HEADER_BYTES
from lightning_stale.engine.distributed.paths.collective.path import update_payload


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("local_updates_vs_ddp")


def test_bytes_per_inner_step_fall_as_one_over_h_on_both_paths(bench):
    steps, params, buffers, tensors, p = 160, 3_487_754, 0, 10, 4
    central = {h: bench.central_bytes(steps / h, steps, params, buffers) for h in (1, 4, 16)}
    collective = {h: bench.collective_bytes(steps / h, steps // h, steps, p, params, buffers, tensors, 0)
                  for h in (1, 4, 16)}
    for figures in (central, collective):
        assert figures[1] > 0
        for h in (4, 16):
            assert figures[h] == pytest.approx(figures[1] / h, rel=1e-12)
    # at H = 1 the collective path sends ddp's all-reduce plus the mask, the headers and the decision
    ddp = 2 * (p - 1) / p * 4 * params
    extra = collective[1] - ddp
    assert extra == pytest.approx(2 * (p - 1) / p * 4 * tensors + 2 * HEADER_BYTES + 8 * (p + 2))


def test_the_collective_count_is_what_the_learners_all_reduce(bench, monkeypatch):
    reduced: dict[int, list[int]] = {0: [], 1: []}
    original = thread_ranks.ThreadRanks.all_reduce

    def recording(self, tensor, *args, **kwargs):
        reduced[self.local.rank].append(tensor.numel() * tensor.element_size())
        return original(self, tensor, *args, **kwargs)

    monkeypatch.setattr(thread_ranks.ThreadRanks, "all_reduce", recording)
    torch.manual_seed(0)
    module, h, p = um.BatchNormCNN(lr=0.05), 3, 2
    params = sum(t.numel() for t in module.parameters())  # as the benchmark counts them
    tensors = sum(1 for _ in module.parameters())
    buffers = sum(t.numel() for t in module.buffers())
    integers = sum(t.numel() for t in module.buffers() if not t.is_floating_point())
    assert integers > 0 and buffers > integers  # both kinds of buffer are counted
    run = InProcessRun(module, blob_batches(image=True), "sync", p=p, max_updates=3, local_steps=h,
                       path="collective").fit()
    updates, pushes = run.stats["updates"], run.stats["pushes_per_learner"]
    assert updates == 3 and pushes == [3, 3]
    # the decision each learner hears per update: P + 2 float64 inside a header
    decision = update_payload(run.updates[0].update, p)
    assert decision.numel() * decision.element_size() == 8 * (p + 2)
    for rank in range(p):
        assert len(reduced[rank]) == 2 * updates  # the sum, and the integer counters' maximum
        ring = 2 * (p - 1) / p * sum(reduced[rank])
        moved = pushes[rank] * HEADER_BYTES + updates * (HEADER_BYTES + 8 * (p + 2)) + ring
        counted = bench.collective_bytes(pushes[rank], updates, updates * h, p, params, buffers, tensors, integers)
        assert counted * updates * h == pytest.approx(moved)
