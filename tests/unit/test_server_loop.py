"""The parameter server loop and the learner protocol, in one process with hand-built messages.

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

from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed.learner import Learner, ServerFailed
from lightning_stale.engine.distributed.messages import (HEADER_BYTES, Kind, Message, TransportError,
                                                         coalesce)
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.engine.distributed.transport import (FRAME_BYTES, INLINE_PAYLOAD_BYTES, ServerEndpoint,
                                                          decode, encode)
from lightning_stale.engine.state import FlatView, ServerState
from lightning_stale.method.variants import Variant


class RecordingEndpoint:
    def __init__(self):
        self.sent = []

    def send(self, learner, message):
        self.sent.append((learner, message))

    def take(self):
        sent, self.sent = self.sent, []
        return sent


def make_server(name, k=None, p=4, **limits):
    module = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(module.weight)
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0))
    server = ParameterServer(ServerCore(Variant.create(name, p, k), state, ServerLimits(**limits)))
    endpoint = RecordingEndpoint()
    server.endpoint = endpoint
    server._broadcast(Kind.PARAMS)
    endpoint.take()
    return server, endpoint


def push(server, learner, version, value=1.0, loss=2.0):
    server._on_push(Message(Kind.PUSH, learner, version, samples=8, loss=loss,
                            payload=torch.full((3,), value)))


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


def test_epoch_ends_with_a_flush_to_everyone():
    server, endpoint = make_server("k_async", k=3, pushes_per_epoch=2)
    push(server, 0, 0)
    push(server, 1, 0)
    sent = endpoint.take()
    assert [(l, m.kind, m.epoch) for l, m in sent] == [(l, Kind.PARAMS, 1) for l in range(4)]
    assert server.core.rules.counts.dropped["epoch_end"] == 2 and server.core.epoch == 1
    push(server, 2, 0)  # computed before the epoch ended
    assert server.core.rules.counts.dropped["flushed"] == 1


def test_max_updates_stops_everyone_and_late_pushes_count_as_in_flight():
    server, endpoint = make_server("async", max_updates=2)
    push(server, 0, 0)
    push(server, 1, 0)
    assert [(l, m.kind) for l, m in endpoint.take()][-4:] == [(l, Kind.STOP) for l in range(4)]
    push(server, 2, 0)
    stats = server.core.rules.stats()
    assert stats["updates"] == 2 and stats["gradients_in_flight_at_stop"] == 1
    assert stats["gradients_received"] == 3 == stats["gradients_applied"] + stats["gradients_in_flight_at_stop"]


def test_first_goodbye_stops_the_server_loop_after_all_leave():
    server, endpoint = make_server("k_sync", k=2)
    server._thread = threading.Thread(target=server._run)
    server._thread.start()
    for learner in range(4):
        server.events.put(Message(Kind.BYE, learner))
    assert server.join(5.0)
    assert [m.kind for _, m in endpoint.take()] == [Kind.STOP] * 4


def test_transport_failure_ends_the_loop_with_the_error():
    server, _ = make_server("async")
    server._thread = threading.Thread(target=server._run)
    server._thread.start()
    server.events.put(Message(Kind.FAILED, error="learner 2 went away"))
    assert server.join(5.0) and server.error == "learner 2 went away"


# ---------------------------------------------------------------- learner side
class FakeLearnerEndpoint:
    def __init__(self, rank=1):
        self.rank, self.inbox, self.pushed = rank, queue.Queue(), []
        self.answer = None  # message to answer every push with
        self.round_trip = None  # (wire seconds, server hold seconds): stamp answers like the server

    def push(self, message):
        self.pushed.append(message)
        if self.answer is not None and message.kind == Kind.PUSH:
            answer = replace(self.answer)
            if self.round_trip is not None:
                wire, hold = self.round_trip
                pushes = sum(m.kind == Kind.PUSH for m in self.pushed)
                time.sleep(wire + hold)
                answer.pushes, answer.hold, answer.received_at = pushes, hold, time.monotonic()
            self.inbox.put(answer)

    def join(self, timeout):
        return True


class Delay:
    def __init__(self, seconds):
        self.seconds = seconds

    def sample(self, learner):
        return self.seconds


def make_learner(delay=None):
    module = nn.Linear(2, 1, bias=False)
    module.weight.grad = torch.ones_like(module.weight)
    endpoint = FakeLearnerEndpoint()
    learner = Learner(endpoint, FlatView(list(module.parameters())), delay)
    endpoint.inbox.put(Message(Kind.PARAMS, version=0, payload=torch.zeros(2)))
    learner.wait_for_parameters()
    return learner, endpoint, module


def test_learner_pushes_then_loads_the_answer():
    learner, endpoint, module = make_learner()
    endpoint.answer = Message(Kind.PARAMS, version=5, payload=torch.tensor([1.0, 2.0]))
    learner.step(loss=0.5, samples=4, local_epoch=0)
    (pushed,) = endpoint.pushed
    assert (pushed.kind, pushed.version, pushed.samples, pushed.loss) == (Kind.PUSH, 0, 4, 0.5)
    assert learner.version == 5 and module.weight.tolist() == [[1.0, 2.0]]


def test_a_message_during_computation_cancels_the_push():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(Message(Kind.PARAMS, version=3, payload=torch.ones(2)))
    learner.step(loss=0.5, samples=4, local_epoch=0)
    assert endpoint.pushed == [] and learner.cancelled == 1 and learner.version == 3


def test_a_cancellation_interrupts_the_injected_delay_promptly():
    learner, endpoint, _ = make_learner(delay=Delay(5.0))
    threading.Timer(0.1, endpoint.inbox.put, [Message(Kind.PARAMS, version=1, payload=torch.ones(2))]).start()
    start = time.monotonic()
    learner.step(loss=0.5, samples=4, local_epoch=0)
    assert time.monotonic() - start < 2.0 and endpoint.pushed == [] and learner.cancelled == 1
    assert learner.delays == [5.0]  # the draw is recorded even though it was cut short


def test_a_k_batch_sync_learner_pushes_without_waiting_for_an_answer():
    learner, endpoint, _ = make_learner()
    learner.waits_for_answer = False
    learner.step(loss=0.5, samples=4, local_epoch=0)
    learner.step(loss=0.4, samples=4, local_epoch=0)  # would block forever if it waited
    assert [m.version for m in endpoint.pushed] == [0, 0] and learner.cancelled == 0


def test_a_total_delay_counts_the_time_already_spent_on_the_mini_batch():
    learner, endpoint, _ = make_learner(delay=Delay(0.6))
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    learner.clock.total = True
    learner.clock._start = time.monotonic() - 0.5  # the computation took 0.5 s of the 0.6 s
    start = time.monotonic()
    learner.step(loss=0.5, samples=4, local_epoch=0)
    assert time.monotonic() - start < 0.4 and learner.delays == [0.6]
    learner.clock.total = False  # added after the computation: the whole 0.6 s
    start = time.monotonic()
    learner.step(loss=0.5, samples=4, local_epoch=0)
    assert time.monotonic() - start >= 0.6


def test_the_learner_measures_its_message_latency_without_the_servers_hold():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    endpoint.round_trip = (0.004, 0.030)  # 4 ms on the wire, 30 ms waiting at the server
    for _ in range(3):
        learner.step(loss=0.5, samples=4, local_epoch=0)
    assert learner.clock.latency.mean == pytest.approx(0.004, abs=0.002)
    endpoint.inbox.put(Message(Kind.PARAMS, version=1, payload=torch.ones(2), pushes=3, hold=0.0,
                               received_at=time.monotonic() + 5.0))
    learner.step(loss=0.5, samples=4, local_epoch=0)  # a second message for push 3: not a sample
    assert learner.clock.latency.mean == pytest.approx(0.004, abs=0.002)


def test_a_total_delay_also_covers_the_measured_message_latency():
    learner, endpoint, _ = make_learner(delay=Delay(0.5))
    learner.clock.total = True
    learner.clock.latency.observe(0.3)  # the downlink that started this mini-batch and the uplink
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    learner.step(loss=0.5, samples=4, local_epoch=0)  # started on w_0: no message ahead of it
    start = time.monotonic()
    learner.step(loss=0.5, samples=4, local_epoch=0)  # started on the answer to the first push
    assert 0.15 <= time.monotonic() - start < 0.4
    # The server took 0.1 s to send the message that starts the next mini-batch: that counts too.
    endpoint.answer = Message(Kind.CONTINUE, version=0, age=0.1)
    learner.step(loss=0.5, samples=4, local_epoch=0)
    start = time.monotonic()
    learner.step(loss=0.5, samples=4, local_epoch=0)
    assert 0.05 <= time.monotonic() - start < 0.3  # 0.5 - 0.3 (round trip) - 0.1 (age)
    # A K-batch-sync learner goes on right after its own push: no downlink started its next
    # mini-batch, and its uplinks cancel out between consecutive pushes, so nothing is taken off.
    learner.waits_for_answer, endpoint.answer = False, None
    learner.step(loss=0.5, samples=4, local_epoch=0)
    start = time.monotonic()
    learner.step(loss=0.5, samples=4, local_epoch=0)
    assert time.monotonic() - start >= 0.45


def test_after_the_epoch_ended_nothing_is_pushed():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(Message(Kind.PARAMS, version=1, epoch=1, payload=torch.ones(2)))
    learner.step(loss=0.5, samples=4, local_epoch=0)  # interrupted by the epoch end
    assert learner.epoch_over(0) and not learner.epoch_over(1)
    learner.step(loss=0.5, samples=4, local_epoch=0)  # the prefetched last batch of the epoch
    assert endpoint.pushed == [] and learner.cancelled == 2


def test_learner_fails_loudly_when_the_transport_breaks():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.FAILED, error="receiving from the server failed: reset")
    with pytest.raises(ServerFailed, match="reset"):
        learner.step(loss=0.5, samples=4, local_epoch=0)


def test_close_says_goodbye_with_the_delays_and_waits_for_stop():
    learner, endpoint, _ = make_learner(delay=Delay(0.0))
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    learner.step(loss=0.5, samples=4, local_epoch=0)
    endpoint.inbox.put(Message(Kind.STOP, version=0, payload=torch.zeros(2)))
    learner.close(timeout=5.0)
    bye = endpoint.pushed[-1]
    assert bye.kind == Kind.BYE and bye.payload.tolist() == [0.0] and learner.stopped
    assert bye.cancelled == learner.cancelled == 0


def test_close_gives_up_with_an_error_instead_of_hanging():
    learner, _, _ = make_learner()
    with pytest.raises(ServerFailed, match="no stop from the server within 0.2 s"):
        learner.close(timeout=0.2)


# ---------------------------------------------------------------- framing
def test_a_small_message_travels_as_one_frame_that_keeps_every_field():
    message = Message(Kind.PUSH, learner=3, version=12345, epoch=7, samples=64, loss=0.123456789,
                      payload=torch.arange(5, dtype=torch.float64), pushes=9, hold=0.25, age=0.125)
    frame, separate = encode(message)
    assert separate is None and frame.numel() == HEADER_BYTES + 5 * 8
    received = torch.full((FRAME_BYTES,), 255, dtype=torch.uint8)  # gloo fills only the start
    received[:frame.numel()] = frame
    decoded, numel, dtype, inline = decode(received, "learner 3", 100)
    assert (decoded.kind, decoded.learner, decoded.version, decoded.epoch, decoded.samples) == (Kind.PUSH, 3, 12345, 7, 64)
    assert decoded.loss == 0.123456789 and (decoded.pushes, decoded.hold, decoded.age) == (9, 0.25, 0.125)
    assert (numel, dtype, inline) == (5, torch.float64, True)
    assert decoded.payload.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    received.zero_()  # the receive buffer is reused: the payload must not share it
    assert decoded.payload.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_large_payload_follows_its_header_without_a_copy():
    payload = torch.zeros(INLINE_PAYLOAD_BYTES // 4 + 1)
    frame, separate = encode(Message(Kind.PARAMS, version=2, payload=payload))
    assert frame.numel() == HEADER_BYTES and separate.data_ptr() == payload.data_ptr()
    decoded, numel, dtype, inline = decode(frame, "the server", payload.numel())
    assert (numel, dtype, inline) == (payload.numel(), torch.float32, False) and decoded.payload is None


def test_the_server_endpoint_stamps_pushes_received_and_time_held():
    inbox, delivered = queue.Queue(), []
    endpoint = ServerEndpoint(None, 1, delivered.append, inbox, numel=2)  # P = 1: no threads, no gloo
    endpoint.send(0, Message(Kind.PARAMS, version=0))
    assert inbox.get_nowait().pushes == 0
    endpoint.receive_local(Message(Kind.PUSH, learner=0, version=0))
    time.sleep(0.05)
    endpoint.send(0, Message(Kind.PARAMS, version=1, caused_at=time.monotonic() - 0.02))
    answer = inbox.get_nowait()
    assert delivered[0].kind == Kind.PUSH and answer.pushes == 1 and 0.05 <= answer.hold < 1.0
    assert 0.02 <= answer.age < answer.hold  # the server's own time since the deciding push


def test_coalesce_keeps_the_newest_parameters_and_epoch():
    p1 = Message(Kind.PARAMS, version=1, epoch=0, payload=torch.zeros(1))
    p2 = Message(Kind.PARAMS, version=2, epoch=0, payload=torch.ones(1))
    cont = Message(Kind.CONTINUE, version=2, epoch=1)
    merged = coalesce([p1, p2, cont])
    assert (merged.kind, merged.version, merged.epoch, merged.payload.item()) == (Kind.PARAMS, 2, 1, 1.0)
    stop = Message(Kind.STOP, version=3, epoch=1, payload=torch.full((1,), 3.0))
    assert coalesce([p1, stop]) is stop


@pytest.mark.parametrize("corrupt,match", [
    (lambda f: f[:10], "shorter than a header"),
    (lambda f: torch.cat([torch.zeros(8, dtype=torch.uint8), f[8:]]), "not a lightning_stale message"),
    (lambda f: _with_field(f, 1, 99), "protocol version 99"),
    (lambda f: _with_field(f, 2, 42), "unknown kind 42"),
    (lambda f: _with_field(f, 9, 10**9), "announced a payload of 1000000000 values"),
    (lambda f: _with_field(f, 10, 17), "unknown dtype code 17"),
])
def test_a_frame_that_does_not_parse_is_refused_naming_the_sender(corrupt, match):
    frame, _ = encode(Message(Kind.PUSH, version=1, payload=torch.ones(3)))
    with pytest.raises(TransportError, match=match) as error:
        decode(corrupt(frame.clone()), "learner 2", 100)
    assert "learner 2" in str(error.value)


def _with_field(frame, index, value):
    """The frame with its header's int64 field number ``index`` set to ``value``."""
    frame[index * 8:(index + 1) * 8] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
    return frame
