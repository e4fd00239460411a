"""Recorded straggler delays: replay (`Trace`), recording (`TraceRecorder`, `RecordingDelay`).

Trace file format (written by `TraceRecorder`, replayed by `Trace`; every run of the
parameter-server engine writes one): CSV with the header ``learner,index,delay_s`` and one row
per drawn delay; ``index`` counts 0, 1, 2, ... per learner, in file order. Rows of different
learners may be interleaved. Learner l's i-th replayed delay is the row (l, i).

Extra columns may follow the three required ones (e.g. ``compute_s,total_s`` in the mini-batch
times written by `lightning_stale.strategies.timing.MiniBatchTimer`): `Trace` and `Empirical`
ignore them unless asked to use one (``column=``). An empty cell in an extra column means "not
known for this mini-batch": the row is left out of that column's record.

`Empirical` resamples recorded times instead of replaying them in order.
"""

from __future__ import annotations

import csv
import math
import os
import threading
from pathlib import Path

import numpy as np

from lightning_stale.delays.models import DelayModel, _check_seed

TRACE_HEADER = ("learner", "index", "delay_s")
TRACE_FILE_NAME = "delays.csv"  # what an engine writes in its log folder


def read_trace(path: str | os.PathLike, column: str = "delay_s"
               ) -> tuple[tuple[str, ...], dict[int, list[float]]]:
    """The header of a trace file and, per learner, the values of `column` in file order.

    Checks the format of the module docstring: the header starts with ``learner,index,delay_s``,
    every row has one field per header column, ``index`` counts 0, 1, 2, ... per learner, and
    every value is a finite number >= 0 (an empty cell in an extra column leaves the row out of
    that column's record). Raises FileNotFoundError or ValueError naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"delay trace file not found: {path}")
    values: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        columns = tuple(field.strip() for field in header or ())
        if columns[:3] != TRACE_HEADER:
            raise ValueError(
                f"{path}, line 1: expected the header {','.join(TRACE_HEADER)!r} (extra columns "
                f"may follow), got {header!r}"
            )
        if column not in columns:
            raise ValueError(f"{path}: no column {column!r}; the trace has {', '.join(columns)}")
        position = columns.index(column)
        for row in reader:
            where = f"{path}, line {reader.line_num}"
            if not row:
                continue
            if len(row) != len(columns):
                raise ValueError(
                    f"{where}: expected {len(columns)} fields {','.join(columns)}, got {row!r}")
            try:
                learner, index, delay = int(row[0]), int(row[1]), float(row[2])
                cell = row[position].strip()
                value = float(cell) if cell else None
            except ValueError:
                raise ValueError(f"{where}: cannot parse {row!r} as int,int,float"
                                 f"{',float' * (len(columns) - 3)}") from None
            if learner < 0:
                raise ValueError(f"{where}: learner must be >= 0, got {learner}")
            for name, number in ((TRACE_HEADER[2], delay), (column, value)):
                if number is not None and not (number >= 0 and math.isfinite(number)):
                    raise ValueError(f"{where}: {name} must be a finite number >= 0, got {number}")
            expected = counts.get(learner, 0)
            if index != expected:
                raise ValueError(
                    f"{where}: learner {learner} has index {index}, expected {expected} "
                    "(indices count 0, 1, 2, ... per learner in file order)"
                )
            counts[learner] = expected + 1
            if value is not None:
                values.setdefault(learner, []).append(value)
    if not values:
        what = "delays" if column == TRACE_HEADER[2] else f"values in column {column!r}"
        raise ValueError(f"{path}: the trace holds no {what}")
    return columns, values


class TraceExhaustedError(RuntimeError):
    """A `Trace` with on_exhausted='error' ran out of recorded delays for a learner."""


class Trace(DelayModel):
    """Replays per-learner delays recorded in a trace file (format in the module docstring).

    Args:
        path: the CSV trace, e.g. one written by `TraceRecorder.write`.
        on_exhausted: what a learner does after its last recorded delay: "error" raises
            `TraceExhaustedError`, "cycle" replays its record again from the start.
        column: the column replayed: ``delay_s`` (default) or an extra column of the file,
            e.g. ``compute_s`` of a `MiniBatchTimer` trace.

    The trace is read once, at construction, so a pickled `Trace` needs no file access.
    Learners differ, so `mean` raises; `mean_of(learner)` is the learner's empirical mean.
    """

    _fields = ("path", "on_exhausted", "column")
    _ON_EXHAUSTED = ("error", "cycle")

    def __init__(self, path: str | os.PathLike, on_exhausted: str = "error",
                 column: str = "delay_s") -> None:
        if on_exhausted not in self._ON_EXHAUSTED:
            raise ValueError(f"Trace on_exhausted must be 'error' or 'cycle', got {on_exhausted!r}")
        self.path = os.fspath(path)
        self.on_exhausted = on_exhausted
        self.column = column
        self.columns, self._delays = read_trace(Path(self.path), column)
        self._positions: dict[int, int] = {}

    @property
    def learners(self) -> list[int]:
        """The learners with a record in the trace."""
        return sorted(self._delays)

    def num_recorded(self, learner: int) -> int:
        return len(self._delays.get(learner, ()))

    def delays_of(self, learner: int) -> tuple[float, ...]:
        """`learner`'s recorded values of the replayed column, in order (empty if none)."""
        return tuple(self._delays.get(learner, ()))

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
        """Write the trace (format in the module docstring) and return its path. The file is
        replaced atomically: a reader never sees a partial trace, even if the process dies."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            rows = list(self.rows)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with partial.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(TRACE_HEADER)
            # repr of a float round-trips exactly, so Trace replays the very same values.
            writer.writerows((learner, index, repr(delay)) for learner, index, delay in rows)
        os.replace(partial, path)
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
    def seed(self) -> int | None:  # type: ignore[override]  # read-only: the wrapped model owns it
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


class Empirical(DelayModel):
    """Delays drawn with replacement from recorded times: the empirical distribution of a trace.

    Where `Trace` replays a record in order, `Empirical` resamples it (the bootstrap), so a short
    trace serves runs of any length and, pooled, any number of learners: docs/method.md ("Setting")
    takes X i.i.d. across learners and mini-batches, and the empirical distribution is its
    nonparametric maximum-likelihood estimate.

    Args:
        path: a trace file (format in the module docstring) or a `Trace`.
        column: the column resampled (``delay_s``, or e.g. ``compute_s``, ``total_s``).
        per_learner: False (default): every learner draws from all recorded values, pooled.
            True: learner l draws only from learner l's record (keeps persistently slow
            machines; every learner that draws needs a record).
        seed: each learner's draws come from ``numpy.random.default_rng([seed, learner])``, as
            for the other random models; ``reset()`` restarts them.
        discard_first: values left out at the start of every learner's record (warm-up).
    """

    _fields = ("path", "column", "per_learner", "seed", "discard_first")
    seed: int

    def __init__(self, path: str | os.PathLike | Trace, column: str = "delay_s",
                 per_learner: bool = False, seed: int = 0, discard_first: int = 0) -> None:
        if isinstance(path, Trace):
            if column != path.column:
                path = Trace(path.path, column=column)
            self.path, records = path.path, {l: list(path.delays_of(l)) for l in path.learners}
        else:
            self.path = os.fspath(path)
            records = read_trace(Path(self.path), column)[1]
        if isinstance(discard_first, bool) or int(discard_first) != discard_first \
                or discard_first < 0:
            raise ValueError(f"discard_first must be an integer >= 0, got {discard_first!r}")
        self.column = column
        self.per_learner = bool(per_learner)
        self.seed = _check_seed(seed)
        self.discard_first = int(discard_first)
        self._records = {learner: np.asarray(values[self.discard_first:], dtype=float)
                         for learner, values in records.items()
                         if len(values) > self.discard_first}
        if not self._records:
            raise ValueError(f"{self.path}: no {column} values left after discarding the first "
                             f"{self.discard_first} of every learner")
        self._pooled = np.concatenate([self._records[l] for l in sorted(self._records)])
        self._streams: dict[int, tuple[np.random.Generator, list[float]]] = {}

    @property
    def learners(self) -> list[int]:
        """The learners with a record."""
        return sorted(self._records)

    def values(self, learner: int | None = None) -> np.ndarray:
        """The values `learner` draws from (all of them, pooled, for None or when pooled)."""
        if learner is None or not self.per_learner:
            return self._pooled
        record = self._records.get(learner)
        if record is None:
            raise ValueError(f"learner {learner!r} has no {self.column} values in {self.path}; "
                             f"recorded learners: {self.learners} (or use per_learner=False)")
        return record

    def sample(self, learner: int) -> float:
        stream = self._streams.get(learner)
        if stream is None or not stream[1]:
            if stream is None:
                if isinstance(learner, bool) or int(learner) != learner or learner < 0:
                    raise ValueError(f"learner index must be an integer >= 0, got {learner!r}")
                stream = (np.random.default_rng([self.seed, int(learner)]), [])
                self._streams[learner] = stream
            # A block of draws at a time, reversed so that pop() hands them out in order.
            stream[1].extend(stream[0].choice(self.values(learner), 256)[::-1].tolist())
        return stream[1].pop()

    def reset(self) -> None:
        self._streams.clear()

    @property
    def mean(self) -> float:
        if self.per_learner:
            raise ValueError("Empirical(per_learner=True) has no common mean: each learner "
                             "draws from its own record; use mean_of(learner)")
        return float(np.mean(self._pooled))

    def mean_of(self, learner: int) -> float:
        return float(np.mean(self.values(learner)))

    def check_learners(self, num_learners: int) -> None:
        super().check_learners(num_learners)
        missing = [l for l in range(num_learners) if l not in self._records]
        if self.per_learner and missing:
            raise ValueError(
                f"Empirical(per_learner=True): the trace {self.path} has no {self.column} values "
                f"for learners {missing}; use per_learner=False to pool all recorded values")
