"""Benchmark results as data: one JSON file per run, and the latest of each kept in git.

Every benchmark script ends with `write_run(...)`:

- ``<out>/runs/<benchmark>-<kind>-<UTC time>.json`` (and a ``.csv`` of its rows) for every run;
  ``benchmarks/results/runs/`` is ignored by git, so the history of runs stays local;
- a copy as ``<out>/latest/<benchmark>-<kind>.json``, which is tracked: the documentation's
  benchmark pages (``docs/hooks/benchmarks.py``) draw their tables and figures from these files,
  so updating a page is running its benchmark and committing the file.

``kind`` is ``"gpu"`` where the benchmark trained on GPUs, else ``"cpu"``. A file holds the
exact command, the commit (``+dirty`` when the tree had uncommitted changes), the UTC date, the
machine (kind, cores, CPU, torch and Lightning versions), the script's own settings and
``figures``: its rows, one dict per table row.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("cpu", "gpu")


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the checkout, with ``+dirty`` when tracked files differ."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=here, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=here, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head


def machine() -> dict[str, Any]:
    """What ran it: CPU model, cores, load, and the versions that matter."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "python": platform.python_version()}
    try:
        info["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


def versions() -> dict[str, str | None]:
    import torch

    found: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("pytorch_lightning", "lightning"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def write_run(out: str | os.PathLike, benchmark: str, figures: list[dict[str, Any]],
              settings: dict[str, Any] | None = None, kind: str = "cpu") -> tuple[Path, Path]:
    """Write one run's file under ``<out>/runs/`` and copy it to ``<out>/latest/``.

    Returns (the run's JSON, the latest copy)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    doc = {"benchmark": benchmark, "command": " ".join(["python", *sys.argv]),
           "commit": git_commit(), "date": now.isoformat().replace("+00:00", "Z"), "kind": kind,
           "cores": os.cpu_count(), **versions(), "machine": machine(),
           "settings": settings or {}, "figures": figures}
    out = Path(out)
    runs, latest = out / "runs", out / "latest"
    runs.mkdir(parents=True, exist_ok=True)
    latest.mkdir(parents=True, exist_ok=True)
    run_path = runs / f"{benchmark}-{kind}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    run_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    columns: list[str] = []
    for row in figures:
        columns += [c for c in row if c not in columns]
    with run_path.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(figures)
    latest_path = latest / f"{benchmark}-{kind}.json"
    shutil.copyfile(run_path, latest_path)
    return run_path, latest_path


def read_latest(benchmark: str, kind: str, results: Path = RESULTS) -> dict[str, Any] | None:
    """The latest file of ``benchmark`` on ``kind`` machines, or None if there is none."""
    path = results / "latest" / f"{benchmark}-{kind}.json"
    return json.loads(path.read_text()) if path.is_file() else None
