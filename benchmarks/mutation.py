"""Mutation testing of the method's core: mutmut over lightning_stale/method/,
engine/core.py and engine/state.py, against the fast unit tests that concern them.

One command, from the checkout's root (mutmut and its settings: pyproject.toml's
``[tool.mutmut]``; install with ``pip install -e '.[mutation]'``):

    nice -n 10 python benchmarks/mutation.py

It runs ``mutmut run --max-children 1`` (one worker by default, as CPU is shared; mutmut keeps its work in
./mutants/: with ``all`` a second run checks only mutants without a verdict, while name
patterns recheck every mutant they match) over the mutants of ``--scope`` (mutmut
name patterns; default: rules.py and core.py, the decisions and the update, about 640 mutants,
an hour of one busy core; ``--scope all`` takes every file of ``[tool.mutmut]``, about 2,460),
then writes
benchmarks/results/latest/mutation-cpu.json (one file for every scope run: a run replaces the
scopes its own covers and keeps the others, and the figures at the top sum them; the scopes
must not overlap): every mutant's verdict counted, the surviving
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
import shlex
import subprocess
import sys
from pathlib import Path

import results  # benchmarks/results.py: the machine and versions every results file names

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "latest" / "mutation-cpu.json"
COMMAND = "nice -n 10 python benchmarks/mutation.py"
SCOPE = ["lightning_stale.method.rules.*", "lightning_stale.engine.core.*"]

# Surviving mutants that change nothing observable through any API, by mutmut's name, with why.
EQUIVALENT: dict[str, str] = {
    "lightning_stale.method.rules.xǁServerRulesǁremove_learner__mutmut_13":
        "`if self.k >= left: self.k = left`: where k == left the assignment changes nothing",
    "lightning_stale.engine.core.xǁServerCoreǁ_snapshot_current__mutmut_4":
        "`state.snapshot(None)`: the version only keys ServerState's one-entry cache; the vector "
        "is the current parameters either way, and a later snapshot of the version recomputes it",
    "lightning_stale.engine.core.xǁServerCoreǁ__init____mutmut_37":
        "`state.snapshot(None)` at start: as _snapshot_current__mutmut_4 (a cache key only)",
    **{f"lightning_stale.engine.core.xǁServerCoreǁ__init____mutmut_{n}":
       f"_last_update_s starts as {start}: it is read (stats) only once an update has set it"
       for n, start in ((32, "None"), (33, "1.0"))},
    "lightning_stale.engine.core.xǁServerCoreǁpush__mutmut_10":
        "`unusable` passed to ServerRules.on_push after the stop: on_push counts a push after "
        "the stop as in flight before it reads `unusable`",
    **{f"lightning_stale.engine.core.xǁServerCoreǁ_apply__mutmut_{n}":
       "the type named in `typing.cast` changed: cast returns its argument unchanged at run time"
       for n in (53, 57, 58, 59)},
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
    "lightning_stale.method.adaptive.xǁ_LossByIntervalǁ_at_boundary__mutmut_17":
        "`assert initial_loss is not None or current_loss is not None`: both hold there (the "
        "initial loss is frozen just above, the running mean holds the loss appended above)",
    "lightning_stale.method.adaptive.xǁ_LossByIntervalǁ_freeze_initial_loss__mutmut_4":
        "`_first_losses = None` once frozen: it is read only while initial_loss is None, which it "
        "is not again until _reset_estimate() gives it a new list",
    "lightning_stale.method.virtual_clock.xǁVirtualClusterǁ__init____mutmut_12":
        "generations start at 1: a generation is only compared for equality with the learner's "
        "current one, so an offset common to all changes nothing",
    "lightning_stale.method.virtual_clock.xǁVirtualClusterǁ__init____mutmut_16":
        "the sequence numbers start at 1: they only break ties in the heap by their order",
    "lightning_stale.method.virtual_clock.xǁVirtualClusterǁ_start__mutmut_2":
        "generations counted down: each start still makes a generation unlike every earlier one, "
        "and only equality with the current one is checked",
    "lightning_stale.method.virtual_clock.xǁVirtualClusterǁ_start__mutmut_3":
        "generations counted in steps of 2: as _start__mutmut_2, every start still makes a new one",
    "lightning_stale.method.virtual_clock.xǁVirtualClusterǁ_start__mutmut_22":
        "sequence numbers in steps of 2: their order, the only thing the heap reads, is the same",
    **{f"lightning_stale.engine.state.xǁModelVectorsǁload_parts__mutmut_{n}":
       "the part of an empty tensor taken as an empty slice of the chunk or an empty tensor of "
       "another dtype: _load copies nothing from a part of 0 values"
       for n in (19, 22, 24)},
    "lightning_stale.engine.state.xǁServerStateǁapply__mutmut_1":
        "the default update_index: every caller (ServerCore, the shard owner) passes the update's",
    "lightning_stale.engine.state.xǁServerStateǁapply__mutmut_13":
        "one gradient (K = 1) averaged by the general path: the same values times 1.0, in a copy "
        "where the fast path lets the parameters' grads view the push",
    **{f"lightning_stale.engine.state.xǁModelVectorsǁof__mutmut_{n}":
       "`state_dict(keep_vars=False/None)` where only its names are read (which buffers are "
       "persistent): keep_vars changes its values (detached or not), not its keys"
       for n in (3, 4)},
    **{f"lightning_stale.engine.state.xǁModelVectorsǁ_load__mutmut_{n}":
       "the load's copy without `non_blocking`: it only makes a copy between a GPU and pinned "
       "host memory asynchronous; a GPU destination is read in stream order and a module's host "
       "tensors are not pinned, so every later read sees the same values"
       for n in (14, 18)},
    "lightning_stale.engine.state.xǁModelVectorsǁpush_vector__mutmut_14":
        "`to_dense()` of every gradient: for a dense gradient it returns the gradient itself",
    **{f"lightning_stale.engine.state.x_clone_optimizer__mutmut_{n}":
       "the rebuild made to fail (no groups, no class, no accepted options, groups without "
       "'params'): the fallback copy then gives the same groups, defaults, state and attributes "
       "(Optimizer.__getstate__ carries no hooks either); only the learner's state is copied once "
       "more on the way"
       for n in (13, 17, 18, 20, 21, 22, 34, 35)},
    **{f"lightning_stale.engine.state.x_clone_optimizer__mutmut_{n}":
       "the group's options filtered by another name than 'params': the original 'params' entry "
       "is then overwritten by the server's tensors, the next key of the same dict"
       for n in (15, 16)},
    **{f"lightning_stale.engine.state.x_clone_optimizer__mutmut_{n}":
       "the fallback's deepcopy without the memo: Optimizer.__getstate__ hands it only defaults, "
       "state and param_groups; the next lines replace every group's params and clear the state, "
       "so the memo only spares copies that are dropped"
       for n in (40, 42)},
    "lightning_stale.engine.state.x_clone_optimizer__mutmut_61":
        "`getattr(value, '_wrapped_by_lr_sched', None)`: None and False are both false under `not`",
    "lightning_stale.engine.state.x_clone_optimizer__mutmut_84":
        "a state tensor deep-copied instead of detached and cloned: optimizers make their state "
        "under no_grad, so both give an independent copy of the same values",
    **{f"lightning_stale.method.local.x_erlang_order_statistic_mean__mutmut_{n}":
       "the quadrature with scipy's default tolerance (1.5e-8) or subinterval limit (50), or a "
       "limit of 201: the survival function is smooth and quad meets its tolerance long before "
       "either limit; the mean moves by under 1e-13 relative (checked for P up to 32, H up to 50)"
       for n in (44, 45, 46, 48)},
    "lightning_stale.engine.state.x__joined__mutmut_11":
        "the two ways of joining swapped for parts on one device: both give the same vector and "
        "use out alike; joining first only saves a copy per part from another device",
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


def in_scope(name: str, scope: list[str]) -> bool:
    import fnmatch

    return not scope or any(fnmatch.fnmatch(name, pattern) for pattern in scope)


def scope_figures(scope: list[str]) -> dict:
    """The counts, equivalent and surviving mutants of ``scope`` from ./mutants/."""
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
    return {"scope": ", ".join(scope) or "all", "patterns": scope, "counts": counts,
            "equivalent": equivalent, "surviving": survivors}


def summed(parts: list[dict]) -> dict:
    """Figures over the scopes run (each mutant belongs to one scope: they are kept disjoint)."""
    counts: dict[str, int] = {}
    for part in parts:
        for status, n in part["counts"].items():
            counts[status] = counts.get(status, 0) + n
    equivalent = [e for part in parts for e in part["equivalent"]]
    survivors = [s for part in parts for s in part["surviving"]]
    total = sum(counts.values()) - counts.get("not checked", 0)  # (a run cut short leaves some unchecked)
    detected = counts.get("killed", 0) + counts.get("timeout", 0)
    non_equivalent = total - len(equivalent)
    return {
        "mutants": total,
        "killed": counts.get("killed", 0),
        "survived": len(survivors),
        "timeout": counts.get("timeout", 0),
        "not_checked": counts.get("not checked", 0),
        "by_status": counts,
        "equivalent": equivalent,
        "surviving": survivors,
        "killed_fraction_of_non_equivalent": detected / non_equivalent if non_equivalent else None,
    }


def scope_row(part: dict) -> dict:
    """One line of the table of scopes: the part's own figures, its commit and date."""
    figures = summed([part])
    return {"scope": part["scope"], "patterns": part["patterns"], "command": part.get("command", COMMAND),
            "commit": part["commit"],
            "date": part["date"], "counts": part["counts"],
            "equivalent": part["equivalent"], "surviving": part["surviving"],
            **{k: figures[k] for k in ("mutants", "killed", "timeout", "survived", "not_checked",
                                       "killed_fraction_of_non_equivalent")},
            "equivalent_count": len(part["equivalent"])}


def earlier_scopes() -> list[dict]:
    """The scopes of the results file as it is: its ``scopes``, or (a file written before scopes
    were kept apart) the whole file as one scope."""
    if not OUT.is_file():
        return []
    doc = json.loads(OUT.read_text())
    figures = doc["figures"]
    if "scopes" in figures:
        return figures["scopes"]
    patterns = doc["scope"] if isinstance(doc["scope"], list) else []
    return [{"scope": ", ".join(patterns) or "all", "patterns": patterns, "commit": doc.get("commit"),
             "date": doc.get("date"), "counts": figures["by_status"], "equivalent": figures["equivalent"],
             "surviving": figures["surviving"]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="write the result from ./mutants/ without running")
    parser.add_argument("--scope", nargs="+", default=SCOPE,
                        help="mutmut name patterns of the mutants run, or 'all' (default: %(default)s)")
    parser.add_argument("--max-children", type=int, default=1,
                        help="mutants tested at once (default: %(default)s, for a shared machine)")
    args = parser.parse_args()
    if args.max_children < 1:
        parser.error(f"--max-children must be at least 1, got {args.max_children}")
    scope = [] if args.scope == ["all"] else args.scope
    if not args.report_only:
        # (mutmut's exit status says nothing about survivors)
        mutmut("run", "--max-children", str(args.max_children), *scope, check=False)
    # The command that gives these verdicts (--report-only reads what such a run left in ./mutants/)
    command = " ".join([COMMAND, *(["--scope", *map(shlex.quote, args.scope)] if args.scope != SCOPE else []),
                        *(["--max-children", str(args.max_children)] if args.max_children != 1 else [])])
    part = {**scope_figures(scope), "commit": commit(), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    # The file keeps every scope run: this run replaces the scopes whose mutants it covers
    # (a scope of patterns all within this one's), the others stay as they were.
    kept = [old for old in earlier_scopes()
            if old["scope"] != part["scope"] and not (scope == [] or all(
                any(p.startswith(q.rstrip("*")) for q in scope) for p in old["patterns"] or ["*"]))]
    overlap = [old["scope"] for old in kept
               if any(in_scope(m["mutant"], scope) for m in old["equivalent"] + old["surviving"])]
    if overlap:
        raise SystemExit(f"scope {part['scope']!r} overlaps the kept scope(s) {overlap}: run disjoint scopes")
    parts = kept + [part]
    result = {
        "benchmark": "mutation",
        "command": part["command"],
        "commit": part["commit"],
        "date": part["date"],
        "kind": "cpu",
        "cores": os.cpu_count(),
        **results.versions(),  # (torch and Lightning, where the benchmark pages read them)
        "machine": results.machine(),
        "versions": versions(),
        "scope": [p for old in parts for p in old["patterns"]] or "all",
        "figures": {**summed(parts), "scopes": [scope_row(old) for old in parts]},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["figures"]["scopes"]:
        print(f"{row['scope']}: {row['mutants']} mutants, {row['killed']} killed, {row['timeout']} timeouts, "
              f"{row['equivalent_count']} equivalent, {row['survived']} not killed, {row['not_checked']} not checked")
    figures = result["figures"]
    print(f"all scopes: {figures['mutants']} mutants: {figures['killed']} killed, {figures['timeout']} timeouts, "
          f"{len(figures['equivalent'])} equivalent, {figures['survived']} not killed; "
          f"killed {figures['killed_fraction_of_non_equivalent']:.1%} of the non-equivalent -> {OUT}")
    for s in figures["surviving"]:
        print(f"  {s['status']}: {s['file']}:{s['line']} {s['mutant']}: {s['change']}")


if __name__ == "__main__":
    main()
