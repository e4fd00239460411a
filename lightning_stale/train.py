"""The Hydra app ``python -m lightning_stale.train [overrides]`` (script ``lightning-stale``).

``train(cfg)`` does the work and returns a summary, so tests and notebooks call it with a config
from ``lightning_stale.config.compose_config``; ``main()`` is the thin command-line wrapper.
By default the run is a race (``conf/race/default.yaml``): every contestant is fitted in turn,
then global rank 0 writes and prints the report (`lightning_stale.analysis.race`). With
``race=none`` it is one run of ``variant``.

Every learner process runs this same module: with ``trainer.devices=N`` Lightning's default
(popen) launcher re-runs the command line for ranks 1..N-1, and the children reuse the parent's
Hydra run directory. The processes start at the first ``fit`` and every later ``Trainer(...).fit``
in the same processes reuses them, so a race is one launch as long as every rank builds the same
sequence of Trainers, which it does: every rank composes the same config and runs its
contestants in order. That is also why a multi-process run cannot be a Hydra sweep (``-m``):
each child would re-run the whole sweep. Sweep with ``engine=simulated`` (one process).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from pytorch_lightning import Trainer, seed_everything

from lightning_stale.config import (
    ConfigError,
    Contestant,
    check_race_overrides,
    contestant_configs,
    is_race,
    process_count,
    recipes_dir,
    validate_config,
)
from lightning_stale.strategies.callbacks import WallClockLogger

# A race's contestants log under <run dir>/contestants/<n>-<name>/ (one run directory each, in
# the form lightning_stale.plot reads); the report goes beside that folder.
CONTESTANTS_DIR = "contestants"


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the race, or the single run with ``race=none``, and return its summary.

    A single run's summary: ``wall_time_s`` (all of this call), ``train_time_s`` (training only,
    without validation), ``updates`` (server updates, or optimizer steps for the ddp engine),
    ``final_loss`` (training loss of the last update), ``val_acc``/``val_loss`` and
    ``test_acc``/``test_loss`` where run and logged, ``log_dir`` (None without a logger).
    A race's: ``contestants`` (one such summary each, plus its ``name``), ``wall_time_s``, and on
    global rank 0 ``figure``, ``tradeoff`` (final loss against run time), ``table`` (the Markdown
    file), ``target_loss`` and ``rows``.
    """
    started = time.monotonic()
    validate_config(cfg)  # before any data is loaded or any process started
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.output_dir = output_dir(cfg)
    if is_race(cfg):
        return run_race(cfg, started)
    summary, is_global_zero = fit_one(cfg, started)
    if is_global_zero:
        print(format_summary(summary), flush=True)
    return summary


def run_race(cfg: DictConfig, started: float | None = None) -> dict[str, Any]:
    """Fit every contestant of a validated race config in order, then report on rank 0."""
    from lightning_stale.analysis.race import write_race_report  # matplotlib: only for races

    started = time.monotonic() if started is None else started
    entries = contestant_configs(cfg)
    summaries, run_dirs, is_global_zero = [], [], True
    for index, (contestant, run) in enumerate(entries, 1):
        run_dir = Path(cfg.output_dir) / CONTESTANTS_DIR / contestant_folder(index, contestant,
                                                                            cfg.engine.name)
        with open_dict(run):
            run.output_dir = str(run_dir)
        summary, is_global_zero = fit_one(run, time.monotonic(), config_file=True)
        if is_global_zero:
            print(f"race {index}/{len(entries)} {contestant.name}: {format_summary(summary)}",
                  flush=True)
        summaries.append({"name": contestant.name, **summary})
        run_dirs.append(run_dir)
    result: dict[str, Any] = {"contestants": summaries}
    if is_global_zero:
        report = write_race_report(
            run_dirs, cfg.output_dir, labels=[contestant.label for contestant, _ in entries],
            target_loss=cfg.race.get("target_loss"), window=int(cfg.race.get("window", 20)),
            extras=[_table_extras(summary) for summary in summaries])
        result.update(figure=str(report.figure), tradeoff=str(report.tradeoff),
                      table=str(report.markdown),
                      target_loss=report.target_loss, rows=report.rows)
        print(f"\n{report.text}\nfigure: {report.figure} (trade-off: {report.tradeoff.name})"
              f"\ntable: {report.markdown} "
              f"(and {report.csv.name}); each contestant's logs: "
              f"{Path(cfg.output_dir) / CONTESTANTS_DIR}", flush=True)
    result["wall_time_s"] = time.monotonic() - started
    return result


def contestant_folder(index: int, contestant: Contestant, engine: str) -> str:
    """``2-k_sync-K2``, ``4-sync-ddp``: race order first, the engine only where it differs."""
    name = f"{index}-{contestant.variant}"
    if contestant.k is not None:
        name += f"-K{contestant.k}"
    return name + (f"-{contestant.engine}" if contestant.engine != engine else "")


def _table_extras(summary: dict[str, Any]) -> dict[str, Any]:
    return {"val acc": summary["val_acc"]} if "val_acc" in summary else {}


def fit_one(cfg: DictConfig, started: float, config_file: bool = False) -> tuple[dict, bool]:
    """One run of a validated config with its ``output_dir`` set: fit, validate and test as
    configured. Returns the summary and whether this process is global rank 0. With
    ``config_file``, rank 0 saves the config as ``<output_dir>/.hydra/config.yaml``, where Hydra
    puts a run's config, so that `lightning_stale.analysis.runs` can read the run."""
    seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, input_shape=datamodule.input_shape,
                        num_classes=datamodule.num_classes)
    wallclock = WallClockLogger()
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [wallclock, *(instantiate(node) for node in cfg.engine.get("callbacks") or [])]
    trainer: Trainer = instantiate(cfg.trainer, strategy=build_strategy(cfg), callbacks=callbacks,
                                   logger=logger, default_root_dir=cfg.output_dir)

    metrics: dict[str, float] = {}
    if cfg.fit:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if cfg.validate:
        metrics.update(trainer.validate(model, datamodule=datamodule, verbose=False)[0])
    if cfg.test:
        metrics.update(trainer.test(model, datamodule=datamodule, verbose=False)[0])

    summary = _summary(cfg, wallclock, metrics, logger, time.monotonic() - started)
    if config_file and trainer.is_global_zero:
        folder = Path(cfg.output_dir) / ".hydra"
        folder.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, folder / "config.yaml", resolve=True)
    return summary, trainer.is_global_zero


def build_strategy(cfg: DictConfig) -> Any:
    """Instantiate the engine's strategy, with the variant, K and delay the engine config names."""
    return instantiate(cfg.engine.strategy)


def output_dir(cfg: DictConfig) -> str:
    """``cfg.output_dir`` if set, else Hydra's run directory, else the working directory."""
    if cfg.get("output_dir"):
        return str(cfg.output_dir)
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.output_dir
    return os.getcwd()


def _summary(cfg: DictConfig, wallclock: WallClockLogger, metrics: dict[str, float],
             logger: Any, wall_time_s: float) -> dict[str, Any]:
    clock = wallclock.summary()
    summary: dict[str, Any] = {
        "variant": cfg.variant.name,
        "engine": cfg.engine.name,
        "wall_time_s": wall_time_s,
        "train_time_s": clock["train_time_s"],
        "updates": clock["updates"],
        "final_loss": clock["final_loss"],
    }
    for key in ("val/acc", "val/loss", "test/acc", "test/loss"):
        if key in metrics:
            summary[key.replace("/", "_")] = float(metrics[key])
    summary["log_dir"] = logger.log_dir if logger else None
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return "summary: " + ", ".join(f"{key}={show(value)}" for key, value in summary.items())


@hydra.main(config_path="pkg://lightning_stale.conf", config_name="train", version_base=None)
def _run(cfg: DictConfig) -> None:
    _refuse_multiprocess_sweep(cfg)
    check_race_overrides(cfg, HydraConfig.get().overrides.task)
    train(cfg)


def _refuse_multiprocess_sweep(cfg: DictConfig) -> None:
    # Under -m the popen launcher's children would each re-run the whole sweep, and a spawn
    # launcher keeps the wall-clock rows in the spawned processes, out of the summary.
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    processes = process_count(cfg)
    if processes != 1:
        raise ConfigError(
            f"a Hydra sweep (-m) runs one process per run, got trainer.devices="
            f"{cfg.trainer.devices} with engine={cfg.engine.name}: sweep with engine=simulated "
            "(P learners in one process), or trainer.devices=1")


def main() -> None:
    """Console entry point: makes the recipes loadable by name (``--config-name=<recipe>``).

    The recipes folder goes in as Hydra's ``--config-dir``: a ``hydra.searchpath`` override is
    applied only after Hydra has looked up the primary config, so it cannot serve recipes.
    Child processes inherit the flag through ``sys.argv``; it is added only once.
    """
    _quiet_known_warnings()
    arguments = sys.argv[1:]
    given = any(arg in ("--config-dir", "-cd") or arg.startswith(("--config-dir=", "-cd="))
                for arg in arguments)
    if not given:
        sys.argv.insert(1, f"--config-dir={recipes_dir()}")
    _run()


def _quiet_known_warnings() -> None:
    # Printed by every process at every fit, they would bury the race's table: a deprecation
    # inside Lightning 2.6 on torch 2.13, and the note that validation under P processes pads
    # the split to a multiple of P (at most P - 1 repeated samples; 1 of 359 on digits).
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r".*Using `DistributedSampler` with the dataloaders")


if __name__ == "__main__":
    main()
