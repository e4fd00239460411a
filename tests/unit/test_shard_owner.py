"""A shard owner's protocol, in-process (`paths.sharded.owner.ShardOwner`): the server's orders
(APPLY, SEND, SCHEDULE, GATHER, RETIRE) followed in order, gradient pieces that arrive before
or after the order naming them, and a failure of the run that ends the wait for a piece."""

import io
import json
import threading
import time

import torch
from pytorch_lightning.utilities.types import LRSchedulerConfig
from torch import nn

from lightning_stale.engine.distributed.messages import Flag, Kind, Order, ShardData, text_payload
from lightning_stale.engine.distributed.paths.sharded.owner import ShardLayout, ShardOwner
from lightning_stale.engine.state import ServerState


class RecordingMesh:
    def __init__(self):
        self.sent = []

    def send(self, peer, message):
        self.sent.append((peer, message))

    def payload_device(self, device):
        return None


class Endpoint:
    failure = None

    def __init__(self):
        self.pushed = []

    def push(self, message):
        self.pushed.append(message)


def make_owner(rank=0, p=1, lr=1.0, schedulers=()):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
    layout = ShardLayout([t.numel() for t in module.parameters()], 0, p)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    state = ServerState(module, optimizer, schedulers, buffers=rank == 0, tensors=layout.tensors[rank])
    mesh, endpoint = RecordingMesh(), Endpoint()
    owner = ShardOwner(rank, state, mesh)
    owner.start(endpoint)
    return owner, state, mesh, endpoint, layout


def piece(learner, seq, values):
    return ShardData(Kind.PIECE, learner, 0, seq=seq, payload=torch.tensor(values))


def apply(version, *orders):
    return Order(Kind.APPLY, version=version,
                   payload=torch.tensor([list(o) for o in orders], dtype=torch.float64).reshape(-1))


def retire(owner):
    owner.commands.put(Order(Kind.RETIRE))
    assert owner.join(5.0)


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_owners_split_the_model_at_tensor_boundaries():
    owner0, state0, *_ = make_owner(rank=0, p=2)
    owner1, state1, *_ = make_owner(rank=1, p=2)
    retire(owner0)
    retire(owner1)
    assert [p.numel() for p in state0.params] == [4] and [p.numel() for p in state1.params] == [2]


def test_an_update_applies_the_named_pieces_averaged_whether_they_came_before_or_after_it():
    owner, state, _, _, _ = make_owner(p=2, rank=0)  # owns the first layer: 4 values
    start = state.params[0].detach().clone().reshape(-1)
    owner.put_piece(piece(1, 1, [1.0, 2.0, 3.0, 4.0]))  # before its order
    owner.commands.put(apply(1, (1, 1, 1.0), (2, 1, 1.0)))
    late = piece(2, 1, [3.0, 2.0, 1.0, 0.0])
    threading.Timer(0.2, owner.put_piece, (late,)).start()  # after it: the owner waits for it
    wait_until(lambda: owner.version == 1)
    assert torch.allclose(state.params[0].detach().reshape(-1), start - torch.tensor([2.0, 2.0, 2.0, 2.0]))
    owner.commands.put(apply(2, (1, 2, 0.5)))  # a weighted gradient (staleness compensation)
    owner.put_piece(piece(1, 2, [4.0, 4.0, 4.0, 4.0]))
    wait_until(lambda: owner.version == 2)
    assert torch.allclose(state.params[0].detach().reshape(-1), start - torch.tensor([4.0, 4.0, 4.0, 4.0]))
    retire(owner)


def test_pieces_older_than_an_applied_one_of_the_same_learner_are_dropped():
    owner, *_ = make_owner()
    for seq in (1, 2, 3):
        owner.put_piece(piece(1, seq, [0.0] * 6))
    owner.put_piece(piece(2, 1, [0.0] * 6))
    owner.commands.put(apply(1, (1, 2, 1.0)))
    wait_until(lambda: owner.version == 1)
    assert sorted(owner._pieces) == [(1, 3), (2, 1)]  # the server dropped (1, 1); (1, 3) may come
    retire(owner)


def test_a_send_order_gives_the_learner_this_owners_slice_of_the_current_version():
    owner, state, mesh, _, _ = make_owner()
    owner.commands.put(Order(Kind.SEND, 3, delivery=7))
    retire(owner)
    (peer, slice_), = mesh.sent
    assert peer == 3 and slice_.kind == Kind.SLICE and slice_.delivery == 7 and slice_.version == 0
    assert torch.equal(slice_.payload, state.vectors.state_vector())


def test_schedules_follow_the_servers_epochs_and_gather_sends_the_state_to_rank_0():
    module = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = ServerState(module, optimizer, [LRSchedulerConfig(scheduler, interval="epoch")])
    mesh = RecordingMesh()
    owner = ShardOwner(0, state, mesh)
    owner.start(Endpoint())
    owner.commands.put(Order(Kind.SCHEDULE, epoch=1, payload=text_payload(json.dumps({"loss": 1.0}))))
    owner.commands.put(Order(Kind.GATHER, delivery=4))
    retire(owner)
    assert state.optimizer.param_groups[0]["lr"] == 0.5
    (to0, vector), (to0b, saved) = mesh.sent
    assert to0 == to0b == 0 and vector.kind == saved.kind == Kind.STATE and vector.delivery == saved.delivery == 4
    assert not vector.flags & Flag.OPTIMIZER and saved.flags & Flag.OPTIMIZER
    loaded = torch.load(io.BytesIO(saved.payload.numpy().tobytes()), weights_only=True)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.5 and len(loaded["schedulers"]) == 1


def test_a_failure_of_the_run_ends_the_wait_for_a_piece_and_is_reported_naming_the_owner():
    owner, _, _, endpoint, _ = make_owner(rank=0)
    owner.commands.put(apply(1, (1, 1, 1.0)))  # its piece never comes
    time.sleep(0.2)
    assert endpoint.pushed == []  # still waiting
    endpoint.failure = "learner 1 died"
    assert owner.join(5.0)
    (abort,) = endpoint.pushed
    assert abort.kind == Kind.ABORT and "shard server on rank 0 failed" in abort.error
    assert "waiting for learner 1's gradient: the run failed (learner 1 died)" in abort.error


def test_a_broken_data_connection_ends_an_idle_owner():
    owner, *_ = make_owner()
    owner.broken("receiving data from rank 1 failed: reset")
    assert owner.join(5.0)  # (it looks at the failure once a second while idle)
