"""Device channels (`engine.distributed.channels`): what a send leaves to the caching allocator,
and the first exchange over every channel before training, driven in-process with a stand-in
for torch.distributed. Real channels run in the multi-process tests (gloo groups on CPU)."""

import contextlib
import datetime
import threading

import pytest
import torch

from lightning_stale.engine.distributed import channels as channels_module
from lightning_stale.engine.distributed.channels import Channel, close_channels, open_channels
from lightning_stale.engine.distributed.paths.registry import channel_pairs


def test_a_sent_payload_is_held_for_the_channels_stream_after_its_send(monkeypatch):
    calls = []
    monkeypatch.setattr(channels_module.dist, "send", lambda t, dst, group: calls.append(("send", t, dst)))
    monkeypatch.setattr(channels_module.streams, "hold", lambda t, stream: calls.append(("hold", t, stream)))
    monkeypatch.setattr(channels_module.streams, "on", lambda stream: contextlib.nullcontext())
    channel = Channel(group="group", src=0, dst=1, device=torch.device("cpu"))
    channel.stream = "channel stream"  # (None on the CPU)
    payload = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: a contiguous copy is sent
    channel.send(payload, ready=None)
    (send, sent, dst), hold = calls
    assert send == "send" and dst == 1 and sent.is_contiguous() and torch.equal(sent, payload)
    assert hold == ("hold", sent, "channel stream")  # the tensor the send read, after the send
    assert channel.carried == 1


def test_a_send_waits_for_its_payload_on_its_channels_device(monkeypatch):
    """A sending thread starts on GPU 0: the wait for the payload's event (a CUDA call) comes
    after the channel has set its own device and stream."""
    calls = []

    @contextlib.contextmanager
    def on(stream):
        calls.append(("enter", stream))
        yield
        calls.append(("leave", stream))

    class Ready:
        def synchronize(self):
            calls.append(("synchronize",))

    monkeypatch.setattr(channels_module.streams, "on", on)
    monkeypatch.setattr(channels_module.dist, "send", lambda t, dst, group: calls.append(("send",)))
    channel = Channel(group="group", src=0, dst=1, device=torch.device("cpu"))
    channel.stream = "channel stream"
    channel.send(torch.ones(3), Ready())
    assert calls[:4] == [("enter", "channel stream"), ("synchronize",), ("send",), ("leave", "channel stream")]


class FakeNCCLOptions:
    is_high_priority_stream = False


def test_nccl_channel_groups_ask_for_the_most_urgent_stream_level(monkeypatch):
    """A group's stream comes from PyTorch's pools: the channels' from the level neither the
    default group nor the engine's own streams use (`engine.streams`)."""
    fake = Rendezvous(2)
    monkeypatch.setattr(channels_module.dist, "new_group", fake.new_group)
    monkeypatch.setattr(channels_module.dist, "ProcessGroupNCCL",
                        type("FakeProcessGroupNCCL", (), {"Options": FakeNCCLOptions}), raising=False)
    monkeypatch.setattr(channels_module, "_first_exchange", lambda *args: None)
    timeout = datetime.timedelta(seconds=5)
    open_channels(0, [(0, 1)], "nccl", torch.device("cpu"), timeout)
    assert isinstance(fake.options, FakeNCCLOptions) and fake.options.is_high_priority_stream
    assert fake.options._timeout == timeout  # (the group's own: new_group warns of another)
    open_channels(0, [(0, 1)], "gloo", torch.device("cpu"), timeout)
    assert fake.options is None


def test_a_clean_end_destroys_each_channels_group_once_and_keeps_its_count(monkeypatch):
    destroyed = []
    monkeypatch.setattr(channels_module.dist, "destroy_process_group", destroyed.append)
    ends = {(0, 1): Channel("up", 0, 1, torch.device("cpu")), (1, 0): Channel("down", 1, 0, torch.device("cpu"))}
    ends[(0, 1)].carried = 4
    close_channels(ends)
    close_channels(ends)  # (a second teardown destroys nothing)
    assert destroyed == ["up", "down"]
    assert channels_module.carried(ends) == 4  # the run's stats still read them


class Done:
    """A finished operation's work."""

    def wait(self, timeout=None):
        return True


class Rendezvous:
    """Stands in for torch.distributed across ``world`` ranks run as threads: a send waits until
    its receiver posts the matching receive (as NCCL's first operation on a group waits for both
    ranks to create the communicator), and groups are the ranks they were made with."""

    def __init__(self, world: int, timeout: float = 5.0) -> None:
        self.world, self.timeout = world, timeout
        self.lock, self.posted = threading.Condition(), {}
        self.log: list[tuple[int, int, float]] = []

    def new_group(self, ranks, backend, timeout, pg_options=None):
        self.options = pg_options
        return tuple(ranks)

    def send(self, tensor, dst, group):
        src = threading.current_thread().rank
        assert set(group) == {src, dst}
        with self.lock:
            if not self.lock.wait_for(lambda: (src, dst) in self.posted, timeout=self.timeout):
                raise TimeoutError(f"rank {src}'s first send to {dst} found no receive")
            self.posted.pop((src, dst)).copy_(tensor)
            self.log.append((src, dst, tensor.clone()))
            self.lock.notify_all()

    def isend(self, tensor, dst, group):  # (posted at once by torch; here it waits, as the wait would)
        self.send(tensor, dst, group)
        return Done()

    def irecv(self, tensor, src, group):
        self.recv(tensor, src, group)
        return Done()

    def recv(self, tensor, src, group):
        dst = threading.current_thread().rank
        assert set(group) == {src, dst}
        with self.lock:
            self.posted[(src, dst)] = tensor
            self.lock.notify_all()
            if not self.lock.wait_for(lambda: (src, dst) not in self.posted, timeout=self.timeout):
                raise TimeoutError(f"rank {dst}'s first receive from {src} found no send")


@pytest.mark.parametrize("path,world", [("central", 4), ("sharded", 4), ("sharded", 3)])
def test_every_channel_carries_one_value_before_training_with_no_rank_left_waiting(monkeypatch, path, world):
    fake = Rendezvous(world)
    for name in ("new_group", "isend", "irecv"):
        monkeypatch.setattr(channels_module.dist, name, getattr(fake, name))
    pairs, opened, errors = channel_pairs(path, world), {}, []

    def rank_main(rank):
        threading.current_thread().rank = rank
        try:
            opened[rank] = open_channels(rank, pairs, "gloo", torch.device("cpu"), datetime.timedelta(seconds=5),
                                         first_numel=5)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20.0)
    assert not errors and all(not thread.is_alive() for thread in threads)
    assert sorted((src, dst) for src, dst, _ in fake.log) == sorted(pairs)  # each direction once
    assert all(torch.equal(value, torch.ones(5)) for _, _, value in fake.log)  # a payload's size, not one value
    for rank, held in opened.items():
        assert set(held) == {pair for pair in pairs if rank in pair}
        assert all(channel.carried == 0 for channel in held.values())  # not counted as payloads


def test_a_rank_that_meets_its_channels_in_another_order_is_caught_by_the_stand_in(monkeypatch):
    """The stand-in above can fail: two ranks that each send first wait for each other."""
    fake = Rendezvous(2, timeout=0.3)
    monkeypatch.setattr(channels_module.dist, "send", fake.send)
    errors = []

    def rank_main(rank):
        threading.current_thread().rank = rank
        try:
            fake.send(torch.ones(1), dst=1 - rank, group=(0, 1))
        except TimeoutError as error:
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20.0)
    assert len(errors) == 2


def test_a_channel_whose_peer_never_comes_fails_set_up_within_the_strategys_timeout(monkeypatch):
    """The channels' groups wait long (a frozen learner is a straggler), but their first
    exchange, before training, is bounded like the rest of set-up."""
    waited = []

    class Never:
        def wait(self, timeout=None):
            waited.append(timeout)
            return False  # (gloo and NCCL raise instead: either way set-up ends)

    monkeypatch.setattr(channels_module.dist, "new_group", lambda ranks, backend, timeout, pg_options=None: tuple(ranks))
    monkeypatch.setattr(channels_module.dist, "isend", lambda tensor, dst, group: Never())
    limit = datetime.timedelta(seconds=7)
    with pytest.raises(TimeoutError, match=r"rank 0: the device channel 0 -> 1 was not set up within 0:00:07"):
        open_channels(0, [(0, 1), (1, 0)], "gloo", torch.device("cpu"), datetime.timedelta(days=7),
                      setup_timeout=limit)
    assert waited == [limit]
