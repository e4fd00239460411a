"""MkDocs hook: the benchmark pages' results, drawn from benchmarks/results/latest/ at build time.

A page under docs/benchmarks/ marks where its results go with ``<!-- results -->``; this hook
replaces the mark with one section per machine kind (CPU, GPU): where the latest file of that
benchmark and kind exists, its provenance (command, commit, date, machine), a table of its
figures and a matplotlib figure; otherwise a line saying there is none yet, with the command
that makes it. The index page's ``<!-- results-index -->`` becomes a table of every benchmark's
latest files. No page types a measured number: updating one is committing a new results file.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
LATEST = ROOT / "benchmarks" / "results" / "latest"
KINDS = {"cpu": "CPU", "gpu": "GPU"}
GPU_CAPABLE = {"scaling", "gpu_check"}  # the scripts with --accelerator gpu; the rest train on CPUs
NAMED = {"k", "devices", "learner", "h"}  # label columns shown as name=value under a bar

# Per benchmark: the table's columns (None: all), where the rows are ("figures", or a key of
# "settings"), and the figure: bars of `value` per row labelled by `label` columns, or lines of
# `value` against `x`, one panel per `panel` value and one line per `series` combination.
# `reference` draws a dashed line (1 = parity). `also` adds tables drawn from the same file by
# other entries; an entry with `part_of` (or `list`) is such a table, not a benchmark of the index.
SPECS: dict[str, dict[str, Any]] = {
    "runtime_fidelity": dict(columns=["variant", "k", "updates", "theory_s", "measured_s", "measured/theory",
                                      "replay/theory", "measured/replay"],
                             plot="bar", label=["variant", "k"], value="measured/theory", reference=1.0,
                             ylabel="measured time per update / E[T]"),
    "slow_learner": dict(columns=["k", "updates", "ideal_updates_per_s", "measured_updates_per_s", "ratio",
                                  "replay/ideal", "measured/replay", "slow_learner_share", "ideal_slow_share"],
                         plot="bar", label=["k"], value="ratio", reference=1.0,
                         ylabel="measured updates/s / ideal"),
    "overhead_vs_ddp": dict(columns=["devices", "mode", "k", "vs_ddp", "vs_ddp_per_repeat", "target",
                                     "ms_per_update", "samples_per_s"],
                            plot="bar", label=["devices", "mode", "k"], value="vs_ddp", reference=1.0,
                            ylabel="samples/s over ddp's"),
    "local_updates_vs_ddp": dict(columns=["devices", "mode", "server", "h", "samples_per_s", "vs_ddp",
                                          "vs_ddp_per_repeat", "target", "met", "bytes_per_inner_step",
                                          "ms_per_update", "updates"],
                                 plot="bar", label=["devices", "mode", "server", "h"], value="vs_ddp", reference=1.0,
                                 ylabel="samples/s over ddp's"),
    "straggler_win": dict(columns=None, plot="bar", label=["variant", "k"], value=r"^t_[0-9.]+_s$",
                          ylabel="seconds to the first target loss"),
    "time_to_target": dict(columns=["contestant", "h", "outer", "t_target_s", "updates_at_target",
                                    "inner_steps_at_target", "ddp/this", "h1/this", "updates", "inner_steps",
                                    "s_per_inner_step", "final_loss"],
                           plot="bar", label=["contestant"], value="t_target_s",
                           ylabel="seconds to the target loss",
                           also=[("time_to_target_summary", "The target and the best local-update contestant")]),
    "time_to_target_summary": dict(rows="summary", part_of="time_to_target",
                                   columns=["target_loss", "window", "ddp_t_target_s", "best_local", "best_h",
                                            "best_t_target_s", "best_ddp/this", "best_h1/this"], plot=None),
    "simulation_cost": dict(columns=["run", "k", "steps_per_s", "vs_plain", "vs_plain_per_repeat",
                                     "pushes_per_update"],
                            plot="bar", label=["run", "k"], value="vs_plain", reference=1.0,
                            ylabel="gradients/s over plain Lightning's steps/s"),
    "latency_breakdown": dict(rows="summary", columns=None, plot="bar", label=["variant", "k"],
                              value="measured/theory", reference=1.0,
                              ylabel="measured time per update / E[T]"),
    "scaling": dict(columns=["devices", "size", "mode", "requested", "path", "k", "vs_ddp", "per_repeat",
                             "target", "ms_per_update", "samples_per_s", "parameters"],
                    plot="line", x="parameters", panel="devices", series=["mode", "requested"], value="vs_ddp",
                    reference=1.0, ylabel="samples/s over ddp's", xlabel="parameters", logx=True),
    "architectures": dict(columns=["devices", "model", "mode", "requested", "path", "k", "vs_ddp", "per_repeat",
                                   "ms_per_update", "samples_per_s", "parameters"],
                          plot="bar", label=["devices", "model", "mode"], value="vs_ddp", reference=1.0,
                          ylabel="samples/s over ddp's"),
    "path_breakdown": dict(rows="summary", columns=None, plot="bar", label=["variant", "server"],
                           value="samples_per_s", ylabel="samples/s (all learners)"),
    "against_commit": dict(columns=["devices", "parameters", "steps", "mode", "k", "base_vs_ddp", "head_vs_ddp",
                                    "head_over_base", "mann_whitney_p", "launches", "repeats",
                                    "base_samples_per_s", "head_samples_per_s"],
                           plot="bar", label=["devices", "parameters", "mode", "k"], value="head_over_base",
                           reference=1.0, ylabel="head's ratio to ddp over base's"),
    "record_minibatch_times": dict(columns=None, plot="bar", label=["learner"], value="mean_s",
                                   ylabel="mean seconds per mini-batch"),
    "recording_cost": dict(columns=["devices", "size", "parameters", "mode", "vs_off", "vs_off_per_repeat",
                                    "target", "samples_per_s", "log_bytes"],
                           plot="bar", label=["size", "mode"], value="vs_off", reference=1.0,
                           ylabel="samples/s over recording off's"),
    "mutation": dict(columns=["mutants", "killed", "timeout", "survived", "equivalent",
                              "killed_fraction_of_non_equivalent"], plot=None,
                     also=[("mutation_scopes", "By scope (each run of `--scope`, kept side by side)"),
                           ("mutation_equivalent", "The surviving mutants that are equivalent, and why")]),
    "mutation_scopes": dict(list="scopes", columns=["scope", "mutants", "killed", "timeout", "survived",
                                                    "equivalent_count", "not_checked",
                                                    "killed_fraction_of_non_equivalent", "commit", "date"],
                            plot=None),
    "mutation_equivalent": dict(list="equivalent", columns=["file", "line", "change", "reason"], plot=None),
    "gpu_check": dict(columns=["variant", "path", "updates", "default_backend", "server_backend",
                               "module_device", "counts_balance", "module_matches_server",
                               "same_on_every_rank", "val_acc", "overlapped", "channels", "on_channels"],
                      plot="bar", label=["variant", "path"], value="val_acc",
                      ylabel="validation accuracy after the run"),
}


def load(benchmark: str, kind: str) -> dict[str, Any] | None:
    path = LATEST / f"{benchmark}-{kind}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def rows_of(benchmark: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    where = SPECS.get(benchmark, {}).get("rows", "figures")
    rows = doc["figures"] if where == "figures" else doc.get("settings", {}).get(where, [])
    if isinstance(rows, dict):  # one summary (mutation testing): its items, or the list it names
        listed = SPECS.get(benchmark, {}).get("list")
        if listed:
            return [r for r in rows.get(listed, []) if isinstance(r, dict)]
        return [{k: len(v) if isinstance(v, list) else v for k, v in rows.items()
                 if _scalar(v) or isinstance(v, list)}]
    return [r for r in rows if isinstance(r, dict)]


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if value is None:
        return ""
    return str(value).replace("|", "\\|").replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")  # (code in cells)


def columns_of(benchmark: str, rows: list[dict[str, Any]]) -> list[str]:
    wanted = SPECS.get(benchmark, {}).get("columns")
    present: list[str] = []
    for row in rows:
        present += [c for c in row if c not in present and not isinstance(row[c], (dict, list))]
    return [c for c in wanted if c in present] if wanted else present


def markdown_table(benchmark: str, rows: list[dict[str, Any]]) -> str:
    columns = columns_of(benchmark, rows)
    lines = ["| " + " | ".join(c.replace("_", " ") for c in columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _value_column(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    value = spec.get("value")
    if value and value.startswith("^"):
        return next((c for row in rows for c in row if re.match(value, c)), None)
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


def figure_png(benchmark: str, doc: dict[str, Any]) -> bytes | None:
    """The benchmark's figure as PNG bytes, or None where it has nothing to draw."""
    spec = SPECS.get(benchmark)
    rows = rows_of(benchmark, doc)
    if not spec or not rows or spec.get("plot") is None:
        return None
    value = _value_column(spec, rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if spec["plot"] == "line":
        return _line_figure(spec, rows, value, plt)
    labels, heights = [], []
    for row in rows:
        y = _number(row.get(value))
        if y is not None:
            labels.append(" ".join(f"{c}={row[c]}" if c in NAMED else str(row[c])
                                   for c in spec["label"] if row.get(c) not in (None, "")))
            heights.append(y)
    if not heights:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
    ax.bar(range(len(heights)), heights, color="#3f51b5")
    ax.set_xticks(range(len(heights)), labels, rotation=45, ha="right", fontsize=7)
    if spec.get("reference") is not None:
        ax.axhline(spec["reference"], color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel(spec.get("ylabel", value), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _line_figure(spec: dict[str, Any], rows: list[dict[str, Any]], value: str, plt) -> bytes | None:
    """One panel per value of ``spec["panel"]``: ``value`` against ``spec["x"]``, a line per
    ``spec["series"]`` combination (dashed where a run forced its path: ``requested`` not auto)."""
    panels = sorted({row.get(spec["panel"]) for row in rows}, key=str)
    names = sorted({tuple(row.get(c) for c in spec["series"]) for row in rows}, key=str)
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 2.5, 4.2), dpi=110, sharey=True,
                             squeeze=False)
    drawn = False
    for ax, panel in zip(axes[0], panels):
        for index, name in enumerate(names):
            points = sorted((_number(row.get(spec["x"])), _number(row.get(value))) for row in rows
                            if row.get(spec["panel"]) == panel and tuple(row.get(c) for c in spec["series"]) == name
                            and _number(row.get(spec["x"])) is not None and _number(row.get(value)) is not None)
            if not points:
                continue
            forced = any(part not in (None, "", "auto") for part in name[1:])
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colours(index % 20),
                    linestyle="--" if forced else "-",
                    label=" ".join(str(part) for part in name if part not in (None, "", "auto")))
            drawn = True
        if spec.get("reference") is not None:
            ax.axhline(spec["reference"], color="grey", linestyle=":", linewidth=1)
        if spec.get("logx"):
            ax.set_xscale("log")
        ax.set_title(f"{spec['panel']} = {panel}", fontsize=9)
        ax.set_xlabel(spec.get("xlabel", spec["x"]), fontsize=8)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    axes[0][0].set_ylabel(spec.get("ylabel", value), fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / (5 * len(panels) + 2.5), 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def figure_uri(benchmark: str, kind: str) -> str:
    return f"benchmarks/figures/{benchmark}-{kind}.png"


def provenance(doc: dict[str, Any]) -> str:
    machine = doc.get("machine", {})
    gpus = machine.get("gpus")
    where = (f"{len(gpus)} x {gpus[0]}, " if gpus else "") + f"{doc.get('cores')} CPU cores ({machine.get('cpu')})"
    lightning = doc.get("pytorch_lightning") or doc.get("lightning")
    load = machine.get("loadavg_at_end")  # other jobs on the machine while it ran
    busy = f"; load average at the end {load[0]:.1f} (1 min), {load[2]:.1f} (15 min)" if load else ""
    return "\n".join([
        f"- command: `{doc['command']}`",
        f"- commit: `{doc.get('commit')}`, run {doc.get('date')}",
        f"- machine: {where}; torch {doc.get('torch')}, Lightning {lightning}{busy}",
    ])


def section(benchmark: str, kind: str, command: str, has_figure: bool) -> str:
    doc = load(benchmark, kind)
    title = f"## Latest results: {KINDS[kind]}"
    if doc is None:
        if kind == "gpu":
            command = command if "--accelerator" in command or benchmark == "gpu_check" else \
                f"{command} --accelerator gpu"
        return (f"{title}\n\nNo {KINDS[kind]} results yet. Make them with `{command}` on a "
                f"{KINDS[kind]} machine and commit `benchmarks/results/latest/{benchmark}-{kind}.json`.\n")
    rows = rows_of(benchmark, doc)
    parts = [title, "", provenance(doc), ""]
    parts += [markdown_table(benchmark, rows) if rows else "(the file holds no rows)", ""]
    also = SPECS.get(benchmark, {}).get("also") or []
    for extra, heading in [also] if isinstance(also, tuple) else also:  # more tables from the same file
        extra_rows = rows_of(extra, doc)
        parts += [f"### {heading}", "", markdown_table(extra, extra_rows) if extra_rows else "None.", ""]
    if has_figure:
        parts += [f"![{benchmark}, {KINDS[kind]}](figures/{benchmark}-{kind}.png)", ""]
    return "\n".join(parts)


def index_table() -> str:
    lines = ["| benchmark | CPU results | GPU results |", "| --- | --- | --- |"]
    for benchmark in sorted(b for b, spec in SPECS.items()  # (not sub-tables)
                            if "list" not in spec and "part_of" not in spec):
        cells = []
        for kind in KINDS:
            doc = load(benchmark, kind)
            if doc:
                cells.append(f"{doc['date'][:10]}, `{str(doc.get('commit'))[:10]}`")
            else:
                cells.append("none yet" if kind == "cpu" or benchmark in GPU_CAPABLE else "(CPU only)")
        lines.append(f"| [{benchmark}]({benchmark}.md) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_figures: set[tuple[str, str]] = set()


def on_files(files, config):
    _figures.clear()
    for benchmark in SPECS:
        for kind in KINDS:
            doc = load(benchmark, kind)
            png = figure_png(benchmark, doc) if doc else None
            if png:
                files.append(File.generated(config, figure_uri(benchmark, kind), content=png))
                _figures.add((benchmark, kind))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- results-index -->" in markdown:
        markdown = markdown.replace("<!-- results-index -->", index_table())
    if "<!-- results -->" not in markdown:
        return markdown
    benchmark = Path(page.file.src_uri).stem
    match = re.search(r"^    (python benchmarks/" + re.escape(benchmark) + r"\.py[^\n]*)$", markdown, re.MULTILINE)
    command = match[1] if match else f"python benchmarks/{benchmark}.py"
    kinds = KINDS if benchmark in GPU_CAPABLE else {"cpu": "CPU"}
    sections = [section(benchmark, kind, command, (benchmark, kind) in _figures) for kind in kinds]
    return markdown.replace("<!-- results -->", "\n".join(sections))
