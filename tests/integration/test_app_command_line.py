"""The command line with the popen launcher: rank 1 re-runs the command in the parent's run folder."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from processes import clean_env


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_command_line_with_two_processes(tmp_path):
    """`python -m lightning_stale.train` from outside the checkout, on the default parameter-server
    engine; rank 1 re-runs the command."""
    run_dir = tmp_path / "run"
    env = clean_env()
    command = [sys.executable, "-m", "lightning_stale.train", "variant=k_async", "variant.k=1",
               "delay=exponential", "delay.mean=0.002", "trainer.devices=2", "trainer.max_steps=5",
               f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "summary:" in result.stdout and "updates=5" in result.stdout, output[-4000:]
    assert result.stdout.count("summary:") == 1  # printed by rank 0 only
    # The child process ran in the parent's Hydra run directory.
    assert (run_dir / "train_ddp_process_1.log").is_file()
    wallclock = list(run_dir.glob("csv/version_*/wallclock.csv"))
    assert len(wallclock) == 1 and len(read_rows(wallclock[0])) == 5
