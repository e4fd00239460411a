"""Recording a run's events from the server core: the observer every engine hands `ServerCore`.

`EventRecorder` turns what the core tells it (docs/replay.md; `engine.core`, "Observer") into
the lines of `lightning_stale.replay.events`. What only the engine knows about a push (the
mini-batch it drew, the seed of its random state) is handed in before the push with
`EventRecorder.next_push`.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_stale.replay.events import FORMAT, FORMAT_VERSION, state_digest


class EventRecorder:
    """Writes the events of one run through ``writer`` (`EventWriter` or `MemoryWriter`).

    Args:
        writer: where the lines go.
        header: the header's fields besides ``kind``, ``format`` and ``version``.
        digest_every: a digest of the server's state after every ``digest_every``-th update
            (and at the stop); 0 for the stop only.
    """

    def __init__(self, writer: Any, header: dict, digest_every: int = 1) -> None:
        if isinstance(digest_every, bool) or not isinstance(digest_every, int) or digest_every < 0:
            raise ValueError(f"digest_every must be an integer >= 0, got {digest_every!r}")
        self.writer, self.digest_every = writer, digest_every
        self._extra: dict = {}
        self._pushes = 0
        self._epochs = 0
        self._stopped = False
        self._removed: set[int] = set()
        writer.write({"kind": "header", "format": FORMAT, "version": FORMAT_VERSION,
                      **header, "digest_every": digest_every})

    @property
    def path(self) -> str | None:
        return self.writer.path

    @property
    def stop_digest(self) -> dict | None:
        """The digest of the server's state at the stop (None before it)."""
        return self._stop_event.get("digest") if self._stopped else None

    # ------------------------------------------------------------------ from the engine
    def next_push(self, **extra: Any) -> None:
        """Fields of the next push only the engine knows (``draw``, ``batches``, ``batch``,
        ``rng``); they go into the next push's line."""
        self._extra = extra

    @property
    def stopped(self) -> bool:
        """The core stopped (`finish` then writes the stop line)."""
        return self._stopped

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ from the core
    def on_push(self, core: Any, decision: Any, clock: float, loss: float) -> None:
        push = decision.push
        index = core.rules.counts.pushes_per_learner[push.learner] - 1
        self._pushes += 1
        self.writer.write({
            "kind": "push", "push": push.id, "learner": push.learner, "index": index,
            "version": push.version, "t": core.running_time(clock),
            "loss": None if loss is None or math.isnan(loss) else float(loss),
            "accepted": decision.accepted, "dropped": decision.dropped,
            "update": decision.update.index if decision.update is not None else None,
            "cancel": list(decision.cancel), **self._extra})
        self._extra = {}

    def on_update(self, core: Any, update: Any, order: tuple[int, ...],
                  weights: tuple[float, ...] | None, lrs: tuple[float, ...] | None) -> None:
        by_id = {g.id: (g.learner, s) for g, s in zip(update.gradients, update.staleness)}
        event = {"kind": "update", "update": update.index, "version": update.version,
                 "contributions": list(order), "learners": [by_id[i][0] for i in order],
                 "staleness": [by_id[i][1] for i in order],
                 "weights": None if weights is None else [float(w) for w in weights],
                 "lr": None if lrs is None else list(lrs), "k": core.rules.k}
        if self.digest_every and update.index % self.digest_every == 0 and core.state is not None:
            event["digest"] = state_digest(core.state)
        self.writer.write(event)

    def on_epoch_end(self, core: Any) -> None:
        self._epochs += 1
        self.writer.write({"kind": "epoch_end", "epoch": core.epoch, "updates": core.updates,
                           "pushes": self._pushes})

    def on_validation(self, core: Any, metrics: Any) -> None:
        """The logged values an epoch's end hands its schedulers (after its validation)."""
        self.writer.write({"kind": "validation", "epoch": core.epoch,
                           "metrics": {k: float(v) for k, v in sorted(metrics.items())}})

    def on_remove_learner(self, core: Any, learner: int, clock: float) -> None:
        if learner in self._removed:  # (the real server may hear of one death on two threads)
            return
        self._removed.add(learner)
        self.writer.write({"kind": "remove_learner", "learner": learner, "t": core.running_time(clock)})

    def on_stop(self, core: Any, pending: tuple[int, ...]) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stop_event = {"kind": "stop", "updates": core.updates, "epochs": self._epochs,
                            "in_flight": sorted(pending),
                            "digest": state_digest(core.state) if core.state is not None else None}

    def finish(self, core: Any, final_digest: dict | None = None) -> None:
        """Write the stop line (with every push counted, those after the stop included) and
        close. ``final_digest``: the stop's digest where the core holds no state (the engine's
        final parameters, taken elsewhere). Nothing is written if the core never stopped: the
        log then reads as truncated."""
        if self._stopped:
            if self._stop_event["digest"] is None:
                self._stop_event["digest"] = final_digest
            self.writer.write({**self._stop_event, "pushes": self._pushes,
                               "epochs": self._epochs})
        self.close()
