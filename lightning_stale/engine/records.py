"""What an engine reports about each server update: the core's `UpdateRecord`s, which
`WallClockLogger` drains through ``strategy.pop_update_records()`` (`UpdateRecordSource`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class UpdateRecord:
    """One server update w_j -> w_{j+1} (docs/method.md, update rule)."""

    update: int  # updates applied, this one included (1 for the first)
    # training seconds since the start, pauses at epoch ends excluded: wall seconds for the real
    # engine, virtual seconds for the simulator (``virtual_clock``)
    clock: float
    samples: int  # in all gradients applied so far, this update included
    loss: float  # mean training loss reported with the gradients averaged into this update
    staleness_mean: float  # mean of j - tau(l, j) over the gradients of this update
    staleness_max: int  # the largest j - tau(l, j) in this update
    num_gradients: int  # gradients averaged (K, or fewer after a flush)
    k: int  # the K in force for this update
    learners: tuple[int, ...] = ()  # the learner of each gradient averaged, in arrival order


@runtime_checkable
class UpdateRecordSource(Protocol):
    """What a strategy offers the callbacks: rank 0's update records, and if their clock is virtual."""

    virtual_clock: bool

    def pop_update_records(self) -> list[UpdateRecord]: ...
