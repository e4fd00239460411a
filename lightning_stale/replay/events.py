"""The event log of a run: its format, its digests, and the reader that refuses bad logs.

A log is a text file of JSON Lines (one JSON object per line; nothing is unpickled or executed
when it is read). It holds no tensors, only digests, so it grows with the pushes, not with the
model. Every line has a ``"kind"``; the first line is the header, the last the stop:

- ``header``: ``format`` (always ``"lightning_stale.events"``), ``version`` (`FORMAT_VERSION`;
  a reader refuses a newer one), ``engine``, ``variant``, ``k``, ``p``, ``seed``, the options
  that shape the event order (``delay``: the delay model's description, ``compute_time``,
  ``adaptive_k``), ``parameters`` (``[name, shape]`` of every trainable parameter and
  persistent buffer, in the order the server lays them out: a log is refused at once by a module
  of other shapes), ``optimizer`` (its class), ``digest_every``, ``trainer`` (the Trainer's
  limits that decide when the fit ends), ``sampler`` (how mini-batches are drawn) and
  ``intra_op_threads`` (torch's intra-op thread count the run computed with, which a replay
  takes for its fit; absent from older logs).
- ``push``: ``push`` (its id: 0, 1, ... in arrival order), ``learner``, ``index`` (the learner's
  own push count, from 0), ``version`` (the version its gradient was computed at), ``t``
  (training seconds at the push, pauses excluded: virtual seconds in the simulator), ``loss``,
  what the server did (``accepted``: kept for an update; ``dropped``: the reason, e.g.
  ``"stale"``, ``"overflow"``, ``"in_flight_at_stop"``;
  ``update``: the update it completed, if any), ``cancel`` (learners whose unfinished work it
  cancelled) and what the engine adds to draw the same push again: ``draw`` (the index of its
  first mini-batch in the fit's sequence of training batches), ``batches`` (micro-batches),
  ``batch`` (digest of the mini-batch's tensors) and ``rng`` (the seed of torch's generators
  for its forward and backward: dropout).
- ``update``: ``update`` (j, from 1), ``version`` (after it), ``contributions`` (push ids in the
  order they were summed), ``learners``, ``staleness``, ``weights`` (staleness compensation,
  or null), ``lr`` (each parameter group's learning rate for this step), ``k`` (the K in force)
  and, every ``digest_every`` updates, ``digest``: the server's parameters and optimizer state
  after the update (`state_digest`).
- ``epoch_end`` (``epoch``: epochs ended, ``updates``, ``pushes``), ``validation`` (``epoch``,
  ``metrics``: the logged values the epoch's schedulers saw), ``remove_learner`` (``learner``).
- ``stop``: ``pushes``, ``updates``, ``epochs`` (counts the reader checks against the lines),
  ``in_flight`` (ids of accepted pushes never applied) and the final ``digest``.

Digests (`state_digest`): ``sha256`` of the parameters-and-buffers vector's bytes (bit identity)
and of the optimizer state's bytes, and, per tensor, its sum and Euclidean norm in float64
(``tensors``: ``[sum, norm]`` in the header's ``parameters`` order; ``optimizer_tensors``:
``[name, numel, sum, norm]``). The hashes say whether two states are the same bit for bit;
the sums and norms bound how far apart they are where they are not (`relative_difference`: a
replay with other options, or on another machine, is not expected to be bit-identical). Floats
are written as Python's shortest repr, which reads back to the same float64.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

FORMAT = "lightning_stale.events"
FORMAT_VERSION = 1
EVENTS_FILE_NAME = "events.jsonl"
KINDS = ("header", "push", "update", "epoch_end", "validation", "remove_learner", "stop")


class EventLogError(ValueError):
    """A log that cannot be replayed: newer format, truncated, corrupted, or not this run's."""


# ---------------------------------------------------------------------- digests
def tensor_bytes(t: Tensor) -> Any:
    """The raw bytes of ``t`` (any dtype), on the CPU: a buffer ``hashlib`` reads in place (no
    copy of a large tensor's bytes)."""
    flat = t.detach().reshape(-1).cpu().contiguous()
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def batch_digest(batch: Any) -> str:
    """A short sha256 of every tensor in ``batch`` (nested tuples, lists and dicts), with their
    shapes and dtypes: the same mini-batch gives the same digest."""
    h = hashlib.sha256()
    for t in _tensors_in(batch):
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()[:16]


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors_in(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)


def _summary(t: Tensor) -> list[float]:
    d = t.detach().double()
    return [float(d.sum()), float(d.norm())]


def state_digest(state: Any) -> dict:
    """Digest of a `ServerState`: its parameters and buffers and its optimizer's state."""
    tensors = list(state.params) + list(state.buffers)
    params = hashlib.sha256()
    for t in tensors:
        params.update(tensor_bytes(t))
    optimizer = hashlib.sha256()
    optimizer_tensors = []
    for i, p in enumerate(state.params):
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            optimizer.update(f"{i}.{key}".encode())
            if isinstance(value, Tensor):
                optimizer.update(tensor_bytes(value))
                optimizer_tensors.append([f"{i}.{key}", value.numel(), *_summary(value)])
            else:
                optimizer.update(repr(value).encode())
    return {"sha256": params.hexdigest(), "optimizer_sha256": optimizer.hexdigest(),
            "tensors": [_summary(t) for t in tensors], "optimizer_tensors": optimizer_tensors}


def relative_difference(a: list[float], b: list[float], numel: int) -> float:
    """A lower bound of ||x - y|| / max(||x||, ||y||) for two tensors of ``numel`` values known
    only by their digests' ``[sum, norm]``: by the triangle inequality | ||x|| - ||y|| | <=
    ||x - y||, and by Cauchy-Schwarz |sum(x) - sum(y)| <= sqrt(numel) ||x - y||. 0 when the
    summaries agree; inf when one is not finite."""
    if a == b:
        return 0.0
    if not all(math.isfinite(v) for v in (*a, *b)):
        return math.inf
    bound = max(abs(a[1] - b[1]), abs(a[0] - b[0]) / math.sqrt(max(1, numel)))
    scale = max(a[1], b[1])
    return bound / scale if scale > 0 else math.inf


def combined_digest(digests: list[str]) -> str:
    """One digest of several micro-batches' digests, in order."""
    return digests[0] if len(digests) == 1 else hashlib.sha256(":".join(digests).encode()).hexdigest()[:16]


def seed_for(seed: int, learner: int, index: int) -> int:
    """The seed of push ``index`` of ``learner`` in a run seeded ``seed`` (63 bits of a sha256)."""
    digest = hashlib.sha256(f"{seed}:{learner}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_generators(seed: int) -> None:
    """What `torch.manual_seed` does to the generators a push draws from (the CPU's, and CUDA's
    once CUDA is in use), without its cost on the others: seeding every backend's generators
    (CUDA's queued lazily where CUDA is not in use, XPU's) takes about 0.2 ms, a tenth of an
    update of a small model on a CPU."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


# ---------------------------------------------------------------------- writing
class EventWriter:
    """Writes events to ``path`` as JSON Lines (buffered; `close` flushes)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: dict) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class MemoryWriter:
    """Keeps events in a list (a replay's own events, compared with the log's)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.path = None

    def write(self, event: dict) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- reading
@dataclass
class EventLog:
    """A log read and checked by `read_events`."""

    path: str
    header: dict
    pushes: list[dict] = field(default_factory=list)  # by push id
    updates: list[dict] = field(default_factory=list)  # by update index - 1
    events: list[dict] = field(default_factory=list)  # every line after the header, in order
    stop: dict = field(default_factory=dict)

    def fate(self, push: int) -> dict:
        """What the server did with push ``push``: ``{"applied": j, "weight": w}``,
        ``{"dropped": reason}`` or ``{"in_flight_at_stop": True}``."""
        event = self.pushes[push]
        if not event["accepted"]:
            return {"dropped": event["dropped"]}
        for update in self.updates:
            if push in update["contributions"]:
                i = update["contributions"].index(push)
                weight = 1.0 if update["weights"] is None else update["weights"][i]
                return {"applied": update["update"], "weight": weight}
        return {"in_flight_at_stop": True}


_REQUIRED = {
    "header": ("format", "version", "engine", "variant", "k", "p", "seed", "parameters",
               "optimizer", "digest_every"),
    "push": ("push", "learner", "index", "version", "t", "accepted", "dropped", "update"),
    "update": ("update", "version", "contributions", "learners", "weights", "lr", "k"),
    "epoch_end": ("epoch", "updates", "pushes"),
    "validation": ("epoch", "metrics"),
    "remove_learner": ("learner",),
    "stop": ("pushes", "updates", "epochs", "in_flight"),
}


def read_events(path: str | os.PathLike) -> EventLog:
    """Read and check a log; any problem raises `EventLogError` naming the file, the line and
    what is wrong: not a log, a newer format version, a line that does not parse, a missing
    field, pushes or updates out of sequence, an update of pushes never accepted, a missing stop
    (a truncated file), or counts in the stop that do not match the lines."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise EventLogError(f"cannot read the event log {path}: {e}") from e
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise EventLogError(f"{path} is empty: not an event log")
    log: EventLog | None = None
    applied: set[int] = set()
    for number, line in enumerate(lines, start=1):
        where = f"{path}, line {number}"
        try:
            event = json.loads(line)
        except json.JSONDecodeError as e:
            raise EventLogError(f"{where} does not parse as JSON ({e.msg}): the log is corrupted") from e
        if not isinstance(event, dict) or event.get("kind") not in KINDS:
            raise EventLogError(f"{where}: not an event (kind must be one of {', '.join(KINDS)})")
        kind = event["kind"]
        missing = [name for name in _REQUIRED[kind] if name not in event]
        if log is None:  # the first line
            _check_header(event, where)
        if missing:
            raise EventLogError(f"{where}: a {kind} event without {', '.join(missing)}")
        if log is None:
            log = EventLog(path, event)
            continue
        if kind == "header":
            raise EventLogError(f"{where}: a second header")
        if log.stop:
            raise EventLogError(f"{where}: a {kind} event after the stop")
        log.events.append(event)
        if kind == "push":
            if event["push"] != len(log.pushes):
                raise EventLogError(f"{where}: push {event['push']} where push {len(log.pushes)} "
                                    "was due: a push is missing or repeated")
            if not 0 <= event["learner"] < log.header["p"]:
                raise EventLogError(f"{where}: learner {event['learner']} of P={log.header['p']}")
            if not 0 <= event["version"] <= len(log.updates):
                raise EventLogError(f"{where}: push {event['push']} was computed at version "
                                    f"{event['version']}, but {len(log.updates)} updates came before it")
            log.pushes.append(event)
        elif kind == "update":
            if event["update"] != len(log.updates) + 1:
                raise EventLogError(f"{where}: update {event['update']} where update "
                                    f"{len(log.updates) + 1} was due: an update is missing or repeated")
            for push in event["contributions"]:
                if not (0 <= push < len(log.pushes) and log.pushes[push]["accepted"]) or push in applied:
                    raise EventLogError(f"{where}: update {event['update']} applies push {push}, "
                                        "which was not accepted before it or was applied already")
                applied.add(push)
            log.updates.append(event)
        elif kind == "stop":
            log.stop = event
    assert log is not None  # (the file has a first line)
    if not log.stop:
        raise EventLogError(f"{path} ends at line {len(lines)} without its stop event: the file is "
                            "truncated (the run did not finish, or the file was cut)")
    counted = {"pushes": len(log.pushes), "updates": len(log.updates),
               "epochs": sum(e["kind"] == "epoch_end" for e in log.events)}
    for name, count in counted.items():
        if log.stop[name] != count:
            raise EventLogError(f"{path}: the stop counts {log.stop[name]} {name}, the log holds "
                                f"{count}: the log is corrupted")
    accepted = {p["push"] for p in log.pushes if p["accepted"]}
    unsettled = accepted - applied - set(log.stop["in_flight"])
    if unsettled:
        raise EventLogError(f"{path}: accepted pushes {sorted(unsettled)[:5]} are neither applied nor "
                            "in flight at the stop: the log is corrupted")
    return log


def _check_header(event: dict, where: str) -> None:
    if event.get("kind") != "header" or event.get("format") != FORMAT:
        raise EventLogError(f"{where}: not a {FORMAT} log (its first line must be the header)")
    version = event.get("version")
    if not isinstance(version, int) or version < 1:
        raise EventLogError(f"{where}: format version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise EventLogError(f"{where}: the log has format version {version}, newer than version "
                            f"{FORMAT_VERSION} that this lightning_stale reads: upgrade lightning_stale")
    threads = event.get("intra_op_threads", 1)  # (absent from logs written before it was recorded)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise EventLogError(f"{where}: intra_op_threads {threads!r} is not a thread count (an integer >= 1)")


def module_layout(module: torch.nn.Module) -> list[list]:
    """``[name, shape]`` of the trainable parameters and persistent buffers of ``module``, in
    the order `ModelVectors` lays them out (the header's ``parameters``)."""
    persistent = module.state_dict(keep_vars=True)
    params = [[n, list(p.shape)] for n, p in module.named_parameters() if p.requires_grad]
    buffers = [[n, list(b.shape)] for n, b in module.named_buffers() if n in persistent]
    return params + buffers


def check_layout(recorded: Iterable, module: torch.nn.Module, path: str) -> None:
    """Refuse a log recorded from a module of other parameter names or shapes."""
    mine, theirs = module_layout(module), [list(x) for x in recorded]
    if mine == theirs:
        return
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            raise EventLogError(f"{path} was recorded from another model: its tensor {i} is "
                                f"{a[0]} of shape {tuple(a[1])}, this module's is {b[0]} of shape "
                                f"{tuple(b[1])}")
    raise EventLogError(f"{path} was recorded from another model: it has {len(theirs)} parameter "
                        f"and buffer tensors, this module has {len(mine)}")
