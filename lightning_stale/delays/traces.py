"""Recorded straggler delays: replay (`Trace`), recording (`TraceRecorder`, `RecordingDelay`).

Trace file format (written by `TraceRecorder`, replayed by `Trace`; every run of the
parameter-server engine writes one): CSV with the header ``learner,index,delay_s`` and one row
per drawn delay; ``index`` counts 0, 1, 2, ... per learner, in file order. Rows of different
learners may be interleaved. Learner l's i-th replayed delay is the row (l, i).
"""

from __future__ import annotations

import csv
import math
import os
import threading
from pathlib import Path

from lightning_stale.delays.models import DelayModel

TRACE_HEADER = ("learner", "index", "delay_s")
TRACE_FILE_NAME = "delays.csv"  # what an engine writes in its log folder


class TraceExhaustedError(RuntimeError):
    """A `Trace` with on_exhausted='error' ran out of recorded delays for a learner."""


class Trace(DelayModel):
    """Replays per-learner delays recorded in a trace file (format in the module docstring).

    Args:
        path: the CSV trace, e.g. one written by `TraceRecorder.write`.
        on_exhausted: what a learner does after its last recorded delay: "error" raises
            `TraceExhaustedError`, "cycle" replays its record again from the start.

    The trace is read once, at construction, so a pickled `Trace` needs no file access.
    Learners differ, so `mean` raises; `mean_of(learner)` is the learner's empirical mean.
    """

    _fields = ("path", "on_exhausted")
    _ON_EXHAUSTED = ("error", "cycle")

    def __init__(self, path: str | os.PathLike, on_exhausted: str = "error") -> None:
        if on_exhausted not in self._ON_EXHAUSTED:
            raise ValueError(f"Trace on_exhausted must be 'error' or 'cycle', got {on_exhausted!r}")
        self.path = os.fspath(path)
        self.on_exhausted = on_exhausted
        self._delays = self._read(Path(self.path))
        self._positions: dict[int, int] = {}

    @staticmethod
    def _read(path: Path) -> dict[int, list[float]]:
        if not path.is_file():
            raise FileNotFoundError(f"delay trace file not found: {path}")
        delays: dict[int, list[float]] = {}
        with path.open(newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None or tuple(field.strip() for field in header) != TRACE_HEADER:
                raise ValueError(
                    f"{path}, line 1: expected the header {','.join(TRACE_HEADER)!r}, got {header!r}"
                )
            for row in reader:
                where = f"{path}, line {reader.line_num}"
                if not row:
                    continue
                if len(row) != 3:
                    raise ValueError(f"{where}: expected 3 fields learner,index,delay_s, got {row!r}")
                try:
                    learner, index, delay = int(row[0]), int(row[1]), float(row[2])
                except ValueError:
                    raise ValueError(f"{where}: cannot parse {row!r} as int,int,float") from None
                if learner < 0:
                    raise ValueError(f"{where}: learner must be >= 0, got {learner}")
                if not (delay >= 0 and math.isfinite(delay)):
                    raise ValueError(f"{where}: delay_s must be a finite number >= 0, got {delay}")
                record = delays.setdefault(learner, [])
                if index != len(record):
                    raise ValueError(
                        f"{where}: learner {learner} has index {index}, expected {len(record)} "
                        "(indices count 0, 1, 2, ... per learner in file order)"
                    )
                record.append(delay)
        if not delays:
            raise ValueError(f"{path}: the trace holds no delays")
        return delays

    @property
    def learners(self) -> list[int]:
        """The learners with a record in the trace."""
        return sorted(self._delays)

    def num_recorded(self, learner: int) -> int:
        return len(self._delays.get(learner, ()))

    def sample(self, learner: int) -> float:
        record = self._delays.get(learner)
        if record is None:
            raise ValueError(f"learner {learner!r} has no delays in the trace {self.path}")
        position = self._positions.get(learner, 0)
        if position == len(record):
            if self.on_exhausted == "error":
                raise TraceExhaustedError(
                    f"learner {learner} asked for delay number {position + 1}, but the trace "
                    f"{self.path} recorded only {len(record)} for it "
                    "(use on_exhausted='cycle' to replay it)"
                )
            position = 0
        self._positions[learner] = position + 1
        return record[position]

    def reset(self) -> None:
        self._positions.clear()

    @property
    def mean(self) -> float:
        raise ValueError(
            "Trace has no common mean: each learner replays its own record; use mean_of(learner)"
        )

    def mean_of(self, learner: int) -> float:
        record = self._delays.get(learner)
        if record is None:
            raise ValueError(f"learner {learner!r} has no delays in the trace {self.path}")
        return math.fsum(record) / len(record)

    def check_learners(self, num_learners: int) -> None:
        super().check_learners(num_learners)
        extra = [learner for learner in self._delays if learner >= num_learners]
        if extra:
            raise ValueError(
                f"the trace {self.path} has delays for learners {sorted(extra)}, but there are "
                f"only {num_learners} learners (indices 0..{num_learners - 1})"
            )
        # A learner without a record would fail at its first step; say so before training.
        missing = [learner for learner in range(num_learners) if learner not in self._delays]
        if missing:
            raise ValueError(f"the trace {self.path} has no delays for learners {missing}")


class TraceRecorder:
    """Collects (learner, index, delay) rows, indexing each learner's delays 0, 1, 2, ...

    `record` is thread-safe, so learner threads may share one recorder.
    """

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float]] = []
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def record(self, learner: int, delay: float) -> None:
        with self._lock:
            index = self._counts.get(learner, 0)
            self._counts[learner] = index + 1
            self.rows.append((int(learner), index, float(delay)))

    def __len__(self) -> int:
        return len(self.rows)

    def write(self, path: str | os.PathLike) -> Path:
        """Write the trace (format in the module docstring) and return its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            rows = list(self.rows)
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(TRACE_HEADER)
            # repr of a float round-trips exactly, so Trace replays the very same values.
            writer.writerows((learner, index, repr(delay)) for learner, index, delay in rows)
        return path

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # locks cannot be pickled
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class RecordingDelay(DelayModel):
    """Draws from `model` and records every draw in `recorder` (a new one if not given).

    ``reset()`` restarts `model`'s streams but keeps the recording, so the trace stays the
    sequence of delays actually used.
    """

    _fields = ("model",)

    def __init__(self, model: DelayModel, recorder: TraceRecorder | None = None) -> None:
        if not isinstance(model, DelayModel):
            raise ValueError(f"RecordingDelay model must be a DelayModel, got {model!r}")
        self.model = model
        self.recorder = recorder if recorder is not None else TraceRecorder()

    @property
    def seed(self) -> int | None:
        return self.model.seed

    def sample(self, learner: int) -> float:
        delay = self.model.sample(learner)
        self.recorder.record(learner, delay)
        return delay

    def reset(self) -> None:
        self.model.reset()

    @property
    def mean(self) -> float:
        return self.model.mean

    def mean_of(self, learner: int) -> float:
        return self.model.mean_of(learner)

    def check_learners(self, num_learners: int) -> None:
        self.model.check_learners(num_learners)
