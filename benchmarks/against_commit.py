"""The engine of one commit against another's, side by side: "is this variant slower than before?"

Scaling issue's small-model target: at 0.02M parameters no variant slower than before. One
launch on this shared machine cannot answer that (a variant's ratio to ddp moves by a quarter
between repeats), so this script alternates launches of the two codes: each commit's
``lightning_stale`` is exported with ``git archive`` into a temporary folder and put first on
``PYTHONPATH``, and every launch runs stock ``ddp`` and the chosen variants interleaved
``--repeats`` times on the same model (the MLP 64-``--hidden``-10 of ``overhead_vs_ddp.py``,
batch 32, no injected delay). The two codes take turns at going first in a pair of launches.
Reported per variant and code: the median over all repeats of samples/s over ddp's samples/s
in the same repeat, and a two-sided Mann-Whitney U test (scipy) of the two codes' launches, each
launch's median ratio one value: repeats inside a launch share its luck, so the launch, not the
repeat, is the independent unit (a test over the repeats can call a gap between a commit and
itself significant). Four launches of each code are the fewest that can give p < 0.05. Each code runs as its users get it: where it has one, every mode of a
launch (ddp included) runs under the allocator setting the strategy makes
(`engine.distributed.allocator`, applied by `_common.apply_process_settings`); before, under
glibc's defaults; ``--same-settings`` runs both under this checkout's, which compares the
engines alone (the setting applies to ``ddp`` too, so a ratio to ``ddp`` can move with it).

Each fit is ``overhead_vs_ddp.measure`` (its samples/s and its K per variant).

``--devices`` and ``--hidden`` take several values: every pair of them is one comparison of its own
(its launches alternate as above), and its rows name P and the model's parameters (75h + 10 at
``--hidden`` h: 256 gives 0.02M, 46667 gives 3.5M).

    python benchmarks/against_commit.py --base COMMIT [--head HEAD] [--modes k_batch_sync sync]
        [--devices 2 4] [--launches 4] [--repeats 6] [--steps 300] [--hidden 256 46667] [--same-settings]
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import apply_process_settings, base_parser, is_rank_zero, prepare_out, table, write_results
from overhead_vs_ddp import k_of, measure

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async")


def run_launch(args) -> None:
    """One process tree: ddp and every mode, interleaved ``--repeats`` times (whichever
    ``lightning_stale`` is first on the path)."""
    rows = []
    for repeat in range(args.repeats):
        for mode in ("ddp", *args.modes):
            row = measure(mode, None if mode == "ddp" else k_of(mode, args.devices[0]), args.devices[0],
                          hidden=args.hidden[0], steps=args.steps[0], seed=args.seed)
            if row is not None:
                rows.append({"repeat": repeat, "mode": mode, "samples_per_s": row["samples_per_s"]})
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def hold_freed_memory_from_this_checkout() -> None:
    """The allocator setting of this checkout's engine, whichever code is first on the path
    (an earlier commit may not have it; its module needs nothing but the standard library)."""
    path = REPO / "lightning_stale" / "engine" / "distributed" / "allocator.py"
    spec = importlib.util.spec_from_file_location("_allocator_of_this_checkout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.hold_freed_memory()


def export(rev: str, into: Path) -> str:
    """``rev``'s package in a folder of its own; returns the full commit id."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "lightning_stale"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def ratios(rows: list[dict], mode: str) -> list[float]:
    ddp = {r["repeat"]: r["samples_per_s"] for r in rows if r["mode"] == "ddp"}
    return [r["samples_per_s"] / ddp[r["repeat"]] for r in rows if r["mode"] == mode]


def per_launch(rows: list[dict], mode: str) -> list[float]:
    """Each launch's median ratio of ``mode`` to ddp (a row's ``repeat`` is (launch, repeat))."""
    launches = sorted({r["repeat"][0] for r in rows})
    return [statistics.median(ratios([r for r in rows if r["repeat"][0] == launch], mode)) for launch in launches]


def absolute(collected: dict[str, list[dict]], mode: str) -> dict[str, float]:
    """Each code's median samples/s of ``mode`` (ddp's tells whether a ratio moved with ddp:
    each code's launches run ddp under that code's own process settings)."""
    return {f"{side}_samples_per_s": round(statistics.median(r["samples_per_s"] for r in rows if r["mode"] == mode), 1)
            for side, rows in collected.items()}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--head", default="HEAD", help="the commit to compare with it")
    parser.add_argument("--modes", nargs="+", default=["k_batch_sync", "sync"], choices=VARIANTS)
    parser.add_argument("--devices", type=int, nargs="+", default=[2])
    parser.add_argument("--launches", type=int, default=4, help="launches per commit, alternating")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved repeats per launch")
    parser.add_argument("--steps", type=int, nargs="+", default=[300],
                        help="steps per fit: one value, or one per --hidden value")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256],
                        help="0.02M parameters at 256, 3.5M at 46667")
    parser.add_argument("--same-settings", action="store_true",
                        help="run both codes under this checkout's process settings (the allocator's): "
                             "the engines compared alone, ddp alike in both")
    parser.add_argument("--child-result", default=None, help=__import__("argparse").SUPPRESS)
    args = parser.parse_args()
    apply_process_settings(args)
    if args.same_settings:
        hold_freed_memory_from_this_checkout()
    if args.child_result is not None:
        return run_launch(args)

    from scipy.stats import mannwhitneyu

    out, start = prepare_out(args.out), time.monotonic()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: Path(tmp) / side for side in ("base", "head")}
        commits = {side: export(getattr(args, side), trees[side]) for side in trees}
        steps = args.steps * len(args.hidden) if len(args.steps) == 1 else args.steps
        if len(steps) != len(args.hidden):
            parser.error(f"--steps takes one value or one per --hidden value ({len(args.hidden)}), not {len(steps)}")
        for devices in args.devices:
            for hidden, fit_steps in zip(args.hidden, steps):
                rows += compare(args, trees, Path(tmp), devices, hidden, fit_steps, mannwhitneyu)
                # after every pair, all so far: a long grid cut short keeps what it measured
                write_results(out, "against_commit", rows, {"base": commits["base"], "head": commits["head"],
                                                             "wall_s": time.monotonic() - start})
    print(f"\nbase {commits['base'][:7]} against head {commits['head'][:7]}, {args.launches} launches of each, "
          f"{args.repeats} repeats per launch; samples/s over ddp's in the same repeat, median")
    print(table(rows, ["devices", "parameters", "mode", "k", "base_vs_ddp", "head_vs_ddp", "head_over_base",
                       "mann_whitney_p", "launches", "repeats", "base_samples_per_s", "head_samples_per_s"]))


def compare(args, trees: dict[str, Path], tmp: Path, devices: int, hidden: int, steps: int,
            mannwhitneyu) -> list[dict]:
    """The two codes' launches, alternating, on P = ``devices`` and the MLP 64-``hidden``-10."""
    collected: dict[str, list[dict]] = {"base": [], "head": []}
    for launch in range(args.launches):
        for side in ("base", "head") if launch % 2 == 0 else ("head", "base"):
            result = tmp / f"{side}-{devices}-{hidden}-{launch}.json"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(trees[side]), os.environ.get("PYTHONPATH", "")])}
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--devices", str(devices),
                            "--hidden", str(hidden), "--steps", str(steps),
                            "--child-result", str(result)], check=True, env=env)
            for row in json.loads(result.read_text()):
                collected[side].append({**row, "repeat": (launch, row["repeat"])})
    config = {"devices": devices, "parameters": 75 * hidden + 10, "steps": steps}
    rows = []
    for mode in args.modes:
        base, head = ratios(collected["base"], mode), ratios(collected["head"], mode)
        launches = {side: per_launch(collected[side], mode) for side in collected}
        rows.append({**config, "mode": mode, "k": k_of(mode, devices), "base_vs_ddp": statistics.median(base),
                     "head_vs_ddp": statistics.median(head),
                     "head_over_base": statistics.median(head) / statistics.median(base),
                     "mann_whitney_p": float(mannwhitneyu(launches["base"], launches["head"]).pvalue),
                     "launches": len(launches["base"]), "repeats": len(base), **absolute(collected, mode),
                     "base_per_repeat": " ".join(f"{x:.2f}" for x in base),
                     "head_per_repeat": " ".join(f"{x:.2f}" for x in head)})
    rows.append({**config, "mode": "ddp", "k": "", **absolute(collected, "ddp")})
    return rows


if __name__ == "__main__":
    main()
