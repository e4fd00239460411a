"""The collective path's learner side, in one process (a gloo group of one: the all-reduce is
the identity, so the arithmetic and the recycling of vectors are checked exactly)."""

import pytest
import torch
from torch import nn

from lightning_stale.engine.distributed.paths.collective.path import CollectiveExchange
from lightning_stale.engine.distributed.messages import Flag, Kind, Message
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors

pytestmark = pytest.mark.usefixtures("gloo_group_of_one")


def exchange(set_to_none=True):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    vectors = ModelVectors.of(module)
    ex = CollectiveExchange(vectors, optimizer, Schedules([], optimizer), rank=0, device=torch.device("cpu"))
    return module, optimizer, vectors, ex


def backward_and_push(module, optimizer, ex, seed, set_to_none):
    optimizer.zero_grad(set_to_none=set_to_none)
    torch.manual_seed(seed)
    module(torch.randn(8, 3)).square().mean().backward()
    grad = torch.cat([p.grad.reshape(-1).clone() for p in module.parameters()])
    push = Message(Kind.PUSH)
    ex.fill_push(push)
    ex.before_push(push)
    assert push.payload is None  # only the header travels
    ex.after_push(push)
    return grad


def update(ex, k, mine, version):
    payload = torch.tensor([k, mine], dtype=torch.float64)
    ex.take(Message(Kind.PARAMS, version=version, payload=payload))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_updates_average_the_taken_gradients_and_recycled_vectors_never_alias_grads(set_to_none):
    module, optimizer, vectors, ex = exchange()
    for version in range(1, 6):
        # two pushes (a K-batch-sync learner), the update takes both: their mean is the step
        before = vectors.state_vector()[:vectors.numel]
        grads = [backward_and_push(module, optimizer, ex, 10 * version + i, set_to_none) for i in range(2)]
        update(ex, k=2, mine=2, version=version)
        after = vectors.state_vector()[:vectors.numel]
        assert torch.allclose(after, before - 0.1 * (grads[0] + grads[1]) / 2, atol=1e-6)
    # a push the update does not take (it crossed the update) is discarded, not summed later
    backward_and_push(module, optimizer, ex, 99, set_to_none)
    before = vectors.state_vector()[:vectors.numel]
    update(ex, k=1, mine=0, version=6)  # this learner contributes nothing: zeros
    assert torch.allclose(vectors.state_vector()[:vectors.numel], before)
    grad = backward_and_push(module, optimizer, ex, 100, set_to_none)
    update(ex, k=1, mine=1, version=7)
    assert torch.allclose(vectors.state_vector()[:vectors.numel], before - 0.1 * grad, atol=1e-6)
    # recycled vectors are few: at most the pending pushes of one update plus the one in .grad
    assert len(ex._spare) <= 3


def test_epoch_end_and_stop_see_the_buffers_of_the_last_update():
    # A forward pass begun after the update (work the epoch's end or the stop leaves unapplied)
    # moves BatchNorm's running statistics; validation and the final module must not see that.
    module, optimizer, vectors, ex = exchange()
    backward_and_push(module, optimizer, ex, 1, True)
    update(ex, 1, 1, version=1)
    settled = vectors.state_vector()
    backward_and_push(module, optimizer, ex, 2, True)  # in flight: not taken by any update
    moved = vectors.state_vector()
    assert not torch.equal(moved[vectors.numel:], settled[vectors.numel:])
    assert torch.equal(moved[:vectors.numel], settled[:vectors.numel])  # only an update steps

    epoch = Message(Kind.EPOCH, version=1)
    ex.resolve(epoch, check=lambda: None)
    assert torch.equal(epoch.payload, settled)  # what the learner validates on
    assert torch.equal(vectors.state_vector(), moved)  # its own state is kept for after it

    ex.take(Message(Kind.STOP, version=1))
    assert torch.equal(vectors.state_vector(), settled)


def test_a_stop_that_carries_the_last_update_applies_it():
    module, optimizer, vectors, ex = exchange()
    before = vectors.state_vector()[:vectors.numel]
    grad = backward_and_push(module, optimizer, ex, 3, True)
    ex.take(Message(Kind.STOP, version=1, payload=torch.tensor([1.0, 1.0], dtype=torch.float64)))
    assert torch.allclose(vectors.state_vector()[:vectors.numel], before - 0.1 * grad, atol=1e-6)


def test_an_unusable_push_is_never_taken_nor_recycled():
    # A 16-mixed overflow: the push goes out as a header without a gradient (the server drops it
    # as "overflow"). A K-batch-sync learner then pushes a usable one, and the update takes that.
    module, optimizer, vectors, ex = exchange()
    overflow = Message(Kind.PUSH, flags=Flag.UNUSABLE, error="overflow")
    ex.before_push(overflow)  # (the learner fills no payload for it)
    ex.after_push(overflow)
    before = vectors.state_vector()[:vectors.numel]
    grad = backward_and_push(module, optimizer, ex, 5, True)
    update(ex, k=1, mine=1, version=1)
    assert torch.allclose(vectors.state_vector()[:vectors.numel], before - 0.1 * grad, atol=1e-6)
    # an overflow the update leaves, then updates this learner contributes nothing to (zeros)
    overflow = Message(Kind.PUSH, flags=Flag.UNUSABLE, error="overflow")
    ex.before_push(overflow)
    ex.after_push(overflow)
    for version in (2, 3):
        settled = vectors.state_vector()[:vectors.numel]
        update(ex, k=1, mine=0, version=version)
        assert torch.equal(vectors.state_vector()[:vectors.numel], settled)
    assert all(isinstance(v, torch.Tensor) for v in ex._spare)


def test_a_push_carried_over_an_epochs_end_keeps_its_gradient_through_validation():
    # The push waits for the next epoch, and Lightning zeroes the gradients before validation
    # (and the loader's prefetched mini-batch may run one more backward): the push that leaves
    # after it must carry the gradient computed before the epoch's end.
    module, optimizer, vectors, ex = exchange()
    optimizer.zero_grad()
    torch.manual_seed(4)
    module(torch.randn(8, 3)).square().mean().backward()
    grad = torch.cat([p.grad.reshape(-1).clone() for p in module.parameters()])
    push = Message(Kind.PUSH)
    ex.fill_push(push)
    ex.carry(push)
    module(torch.randn(8, 3)).sum().backward()  # a discarded mini-batch's backward
    module.zero_grad()  # Lightning's on_validation_model_zero_grad
    ex.carry(push)  # carried over a second epoch's end before it left
    before = vectors.state_vector()[:vectors.numel]
    ex.before_push(push)
    assert push.payload is None  # only the header travels
    ex.after_push(push)
    update(ex, k=1, mine=1, version=1)
    assert torch.allclose(vectors.state_vector()[:vectors.numel], before - 0.1 * grad, atol=1e-6)
    # the next push packs its own gradient again
    grad = backward_and_push(module, optimizer, ex, 5, True)
    before = vectors.state_vector()[:vectors.numel]
    update(ex, k=1, mine=1, version=2)
    assert torch.allclose(vectors.state_vector()[:vectors.numel], before - 0.1 * grad, atol=1e-6)
