"""A shard owner: the trainable tensors cut into P runs at tensor boundaries, rank o's owner
thread holding run o, its optimizer state and schedulers, and following the server's orders: APPLY
an update (each gradient's (learner, seq) and weight), SEND a learner its slice. A dead process
takes its slice with it, so the run stops (docs/concepts/paths.md)."""

from __future__ import annotations

import io
import json
import queue
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_stale.engine import streams
from lightning_stale.engine.distributed.messages import (
    Flag,
    Kind,
    Message,
    Order,
    ShardData,
    payload_text,
    text_payload,
)
from lightning_stale.engine.distributed.paths.sharded.mesh import DataMesh
from lightning_stale.engine.state import ModelVectors, ServerState

WAIT_S = 0.1  # how often a wait for pieces, slices or state looks at the run's failure


class ShardLayout:
    """Which trainable tensors each of the P owners holds: contiguous runs of about N/P values."""

    def __init__(self, sizes: Sequence[int], buffer_numel: int, p: int) -> None:
        self.p, self.buffer_numel = p, buffer_numel
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        total = self.numel = offsets[-1]
        # Each cut at the tensor boundary nearest to o/P of the way (never before the last cut).
        cuts = [0]
        for owner in range(1, p):
            ideal = total * owner / p
            nearest = min(range(cuts[-1], len(sizes) + 1), key=lambda i: abs(offsets[i] - ideal))
            cuts.append(nearest)
        cuts.append(len(sizes))
        self.tensors = [range(cuts[o], cuts[o + 1]) for o in range(p)]
        self.spans = [(offsets[r.start], offsets[r.stop]) for r in self.tensors]  # in the gradients

    def piece(self, push: Tensor, owner: int, masked: bool) -> Tensor:
        """Owner ``owner``'s part of a learner's push vector (gradients | buffers | presence)."""
        a, z = self.spans[owner]
        parts = [push[a:z]]
        if owner == 0 and self.buffer_numel:
            parts.append(push[self.numel:self.numel + self.buffer_numel])
        if masked:
            presence = push[self.numel + self.buffer_numel:]
            parts.append(presence[self.tensors[owner].start:self.tensors[owner].stop])
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # a view: the push is not reused

    def _parts(self, slices: Sequence[Tensor]) -> list[Tensor]:
        """The owners' slices cut into their parameters, then the buffers (at the end of owner 0's)."""
        return [s[:z - a] for s, (a, z) in zip(slices, self.spans)] + [slices[0][self.spans[0][1] - self.spans[0][0]:]]

    def join(self, slices: Sequence[Tensor]) -> Tensor:
        """The parameters-and-buffers vector of the owners' slices."""
        return torch.cat(self._parts(slices))

    def load(self, vectors: ModelVectors, slices: Sequence[Tensor]) -> None:
        """`join` then ``vectors.load_state``, with one copy instead of two."""
        parts = self._parts(slices)
        vectors.load_parts(parts if vectors.buffers else parts[:-1])


@dataclass(frozen=True)
class PieceRef:
    """An accepted push, as the server keeps it: its pieces are with the owners."""

    learner: int
    seq: int


class ShardOwner:
    """Holds one shard of the server and follows the server's orders, in order (a thread)."""

    def __init__(self, rank: int, state: ServerState, mesh: DataMesh) -> None:
        self.rank, self.state, self.mesh = rank, state, mesh
        self.commands: queue.Queue[Order] = queue.Queue()
        self.version = 0
        self._pieces: dict[tuple[int, int], ShardData] = {}
        self._arrived = threading.Condition()
        self._mesh_failure: str | None = None
        # its own stream: on the default one its copies would queue behind collectives (`streams`)
        self.stream = streams.side_stream(state.vectors.device, streams.OWNER)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"stale-shard-{rank}")

    def start(self, endpoint, server=None) -> None:
        """Follow the orders in ``commands``; a failure of ``endpoint`` (this rank's learner's) or
        ``server`` (rank 0's) ends it, and the owner's is reported through them."""
        self._endpoint, self._server = endpoint, server
        self._thread.start()

    def broken(self, error: str) -> None:  # a data connection of this rank broke
        self._mesh_failure = error

    def failure(self) -> str | None:
        server_error = self._server.error if self._server is not None else None
        return server_error or self._endpoint.failure or self._mesh_failure

    def report(self, reason: str) -> None:
        message = Message(Kind.ABORT, self.rank, error=reason, payload=text_payload(reason))
        if self._server is not None:
            self._server.events.put(message)
        else:
            self._endpoint.push(message)

    def put_piece(self, message: ShardData) -> None:
        with self._arrived:
            self._pieces[(message.learner, message.seq)] = message
            self._arrived.notify_all()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        with streams.running_on(self.stream):
            self._follow()

    def _follow(self) -> None:
        try:
            while True:
                try:
                    command = self.commands.get(timeout=1.0)
                except queue.Empty:
                    if self.failure():
                        return
                    continue
                if command.kind == Kind.RETIRE:
                    return
                {Kind.APPLY: self._apply, Kind.SEND: self._send, Kind.SCHEDULE: self._schedule,
                 Kind.GATHER: self._gather}[command.kind](command)
        except BaseException as exc:  # noqa: BLE001 - the run must end, naming this
            detail = "".join(traceback.format_exception(exc)).rstrip()
            self.report(f"the shard server on rank {self.rank} failed: {type(exc).__name__}: {exc}\n{detail}")

    def _apply(self, command: Order) -> None:
        assert command.payload is not None, "an update names its gradients"
        orders = command.payload.view(-1, 3).tolist()
        pieces = [self._take(int(learner), int(seq)) for learner, seq, _ in orders]
        for m in pieces:
            streams.receive(m.payload, m.ready)  # a piece on the device: from its channel or learner
        empty = torch.zeros(0, dtype=self.state.vectors.dtype)  # the piece of an owner of no tensor
        contributions = [self.state.vectors.split_push(m.payload if m.payload is not None else empty,
                                                       bool(m.flags & Flag.MASKED)) for m in pieces]
        weights = [w for _, _, w in orders]
        self.state.apply(contributions, None if all(w == 1.0 for w in weights) else weights, command.version)
        self.version = command.version
        with self._arrived:  # older pieces of these learners were dropped by the server
            applied: dict[int, int] = {}
            for learner, seq, _ in orders:
                applied[int(learner)] = max(applied.get(int(learner), -1), int(seq))
            for key in [k for k in self._pieces if k[0] in applied and k[1] < applied[k[0]]]:
                del self._pieces[key]

    def _take(self, learner: int, seq: int) -> ShardData:
        with self._arrived:
            while (learner, seq) not in self._pieces:
                self._arrived.wait(WAIT_S)
                reason = self.failure()
                if reason:
                    raise RuntimeError(f"waiting for learner {learner}'s gradient: the run failed ({reason})")
            return self._pieces.pop((learner, seq))

    def _send(self, command: Order) -> None:
        payload = self.state.snapshot(self.version, self.mesh.payload_device(self.state.vectors.device))
        self.mesh.send(command.learner, ShardData(Kind.SLICE, command.learner, self.version,
                                                  delivery=command.delivery, payload=payload,
                                                ready=streams.mark(payload)))

    def _schedule(self, command: Order) -> None:
        metrics = json.loads(payload_text(command.payload))
        if command.flags & Flag.PER_UPDATE:
            self.state.schedules.metrics.update(metrics)
        else:
            self.state.schedules.end_epoch(command.epoch - 1, metrics)

    def _gather(self, command: Order) -> None:
        self.mesh.send(0, ShardData(Kind.STATE, self.rank, self.version, delivery=command.delivery,
                                  payload=self.state.snapshot(self.version)))
        saved = io.BytesIO()
        torch.save({"optimizer": self.state.optimizer.state_dict(),
                    "schedulers": self.state.schedules.states()}, saved)
        self.mesh.send(0, ShardData(Kind.STATE, self.rank, self.version, delivery=command.delivery,
                                  flags=Flag.OPTIMIZER,
                                  payload=torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8)))
