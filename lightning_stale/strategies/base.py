"""What both strategies share: options, the variant settled once per fit, the trainer checks, the
takeover of Lightning's step counting and schedulers (undone in ``teardown``), checkpoints, and
the contract the callbacks read.

A strategy of this package replaces Lightning's optimizer step by a parameter server
(`lightning_stale.engine.core.ServerCore`). It is written once, with no Lightning base class, and
names the Lightning strategy it extends; `strategies.namespaces` builds it on that class of
``pytorch_lightning`` or ``lightning.pytorch``, whichever Trainer it meets:

    class StaleStrategy(ServerStrategyMixin):
        lightning_base = "DDPStrategy"

The contract for callbacks (`WallClockLogger`): ``pop_update_records()`` returns the server's
`UpdateRecord`s since the last call (on global rank 0), their ``clock`` is training seconds
(virtual with ``virtual_clock``), and ``stats`` holds the server's counters.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable
from typing import Any

from pytorch_lightning import Callback
from pytorch_lightning.trainer.states import TrainerFn

from lightning_stale.delays.traces import TraceRecorder
from lightning_stale.engine.core import ServerCore
from lightning_stale.engine.records import UpdateRecord
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import VARIANT_NAMES, Variant, check_k
from lightning_stale.strategies.lightning_api import run_closure, switch_off_scheduler_stepping, trace_path
from lightning_stale.strategies.namespaces import namespace_of, new_instance
from lightning_stale.strategies.progress import show_server_progress

CHECKPOINT_KEY = "stale_server"  # the server's books in a Lightning checkpoint


class _ServerStateForValidation(Callback):
    """See `ServerStrategyMixin.validate_on_server_state`."""

    def __init__(self, strategy: ServerStrategyMixin) -> None:
        self.strategy = strategy

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.enter_validation()


class ServerStrategyMixin:
    """Options and Lightning plumbing common to the strategies (see the module docstring).

    Subclasses set ``strategy_name``, ``virtual_clock`` and ``lightning_base`` (the name of the
    Lightning strategy class they extend), call `_init_server_options` from their constructor and
    `settle_variant` once P is known, and provide ``core`` (the `ServerCore` on this rank, or
    None) and `_engine_checkpoint`.
    """

    strategy_name = "stale"
    virtual_clock = False
    local_steps = 1  # H: inner steps per push (docs/how-to/local-updates.md)
    lightning_namespace: str | None = None  # set on the concrete classes

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if "lightning_base" in cls.__dict__:  # the public class: a concrete or pending instance
            return new_instance(cls)
        return super().__new__(cls)

    def _init_server_options(self, variant: str, k: int | None, delay: Any, adaptive_k: Any,
                             staleness_compensation: Any, record_trace: Any, seed: int) -> None:
        check_k(variant, k)
        if delay is not None and not callable(getattr(delay, "sample", None)):
            raise ValueError(f"delay must be a straggler model with sample(learner), e.g. from "
                             f"lightning_stale.delays, or None; got {delay!r}")
        if adaptive_k is not None:
            if not Variant.k_applies_to(variant):
                raise ValueError(f"adaptive_k changes K, so it needs a K-variant "
                                 f"({', '.join(n for n in VARIANT_NAMES if Variant.k_applies_to(n))}), "
                                 f"got variant {variant!r}")
            AdaptiveK.create(adaptive_k, k0=k or 1)  # checks the spec now; K_0 is settled with P
        if record_trace is not None and not isinstance(record_trace, (bool, str, os.PathLike)):
            raise ValueError(f"record_trace must be a bool or a path, got {record_trace!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.variant_name, self.k, self.delay = variant, k, delay
        self.adaptive_k = adaptive_k
        self.staleness_compensation = StalenessCompensation.create(staleness_compensation)
        self.record_trace, self.seed = record_trace, seed
        self.variant: Variant | None = None
        self._adaptive: AdaptiveK | None = None
        self._final_stats: dict | None = None
        self._undo: list[Callable[[], None]] = []
        self._resume: dict | None = None  # CHECKPOINT_KEY of a checkpoint being resumed
        self.updates_per_epoch = 0  # server updates an epoch makes (an upper bound), set in setup

    # ------------------------------------------------------------------ the variant
    def settle_variant(self, p: int) -> Variant:
        """Validate the variant, K, the delay and AdaSync against P learners; done once per fit.
        AdaSync gets its own copy of the schedule, so the caller's object stays as it is."""
        self.variant = Variant.create(self.variant_name, p, self.k)
        check_learners = getattr(self.delay, "check_learners", None)
        if check_learners is not None:
            check_learners(p)
        self._adaptive = None
        if self.adaptive_k is not None:
            adaptive = copy.deepcopy(AdaptiveK.create(self.adaptive_k, k0=self.variant.k))
            assert adaptive is not None, "adaptive_k was given"
            if self.k is not None and self.k != adaptive.k0:
                raise ValueError(f"k={self.k} disagrees with adaptive_k's k0={adaptive.k0}; give one")
            adaptive.limit(p)
            adaptive.reset()
            self._adaptive = adaptive
            self.variant = Variant.create(self.variant_name, p, adaptive.k0)
        return self.variant

    @property
    def core(self) -> ServerCore | None:
        raise NotImplementedError

    def check_namespace(self) -> None:
        """A concrete instance serves the Trainer of its own namespace only."""
        found = namespace_of(self.accelerator)
        if found is not None and found != self.lightning_namespace:
            raise TypeError(f"this {type(self).__name__} was built for {self.lightning_namespace}, but "
                            f"the Trainer is {found}'s: create a new strategy object for this Trainer")

    # ------------------------------------------------------------------ trainer checks
    def check_trainer(self, trainer: Any, problems: list[str]) -> None:
        """Refuse, before training, what the server cannot run; ``problems`` holds the
        subclass's own findings. One error lists them all."""
        module = self.lightning_module
        if not module.automatic_optimization:
            problems.append("manual optimization is not supported: training_step would step the "
                            "optimizer itself, while here each optimizer step is a gradient push "
                            "that the server applies; use automatic optimization")
        if len(self.optimizers) != 1:
            problems.append(f"exactly one optimizer is supported, got {len(self.optimizers)}: the "
                            "server applies one optimizer's step per update; use one optimizer "
                            "with a parameter group per part of the model")
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run this Trainer: " + "; ".join(problems))

    # ------------------------------------------------------------------ takeover, undone in teardown
    def patch(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` until teardown."""
        saved = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, saved))

    def take_over_schedulers(self, trainer: Any) -> list:
        """The server steps the LR schedulers (per update or per epoch): Lightning's stepping is
        switched off until teardown, while its configs stay where Lightning, callbacks (e.g.
        ``LearningRateMonitor``) and checkpoints read them. Returns the scheduler configs."""
        self._undo.append(switch_off_scheduler_stepping(trainer.fit_loop.epoch_loop))
        return list(self.lr_scheduler_configs)

    @contextlib.contextmanager
    def counting_updates(self, trainer: Any, pushes_per_epoch: int):
        """Within this block (Lightning's ``configure_optimizers``), ``estimated_stepping_batches``
        is the number of server updates the fit will make, as it is the number of optimizer
        steps under DDP: ``max_epochs`` x the updates an epoch of ``pushes_per_epoch`` pushes
        makes, pushes / K, or ``max_steps`` if that comes first (the updates per epoch are
        exact where every push is applied; an upper bound for the sync family, which drops a
        few stale pushes, and for AdaSync). With no ``max_epochs`` it is ``max_steps``. With
        local updates an update counts as ``local_steps`` steps, as ``global_step`` does."""
        epoch_loop = trainer.fit_loop.epoch_loop
        max_steps = epoch_loop.max_steps
        assert self.variant is not None, "settled for this fit"
        self.updates_per_epoch = max(1, math.ceil(pushes_per_epoch / self.variant.k))
        if trainer.max_epochs in (None, -1):
            yield
            return
        updates = self.updates_per_epoch * self.local_steps * max(1, trainer.max_epochs)
        if max_steps != -1:
            updates = min(updates, max_steps)
        epoch_loop.max_steps = updates  # what Lightning's estimate returns for an endless loader
        try:
            yield
        finally:
            epoch_loop.max_steps = max_steps

    # ------------------------------------------------------------------ validation
    def validate_on_server_state(self, trainer: Any) -> None:
        """Until teardown, the first of the Trainer's callbacks puts the server's parameters and
        buffers into the module when validation starts, so that every validation hook (the
        callbacks' and the module's ``on_validation_start`` included) sees them, as every DDP
        rank's hooks see the same model."""
        callback = _ServerStateForValidation(self)
        trainer.callbacks.insert(0, callback)
        self._undo.append(lambda: trainer.callbacks.remove(callback))

    def enter_validation(self) -> None:
        """Put the server's parameters and buffers into the module for validation."""
        raise NotImplementedError

    # ------------------------------------------------------------------ progress bar
    def show_progress(self, trainer: Any) -> None:
        """The progress bar shows server updates, K and mean staleness until teardown (see
        `strategies.progress`)."""
        show_server_progress(self, trainer, self._undo)

    def progress(self) -> dict[str, float] | None:
        """Server updates so far, the K in force and the mean staleness of the gradients applied
        so far, on the rank that hosts the server (None elsewhere)."""
        core = self.core
        if core is None:
            return None
        with self.books_lock():
            histogram = core.rules.counts.staleness
            applied = sum(histogram.values())
            staleness = sum(s * n for s, n in histogram.items()) / applied if applied else 0.0
            return {"updates": core.updates, "K": core.rules.k, "staleness": round(staleness, 3)}

    def books_lock(self) -> Any:
        """Held while reading the server's books from another thread than the server's."""
        return contextlib.nullcontext()

    def compute_gradient(self, model: Any, optimizer: Any, closure: Any) -> tuple[Any, bool]:
        """Run Lightning's closure (forward, backward, ``on_before_optimizer_step``, clipping)
        exactly once, as the precision plugin's ``optimizer_step`` would without stepping; in
        ``16-mixed`` the gradients are unscaled before the hook and clipping, and the scaler is
        updated. Returns the loss (None: the step was skipped) and whether the unscaled gradient
        overflowed (it must not be applied)."""
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is None:
            return run_closure(plugin, model, optimizer, closure), False
        loss = closure()
        if loss is None:
            plugin._after_closure(model, optimizer)
            return None, False
        scaler.unscale_(optimizer)
        plugin._after_closure(model, optimizer)
        overflow = any(v.item() for v in scaler._found_inf_per_device(optimizer).values())
        scaler.update()
        return loss, overflow

    def take_over_clipping(self, trainer: Any) -> Callable[[Any], None] | None:
        """Gradient clipping applies to the averaged gradient of an update, as DDP clips its
        all-reduced gradient: learners stop clipping their own (until teardown), and the
        returned function clips through the module's ``configure_gradient_clipping`` hook,
        for whoever applies the update. None when the Trainer does not clip."""
        value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if value is None:
            return None
        self.patch(trainer, "gradient_clip_val", None)
        self.patch(trainer, "gradient_clip_algorithm", None)
        module = self.lightning_module
        return lambda optimizer: module.configure_gradient_clipping(
            optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm)

    def undo_patches(self) -> None:
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------------ results
    @property
    def stats(self) -> dict:
        """The server's counters (`ServerCore.stats`) on the rank that hosts it; after fit, those
        of the fit's end."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        return self.core.stats() if self.core is not None else {}

    def pop_update_records(self) -> list[UpdateRecord]:
        """Server updates since the last call; ``clock`` is training seconds."""
        return self.core.pop_records() if self.core is not None else []

    def write_trace(self, recorder: TraceRecorder) -> str | None:
        """Write the delays drawn where ``record_trace`` says; returns the path."""
        if not self.record_trace:
            return None
        return str(recorder.write(trace_path(self.record_trace, self.lightning_module.trainer)))

    # ------------------------------------------------------------------ checkpoints
    def server_state(self) -> Any:
        """The `ServerState` whose parameters and buffers are the model's, or None where this
        rank holds none (or the module already holds them)."""
        core = self.core
        return core.state if core is not None else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with the server's parameters and buffers in place of this
        learner's."""
        state_dict = super().lightning_module_state_dict()
        state = self.server_state()
        if state is not None:
            state_dict.update(state.named_state(self.lightning_module))
        return state_dict

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = self.server_state()
        if state is not None:
            return state.optimizer.state_dict()
        return super().optimizer_state(optimizer)

    def _engine_checkpoint(self) -> dict:
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        if self.core is not None:
            checkpoint[CHECKPOINT_KEY] = self._engine_checkpoint()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # (Lightning's own takes ``weights_only`` from 2.6 on: passed only where it was given)
        extra = () if weights_only is None else (weights_only,)
        checkpoint = super().load_checkpoint(checkpoint_path, *extra)
        self._resume = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    def fitting(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's registration hook: ``Trainer(strategy=cls.strategy_name)``."""
        if cls.strategy_name not in strategy_registry:
            summary = (cls.__doc__ or cls.__name__).splitlines()[0]
            strategy_registry.register(cls.strategy_name, cls, description=summary)
