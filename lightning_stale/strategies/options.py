"""The checks of `StaleStrategy`'s options, at its construction: a bad value is refused there,
naming it and what is allowed, before any process starts; and, as a fit starts, which transport
``overlap_allreduce`` and ``payload_channels`` come to (`settle_transport`)."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from lightning_stale.engine.distributed.paths.registry import overlap_allreduce, settle_channels
from lightning_stale.engine.distributed.server import LEARNER_FAILURE_MODES
from lightning_stale.engine.state import ModelVectors
from lightning_stale.strategies.lightning_api import hooks_after_backward, process_group_backend

log = logging.getLogger(__name__)

DELAY_MODES = ("after_compute", "total")
# Routes that have not run on two or more GPUs: never a default, logged when asked for.
UNVERIFIED = ("%s: this route has not run on two or more GPUs yet (see the documentation's GPU "
              "page); pass False to use the verified route")
DDP_OPTIONS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
               "precision_plugin", "process_group_backend", "timeout", "start_method")


def check_options(*, delay_mode: str, on_learner_failure: str, variant: str, hold_freed_memory: Any,
                  shared_memory: Any, payload_channels: Any, overlap_allreduce: Any, server_timeout: Any,
                  shutdown_timeout: Any, ddp_kwargs: dict[str, Any]) -> None:
    """Raise `ValueError` for the first bad option (the server path is checked by the registry)."""
    if delay_mode not in DELAY_MODES:
        raise ValueError(f"unknown delay_mode {delay_mode!r}; choose one of {', '.join(DELAY_MODES)}")
    if on_learner_failure not in LEARNER_FAILURE_MODES:
        raise ValueError(f"unknown on_learner_failure {on_learner_failure!r}; choose one of "
                         f"{', '.join(LEARNER_FAILURE_MODES)}")
    if on_learner_failure == "continue" and variant == "sync":
        raise ValueError("on_learner_failure='continue' cannot apply to variant 'sync': every "
                         "update waits for every learner; use a K-variant with K < P")
    for name, flag in (("hold_freed_memory", hold_freed_memory), ("shared_memory", shared_memory),
                       ("payload_channels", payload_channels)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if overlap_allreduce is not None and not isinstance(overlap_allreduce, bool):
        raise ValueError(f"overlap_allreduce must be None (where the default group runs on gloo), "
                         f"True or False, got {overlap_allreduce!r}")
    if payload_channels and on_learner_failure == "continue":
        raise ValueError("payload_channels=True cannot go with on_learner_failure='continue': a "
                         "dead learner would leave its peers' point-to-point transfers waiting; "
                         "pass payload_channels=False (host transport, the default)")
    for name, value in (("server_timeout", server_timeout), ("shutdown_timeout", shutdown_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    unknown = sorted(set(ddp_kwargs) - set(DDP_OPTIONS))
    if unknown:
        raise ValueError(f"StaleStrategy got unknown options {unknown}; it does not wrap the model "
                         f"in DistributedDataParallel, and accepts {sorted(DDP_OPTIONS)}")


def check_launch(strategy: Any) -> None:
    """In the launching process when the Trainer is built (devices and nodes known): refuse
    NCCL on CPU and ``on_learner_failure="continue"`` with K = P."""
    on_cpu = all(d.type == "cpu" for d in (strategy.parallel_devices or []))
    if on_cpu and process_group_backend(strategy) == "nccl":
        raise ValueError("process_group_backend='nccl' needs GPUs, but this Trainer runs on CPU: "
                         "use 'gloo' or leave it unset (the server's own traffic is always gloo)")
    variant = strategy.settle_variant(strategy.num_learners)
    if strategy.on_learner_failure == "continue" and variant.k == variant.p and strategy._adaptive is None:
        raise ValueError(f"on_learner_failure='continue' needs K < P, got K = P = {variant.p}: "
                         "every update would wait for the dead learner")


def settle_transport(strategy: Any, trainer: Any, variant: Any) -> tuple[bool, str | None]:
    """For a fit of ``strategy`` on its settled ``path``: whether the all-reduce overlaps the
    backward pass, and the backend of the payload channels (None: host memory)."""
    default_backend = dist.get_backend() if strategy.world_size > 1 else None
    module, rank0 = strategy.lightning_module, strategy.global_rank == 0
    plain_steps = (trainer.accumulate_grad_batches == 1 and module.automatic_optimization
                   and getattr(strategy.precision_plugin, "scaler", None) is None
                   and not getattr(strategy, "local_updates", False))  # (a push is no backward's gradient)
    overlap = overlap_allreduce(strategy.overlap_allreduce, default_backend, strategy.path, variant,
                                strategy._adaptive, plain_steps)
    # (no user hook that may change gradients after backward: a round's gradient is the one pushed)
    hooks = hooks_after_backward(module, trainer.callbacks) if overlap else []
    if hooks and rank0:
        log.info("overlap_allreduce: the all-reduce follows the server's decision, after %s, "
                 "which may change the gradients", ", ".join(hooks))
    overlap = overlap and not hooks
    if overlap and default_backend == "nccl" and rank0:
        log.warning(UNVERIFIED, "overlap_allreduce=True (the overlap's own NCCL group)")
    vectors = ModelVectors.of(module)
    channels = settle_channels(strategy.payload_channels, strategy.path, strategy.world_size, default_backend,
                               strategy.root_device, strategy.on_learner_failure,
                               vectors.max_push_numel() * vectors.dtype.itemsize, strategy._server_group)
    if channels == "nccl" and rank0:
        log.warning(UNVERIFIED, "payload_channels=True (NCCL point-to-point groups for payloads)")
    return overlap, channels
