"""The race (the app's default run): its config, its checks, and its report, in-process.

The real multi-process race from the command line is tests/integration/test_app_command_line.py.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from datafiles import fake_contestant

from lightning_stale.analysis.race import delay_injection, race_rows, time_to_loss, write_race_report
from lightning_stale.analysis.runs import load_run
from lightning_stale.config import (
    ConfigError,
    Contestant,
    check_race_overrides,
    compose_config,
    contestant_configs,
    is_race,
    parse_contestant,
)
from lightning_stale.train import contestant_folder, train


# ------------------------------------------------------------------ contestants
@pytest.mark.parametrize("spec,expected", [
    ("sync", Contestant("sync", None, "server")),
    ("k_sync:2", Contestant("k_sync", 2, "server")),
    ("sync@ddp", Contestant("sync", None, "ddp")),
    (" k_batch_async : 3 @ server ", Contestant("k_batch_async", 3, "server")),
    ({"variant": "k_async", "k": 2, "label": "mine", "overrides": {"model.lr": 0.05}},
     Contestant("k_async", 2, "server", "mine", {"model.lr": 0.05})),
])
def test_contestant_specs(spec, expected):
    assert parse_contestant(spec, "server", 1) == expected


@pytest.mark.parametrize("spec,engine,message", [
    ("k_sink:2", "server", r"contestants\[0\]: unknown variant 'k_sink'; choose one of sync"),
    ("k_sync:two", "server", r"'k_sync:two' is not a contestant: write VARIANT, VARIANT:K"),
    ("sync@server", "simulated", r"engine 'server' cannot race in a launch of engine=simulated"),
    ("sync@simulated", "server", r"with engine=server a contestant may name server, ddp"),
    ({"variant": "sync", "K": 2}, "server", r"unknown keys \['K'\]; a contestant takes variant"),
    ({"variant": "sync", "overrides": ["model.lr=1"]}, "server", r"overrides must map"),
    (3, "server", r"not a contestant"),
])
def test_bad_contestant_specs_name_the_value_and_the_choices(spec, engine, message):
    with pytest.raises(ConfigError, match=message):
        parse_contestant(spec, engine, 1)


def test_contestant_configs_differ_only_where_the_contestant_says():
    cfg = compose_config("train", [
        "race.contestants=[sync@ddp,{variant: k_async, k: 2, overrides: {model.lr: 0.05}}]"])
    (ddp, ddp_run), (stale, stale_run) = contestant_configs(cfg)
    assert (ddp.engine, ddp_run.engine.name, ddp_run.variant.name) == ("ddp", "ddp", "sync")
    # The ddp contestant faces the race's straggler model, slept by its callback.
    (callback,) = ddp_run.engine.callbacks
    assert callback.delay == cfg.delay
    assert stale_run.engine.strategy.variant == "k_async" and stale_run.engine.strategy.k == 2
    assert stale_run.model.lr == 0.05 and ddp_run.model.lr == cfg.model.lr
    assert not is_race(ddp_run) and not is_race(stale_run)
    stale_run.output_dir = "/somewhere"  # the logger follows the contestant's folder
    assert stale_run.logger.save_dir == "/somewhere"
    assert contestant_folder(1, ddp, "server") == "1-sync-ddp"
    assert contestant_folder(2, stale, "server") == "2-k_async-K2"


@pytest.mark.parametrize("overrides,message", [
    (["race.contestants=[sync,k_sync:5]"],
     r"race contestant 2 \(k_sync:5@server\): variant=k_sync variant\.k=5 does not fit P=4"),
    (["race.contestants=[sync,k_sync:2,sync@ddp]", "engine=simulated"],
     r"engine 'ddp' cannot race in a launch of engine=simulated"),
    (["race.contestants=[{variant: sync, overrides: {trainer.devices: 2}}]"],
     r"runs in 2 processes, the launch in 4"),
    (["logger=none"], r"logger=none does not write: use logger=csv .* or race=none"),
    (["fit=false"], r"fit=false and ckpt_path apply to single runs only \(race=none\)"),
    (["race.target_loss=low"], r"race\.target_loss must be a number or null"),
    (["race.window=0"], r"race\.window must be an integer >= 1"),
    (["+race.targets=[1]"], r"race has unknown keys \['targets'\]"),
])
def test_bad_race_fails_at_composition(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config("train", overrides)


@pytest.mark.parametrize("override", ["variant=k_async", "variant.k=2", "+variant.extra=1"])
def test_a_variant_override_in_a_race_points_at_race_none(override):
    with pytest.raises(ConfigError, match=r"add race=none for a single run"):
        compose_config("train", [override])
    single = compose_config("train", ["race=none", "variant=k_sync", override])
    assert single.variant.name in ("k_async", "k_sync") and not is_race(single)
    cfg = compose_config("train", validate=False)
    check_race_overrides(cfg, ["race.window=5", "model.lr=0.2"])  # the race's own keys pass


# ------------------------------------------------------------------ report
def test_time_to_loss_uses_the_trailing_mean():
    times = np.arange(1, 9) * 0.5
    losses = np.array([4.0, 3.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.5])
    # means of 2: 3.5, 2.5, 1.5, 1.0, 0.75, 0.5, 0.5 (ending at updates 2..8)
    assert time_to_loss(times, losses, 1.0, 2) == (2.5, 5)
    assert time_to_loss(times, losses, 0.5, 2) == (3.5, 7)
    never = time_to_loss(times, losses, 0.4, 2)
    assert math.isnan(never[0]) and never[1] is None
    assert time_to_loss(times, losses, 9.0, 20)[1] is None  # fewer updates than the window


LOSSES = np.linspace(2.0, 0.2, 40)  # reaches a mean of 0.5 over 5 updates at update 36


def test_report_on_known_logs(tmp_path):
    dirs = [fake_contestant(tmp_path / "1-sync", [], LOSSES, 0.10),
            fake_contestant(tmp_path / "2-k_async", ["variant=k_async", "variant.k=2"], LOSSES,
                            0.04, staleness=0.75),
            fake_contestant(tmp_path / "3-ddp", ["engine=ddp"], LOSSES + 1.0, 0.10)]
    report = write_race_report(dirs, tmp_path, labels=[None, "stale one", None],
                               target_loss=0.5, window=5, extras=[{"val acc": 0.9}] * 3)
    rows = report.rows
    assert [row["contestant"] for row in rows] == ["Fully sync (K=4), server", "stale one",
                                                   "Fully sync (K=4), ddp"]
    key = "time to loss 0.5 (s)"
    assert [row["update at target"] for row in rows] == [36, 36, ""]
    assert rows[0][key] == pytest.approx(3.6) and rows[1][key] == pytest.approx(1.44)
    assert math.isnan(rows[2][key]) and math.isnan(rows[2]["speed-up over row 1"])
    assert rows[1]["speed-up over row 1"] == pytest.approx(2.5)
    assert [row["mean staleness"] for row in rows] == [0.0, 0.75, 0.0]
    assert rows[0]["final loss"] == pytest.approx(np.mean(LOSSES[-5:]))
    assert [row["K of P"] for row in rows] == ["4 of 4", "2 of 4", "4 of 4"]
    assert rows[2]["delay injected"] == "slept after backward by every rank (InjectedDelay)"
    assert rows[0]["delay injected"] == "added after backward by each learner"
    assert all(row["val acc"] == 0.9 for row in rows)

    assert report.figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(report.csv, newline="") as handle:
        assert [row["contestant"] for row in csv.DictReader(handle)] == [
            row["contestant"] for row in rows]
    text = report.markdown.read_text()
    assert "ShiftedExponential(shift=0.01, mean=0.05) s delays" in text
    assert "| stale one | server |" in text and "not reached" in text
    assert report.text in text
    again = write_race_report([dirs[0], dirs[0]], tmp_path / "again", target_loss=0.5, window=5)
    assert [row["contestant"] for row in again.rows] == ["Fully sync (K=4)",
                                                         "Fully sync (K=4) #2"]


def test_tradeoff_has_one_labelled_point_per_contestant(tmp_path):
    from lightning_stale.analysis.race import plot_tradeoff

    local = ["engine=simulated", "variant.local_steps=8"]
    dirs = [fake_contestant(tmp_path / "1-sync", ["engine=simulated"], LOSSES, 0.10),
            fake_contestant(tmp_path / "2-diloco", local, LOSSES + 0.5, 0.06),
            fake_contestant(tmp_path / "3-k_batch_async",
                            [*local, "variant=k_batch_async", "variant.k=2"], LOSSES + 1.0, 0.02)]
    report = write_race_report(dirs, tmp_path, target_loss=2.0, window=5)
    assert report.tradeoff == tmp_path / "race_tradeoff.png"
    assert report.tradeoff.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "race_tradeoff.png" in report.markdown.read_text()
    rows = report.rows
    assert [row["contestant"] for row in rows] == [
        "Fully sync (K=4)", "Fully sync (K=4), H=8", "K-batch-async, K=2, H=8"]
    assert [row["H"] for row in rows] == [1, 8, 8]
    runs = [load_run(path) for path in dirs]
    axes = plot_tradeoff(runs, rows).axes[0]
    points = [tuple(line.get_xydata()[0]) for line in axes.get_lines()]
    expected = [(40 * seconds, float(np.mean(LOSSES[-5:])) + shift)
                for seconds, shift in ((0.10, 0.0), (0.06, 0.5), (0.02, 1.0))]
    assert points == [pytest.approx(point) for point in expected]
    assert [text.get_text() for text in axes.texts] == [row["contestant"] for row in rows]
    assert axes.get_xlabel() == "training time (simulated seconds)"
    assert axes.get_ylabel().startswith("final training loss")
    # without local updates the table keeps its columns
    plain = write_race_report(dirs[:1], tmp_path / "plain", target_loss=2.0, window=5)
    assert "H" not in plain.rows[0] and plain.tradeoff.is_file()


def test_figure_labels_lines_and_title(tmp_path):
    from lightning_stale.analysis.race import plot_race

    dirs = [fake_contestant(tmp_path / "a", [], LOSSES, 0.1),
            fake_contestant(tmp_path / "b", ["engine=ddp"], LOSSES, 0.1)]
    runs = [load_run(path) for path in dirs]
    rows = race_rows(runs, 0.5, 5)
    axes = plot_race(runs, rows, 0.5, window=5).axes[0]
    assert "wall-clock" in axes.get_xlabel() and "seconds" in axes.get_xlabel()
    assert axes.get_ylabel().startswith("training loss")
    assert "ShiftedExponential(shift=0.01, mean=0.05)" in axes.get_title()
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend[:2] == ["Fully sync (K=4)", "Fully sync (K=4)"]
    assert "target loss 0.5" in legend
    assert axes.get_lines()[1].get_linestyle() == "--"  # ddp dashed, apart from the server's
    assert delay_injection(runs[1]).startswith("slept")


def test_simulated_race_in_process(tmp_path, capsys):
    """The whole race path in one process: train() fits every contestant, then reports."""
    cfg = compose_config("train", [
        "engine=simulated", "trainer.max_steps=25", "trainer.num_sanity_val_steps=0",
        "validate=false", "race.target_loss=null", "race.window=5",
        "race.contestants=[sync,k_async:2,{variant: async, label: fastest}]",
        f"output_dir={tmp_path}"])
    result = train(cfg)
    names = ["1-sync", "2-k_async-K2", "3-async"]
    assert [summary["name"] for summary in result["contestants"]] == [
        "sync@simulated", "k_async:2@simulated", "async@simulated"]
    assert all(summary["updates"] == 25 for summary in result["contestants"])
    for name in names:
        folder = tmp_path / "contestants" / name
        assert len(list(folder.glob("csv/version_0/wallclock.csv"))) == 1
        assert load_run(folder).engine == "simulated"
    assert Path(result["figure"]) == tmp_path / "race.png" and (tmp_path / "race.png").is_file()
    rows = result["rows"]
    assert [row["contestant"] for row in rows] == ["Fully sync (K=4)", "K-async, K=2", "fastest"]
    # target null: the highest final loss, which every contestant reaches
    assert result["target_loss"] == max(row["final loss"] for row in rows)
    assert all(math.isfinite(row["time to loss " + f"{result['target_loss']:.3g} (s)"])
               for row in rows)
    # on the virtual clock the async family is faster per update than fully sync
    assert rows[0]["train time (s)"] > rows[1]["train time (s)"] > rows[2]["train time (s)"]
    printed = capsys.readouterr().out
    assert f"figure: {tmp_path / 'race.png'}" in printed and "| fastest | simulated |" in printed


def test_the_app_refuses_a_variant_override_in_a_race(tmp_path, monkeypatch, capsys):
    """Through Hydra's command line (in-process): the error comes before anything is built."""
    from lightning_stale import train as app

    def must_not_run(cfg):
        raise AssertionError("train() ran despite the variant override")

    monkeypatch.setattr(app, "train", must_not_run)
    monkeypatch.setattr("sys.argv", ["lightning-stale", "variant=k_async",
                                     f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_code:
        app.main()
    assert exit_code.value.code == 1
    assert "variant=k_async sets the variant of a single run" in capsys.readouterr().err
