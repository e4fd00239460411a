"""The Hydra app ``python -m lightning_stale.train [overrides]`` (script ``lightning-stale``).

``train(cfg)`` does the work and returns a summary, so tests and notebooks call it with a config
from ``lightning_stale.config.compose_config``; ``main()`` is the thin command-line wrapper.

Every learner process runs this same module: with ``trainer.devices=N`` Lightning's default
(popen) launcher re-runs the command line for ranks 1..N-1, and the children reuse the parent's
Hydra run directory. That is also why a multi-process run cannot be a Hydra sweep (``-m``): each
child would re-run the whole sweep. Sweep with ``engine=simulated`` (P learners in one process).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from pytorch_lightning import Trainer, seed_everything

from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.config import (ConfigError, process_count, recipes_dir, strategy_class,
                                    validate_config)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit (then validate/test, as configured) and return a summary of the run.

    Summary keys: ``wall_time_s`` (all of this call), ``train_time_s`` (training only, without
    validation), ``updates`` (server updates, or optimizer steps for the ddp engine),
    ``final_loss`` (training loss of the last update), ``val_acc``/``val_loss`` and
    ``test_acc``/``test_loss`` where run and logged, ``log_dir`` (None without a logger).
    """
    started = time.monotonic()
    validate_config(cfg)  # before any data is loaded or any process started
    strategy_class(cfg)  # likewise: a clear error when this version does not have the engine
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.output_dir = output_dir(cfg)

    seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, input_shape=datamodule.input_shape,
                        num_classes=datamodule.num_classes)
    wallclock = WallClockLogger()
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer: Trainer = instantiate(cfg.trainer, strategy=build_strategy(cfg), callbacks=[wallclock],
                                   logger=logger, default_root_dir=cfg.output_dir)

    metrics: dict[str, float] = {}
    if cfg.fit:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if cfg.validate:
        metrics.update(trainer.validate(model, datamodule=datamodule, verbose=False)[0])
    if cfg.test:
        metrics.update(trainer.test(model, datamodule=datamodule, verbose=False)[0])

    summary = _summary(cfg, wallclock, metrics, logger, time.monotonic() - started)
    if trainer.is_global_zero:
        print(format_summary(summary), flush=True)
    return summary


def build_strategy(cfg: DictConfig) -> Any:
    """Instantiate the engine's strategy, with the variant, K and delay the engine config names."""
    strategy_class(cfg)
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
    arguments = sys.argv[1:]
    given = any(arg in ("--config-dir", "-cd") or arg.startswith(("--config-dir=", "-cd="))
                for arg in arguments)
    if not given:
        sys.argv.insert(1, f"--config-dir={recipes_dir()}")
    _run()


if __name__ == "__main__":
    main()
