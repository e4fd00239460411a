"""Shared-memory lanes (`engine.distributed.lanes`), driven in one process: both ends of a lane
are mappings of the same file, as they are in two processes of one host."""

import os
import threading
import time

import pytest
import torch

from lightning_stale.engine.distributed.lanes import SLOTS, LaneClosed, LaneFile, slot_bytes_for
from lightning_stale.engine.distributed.messages import IN_LANE, Kind, Message, TransportError
from lightning_stale.engine.distributed.frames import decode, encode
from thread_ranks import ThreadRanks


def open_pair(tmp_path, numel=1000, dtype=torch.float32):
    """The learner's file and the server's mapping of it."""
    slot = slot_bytes_for(numel, dtype)
    made, token = LaneFile.create(str(tmp_path), slot)
    mapped = LaneFile.open(made.path, token, slot)
    assert mapped is not None
    return made, mapped


def never():
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_payloads_cross_in_order_through_every_slot(tmp_path, dtype):
    learner, server = open_pair(tmp_path, 1000, dtype)
    for i in range(3 * SLOTS):  # round the slots three times, each message read before the next
        sent = (torch.arange(1000) % 200 + i).to(dtype)
        learner.up.write(sent, never)
        received = server.up.read(1000, dtype)
        assert received.dtype == dtype and torch.equal(received, sent)
    # and the other way, with payloads shorter than a slot
    server.down.write(torch.ones(7, dtype=dtype), never)
    assert torch.equal(learner.down.read(7, dtype), torch.ones(7, dtype=dtype))


def test_a_read_payload_is_a_copy_the_next_write_cannot_change(tmp_path):
    learner, server = open_pair(tmp_path)
    first = torch.full((1000,), 1.0)
    learner.up.write(first, never)
    got = server.up.read(1000, torch.float32)
    for value in range(2, 2 + SLOTS):
        learner.up.write(torch.full((1000,), float(value)), never)
    assert torch.equal(got, first)


def test_the_writer_waits_for_a_free_slot_and_gives_up_when_the_peer_is_gone(tmp_path):
    learner, server = open_pair(tmp_path)
    for i in range(SLOTS):  # every slot written, none read
        learner.up.write(torch.full((1000,), float(i)), never)
    done = threading.Event()

    def third():
        learner.up.write(torch.full((1000,), 9.0), never)
        done.set()

    writer = threading.Thread(target=third, daemon=True)
    writer.start()
    time.sleep(0.2)
    assert not done.is_set()  # it would overwrite payload 0, which was not read
    assert torch.equal(server.up.read(1000, torch.float32), torch.zeros(1000))
    assert done.wait(5)
    assert [float(server.up.read(1000, torch.float32)[0]) for _ in range(2)] == [1.0, 9.0]
    for _ in range(SLOTS):
        learner.up.write(torch.zeros(1000), never)
    with pytest.raises(LaneClosed, match="the server died") as closed:
        learner.up.write(torch.zeros(1000), lambda: "the server died")
    assert isinstance(closed.value, TransportError)  # as a broken gloo connection would be


def test_a_read_without_a_payload_written_or_larger_than_a_slot_is_an_error(tmp_path):
    learner, server = open_pair(tmp_path)
    with pytest.raises(RuntimeError, match="holds 0 payloads"):
        server.up.read(10, torch.float32)
    learner.up.write(torch.zeros(10), never)
    with pytest.raises(RuntimeError, match="of at most 4032 bytes"):
        server.up.read(5000, torch.float32)


def test_only_a_process_that_reads_the_token_maps_the_file(tmp_path):
    slot = slot_bytes_for(1000, torch.float32)
    made, token = LaneFile.create(str(tmp_path), slot)
    assert LaneFile.open(made.path, token + 1, slot) is None  # another host's file of that name
    assert LaneFile.open(made.path, token, slot + 64) is None  # another model's size
    assert LaneFile.open(str(tmp_path / "missing"), token, slot) is None
    made.unlink()
    assert os.listdir(tmp_path) == [] and LaneFile.open(made.path, token, slot) is None
    made.up.write(torch.ones(3), never)  # the mapping outlives the name
    assert torch.equal(made.up.read(3, torch.float32), torch.ones(3))


def test_no_space_for_the_file_is_an_oserror_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        LaneFile.create(str(tmp_path), 4096)
    assert os.listdir(tmp_path) == []


def test_a_large_payload_that_fits_goes_through_the_lane_and_one_that_does_not_over_gloo(tmp_path):
    learner, server = open_pair(tmp_path, 100_000)
    big = torch.randn(100_000)
    frame, after = encode(Message(Kind.PUSH, 1, version=4, payload=big), learner.up)
    message, numel, dtype, where = decode(frame, "learner 1", 200_000)
    assert after is None and (numel, dtype, where) == (100_000, torch.float32, IN_LANE)
    assert message.version == 4 and torch.equal(server.up.read(numel, dtype), big)
    too_big = torch.randn(100_001)
    frame, after = encode(Message(Kind.PUSH, 1, payload=too_big), learner.up)
    assert torch.equal(after, too_big) and decode(frame, "learner 1", 200_000)[3] == 0
    small = torch.randn(10)  # inside the frame, as without a lane
    frame, after = encode(Message(Kind.PUSH, 1, payload=small), learner.up)
    assert after is None and decode(frame, "learner 1", 200_000)[3] == 1
    assert int(learner.up.control[1]) == 1  # the lane carried only the first


def test_a_payload_packed_in_the_next_slot_is_sent_from_there_and_work_thrown_away_leaves_nothing(tmp_path):
    n = 100_000  # 400 KB: over a frame's inline payload
    learner, server = open_pair(tmp_path, n)
    thrown = learner.up.reserve(4 * n, never).view(torch.float32)
    thrown.fill_(7.0)  # a push packed, then cancelled before it left: never written
    packed = learner.up.reserve(4 * n, never).view(torch.float32)
    assert packed.data_ptr() == thrown.data_ptr()  # still the next slot
    packed.copy_(torch.arange(float(n)))

    def copying(closed):  # only a payload from elsewhere waits for its slot, to be copied there
        raise AssertionError("a payload packed in its slot was copied")

    learner.up._wait_free, wait_free = copying, learner.up._wait_free
    frame, after = encode(Message(Kind.PUSH, 1, payload=packed), learner.up)
    learner.up._wait_free = wait_free
    assert after is None and int(learner.up.control[1]) == 1
    assert torch.equal(server.up.read(n, torch.float32), torch.arange(float(n)))
    learner.up.write(torch.ones(n), never)  # a payload from elsewhere is copied in
    assert torch.equal(server.up.read(n, torch.float32), torch.ones(n))


def test_a_central_learner_packs_its_push_into_the_lane(tmp_path):
    from lightning_stale.engine.distributed.paths.central.path import CentralExchange
    from lightning_stale.engine.state import ModelVectors

    learner, server = open_pair(tmp_path, 1000)
    layer = torch.nn.Linear(20, 30)
    vectors = ModelVectors.of(layer)
    slots = []

    def buffer(numel, dtype):
        slots.append(numel)
        return learner.up.reserve(numel * dtype.itemsize, never).view(dtype)

    exchange = CentralExchange(vectors, buffer)
    layer(torch.randn(4, 20)).sum().backward()
    message = Message(Kind.PUSH, 1)
    exchange.fill_push(message)
    assert slots == [vectors.state_numel] and not message.flags  # every gradient there: no mask
    expected = torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad])
    assert torch.equal(message.payload, expected)
    learner.up.write(message.payload, never)
    assert torch.equal(server.up.read(vectors.state_numel, torch.float32), expected)
    layer.bias.grad = None  # a missing gradient: the presence mask follows, in the same slot
    exchange.fill_push(message := Message(Kind.PUSH, 1))
    assert slots[-1] == vectors.state_numel + 2 and message.flags
    assert message.payload.numel() == slots[-1] and message.payload[-2:].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("all_or_none", [False, True])
@pytest.mark.parametrize("without", [None, 2])
def test_lanes_open_for_every_learner_that_can_have_them_or_with_all_or_none_for_all_or_none(
        tmp_path, monkeypatch, all_or_none, without):
    from lightning_stale.engine.distributed import lanes as lanes_module

    ranks = ThreadRanks(3)
    monkeypatch.setattr(lanes_module, "dist", ranks)
    slot = slot_bytes_for(1000, torch.float32)
    got = ranks.run(lambda rank: lanes_module.open_lanes(None, rank, slot, enabled=rank != without,
                                                         directory=str(tmp_path), all_or_none=all_or_none))
    sharing = [1, 2] if without is None else [1]
    if all_or_none and without is not None:
        sharing = []  # learner 2 has no shared memory, so nobody uses it: every rank knows the same
    assert sorted(got[0]) == sharing
    assert [sorted(got[r]) for r in (1, 2)] == [[0] if r in sharing else [] for r in (1, 2)]
    for r in sharing:  # each learner's lane to the server and back joins the right pair
        got[r][0][0].write(torch.full((5,), float(r)), never)
        assert torch.equal(got[0][r][1].read(5, torch.float32), torch.full((5,), float(r)))
        got[0][r][0].write(torch.full((3,), -float(r)), never)
        assert torch.equal(got[r][0][1].read(3, torch.float32), torch.full((3,), -float(r)))
    assert os.listdir(tmp_path) == []  # nothing left behind either way


class Loopback:
    """Point-to-point sends between the threads of one process, for endpoints of two ranks: what
    is sent to a rank waits in a queue per (rank, tag) until that rank receives it."""

    def __init__(self):
        self.queues = {}

    def _queue(self, rank, tag):
        import queue

        return self.queues.setdefault((rank, tag), queue.Queue())

    def send(self, tensor, dst, group=None, tag=0):
        self._queue(dst, tag).put(tensor.clone())

    def recv(self, tensor, src, group=None, tag=0):
        got = self._queue(1 - src, tag).get()
        tensor[:got.numel()].copy_(got)


def test_the_server_writes_an_answer_straight_into_a_free_slot_and_never_waits_for_one(tmp_path, monkeypatch):
    """`ServerEndpoint.place_for`: the learner's next slot while it is free and the learner's
    sender has nothing queued (else None at once), sent from there with no copy."""
    from lightning_stale.engine.distributed import frames
    from lightning_stale.engine.distributed.transport import DOWN, UP, ServerEndpoint

    n = 100_000  # over a frame's inline payload
    learner, server = open_pair(tmp_path, n)
    wire = Loopback()
    monkeypatch.setattr(frames, "dist", wire)
    endpoint = ServerEndpoint(None, 2, lambda message: None, None, n, lanes={1: (server.down, server.up)})
    lane = server.down
    copied = threading.Event()  # a payload from elsewhere is copied into its slot, after a wait
    wait_free = lane._wait_free
    lane._wait_free = lambda closed: (copied.set(), wait_free(closed))

    def sent(count):  # the sender has handled every message so far
        deadline = time.monotonic() + 10
        while wire._queue(1, DOWN).qsize() < count or endpoint._outboxes[1].unfinished_tasks:
            assert time.monotonic() < deadline
            time.sleep(0.001)

    assert endpoint.place_for(1, 10, torch.float32) is None  # travels inside its frame
    assert endpoint.place_for(0, n, torch.float32) is None  # rank 0's learner: a queue, no lane
    for i in range(SLOTS):  # the learner reads nothing yet
        place = endpoint.place_for(1, n, torch.float32)
        assert place is not None and place.data_ptr() == lane._slots[i].data_ptr()
        place.copy_(torch.full((n,), float(i)))
        endpoint.send(1, Message(Kind.PARAMS, 1, version=i, payload=place))
        sent(i + 1)
    assert not copied.is_set() and int(lane.control[1]) == SLOTS
    assert endpoint.place_for(1, n, torch.float32) is None  # slot 0 unread: no wait, no place
    assert torch.equal(learner.down.read(n, torch.float32), torch.zeros(n))
    place = endpoint.place_for(1, n, torch.float32)
    assert place is not None and place.data_ptr() == lane._slots[0].data_ptr()

    # A message queued before is sent first, into that slot: nothing may be placed until it left.
    hold = threading.Event()
    lane._wait_free = lambda closed: (copied.set(), hold.wait(10), wait_free(closed))
    endpoint.send(1, Message(Kind.PARAMS, 1, version=5, payload=torch.full((n,), 5.0)))
    assert copied.wait(10)
    assert endpoint.place_for(1, n, torch.float32) is None  # (the slot is free, the sender busy)
    hold.set()
    sent(SLOTS + 1)
    assert endpoint.place_for(1, n, torch.float32) is None  # slot 1 unread
    assert [float(learner.down.read(n, torch.float32)[0]) for _ in range(2)] == [1.0, 5.0]
    assert endpoint.place_for(1, n, torch.float32).data_ptr() == lane._slots[1].data_ptr()
    wire.send(encode(Message(Kind.BYE, 1))[0], dst=0, tag=UP)  # ends the receiving thread
    endpoint.send(1, Message(Kind.STOP, 1))  # ends the sending thread
    assert endpoint.join(10) == []


def test_a_lent_payload_is_read_in_its_slot_and_frees_it_once_used_kept_or_released(tmp_path):
    """`Lane.lend`: the payload stays in its slot (no copy) and holds it until used; the reader
    copies it out when it takes the next payload, so the writer never waits on it for long."""
    n = 1000
    learner, server = open_pair(tmp_path, n)
    lane = learner.down
    server.down.write(torch.full((n,), 1.0), never)
    first = Message(Kind.PARAMS, 1)
    lane.lend(first, n, torch.float32)
    assert first.payload.data_ptr() == lane._slots[0].data_ptr()  # in place: no copy
    assert int(lane.control[2]) == 0  # and its slot still held
    loaded = torch.zeros(n)
    first.lent.use(loaded.copy_)
    assert torch.equal(loaded, torch.full((n,), 1.0)) and int(lane.control[2]) == 1
    first.lent.use(loaded.copy_)  # (a second use gives nothing back twice)
    assert int(lane.control[2]) == 1

    # One left unused (deferred over a pause) is copied out when the next one is taken.
    server.down.write(torch.full((n,), 2.0), never)
    second = Message(Kind.PARAMS, 1)
    lane.lend(second, n, torch.float32)
    server.down.write(torch.full((n,), 3.0), never)
    assert torch.equal(lane.read(n, torch.float32), torch.full((n,), 3.0))
    assert second.payload.data_ptr() != lane._slots[1].data_ptr() and int(lane.control[2]) == 3
    server.down.write(torch.full((n,), 9.0), never)  # into the slot the second one had
    second.lent.use(loaded.copy_)
    assert torch.equal(loaded, torch.full((n,), 2.0))

    # Parameters the learner holds already are released: the slot is free, nothing points there.
    third = Message(Kind.PARAMS, 1)
    lane.lend(third, n, torch.float32)
    third.lent.release()
    assert third.payload is None and int(lane.control[2]) == 4
    with pytest.raises(RuntimeError, match="given back twice"):
        lane.give_back()


def test_a_lent_payload_is_never_copied_out_while_it_is_being_loaded(tmp_path):
    """The receiving thread's copy (`keep`) waits for a load in progress, and then has nothing
    to do: the load freed the slot."""
    n = 1000
    learner, server = open_pair(tmp_path, n)
    server.down.write(torch.full((n,), 1.0), never)
    message = Message(Kind.PARAMS, 1)
    learner.down.lend(message, n, torch.float32)
    loading, proceed, kept = threading.Event(), threading.Event(), threading.Event()

    def slow_load(payload):
        loading.set()
        assert proceed.wait(10)
        assert torch.equal(payload, torch.full((n,), 1.0))

    loader = threading.Thread(target=lambda: message.lent.use(slow_load), daemon=True)
    loader.start()
    assert loading.wait(10)
    keeper = threading.Thread(target=lambda: (message.lent.keep(), kept.set()), daemon=True)
    keeper.start()
    assert not kept.wait(0.2)  # waits for the load
    proceed.set()
    assert kept.wait(10)
    loader.join(10)
    assert message.payload.data_ptr() == learner.down._slots[0].data_ptr()  # loaded, not copied
    assert int(learner.down.control[2]) == 1


def test_a_learner_loads_the_servers_parameters_straight_from_its_slot(tmp_path, monkeypatch):
    """`LearnerEndpoint` lends the parameters and the stop (an epoch's parameters, kept for
    validation, are copied out), and `CentralExchange.take` loads them from the slot."""
    from lightning_stale.engine.distributed import frames, transport
    from lightning_stale.engine.distributed.paths.central.path import CentralExchange
    from lightning_stale.engine.distributed.transport import LearnerEndpoint
    from lightning_stale.engine.state import ModelVectors

    layer = torch.nn.Linear(300, 400)  # 120,400 values: over a frame's inline payload
    vectors = ModelVectors.of(layer)
    n = vectors.state_numel
    learner, server = open_pair(tmp_path, n)
    wire = Loopback()
    monkeypatch.setattr(frames, "dist", wire)
    endpoint = LearnerEndpoint(1, None, n, lanes=(learner.up, learner.down))

    def answer(kind, value):
        transport.send(Message(kind, 1, version=int(value), payload=torch.full((n,), value)), 1, None,
                       (transport.DOWN, transport.DOWN_DATA), server.down)
        return endpoint.inbox.get(timeout=10)

    params = answer(Kind.PARAMS, 3.0)
    assert params.lent is not None and params.payload.data_ptr() == learner.down._slots[0].data_ptr()
    CentralExchange(vectors).take(params)
    assert float(layer.weight.detach()[0, 0]) == 3.0 and params.lent.settled
    epoch = answer(Kind.EPOCH, 4.0)
    assert epoch.lent is None and epoch.payload.data_ptr() != learner.down._slots[1].data_ptr()
    stop = answer(Kind.STOP, 5.0)
    assert stop.lent is not None
    CentralExchange(vectors).take(stop)
    assert float(layer.bias.detach()[-1]) == 5.0 and torch.equal(epoch.payload, torch.full((n,), 4.0))
    assert endpoint.join(10)
