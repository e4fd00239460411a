"""The parameter server loop and the message framing, in one process with hand-built messages.

No torch.distributed here: a recording endpoint stands in for the transport, so every decision
can be checked exactly. The real transport is exercised by tests/integration/test_engine_processes.py.
"""

import queue
import threading
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from fake_clock import FakeTime
from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed.messages import (HEADER, HEADER_BYTES, INLINE, ON_CHANNEL, SEPARATE, Flag, Kind,
                                                         Message, TransportError, coalesce, payload_text,
                                                         text_payload)
from lightning_stale.engine.distributed.paths.central.path import CentralPayloads
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.engine.distributed.frames import FRAME_BYTES, INLINE_PAYLOAD_BYTES, decode, encode
from lightning_stale.engine.distributed import transport
from lightning_stale.engine.distributed.transport import ServerEndpoint
from lightning_stale.engine.state import ModelVectors, ServerState
from lightning_stale.method.variants import Variant


class RecordingEndpoint:
    def __init__(self):
        self.sent, self.forgotten, self.heartbeats = [], [], 0
        self.broken = {}

    def send(self, learner, message):
        self.sent.append((learner, message))

    def heartbeat(self, interval):
        self.heartbeats += 1

    def forget(self, learner):
        self.forgotten.append(learner)

    def take(self):
        sent, self.sent = self.sent, []
        return sent


def make_server(name, k=None, p=4, on_learner_failure="stop", **limits):
    module = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(module.weight)
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0))
    core = ServerCore(Variant.create(name, p, k), state, ServerLimits(**limits))
    server = ParameterServer(core, CentralPayloads(ModelVectors.of(module)), on_learner_failure)
    endpoint = RecordingEndpoint()
    server.endpoint = endpoint
    server._broadcast(Kind.PARAMS)
    endpoint.take()
    return server, endpoint


def push(server, learner, version, value=1.0, loss=2.0, **fields):
    server._handle(Message(Kind.PUSH, learner, version, samples=8, loss=loss,
                           payload=torch.full((3,), value), **fields))


def run_loop(server):
    server._thread = threading.Thread(target=server._run)
    server._thread.start()


def test_k_async_update_averages_and_answers_only_the_pushers():
    server, endpoint = make_server("k_async", k=2)
    push(server, 1, 0, value=1.0, loss=1.0)
    assert endpoint.take() == []  # learner 1 waits for w_1
    push(server, 3, 0, value=3.0, loss=3.0)
    sent = endpoint.take()
    assert [(l, m.kind, m.version) for l, m in sent] == [(1, Kind.PARAMS, 1), (3, Kind.PARAMS, 1)]
    assert torch.allclose(sent[0][1].payload, torch.full((3,), -2.0))  # w_0 - lr * mean(1, 3)
    (record,) = server.pop_update_records()
    assert (record.update, record.samples, record.loss, record.learners) == (1, 16, 2.0, (1, 3))


def test_update_times_never_go_back_when_pushes_are_queued_out_of_stamp_order():
    # two receiving threads: one stamps its push first, the other queues its own first
    server, endpoint = make_server("async", p=2)
    now = time.monotonic()
    push(server, 1, 0, received_at=now + 0.002)
    push(server, 0, 0, received_at=now + 0.001)
    push(server, 1, 1, received_at=now + 0.003)
    clocks = [record.clock for record in server.pop_update_records()]
    assert len(clocks) == 3 and clocks == sorted(clocks)


def test_k_batch_sync_lets_the_pusher_go_on_then_refreshes_everyone():
    server, endpoint = make_server("k_batch_sync", k=2)
    push(server, 2, 0)
    assert endpoint.take() == []  # the pusher keeps w_0 and went on without waiting for an answer
    push(server, 2, 0)
    assert [l for l, m in endpoint.take() if m.kind == Kind.PARAMS] == [0, 1, 2, 3]
    push(server, 0, 0)  # crossed the cancellation on the wire: dropped, no answer of its own
    assert endpoint.take() == [] and server.core.rules.counts.dropped["stale"] == 1


def test_k_batch_async_pusher_hears_continue_when_it_holds_the_current_parameters():
    server, endpoint = make_server("k_batch_async", k=2)
    push(server, 1, 0)
    assert [(l, m.kind, m.payload) for l, m in endpoint.take()] == [(1, Kind.CONTINUE, None)]
    push(server, 2, 0)  # completes the update; this pusher pulls w_1
    assert [(l, m.kind, m.version) for l, m in endpoint.take()] == [(2, Kind.PARAMS, 1)]
    push(server, 3, 0)  # holds w_0 < w_1: pulls w_1 at once
    assert [(l, m.kind, m.version) for l, m in endpoint.take()] == [(3, Kind.PARAMS, 1)]


def test_an_epoch_end_pauses_everyone_without_dropping_anything():
    server, endpoint = make_server("k_async", k=3, pushes_per_epoch=2)
    push(server, 0, 0)
    push(server, 1, 0)
    sent = endpoint.take()
    # everyone gets the server's parameters to validate; nobody is refreshed or cancelled
    assert [(l, m.kind, m.epoch) for l, m in sent] == [(l, Kind.EPOCH, 1) for l in range(4)]
    assert server.core.rules.counts.dropped == {} and len(server.core.rules.pending) == 2
    assert server.core._paused_at is not None  # the clock stopped
    push(server, 2, 0)  # in flight across the epoch's end: held while everyone validates
    assert endpoint.take() == [] and server.core.rules.counts.received == 2
    server._handle(("resume", {"val/loss": 1.0}, None))
    assert server.core._paused_at is None
    # training goes on: the held push counts, and completes the update
    assert [l for l, m in endpoint.take() if m.kind == Kind.PARAMS] == [0, 1, 2]
    assert server.core.updates == 1 and server.core.rules.counts.received == 3


def test_the_update_that_ends_an_epoch_answers_with_the_new_count_and_the_epochs_end_follows():
    """What a learner relies on to pause at that update (`Learner._absorb`): every learner's
    answer to the update that ends an epoch carries the new epoch count, and the EPOCH comes
    right behind it, on the same connection, before anything else."""
    server, endpoint = make_server("sync", p=4, pushes_per_epoch=8)
    for learner in range(4):
        push(server, learner, 0)
    # within the epoch: answers with the count unchanged, and nothing behind them
    assert [(m.kind, m.epoch) for _, m in endpoint.take()] == [(Kind.PARAMS, 0)] * 4
    for learner in range(3):
        push(server, learner, 1)
    assert endpoint.take() == []  # Fully sync waits for the fourth
    push(server, 3, 1)
    sent = endpoint.take()
    for learner in range(4):
        mine = [(m.kind, m.version, m.epoch) for to, m in sent if to == learner]
        assert mine == [(Kind.PARAMS, 2, 1), (Kind.EPOCH, 2, 1)]


def test_on_the_collective_path_the_update_that_stops_training_goes_with_the_stop():
    # Learners hold the parameters there: a stop without the last update's payload would leave
    # every learner one update behind the books.
    from lightning_stale.engine.distributed.paths.collective.path import CollectivePayloads

    core = ServerCore(Variant.create("sync", 2), None, ServerLimits(max_updates=2, pushes_per_epoch=8))
    server = ParameterServer(core, CollectivePayloads(overlap=True), "stop")
    server.endpoint = endpoint = RecordingEndpoint()
    for version in (0, 1):
        for learner in (0, 1):
            server._handle(Message(Kind.PUSH, learner, version, samples=8, loss=1.0))
    sent = endpoint.take()
    first, last = sent[:2], sent[2:]
    # [K, taken from learner 0, from learner 1, the next backward overlapped]
    assert [(m.kind, m.payload.tolist()) for _, m in first] == [(Kind.PARAMS, [2, 1, 1, 1])] * 2
    assert [(m.kind, m.payload.tolist()) for _, m in last] == [(Kind.STOP, [2, 1, 1, 0])] * 2


def test_max_updates_stops_everyone_and_late_pushes_count_as_in_flight():
    server, endpoint = make_server("async", max_updates=2)
    push(server, 0, 0)
    push(server, 1, 0)
    assert [(l, m.kind) for l, m in endpoint.take()][-4:] == [(l, Kind.STOP) for l in range(4)]
    push(server, 2, 0)
    stats = server.core.rules.stats()
    assert stats["updates"] == 2 and stats["gradients_in_flight_at_stop"] == 1
    assert stats["gradients_received"] == 3 == stats["gradients_applied"] + stats["gradients_in_flight_at_stop"]


def test_an_overflowing_push_is_dropped_and_its_learner_goes_on():
    server, endpoint = make_server("k_async", k=2)
    server._handle(Message(Kind.PUSH, 1, 0, samples=8, flags=Flag.UNUSABLE, error="overflow"))
    assert [(l, m.kind) for l, m in endpoint.take()] == [(1, Kind.CONTINUE)]
    assert server.core.rules.counts.dropped == {"overflow": 1}


def test_a_masked_push_tells_the_server_which_parameters_had_a_gradient():
    server, _ = make_server("async")
    payload = torch.cat([torch.full((3,), 5.0), torch.zeros(1)])  # gradients, mask: no gradient
    push_message = Message(Kind.PUSH, 0, 0, samples=8, flags=Flag.MASKED, payload=payload)
    server._handle(push_message)
    assert server.core.state.params[0].abs().sum().item() == 0.0  # nothing moved


def test_first_goodbye_stops_the_server_loop_after_all_leave():
    server, endpoint = make_server("k_sync", k=2)
    run_loop(server)
    for learner in range(4):
        server.events.put(Message(Kind.BYE, learner))
    assert server.join(5.0)
    assert [m.kind for _, m in endpoint.take()] == [Kind.STOP] * 4


def test_a_learner_asking_to_stop_stops_everyone_even_during_an_epoch_end():
    # e.g. max_time passed on learner 1: every learner stops on the server's STOP (and so
    # validates at the same point), the push held by the pause counts as in flight
    server, endpoint = make_server("k_async", k=2, pushes_per_epoch=2)
    push(server, 0, 0)
    push(server, 1, 0)
    assert {m.kind for _, m in endpoint.take()} == {Kind.PARAMS, Kind.EPOCH}
    push(server, 2, 1)  # held by the pause
    server._handle(Message(Kind.HALT, 1))
    assert [(l, m.kind) for l, m in endpoint.take()] == [(l, Kind.STOP) for l in range(4)]
    stats = server.core.rules.stats()
    assert server.core.stopped and stats["gradients_in_flight_at_stop"] == 1
    assert server.learner_reports == {}  # nobody has left yet: the goodbyes follow


def test_a_dead_learner_ends_the_run_for_everyone_with_its_name():
    server, endpoint = make_server("async")
    run_loop(server)
    server.events.put(Message(Kind.FAILED, learner=2, error="receiving from learner 2 failed: reset"))
    assert server.join(5.0) and server.error.startswith("learner 2 died: receiving from learner 2")
    aborts = [(l, m) for l, m in endpoint.take() if m.kind == Kind.ABORT]
    assert [l for l, _ in aborts] == [0, 1, 2, 3] and payload_text(aborts[1][1].payload) == server.error


def test_with_continue_a_dead_learner_is_dropped_and_k_clamped():
    server, endpoint = make_server("k_sync", k=3, on_learner_failure="continue")
    push(server, 0, 0)
    push(server, 1, 0)
    server._handle(Message(Kind.FAILED, learner=3, error="reset"))
    server._handle(Message(Kind.FAILED, learner=2, error="reset"))  # two left: K = 2 is met
    assert server.error is None and endpoint.forgotten == [3, 2]
    assert [(l, m.kind, m.dead) for l, m in endpoint.take()] == [(0, Kind.PARAMS, 2), (1, Kind.PARAMS, 2)]
    assert server.core.rules.k == 2 and server.core.updates == 1


def test_the_roll_call_waits_for_every_live_learner_and_counts_one_that_died_before_reporting():
    # An epoch ends; learner 2 was killed just before, and its connection is seen to break only
    # after the others reported: they hear the answer then, with the death counted, and not before.
    server, endpoint = make_server("k_async", k=2, p=3, on_learner_failure="continue", pushes_per_epoch=2)
    push(server, 0, 0)
    push(server, 1, 0)
    assert [(l, m.kind, m.dead) for l, m in endpoint.take() if m.kind == Kind.EPOCH] == [
        (l, Kind.EPOCH, 0) for l in range(3)]
    epoch = server.core.epoch
    server._handle(Message(Kind.PRESENT, 0, epoch=epoch))
    server._handle(Message(Kind.PRESENT, 1, epoch=epoch))
    assert endpoint.take() == []  # learner 2 is neither present nor known dead
    server._handle(Message(Kind.FAILED, learner=2, error="reset"))
    assert [(l, m.kind, m.epoch, m.dead) for l, m in endpoint.take()] == [
        (0, Kind.PRESENT, epoch, 1), (1, Kind.PRESENT, epoch, 1)]


def test_the_roll_call_is_answered_once_the_last_live_learner_reports():
    server, endpoint = make_server("k_async", k=2, p=3, on_learner_failure="continue", pushes_per_epoch=2)
    push(server, 0, 0)
    push(server, 1, 0)
    endpoint.take()
    epoch = server.core.epoch
    for learner in (2, 0):
        server._handle(Message(Kind.PRESENT, learner, epoch=epoch))
        assert endpoint.take() == []
    server._handle(Message(Kind.PRESENT, 1, epoch=epoch))
    assert [(l, m.kind, m.dead) for l, m in endpoint.take()] == [(l, Kind.PRESENT, 0) for l in range(3)]
    server._handle(Message(Kind.FAILED, learner=2, error="reset"))  # later: no second answer
    assert [m.kind for _, m in endpoint.take()] == []


def test_after_the_stop_a_broken_learner_is_not_waited_for_by_the_roll_call():
    # nothing is removed after the stop, but the learners waiting must not wait for it forever
    server, endpoint = make_server("k_async", k=2, p=3, on_learner_failure="continue", pushes_per_epoch=2)
    push(server, 0, 0)
    push(server, 1, 0)
    epoch = server.core.epoch
    server._handle(Message(Kind.HALT, 1))
    endpoint.take()
    server._handle(Message(Kind.PRESENT, 0, epoch=epoch))
    server._handle(Message(Kind.PRESENT, 1, epoch=epoch))
    server._handle(Message(Kind.FAILED, learner=2, error="reset"))
    assert server.core.rules.counts.dead_learners == []
    assert [(l, m.kind, m.dead) for l, m in endpoint.take()] == [(0, Kind.PRESENT, 0), (1, Kind.PRESENT, 0)]


def test_continue_needs_k_below_p():
    server, endpoint = make_server("k_sync", k=4, on_learner_failure="continue")
    server._handle(Message(Kind.FAILED, learner=3, error="reset"))
    assert "needs K < P" in server.error


def test_a_learner_interrupted_by_a_signal_stops_everyone_as_interrupted():
    server, endpoint = make_server("k_async", k=2)
    run_loop(server)
    server.events.put(Message(Kind.ABORT, 1, flags=Flag.INTERRUPTED, error="SIGTERM on rank 1"))
    assert server.join(5.0) and server.interrupted and server.error == "SIGTERM on rank 1"
    assert {m.flags for _, m in endpoint.take()} == {Flag.INTERRUPTED}


def test_a_signal_on_a_learner_stops_everyone_through_the_goodbye_protocol():
    server, endpoint = make_server("k_async", k=2)
    run_loop(server)
    server.events.put(Message(Kind.INTERRUPT, 1, error="SIGTERM on rank 1"))
    for learner in range(4):
        server.events.put(Message(Kind.BYE, learner))
    assert server.join(5.0) and server.error is None and server.interruption == "SIGTERM on rank 1"
    sent = endpoint.take()  # every learner hears why, then stops; no abort
    assert [(l, m.kind) for l, m in sent] == [(l, Kind.INTERRUPT) for l in range(4)] + [(l, Kind.STOP) for l in range(4)]
    assert payload_text(sent[2][1].payload) == "SIGTERM on rank 1"
    assert server.learner_reports.keys() == {0, 1, 2, 3}  # goodbyes (with the delays) collected


def test_a_signal_after_training_stopped_is_moot():
    server, endpoint = make_server("async", max_updates=1)
    push(server, 1, 0)  # the last update: everyone was told to stop
    endpoint.take()
    server._handle(Message(Kind.INTERRUPT, 2, error="SIGINT on rank 2"))
    assert server.interruption is None and server.error is None and endpoint.take() == []


def test_an_exception_in_the_server_thread_aborts_the_run_naming_it():
    server, endpoint = make_server("async")

    def broken(*args, **kwargs):
        raise RuntimeError("scheduler blew up")

    server.core.push = broken
    run_loop(server)
    push_message = Message(Kind.PUSH, 1, 0, samples=8, payload=torch.ones(3))
    server.events.put(push_message)
    assert server.join(5.0)
    assert server.error.startswith("the parameter server failed: RuntimeError: scheduler blew up")
    assert sorted(l for l, m in endpoint.take() if m.kind == Kind.ABORT) == [0, 1, 2, 3]


def test_an_idle_server_sends_heartbeats():
    server, endpoint = make_server("async")
    server.heartbeat_s = 0.05
    run_loop(server)
    deadline = time.monotonic() + 60  # (a guard against a hang, not a bound on the heartbeat)
    while endpoint.heartbeats < 3:  # with no message to send, the loop beats again and again
        assert time.monotonic() < deadline, f"{endpoint.heartbeats} heartbeats"
        time.sleep(0.01)
    server.events.put(Message(Kind.FAILED, learner=1, error="x"))
    assert server.join(5.0)


# ---------------------------------------------------------------- framing
def test_a_small_message_travels_as_one_frame_that_keeps_every_field():
    message = Message(Kind.PUSH, learner=3, version=12345, epoch=7, samples=64, loss=0.123456789,
                      payload=torch.arange(5, dtype=torch.float64), pushes=9, hold=0.25, age=0.125,
                      flags=Flag.MASKED, dead=2, cancelled=4, seq=31, delivery=6)
    frame, separate = encode(message)
    assert separate is None and frame.numel() == HEADER_BYTES + 5 * 8
    received = torch.full((FRAME_BYTES,), 255, dtype=torch.uint8)  # gloo fills only the start
    received[:frame.numel()] = frame
    decoded, numel, dtype, inline = decode(received, "learner 3", 100)
    assert (decoded.kind, decoded.learner, decoded.version, decoded.epoch, decoded.samples) == (Kind.PUSH, 3, 12345, 7, 64)
    assert decoded.loss == 0.123456789 and (decoded.pushes, decoded.hold, decoded.age) == (9, 0.25, 0.125)
    assert (decoded.flags, decoded.dead, decoded.cancelled, decoded.seq, decoded.delivery) == (Flag.MASKED, 2, 4, 31, 6)
    assert (numel, dtype, inline) == (5, torch.float64, True)
    assert decoded.payload.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    received.zero_()  # the receive buffer is reused: the payload must not share it
    assert decoded.payload.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_payload_of_a_dtype_the_header_cannot_name_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"dtype torch.int64 cannot travel.*torch.float32"):
        encode(Message(Kind.PUSH, payload=torch.arange(3)))


def test_a_large_payload_follows_its_header_without_a_copy():
    payload = torch.zeros(INLINE_PAYLOAD_BYTES // 4 + 1)
    frame, separate = encode(Message(Kind.PARAMS, version=2, payload=payload))
    assert frame.numel() == HEADER_BYTES and separate.data_ptr() == payload.data_ptr()
    decoded, numel, dtype, inline = decode(frame, "the server", payload.numel())
    assert (numel, dtype, inline) == (payload.numel(), torch.float32, False) and decoded.payload is None


@pytest.mark.parametrize("channel_device,size,where", [
    ("cpu", INLINE_PAYLOAD_BYTES // 4 + 1, ON_CHANNEL),  # a channel of its device: on it
    ("cuda", INLINE_PAYLOAD_BYTES // 4 + 1, SEPARATE),  # a host payload beside NCCL: over gloo
    ("cpu", 10, INLINE),  # small: in the frame, channel or not
])
def test_a_large_payload_goes_on_a_channel_of_its_device_and_the_header_says_so(channel_device, size, where):
    from types import SimpleNamespace

    payload = torch.zeros(size)
    channel = SimpleNamespace(device=torch.device(channel_device))
    frame, after = encode(Message(Kind.PUSH, version=2, payload=payload), channel=channel)
    decoded, numel, dtype, inline = decode(frame, "learner 1", size)
    assert (numel, inline) == (size, where)
    assert (after is None) == (where == INLINE)


@pytest.mark.parametrize("kind", [Kind.ABORT, Kind.INTERRUPT])
def test_an_abort_or_interrupt_carries_its_reason_as_text(kind):
    reason = "learner 1 failed: ValueError: bad batch — ünïcode"
    frame, _ = encode(Message(kind, payload=text_payload(reason)))
    decoded, *_ = decode(frame, "learner 1", 1000)
    assert decoded.kind == kind and payload_text(decoded.payload) == reason


def test_the_server_endpoint_stamps_pushes_received_and_time_held(monkeypatch):
    clock = FakeTime()  # the endpoint's clock: the times it stamps are exact
    monkeypatch.setattr(transport, "time", clock)
    inbox, delivered = queue.Queue(), []
    endpoint = ServerEndpoint(None, 1, delivered.append, inbox, max_numel=2)  # P = 1: no threads, no gloo
    endpoint.send(0, Message(Kind.PARAMS, version=0))
    first = inbox.get_nowait()
    assert (first.pushes, first.hold, first.age) == (0, 0.0, 0.0)  # nothing received, nothing caused it
    endpoint.receive_local(Message(Kind.PUSH, learner=0, version=0))
    assert delivered[0].kind == Kind.PUSH and delivered[0].received_at == clock.now
    clock.sleep(0.05)  # the server holds the push 0.05 s; the deciding push came 0.02 s ago
    endpoint.send(0, Message(Kind.PARAMS, version=1, caused_at=clock.now - 0.02))
    answer = inbox.get_nowait()
    assert answer.pushes == 1 and answer.hold == pytest.approx(0.05) and answer.age == pytest.approx(0.02)
    assert answer.received_at == clock.now  # the learner's own copy: received as sent


def test_coalesce_keeps_the_newest_parameters_and_every_epoch_end():
    p1 = Message(Kind.PARAMS, version=1, epoch=0, payload=torch.zeros(1))
    p2 = Message(Kind.PARAMS, version=2, epoch=0, payload=torch.ones(1))
    cont = Message(Kind.CONTINUE, version=2, epoch=0)
    epoch = Message(Kind.EPOCH, version=2, epoch=1, payload=torch.full((1,), 7.0))
    beat = Message(Kind.HEARTBEAT)
    merged = coalesce([p1, beat, p2, cont, epoch, beat])
    assert [(m.kind, m.version) for m in merged] == [(Kind.PARAMS, 2), (Kind.EPOCH, 2)]
    assert merged[0].payload.item() == 1.0 and merged[1].payload.item() == 7.0
    # a CUDA snapshot's event goes with its parameters: sent before it, the payload may be unwritten
    made, later = object(), object()
    p2, cont = replace(p2, ready=made), replace(cont, ready=None)
    assert coalesce([p2, cont])[0].ready is made
    assert coalesce([p2, replace(cont, kind=Kind.PARAMS, ready=later)])[0].ready is later
    stop = Message(Kind.STOP, version=3, epoch=1, payload=torch.full((1,), 3.0))
    assert coalesce([p1, stop])[-1] is stop
    assert coalesce([beat]) == [beat]


@pytest.mark.parametrize("corrupt,match", [
    (lambda f: f[:10], "shorter than a header"),
    (lambda f: torch.cat([torch.zeros(8, dtype=torch.uint8), f[8:]]), "not a lightning_stale message"),
    (lambda f: _with_field(f, "protocol", 99), "protocol version 99"),
    (lambda f: _with_field(f, "kind", 42), "unknown kind 42"),
    (lambda f: _with_field(f, "numel", 10**9), "announced a payload of 1000000000 values"),
    (lambda f: _with_field(f, "dtype", 17), "unknown dtype code 17"),
])
def test_a_frame_that_does_not_parse_is_refused_naming_the_sender(corrupt, match):
    frame, _ = encode(Message(Kind.PUSH, version=1, payload=torch.ones(3)))
    with pytest.raises(TransportError, match=match) as error:
        decode(corrupt(frame.clone()), "learner 2", 100)
    assert "learner 2" in str(error.value)


def _with_field(frame, name, value):
    """The frame with its header's int64 field ``name`` set to ``value``."""
    index = [field for field, _ in HEADER].index(name)
    frame[index * 8:(index + 1) * 8] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
    return frame


@pytest.mark.parametrize("name,k", [("async", None), ("k_async", 2)])
def test_an_answer_to_one_learner_alone_is_written_where_its_endpoint_places_it(name, k):
    """`CentralPayloads.place_for`: the parameters of an answer that refreshes one learner go
    straight into the place its endpoint offers (a free slot of its lane); a version that goes
    to several learners, or a learner offered no place, gets the shared snapshot."""
    server, endpoint = make_server(name, k=k)
    asked, places = [], {}

    def place_for(learner, numel, dtype):
        asked.append(learner)
        if learner == 2:
            return None  # its slot is still held
        places[learner] = torch.full((numel,), float("nan"), dtype=dtype)
        return places[learner]

    server.payloads.place_for = place_for
    push(server, 1, 0, value=1.0)
    if k is None:
        push(server, 2, 0, value=1.0)
    push(server, 3, 0, value=3.0)
    sent = {learner: m for learner, m in endpoint.take() if m.kind == Kind.PARAMS}
    snapshot = server.core.state.snapshot(server.core.version)
    if k is None:  # three updates, each answering its pusher alone
        assert asked == [1, 2, 3] and sent[1].payload is places[1] and sent[3].payload is places[3]
        assert torch.equal(sent[3].payload, snapshot) and torch.equal(sent[2].payload, -2 * torch.ones(3))
        assert not torch.equal(sent[1].payload, sent[3].payload)  # each its own version's
    else:  # one update answering learners 1 and 3 together: one snapshot, no place asked
        assert asked == [] and sent[1].payload is sent[3].payload
        assert torch.equal(sent[1].payload, snapshot)


def lent_push(server, lane, learner, version, value):
    """A push whose gradient the receiving thread hands over in its lane's slot."""
    from lightning_stale.engine.distributed.lanes import Lane

    assert isinstance(lane, Lane)
    lane.write(torch.full((3,), value), lambda: None)
    message = Message(Kind.PUSH, learner, version, samples=8, loss=1.0)
    lane.lend(message, 3, torch.float32)
    server._handle(message)
    return message


@pytest.mark.parametrize("name,k", [("async", None), ("k_async", 2)])
def test_a_push_read_in_its_slot_frees_it_once_decided_and_one_kept_for_later_is_copied_out(tmp_path, name, k):
    """`ServerEndpoint` ``lend_pushes``: the server decides a push straight from its shared-memory
    slot and gives the slot back; a gradient that waits for others (K > 1) is copied out first,
    so the learner's next push into that slot cannot change it."""
    from lightning_stale.engine.distributed.lanes import LaneFile, slot_bytes_for

    lanes, _ = LaneFile.create(str(tmp_path), slot_bytes_for(3, torch.float32))
    lane = lanes.up
    server, endpoint = make_server(name, k=k)
    first = lent_push(server, lane, 1, 0, 1.0)
    assert first.lent.settled and int(lane.control[2]) == 1  # the slot is free again
    held = [g.contribution for g in server.core._pending.values()]
    if k is None:  # decided at once: the update read the slot, nothing copied
        assert held == [] and first.payload.data_ptr() == lane._slots[0].data_ptr()
        assert server.core.state.params[0].tolist() == [[-1.0, -1.0, -1.0]]
    else:  # waits for a second gradient: its own copy
        (kept,) = held
        assert kept.gradient.data_ptr() != lane._slots[0].data_ptr()
        lane.write(torch.full((3,), 50.0), lambda: None)  # the learner's next pushes: the second
        lane.write(torch.full((3,), 70.0), lambda: None)  # goes into the slot the first one left
        other, _ = LaneFile.create(str(tmp_path), slot_bytes_for(3, torch.float32))
        lent_push(server, other.up, 3, 0, 3.0)
        assert server.core.state.params[0].tolist() == [[-2.0, -2.0, -2.0]]  # mean(1, 3), not 70


def test_a_push_read_in_its_slot_during_an_epochs_end_is_copied_out_and_held(tmp_path):
    from lightning_stale.engine.distributed.lanes import LaneFile, slot_bytes_for

    lanes, _ = LaneFile.create(str(tmp_path), slot_bytes_for(3, torch.float32))
    lane = lanes.up
    server, endpoint = make_server("async", pushes_per_epoch=1)
    lent_push(server, lane, 1, 0, 1.0)  # ends the epoch
    late = lent_push(server, lane, 2, 0, 4.0)  # held over the pause
    assert late.lent.settled and late.payload.data_ptr() != lane._slots[1].data_ptr()
    for value in (90.0, 91.0):  # the learner's next pushes: the second into the slot it came in
        lane.write(torch.full((3,), value), lambda: None)
    server._handle(("resume", {}, None))
    assert server.core.state.params[0].tolist() == [[-5.0, -5.0, -5.0]]  # 0 - 1 - 4


def test_a_checkpoints_parts_are_of_one_instant_though_the_server_steps_between_their_reads():
    # Lightning reads the module's state, then the optimizer's, then the books, and writes the
    # file after the server's lock is released; the server steps its optimizer in place meanwhile.

    from lightning_stale.engine.distributed.paths.base import CheckpointView
    from lightning_stale.engine.distributed.paths.central.path import CentralCheckpoint

    module = nn.Linear(3, 1, bias=False)
    state = ServerState(module, torch.optim.AdamW(module.parameters(), lr=0.1))
    core = ServerCore(Variant.create("async", 2, None), state, ServerLimits())
    server = ParameterServer(core, CentralPayloads(ModelVectors.of(module)))
    server.endpoint = RecordingEndpoint()
    server._broadcast(Kind.PARAMS)
    push(server, 1, 0, value=1.0)
    checkpoint = CentralCheckpoint(CheckpointView(server, module))
    weight = state.params[0].detach().clone()
    moment = state.optimizer.state[state.params[0]]["exp_avg"].clone()
    parameters = checkpoint.module_state({})
    push(server, 1, 1, value=5.0)  # between Lightning's reads
    optimizer, books = checkpoint.optimizer_state({}), checkpoint.engine_state()
    assert server.core.version == 2 and not torch.equal(state.params[0].detach(), weight)
    assert torch.equal(parameters["weight"], weight) and books["version"] == books["updates"] == 1
    assert torch.equal(optimizer["state"][0]["exp_avg"], moment)
    push(server, 1, 2, value=3.0)
    assert torch.equal(optimizer["state"][0]["exp_avg"], moment)  # a copy, not the live state
    # the next checkpoint takes the next instant
    assert torch.equal(checkpoint.module_state({})["weight"], state.params[0].detach())
    assert checkpoint.engine_state()["version"] == 3


def test_a_death_the_servers_loop_has_not_heard_yet_is_known_to_the_watchdog():
    """The endpoint keeps why a learner's connection broke, so that rank 0's watchdog knows of
    the death even where the server's loop is stuck (on a GPU, behind a payload that never
    comes); it reads it as the loop would decide it."""
    from types import SimpleNamespace

    from lightning_stale.strategies.faults import FaultHandling

    server, endpoint = make_server("k_async", k=2, p=3)
    strategy = SimpleNamespace(_server=server, _learner=None, _trap=None)
    assert server.unheard_death() is None and FaultHandling._known_failure(strategy) is None
    endpoint.broken[2] = "receiving from learner 2 failed: reset"
    assert server.unheard_death() == "learner 2 died: receiving from learner 2 failed: reset"
    assert FaultHandling._known_failure(strategy) == server.unheard_death()
    server.learner_reports[2] = Message(Kind.BYE, 2)  # it had left: its connection closing is no fault
    assert server.unheard_death() is None
    tolerant, endpoint = make_server("k_async", k=2, p=3, on_learner_failure="continue")
    endpoint.broken[2] = "receiving from learner 2 failed: reset"
    assert tolerant.unheard_death() is None  # the run goes on without it


def test_an_endpoint_keeps_the_first_reason_a_connection_broke_and_tells_the_loop():
    delivered = []
    endpoint = ServerEndpoint(None, 1, delivered.append, queue.Queue(), max_numel=2)
    endpoint._broke(1, "receiving from learner 1 failed: reset")
    endpoint._broke(1, "sending to learner 1 failed: closed")
    assert endpoint.broken == {1: "receiving from learner 1 failed: reset"}
    assert [(m.kind, m.learner, m.error) for m in delivered] == [
        (Kind.FAILED, 1, "receiving from learner 1 failed: reset"), (Kind.FAILED, 1, "sending to learner 1 failed: closed")]
