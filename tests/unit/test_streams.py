"""The engine's CUDA stream hand-offs (`engine.streams`), checked on the CPU.

Without a GPU the stream functions do nothing, so these tests check two things: that they are
no-ops on CPU tensors, and that the engine calls them where a tensor changes threads (rank 0's
push to the server, the server's answer to rank 0's learner) and runs the server's and the shard
owners' work inside their own stream. The recorded calls stand in for the GPU; what the calls do
on one is PyTorch's (CUDA semantics), and `benchmarks/gpu_check.py` runs them there.
"""

import threading

import torch
from torch import nn

from lightning_stale.engine import streams
from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed import learner as learner_module, server as server_module
from lightning_stale.engine.distributed.paths.central import path as central
from lightning_stale.engine.distributed.paths.sharded import owner as sharded
from lightning_stale.engine.distributed.paths.central.path import CentralExchange, CentralPayloads
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.engine.state import ModelVectors, ServerState
from lightning_stale.method.variants import Variant
from test_learner import FakeLearnerEndpoint


def test_off_cuda_every_stream_function_does_nothing():
    cpu = torch.zeros(3)
    assert streams.side_stream(torch.device("cpu"), "server") is None
    assert streams.engine_stream(torch.device("cpu"), "server") is None
    assert streams.separate_levels(torch.device("cpu"))
    assert streams.to_host(cpu, None) is cpu
    assert streams.mark(cpu) is None and streams.mark(None) is None
    streams.receive(cpu, None)
    with streams.running_on(None), streams.reading(None):
        pass


class Recorder:
    """Stands in for the stream functions: every tensor handed over gets an event name."""

    def __init__(self, monkeypatch):
        self.marked, self.received, self.ran_on = [], [], []
        for module in (central, learner_module):
            monkeypatch.setattr(module.streams, "mark", self.mark)
            monkeypatch.setattr(module.streams, "receive", self.receive)

    def mark(self, tensor):
        self.marked.append(tensor)
        return f"event {len(self.marked)}"

    def receive(self, tensor, ready):
        if ready is not None:
            self.received.append((tensor, ready))


def test_rank_0s_push_and_its_answer_are_handed_over_with_events(monkeypatch):
    recorder = Recorder(monkeypatch)
    module = nn.Linear(2, 1, bias=False)
    module.weight.grad = torch.ones_like(module.weight)
    vectors = ModelVectors.of(module)
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0))
    core = ServerCore(Variant.create("async", 2, None), state, ServerLimits())
    payloads = CentralPayloads(state.vectors)

    push = Message(Kind.PUSH, 0)
    CentralExchange(vectors, device=vectors.device).fill_push(push)
    assert push.ready == "event 1" and recorder.marked == [push.payload]
    payloads.contribution(push)  # on the server's thread: its stream waits for the push
    assert recorder.received == [(push.payload, "event 1")]

    answer = Message(Kind.PARAMS, 0)
    payloads.fill(answer, core, None)
    assert answer.ready == "event 2" and recorder.marked[-1] is answer.payload
    remote = Message(Kind.PARAMS, 1)
    payloads.fill(remote, core, None)  # a host snapshot for another process: nothing to hand over
    assert remote.ready is None and len(recorder.marked) == 2

    learner = Learner(FakeLearnerEndpoint(rank=0), vectors, None, exchange=CentralExchange(vectors))
    learner.endpoint.inbox.put(answer)
    learner.wait_for_parameters()  # the training thread's stream waits before loading
    assert recorder.received[-1] == (answer.payload, "event 2")


def test_the_server_and_a_shard_owner_work_inside_their_own_stream(monkeypatch):
    entered, original = [], streams.running_on

    def running_on(stream):
        entered.append((threading.current_thread().name, stream))
        return original(None)

    monkeypatch.setattr(server_module.streams, "running_on", running_on)
    module = nn.Linear(2, 1)
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0))
    server = ParameterServer(ServerCore(Variant.create("async", 1, None), state, ServerLimits()),
                             CentralPayloads(state.vectors))
    server.stream = "server stream"
    server.error = "stopped before it began"  # the loop ends at once
    server._thread = threading.Thread(target=server._run, name="stale-server")
    server._thread.start()
    assert server.join(5.0)

    owner = sharded.ShardOwner(0, ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0)), mesh=None)
    owner.stream = "owner stream"
    owner.commands.put(Message(Kind.RETIRE))
    owner.start(endpoint=None)
    assert owner.join(5.0)
    assert entered == [("stale-server", "server stream"), ("stale-shard-0", "owner stream")]


def test_each_role_gets_one_stream_per_process_from_the_engines_own_level(monkeypatch):
    """However many fits a process runs, the engine takes one stream per role and device, all at
    `ENGINE_PRIORITY` (the pools are PyTorch's: a stream taken anew each fit would in time be
    one a NCCL group or another role already uses)."""
    made = []

    class FakeStream:
        def __init__(self, device, priority):
            made.append((device, priority))

    monkeypatch.setattr(streams.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(streams, "_engine_streams", {})
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    server = streams.engine_stream(gpu0, "server")
    for _fit in range(3):
        assert streams.engine_stream(gpu0, "server") is server
        assert streams.engine_stream(gpu0, ("channel", 0, 1)) is streams.engine_stream(gpu0, ("channel", 0, 1))
    roles = {streams.engine_stream(gpu0, role) for role in ("server", "owner", "copies", "readers",
                                                            ("channel", 0, 1), ("channel", 1, 0))}
    assert len(roles) == 6 and streams.engine_stream(gpu1, "server") is not server
    assert made == [(gpu0, streams.ENGINE_PRIORITY)] * 6 + [(gpu1, streams.ENGINE_PRIORITY)]
    assert streams.ENGINE_PRIORITY == -1  # between NCCL's levels: 0, and the most urgent
