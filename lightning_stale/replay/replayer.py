"""Re-executing a recorded run in one process, following its event log instead of a clock.

`ReplayServer` is the simulated engine (`engine.simulated.SimulatedServer`) with the virtual
clock replaced by the log: the next learner to push, the version it computed at and the time
of its push are the log's, and the server core decides and applies as in any run. Each push is
computed (by the caller: `SimulatedStaleStrategy`) at the recorded version, on the recorded
mini-batch, with torch's generators seeded with the recorded seed. The replay records its own
events in memory through the same `EventRecorder` and compares them, line by line, with the
log's: the push decisions, each update's contributions, order, weights, learning rates and K,
and the digests of the server's state. `ReplayComparison.report` is ``strategy.replay_report``.

Options that do not change the event order may differ from the recorded run's (learning rate,
staleness compensation, the optimizer): the replay then answers "what would this run have done
on the same arrival pattern"; its report lists where it went another way.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from torch import Tensor

from lightning_stale.engine.core import Outcome, ServerCore, ServerLimits
from lightning_stale.engine.simulated import SimulatedServer
from lightning_stale.engine.state import Contribution, ServerState
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import Finish
from lightning_stale.replay.events import EventLog, relative_difference
from lightning_stale.replay.recorder import EventRecorder

MAX_DIFFERENCES = 20  # differences listed in the report (all are counted)
_PUSH_FIELDS = ("learner", "index", "version", "accepted", "dropped", "update", "cancel", "draw",
                "batches", "batch", "loss")
_DRAWN = ("draw", "batches", "batch", "rng", "indices")  # what a push drew
_UPDATE_FIELDS = ("version", "contributions", "learners", "staleness", "weights", "lr", "k")


class ReplayComparison:
    """Compares a replay's events with the log's as they come (see the module docstring)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.differences: list[dict] = []
        self.count = 0
        self.checked_updates = 0
        self.final_checked = False  # the stop's digest was compared
        self.max_relative_difference = 0.0
        self.first_differing_update: int | None = None
        self._seen: defaultdict[str, int] = defaultdict(int)
        self._losses: list[float | None] = []  # the replay's push losses
        self.changed_options: dict[str, list] = {}  # option -> [recorded, replayed]

    def differ(self, what: str, recorded: Any, replayed: Any, update: int | None = None,
               push: int | None = None, relative: float | None = None) -> None:
        self.count += 1
        if update is not None and self.first_differing_update is None:
            self.first_differing_update = update
        if len(self.differences) < MAX_DIFFERENCES:
            entry = {"update": update, "push": push, "what": what, "recorded": recorded,
                     "replayed": replayed}
            if relative is not None:
                entry["relative_difference"] = relative
            self.differences.append(entry)

    def write(self, event: dict) -> None:
        """One event of the replay (the `EventRecorder`'s writer)."""
        kind = event["kind"]
        if kind == "header":
            return
        if kind == "push":
            self._push(event)
        elif kind == "update":
            self._update(event)
        elif kind == "epoch_end":
            self._other(event)
        elif kind == "validation" and self.log.header["engine"] != "stale":
            self._other(event)
        elif kind == "validation":  # a real run's metrics are rank 0's, not the replay's: the epoch only
            self._other({"kind": kind, "epoch": event["epoch"]}, ("kind", "epoch"))

    path = None

    def close(self) -> None:
        pass

    def _push(self, mine: dict) -> None:
        n = mine["push"]
        self._losses.append(mine.get("loss"))
        if n >= len(self.log.pushes):
            self.differ("push", None, {k: mine.get(k) for k in _PUSH_FIELDS}, push=n)
            return
        theirs = self.log.pushes[n]
        for name in _PUSH_FIELDS:
            if name in theirs and theirs.get(name) != mine.get(name):
                self.differ(f"push.{name}", theirs.get(name), mine.get(name), update=None, push=n)

    def _update(self, mine: dict) -> None:
        j = mine["update"]
        if j > len(self.log.updates):
            self.differ("update", None, "made by the replay only", update=j)
            return
        theirs = self.log.updates[j - 1]
        for name in _UPDATE_FIELDS:
            if name == "lr" and theirs.get("lr") is None:
                continue  # a server that does not apply updates does not know them
            if _plain(name, theirs) != _plain(name, mine):
                self.differ(f"update.{name}", theirs.get(name), mine.get(name), update=j)
        if "digest" in theirs and "digest" in mine:
            self.checked_updates += 1
            self.compare_digests(theirs["digest"], mine["digest"], j)

    def compare_digests(self, theirs: dict, mine: dict, update: int | None) -> None:
        layout = self.log.header["parameters"]
        for key, label in (("tensors", "parameters"), ("optimizer_tensors", "optimizer state")):
            a_list, b_list = theirs[key], mine[key]
            if a_list is None:  # not recorded (the sharded path's optimizer state)
                continue
            if len(a_list) != len(b_list):
                self.differ(f"{label} tensors", len(a_list), len(b_list), update=update)
                continue
            worst, where = 0.0, None
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                if key == "optimizer_tensors":  # [name, numel, sum, norm]
                    name, numel, a, b = a[0], a[1], a[2:], b[2:]
                else:
                    name, numel = layout[i][0], math.prod(layout[i][1])
                r = relative_difference(a, b, numel)
                if r > worst or (where is None and r > 0):
                    worst, where = r, (name, a, b)
            self.max_relative_difference = max(self.max_relative_difference, worst)
            hash_key = "sha256" if key == "tensors" else "optimizer_sha256"
            if theirs[hash_key] != mine[hash_key]:
                self.differ(f"{label} ({hash_key})", theirs[hash_key][:16], mine[hash_key][:16],
                            update=update, relative=worst)
                if where is not None:
                    tensor = where[0]
                    self.differences[-1]["tensor"] = tensor
                    self.differences[-1]["recorded_sum_norm"] = where[1]
                    self.differences[-1]["replayed_sum_norm"] = where[2]

    def _other(self, mine: dict, fields: tuple[str, ...] | None = None) -> None:
        """Compare ``mine`` with the log's event of its kind and rank (on ``fields`` only, if given)."""
        kind = mine["kind"]
        recorded = [e for e in self.log.events if e["kind"] == kind]
        i = self._seen[kind]
        self._seen[kind] += 1
        if i >= len(recorded):
            self.differ(kind, None, mine)
            return
        theirs = recorded[i] if fields is None else {k: recorded[i].get(k) for k in fields}
        if theirs != mine:
            self.differ(kind, theirs, mine)

    def finish(self, replayed_pushes: int, updates: int, final_digest: dict | None) -> None:
        """The replay ended after ``replayed_pushes`` pushes and ``updates`` updates."""
        stop = self.log.stop
        if replayed_pushes != len(self.log.pushes):
            self.differ("pushes", len(self.log.pushes), replayed_pushes)
        if updates != stop["updates"]:
            self.differ("updates", stop["updates"], updates)
        if stop.get("digest") and final_digest:
            self.compare_digests(stop["digest"], final_digest, None)
            self.final_checked = True

    def late_loss(self) -> dict:
        """Mean training loss of the last quarter of the pushes, recorded and replayed: how the
        two runs compare at their end (a counterfactual's answer at a glance)."""
        n = min(len(self._losses), len(self.log.pushes))
        start = n - max(1, n // 4)

        def mean(values: list) -> float:
            kept = [v for v in values if v is not None]
            return sum(kept) / len(kept) if kept else math.nan

        return {"pushes": [start, n], "recorded": mean([p.get("loss") for p in self.log.pushes[start:n]]),
                "replayed": mean(self._losses[start:n])}

    def report(self) -> dict:
        return {"checked_updates": self.checked_updates, "final_checked": self.final_checked,
                "max_relative_difference": self.max_relative_difference,
                "differences": list(self.differences), "difference_count": self.count,
                "first_differing_update": self.first_differing_update,
                "identical": self.count == 0, "late_loss": self.late_loss(),
                "changed_options": dict(self.changed_options), "log": self.log.path}


def _plain(name: str, event: dict) -> Any:
    """A field as compared: no weights are weights of 1."""
    value = event.get(name)
    if name == "weights" and value is None:
        return [1.0] * len(event["contributions"])
    return value


class ReplayServer(SimulatedServer):
    """A `SimulatedServer` whose pushes come from ``log`` (see the module docstring).

    Args:
        state: the server's parameters and optimizer.
        variant: the recorded variant (with the K of its first update).
        log: the log, read and checked (`read_events`).
        compensation: staleness compensation for this replay (None: none), which may differ
            from the recorded run's.
    """

    def __init__(self, state: ServerState, variant: Variant, log: EventLog,
                 compensation: StalenessCompensation | None = None) -> None:
        self.log = log
        self.comparison = ReplayComparison(log)
        replayed = {"optimizer": type(state.optimizer).__qualname__,
                    "staleness_compensation": None if compensation is None else repr(compensation)}
        for name, value in replayed.items():
            if log.header.get(name) != value:
                self.comparison.changed_options[name] = [log.header.get(name), value]
        header = {k: v for k, v in log.header.items() if k not in ("kind", "format", "version", "digest_every")}
        self.recorder = EventRecorder(self.comparison, header, log.header["digest_every"])
        self.core = ServerCore(variant, state, ServerLimits(), None, compensation,
                               keep_snapshots=compensation is not None, observer=self.recorder)
        self.cluster = None  # type: ignore[assignment]  # the log, not a clock, orders the pushes
        self.now = 0.0
        self._next = 0  # the next recorded push
        # Versions later pushes were computed at: their snapshots are kept until the last of them.
        self._last_use: dict[int, int] = {}
        for p in log.pushes:
            self._last_use[p["version"]] = p["push"]
        self._versions: dict[int, Tensor] = {}
        self._keep(0)
        self._set_k()
        # The real engine's learner loads a version's parameters and buffers once, and computes
        # its next push at the same version with the buffers its forward passes left (BatchNorm
        # statistics); the simulated engine's reloads them for every push.
        self.keeps_buffers = log.header["engine"] == "stale"
        self._learner_buffers: dict[int, tuple[int, Tensor]] = {}  # learner -> (version, buffers)
        # Learners that died (on_learner_failure="continue"), by the push they were removed before.
        self._removals: dict[int, list[int]] = {}
        pushes_seen = 0
        for event in log.events:
            if event["kind"] == "push":
                pushes_seen += 1
            elif event["kind"] == "remove_learner":
                self._removals.setdefault(pushes_seen, []).append(event["learner"])

    def next_push(self) -> dict:
        """The next recorded push (its ``draw``, ``rng`` ...); `next_finish` moves past it."""
        if self._next >= len(self.log.pushes):
            raise RuntimeError(f"the replay needs push {self._next}, but {self.log.path} holds "
                               f"{len(self.log.pushes)} pushes: replay with the recorded run's "
                               "Trainer options (max_steps, max_epochs, limit_train_batches)")
        return self.log.pushes[self._next]

    def current_push(self) -> dict:
        """The recorded push the replay is computing (the one `next_finish` returned last)."""
        return self.log.pushes[self._next - 1]

    def next_finish(self) -> Finish:
        self._remove_learners()
        push = self.next_push()
        self._next += 1
        self.now = push["t"]
        return Finish(push["t"], push["learner"], push["version"], push["t"])

    def parameters_for(self, finish: Finish) -> Tensor:
        if finish.version not in self._versions:
            raise RuntimeError(f"the log asks for version {finish.version}, which the replay never "
                               f"made (it is at version {self.core.version})")
        kept = self._learner_buffers.get(finish.learner)
        if kept is None or kept[0] != finish.version:
            return self._versions[finish.version]
        vector = self._versions[finish.version].clone()
        vector[self.state.vectors.numel:] = kept[1]
        return vector

    def push(self, finish: Finish, contribution: Contribution | None, loss: float, samples: int,
             unusable: str | None = None) -> Outcome:
        if self.keeps_buffers and contribution is not None and contribution.buffers is not None:
            self._learner_buffers[finish.learner] = (finish.version, contribution.buffers.clone())
        outcome = self.core.push(finish.learner, finish.version, self.now, contribution=contribution,
                                 loss=loss, samples=samples, unusable=unusable)
        if outcome.update is not None:
            self._keep(outcome.update.version)
            self._set_k()
        done = self._next - 1
        for version in [v for v in self._versions if self._last_use[v] <= done]:
            del self._versions[version]
        return outcome

    def end_epoch(self, metrics=None) -> None:
        self.core.end_epoch()
        self.core.begin_epoch(self.now, metrics)

    def stats(self) -> dict:
        return {**self.core.stats(), "virtual_time_s": self.now}

    def stop(self) -> None:
        """The replay's training is over; the pushes the log has after its stop (which arrived
        when the recorded server had stopped: counted in flight, never applied) are decided now,
        without being computed."""
        self._remove_learners()
        self.core.stop()
        while self._next < len(self.log.pushes):
            push = self.log.pushes[self._next]
            self._next += 1
            self.now = push["t"]
            # (never computed: what the recorded learner drew is carried over as it is)
            self.recorder.next_push(**{k: push[k] for k in _DRAWN if k in push})
            self.core.push(push["learner"], push["version"], self.now, loss=push["loss"] or math.nan)

    def _remove_learners(self) -> None:
        """The learners the log removes before the next push, removed where the log says (K is
        clamped to the learners left, which may complete an update)."""
        for learner in self._removals.pop(self._next, []):
            outcome = self.core.remove_learner(learner, self.now)
            if outcome.update is not None:
                self._keep(outcome.update.version)
                self._set_k()

    @property
    def epochs_recorded(self) -> int:
        return sum(e["kind"] == "epoch_end" for e in self.log.events)

    def finish(self) -> dict:
        """Compare the end of the replay with the log's; returns the report."""
        self.comparison.finish(self._next, self.core.updates, self.recorder.stop_digest)
        return self.comparison.report()

    def _keep(self, version: int) -> None:
        if version in self._last_use:  # a later push was computed at it
            self._versions[version] = self.state.snapshot(version)

    def _set_k(self) -> None:
        """The K in force for the next update, as recorded (AdaSync changes it between updates)."""
        j = self.core.updates
        if j < len(self.log.updates):
            k = self.log.updates[j]["k"]
            if k != self.core.rules.k and not math.isnan(k):
                self.core.rules.set_k(k)
