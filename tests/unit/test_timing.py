"""MiniBatchTimer in one process: what it measures, the optional `minibatch_times` protocol, and
the simulated engine. The multi-process gather is in tests/integration/test_minibatch_timer.py."""

from __future__ import annotations

import csv
import logging
import time

import pytest
import torch
from pytorch_lightning import Callback, Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import SingleDeviceStrategy

from lightning_stale import SimulatedStaleStrategy
from lightning_stale.delays import Exponential, Trace, fit
from fake_clock import FakeTime
from lightning_stale.strategies import timing as timing_module
from lightning_stale.strategies.timing import MINIBATCH_COLUMNS, MiniBatchTimer

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
             accelerator="cpu", devices=1)


class Sleep(Callback):
    """Takes `seconds` of ``clock`` in on_before_optimizer_step (after backward)."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def on_before_optimizer_step(self, *args):
        self.clock.sleep(self.seconds)


class ReportX(Callback):
    """Plays an engine that fills the `minibatch_times` protocol: one X per training batch."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.strategy.minibatch_times.append(1.0 + batch_idx)


def read(path):
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        return next(reader), list(reader)


def test_computation_counts_callbacks_before_the_timer_and_not_after(tmp_path, monkeypatch):
    clock = FakeTime()  # only the two callbacks take time on it
    monkeypatch.setattr(timing_module, "perf_counter", clock.perf_counter)
    timer = MiniBatchTimer(tmp_path / "out")
    trainer = Trainer(max_steps=6, callbacks=[Sleep(clock, 0.02), timer, Sleep(clock, 0.05)], **QUIET)
    trainer.fit(BoringModel())
    assert timer.written == tmp_path / "out" / "minibatch_times.csv"
    header, rows = read(timer.written)
    assert tuple(header) == MINIBATCH_COLUMNS
    assert [(r[0], r[1]) for r in rows] == [("0", str(i)) for i in range(6)]
    compute = [float(r[3]) for r in rows]
    assert compute == pytest.approx([0.02] * 6)  # the sleep before counts, the one after not
    assert all(r[4] == "" and r[2] == r[3] for r in rows)  # no X reported: delay_s = compute_s
    assert Trace(timer.written).learners == [0]


def test_x_reported_by_the_strategy_fills_total_and_delay(tmp_path):
    # An engine appends X inside its optimizer step; ReportX, listed before the timer, does so
    # before the timer's on_train_batch_end.
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.minibatch_times = []
    timer = MiniBatchTimer(tmp_path / "y.csv")
    trainer = Trainer(max_steps=5, strategy=strategy, callbacks=[ReportX(), timer], **QUIET)
    trainer.fit(BoringModel())
    rows = read(timer.written)[1]
    assert [float(r[4]) for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r[2] for r in rows] == [r[4] for r in rows]  # delay_s is X where known
    assert Trace(timer.written, column="total_s").delays_of(0) == (1.0, 2.0, 3.0, 4.0, 5.0)


def test_simulated_engine_records_every_push_with_its_virtual_x(tmp_path):
    torch.manual_seed(0)
    timer = MiniBatchTimer(tmp_path)
    strategy = SimulatedStaleStrategy("k_async", 2, num_learners=3, delay=Exponential(0.1, seed=0))
    trainer = Trainer(max_steps=8, strategy=strategy, callbacks=[Sleep(time, 0.002), timer], **QUIET)
    trainer.fit(BoringModel())
    rows = read(timer.written)[1]
    assert len(rows) == strategy.stats["gradients_received"] >= 2 * trainer.global_step == 16
    assert all(float(r[3]) >= 0.002 for r in rows)  # compute_s: the real computation
    delays = Exponential(0.1, seed=0)
    drawn = [delays.sample(learner) for learner in range(3) for _ in range(40)]
    # total_s: the virtual X of each push, one of the simulated learners' draws
    assert all(min(abs(float(r[4]) - d) for d in drawn) < 1e-12 for r in rows)
    assert [r[2] for r in rows] == [r[4] for r in rows]  # delay_s replays X where it is known
    assert fit(timer.written).n == len(rows)


def test_bad_path_is_named():
    with pytest.raises(ValueError, match=r"path must be None or a path, got 3"):
        MiniBatchTimer(3)
