"""ServerState: the server's copy of parameters and optimizer, and its update arithmetic."""

import pytest
import torch
from torch import nn

from lightning_stale.engine.state import FlatView, ServerState


def make(optimizer_cls=torch.optim.SGD, **kw):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return module, ServerState(module, optimizer_cls(module.parameters(), **kw))


def test_average_of_k_gradients_is_one_sgd_step():
    module, state = make(lr=0.5)
    before = state.view.params_vector()
    grads = [torch.randn(state.view.numel) for _ in range(3)]
    state.apply(grads)
    expected = before - 0.5 * torch.stack(grads).mean(0)
    assert torch.allclose(state.view.params_vector(), expected, atol=1e-6)
    # the learner's module is a separate copy: untouched until parameters are sent
    assert torch.allclose(FlatView(list(module.parameters())).params_vector(), before)


def test_weights_scale_each_gradient():
    _, state = make(lr=1.0)
    before = state.view.params_vector()
    g = torch.ones(state.view.numel)
    state.apply([g, g], weights=[1.0, 0.5])
    assert torch.allclose(state.view.params_vector(), before - 0.75 * g)


def test_adam_state_lives_with_the_server():
    _, state = make(torch.optim.Adam, lr=0.01)
    state.apply([torch.randn(state.view.numel)])
    assert all("exp_avg" in s for s in state.optimizer.state.values())


def test_snapshot_is_cached_per_version():
    _, state = make(lr=0.1)
    a = state.snapshot(0)
    assert state.snapshot(0) is a
    state.apply([torch.randn(state.view.numel)])
    assert not torch.equal(state.snapshot(1), a)


def test_flat_view_rejects_wrong_size():
    _, state = make(lr=0.1)
    with pytest.raises(ValueError, match="flat vector has 3 values"):
        state.view.load_params(torch.zeros(3))
