"""What an engine reports about each server update, for loggers and plots.

The server core (`engine.core`) keeps a queue of `UpdateRecord`s that `WallClockLogger` drains
through ``strategy.pop_update_records()`` (the `UpdateRecordSource` contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class UpdateRecord:
    """One server update w_j -> w_{j+1} (docs/method.md, update rule).

    Attributes:
        update: how many updates the server has applied, this one included (1 for the first).
        clock: training seconds since the start when the update was applied, pauses at epoch
            ends excluded: wall seconds for the real engine, virtual seconds for the simulator
            (see ``virtual_clock``).
        samples: samples in all gradients applied so far, this update included.
        loss: mean training loss reported with the gradients averaged into this update.
        staleness_mean: mean of j - tau(l, j) over the gradients of this update.
        staleness_max: the largest j - tau(l, j) in this update.
        num_gradients: how many gradients were averaged (K, or fewer after a flush).
        k: the K in force for this update.
        learners: the learner of each gradient averaged, in arrival order.
    """

    update: int
    clock: float
    samples: int
    loss: float
    staleness_mean: float
    staleness_max: int
    num_gradients: int
    k: int
    learners: tuple[int, ...] = ()


@runtime_checkable
class UpdateRecordSource(Protocol):
    """What a strategy offers the callbacks (`WallClockLogger`): its server's update records
    since the last call (on global rank 0), and whether their clock is virtual."""

    virtual_clock: bool

    def pop_update_records(self) -> list[UpdateRecord]: ...
