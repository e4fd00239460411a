"""Recording the real engine (`StaleStrategy`): rank 0's server log, each learner's side log,
and their merge into one event log (docs/replay.md, "Recording the real engine").

What the server did with each push is known on rank 0 only: its `ServerCore` tells an
`EventRecorder` (the same observer the simulated engine uses), which writes
``<name>.server.jsonl``. What a push was made of is known to its learner only: the mini-batch
indices its sampler drew, the digest of the batch and the seed of torch's generators for its
forward and backward (dropout). Each learner writes those, one line per push, to its own
``<name>.rank<r>.jsonl`` (`LearnerLog`), from the strategy's hooks, so the messages between
learners and server stay as they are. At the end of the fit rank 0 joins the parts on
(learner, push index) into ``<name>.jsonl`` and deletes them (`merge_parts`): the ranks must
share a file system (one host, or a shared folder).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from lightning_stale.engine.state import ModelVectors
from lightning_stale.replay.events import (
    EventLogError,
    EventWriter,
    batch_digest,
    combined_digest,
    module_layout,
    seed_for,
    seed_generators,
    state_digest,
)
from lightning_stale.replay.recorder import EventRecorder

log = logging.getLogger(__name__)

SIDE_FIELDS = ("indices", "batches", "batch", "rng")  # what a learner's line adds to a push


def server_part(path: Path) -> Path:
    """Where rank 0's server writes its part of the log ``path``."""
    return path.with_name(f"{path.stem}.server.jsonl")


def learner_part(path: Path, rank: int) -> Path:
    """Where learner ``rank`` writes its side log of the log ``path``."""
    return path.with_name(f"{path.stem}.rank{rank}.jsonl")


def start_server_recording(strategy: Any, module: Any, path: Path, server_path: str,
                           pushes_per_epoch: int, limit_train_batches: Any) -> EventRecorder:
    """Rank 0's `EventRecorder` (the core's observer), writing the server's part of ``path``."""
    trainer = module.trainer
    header = {
        "engine": "stale", "server": server_path, "variant": strategy.variant.name,
        "k": strategy.variant.k, "p": strategy.variant.p, "seed": strategy.seed,
        "delay": repr(strategy.delay), "delay_mode": strategy.delay_mode, "compute_time": 0.0,
        "adaptive_k": None if strategy._adaptive is None else repr(strategy._adaptive),
        "staleness_compensation": None if strategy.staleness_compensation is None
        else repr(strategy.staleness_compensation),
        "parameters": module_layout(module), "optimizer": type(strategy.optimizers[0]).__qualname__,
        "trainer": {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs,
                    "limit_train_batches": limit_train_batches,
                    "accumulate_grad_batches": trainer.accumulate_grad_batches},
        "pushes_per_epoch": pushes_per_epoch,
        # (Lightning's launcher gives every process of a node the same count: rank 0's stands
        # for the learners', which compute on their main threads)
        "intra_op_threads": torch.get_num_threads(),
        "sampler": {"kind": "IndependentBatchSampler per learner",
                    "indices": "each push's micro-batches' dataset indices, from its learner's log"},
    }
    return EventRecorder(EventWriter(server_part(path)), header, strategy.digest_every)


class LearnerLog:
    """One learner's side log: for each push, its index among the learner's pushes, the version
    it was computed at, its micro-batches' dataset indices and digest, and the seed of torch's
    generators for its forward and backward. One line per push, flushed at once (a learner
    killed mid-run leaves its lines so far).

    The strategy calls `start_micro_batch` as each micro-batch starts (the first of a push seeds
    torch's generators with `seed_for` of the learner's computation count), `after_step` after
    the learner's step (the push, if the computation was pushed; kept if carried across an
    epoch's end) and `after_resume` after training goes on (a carried computation pushed then).
    ``drawn`` is filled by the learner's sampler with the indices of each batch it yields, in
    order; the batches start in that order."""

    def __init__(self, path: Path, rank: int, seed: int) -> None:
        self.rank, self.seed = rank, seed
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.drawn: deque[list[int]] = deque()
        self.computations = 0
        self.logged = 0  # pushes written
        self.current: dict | None = None
        self.carried: dict | None = None

    def start_micro_batch(self, batch: Any, first: bool, version: int) -> None:
        if first or self.current is None:
            rng = seed_for(self.seed, self.rank, self.computations)
            self.computations += 1
            seed_generators(rng)  # the push's dropout, drawn again by a replay
            self.current = {"version": version, "rng": rng, "indices": [], "batch": []}
        self.current["indices"].append(self.drawn.popleft() if self.drawn else None)
        self.current["batch"].append(batch_digest(batch))

    def after_step(self, pushes: int, carried: bool) -> None:
        work, self.current = self.current, None
        if work is None:
            return
        if pushes > self.logged:
            self._write(work, pushes)
        elif carried:
            self.carried = work

    def after_resume(self, pushes: int, still_carried: bool) -> None:
        """At a micro-batch's start: the carried computation was pushed when training went on,
        or dropped (an update made it stale meanwhile), unless the learner still carries it
        (the batch started during the pause: it is discarded itself)."""
        if self.carried is None or still_carried:
            return
        work, self.carried = self.carried, None
        if pushes > self.logged:
            self._write(work, pushes)

    def _write(self, work: dict, pushes: int) -> None:
        self.logged = pushes
        line = {"learner": self.rank, "index": pushes - 1, "version": work["version"],
                "rng": work["rng"], "batches": len(work["batch"]), "indices": work["indices"],
                "batch": combined_digest(work["batch"])}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def merge_parts(path: Path, p: int) -> Path:
    """Join the server's part of the log ``path`` with the learners' side logs into ``path``
    (the push lines gain ``indices``, ``batches``, ``batch`` and ``rng``) and delete the parts.
    A push that its learner's log lacks (a learner killed before it flushed) keeps the server's
    fields only; a learner's line that disagrees with the server about the push's version is an
    error (the log would replay another run)."""
    sides: dict[tuple[int, int], dict] = {}
    parts = [learner_part(path, r) for r in range(p)]
    for part in parts:
        if not part.exists():
            log.warning("event log: no side log %s (that learner's pushes cannot be replayed)", part)
            continue
        with open(part, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    entry = json.loads(line)
                    sides[(entry["learner"], entry["index"])] = entry
    source = server_part(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(source, encoding="utf-8") as f, open(tmp, "w", encoding="utf-8") as out:
        for line in f:
            event = json.loads(line)
            if event.get("kind") == "push":
                side = sides.get((event["learner"], event["index"]))
                if side is not None:
                    if side["version"] != event["version"]:
                        raise EventLogError(
                            f"learner {event['learner']}'s push {event['index']} was computed at version "
                            f"{side['version']} by its own log, {event['version']} by the server's")
                    event.update({name: side[name] for name in SIDE_FIELDS})
            out.write(json.dumps(event, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    for part in [source, *parts]:
        if part.exists():
            part.unlink()
    return path


class LogBatchSampler:
    """A replay's training batches for a log of the real engine: the recorded micro-batches'
    dataset indices, push after push in the log's order, one epoch of the log per iteration (the
    pushes between two of its ``epoch_end`` lines), up to the stop: pushes that arrived after
    it were never applied, and the replay decides them without computing them."""

    def __init__(self, log: Any) -> None:
        pushes = log.pushes
        replayed = next((p["push"] for p in pushes if p["dropped"] == "in_flight_at_stop"), len(pushes))
        ends = [e["pushes"] for e in log.events if e["kind"] == "epoch_end"]
        bounds = [0, *[min(end, replayed) for end in ends]]
        if replayed > bounds[-1]:
            bounds.append(replayed)
        self.epochs: list[list[list[int]]] = []
        for start, stop in itertools.pairwise(bounds):
            batches = []
            for push in pushes[start:stop]:
                indices = push.get("indices")
                if not indices or any(i is None for i in indices):
                    raise EventLogError(f"{log.path}: push {push['push']} lacks its mini-batch indices "
                                        "(its learner's side log was lost): it cannot be replayed")
                batches += indices
            self.epochs.append(batches)
        self._epoch = 0

    def __len__(self) -> int:
        return max((len(e) for e in self.epochs), default=0)

    def __iter__(self):
        epoch = self.epochs[self._epoch] if self._epoch < len(self.epochs) else []
        self._epoch += 1
        yield from epoch


def module_digest(module: Any, optimizer: Any | None) -> dict:
    """`state_digest` of ``module``'s trainable parameters and persistent buffers and of
    ``optimizer``'s state (None: not known, left out of the comparison)."""
    vectors = ModelVectors.of(module)
    view = SimpleNamespace(params=vectors.params, buffers=vectors.buffers,
                           optimizer=optimizer if optimizer is not None else SimpleNamespace(state={}))
    digest = state_digest(view)
    if optimizer is None:
        digest["optimizer_sha256"] = digest["optimizer_tensors"] = None
    return digest


class EngineRecording:
    """A `StaleStrategy` fit's recording on one rank: its learner's side log and, on rank 0, the
    server's recorder; the strategy forwards its hooks here (see `LearnerLog`)."""

    def __init__(self, path: Path, rank: int, seed: int, sampler: Any) -> None:
        self.path, self.rank = path, rank
        self.learner_log = LearnerLog(learner_part(path, rank), rank, seed)
        if sampler is not None and sampler.drawn is not None:  # (Lightning draws a batch before training starts)
            self.learner_log.drawn = sampler.drawn
        self.recorder: EventRecorder | None = None  # rank 0's

    def batch_start(self, batch: Any, first: bool, learner: Any) -> None:
        carried = learner.carried
        self.learner_log.after_resume(learner.pushes, carried is not None and carried.push is not None)
        self.learner_log.start_micro_batch(batch, first, learner.version)

    def after_step(self, learner: Any, carried_before: Any) -> None:
        carried = learner.carried
        self.learner_log.after_step(learner.pushes, carried is not None and carried is not carried_before
                                    and carried.push is not None)

    def close_learner_log(self) -> None:
        """Before the learner's goodbye: the server hears it after every line is on disk."""
        self.learner_log.close()

    def finish(self, core: Any, p: int, module: Any, optimizer: Any) -> str | None:
        """Rank 0, after the server's thread ended: the stop line, then the merged log's path
        (None where the core never stopped: the server's part then reads as truncated). Where
        the core holds no state (the collective and sharded paths), the stop's digest is rank
        0's module after the fit, which holds the final parameters, with its optimizer's state
        on the collective path (every learner applies every update) and without it on the
        sharded one (each owner holds a slice)."""
        if self.recorder is None:
            return None
        self.recorder.finish(core, module_digest(module, optimizer) if core.state is None else None)
        if not self.recorder.stopped:
            return None
        return str(merge_parts(self.path, p))

    def abandon(self) -> None:
        self.learner_log.close()
        if self.recorder is not None:
            self.recorder.close()
