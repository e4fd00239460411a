"""The all-reduce overlapped with backward, in one process (a gloo group of one: the all-reduce is
the identity, so what a round holds is checked exactly against what the decision-time path
would have reduced)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_stale.engine.distributed.paths.collective.path import CollectiveExchange, update_payload
from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.paths.collective.overlap import OverlappedAllReduce, bucket_ranges
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors
from lightning_stale.method.rules import Push, Update

pytestmark = pytest.mark.usefixtures("gloo_group_of_one")

P = 2  # the weight is 1/P; the group of one only sums this learner's part


class WithUnused(nn.Module):
    """BatchNorm (float and integer buffers), a frozen layer and a head used only on request
    (first among the parameters, so in the last bucket: an unused parameter holds its bucket,
    and the ones after it, until backward ends)."""

    def __init__(self):
        super().__init__()
        self.spare_head = nn.Linear(8, 2)
        self.body = nn.Sequential(nn.Linear(3, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_spare=False):
        h = self.frozen(self.body(x))
        return self.spare_head(h) if use_spare else h


def setup(bucket_bytes=64):
    torch.manual_seed(0)
    module = WithUnused()
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    vectors = ModelVectors.of(module)
    overlap = OverlappedAllReduce(vectors, P, dist.group.WORLD, dist.group.WORLD, torch.device("cpu"),
                                  first_bucket_bytes=bucket_bytes, bucket_bytes=bucket_bytes)
    ex = CollectiveExchange(vectors, optimizer, Schedules([], optimizer), rank=0,
                            device=torch.device("cpu"), overlap=overlap)
    return module, optimizer, vectors, overlap, ex


def backward(module, optimizer, seed, set_to_none=True):
    optimizer.zero_grad(set_to_none=set_to_none)
    torch.manual_seed(seed)
    module(torch.randn(8, 3)).square().mean().backward()


def push(ex):
    message = Message(Kind.PUSH)
    ex.fill_push(message)
    ex.before_push(message)
    ex.after_push(message)


def answer(ex, version, overlap_next):
    update = Update(index=version, version=version, staleness=(0,) * P,
                    gradients=tuple(Push(id=i, learner=i, version=version - 1) for i in range(P)))
    ex.take(Message(Kind.PARAMS, version=version, payload=update_payload(update, P, overlap_next)))


def test_buckets_cut_at_tensor_boundaries_from_the_last_parameter_back():
    sizes = [10, 300, 5, 400, 7]
    ranges = bucket_ranges(sizes, element_bytes=4, first_bytes=20, bytes_per_bucket=1000)
    # 28 bytes >= 20 closes the first; then 1600 >= 1000; then 20 + 1200; the rest (40 bytes)
    assert ranges == [(4, 5), (3, 4), (1, 3), (0, 1)]
    covered = sorted(i for lo, hi in ranges for i in range(lo, hi))
    assert covered == list(range(len(sizes)))
    assert bucket_ranges([], 4) == []
    assert bucket_ranges([3], 4) == [(0, 1)]


def test_a_round_holds_what_the_decision_time_path_would_reduce_and_starts_during_backward():
    module, optimizer, vectors, overlap, ex = setup()
    overlap.arm()
    launched = []
    first_layer = module.body[0].weight
    hook = first_layer.register_post_accumulate_grad_hook(lambda p: launched.append(len(overlap._works)))
    backward(module, optimizer, seed=1)
    hook.remove()
    # the first layer's gradient comes last in backward: buckets above it were already on their way
    assert launched and launched[0] >= 2
    expected, masked = vectors.push_vector(mask=True)
    assert masked and expected[vectors.state_numel:].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]  # spare head unused
    assert overlap.finish() and not overlap.armed
    got = overlap.result()
    s = vectors.state_numel
    assert torch.allclose(got[:s], expected[:s] / P)  # gradients (zeros where none) and buffers, weighted 1/P
    assert torch.equal(got[s:], expected[s:])  # the mask, as is
    assert not overlap.finish()  # a backward that was not armed is no round
    assert overlap.rounds == 1


def test_updates_from_overlapped_rounds_step_as_the_decision_time_path():
    for set_to_none in (True, False):
        module, optimizer, vectors, overlap, ex = setup()
        twin, twin_optimizer, twin_vectors, _, _ = setup()
        plain = CollectiveExchange(twin_vectors, twin_optimizer, Schedules([], twin_optimizer), rank=0,
                                   device=torch.device("cpu"))
        for version in range(1, 6):
            backward(module, optimizer, version, set_to_none)
            push(ex)
            backward(twin, twin_optimizer, version, set_to_none)
            push(plain)
            # the first update is not overlapped (nothing armed it); it arms the next ones, but the
            # fourth's answer says the next may not be (an epoch's end): the fifth goes the plain way
            answer(ex, version, overlap_next=version != 4)
            answer(plain, version, overlap_next=False)
            assert torch.allclose(vectors.state_vector(), twin_vectors.state_vector(), atol=1e-6), version
        assert ex.overlapped_updates == 3  # updates 2, 3 and 4
        assert int(module.body[1].num_batches_tracked) == 5  # the integer buffer is the largest, not a mean
        assert not any(overlap.owns(v) for v in ex._spare)  # a round's vector is never packed into
        assert overlap.rounds == 3


def test_an_update_that_does_not_take_the_round_whole_is_an_error():
    module, optimizer, vectors, overlap, ex = setup()
    overlap.arm()
    backward(module, optimizer, 1)
    push(ex)
    payload = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # K = 1: learner 1's left out
    with pytest.raises(RuntimeError, match="does not take the overlapped round"):
        ex.take(Message(Kind.PARAMS, version=1, payload=payload))


def test_a_second_backward_into_a_bucket_already_reduced_is_refused():
    module, optimizer, vectors, overlap, ex = setup()
    overlap.arm()
    torch.manual_seed(0)
    loss = module(torch.randn(8, 3)).square().mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per step"):
        loss.backward()


def test_the_end_balances_rounds_and_released_hooks_leave_the_module_alone():
    module, optimizer, vectors, overlap, ex = setup()
    overlap.arm()
    backward(module, optimizer, 1)
    push(ex)  # launched, then the stop: never taken
    ex.take(Message(Kind.STOP, version=0))
    ex.close(timeout=10)  # (a group of one: nothing to run for others) every all-reduce is waited for
    assert overlap._works == [] and overlap.rounds == 1
    overlap.arm()
    before = [v.clone() for v in overlap._vectors]
    backward(module, optimizer, 2)  # the hooks are gone: nothing reaches the rounds' vectors
    assert all(torch.equal(a, b) for a, b in zip(before, overlap._vectors))


def test_after_a_failure_the_hooks_go_without_a_collective_and_the_groups_stay(monkeypatch):
    """A learner may be dead: balancing the rounds would fail (or wait) on it and put its own
    error in place of the one that ended the run; its groups are left to the process's exit."""
    module, optimizer, vectors, overlap, ex = setup()
    overlap.arm()
    backward(module, optimizer, 1)
    push(ex)
    collectives = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **kw: collectives.append(a))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: collectives.append(a))
    assert ex.close(timeout=10, failed=True) == []
    assert collectives == [] and overlap.group is not None and not overlap.armed
    before = [v.clone() for v in overlap._vectors]
    overlap.arm()
    backward(module, optimizer, 2)  # the hooks are gone
    assert all(torch.equal(a, b) for a, b in zip(before, overlap._vectors))


def test_rounds_another_learner_launched_are_run_with_zeros_at_the_end(monkeypatch):
    # Another learner launched two rounds more (this one heard the stop before those backwards):
    # this one issues the same all-reduces, bucket by bucket, so that none waits for a peer.
    module, optimizer, vectors, overlap, ex = setup()
    overlap.arm()
    backward(module, optimizer, 1)
    push(ex)
    issued = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: issued.append(t.numel()) or real(t, **kw))
    monkeypatch.setattr(overlap, "_most_rounds", lambda timeout: overlap.rounds + 2)
    ex.close(timeout=10)
    buckets = [overlap._span(b) for b in range(len(overlap._ranges))]
    one_round = [z - a for a, z in buckets] + [vectors.state_numel + len(vectors.params) - vectors.numel]
    assert issued == one_round * 2 and overlap.rounds == 3 and overlap._works == []


def test_hooks_that_may_change_gradients_after_backward_are_found_in_modules_and_callbacks():
    import pytorch_lightning as pl

    from lightning_stale.strategies.lightning_api import hooks_after_backward
    from lightning_stale.strategies.timing import MiniBatchTimer

    class LogsNorms(pl.LightningModule):  # (a Trainer of either namespace: users'-module launch)
        def on_before_optimizer_step(self, optimizer):
            pass

    class Plain(pl.LightningModule):
        pass

    class ClipsItself(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            pass

    class Inherits(ClipsItself):
        pass

    assert hooks_after_backward(Plain(), [pl.callbacks.LearningRateMonitor(), MiniBatchTimer()]) == []
    assert hooks_after_backward(LogsNorms(), [Inherits()]) == [
        f"{LogsNorms.__qualname__}.on_before_optimizer_step", f"{ClipsItself.__qualname__}.on_after_backward"]


def test_the_buckets_group_is_used_once_at_set_up_before_any_backward(monkeypatch):
    """NCCL creates a group's communicator at its first operation, and connects each protocol
    at its first use: that happens when every rank builds the overlap, with the sizes of the
    first bucket and the largest one, not in the middle of the first backward."""
    from lightning_stale.engine.distributed.paths.collective import overlap as overlap_module

    calls, real = [], dist.all_reduce
    monkeypatch.setattr(overlap_module.dist, "all_reduce",
                        lambda tensor, group=None, **kw: calls.append((tensor.numel(), group)) or real(tensor, group=group, **kw))
    module, _, vectors, overlap, _ = setup(bucket_bytes=16)
    buckets = [sum(vectors.params[i].numel() for i in range(lo, hi)) for lo, hi in overlap._ranges]
    assert len(set(buckets)) > 2  # (so that two sizes stand for all)
    assert calls == [(n, dist.group.WORLD) for n in sorted({buckets[0], max(buckets)})]
