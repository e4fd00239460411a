"""Learners at their own pace, and Lightning's collectives.

Inside training batches every learner runs at its own pace: a collective issued there, e.g.
``self.log(..., sync_dist=True)`` in ``training_step`` or a callback's barrier, would pair up calls
from different steps and deadlock. The strategy answers those locally; at epoch ends and in
validation every learner is in step again and collectives are real, unless a learner has died
(``on_learner_failure="continue"``): the default process group then lacks a member for the rest
of the fit, so collectives stay local and validation is skipped.

For the same reason a learner must not stop on its own inside an epoch. Lightning validates when
``trainer.should_stop`` is set mid-epoch (for early stopping), and under DDP every rank stops
at the same batch because callbacks broadcast their decision (``Timer`` for ``max_time``); here
that broadcast is local, so a learner that stopped alone would validate alone, or at a different
point than the others, and their collectives would pair up wrongly. So a stop wanted inside a
training batch (set by a callback or by the module's own hooks) is handed to the strategy
(`ask_to_stop`) before Lightning acts on it, which has the server stop everyone, and each learner
stops at its own next batch on the server's STOP, validating exactly once. A STOP that comes
while an epoch ends reaches some learners before their end of the epoch and others after it;
the learners agree on it at the epoch's end (`agree_on_stop`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytorch_lightning import Callback

from lightning_stale.strategies.lightning_api import hand_over_stops_inside_batches


class _Pace(Callback):
    """Marks when learners run at their own pace (inside training batches)."""

    def __init__(self, strategy: OwnPaceCollectives) -> None:
        self.strategy = strategy

    def on_train_batch_start(self, *args: Any) -> None:
        self.strategy.local_collectives = True

    def on_validation_start(self, *args: Any) -> None:
        self.strategy.local_collectives = self.strategy.lost_learner

    def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
        self.strategy.local_collectives = self.strategy.lost_learner
        self.strategy.agree_on_stop(trainer)

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        # First among the callbacks: the strategy stops its server before the others' hooks read
        # its state (OnExceptionCheckpoint), and no peer can be counted on to join a collective.
        self.strategy.local_collectives = True
        self.strategy.fit_failed(exception)


class OwnPaceCollectives:
    """Mixin for a DDP-style strategy: collectives are local while learners are out of step."""

    local_collectives = False
    lost_learner = False  # a learner died: no collective can complete any more

    def track_pace(self, trainer: Any) -> Callable[[], None]:
        """Start tracking the phases of ``trainer``'s fit; returns the undo."""
        pace = _Pace(self)
        trainer.callbacks.insert(0, pace)
        undo_stops = hand_over_stops_inside_batches(trainer.fit_loop.epoch_loop, self.ask_to_stop)
        self.lost_learner = False

        def undo() -> None:
            trainer.callbacks.remove(pace)
            undo_stops()
        return undo

    def ask_to_stop(self) -> bool:
        """This learner's Trainer wants to stop inside an epoch (``trainer.should_stop`` set
        during a training batch): True when the stop is left to the server (the flag is cleared
        and training goes on until the server stops every learner), False to stop here."""
        return False

    def stop_heard(self) -> bool:
        """Whether the server's stop has reached this learner."""
        return False

    def agree_on_stop(self, trainer: Any) -> None:
        """At an epoch's end, where every learner is in step, the learners agree whether training
        is over. A stop decided while the epoch ends (a learner asked for it at its last batch)
        reaches some learners before their end of the epoch and others after it: these would
        start another epoch and validate alone at its first batch. So any learner that has
        heard the stop stops them all here (one all-reduce per epoch)."""
        if not self.local_collectives and self.reduce_boolean_decision(self.stop_heard(), all=False):
            trainer.should_stop = True

    def fit_failed(self, exception: BaseException) -> None:
        """The fit raised ``exception`` on this process (before the other callbacks hear it)."""

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor if self.local_collectives else super().reduce(tensor, group, reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.local_collectives:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj, src: int = 0):
        return obj if self.local_collectives else super().broadcast(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision if self.local_collectives else super().reduce_boolean_decision(decision, all)
