"""The checks of `StaleStrategy`'s options, at its construction: a bad value is refused there,
naming it and what is allowed, before any process starts."""

from __future__ import annotations

from typing import Any

from lightning_stale.engine.distributed.server import LEARNER_FAILURE_MODES

DELAY_MODES = ("after_compute", "total")
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
