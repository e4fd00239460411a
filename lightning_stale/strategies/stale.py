"""`StaleStrategy`: Lightning's DDP launching, with a parameter server instead of all-reduce."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.utilities.data import extract_batch_size
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_stale.delays.models import DelayModel
from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed import allocator
from lightning_stale.engine.distributed.channels import close_channels
from lightning_stale.engine.distributed.learner import Learner, RunInterrupted, ServerFailed
from lightning_stale.engine.distributed.ranks import (
    RankOptions,
    build_rank,
    channel_backend,
    check_path,
    levels_agree,
    overlap_wanted,
    overlaps,
    settle_path,
)
from lightning_stale.engine.distributed.server import LEARNER_FAILURE_MODES, ParameterServer
from lightning_stale.engine.state import ModelVectors
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import VARIANT_NAMES
from lightning_stale.strategies.base import ServerStrategyMixin
from lightning_stale.strategies.checkpoints import ServerCheckpoint
from lightning_stale.strategies.faults import FaultHandling, destroy_groups_at_exit, watched_launcher
from lightning_stale.strategies.lightning_api import (
    hooks_after_backward,
    process_group_backend,
    replace_sigterm_broadcast,
    set_global_step,
)
from lightning_stale.strategies.namespaces import register_everywhere
from lightning_stale.strategies.pace import OwnPaceCollectives
from lightning_stale.strategies.sampling import IndependentBatchSampler, check_trainer_options, independent_sampler

log = logging.getLogger(__name__)

DELAY_MODES = ("after_compute", "total")
_SERVER_GROUP_TIMEOUT = timedelta(days=7)  # a gloo timeout kills the connection: never hit it
# Routes that have not run on two or more GPUs: never a default, logged when asked for.
UNVERIFIED = ("%s: this route has not run on two or more GPUs yet (see the documentation's GPU "
              "page); pass False to use the verified route")
_DDP_OPTIONS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                "precision_plugin", "process_group_backend", "timeout", "start_method")


class StaleStrategy(FaultHandling, OwnPaceCollectives, ServerStrategyMixin):
    """Runs one of the six variants of Dutta et al. (AISTATS 2018) with a real parameter server.

    The P learners are the Trainer's processes (devices x nodes), launched as for DDP. Global
    rank 0 also hosts the server thread, which owns the authoritative parameters, optimizer
    state and schedulers, and updates as soon as the variant's rule is met; learners compute
    gradients at the parameters they last received. Server traffic uses its own gloo group on CPU
    tensors, so GPU runs keep NCCL for Lightning's own collectives.

    Args:
        variant: ``sync``, ``k_sync``, ``k_batch_sync``, ``async``, ``k_async`` or
            ``k_batch_async``.
        k: K, an integer 1 <= K <= P; None: P for sync, 1 for async, ceil(P/2) otherwise.
        delay: a straggler model from `lightning_stale.delays`; each learner draws one delay per
            mini-batch after its backward pass and before its push (interruptible by a
            cancellation).
        delay_mode: ``"after_compute"`` (default): the delay is added after the backward pass;
            ``"total"``: the delay is the mini-batch's whole time X as the server sees it (from
            sending the parameters to receiving the gradient), as in the paper's model and in a
            trace recorded elsewhere: the real computation and the learner's measured message
            round trip count toward it (a mini-batch that already took longer is not shortened).
        record_trace: write the delays drawn, per learner, in the `Trace` format: True for
            ``delays.csv`` in the log directory, a path, or False.
        staleness_compensation: None, ``"inverse"`` (step of a gradient of staleness s scaled by
            1/max(1, s)), ``"norm"`` settings as a dict, or a `StalenessCompensation`.
        adaptive_k: AdaSync schedule of K over wall-clock seconds (K-variants only): an
            `AdaptiveK`, a dict of its arguments, or the interval T0 in seconds.
        seed: seed of every learner's independent mini-batch sampler.
        server: where updates are applied (`engine.distributed.ranks`): ``"central"`` (the server
            on rank 0 holds the parameters), ``"collective"`` (sync family: the gradients of an
            update meet in one all-reduce on the default group and every learner applies it),
            ``"sharded"`` (every rank owns a slice of the parameters and optimizer state), or
            ``"auto"`` (default: collective for the sync family on models of at least
            ``ranks.SCALE_MIN_NUMEL`` values, or, for CPU learners on one node that all share
            memory with rank 0 (``shared_memory``), ``ranks.ONE_HOST_COLLECTIVE_MIN_NUMEL``
            (``ranks.CROWDED_HOST_COLLECTIVE_MIN_NUMEL`` where they outnumber the node's
            cores); sharded for the async family once
            parameters x (P - 1) reach ``ranks.SHARDED_MIN_TRAFFIC`` and, on one node, P
            reaches ``ranks.ONE_HOST_SHARDED_MIN_P``; else central).
            ``stats["server_path"]`` says which ran (and ``stats["shared_memory_learners"]``
            which learners used `shared_memory`).
        on_learner_failure: ``"stop"`` (default): a learner that dies ends the run, like DDP;
            ``"continue"``: the server drops it, clamps K to the learners left and goes on
            (needs K < P; validation is skipped after a death: the default process group lost
            a member). Lightning's child-process watchdog then tolerates the death.
        server_timeout: seconds of silence after which a learner takes the server for dead (the
            server sends heartbeats when idle).
        shutdown_timeout: seconds to wait for every learner to leave at the end of training.
        hold_freed_memory: from the first fit on, keep the memory this process frees for
            reuse instead of handing it back to the system (glibc's ``mallopt``; nothing
            elsewhere): a fresh vector of the model's size per push and answer otherwise costs
            a page fault per page (`engine.distributed.allocator`). It stays set for the
            process's life. False leaves the allocator alone.
        shared_memory: on the central path, a learner on rank 0's host sends its pushes and
            receives its parameters through a file in ``/dev/shm`` mapped by both processes,
            with only the headers over gloo (`engine.distributed.lanes`; learners on other
            hosts, or where ``/dev/shm`` lacks the space, use gloo). False: gloo for all.
        payload_channels: False (default): payloads go through host memory, with their
            headers over gloo. True: on the central and sharded paths, payloads travel on
            point-to-point groups of the default group's backend, one per direction between two
            ranks (`engine.distributed.channels`), with only the headers over gloo: on NCCL,
            gradients and parameters go from GPU to GPU without a copy through host memory (a
            route that has not run on several GPUs yet: it is logged as unverified at start-up);
            on CPU, gloo groups. Refused with ``on_learner_failure="continue"`` (a dead peer
            would leave NCCL waiting), for GPUs on a gloo default group, and beyond 15
            processes (each channel needs CUDA streams of its own, from PyTorch's pools of 32:
            `engine.streams`); unused for a model whose whole push fits a header's frame
            (256 KiB). ``stats["payload_channels"]`` names the backend used, or None, and
            ``stats["payloads_on_channels"]`` counts the payloads rank 0 sent and received on them.
        overlap_allreduce: on the collective path, where every update takes one gradient from
            every learner (``sync``; ``k_sync`` with K = P and no ``adaptive_k``), each learner
            reduces its gradient in buckets while backward runs, as DDP does
            (`engine.distributed.overlap`), on a process group of its own. None (default): where
            the default group runs on gloo; not on NCCL, where that second communicator beside
            the default one has not run on several GPUs yet. True: on NCCL too (logged as
            unverified at start-up). It applies to
            automatic optimization with one micro-batch per push and no gradient scaler
            (``16-mixed``), and where neither the module nor a callback overrides
            ``on_after_backward`` or ``on_before_optimizer_step`` (they may change the
            gradients after backward, and are then taken into account: the all-reduce follows
            the server's decision, as it does everywhere else).
            ``trainer.strategy.overlapped_updates`` counts the updates reduced so on this rank.
            False: always after the decision.
        Other arguments are `DDPStrategy`'s (accelerator, parallel_devices,
        cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout,
        start_method).

    Semantics worth knowing: ``trainer.global_step`` is the server update a learner's parameters
    come from, so ``max_steps`` counts server updates; an epoch is one pass worth of mini-batches
    pushed by all learners together, and its end pauses training (work in flight carries over)
    while validation and checkpoints see the server's parameters. A push is one optimizer step
    (``accumulate_grad_batches`` micro-batches), its gradient clipped and, in ``16-mixed``,
    unscaled by the learner; an overflowing one is dropped and counted as "overflow". Any
    exception on any process ends every process at once with a non-zero status, the cause named;
    SIGTERM or SIGINT on any process stops every learner through the goodbye protocol, then
    raises `RunInterrupted` on every process (``on_exception`` hooks run; non-zero status). The
    README's "Faults" section has the whole fault model. ``trainer.strategy.stats`` on global
    rank 0 holds the server's counters (after a failure, those at the failure).
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
                 **ddp_kwargs: Any) -> None:
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
        unknown = sorted(set(ddp_kwargs) - set(_DDP_OPTIONS))
        if unknown:
            raise ValueError(f"StaleStrategy got unknown options {unknown}; it does not wrap the model "
                             f"in DistributedDataParallel, and accepts {sorted(_DDP_OPTIONS)}")
        super().__init__(**ddp_kwargs)
        self._init_server_options(variant, k, delay, adaptive_k, staleness_compensation,
                                  record_trace, seed)
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
        self._mesh = None  # the sharded path's data mesh on this rank
        self._samplers: list[IndependentBatchSampler] = []
        self._pushes_per_epoch = 0
        self._batch_samples = 0
        self._batch_started = 0.0
        self._buffers_at_start: list[torch.Tensor] = []  # the module's, before this push's forwards
        self._epoch = 0
        self.minibatch_times: list[float] = []  # each push's X as the server saw it (NaN: none)

    @property
    def num_learners(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    @override
    def core(self) -> ServerCore | None:
        return self._server.core if self._server is not None else None

    # ------------------------------------------------------------------ validation, early
    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process when the Trainer is built: fail before any process starts.
        self.check_namespace()
        on_cpu = all(d.type == "cpu" for d in (self.parallel_devices or []))
        if on_cpu and process_group_backend(self) == "nccl":
            raise ValueError("process_group_backend='nccl' needs GPUs, but this Trainer runs on CPU: "
                             "use 'gloo' or leave it unset (the server's own traffic is always gloo)")
        variant = self.settle_variant(self.num_learners)
        if self.on_learner_failure == "continue" and variant.k == variant.p and self._adaptive is None:
            raise ValueError(f"on_learner_failure='continue' needs K < P, got K = P = {variant.p}: "
                             "every update would wait for the dead learner")
        super()._configure_launcher()
        self._launcher = watched_launcher(
            self._launcher, tolerate=lambda: self.on_learner_failure == "continue" and self._server is not None)

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
        self._clip = self.take_over_clipping(trainer)
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
            trainer.accumulate_grad_batches)
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
        limits = ServerLimits(max_updates=trainer.max_steps, pushes_per_epoch=self._pushes_per_epoch,
                              max_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1)
        # The collective path under a variant whose every update takes one gradient from each
        # learner, one backward per push, no scaler to undo and no user hook that may change
        # gradients after backward: a round's gradient is then the one pushed.
        default_backend = dist.get_backend() if self.world_size > 1 else None
        overlap = (overlap_wanted(self.overlap_allreduce, default_backend) and self.path == "collective"
                   and overlaps(variant, self._adaptive) and trainer.accumulate_grad_batches == 1
                   and self.lightning_module.automatic_optimization
                   and getattr(self.precision_plugin, "scaler", None) is None)
        hooks = hooks_after_backward(self.lightning_module, trainer.callbacks) if overlap else []
        if hooks and self.global_rank == 0:
            log.info("overlap_allreduce: the all-reduce follows the server's decision, after %s, "
                     "which may change the gradients", ", ".join(hooks))
        overlap = overlap and not hooks
        vectors = ModelVectors.of(self.lightning_module)
        if overlap and default_backend == "nccl" and self.global_rank == 0:
            log.warning(UNVERIFIED, "overlap_allreduce=True (the overlap's own NCCL group)")
        choice = partial(channel_backend, self.payload_channels, self.path, self.world_size,
                         default_backend, self.root_device,
                         self.on_learner_failure, vectors.max_push_numel() * vectors.dtype.itemsize)
        self._channels = choice()
        # (asked only where NCCL channels would open: the same on every rank, as the question is
        # collective; without the levels they are refused, saying why)
        if self._channels == "nccl" and not levels_agree(self._server_group, self.root_device):
            self._channels = choice(separate_levels=False)
        if self._channels == "nccl" and self.global_rank == 0:
            log.warning(UNVERIFIED, "payload_channels=True (NCCL point-to-point groups for payloads)")
        options = RankOptions(self.path, self.delay, self.delay_mode == "total", self.on_learner_failure,
                              self.server_timeout, self.staleness_compensation, self._adaptive,
                              self.shared_memory, overlap, self.shutdown_timeout, self._channels, self._timeout)
        learner, self._server, self._channel_ends = build_rank(
            self.global_rank, self._server_group, self.lightning_module, self.optimizers[0], self._schedulers,
            variant, limits, options, self._resume, self._clip, lanes=lanes)
        self._learner, self._resume = learner, None
        self._buffers_at_start = [torch.empty_like(b) for b in learner.vectors.buffers]
        self.shard_layout = getattr(learner.exchange, "layout", None)
        self._mesh = getattr(learner.exchange, "mesh", None)  # the sharded path's, for its stats
        self.shard_params = learner.vectors.params
        self._checkpoint = ServerCheckpoint(self)
        self.overlapped_updates = 0
        if hasattr(learner.exchange, "release"):  # hooks on the module: gone at teardown, failed or not
            self._undo.append(learner.exchange.release)
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
                self._server.resume(metrics)
            schedules = self._learner.exchange.schedules  # stepped here where learners apply updates
            if schedules is not None:
                schedules.end_epoch(self._epoch - 1, metrics)
            self.guarded(self._learner.resume)
        if first_micro_batch:
            self._batch_started = time.monotonic()
            with torch.no_grad():  # (into the storage allocated with the learner)
                for saved, buffer in zip(self._buffers_at_start, self._learner.vectors.buffers):
                    saved.copy_(buffer)

    @override
    def enter_validation(self) -> None:
        if self._learner is not None and self.fitting():
            self._learner.enter_validation()

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        # A push; the learner's own optimizer never steps: the server's does.
        model = model if model is not None else self.lightning_module
        loss, overflow = self.compute_gradient(model, optimizer, closure)
        trainer = self.lightning_module.trainer
        if loss is not None:
            loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
            learner = self._learner
            discarded, version = learner.cancelled, learner.version
            self.guarded(learner.step, loss_value, self._batch_samples, self._batch_started,
                          "overflow" if overflow else None)
            if learner.cancelled > discarded and learner.version == version and not learner.stopped:
                # Discarded with no new parameters (it started after an epoch's end): as if it
                # never ran, so its forward passes leave no trace in the buffers either.
                with torch.no_grad():
                    for buffer, saved in zip(learner.vectors.buffers, self._buffers_at_start):
                        buffer.copy_(saved)
            self.minibatch_times.append(self._learner.last_x)  # X, for MiniBatchTimer
        self._batch_samples = 0
        self.note_dead_learners(trainer)  # before Lightning decides to validate
        set_global_step(trainer, max(self._learner.version, 0))
        if self._learner.stopped:
            trainer.should_stop = True
        self._report_metrics(trainer)
        return loss

    def _report_metrics(self, trainer) -> None:
        """A plateau scheduler stepped per update reads the latest logged metrics."""
        if not any(c.reduce_on_plateau and c.interval == "step" for c in self._schedulers):
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        schedules = self._learner.exchange.schedules
        if schedules is not None:  # collective: every learner steps its own
            schedules.metrics.update(metrics)
        elif self._server is not None:
            self._server.report_metrics(metrics)

    @override
    def on_train_end(self) -> None:
        self._step_last_epoch_schedulers()
        self._shut_down()
        super().on_train_end()

    def _step_last_epoch_schedulers(self) -> None:
        """Lightning steps the epoch-interval schedulers after every epoch's validation, the
        last epoch's too; the server steps them when the next epoch begins, so when the fit
        ended with an epoch (not with ``max_steps`` inside one) that epoch's are stepped here."""
        server = self._server
        if server is None or self._learner is None:
            return
        with server.lock:
            epochs_ended = server.core.epoch
        if epochs_ended > self._epoch:
            trainer = self.lightning_module.trainer
            server.resume({k: float(v) for k, v in trainer.callback_metrics.items()})

    def _shut_down(self) -> None:
        learner, self._learner = self._learner, None
        if learner is None:
            return
        self.stop_watching()
        learner.close(self.shutdown_timeout)
        if self._server is not None:
            self._finish_server()
        stuck = learner.exchange.close(self.shutdown_timeout)
        self.overlapped_updates = getattr(learner.exchange, "overlapped_updates", 0)
        if stuck:
            raise ServerFailed(f"threads still running after shutdown: {stuck}")
        if learner.interrupted:  # a signal stopped training: everyone left, the run did not finish
            self._failure_raised = True
            raise RunInterrupted(f"{learner.interrupted}: training stopped before its end (every "
                                 "learner left through the shutdown protocol)")

    def _finish_server(self) -> None:
        if not self._server.join(self.shutdown_timeout):
            raise ServerFailed(f"the parameter server did not finish within {self.shutdown_timeout} s")
        stuck = self._server.endpoint.join(self.shutdown_timeout)
        if stuck:
            raise ServerFailed(f"server threads still running after shutdown: {stuck}")
        self.check_server()
        self._checkpoint.finish()
        self._collect_stats()

    def _collect_stats(self, unannounced: Learner | None = None) -> None:
        """The final counters, and the trace of the delays drawn (written atomically). After a
        normal end the trace holds every learner's delays (from their goodbyes); after a failure
        (``unannounced``: rank 0's learner, which said no goodbye) it holds rank 0's delays and
        those of learners that had said goodbye, not the others'."""
        stats, recorder = self._server.final_report(
            None if unannounced is None else (unannounced.rank, unannounced.delays, unannounced.cancelled))
        stats["server_path"] = self.path
        stats["shared_memory_learners"] = self._server.endpoint.lane_learners
        stats["payload_channels"] = self._channels
        stats["payloads_on_channels"] = (self._server.endpoint.payloads_on_channels  # rank 0's
                                         + (self._mesh.payloads_on_channels if self._mesh is not None else 0))
        path = self.write_trace(recorder)
        if path is not None:
            stats["trace_path"] = path
        self._final_stats = stats

    # ------------------------------------------------------------------ checkpoints
    @override
    def server_state(self) -> Any:
        return None  # the checkpoint's parts come from `ServerCheckpoint`, per path

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state_dict = super().lightning_module_state_dict()
        return self._checkpoint.module_state(state_dict) if self._server is not None else state_dict

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        own = super().optimizer_state(optimizer)
        return self._checkpoint.optimizer_state(own) if self._server is not None else own

    def _engine_checkpoint(self) -> dict:
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
            if failed:
                self.overlapped_updates = getattr(learner.exchange, "overlapped_updates", 0)  # (so far)
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
            self.undo_patches()
            self.local_collectives = False
            try:  # (moving the module and the optimizer to the CPU, emptying the CUDA cache: each
                # waits for the device, which a dead peer's NCCL operation may hold for good)
                super().teardown()
            finally:
                self.stop_watching()


register_everywhere(StaleStrategy)
