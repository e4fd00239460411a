"""Local updates (local SGD, DiLoCo): the options ``local_steps`` and ``outer_optimizer`` and
the inner optimizer's state of each simulated learner (docs/how-to/local-updates.md).

A learner takes H steps of the module's own optimizer (the inner optimizer) from the parameters
it pulled, then pushes the pseudo-gradient, pulled minus current parameters. The server applies
the average of an update's pseudo-gradients with the outer optimizer: plain averaging (SGD with
lr 1 and no momentum: local SGD, Wang and Joshi, "Cooperative SGD", JMLR 2021) by default, or any
``torch.optim`` optimizer (DiLoCo, Douillard et al. 2023: SGD with Nesterov momentum, lr 0.7,
momentum 0.9).

``outer_optimizer`` takes the form LightningCLI and Hydra both write: a class path and its
arguments, ``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, ...}}`` (or the class
path alone for its defaults).

`LocalUpdatesMixin` runs the rounds inside `SimulatedStaleStrategy`, one Lightning training step
per inner step.
"""

from __future__ import annotations

import copy
import importlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_stale.engine.local_round import (  # noqa: F401 - shared with the real engine
    LocalRound,
    cloned_state,
    give_inner_state,
    optimizer_params,
    take_inner_state,
)
from lightning_stale.engine.simulated import SimulatedServer
from lightning_stale.method.adaptive import AdaptiveH
from lightning_stale.method.local import check_local_steps
from lightning_stale.method.virtual_clock import Finish
from lightning_stale.strategies.lightning_api import set_global_step

OuterFactory = Callable[[Sequence[Tensor]], Optimizer]
PLAIN_AVERAGING = {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}}


def check_real_engine_local_updates(local_steps: Any, outer_optimizer: Any, adaptive_h: Any, server: str,
                                    record_events: Any, payload_channels: bool) -> OuterFactory | None:
    """`StaleStrategy`'s checks of its local-update options; returns the outer optimizer's
    factory for this run (None: no local updates). Local updates run on the central path and,
    for the sync family, the collective one (AdaComm's adaptive H on the central one only); the
    sharded path, event logs and device channels are refused with them, naming what to use instead. (AdaSync's adaptive
    K, the staleness compensations and surviving dead learners run with them, on the paths that
    run them without local updates: `engine.distributed.paths.registry.check_path`.)"""
    h = check_local_steps(local_steps)
    outer = outer_optimizer_factory(outer_optimizer)
    AdaptiveH.create(adaptive_h, h0=h)  # checks the spec now (H_0 > 1 included)
    if adaptive_h is not None and server not in ("central", "auto"):
        raise ValueError(f"adaptive_h={adaptive_h!r} with server={server!r}: AdaComm's adaptive H runs on "
                         "StaleStrategy's central path, whose server decides each round's H; use "
                         "server='central' (or 'auto'), or SimulatedStaleStrategy")
    if h == 1 and outer is None:
        return None
    given = f"local_steps={h}" + ("" if outer is None else " with an outer_optimizer")
    if server not in ("central", "auto", "collective"):
        raise ValueError(f"server={server!r} with {given}: local updates run on the central path (and "
                         "the collective one, for the sync family) on StaleStrategy; use server='central' "
                         "(or 'auto', or 'collective' for sync, k_sync, k_batch_sync), or SimulatedStaleStrategy")
    if record_events:
        raise ValueError(f"record_events={record_events!r} cannot go with local updates ({given}): an "
                         "event log holds one mini-batch per push; use record_events=False")
    if payload_channels:
        raise ValueError(f"payload_channels=True with local updates ({given}): pseudo-gradients travel "
                         "through host memory; use payload_channels=False")
    return outer or plain_averaging()


def outer_optimizer_factory(spec: Any) -> OuterFactory | None:
    """A function building the outer optimizer over the server's parameters, from None (no
    outer optimizer), a class path, or a mapping ``{"class_path": ..., "init_args": {...}}``.

    The class must be a ``torch.optim.Optimizer``; it is built once on a probe tensor here, so
    that a bad argument is refused at construction, with the optimizer's own message."""
    if spec is None:
        return None
    init_args: Mapping[str, Any]
    if isinstance(spec, str):
        class_path, init_args = spec, {}
    elif isinstance(spec, Mapping):
        unknown = sorted(set(map(str, spec)) - {"class_path", "init_args"})
        if unknown or "class_path" not in spec:
            raise ValueError(f"outer_optimizer {dict(spec)!r} needs the keys class_path and "
                             f"(optionally) init_args, e.g. {{'class_path': 'torch.optim.SGD', "
                             f"'init_args': {{'lr': 0.7, 'momentum': 0.9, 'nesterov': True}}}}")
        class_path, init_args = spec["class_path"], spec.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            raise ValueError(f"outer_optimizer's init_args must map names to values, got {init_args!r}")
        init_args = {str(k): v for k, v in init_args.items()}
    else:
        raise ValueError(f"outer_optimizer must be None, a class path such as 'torch.optim.SGD' or "
                         f"a dict with class_path and init_args, got {spec!r}")
    cls = _import_optimizer(str(class_path))
    try:
        cls([torch.zeros(1, requires_grad=True)], **init_args)
    except (TypeError, ValueError) as error:
        raise ValueError(f"outer_optimizer {class_path} cannot be built with {init_args}: {error}") from None
    return lambda params: cls(list(params), **init_args)


def plain_averaging() -> OuterFactory:
    """The default outer step: SGD with lr 1 and no momentum, w <- mean of the learners' w."""
    factory = outer_optimizer_factory(PLAIN_AVERAGING)
    assert factory is not None
    return factory


def _import_optimizer(class_path: str) -> type:
    module_name, _, name = class_path.rpartition(".")
    found = None
    if module_name:
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, Optimizer)):
        raise ValueError(f"outer_optimizer class_path {class_path!r} names no torch.optim.Optimizer "
                         "class; give e.g. 'torch.optim.SGD'")
    return found


# ------------------------------------------------------------------ the simulated strategy's rounds
class LocalUpdatesMixin:
    """`SimulatedStaleStrategy`'s local updates: the options, the round of the learner computing
    (``self._round``; None between rounds and without local updates), its push at the round's
    end, and what a checkpoint keeps of them."""

    _finish: Finish | None  # the strategy's: the learner computing the push in progress

    def _init_local_updates(self, local_steps: Any, outer_optimizer: Any, event_log: bool,
                            adaptive_h: Any = None) -> None:
        """Check the options; ``event_log``: record_events or replay was given (refused with them)."""
        self.local_steps, self.outer_optimizer = check_local_steps(local_steps), outer_optimizer
        self._outer = outer_optimizer_factory(outer_optimizer)
        AdaptiveH.create(adaptive_h, h0=self.local_steps)  # checks the spec now (H_0 > 1 included)
        self.adaptive_h = adaptive_h
        self.local_updates = self.local_steps > 1 or self._outer is not None
        if self.local_updates and event_log:
            raise ValueError("record_events and replay cannot go with local updates (local_steps > 1 "
                             "or an outer_optimizer): an event log holds one mini-batch per push")
        self._round: LocalRound | None = None  # the local steps in progress

    def _fresh_adaptive_h(self) -> AdaptiveH | None:
        """This fit's own AdaComm schedule (the caller's object stays as it is)."""
        schedule = copy.deepcopy(AdaptiveH.create(self.adaptive_h, h0=self.local_steps))
        if schedule is not None:
            schedule.reset()
        return schedule

    def _outer_factory(self) -> OuterFactory | None:
        """The server's outer optimizer for this fit; None: the pushes are gradients."""
        return (self._outer or plain_averaging()) if self.local_updates else None

    def _restored_round(self, restored: dict, state: Any) -> Finish | None:
        """Load the outer optimizer's state from a checkpoint's ``restored`` simulation into
        ``state``; returns the learner whose round was in progress (it starts again), if any."""
        if restored.get("outer_optimizer") is not None:
            state.optimizer.load_state_dict(restored["outer_optimizer"])
        saved = restored.get("round")  # saved within a round
        return None if saved is None else pickle.loads(saved)

    def _start_round(self, finish: Finish, server: SimulatedServer) -> None:
        if self.local_updates:
            # finish.local_steps: the H the learner started with (adaptive H changes it between rounds)
            self._round = LocalRound(finish, finish.local_steps, self.optimizers[0],
                                     server.inner_states.get(finish.learner))

    def _pause_round(self) -> None:
        if self._round is not None and self._round.paused is None:
            self._round.paused = self._learner_view.state_vector()  # restored when training goes on

    def _resume_round(self) -> None:
        if self._round is not None and self._round.paused is not None:
            self._learner_view.load_state(self._round.paused)  # validation ran within the round
            self._round.paused = None

    def _local_step(self, server: SimulatedServer, round_: LocalRound, model: Any,
                    optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        """One inner step of the learner's round; its last one pushes the pseudo-gradient. A
        skipped training_step is not a step: the learner goes on with the next batch."""
        loss, overflow = self.compute_gradient(model, optimizer, closure)
        if loss is not None and round_.step(optimizer, self._learner_view.params, float(loss), overflow):
            finish = round_.finish
            contribution = round_.contribution(self._learner_view, server.parameters_for(finish))
            server.inner_states[finish.learner] = take_inner_state(optimizer)
            self._finish = self._round = None
            # (no X for MiniBatchTimer: a round is H mini-batches, and the trace has each draw)
            server.push(finish, contribution, round_.loss, self._batch_samples)
        set_global_step(self.lightning_module.trainer, server.inner_steps)
        return loss

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.local_updates:  # the inner optimizer's own (its states per learner: the engine's)
            return getattr(optimizer, "_optimizer", optimizer).state_dict()
        return super().optimizer_state(optimizer)

    def _local_checkpoint(self) -> dict:
        """What `_engine_checkpoint` adds for local updates (nothing without them)."""
        if not self.local_updates:
            return {}
        return {"outer_optimizer": self._running.state.optimizer.state_dict(),
                "round": None if self._round is None else pickle.dumps(self._round.finish)}
