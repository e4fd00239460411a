"""The sharded path: every rank owns a slice of the parameters, so no rank carries them all.

The trainable tensors are cut into P contiguous runs of about equal size (at tensor boundaries,
so per-tensor optimizers stay exact); rank o's *owner* thread holds run o, its optimizer state
and its schedulers (rank 0's owner also the buffers). The server core on rank 0 still takes
every decision, from headers alone, so every owner applies the same gradients in the same order:

* a push: the learner sends each owner its piece of the gradient (mesh) and the server the
  header (version, loss, samples, its push counter ``seq``);
* an update: the server orders every owner to APPLY it, naming the (learner, seq) of each
  gradient and its weight; an owner waits for its pieces, averages, steps;
* new parameters for a learner (a refresh, an epoch's validation, the stop): the server orders
  every owner to SEND that learner its slice, tagged with a delivery number, and tells the
  learner to expect that delivery; the learner joins the slices (`ShardedExchange.resolve`).

Per update a rank moves about N(P-1)/P values up and as many down, like a ring all-reduce,
and steps an optimizer over N/P values (see the README's "Scaling" section).

What this path gives up: an owner lives in a learner's process. A learner that is slow to
compute still serves its slice (a thread of its own), but a process that is frozen or dies takes
its slice with it: the run waits for a frozen one and stops for a dead one. The Trainer's
gradient clipping (a norm over every shard) and the "norm" staleness compensation (a distance
over every shard) would need an exchange between owners per update, so they are refused here
(the central server runs them).
"""

from __future__ import annotations

import io
import json
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_stale.engine import streams
from lightning_stale.engine.distributed.mesh import DataMesh
from lightning_stale.engine.distributed.messages import Flag, Kind, Message, payload_text, text_payload
from lightning_stale.engine.state import ModelVectors, ServerState

_WAIT_S = 0.1
_IN_SLICES = torch.zeros(0)  # the payload of a resolved message whose parameters wait in slices
FINAL = 0  # the gather request of the stop; checkpoints during training ask with 1, 2, ...


class ShardLayout:
    """Which trainable tensors each of the P owners holds: contiguous runs of about N/P values.

    Args:
        sizes: the number of values of each trainable tensor, in module order.
        buffer_numel: the values of the buffers (owner 0 keeps them).
        p: the number of owners.
    """

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

    def join(self, slices: Sequence[Tensor]) -> Tensor:
        """The parameters-and-buffers vector of the owners' slices (owner 0's ends with the buffers)."""
        params = [s[:z - a] for s, (a, z) in zip(slices, self.spans)]
        return torch.cat(params + [slices[0][self.spans[0][1] - self.spans[0][0]:]])

    def load(self, vectors: ModelVectors, slices: Sequence[Tensor]) -> None:
        """`join` then ``vectors.load_state``, with one copy instead of two."""
        buffers = slices[0][self.spans[0][1] - self.spans[0][0]:]
        parts = [s[:z - a] for s, (a, z) in zip(slices, self.spans)] + ([buffers] if vectors.buffers else [])
        vectors.load_parts(parts)


@dataclass(frozen=True)
class PieceRef:
    """An accepted push, as the server keeps it: its pieces are with the owners."""

    learner: int
    seq: int


class ShardOwner:
    """Holds one shard of the server and follows the server's orders, in order (a thread).

    Args:
        rank: this owner's rank (its shard's index).
        state: the shard: its parameters, optimizer state, schedulers (buffers on rank 0).
        mesh: where slices and gathered state go.

    `start` begins following orders; an owner that fails tells the server (an ABORT naming it),
    and an owner stops waiting once the run has failed.
    """

    def __init__(self, rank: int, state: ServerState, mesh: DataMesh) -> None:
        self.rank, self.state, self.mesh = rank, state, mesh
        self.commands: queue.Queue[Message] = queue.Queue()
        self.version = 0
        self._pieces: dict[tuple[int, int], Message] = {}
        self._arrived = threading.Condition()
        self._mesh_failure: str | None = None
        # On a GPU the owner works on a stream of its own: on the default one, its copies to the
        # host would queue behind this rank's collectives (`engine.streams`).
        self.stream = streams.side_stream(state.vectors.device, streams.OWNER)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"stale-shard-{rank}")

    def start(self, endpoint, server=None) -> None:
        """Follow the orders arriving in ``commands``; ``endpoint`` is this rank's learner
        endpoint (its failure ends the wait; a failure of the owner is reported through it),
        ``server`` the server on rank 0."""
        self._endpoint, self._server = endpoint, server
        self._thread.start()

    def broken(self, error: str) -> None:
        """A data connection of this rank broke."""
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

    def put_piece(self, message: Message) -> None:
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

    def _apply(self, command: Message) -> None:
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
            applied = {}
            for learner, seq, _ in orders:
                applied[int(learner)] = max(applied.get(int(learner), -1), int(seq))
            for key in [k for k in self._pieces if k[0] in applied and k[1] < applied[k[0]]]:
                del self._pieces[key]

    def _take(self, learner: int, seq: int) -> Message:
        with self._arrived:
            while (learner, seq) not in self._pieces:
                self._arrived.wait(_WAIT_S)
                reason = self.failure()
                if reason:
                    raise RuntimeError(f"waiting for learner {learner}'s gradient: the run failed ({reason})")
            return self._pieces.pop((learner, seq))

    def _send(self, command: Message) -> None:
        payload = self.state.snapshot(self.version, self.mesh.payload_device(self.state.vectors.device))
        self.mesh.send(command.learner, Message(Kind.SLICE, command.learner, self.version,
                                                delivery=command.delivery, payload=payload,
                                                ready=streams.mark(payload)))

    def _schedule(self, command: Message) -> None:
        metrics = json.loads(payload_text(command.payload))
        if command.flags & Flag.PER_UPDATE:
            self.state.schedules.metrics.update(metrics)
        else:
            self.state.schedules.end_epoch(command.epoch - 1, metrics)

    def _gather(self, command: Message) -> None:
        self.mesh.send(0, Message(Kind.STATE, self.rank, self.version, delivery=command.delivery,
                                  payload=self.state.snapshot(self.version)))
        saved = io.BytesIO()
        torch.save({"optimizer": self.state.optimizer.state_dict(),
                    "schedulers": self.state.schedules.states()}, saved)
        self.mesh.send(0, Message(Kind.STATE, self.rank, self.version, delivery=command.delivery,
                                  flags=Flag.OPTIMIZER,
                                  payload=torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8)))


class ShardedExchange:
    """A learner's side of the sharded path: its push goes out in pieces, parameters come in
    slices (see the module docstring)."""

    schedules = None  # the owners step the LR schedulers

    def __init__(self, vectors: ModelVectors, layout: ShardLayout, rank: int, mesh: DataMesh,
                 owner: ShardOwner) -> None:
        self.vectors, self.layout, self.rank, self.mesh, self.owner = vectors, layout, rank, mesh, owner
        self.seq = 0
        self._slices: dict[int, dict[int, Message]] = {}  # delivery -> owner -> SLICE
        self._resolved: tuple[int, list[Tensor]] = (0, [])  # the latest PARAMS/STOP's slices
        self._arrived = threading.Condition()

    def fill_push(self, message: Message) -> None:
        message.payload, masked = self.vectors.push_vector(device=self.mesh.payload_device(self.vectors.device))
        if masked:
            message.flags |= Flag.MASKED

    def carry(self, message: Message) -> None:
        """The push waits over an epoch's end: its payload holds the gradient already."""

    def before_push(self, message: Message) -> None:
        """The pieces go to the owners before the header goes to the server, so that an owner
        rarely waits for them."""
        self.seq += 1
        message.seq = self.seq
        vector, message.payload = message.payload, None
        if vector is None:  # nothing to apply (an overflow): the header alone
            return
        masked = bool(message.flags & Flag.MASKED)
        for owner in range(self.layout.p):
            piece = self.layout.piece(vector, owner, masked)
            self.mesh.send(owner, Message(Kind.PIECE, self.rank, message.version, seq=self.seq,
                                          flags=message.flags & Flag.MASKED, payload=piece,
                                          ready=streams.mark(piece)))

    def after_push(self, message: Message) -> None:
        pass

    def put_slice(self, owner: int, message: Message) -> None:
        if message.payload is None:  # an owner of no tensor sends nothing
            message.payload = torch.zeros(0, dtype=self.vectors.dtype)
        with self._arrived:
            self._slices.setdefault(message.delivery, {})[owner] = message
            self._arrived.notify_all()

    def resolve(self, message: Message, check: Callable[[], None]) -> None:
        """A sliced message gets its parameters: every owner's slice of its delivery."""
        if not message.flags & Flag.SLICED:
            return
        with self._arrived:
            while len(self._slices.get(message.delivery, ())) < self.layout.p:
                self._arrived.wait(_WAIT_S)
                check()
            slices = self._slices.pop(message.delivery)
            for delivery in [d for d in self._slices if d < message.delivery]:
                del self._slices[delivery]  # skipped: a newer delivery superseded them
        for m in slices.values():
            streams.receive(m.payload, m.ready)  # a slice on the device: from its channel or owner
        slices = [slices[o].payload for o in range(self.layout.p)]
        if message.kind == Kind.EPOCH:  # kept whole: validation loads it later
            message.payload = self.layout.join(slices)
        else:  # loaded straight from the slices by `take`
            self._resolved, message.payload = (message.delivery, slices), _IN_SLICES

    def take(self, message: Message) -> None:
        if message.payload is _IN_SLICES:
            delivery, slices = self._resolved
            if delivery != message.delivery:
                raise RuntimeError(f"parameters of delivery {message.delivery} taken, {delivery} resolved")
            self.layout.load(self.vectors, slices)
        elif message.payload is not None:
            self.vectors.load_state(message.payload)

    def close(self, timeout: float, failed: bool = False) -> list[str]:
        """After the stop, or a failure: this rank's owner has retired; the mesh says goodbye to
        every peer."""
        deadline = time.monotonic() + timeout  # one bound for both
        stuck = [] if self.owner.join(timeout) else [f"stale-shard-{self.rank}"]
        self.mesh.close()
        return stuck + self.mesh.join(max(0.0, deadline - time.monotonic()))


class ShardedPayloads:
    """The server's side of the sharded path: pushes are headers (`PieceRef`), updates are
    orders to the owners, and a message that gives a learner parameters is sliced."""

    def __init__(self, p: int, send: Callable[[int, Message], None]) -> None:
        self.p, self.send = p, send
        self._delivery = 0
        self._gathered: dict[int, dict[tuple[int, bool], Message]] = {}
        self._gathered_ready = threading.Condition()

    def contribution(self, message: Message) -> PieceRef:
        return PieceRef(message.learner, message.seq)

    def fill(self, message: Message, core, decision) -> None:
        if message.kind not in (Kind.PARAMS, Kind.EPOCH, Kind.STOP):
            return
        self._delivery += 1
        self._to_owners(Message(Kind.SEND, message.learner, delivery=self._delivery))
        message.delivery, message.flags = self._delivery, message.flags | Flag.SLICED

    def on_update(self, update, contributions: Sequence[PieceRef], weights) -> None:
        weights = [1.0] * len(contributions) if weights is None else list(weights)
        orders = torch.tensor([[c.learner, c.seq, w] for c, w in zip(contributions, weights)],
                              dtype=torch.float64).reshape(-1)
        self._to_owners(Message(Kind.APPLY, version=update.version, payload=orders))

    def on_schedule(self, epoch: int, metrics: dict, per_update: bool) -> None:
        self._to_owners(Message(Kind.SCHEDULE, epoch=epoch, flags=Flag.PER_UPDATE if per_update else 0,
                                payload=text_payload(json.dumps(metrics))))

    def on_stop(self) -> None:
        """The final state goes to rank 0 (request `FINAL`), then the owners retire."""
        self.gather(FINAL)
        self._to_owners(Message(Kind.RETIRE))

    def gather(self, request: int) -> None:
        """Ask every owner for its state (answered through `put_state`, to rank 0)."""
        with self._gathered_ready:
            self._gathered[request] = {}
        self._to_owners(Message(Kind.GATHER, delivery=request))

    def put_state(self, owner: int, message: Message) -> None:
        with self._gathered_ready:
            self._gathered.setdefault(message.delivery, {})[(owner, bool(message.flags & Flag.OPTIMIZER))] = message
            self._gathered_ready.notify_all()

    def gathered(self, request: int, check: Callable[[], None],
                 keep: bool = False) -> tuple[list[Tensor], list[dict], int]:
        """Every owner's state vector and saved optimizer and scheduler states for ``request``,
        and the version they are of (``keep``: leave them for another reader)."""
        with self._gathered_ready:
            while len(self._gathered.get(request, ())) < 2 * self.p:
                self._gathered_ready.wait(_WAIT_S)
                check()
            parts = self._gathered[request] if keep else self._gathered.pop(request)
        states = [parts[(o, False)].payload if parts[(o, False)].payload is not None else torch.zeros(0)
                  for o in range(self.p)]
        # On the host: an owner's optimizer state was saved from its own GPU, which rank 0 must
        # not allocate on (nor may be able to see); loading it into an optimizer moves it to the
        # parameters' device.
        saved = [torch.load(io.BytesIO(parts[(o, True)].payload.numpy().tobytes()), map_location="cpu",
                            weights_only=True) for o in range(self.p)]
        return states, saved, parts[(0, False)].version

    def _to_owners(self, command: Message) -> None:
        for owner in range(self.p):
            self.send(owner, Message(command.kind, command.learner, command.version, command.epoch,
                                     flags=command.flags, delivery=command.delivery,
                                     payload=command.payload))


def assemble_optimizer_state(optimizer, layout: ShardLayout, params: Sequence[Tensor],
                             saved: Sequence[dict]) -> dict:
    """The state dict of ``optimizer`` (rank 0's learner's, over the module's ``params``) as if it
    had taken every update: each owner's per-parameter state, renumbered, and the current group
    options (learning rates after the schedulers) from owner 0."""
    full = optimizer.state_dict()
    numbering = {id(p): i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])}
    state = {}
    for owner, part in enumerate(saved):
        owned = {id(params[i]) for i in layout.tensors[owner]}
        mine = [numbering[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in owned]
        for local, value in part["optimizer"]["state"].items():
            state[mine[local]] = value
    groups = [{**{k: v for k, v in shard_group.items() if k != "params"}, "params": group["params"]}
              for shard_group, group in zip(saved[0]["optimizer"]["param_groups"], full["param_groups"])]
    return {"state": state, "param_groups": groups}
