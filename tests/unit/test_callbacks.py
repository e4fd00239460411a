import csv
import time
from types import SimpleNamespace

import pytest
import torch
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.trainer.states import TrainerFn
from torch.utils.data import DataLoader, TensorDataset

import lightning_stale.strategies.callbacks as callbacks_module
from fake_clock import FakeTime
from lightning_stale.strategies.callbacks import METRIC_NAMES, WallClockLogger, _batch_size
from lightning_stale.engine.records import UpdateRecord

BATCH = 4


class TinyRegression(LightningModule):
    def __init__(self, num_samples=80, val_sleep_s=0.0, sanity_sleep_s=0.0):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.num_samples = num_samples
        self.val_sleep_s = val_sleep_s
        self.sanity_sleep_s = sanity_sleep_s
        self.batch_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.batch_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        time.sleep(self.sanity_sleep_s if self.trainer.sanity_checking else self.val_sleep_s)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _loader(self, n):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 3, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)

    def train_dataloader(self):
        return self._loader(self.num_samples)

    def val_dataloader(self):
        return self._loader(2 * BATCH)


def read_csv(path):
    return list(csv.DictReader(path.read_text().splitlines()))


def make_trainer(tmp_path, logger=True, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        logger=CSVLogger(tmp_path) if logger else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def test_stock_path_one_row_per_step_and_csv(tmp_path):
    wall = WallClockLogger()
    trainer = make_trainer(tmp_path, callbacks=[wall])
    trainer.fit(TinyRegression())

    rows = wall.rows
    assert [r["update"] for r in rows] == list(range(1, 21))
    assert [r["samples"] for r in rows] == [BATCH * i for i in range(1, 21)]
    times = [r["time/train_s"] for r in rows]
    assert times[0] > 0 and all(a < b for a, b in zip(times, times[1:]))
    assert all(r["staleness/mean"] == 0 and r["staleness/max"] == 0 and r["k"] == 1 for r in rows)
    assert all(r["time/validation_s"] == 0 for r in rows)

    logged = read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    assert set(METRIC_NAMES) <= set(logged[0])
    logged_updates = [int(float(r["update"])) for r in logged if r["update"]]
    assert logged_updates == list(range(1, 21))

    ours = read_csv(tmp_path / "lightning_logs" / "version_0" / "wallclock.csv")
    assert len(ours) == 20 and list(ours[0]) == list(METRIC_NAMES)

    summary = wall.summary()
    assert summary["updates"] == 20 and summary["samples"] == 20 * BATCH
    assert summary["train_time_s"] == rows[-1]["time/train_s"]
    assert summary["final_loss"] == pytest.approx(rows[-1]["train/loss"])


def test_without_logger_rows_stay_in_memory(tmp_path):
    wall = WallClockLogger()
    trainer = make_trainer(tmp_path, logger=False, max_steps=3, default_root_dir=tmp_path, callbacks=[wall])
    trainer.fit(TinyRegression())
    assert len(wall.rows) == 3
    assert not list(tmp_path.rglob("wallclock.csv"))


class TickingRegression(TinyRegression):
    """Each training step takes ``step_s`` and each validation batch its sleep, on ``clock``."""

    def __init__(self, clock, step_s, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.step_s = clock, step_s

    def training_step(self, batch, batch_idx):
        self.clock.sleep(self.step_s)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock.sleep(self.sanity_sleep_s if self.trainer.sanity_checking else self.val_sleep_s)


def test_validation_time_is_excluded_from_training_clock(tmp_path, monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(callbacks_module, "monotonic", clock.monotonic)
    step_s, val_sleep, val_batches, validations = 0.01, 0.1, 2, 4
    wall = WallClockLogger()
    trainer = make_trainer(
        tmp_path,
        callbacks=[wall],
        limit_val_batches=val_batches,
        val_check_interval=5,
        num_sanity_val_steps=1,
    )
    trainer.fit(TickingRegression(clock, step_s, val_sleep_s=val_sleep, sanity_sleep_s=0.5))

    slept = val_sleep * val_batches * validations
    # Every validation is counted, and the sanity check (0.5 s) is not.
    assert wall.summary()["validation_time_s"] == pytest.approx(slept)
    rows = wall.rows
    assert rows[4]["time/validation_s"] == 0  # first validation runs after update 5
    assert rows[5]["time/validation_s"] == pytest.approx(val_sleep * val_batches)
    # The training clock holds the steps only: update i came after i steps of 0.01 s.
    assert [r["time/train_s"] for r in rows] == pytest.approx([step_s * r["update"] for r in rows])


def test_gradient_accumulation_logs_optimizer_steps(tmp_path):
    wall = WallClockLogger()
    model = TinyRegression()
    trainer = make_trainer(tmp_path, callbacks=[wall], max_steps=5, accumulate_grad_batches=2)
    trainer.fit(model)
    assert [r["update"] for r in wall.rows] == [1, 2, 3, 4, 5]
    assert [r["samples"] for r in wall.rows] == [2 * BATCH * i for i in range(1, 6)]
    pair_means = [(a + b) / 2 for a, b in zip(model.batch_losses[::2], model.batch_losses[1::2])]
    assert [r["train/loss"] for r in wall.rows] == pytest.approx(pair_means, rel=1e-5)


def test_batch_size_of_structured_batches():
    x = torch.zeros(7, 2)
    assert _batch_size(x) == 7
    assert _batch_size((x, torch.zeros(7))) == 7
    assert _batch_size({"meta": "name", "inputs": [x]}) == 7
    assert _batch_size(["no tensors"]) == 0


# ---------------------------------------------------------------- engine path


class FakeEngine:
    def __init__(self, virtual_clock):
        self.virtual_clock = virtual_clock
        self.pending = []

    def pop_update_records(self):
        records, self.pending = self.pending, []
        return records


class RecordingLogger:
    save_dir = None

    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, metrics))


def record(update, clock, k=3):
    return UpdateRecord(
        update=update, clock=clock, samples=10 * update, loss=1.0 / update,
        staleness_mean=0.5 * update, staleness_max=update, num_gradients=k, k=k,
    )


class FakeClock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def stub_trainer(engine, logger):
    return SimpleNamespace(
        strategy=engine, is_global_zero=True, loggers=[logger], sanity_checking=False,
        state=SimpleNamespace(fn=TrainerFn.FITTING), global_step=0, world_size=4,
    )


@pytest.mark.parametrize("virtual_clock", [True, False])
def test_engine_records_become_rows(monkeypatch, virtual_clock):
    clock = FakeClock(100.0)
    monkeypatch.setattr(callbacks_module, "monotonic", clock)
    engine, logger = FakeEngine(virtual_clock), RecordingLogger()
    trainer = stub_trainer(engine, logger)
    wall = WallClockLogger()
    module = SimpleNamespace(automatic_optimization=True)

    wall.on_train_start(trainer, module)
    # Either clock is the server's training seconds (virtual or wall), pauses already excluded.
    engine.pending = [record(1, 2.0), record(2, 4.0)]
    clock.now = 104.5
    wall.on_train_batch_end(trainer, module, None, None, 0)
    assert [r["update"] for r in wall.rows] == [1, 2]

    engine.pending = [record(3, 5.0)]  # applied just before validation
    clock.now = 106.0
    wall.on_validation_start(trainer, module)
    assert len(wall.rows) == 3  # drained before validation, not left behind
    clock.now = 109.0
    wall.on_validation_end(trainer, module)

    engine.pending = [record(4, 9.0)]
    clock.now = 112.5
    wall.on_train_end(trainer, module)

    rows = wall.rows
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert [r["samples"] for r in rows] == [10, 20, 30, 40]
    assert [r["staleness/max"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["staleness/mean"] == 2.0 and rows[3]["train/loss"] == 0.25 and rows[3]["k"] == 3
    assert [r["time/validation_s"] for r in rows] == [0.0, 0.0, 0.0, 3.0]
    expected_train_s = [2.0, 4.0, 5.0, 9.0]  # logged as the engine reports it
    assert [r["time/train_s"] for r in rows] == pytest.approx(expected_train_s)
    assert [step for step, _ in logger.calls] == [1, 2, 3, 4]
    assert logger.calls[3][1] == rows[3]
    assert wall.summary() == {
        "train_time_s": pytest.approx(expected_train_s[-1]), "validation_time_s": 3.0,
        "updates": 4, "samples": 40, "final_loss": 0.25,
    }


def test_engine_path_through_real_trainer_hooks(tmp_path):
    """A real Trainer whose strategy reports records: rows come only from the records."""
    wall = WallClockLogger()
    trainer = make_trainer(tmp_path, callbacks=[wall], max_steps=6, limit_val_batches=1, val_check_interval=3)
    engine_queue = []
    trainer.strategy.virtual_clock = True
    trainer.strategy.pop_update_records = lambda: [engine_queue.pop(0) for _ in range(len(engine_queue))]

    class ReportingModule(TinyRegression):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            # Two server updates per batch, as an engine with K smaller than P could report.
            step = self.trainer.global_step
            engine_queue.extend([record(2 * step - 1, 0.1 * step), record(2 * step, 0.1 * step + 0.05)])

    trainer.fit(ReportingModule())
    assert [r["update"] for r in wall.rows] == list(range(1, 13))
    assert [r["k"] for r in wall.rows] == [3] * 12
    assert wall.rows[-1]["time/train_s"] == pytest.approx(0.65)
    logged = read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    assert [int(float(r["update"])) for r in logged if r["update"]] == list(range(1, 13))
