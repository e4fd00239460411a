"""P learners and a parameter server simulated in one process on a virtual clock.

`SimulatedStaleStrategy` runs any of the six variants of Dutta et al., "Slow and Stale Gradients
Can Win the Race" (AISTATS 2018; docs/method.md) inside an ordinary single-device Lightning fit.
Every Lightning training step is one simulated gradient push (with local updates, one of a
learner's H inner steps); see `SimulatedServer` for the engine. Local updates' rounds
(`strategies.local_updates.LocalUpdatesMixin`) and the event log's recording and replay
(`strategies.event_log.EventLogMixin`) are mixed in from their own modules.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from pytorch_lightning import LightningModule
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.data import extract_batch_size
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from typing_extensions import override

from lightning_stale.delays.models import DelayModel, NoDelay
from lightning_stale.delays.traces import RecordingDelay, TraceRecorder
from lightning_stale.engine.core import ServerCore
from lightning_stale.engine.simulated import SimulatedServer
from lightning_stale.engine.state import ModelVectors, ServerState
from lightning_stale.method.adaptive import AdaptiveH, AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import Finish
from lightning_stale.replay.real import LogBatchSampler
from lightning_stale.replay.replayer import ReplayServer
from lightning_stale.replay.setup import DIGEST_EVERY, replay_log, use_recorded_threads
from lightning_stale.strategies.base import ServerStrategyMixin
from lightning_stale.strategies.event_log import EventLogMixin
from lightning_stale.strategies.lightning_api import set_global_step, set_root_device, with_sampler
from lightning_stale.strategies.local_updates import LocalUpdatesMixin
from lightning_stale.strategies.namespaces import register_everywhere


class SimulatedStaleStrategy(LocalUpdatesMixin, EventLogMixin, ServerStrategyMixin):
    """Distributed SGD with P simulated learners and a parameter server, in one process.

    A discrete-event clock (`lightning_stale.method.virtual_clock.VirtualCluster`) decides which learner
    finishes its mini-batch next; its gradient is computed on the parameters it last pulled, on
    the batch Lightning hands to this training step, and `ServerRules` decide updates, drops and
    refreshes exactly as in the real parameter-server engine. Updates are applied by the same
    `ServerCore` as there. One Lightning training step is one simulated push; work that the
    real engine would cancel is never computed. Use ``Trainer(strategy=..., devices=1)``.

    Args:
        variant: "sync", "k_sync", "k_batch_sync", "async", "k_async" or "k_batch_async".
        k: K (1 <= K <= P); None picks the variant's default (`variants.default_k`).
        delay: straggler model from `lightning_stale.delays` (seconds per mini-batch); None means
            no delay. A `Trace` (e.g. written by the real engine) replays that run's delays.
            Its streams are reset at the start of every fit; its own seed is kept.
        num_learners: P, the number of simulated learners.
        compute_time: virtual seconds added to every mini-batch on top of ``delay``.
        adaptive_k: AdaSync schedule of K (K-variants only): an `AdaptiveK`, a dict of its
            arguments (``k0`` defaults to ``k``), or a number, the interval T0 in virtual seconds.
        staleness_compensation: None, "inverse", "norm", a dict of `StalenessCompensation`
            arguments, or a `StalenessCompensation`.
        seed: seeds the training sampler, which draws mini-batches uniformly with replacement
            (independent draws for every learner, as the analysis assumes). Model initialisation
            and dropout use torch's global generator: seed it (``seed_everything``) as usual.
        record_trace: write the delays drawn (`Trace` format) at train end: True for
            ``delays.csv`` in the trainer's log dir (first logger, else ``default_root_dir``), a
            ``.csv`` path for that file, any other path for ``delays.csv`` in that folder.
        device: torch device; None picks the accelerator's first device.
        record_events: write the run's event log (docs/replay.md): True for ``events.jsonl``
            beside the delay trace (the first logger's log dir, else ``default_root_dir``), a
            ``.jsonl`` path for that file, any other path for ``events.jsonl`` in that folder;
            False (the default) for none. While recording, torch's generators are seeded before
            each push with a seed derived from ``seed``, the learner and its push index (so that
            its dropout can be drawn again), which replaces the global generator's stream.
        digest_every: with ``record_events``, a digest of the server's parameters and optimizer
            state after every ``digest_every``-th update and at the stop (default 100: about 1%
            of the throughput; 1 checks every update; 0: at the stop only).
        replay: the path of an event log (of this engine, or of `StaleStrategy`: its learners'
            recorded mini-batches are then the training batches) to re-execute instead of the
            virtual clock: variant, K, P, the seed and the arrival order come from the log
            (giving another variant, K or P is an error); the learning rate (the module's), the optimizer and
            ``staleness_compensation`` may differ. Each push is computed at its recorded version
            on its recorded mini-batch with its recorded seed. Run it with the recorded run's
            module, data and Trainer limits; afterwards ``replay_report`` says where the
            replay and the log differ (`lightning_stale.replay.replayer`).
        local_steps: H, local updates (docs/how-to/local-updates.md): each learner takes H steps
            of the module's optimizer (its own state per learner) from the parameters it pulled,
            then pushes the pseudo-gradient, pulled minus current parameters; its virtual time
            is the sum of H draws. 1 (the default): a push per step, the paper's method.
        outer_optimizer: how the server applies an update's averaged pseudo-gradients: None for
            plain averaging (SGD, lr 1, no momentum), or a class path and its arguments,
            ``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentum": 0.9,
            "nesterov": True}}`` (DiLoCo). Given, it makes local updates even with H = 1.
        adaptive_h: AdaComm's schedule of H (Wang and Joshi, SysML 2019; needs local_steps > 1):
            an `AdaptiveH`, a dict of its arguments (``interval_s``, ``window``), or a number,
            the interval T0 in virtual seconds. H shrinks as the loss falls; a learner takes the
            new H at the start of its next round, and ``stats["h_history"]`` holds the (virtual
            seconds, H) changes.

    During fit: ``trainer.global_step`` is the number of server updates (so ``max_steps`` counts
    them, and ``estimated_stepping_batches`` estimates them); a push is one optimizer step
    (``accumulate_grad_batches`` micro-batches, its gradient clipped and, in ``16-mixed``,
    unscaled; an overflowing one is dropped as "overflow"); an epoch's end is a pause, not a
    restart: the virtual clock does not run while Lightning validates, and work in flight goes
    on. Validation, test, predict and checkpoints see the server's parameters and optimizer
    state; checkpoints also hold the simulation under the key ``"stale_server"`` so that a
    resumed fit continues the run (the sampler restarts from ``seed``, so a resumed run is not
    bit-identical to an uninterrupted one). Buffers (e.g. BatchNorm statistics) are server state
    as in the real engine: a simulated learner computes with the buffers of the version it
    pulled, and each update's buffers are the mean of its pushes' buffers.
    After fit: ``stats`` (counters and virtual-time figures), the module holds the final server
    parameters, ``trace_recorder`` holds the recorded delays, ``stats["events_path"]`` names the
    event log (``record_events``) and ``replay_report`` is the replay's report (``replay``).

    With local updates, one Lightning training step is one inner step of a learner, and
    ``trainer.global_step`` is H x the server updates: ``max_steps``, ``estimated_stepping_batches``
    and the step-interval LR schedulers (of the inner optimizer, H steps per update) count inner
    steps, as under DDP with model averaging; gradient clipping applies to each inner step; an
    epoch is one pass worth of inner steps. Event logs and replays are not available with them.

    Not supported (clear errors at setup): manual optimization, more than one optimizer.
    """

    strategy_name = "simulated_stale"
    virtual_clock = True  # UpdateRecord.clock is virtual seconds since the start
    lightning_base = "SingleDeviceStrategy"

    def __init__(self, variant: str | None = None, k: int | None = None,
                 delay: DelayModel | None = None, num_learners: int | None = None,
                 compute_time: float = 0.0,
                 adaptive_k: float | dict | AdaptiveK | None = None,
                 staleness_compensation: str | dict | StalenessCompensation | None = None,
                 seed: int = 0, record_trace: bool | str | os.PathLike | None = None,
                 device: str | torch.device | None = None,
                 record_events: bool | str | os.PathLike = False, digest_every: int = DIGEST_EVERY,
                 replay: str | os.PathLike | None = None, local_steps: int = 1,
                 outer_optimizer: str | dict | None = None,
                 adaptive_h: float | dict | AdaptiveH | None = None, **kwargs: Any) -> None:
        # (the Lightning base is joined at import, `strategies.namespaces`: not visible here)
        super().__init__(device="cpu" if device is None else device, **kwargs)  # type: ignore[call-arg]
        self._device_given = device is not None
        self._replay_log = None
        if replay is not None:
            self._replay_log = replay_log(replay, variant, k, num_learners, adaptive_k, record_events)
            header = self._replay_log.header
            variant, num_learners, seed = header["variant"], header["p"], header["seed"]
            k, compute_time = header["k"] if Variant.k_applies_to(variant) else None, header["compute_time"]
        variant = "k_async" if variant is None else variant
        num_learners = 4 if num_learners is None else num_learners
        self._init_event_log(record_events, digest_every)
        delay = NoDelay() if delay is None else delay
        self._init_server_options(variant, k, delay, adaptive_k, staleness_compensation,
                                  record_trace, seed)
        if isinstance(num_learners, bool) or not isinstance(num_learners, int) or num_learners < 1:
            raise ValueError(f"num_learners must be an integer >= 1, got {num_learners!r}")
        compute_time = float(compute_time)
        if not (compute_time >= 0 and math.isfinite(compute_time)):
            raise ValueError(f"compute_time must be a finite number >= 0, got {compute_time!r}")
        self.num_learners, self.compute_time = num_learners, compute_time
        self.settle_variant(num_learners)  # P is known: every option is checked now
        self._init_local_updates(local_steps, outer_optimizer, bool(record_events) or replay is not None,
                                 adaptive_h)
        self.trace_recorder: TraceRecorder | None = None
        self.server: SimulatedServer | None = None
        self._retry: Finish | None = None  # a learner whose training_step was skipped
        self._finish: Finish | None = None  # the learner computing the push in progress
        self._batch_samples = 0
        self._epoch = 0
        self._loaders_made = 0
        self.minibatch_times: list[float] = []  # each push's virtual X (MiniBatchTimer reads it)

    @property
    @override
    def core(self) -> ServerCore | None:
        return self.server.core if self.server is not None else None

    # ---------------------------------------------------------------- setup and teardown
    @override
    def _configure_launcher(self) -> None:
        self.check_namespace()
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if not self._device_given and self.accelerator is not None:
            accelerator = self.accelerator
            set_root_device(self, accelerator.get_parallel_devices(accelerator.parse_devices(1))[0])
        super().setup_environment()

    @override
    def setup(self, trainer) -> None:
        if not self.fitting():
            super().setup(trainer)
            return
        self._limit_train_batches = None
        if self._replays_engine_log:
            # The log's epochs are the replay's: Lightning must not cut them.
            self._limit_train_batches = trainer.limit_train_batches
            self.patch(trainer, "limit_train_batches", 1.0)
        if self._replay_log is not None:
            use_recorded_threads(self._replay_log.header, self._undo)
        trainer.fit_loop.setup_data()  # before configure_optimizers: estimated_stepping_batches
        pushes = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches / self.local_steps)
        with self.counting_updates(trainer, pushes):
            super().setup(trainer)
        self.check_trainer(trainer, [])
        self._schedulers = self.take_over_schedulers(trainer)
        # (with local updates each learner clips its inner steps' gradients, as a DDP rank does)
        self._clip = None if self.local_updates else self.take_over_clipping(trainer)
        self.validate_on_server_state(trainer)
        self.show_progress(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        # Buffers travel with the parameters, as in the real engine: a simulated learner computes
        # with the buffers of the version it pulled, and the server combines the pushed ones.
        state = ServerState(module, self.optimizers[0], self._schedulers, clip=self._clip,
                            outer=self._outer_factory(), steps_per_update=self.local_steps)
        self._learner_view = ModelVectors.of(module)
        self._final_stats = None
        self._retry = self._finish = self._round = None
        self._epoch = module.trainer.current_epoch
        self.settle_variant(self.num_learners)  # a fresh AdaSync schedule for this fit
        restored, self._resume = self._resume, None
        if self._start_replay(module, state, restored):
            return
        if restored is not None and restored.get("engine") is not None:
            if self.record_events:
                rank_zero_warn("a resumed fit is not recorded: an event log starts with its run")
            self.server = pickle.loads(restored["engine"])
            self.server.attach(state)
            self._adaptive = self.server.core.adaptive
            self._retry = self._restored_round(restored, state)  # a round in progress starts again
            return
        delay = self.delay
        if hasattr(delay, "reset"):
            delay.reset()  # the same seed gives the same delays in every fit
        if self.record_trace:
            self.trace_recorder = TraceRecorder()
            delay = RecordingDelay(delay, self.trace_recorder)
        assert self.variant is not None, "settled for this fit"
        self.server = SimulatedServer(state, self.variant, delay, self.compute_time,
                                      self._adaptive, self.staleness_compensation,
                                      local_steps=self.local_steps,
                                      adaptive_h=self._fresh_adaptive_h())
        self._start_recording(module)
        if restored is not None:
            rank_zero_warn("the checkpoint was saved after its fit had ended, so the simulation "
                           "cannot continue: a new one starts from its parameters")
            self._running.state.schedules.load_states(restored["core"]["schedulers"])

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        if self.server is not None and trainer.current_epoch > self._epoch:
            # A strategy has no epoch-end hook: the epoch that ended is handled here.
            self._end_epoch()
            self._epoch = trainer.current_epoch
        self._resume_round()
        starting = None
        if self.server is not None and self._finish is None:
            # The first micro-batch of a push: the next learner to finish computes it on the
            # parameters it holds (a learner whose step was skipped tries again).
            self._finish = starting = self._retry or self.server.next_finish()
            self._retry = None
            self._learner_view.load_state(self.server.parameters_for(self._finish))
            self._batch_samples = 0
            self._start_round(self._finish, self.server)
        self._note_batch(batch, starting)  # the event log's (its seed set for a new push)
        self._batch_samples += _batch_size(batch)

    def _end_epoch(self) -> None:
        metrics = {k: float(v) for k, v in self.lightning_module.trainer.callback_metrics.items()}
        self._running.end_epoch(metrics)  # (the event log's validation line: from the core)

    @override
    def enter_validation(self) -> None:
        self._pause_round()
        self._load_server_parameters()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.server is None:
            return
        self._load_server_parameters()
        last_batch = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if last_batch and (not isinstance(self.server, ReplayServer)
                           or self.server.core.epoch < self.server.epochs_recorded):
            self._end_epoch()  # the last epoch ended too (in a replay: if the log's did)
        self.server.stop()
        # The learner's optimizer takes the server's state, as the module its parameters: what
        # Lightning saves after fit (its checkpoint slots) is the server's. (With local updates
        # the server's is the outer optimizer, and the inner states stay the learners'.)
        if not self.local_updates:
            self.optimizers[0].load_state_dict(self._running.state.optimizer.state_dict())
        self._final_stats = self.server.stats()
        if self.trace_recorder is not None:
            self.write_trace(self.trace_recorder)
        self._finish_event_log()

    @override
    def teardown(self) -> None:
        self.undo_patches()
        self._resume = None
        if self.server is not None and self._final_stats is None:
            self._final_stats = self.server.stats()  # fit interrupted before on_train_end
        self._close_event_log()
        super().teardown()

    # ---------------------------------------------------------------- one push per step
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: LightningModule | torch.nn.Module | None = None,
                       **kwargs: Any) -> Any:
        """Compute the next finishing learner's gradient at its stale parameters and push it.

        The learner optimizer's ``step`` is never called: the server's optimizer owns the state.
        """
        server = self.server
        assert server is not None and self._finish is not None, "optimizer_step outside fit"
        model = model or self.lightning_module
        if self._round is not None:
            return self._local_step(server, self._round, model, optimizer, closure)
        finish, self._finish = self._finish, None
        loss, overflow = self.compute_gradient(model, optimizer, closure)
        if loss is None:
            # training_step skipped this batch: the learner tries again with the next one.
            self._retry = finish
        else:
            contribution = None if overflow else self._learner_view.split_push(*self._learner_view.push_vector())
            self._record_push()
            server.push(finish, contribution, float(loss), self._batch_samples,
                        unusable="overflow" if overflow else None)
            self.minibatch_times.append(finish.time - finish.started)  # X, for MiniBatchTimer
        set_global_step(self.lightning_module.trainer, server.updates)
        return loss

    # ---------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        dataset = getattr(dataloader, "dataset", None)
        if self._replays_engine_log and isinstance(dataloader, DataLoader):
            assert self._replay_log is not None
            return DataLoader(dataset, batch_sampler=LogBatchSampler(self._replay_log),  # type: ignore[arg-type]
                              num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                              pin_memory=dataloader.pin_memory)
        if not isinstance(dataloader, DataLoader) or isinstance(dataset, IterableDataset):
            rank_zero_warn(f"{type(self).__name__} cannot make this training loader draw with "
                           "replacement (not a DataLoader over a map-style dataset): its batches "
                           "are used in the order it gives them")
            return dataloader
        # Each push gets an independent uniform draw, as docs/method.md's analysis assumes.
        generator = torch.Generator().manual_seed(self.seed + self._loaders_made)
        self._loaders_made += 1
        sized = cast(Sized, dataset)  # a map-style dataset
        sampler = RandomSampler(sized, replacement=True, num_samples=len(sized),
                                generator=generator)
        return with_sampler(dataloader, sampler)

    # ---------------------------------------------------------------- checkpoints
    @override
    def server_state(self) -> Any:
        if self._final_stats is not None:
            return None  # after fit the module already holds the server's parameters
        return super().server_state()

    def _engine_checkpoint(self) -> dict:
        # Plain bytes and dicts: loadable with torch.load(weights_only=True).
        # A stopped simulation (saved after fit) cannot go on: only its results are kept.
        engine = None if self._running.core.stopped else pickle.dumps(self.server)
        return {"core": self._running.core.state_dict(), "engine": engine, "stats": self.stats,
                **self._local_checkpoint()}

    # ---------------------------------------------------------------- internals
    @property
    def _running(self) -> SimulatedServer:
        assert self.server is not None, "the simulation runs from the start of training"
        return self.server

    def _load_server_parameters(self) -> None:
        if self.server is not None and self.server.state is not None:
            self.server.state.load_into(self.lightning_module)


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # no tensor in the batch: samples are not counted
        return 0


register_everywhere(SimulatedStaleStrategy)
