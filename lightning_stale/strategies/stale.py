"""`StaleStrategy`: Lightning's DDP launching, with a parameter server instead of all-reduce."""

from __future__ import annotations

import copy
import queue
import logging
import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.data import extract_batch_size
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.delays.traces import TraceRecorder
from lightning_stale.strategies.lightning_api import trace_path
from lightning_stale.method.rules import ServerRules
from lightning_stale.engine.distributed.learner import Learner, ServerFailed
from lightning_stale.engine.distributed.server import ParameterServer, ServerLimits
from lightning_stale.strategies.sampling import IndependentBatchSampler
from lightning_stale.engine.state import FlatView, ServerState, trainable_parameters
from lightning_stale.engine.distributed.transport import LearnerEndpoint, ServerEndpoint
from lightning_stale.method.variants import VARIANT_NAMES, Variant, check_k

log = logging.getLogger(__name__)

DELAY_MODES = ("after_compute", "total")
_SERVER_GROUP_TIMEOUT = timedelta(days=7)  # a gloo timeout kills the connection: never hit it


class _LocalCollectives(Callback):
    """Marks when learners run at their own pace (inside training batches): collectives issued
    there, e.g. ``self.log(..., sync_dist=True)`` in ``training_step``, would pair up calls from
    different steps and deadlock, so the strategy answers them locally. At epoch ends and in
    validation every learner is in step again and collectives are real."""

    def __init__(self, strategy: StaleStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_start(self, *args: Any) -> None:
        self.strategy._local_collectives = True

    def on_validation_start(self, *args: Any) -> None:
        self.strategy._local_collectives = False

    def on_train_epoch_end(self, *args: Any) -> None:
        self.strategy._local_collectives = False


def _raise_on_local_sigterm(trainer) -> None:
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()


class StaleStrategy(DDPStrategy):
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
        shutdown_timeout: seconds to wait for every learner to leave at the end of training.
        Other arguments are `DDPStrategy`'s (accelerator, parallel_devices,
        cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout,
        start_method).

    Semantics worth knowing: ``max_steps`` counts server updates; an epoch is one pass worth of
    mini-batches pushed by all learners together, and ends with a flush (pending gradients are
    dropped and counted, everyone gets the current parameters) so validation and checkpoints
    see the server's parameters. Gradient clipping applies to each learner's gradient before it
    is pushed. ``trainer.strategy.stats`` on global rank 0 holds the server's counters.
    """

    strategy_name = "stale"
    virtual_clock = False

    def __init__(self, variant: str = "k_async", k: int | None = None, delay: Any = None, *,
                 delay_mode: str = "after_compute", record_trace: bool | str = True,
                 staleness_compensation: Any = None, adaptive_k: Any = None,
                 seed: int = 0, shutdown_timeout: float = 60.0, **ddp_kwargs: Any) -> None:
        check_k(variant, k)
        if delay_mode not in DELAY_MODES:
            raise ValueError(f"unknown delay_mode {delay_mode!r}; choose one of {', '.join(DELAY_MODES)}")
        known = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                 "precision_plugin", "process_group_backend", "timeout", "start_method"}
        unknown = sorted(set(ddp_kwargs) - known)
        if unknown:
            raise ValueError(f"StaleStrategy got unknown options {unknown}; it does not wrap the model "
                             f"in DistributedDataParallel, and accepts {sorted(known)}")
        if adaptive_k is not None:
            if variant in ("sync", "async"):
                raise ValueError(f"adaptive_k changes K, so it needs a K-variant, got variant {variant!r}")
            AdaptiveK.create(adaptive_k, k0=k or 1)  # checks the spec now; K_0 is settled once P is known
        super().__init__(**ddp_kwargs)
        self.variant_name, self.k, self.delay, self.delay_mode = variant, k, delay, delay_mode
        self.record_trace, self.adaptive_k = record_trace, adaptive_k
        self.staleness_compensation = StalenessCompensation.create(staleness_compensation)
        self._adaptive: AdaptiveK | None = None
        self.seed, self.shutdown_timeout = seed, shutdown_timeout
        self.stats: dict[str, Any] = {}
        self._local_collectives = False
        self._server_group = None
        self._server: ParameterServer | None = None
        self._learner: Learner | None = None
        self._resume_state: dict | None = None
        self._samplers: list[IndependentBatchSampler] = []
        self._pushes_per_epoch = 0
        self._batch_samples = 0
        self._undo: list[Any] = []

    # ------------------------------------------------------------------ validation, early
    @property
    def num_learners(self) -> int:
        return self.num_nodes * self.num_processes

    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process when the Trainer is built: fail before any process starts.
        on_cpu = all(d.type == "cpu" for d in (self.parallel_devices or []))
        if on_cpu and self._process_group_backend == "nccl":
            raise ValueError("process_group_backend='nccl' needs GPUs, but this Trainer runs on CPU: "
                             "use 'gloo' or leave it unset (the server's own traffic is always gloo)")
        variant = Variant.create(self.variant_name, self.num_learners, self.k)
        if self.delay is not None and hasattr(self.delay, "check_learners"):
            self.delay.check_learners(variant.p)
        if self.adaptive_k is not None:
            adaptive = copy.deepcopy(AdaptiveK.create(self.adaptive_k, k0=variant.k))
            if self.k is not None and self.k != adaptive.k0:
                raise ValueError(f"k={self.k} disagrees with adaptive_k's k0={adaptive.k0}; give one")
            adaptive.limit(variant.p)
            self._adaptive, self.k = adaptive, adaptive.k0
        super()._configure_launcher()

    def _check_trainer(self, trainer) -> None:
        problems = []
        if trainer.accumulate_grad_batches != 1:
            problems.append("accumulate_grad_batches must be 1 (the server takes one gradient per push)")
        if not self.lightning_module.automatic_optimization:
            problems.append("manual optimization is not supported: use automatic optimization")
        if len(self.optimizers) != 1:
            problems.append(f"exactly one optimizer is supported, got {len(self.optimizers)}")
        if self._layer_sync is not None:
            problems.append("sync_batchnorm must be False: SyncBatchNorm runs a collective in every forward, "
                            "which learners at their own pace cannot join")
        if trainer.val_check_interval != 1.0:
            problems.append("val_check_interval must be 1.0: validation runs at the server's epoch ends, "
                            "when all learners are in step (use check_val_every_n_epoch)")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            problems.append("precision '16-mixed' uses a gradient scaler the server does not run: "
                            "use '32-true' or 'bf16-mixed'")
        if any(type(c.scheduler).__name__ == "ReduceLROnPlateau" for c in self.lr_scheduler_configs):
            problems.append("ReduceLROnPlateau is not supported: the server steps schedulers per update/epoch")
        if problems:
            raise ValueError("StaleStrategy cannot run this Trainer: " + "; ".join(problems))

    # ------------------------------------------------------------------ setup
    @override
    def configure_ddp(self) -> None:
        pass  # no DistributedDataParallel wrapper: the server sends w_0 to every learner

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._check_trainer(trainer)
        self._samplers = []
        self._server_group = (dist.new_group(backend="gloo", timeout=_SERVER_GROUP_TIMEOUT)
                              if self.world_size > 1 else None)
        loop = trainer.fit_loop.epoch_loop
        self._max_updates, loop.max_steps = loop.max_steps, -1  # learners stop when the server says
        self._undo.append(lambda: setattr(loop, "max_steps", self._max_updates))
        # The server steps the schedulers (per update or per its epochs), not every learner.
        self._server_schedulers, self.lr_scheduler_configs = self.lr_scheduler_configs, []
        self._undo.append(lambda: setattr(self, "lr_scheduler_configs", self._server_schedulers))
        # Lightning broadcasts a SIGTERM flag on the default group before every training batch,
        # which would put learners in lock-step; each learner checks its own flag instead.
        loop._broadcast_sigterm_tensor = lambda: _raise_on_local_sigterm(trainer)
        self._undo.append(lambda: delattr(loop, "_broadcast_sigterm_tensor"))
        phase = _LocalCollectives(self)
        trainer.callbacks.insert(0, phase)
        self._undo.append(lambda: trainer.callbacks.remove(phase))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError("StaleStrategy needs a map-style training dataset: each learner draws "
                             "its own mini-batches independently")
        batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
        if batch_size is None:
            raise ValueError("StaleStrategy needs a training DataLoader with a batch_size")
        n = len(dataloader.dataset)
        self._pushes_per_epoch = math.ceil(n / batch_size)
        sampler = IndependentBatchSampler(n, batch_size, self.seed, self.global_rank)
        self._samplers.append(sampler)
        return DataLoader(dataloader.dataset, batch_sampler=sampler, num_workers=dataloader.num_workers,
                          collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                          worker_init_fn=dataloader.worker_init_fn,
                          persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        p = self.world_size
        view = FlatView(trainable_parameters(self.lightning_module))
        variant = Variant.create(self.variant_name, p, self.k)
        if self.global_rank == 0:
            rules = ServerRules(variant)
            state = ServerState(self.lightning_module, self.optimizers[0], self._server_schedulers)
            limits = ServerLimits(max_updates=self._max_updates, pushes_per_epoch=self._pushes_per_epoch,
                                  max_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1)
            if self._adaptive is not None:
                self._adaptive.reset()
            self._server = ParameterServer(rules, state, limits, self.staleness_compensation, self._adaptive)
            if self._resume_state is not None:
                self._server.load_state_dict(self._resume_state)
                self._resume_state = None
            server_endpoint = ServerEndpoint(self._server_group, p, self._server.events.put, queue.Queue())
            endpoint = LearnerEndpoint(0, self._server_group, local_server=server_endpoint)
            self._server.start(server_endpoint)
        else:
            endpoint = LearnerEndpoint(self.global_rank, self._server_group)
        server = self._server
        learner = self._learner = Learner(endpoint, view, self.delay,
                                          failed=lambda: server.error if server else None,
                                          waits_for_answer=variant.pusher_needs_answer,
                                          delay_is_total=self.delay_mode == "total")
        for sampler in self._samplers:
            sampler.epoch_over = lambda: learner.epoch_over(trainer.current_epoch)
        learner.wait_for_parameters()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._batch_samples = extract_batch_size(batch)
        if batch_idx == 0:  # the pause at the epoch boundary (validation) is no mini-batch's time
            self._learner.restart_clock()

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        # The closure runs forward, backward, on_before_optimizer_step and clipping, exactly once.
        # The learner's own optimizer never steps: the server's does.
        model = model if model is not None else self.lightning_module
        loss = self.precision_plugin._wrap_closure(model, optimizer, closure)
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
        trainer = self.lightning_module.trainer
        self._learner.step(loss_value, self._batch_samples, trainer.current_epoch)
        if self._learner.stopped:
            trainer.should_stop = True
        return loss

    @override
    def on_train_end(self) -> None:
        self._shut_down()
        super().on_train_end()

    def _shut_down(self) -> None:
        learner, self._learner = self._learner, None
        if learner is None:
            return
        learner.close(self.shutdown_timeout)
        if self._server is None:
            return
        if not self._server.join(self.shutdown_timeout):
            raise ServerFailed(f"the parameter server did not finish within {self.shutdown_timeout} s")
        stuck = self._server.endpoint.join(self.shutdown_timeout)
        if stuck:
            raise ServerFailed(f"server threads still running after shutdown: {stuck}")
        if self._server.error:
            raise ServerFailed(self._server.error)
        self._collect_stats()

    def _collect_stats(self) -> None:
        server = self._server
        stats = server.rules.stats()
        reports = server.learner_reports
        stats["mean_update_interval_s"] = server.mean_update_interval_s
        stats["computations_cancelled"] = sum(m.samples for m in reports.values())
        stats["epochs"] = server.epoch
        if server.adaptive is not None:
            stats["k_history"] = list(server.adaptive.history)
        self.stats = stats
        if self.record_trace:
            recorder = TraceRecorder()
            for learner in sorted(reports):
                payload = reports[learner].payload
                for value in ([] if payload is None else payload.tolist()):
                    recorder.record(learner, value)
            path = trace_path(self.record_trace, self.lightning_module.trainer)
            self.stats["trace_path"] = str(recorder.write(path))

    def pop_update_records(self) -> list:
        return self._server.pop_update_records() if self._server is not None else []

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor if self._local_collectives else super().reduce(tensor, group, reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._local_collectives:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj, src: int = 0):
        return obj if self._local_collectives else super().broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision if self._local_collectives else super().reduce_boolean_decision(decision, all)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self._server is not None:  # the server's parameters are the model's
            with self._server.lock:
                names = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad]
                state.update({n: p.detach().clone() for n, p in zip(names, self._server.state.params)})
        return state

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._server is not None:
            with self._server.lock:
                return self._server.state.optimizer.state_dict()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        if self._server is not None:
            checkpoint["stale_server"] = self._server.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        self._resume_state = checkpoint.get("stale_server")
        return checkpoint

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        try:
            if self._learner is not None:  # an exception ended training: leave without hanging
                try:
                    self._shut_down()
                except Exception as exc:  # noqa: BLE001 - the original error matters more
                    log.warning("StaleStrategy: unclean shutdown after an error: %s", exc)
            if self._server_group is not None:
                dist.destroy_process_group(self._server_group)
                self._server_group = None
        finally:
            while self._undo:
                self._undo.pop()()
            self._local_collectives = False
            super().teardown()


def _register(registry) -> None:
    for name in VARIANT_NAMES:
        if name not in registry:
            registry.register(name, StaleStrategy, description=f"parameter server, variant {name}",
                              variant=name)


_register(StrategyRegistry)
