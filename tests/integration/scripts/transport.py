"""Two processes, no Lightning: the server and learner endpoints over a real gloo group.

Learner 1 pushes a small gradient (one frame), a large one (header, then payload) and says
goodbye; the server answers with small parameters, then stop with large ones (written straight
into the learner's slot, where it has lanes). The exchange runs
twice: over gloo alone, then with shared-memory lanes (large payloads in ``/dev/shm``). Rank 0
writes what both sides received in each to ``<out>`` (JSON, by transport).
"""

import json
import os
import queue
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.lanes import open_lanes, slot_bytes_for
from lightning_stale.engine.distributed.transport import INLINE_PAYLOAD_BYTES, LearnerEndpoint, ServerEndpoint

SMALL = torch.arange(10, dtype=torch.float32)
LARGE = torch.arange(INLINE_PAYLOAD_BYTES // 4 + 100, dtype=torch.float32)  # just over the frame
HOLD = 0.2  # seconds the server waits between the learner's second push and its answer


def describe(m: Message) -> dict:
    numel = 0 if m.payload is None else m.payload.numel()
    expected = {SMALL.numel(): SMALL, LARGE.numel(): LARGE}.get(numel)
    return {"kind": int(m.kind), "learner": m.learner, "version": m.version, "samples": m.samples,
            "cancelled": m.cancelled,
            "loss": m.loss, "pushes": m.pushes, "hold": m.hold, "age": m.age, "numel": numel,
            "payload_ok": expected is not None and torch.equal(m.payload, expected),
            "payload": m.payload.tolist() if 0 < numel <= 10 else None}


def server(group, out: str, lanes: dict) -> None:
    events: queue.Queue = queue.Queue()
    endpoint = ServerEndpoint(group, 2, events.put, queue.Queue(), max_numel=LARGE.numel(), lanes=lanes)
    received = [events.get(timeout=60), events.get(timeout=60)]  # two pushes
    time.sleep(HOLD)  # the answer is caused by the first push: its age covers the hold and more
    endpoint.send(1, Message(Kind.PARAMS, version=1, payload=SMALL.clone(), caused_at=received[0].received_at))
    received.append(events.get(timeout=60))  # goodbye
    # The stop's parameters written straight into the learner's next slot where it has a lane.
    place = endpoint.place_for(1, LARGE.numel(), torch.float32)
    payload = LARGE.clone() if place is None else place.copy_(LARGE)
    endpoint.send(1, Message(Kind.STOP, version=2, payload=payload))
    left = endpoint.join(30.0)
    return {"received": [describe(m) for m in received], "threads_left": left, "placed": place is not None}


def learner(group, out: str, lanes: dict) -> None:
    endpoint = LearnerEndpoint(1, group, max_numel=LARGE.numel(), lanes=lanes.get(0))
    endpoint.push(Message(Kind.PUSH, version=0, samples=8, loss=0.5, payload=SMALL.clone()))
    # (stamped before the push: the server may stamp its arrival before the send returns here)
    sent = time.monotonic()
    endpoint.push(Message(Kind.PUSH, version=0, samples=9, loss=0.25, payload=LARGE.clone()))
    first = endpoint.inbox.get(timeout=60)
    round_trip = first.received_at - sent
    inbox = [first]
    endpoint.push(Message(Kind.BYE, version=1, cancelled=3, payload=torch.tensor([0.1, 0.2], dtype=torch.float64)))
    inbox.append(endpoint.inbox.get(timeout=60))
    with open(out + ".learner", "w") as f:
        json.dump({"inbox": [describe(m) for m in inbox], "round_trip": round_trip,
                   "thread_done": endpoint.join(30.0)}, f)


def main(rank: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("TEST_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    results = {}
    for transport in ("gloo", "lanes"):
        lanes, flags = {}, None
        if transport == "lanes":
            lanes = open_lanes(group, rank, slot_bytes_for(LARGE.numel(), torch.float32))
            flags = [peer in lanes for peer in range(2)] if rank == 0 else None  # who has lanes
        if rank == 0:
            results[transport] = server(group, out, lanes)
        else:
            learner(group, out, lanes)
        dist.barrier()
        if rank == 0:
            with open(out + ".learner") as f:
                results[transport].update(json.load(f))
            # payloads through each lane (int64 counters after the token): the large push, the stop
            results[transport]["lanes"] = flags
            results[transport]["through_lanes"] = [int(lane.control[1]) for lane in lanes.get(1, ())]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
