"""The app end to end, in-process: train(cfg) on one process (tests/integration runs the command line)."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_stale.config import ConfigError, compose_config
from lightning_stale.train import format_summary, train

@pytest.fixture
def isolated_ddp():
    """Undo what a one-process DDP run leaves behind: launcher variables, the process group."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_train_in_process(tmp_path, isolated_ddp):
    cfg = compose_config("train", [
        "race=none", "engine=ddp", "delay=none", "trainer.devices=1", "trainer.max_steps=12",
        "+trainer.val_check_interval=6", "trainer.num_sanity_val_steps=0", "test=true",
        f"output_dir={tmp_path}"])
    summary = train(cfg)

    assert summary["updates"] == 12 and summary["variant"] == "sync"
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0
    assert 0.0 <= summary["val_acc"] <= 1.0 and 0.0 <= summary["test_acc"] <= 1.0
    assert summary["wall_time_s"] >= summary["train_time_s"] > 0
    log_dir = Path(summary["log_dir"])
    assert log_dir.is_relative_to(tmp_path)
    wallclock = read_rows(log_dir / "wallclock.csv")
    assert [int(row["update"]) for row in wallclock] == list(range(1, 13))
    metrics = read_rows(log_dir / "metrics.csv")
    assert any(row.get("val/acc") for row in metrics)
    assert "updates=12" in format_summary(summary)


def test_train_without_logger(tmp_path, isolated_ddp):
    cfg = compose_config("train", [
        "race=none", "engine=ddp", "trainer.devices=1", "trainer.max_steps=3",
        "trainer.num_sanity_val_steps=0", "logger=none", "validate=false",
        f"output_dir={tmp_path}"])
    summary = train(cfg)
    assert summary["log_dir"] is None and summary["updates"] == 3
    assert "val_acc" not in summary


def test_tensorboard_logger(tmp_path, isolated_ddp):
    """logger=tensorboard: without the package (the ``tensorboard`` extra) composing fails
    saying what to install; with it a run writes event files and wallclock.csv into
    tensorboard/version_0."""
    overrides = ["race=none", "engine=ddp", "delay=none", "logger=tensorboard",
                 "trainer.devices=1", "trainer.max_steps=4", "trainer.num_sanity_val_steps=0",
                 "validate=false", f"output_dir={tmp_path}"]
    if not any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX")):
        with pytest.raises(ConfigError, match=r"pip install \"lightning-stale\[tensorboard\]\""):
            compose_config("train", overrides)
        pytest.skip("tensorboard is not installed: pip install 'lightning-stale[tensorboard]'")
    cfg = compose_config("train", overrides)
    assert cfg.logger._target_ == "pytorch_lightning.loggers.TensorBoardLogger"
    assert cfg.logger.save_dir == str(tmp_path)
    summary = train(cfg)
    log_dir = Path(summary["log_dir"])
    assert log_dir == tmp_path / "tensorboard" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert [int(row["update"]) for row in read_rows(log_dir / "wallclock.csv")] == [1, 2, 3, 4]


def test_fit_false_only_validates_the_initial_weights(tmp_path, isolated_ddp):
    cfg = compose_config("train", [
        "race=none", "engine=ddp", "delay=none", "trainer.devices=1", "trainer.max_steps=3",
        "trainer.num_sanity_val_steps=0", "logger=none", "fit=false", f"output_dir={tmp_path}"])
    summary = train(cfg)
    assert summary["updates"] == 0 and 0.0 <= summary["val_acc"] <= 1.0


def test_the_seed_draws_the_initial_weights(tmp_path, isolated_ddp):
    def initial_val_loss(seed, folder):
        return train(compose_config("train", [
            "race=none", "engine=ddp", "delay=none", "trainer.devices=1", "trainer.num_sanity_val_steps=0",
            "++trainer.limit_val_batches=1", "logger=none", "fit=false", f"seed={seed}", f"output_dir={tmp_path / folder}"]))["val_loss"]

    first = initial_val_loss(0, "a")
    assert initial_val_loss(0, "b") == first and initial_val_loss(1, "c") != first


def test_ckpt_path_resumes_the_fit_where_the_checkpoint_left_it(tmp_path, isolated_ddp):
    def run(folder, epochs, *extra):
        return train(compose_config("train", [
            "race=none", "engine=ddp", "delay=none", "trainer.devices=1", "trainer.max_steps=-1",
            f"++trainer.max_epochs={epochs}", "++trainer.limit_train_batches=3", "++trainer.limit_val_batches=1",
            "trainer.check_val_every_n_epoch=1",
            "trainer.num_sanity_val_steps=0", "validate=false", f"output_dir={tmp_path / folder}", *extra]))

    run("first", 1, "trainer.enable_checkpointing=true")  # saved at the end of epoch 0
    (checkpoint,) = (tmp_path / "first").rglob("*.ckpt")
    resumed = run("resumed", 2, f"ckpt_path='{checkpoint}'")  # (quoted: Lightning names it epoch=0-step=3)
    rows = read_rows(Path(resumed["log_dir"]) / "wallclock.csv")
    assert [int(row["update"]) for row in rows] == [4, 5, 6]  # updates 1-3 came from the checkpoint
    assert resumed["updates"] == 6
