"""Mutation testing of the method's core: mutmut over lightning_stale/method/,
engine/core.py and engine/state.py, against the fast unit tests that concern them.

One command, from the checkout's root (mutmut and its settings: pyproject.toml's
``[tool.mutmut]``; install with ``pip install -e '.[mutation]'``):

    nice -n 10 python benchmarks/mutation.py

It runs ``mutmut run --max-children 1`` (one worker: CPU is shared; mutmut keeps its work in
./mutants/, so a second run only retests what changed) over the mutants of ``--scope`` (mutmut
name patterns; default: rules.py and core.py, the decisions and the update, about 580 mutants,
an hour of one busy core; ``--scope all`` takes every file of ``[tool.mutmut]``, about 2,050),
then writes
benchmarks/results/latest/mutation-cpu.json: every mutant's verdict counted, the surviving
mutants that are equivalent (no behaviour change observable through any API; listed below with
the reason) and the fraction of the others that the tests kill (timeouts count as killed, as
in mutmut's own score). ``--report-only`` rewrites the file from ./mutants/ without running.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "latest" / "mutation-cpu.json"
COMMAND = "nice -n 10 python benchmarks/mutation.py"
SCOPE = ["lightning_stale.method.rules.*", "lightning_stale.engine.core.*"]

# Surviving mutants that change nothing observable through any API, by mutmut's name, with why.
EQUIVALENT: dict[str, str] = {
    "lightning_stale.method.rules.xǁServerRulesǁremove_learner__mutmut_13":
        "`if self.k >= left: self.k = left`: where k == left the assignment changes nothing",
    "lightning_stale.engine.core.xǁServerCoreǁ_snapshot_current__mutmut_2":
        "`state.snapshot(None)`: the version only keys ServerState's one-entry cache; the vector "
        "is the current parameters either way, and a later snapshot of the version recomputes it",
    "lightning_stale.engine.core.xǁServerCoreǁ__init____mutmut_34":
        "`state.snapshot(None)` at start: as _snapshot_current__mutmut_2 (a cache key only)",
    "lightning_stale.engine.core.xǁServerCoreǁ__init____mutmut_31":
        "_last_update_s starts as None: it is read (stats) only once an update has set it",
    "lightning_stale.engine.core.xǁServerCoreǁ__init____mutmut_32":
        "_last_update_s starts as 1.0: it is read (stats) only once an update has set it",
    **{f"lightning_stale.engine.core.xǁServerCoreǁ_apply__mutmut_{n}":
       "the current parameters taken as `state.snapshot(<another version>)`: the version only "
       "keys ServerState's cache, emptied at every step, so the vector is the current one"
       for n in (17, 18, 19)},
    "lightning_stale.method.rules.xǁServerRulesǁstop__mutmut_2":
        "`in_flight_at_stop = len(pending)`: stop() acts once, before any push counts in flight, "
        "so the counter is 0 there and = equals +=",
    "lightning_stale.engine.core.xǁServerCoreǁpushes_fit_in_epoch__mutmut_6":
        "`per_epoch >= 0`: with per_epoch 0, `0 < done` and `done + pushes <= 0` never both hold "
        "for a count of pushes >= 0",
    "lightning_stale.engine.core.xǁServerCoreǁpushes_fit_in_epoch__mutmut_7":
        "`per_epoch > 1`: with one push per epoch every push ends its epoch, so `done` is 0 and "
        "the answer False either way",
}


def mutmut(*args: str, check: bool = True) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    exe = Path(sys.executable).with_name("mutmut")
    done = subprocess.run([str(exe), *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"mutmut {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def verdicts(scope: list[str]) -> dict[str, str]:
    """mutant name -> mutmut's status, for every mutant in ``scope`` (all: every one)."""
    import fnmatch

    statuses = {}
    for line in mutmut("results", "--all", "true").splitlines():
        match = re.match(r"\s+(\S+): (.+)$", line)
        if match and (not scope or any(fnmatch.fnmatch(match.group(1), p) for p in scope)):
            statuses[match.group(1)] = match.group(2).strip()
    return statuses


def where(name: str) -> tuple[str, int, str]:
    """(file, line, the changed line) of a mutant, from its diff."""
    diff = mutmut("show", name)
    file = re.search(r"^\+\+\+ (?:b/)?(\S+)", diff, re.M)
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    line = 0  # (the diff numbers the function's lines: the changed line is found in the file)
    if file and removed:
        source = (ROOT / file.group(1)).read_text().splitlines()
        line = next((i + 1 for i, text in enumerate(source) if text.strip() == removed[0].strip()), 0)
    change = f"{' / '.join(s.strip() for s in removed)} -> {' / '.join(s.strip() for s in added)}"
    return (file.group(1) if file else "?"), line, change


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"python": platform.python_version(),
            **{name: version(name) for name in ("mutmut", "torch", "pytorch-lightning", "pytest")}}


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="write the result from ./mutants/ without running")
    parser.add_argument("--scope", nargs="+", default=SCOPE,
                        help="mutmut name patterns of the mutants run, or 'all' (default: %(default)s)")
    args = parser.parse_args()
    scope = [] if args.scope == ["all"] else args.scope
    if not args.report_only:
        mutmut("run", "--max-children", "1", *scope, check=False)  # (its exit status says nothing about survivors)
    statuses = verdicts(scope)
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    equivalent, survivors = [], []
    for name, status in sorted(statuses.items()):
        if status in ("killed", "timeout", "not checked"):
            continue
        file, line, change = where(name)
        if name in EQUIVALENT and status == "survived":
            equivalent.append({"file": file, "line": line, "mutant": name, "change": change,
                               "reason": EQUIVALENT[name]})
        else:
            survivors.append({"file": file, "line": line, "mutant": name, "status": status, "change": change})
    total = len(statuses) - counts.get("not checked", 0)  # (a run cut short leaves some unchecked)
    detected = counts.get("killed", 0) + counts.get("timeout", 0)
    non_equivalent = total - len(equivalent)
    result = {
        "benchmark": "mutation",
        "command": COMMAND,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kind": "cpu",
        "cores": os.cpu_count(),
        "versions": versions(),
        "scope": scope or "all",
        "figures": {
            "mutants": total,
            "killed": counts.get("killed", 0),
            "survived": len(survivors),
            "timeout": counts.get("timeout", 0),
            "not_checked": counts.get("not checked", 0),
            "by_status": counts,
            "equivalent": equivalent,
            "surviving": survivors,
            "killed_fraction_of_non_equivalent": detected / non_equivalent if non_equivalent else None,
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    figures = result["figures"]
    print(f"{total} mutants: {figures['killed']} killed, {figures['timeout']} timeouts, "
          f"{len(equivalent)} equivalent, {len(survivors)} not killed; "
          f"killed {figures['killed_fraction_of_non_equivalent']:.1%} of the non-equivalent -> {OUT}")
    for s in survivors:
        print(f"  {s['status']}: {s['file']}:{s['line']} {s['mutant']}: {s['change']}")


if __name__ == "__main__":
    main()
