"""benchmarks/time_to_target.py (docs/benchmarks/time_to_target.md): its race composes into a
valid real-engine race whose contestants carry their H, and its figures follow the race's
definitions, with ddp's final loss as the one target."""

import argparse
import math

import numpy as np
import pytest
from benchmark_scripts import import_benchmark
from datafiles import fake_contestant
from omegaconf import OmegaConf

from lightning_stale.analysis.race import final_loss, time_to_loss
from lightning_stale.config import compose_config, contestant_configs


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("time_to_target")


def arguments(**changes) -> argparse.Namespace:
    values = dict(variants=["sync", "k_sync:3", "k_batch_async:2"], h=[1, 4], outer="average",
                  ddp_steps=30, budget_steps=60, seed=0, shift=0.01, mean=0.05, learners=4, window=5)
    return argparse.Namespace(**{**values, **changes})


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_the_race_is_a_valid_server_race_with_each_contestants_h(bench, tmp_path, outer):
    args = arguments(outer=outer)
    entries = bench.contestants(args)
    overrides = bench.race_overrides(args, tmp_path, entries)
    assert overrides[0] == f"hydra.run.dir={tmp_path}"
    cfg = compose_config("train", overrides[1:])  # validated as the app validates it
    runs = contestant_configs(cfg)
    assert len(runs) == len(entries) == 1 + 3 * 2
    seen = []
    for (contestant, run), entry in zip(runs, entries):
        engine = "ddp" if entry["variant"] == "ddp" else "server"
        assert contestant.engine == run.engine.name == engine
        assert run.trainer.devices == 4 and run.delay.shift == 0.01 and run.delay.mean == 0.05
        assert run.trainer.max_steps == (30 if engine == "ddp" else 60)
        strategy = OmegaConf.to_container(run.engine.strategy, resolve=True)
        if engine == "server":
            assert strategy["local_steps"] == entry["h"]
            nesterov = outer == "nesterov" and entry["h"] > 1 and entry["variant"] != "k_batch_async"
            assert (strategy["outer_optimizer"] is not None) == nesterov
            assert entry["outer"] == ("" if entry["h"] == 1 else "nesterov" if nesterov else "average")
            seen.append((strategy["variant"], strategy["k"], entry["h"]))
    assert seen == [("sync", None, 1), ("sync", None, 4), ("k_sync", 3, 1), ("k_sync", 3, 4),
                    ("k_batch_async", 2, 1), ("k_batch_async", 2, 4)]


def test_figures_use_ddps_final_loss_as_the_target(bench, tmp_path):
    args = arguments(variants=["sync"], h=[1, 4])
    entries = bench.contestants(args)
    ddp = np.linspace(2.0, 0.5, 30)
    sync = np.linspace(2.0, 0.3, 60)  # one update per inner step
    local = np.linspace(2.0, 0.2, 15)  # H = 4: 15 updates for the same 60 inner steps
    dirs = [fake_contestant(tmp_path / "1-sync-ddp", ["engine=ddp"], ddp, 0.12, staleness_max=4, k=4),
            fake_contestant(tmp_path / "2-sync", [], sync, 0.11, staleness_max=4, k=4),
            fake_contestant(tmp_path / "3-sync", ["variant.local_steps=4"], local, 0.35, staleness_max=4, k=4)]
    rows, target = bench.measure(entries, dirs, window=5)
    assert target == pytest.approx(float(np.mean(ddp[-5:]))) == pytest.approx(final_loss(ddp, 5))
    times = [time_to_loss((np.arange(len(x)) + 1) * dt, x, target, 5)
             for x, dt in ((ddp, 0.12), (sync, 0.11), (local, 0.35))]
    assert [row["t_target_s"] for row in rows] == [pytest.approx(t) for t, _ in times]
    assert [row["updates_at_target"] for row in rows] == [u for _, u in times]
    assert [row["inner_steps_at_target"] for row in rows] == [times[0][1], times[1][1], 4 * times[2][1]]
    assert [row["h"] for row in rows] == [1, 1, 4]
    assert [row["inner_steps"] for row in rows] == [30, 60, 60]
    assert rows[2]["ddp/this"] == pytest.approx(times[0][0] / times[2][0])
    assert rows[2]["h1/this"] == pytest.approx(times[1][0] / times[2][0])
    assert rows[1]["h1/this"] == 1.0 and math.isnan(rows[0]["h1/this"]) and rows[0]["ddp/this"] == 1.0
    assert rows[0]["contestant"] == "ddp" and rows[2]["final_loss"] == pytest.approx(np.mean(local[-5:]))


def test_contestant_folders_are_read_in_race_order(bench, tmp_path):
    for name in ("10-k_batch_async-K2", "2-sync", "1-sync-ddp"):
        (tmp_path / "contestants" / name).mkdir(parents=True)
    assert [path.name for path in bench.contestant_dirs(tmp_path)] == [
        "1-sync-ddp", "2-sync", "10-k_batch_async-K2"]
