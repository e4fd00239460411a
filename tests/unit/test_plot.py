"""Figures and tables from run logs: fake run directories with known numbers, tiny real runs, the
command line and the Hydra callback."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_stale.analysis import plot
from lightning_stale.strategies.callbacks import METRIC_NAMES
from lightning_stale.config import compose_config
from lightning_stale.analysis.runs import (error_at_convergence, find_runs, floor_rows, k_changes,
                                         load_run, measured_update_time, theory_rows,
                                         time_to_converge, tradeoff_rows)
from lightning_stale.method.theory import harmonic
from lightning_stale.train import train

SIMULATED = ["race=none", "engine=simulated", "delay=exponential"]


def write_run(run_dir: Path, overrides: list[str], losses, times=None, ks=None,
              val_losses=(), recipe: str = "train") -> Path:
    """A run directory as Hydra and the loggers leave it: .hydra/config.yaml, wallclock.csv and a
    metrics.csv with one validation after each ``len(losses) // len(val_losses)`` updates."""
    cfg = compose_config(recipe, overrides)
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    n = len(losses)
    times = np.arange(1, n + 1) * 0.1 if times is None else times
    ks = [cfg.variant.k or 1] * n if ks is None else ks
    rows = [dict(zip(METRIC_NAMES, (j + 1, times[j], 0.0, 32 * (j + 1), losses[j], 0.0, 0,
                                    ks[j]))) for j in range(n)]
    logs = run_dir / "csv" / "version_0"
    logs.mkdir(parents=True)
    with open(logs / "wallclock.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(METRIC_NAMES))
        writer.writeheader()
        writer.writerows(rows)
    every = n // len(val_losses) if len(val_losses) else n + 1
    with open(logs / "metrics.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(METRIC_NAMES) + ["val/loss"])
        writer.writeheader()
        values = iter(val_losses)
        for j, row in enumerate(rows):
            writer.writerow(row)
            if (j + 1) % every == 0:
                writer.writerow({"val/loss": next(values, "")})
    return run_dir


STEP_LOSSES = [10.0, 8.0, 6.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_error_and_time_to_converge_of_a_known_series():
    times = np.arange(1, 11) * 0.5
    losses = np.array(STEP_LOSSES)
    # Tail 20% of 10 updates = the last 2: error 1.0. Trailing means over 2 updates:
    # 10, 9, 7, 5, 3, 1.5, 1, ... first within 10% of 1.0 at update 7 (t = 3.5 s); within 50%
    # already at update 6 (1.5, t = 3.0 s).
    assert error_at_convergence(losses, 0.2) == 1.0
    assert time_to_converge(times, losses, 0.2, 0.1) == 3.5
    assert time_to_converge(times, losses, 0.2, 0.5) == 3.0
    assert error_at_convergence(losses, 0.5) == 1.0
    assert time_to_converge(times[:3], np.array([3.0, 2.0, 1.0]), 1 / 3, 0.0) == times[2]
    assert measured_update_time(np.arange(1, 201) * 0.25, p=4) == pytest.approx(0.25)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A fake sweep: jobs 0..10 (10 sorts after 9), one without logs, one adaptive, convex runs."""
    root = tmp_path_factory.mktemp("sweep")
    for job, k in enumerate([1, 2, 3, 4]):
        write_run(root / str(job), SIMULATED + ["variant=k_sync", f"variant.k={k}"],
                  losses=[x / k for x in STEP_LOSSES], times=np.arange(1, 11) * 0.5 * k)
    write_run(root / "4", SIMULATED + ["variant=async"], losses=STEP_LOSSES)
    (root / "5" / ".hydra").mkdir(parents=True)  # a run that wrote no logs (logger=none)
    write_run(root / "10", SIMULATED + ["variant=k_async", "variant.k=1",
                                        "+engine.strategy.adaptive_k=0.5"],
              losses=STEP_LOSSES, ks=[1, 1, 1, 2, 2, 2, 3, 4, 4, 4])
    return root


def test_find_runs_reads_configs_and_labels_runs(sweep):
    runs = find_runs([sweep])
    assert [run.path.name for run in runs] == ["0", "1", "2", "3", "4", "10"]
    assert [run.label for run in runs] == [
        "K-sync, K=1", "K-sync, K=2", "K-sync, K=3", "K-sync, K=4 (= fully sync)", "Async (K=1)",
        "K-async, adaptive K from 1, T0=0.5 s"]
    assert all(run.simulated and run.p == 4 for run in runs)
    assert find_runs([sweep / "2"])[0].label == "K-sync, K=3"
    twice = find_runs([sweep / "1", sweep / "1"])
    assert len(twice) == 1
    assert k_changes(runs[-1]) == [(0.1, 1), pytest.approx((0.4, 2)), pytest.approx((0.7, 3)),
                                   pytest.approx((0.8, 4))]
    with pytest.raises(FileNotFoundError, match="not a finished run"):
        load_run(sweep / "5")


def test_tradeoff_and_theory_tables(sweep):
    runs = find_runs([sweep])
    rows = {row["run"]: row for row in tradeoff_rows(runs)}
    k2 = rows["K-sync, K=2"]  # losses / 2, times x 2: error 0.5, converged at update 7
    assert k2["error_at_convergence"] == 0.5 and k2["time_to_converge_s"] == pytest.approx(7.0)
    assert k2["total_time_s"] == pytest.approx(10.0) and k2["updates"] == 10
    theory = {row["run"]: row for row in theory_rows(runs, updates=2000)}
    assert "K-async, adaptive K from 1, T0=0.5 s" not in theory  # its K changes
    mean = 0.05  # delay=exponential
    k2 = theory["K-sync, K=2"]
    assert k2["theory_s"] == pytest.approx((harmonic(4) - harmonic(2)) * mean)
    assert k2["method"] == "closed form"
    # 10 updates 1 s apart; warm-up min(max(5 P, n / 20), n / 2) = 5 updates
    assert k2["measured_s"] == pytest.approx(1.0)
    assert theory["Async (K=1)"]["theory_s"] == pytest.approx(mean / 4)


def test_convex_floor_rows_and_figure(tmp_path):
    overrides = SIMULATED + ["data=convex", "model=least_squares", "variant=k_sync"]
    problem = compose_config("train", overrides + ["variant.k=1"]).data
    from hydra.utils import instantiate
    data = instantiate(problem)
    for k in (1, 2):
        floor = 0.02 / k
        write_run(tmp_path / f"k{k}", overrides + [f"variant.k={k}"],
                  losses=[data.optimal_loss + floor] * 40,
                  val_losses=[5.0] * 10 + [data.optimal_loss + floor] * 10)
    runs = find_runs([tmp_path])
    rows = floor_rows(runs, tail_fraction=0.5)
    assert [row["K"] for row in rows] == [1, 2]
    for row in rows:
        assert row["measured_floor"] == pytest.approx(0.02 / row["K"])
        assert row["bound"] == pytest.approx(data.sync_error_floor(0.1, row["K"]))
        assert row["validations_averaged"] == 10
    assert np.allclose(runs[0].val_times, np.arange(2, 41, 2) * 0.1)
    written = plot.make_figures(runs, tmp_path / "figures", theory_updates=500)
    assert {path.name for path in written} >= {"error_floor.png", "loss_vs_time.png"}
    with open(tmp_path / "figures" / "error_floor.csv") as handle:
        table = list(csv.DictReader(handle))
    assert float(table[1]["measured_floor"]) == pytest.approx(0.01)


def test_make_figures_writes_pngs_and_tables(sweep, tmp_path):
    runs = find_runs([sweep])
    written = plot.make_figures(runs, tmp_path, theory_updates=500)
    names = {path.name for path in written}
    assert names == {"loss_vs_time.png", "loss_vs_updates.png", "tradeoff.png",
                     "theory_vs_measurement.png", "adaptive_k.png"}
    for path in written:
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000
    with open(tmp_path / "tradeoff.csv") as handle:
        table = {row["run"]: row for row in csv.DictReader(handle)}
    assert float(table["K-sync, K=4 (= fully sync)"]["error_at_convergence"]) == 0.25
    assert float(table["K-sync, K=4 (= fully sync)"]["time_to_converge_s"]) == pytest.approx(14)
    summary = (tmp_path / "summary.md").read_text()
    assert "## tradeoff.png" in summary and "| K-sync, K=2 |" in summary
    assert (tmp_path / "adaptive_k.csv").read_text().count("adaptive K from 1") == 4


def test_figures_read_as_labelled(sweep):
    runs = find_runs([sweep])
    figure = plot.plot_loss(runs, x="time")
    axes = figure.axes[0]
    assert axes.get_xlabel() == "training time (simulated seconds)"
    assert "P=4" in axes.get_title() and "Exponential" in axes.get_title()
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [r.label for r in runs]
    assert plot.plot_loss(runs, x="updates").axes[0].get_xlabel() == "server updates"
    assert plot.plot_error_floor(runs) is None  # no convex runs
    assert "error at convergence" in plot.plot_tradeoff(runs).axes[0].get_ylabel()


def test_command_line_on_tiny_real_runs(tmp_path, capsys):
    """Two simulated runs through train() (the real log writers), then the command line."""
    for name, variant in (("0", ["variant=k_sync", "variant.k=2"]), ("1", ["variant=async"])):
        cfg = compose_config("train", SIMULATED + variant + ["trainer.max_steps=30",
                                                              f"output_dir={tmp_path / name}"])
        (tmp_path / name / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, tmp_path / name / ".hydra" / "config.yaml")
        summary = train(cfg)
        assert summary["updates"] == 30
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "out"), "--theory-updates",
                      "500"]) == 0
    assert "2 runs" in capsys.readouterr().out
    assert (tmp_path / "out" / "theory_vs_measurement.png").stat().st_size > 10_000
    with open(tmp_path / "out" / "loss_curves.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["run"] for row in rows] == ["K-sync, K=2", "Async (K=1)"]
    assert all(int(row["updates"]) == 30 and math.isfinite(float(row["error_at_convergence"]))
               for row in rows)
    assert plot.main([str(tmp_path / "1")]) == 0  # default output folder: <run>/figures
    assert (tmp_path / "1" / "figures" / "loss_vs_time.png").is_file()


def test_callback_plots_the_sweep_folder(sweep, tmp_path):
    import shutil
    folder = tmp_path / "sweep"
    shutil.copytree(sweep, folder)
    callback = plot.PlotOnMultirunEnd(theory_updates=500)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}}})
    callback.on_multirun_start(config)
    callback.on_multirun_end(config)
    assert (folder / "figures" / "tradeoff.png").is_file()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no runs"):
        plot.PlotOnMultirunEnd().on_multirun_end(
            OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "empty")}}}))
