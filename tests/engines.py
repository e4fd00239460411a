"""Running one LightningModule on either engine in this process, for tests that compare them.

``ENGINES``: ``"simulated"`` (`SimulatedStaleStrategy`, P simulated learners on a virtual clock)
and ``"stale"`` (`StaleStrategy` with one real learner process, P = 1: the server thread, the
learner, Lightning's DDP set-up and the gloo group, all in this process). Use the ``engine``
fixture of tests/conftest.py, which also sets up the one-process environment.
"""

from __future__ import annotations

import socket

import pytorch_lightning as pl
import torch

ENGINES = ("simulated", "stale")
QUIET = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    accelerator="cpu",
    devices=1,
)
_LAUNCHER_VARIABLES = (
    "LOCAL_RANK",
    "WORLD_SIZE",
    "RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_environment(monkeypatch) -> None:
    """What a one-process DDP-style run needs: no launcher variables, a free local port."""
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def strategy(engine: str, variant: str = "sync", k: int | None = None, learners: int = 2, **kwargs):
    """A strategy of ``engine``: the simulated one with ``learners`` learners, the real one with
    the Trainer's single process (P = 1, so K = 1 whatever the variant)."""
    from lightning_stale import SimulatedStaleStrategy, StaleStrategy

    if engine == "simulated":
        return SimulatedStaleStrategy(variant, k, num_learners=learners, **kwargs)
    return StaleStrategy(variant, None, **kwargs)  # K = P = 1


def fit(
    engine: str,
    model,
    datamodule=None,
    *,
    variant: str = "sync",
    k: int | None = None,
    learners: int = 2,
    strategy_kwargs=None,
    **trainer_kwargs,
) -> pl.Trainer:
    """``trainer.fit`` on ``engine`` with quiet defaults; returns the Trainer. The real engine's
    default process group is destroyed afterwards, so that the next fit can create its own."""
    options = {**QUIET, **trainer_kwargs}
    chosen = {"record_trace": False, **(strategy_kwargs or {})}  # no delays.csv in the checkout
    trainer = pl.Trainer(strategy=strategy(engine, variant, k, learners, **chosen), **options)
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


def server_lr(trainer: pl.Trainer, group: int = 0) -> float:
    return trainer.strategy.core.state.optimizer.param_groups[group]["lr"]


def books_balance(stats: dict) -> bool:
    return stats["gradients_received"] == (
        stats["gradients_applied"]
        + stats["gradients_dropped"]
        + stats["gradients_in_flight_at_stop"]
    )
