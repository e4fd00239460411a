"""The sharded path's layout: how a model is cut between owners, and how pieces and slices of
flat vectors map back onto the module, in one process."""

import pytest
import torch
from torch import nn

from lightning_stale.engine.distributed.paths.sharded.owner import ShardLayout
from lightning_stale.engine.state import ModelVectors


def module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.BatchNorm1d(40), nn.Linear(40, 30), nn.Linear(30, 3))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_owners_hold_contiguous_runs_that_cover_every_tensor_once(p):
    sizes = [t.numel() for t in module().parameters()]
    layout = ShardLayout(sizes, buffer_numel=0, p=p)
    covered = [i for r in layout.tensors for i in r]
    assert covered == list(range(len(sizes)))
    assert layout.spans[0][0] == 0 and layout.spans[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in zip(layout.spans, layout.spans[1:]))
    # no owner holds more than its fair share plus the largest tensor
    assert max(z - a for a, z in layout.spans) <= sum(sizes) / p + max(sizes)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("grad_missing", [False, True])
def test_pieces_carry_each_owner_its_gradients_buffers_and_presence(p, grad_missing):
    net = module()
    vectors = ModelVectors.of(net)
    net(torch.randn(5, 6)).sum().backward()
    if grad_missing:
        net[2].weight.grad = None
    push, masked = vectors.push_vector()
    assert masked == grad_missing
    layout = ShardLayout([t.numel() for t in vectors.params], vectors.buffer_numel, p)
    for owner in range(p):
        piece = layout.piece(push, owner, masked)
        a, z = layout.spans[owner]
        tensors = layout.tensors[owner]
        expected = [push[a:z]]
        if owner == 0:
            expected.append(push[vectors.numel:vectors.state_numel])
        if masked:
            expected.append(push[vectors.state_numel:][tensors.start:tensors.stop])
        assert torch.equal(piece, torch.cat(expected))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_slices_load_into_the_module_exactly_as_the_joined_vector(p):
    source, target, joined = module(), module(), module()
    for m in (target, joined):
        for t in m.state_dict().values():
            t.zero_()
    state = ModelVectors.of(source).state_vector()
    layout = ShardLayout([t.numel() for t in ModelVectors.of(source).params],
                         ModelVectors.of(source).buffer_numel, p)
    # owner o's slice: its parameters (owner 0: then the buffers), as `ShardOwner` sends it
    n = layout.numel
    slices = [torch.cat([state[a:z]] + ([state[n:]] if o == 0 else [])) for o, (a, z) in enumerate(layout.spans)]
    ModelVectors.of(joined).load_state(layout.join(slices))
    layout.load(ModelVectors.of(target), slices)
    for (name, a), b in zip(target.state_dict().items(), joined.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(ModelVectors.of(target).state_vector(), state)


def test_load_parts_refuses_chunks_of_the_wrong_size():
    vectors = ModelVectors.of(module())
    state = vectors.state_vector()
    with pytest.raises(ValueError, match="chunks of"):
        vectors.load_parts([state[:-1]])
    with pytest.raises(ValueError, match="straddles"):
        vectors.load_parts([state[:5], state[5:]])
