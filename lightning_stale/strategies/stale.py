"""`StaleStrategy`: Lightning's DDP launching, with a parameter server instead of all-reduce."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.utilities.data import extract_batch_size
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_stale.delays.models import DelayModel
from lightning_stale.engine.core import ServerCore
from lightning_stale.engine.distributed import allocator
from lightning_stale.engine.distributed.channels import close_channels
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.local_steps import LocalSteps
from lightning_stale.engine.distributed.paths.base import CheckpointPart, CheckpointView, LearnerSide
from lightning_stale.engine.distributed.paths.registry import (
    check_path,
    path_named,
    settle_path,
)
from lightning_stale.engine.distributed.ranks import RankOptions, build_rank
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import VARIANT_NAMES
from lightning_stale.replay.setup import DIGEST_EVERY
from lightning_stale.strategies.base import ServerStrategyMixin
from lightning_stale.strategies.ending import RunEnding
from lightning_stale.strategies.faults import FaultHandling, destroy_groups_at_exit, watched_launcher
from lightning_stale.strategies.learner_rounds import LearnerRounds
from lightning_stale.strategies.lightning_api import (
    replace_sigterm_broadcast,
    set_global_step,
)
from lightning_stale.strategies.namespaces import register_everywhere
from lightning_stale.strategies.options import DELAY_MODES, check_launch, check_options, settle_transport
from lightning_stale.strategies.pace import OwnPaceCollectives
from lightning_stale.strategies.recording import EventRecording
from lightning_stale.strategies.sampling import IndependentBatchSampler, check_trainer_options, independent_sampler

__all__ = ["DELAY_MODES", "StaleStrategy"]  # (the benchmarks' parsers read the delay modes here)

log = logging.getLogger(__name__)

_SERVER_GROUP_TIMEOUT = timedelta(days=7)  # a gloo timeout kills the connection: never hit it


class StaleStrategy(LearnerRounds, EventRecording, RunEnding, FaultHandling, OwnPaceCollectives, ServerStrategyMixin):
    """Runs one of the six variants of Dutta et al. (AISTATS 2018) with a real parameter server.

    A drop-in for ``strategy="ddp"``: the P learners are the Trainer's processes (devices x
    nodes), launched as for DDP, and global rank 0 also runs the server, which updates as soon
    as the variant's rule is met; learners compute gradients at the parameters they last
    received. Server traffic has a gloo group of its own, so GPU runs keep NCCL for Lightning's
    collectives. Where updates are applied is the ``server`` path (docs: concepts/paths.md).

    Args:
        variant: ``sync``, ``k_sync``, ``k_batch_sync``, ``async``, ``k_async`` or
            ``k_batch_async``.
        k: K, an integer 1 <= K <= P; None: P for sync, 1 for async, ceil(P/2) otherwise.
        delay: a straggler model from `lightning_stale.delays`; each learner draws one delay per
            mini-batch after its backward pass and before its push (interruptible by a
            cancellation).
        delay_mode: ``"after_compute"`` (default): the delay is added after the backward pass;
            ``"total"``: the delay is the mini-batch's whole time X as the server sees it (from
            sending the parameters to receiving the gradient), as in the paper's model: the real
            computation and the message round trip count toward it (a mini-batch that already
            took longer is not shortened).
        record_trace: write the delays drawn, per learner, in the `Trace` format: True for
            ``delays.csv`` in the log directory, a path, or False.
        staleness_compensation: None, ``"inverse"`` (step of a gradient of staleness s scaled by
            1/max(1, s)), ``"norm"`` settings as a dict, or a `StalenessCompensation`.
        adaptive_k: AdaSync schedule of K over wall-clock seconds (K-variants only): an
            `AdaptiveK`, a dict of its arguments, or the interval T0 in seconds.
        seed: seed of every learner's independent mini-batch sampler.
        server: where updates are applied: ``"central"`` (the server on rank 0 holds the
            parameters), ``"collective"`` (sync family: the gradients of an update meet in one
            all-reduce and every learner applies it), ``"sharded"`` (every rank owns a slice of
            the parameters and optimizer state), or ``"auto"`` (default: by the model's size,
            the family, P and the hosts, `engine.distributed.paths.registry.choose_path`).
            ``stats["server_path"]`` says which ran (``stats["shared_memory_learners"]``: which
            learners used `shared_memory`).
        on_learner_failure: ``"stop"`` (default): a learner that dies ends the run, like DDP;
            ``"continue"``: the server drops it, clamps K to the learners left and goes on
            (needs K < P; validation is skipped after a death: the default process group lost
            a member). Lightning's child-process watchdog then tolerates the death.
        server_timeout: seconds of silence after which a learner takes the server for dead (the
            server sends heartbeats when idle).
        shutdown_timeout: seconds to wait for every learner to leave at the end of training.
        hold_freed_memory: from the first fit on, keep the memory this process frees for reuse
            (glibc's ``mallopt``; for the process's life): a fresh vector of the model's size per
            push and answer otherwise costs a page fault per page. False leaves the allocator alone.
        shared_memory: on the central path, a learner on rank 0's host exchanges payloads through
            a file in ``/dev/shm`` mapped by both processes, headers over gloo (learners on other
            hosts, or where ``/dev/shm`` lacks the space, use gloo). False: gloo for all.
        record_events: write the run's event log (docs/replay.md): True for ``events.jsonl``
            beside the delay trace, a ``.jsonl`` path, or a folder; False (default) for none.
            The ranks must share a file system; ``stats["events_path"]`` names the log. Each
            learner then seeds torch's generators before each mini-batch (dropout replays).
        digest_every: with ``record_events``, a digest of the server's parameters and optimizer
            state after every ``digest_every``-th update and at the stop (default 100: about 1%
            of the throughput; 1 checks every update; 0: at the stop only; central path).
        payload_channels: False (default): payloads go through host memory. True: on the central
            and sharded paths, payloads travel on point-to-point groups of the default group's
            backend, one per direction between two ranks, headers over gloo: on NCCL from GPU to
            GPU (a route not yet run on several GPUs: logged as unverified), on CPU over gloo.
            Refused with ``on_learner_failure="continue"``, for GPUs on a gloo default group, and
            beyond 15 processes (CUDA stream pools); unused where a whole push fits a header's
            frame (256 KiB). ``stats["payload_channels"]`` names the backend, or None;
            ``stats["payloads_on_channels"]`` counts rank 0's payloads on them.
        overlap_allreduce: on the collective path, where every update takes one gradient from
            every learner (``sync``; ``k_sync`` with K = P and no ``adaptive_k``), each learner
            reduces its gradient in buckets while backward runs, as DDP does. None (default):
            where the default group runs on gloo; True: on NCCL too (logged as unverified);
            False: always after the decision. It applies to automatic optimization with one
            micro-batch per push, no gradient scaler, and no ``on_after_backward`` or
            ``on_before_optimizer_step`` override in the module or a callback (which may change
            the gradients). ``trainer.strategy.overlapped_updates`` counts such updates.
        local_steps: H, local updates (docs/how-to/local-updates.md; central, or collective for
            the sync family): each learner takes H steps of the module's optimizer (its own state,
            kept from one pushed round to the next) from the parameters it took, then pushes the
            pseudo-gradient, those parameters minus its current ones; its injected delay is the
            sum of H draws. New parameters or the stop arriving between two inner steps cancel the
            round. 1 (the default): a push per step, the paper's method.
        outer_optimizer: how the server applies an update's averaged pseudo-gradients: None for
            plain averaging (SGD, lr 1, no momentum), or a class path and its arguments,
            ``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentum": 0.9,
            "nesterov": True}}`` (DiLoCo). Given, it makes local updates even with H = 1.
        adaptive_h: AdaComm's H as on `SimulatedStaleStrategy` (central path, T0 in wall seconds):
            the server shrinks it, its answers carry each learner's next H (``stats["h_history"]``).
        **ddp_kwargs: `DDPStrategy`'s accelerator, parallel_devices, cluster_environment,
            checkpoint_io, precision_plugin, process_group_backend, timeout, start_method.

    Semantics worth knowing: ``trainer.global_step`` is the server update a learner's parameters
    come from, so ``max_steps`` counts server updates; an epoch is one pass worth of mini-batches
    pushed by all learners together, and its end pauses training (work in flight carries over)
    while validation and checkpoints see the server's parameters. A push is one optimizer step
    (``accumulate_grad_batches`` micro-batches), its gradient clipped and, in ``16-mixed``,
    unscaled by the learner; an overflowing one is dropped and counted as "overflow". Any
    exception on any process ends every process at once with a non-zero status, the cause named;
    SIGTERM or SIGINT on any process stops every learner through the goodbye protocol, then
    raises `RunInterrupted` on every process (docs: how-to/faults.md). ``trainer.strategy.stats``
    on global rank 0 holds the server's counters (after a failure, those at the failure).

    With local updates, one Lightning training step is one inner step of this learner, and
    ``trainer.global_step`` is H x the server updates its parameters come from: ``max_steps``,
    ``estimated_stepping_batches`` and the step-interval LR schedulers count inner steps, as on
    `SimulatedStaleStrategy` and under DDP with model averaging (ceil(max_steps / H) updates; under
    ``adaptive_h``, global_step sums the H of the updates, each its completing push's H). Each
    learner steps its own schedulers: a round from server version v runs its H inner steps at the
    schedule's value of inner step v x H (the simulated engine's; under the async family s x H steps
    before it for a push of staleness s), epoch-interval ones (plateau: on rank 0's value) at every
    epoch's end. ``"auto"`` runs them central; on the collective path pseudo-gradients meet in one all-reduce and
    every learner applies the outer step. ``adaptive_k`` grows K from the rounds' losses, the
    staleness compensations weigh the pseudo-gradients (the "norm" rule with the outer
    optimizer's learning rate), and ``on_learner_failure="continue"`` loses a dead learner's round
    in progress, on the paths that run them without local updates. Refused with them, naming
    what to use instead: the sharded path (and ``adaptive_h`` off the central one), ``record_events``,
    ``payload_channels`` (at construction), a step-interval ``ReduceLROnPlateau`` (at setup), and
    resuming with ``ckpt_path`` (the learners' inner states are not saved). Clipping applies to each
    inner step.
    """

    strategy_name = "stale"
    virtual_clock = False
    lightning_base = "DDPStrategy"

    def __init__(self, variant: str = "k_async", k: int | None = None,
                 delay: DelayModel | None = None, *, delay_mode: str = "after_compute",
                 record_trace: bool | str = True,
                 staleness_compensation: str | dict | StalenessCompensation | None = None,
                 adaptive_k: float | dict | AdaptiveK | None = None, seed: int = 0,
                 on_learner_failure: str = "stop", server: str = "auto", server_timeout: float = 30.0,
                 shutdown_timeout: float = 60.0, hold_freed_memory: bool = True, shared_memory: bool = True,
                 overlap_allreduce: bool | None = None, payload_channels: bool = False,
                 record_events: bool | str | os.PathLike = False, digest_every: int = DIGEST_EVERY,
                 local_steps: int = 1, outer_optimizer: str | dict | None = None, adaptive_h: Any = None,
                 **ddp_kwargs: Any) -> None:
        server = self._init_learner_rounds(local_steps, outer_optimizer, adaptive_h, server, record_events,
                                           payload_channels)
        check_options(delay_mode=delay_mode, on_learner_failure=on_learner_failure, variant=variant,
                      hold_freed_memory=hold_freed_memory, shared_memory=shared_memory,
                      payload_channels=payload_channels, overlap_allreduce=overlap_allreduce,
                      server_timeout=server_timeout, shutdown_timeout=shutdown_timeout, ddp_kwargs=ddp_kwargs)
        super().__init__(**ddp_kwargs)
        self._init_recording(record_events, digest_every)
        self._init_server_options(variant, k, delay, adaptive_k, staleness_compensation, record_trace, seed)
        check_path(server, variant, on_learner_failure, self.staleness_compensation)
        self.server = server
        self.delay_mode, self.on_learner_failure = delay_mode, on_learner_failure
        self.server_timeout, self.shutdown_timeout = float(server_timeout), float(shutdown_timeout)
        self.hold_freed_memory, self.shared_memory = hold_freed_memory, shared_memory
        self.overlap_allreduce, self.payload_channels = overlap_allreduce, payload_channels
        self._channels: str | None = None  # the backend of this fit's device channels
        self._channel_ends: dict = {}  # and this rank's ends of them
        self.overlapped_updates = 0  # this rank's updates reduced during backward (last fit)
        self._server_group = None
        self._server: ParameterServer | None = None
        self._learner: Learner | None = None
        self._rounds: LocalSteps | None = None  # this rank's rounds of local updates
        self._side: LearnerSide | None = None  # this rank's learner side (its stats outlive the learner)
        self._checkpoint: CheckpointPart | None = None  # on rank 0, the path's part of a checkpoint
        self._samplers: list[IndependentBatchSampler] = []
        self._pushes_per_epoch, self._batch_samples, self._batch_started = 0, 0, 0.0
        self._buffers_at_start: list[torch.Tensor] = []  # the module's, before this push's forwards
        self._epoch = 0
        self.minibatch_times: list[float] = []  # each push's X as the server saw it (NaN: none)

    @property
    def num_learners(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def _fitting(self) -> Learner:
        assert self._learner is not None, "a learner runs from on_train_start to on_train_end"
        return self._learner

    @property
    @override
    def core(self) -> ServerCore | None:
        return self._server.core if self._server is not None else None

    # ------------------------------------------------------------------ validation, early
    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process when the Trainer is built: fail before any process starts.
        self.check_namespace()
        check_launch(self)
        super()._configure_launcher()
        self._launcher = watched_launcher(
            self._launcher,  # type: ignore[has-type]  # Lightning's, set just above: not visible to a mixin
            tolerate=lambda: self.on_learner_failure == "continue" and self._server is not None)

    # ------------------------------------------------------------------ setup
    @override
    def configure_ddp(self) -> None:
        pass  # no DistributedDataParallel wrapper: the server sends w_0 to every learner

    @override
    def setup(self, trainer) -> None:
        fitting = self.fitting()
        if fitting:
            check_trainer_options(self, trainer)  # before Lightning looks at the data with them
            # The server shapes epochs (the learners' loaders are endless): Lightning must not
            # cut them, nor validate every `limit_train_batches` batches of an endless loader.
            self._limit_train_batches = trainer.limit_train_batches
            self.patch(trainer, "limit_train_batches", 1.0)
            self._samplers = []
            trainer.fit_loop.setup_data()  # before configure_optimizers: estimated_stepping_batches
            with self.counting_updates(trainer, self._pushes_per_epoch):
                super().setup(trainer)
        else:
            super().setup(trainer)
            return
        self.check_trainer(trainer, [])
        self._server_group = (dist.new_group(backend="gloo", timeout=_SERVER_GROUP_TIMEOUT)
                              if self.world_size > 1 else None)
        self._schedulers = self.take_over_schedulers(trainer)
        self.refuse_schedulers(self._schedulers)
        # (with local updates each learner clips its inner steps' gradients, as a DDP rank does)
        self._clip = None if self.local_updates else self.take_over_clipping(trainer)
        # Lightning broadcasts rank 0's SIGTERM flag before every training batch, which would put
        # learners in lock-step; signals are the server's business here (see faults.py).
        self._undo.append(replace_sigterm_broadcast(trainer.fit_loop.epoch_loop, lambda: None))
        self._undo.append(self.track_pace(trainer))
        if self.hold_freed_memory:  # whole-model vectors on every push and answer
            allocator.hold_freed_memory()
        self.validate_on_server_state(trainer)
        self.show_progress(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        sampler, self._pushes_per_epoch = independent_sampler(
            dataloader, self.seed, self.global_rank, self.num_learners, self._limit_train_batches,
            trainer.accumulate_grad_batches, self.local_steps)
        self._note_draws(sampler)
        self._samplers.append(sampler)
        return sampler.loader(dataloader)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        variant = self.settle_variant(self.world_size)
        self._final_stats = None
        self.lost_learner = False
        self._epoch = trainer.current_epoch
        self.path, lanes = settle_path(self.server, variant, self.lightning_module, self._server_group,
                                       self.global_rank, self.on_learner_failure, self.staleness_compensation,
                                       clips=self._clip is not None, nodes=self.num_nodes,
                                       shared_memory=self.shared_memory and not self.payload_channels,
                                       cpu=self.root_device.type == "cpu")
        overlap, self._channels = settle_transport(self, trainer, variant)
        observer = self._start_recording(trainer)
        options = RankOptions(path=self.path, delay=self.delay, delay_is_total=self.delay_mode == "total",
                              on_learner_failure=self.on_learner_failure, server_timeout=self.server_timeout,
                              compensation=self.staleness_compensation, adaptive=self._adaptive, overlap=overlap,
                              shared_memory=self.shared_memory, shutdown_timeout=self.shutdown_timeout,
                              channels=self._channels, timeout=self._timeout, observer=observer,
                              local_steps=self.local_steps, outer=self._outer, adaptive_h=self.fresh_adaptive_h())
        learner, self._server, self._channel_ends = build_rank(
            self.global_rank, self._server_group, self.lightning_module, self.optimizers[0], self._schedulers,
            variant, self.server_limits(trainer), options, self._resume, self._clip, lanes=lanes)
        self._learner, self._resume, self._side = learner, None, learner.exchange
        self._rounds = self.start_rounds(learner)
        self._buffers_at_start = [torch.empty_like(b) for b in learner.vectors.buffers]
        self._checkpoint = None if self._server is None else path_named(self.path).checkpoint(CheckpointView(
            self._server, self.lightning_module, optimizer=lambda: self.optimizers[0], learner=lambda: self._learner,
            finished=lambda: self._final_stats is not None, check_server=self.check_server,
            learner_side=learner.exchange))
        self.overlapped_updates = 0
        self._undo.append(learner.exchange.release)  # hooks on the module: gone at teardown, failed or not
        for sampler in self._samplers:
            sampler.epoch_over = lambda: learner.epoch_over(trainer.current_epoch)
        self._undo.append(self.watch(learner))
        learner.wait_for_parameters()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        first_micro_batch = self._batch_samples == 0
        self._batch_samples += extract_batch_size(batch)  # a push counts all its micro-batches
        if trainer.current_epoch > self._epoch:  # an epoch's end is over: training goes on
            self._epoch = trainer.current_epoch
            self.note_dead_learners(trainer)
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            if self._server is not None:
                self._server.resume(metrics, self.handed_metrics(metrics))
            schedules = self._fitting.exchange.schedules  # stepped here where learners apply updates
            if schedules is not None:
                schedules.end_epoch(self._epoch - 1, metrics)
            self.guarded(self._fitting.resume)
        if first_micro_batch and self._rounds is not None:
            self._rounds.begin()  # a round starts from the parameters taken, or goes on
        if first_micro_batch:
            self._batch_started = time.monotonic()
            with torch.no_grad():  # (into the storage allocated with the learner)
                for saved, buffer in zip(self._buffers_at_start, self._fitting.vectors.buffers):
                    saved.copy_(buffer)
        self._record_batch_start(batch, first_micro_batch, self._fitting)

    @override
    def enter_validation(self) -> None:
        if self._learner is not None and self.fitting():
            self._learner.enter_validation()

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        # A push; the learner's own optimizer never steps: the server's does.
        model = model if model is not None else self.lightning_module
        if self._rounds is not None:
            return self._local_step(self._rounds, model, optimizer, closure)
        loss, overflow = self.compute_gradient(model, optimizer, closure)
        trainer, learner = self.lightning_module.trainer, self._fitting
        if loss is not None:
            loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
            discarded, version, carried = learner.cancelled, learner.version, learner.carried
            stopped = learner.stopped
            self.guarded(learner.step, loss_value, self._batch_samples, self._batch_started,
                          "overflow" if overflow else None)
            self._record_step(learner, carried)
            # The server's state loaded during the step (new parameters, or the STOP, which
            # always loads) replaced what the forward passes left; nothing to undo then.
            loaded = learner.version != version or (learner.stopped and not stopped)
            if learner.cancelled > discarded and not loaded:
                # Discarded with nothing loaded (it started after an epoch's end, or after the
                # server's STOP was taken as training went on): as if it never ran, so its
                # forward passes leave no trace in the buffers either, and the module ends
                # with the server's final buffers (docs/concepts/server.md, "Buffers are
                # model state").
                with torch.no_grad():
                    for buffer, saved in zip(learner.vectors.buffers, self._buffers_at_start):
                        buffer.copy_(saved)
            self.minibatch_times.append(learner.last_x)  # X, for MiniBatchTimer
        self._batch_samples = 0
        self.note_dead_learners(trainer)  # before Lightning decides to validate
        set_global_step(trainer, max(learner.version, 0))
        if learner.stopped:
            trainer.should_stop = True
        self._report_metrics(trainer)
        return loss

    def _report_metrics(self, trainer) -> None:
        """A plateau scheduler stepped per update reads the latest logged metrics."""
        if not any(c.reduce_on_plateau and c.interval == "step" for c in self._schedulers):
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        schedules = self._fitting.exchange.schedules
        if schedules is not None:  # collective: every learner steps its own
            schedules.metrics.update(metrics)
        elif self._server is not None:
            self._server.report_metrics(metrics)

    # ------------------------------------------------------------------ checkpoints
    @override
    def server_state(self) -> Any:
        return None  # the checkpoint's parts come from the path's (`paths.base.CheckpointPart`)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state_dict = super().lightning_module_state_dict()
        return self._checkpoint.module_state(state_dict) if self._checkpoint is not None else state_dict

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        own = super().optimizer_state(optimizer)
        return self._checkpoint.optimizer_state(own) if self._checkpoint is not None else own

    def _engine_checkpoint(self) -> dict:
        assert self._checkpoint is not None, "a checkpoint of the server's books is written on rank 0"
        return self._checkpoint.engine_state()

    @override
    def books_lock(self) -> Any:
        return self._server.lock if self._server is not None else super().books_lock()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``Trainer(strategy="k_async")`` and the other five variant names."""
        for name in VARIANT_NAMES:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"parameter server, variant {name}",
                                           variant=name)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        try:  # (after a failure the watchdog bounds all of it, Lightning's teardown too: see finally)
            learner = self._learner
            if learner is not None and not self._failure_raised and not learner.failure:
                try:  # an exception ended training here: leave without hanging
                    self._shut_down()
                except Exception as exc:  # noqa: BLE001 - the original error matters more
                    log.warning("StaleStrategy: unclean shutdown after an error: %s", exc)
            failed = self._learner is not None
            self._learner = None
            if failed and self._server is not None:
                try:  # the counters and the delays drawn so far
                    self._collect_stats(unannounced=learner)
                except Exception as exc:  # noqa: BLE001 - the original error matters more
                    log.warning("StaleStrategy: could not write the trace of the failed run: %s", exc)
            if failed and learner is not None:  # (the same learner: it never left)
                self.overlapped_updates = learner.exchange.overlapped_updates  # (so far)
                self.leave_failed_run(learner)
            if self._server_group is not None and not failed:
                # (a group whose connections broke is left to the process's exit: destroying
                # it under a thread blocked in a receive aborts the process)
                close_channels(self._channel_ends)
                dist.destroy_process_group(self._server_group)
            self._server_group, self._channel_ends = None, {}
            if dist.is_available() and dist.is_initialized():
                destroy_groups_at_exit(clean=not failed)
        finally:
            self._abandon_recording()
            self.undo_patches()
            self.local_collectives = False
            try:  # (moving the module and the optimizer to the CPU, emptying the CUDA cache: each
                # waits for the device, which a dead peer's NCCL operation may hold for good)
                super().teardown()
            finally:
                self.stop_watching()


register_everywhere(StaleStrategy)
