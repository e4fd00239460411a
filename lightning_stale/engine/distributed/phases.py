"""Where a learner stands in its protocol with the server (`Phase`), and the moves allowed
between phases, in one table (`MOVES`); `advance` refuses any other move."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lightning_stale.engine.distributed.messages import Message


class Phase(Enum):
    COMPUTING = "computing"  # a mini-batch runs (or the first parameters are awaited)
    PUSHED = "pushed"  # the push has left; its answer is awaited
    PAUSED = "paused"  # the server ended an epoch: validation; work in flight is carried over
    STOPPED = "stopped"  # the server's STOP was taken: training is over
    LEFT = "left"  # goodbye said, the STOP not heard yet
    DONE = "done"  # goodbye said and the STOP taken
    FAILED = "failed"  # the run failed (raised here, or this learner's abort sent)


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.COMPUTING: frozenset({Phase.PUSHED, Phase.PAUSED, Phase.STOPPED, Phase.LEFT, Phase.FAILED}),
    Phase.PUSHED: frozenset({Phase.COMPUTING, Phase.PAUSED, Phase.STOPPED, Phase.FAILED}),
    # (resuming: computing again, or waiting on for the answer to a push carried over)
    Phase.PAUSED: frozenset({Phase.COMPUTING, Phase.PUSHED, Phase.STOPPED, Phase.LEFT, Phase.FAILED}),
    Phase.STOPPED: frozenset({Phase.DONE, Phase.FAILED}),
    Phase.LEFT: frozenset({Phase.DONE, Phase.FAILED}),
    Phase.DONE: frozenset({Phase.FAILED}),
    Phase.FAILED: frozenset(),
}


class ServerFailed(RuntimeError):
    """The server, the transport or another learner failed; training cannot go on."""


class RunInterrupted(RuntimeError):
    """A signal (SIGTERM, SIGINT) on some process stopped the run before it finished."""


class ProtocolError(RuntimeError):
    """A learner tried a move its protocol does not allow (an error in the engine)."""


def advance(current: Phase, to: Phase) -> Phase:
    """``to``, where `MOVES` allows it from ``current`` (staying is always allowed)."""
    if to is not current and to not in MOVES[current]:
        allowed = ", ".join(sorted(p.value for p in MOVES[current])) or "nothing"
        raise ProtocolError(f"a learner cannot go from {current.value} to {to.value} (from "
                            f"{current.value}: {allowed})")
    return to


@dataclass
class Carried:
    """A mini-batch in flight at an epoch's end: its push (None: pushed), delay, time waited."""

    push: Message | None
    delay: float | None = None
    waited: float = 0.0


@dataclass
class Events:
    """What a batch of server messages meant for the work in progress."""

    refreshed: bool = False  # new parameters: an answer, or a cancellation while computing
    answered: bool = False  # leave to go on with the parameters held
    paused: bool = False  # an epoch ended
    stopped: bool = False
    epoch_ending: bool = False  # an answer counted one more epoch: its end follows

    def merge(self, other: Events) -> Events:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) or value)
        return self

    @property
    def interrupts(self) -> bool:
        return self.refreshed or self.stopped
