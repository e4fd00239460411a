"""The default command, a race, with the popen launcher: one launch of 4 processes that runs
every contestant (three on the parameter server, one on Lightning's ddp) and then writes the
figure and the table; ranks 1..3 re-run the command in the parent's run folder."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from processes import RACE_UPDATES

CONTESTANTS = ["1-sync", "2-k_sync-K2", "3-k_async-K2", "4-sync-ddp"]


@pytest.fixture(scope="module")
def race(launched):
    return launched("race")  # processes.run_race


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_default_race_from_the_command_line(race):
    """`python -m lightning_stale.train` from outside the checkout: the default race with
    fewer updates, smaller delays and a ddp contestant added."""
    result, run_dir = race
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # The children ran in the parent's Hydra run folder, and only rank 0 reported.
    assert (run_dir / "train_ddp_process_1.log").is_file()
    assert result.stdout.count(f"figure: {run_dir / 'race.png'}") == 1, output[-4000:]

    for name in CONTESTANTS:
        rows = read_rows(run_dir / "contestants" / name / "csv" / "version_0" / "wallclock.csv")
        assert [int(row["update"]) for row in rows] == list(range(1, RACE_UPDATES + 1)), name
        times = [float(row["time/train_s"]) for row in rows]
        assert times == sorted(times) and times[0] > 0
    assert (run_dir / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = read_rows(run_dir / "race.csv")
    assert [row["contestant"] for row in table] == [
        "Fully sync (K=4), server", "K-sync, K=2, server", "K-async, K=2, server",
        "Fully sync (K=4), ddp"]
    assert [row["engine"] for row in table] == ["server", "server", "server", "ddp"]
    assert table[3]["delay injected"].startswith("slept after backward by every rank")
    assert all(int(row["updates"]) == RACE_UPDATES for row in table)
    time_key = next(key for key in table[0] if key.startswith("time to loss"))
    # target null: every contestant reaches the highest final loss, at the latest at its end
    assert all(0 < float(row[time_key]) <= float(row["train time (s)"]) for row in table)
    assert float(table[2]["mean staleness"]) > 0 == float(table[1]["mean staleness"])
    # The printed table is the Markdown file's.
    markdown = (run_dir / "race.md").read_text()
    row = "| K-async, K=2, server | server |"
    assert row in markdown and row in result.stdout
