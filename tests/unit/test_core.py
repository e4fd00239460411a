"""ServerCore: the decisions, the update arithmetic and the books that every engine shares."""

import math

import pytest
import torch
from torch import nn

from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.state import Contribution, ServerState
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant


def make_state(lr=1.0):
    module = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(module.weight)
    return ServerState(module, torch.optim.SGD(module.parameters(), lr=lr))


def g(*values, present=None):
    """A pushed gradient as the server keeps it."""
    return Contribution(torch.tensor(values), present=present)


def balanced(stats):
    return stats["gradients_received"] == (stats["gradients_applied"] + stats["gradients_dropped"]
                                           + stats["gradients_pending"] + stats["gradients_in_flight_at_stop"])


def test_an_update_averages_the_k_gradients_and_writes_its_record():
    core = ServerCore(Variant.create("k_async", 4, 2), make_state())
    assert core.push(0, 0, 1.0, contribution=g(1.0, 1.0), loss=3.0, samples=8).update is None
    outcome = core.push(2, 0, 3.0, contribution=g(3.0, 5.0), loss=1.0, samples=8)
    assert outcome.update.index == 1 and outcome.decision.refresh == (0, 2)
    assert core.state.params[0].tolist() == [[-2.0, -3.0]]  # w_0 - lr * mean
    (record,) = core.pop_records()
    assert (record.update, record.clock, record.samples, record.loss, record.learners) == (1, 3.0, 16, 2.0, (0, 2))
    assert core.stats()["mean_update_interval_s"] == 3.0 and balanced(core.stats())


def test_an_update_sums_in_the_learners_order_whatever_order_they_arrived_in():
    """A float sum depends on its order: summed as the pushes arrived, two runs of the same
    Fully sync fit would differ in the last bits and drift apart."""
    values = {0: (1e8, 1.0), 1: (1.0, 1e8), 2: (-1e8, -1e8)}
    results, contributions = [], []
    for arrivals in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        core = ServerCore(Variant.create("sync", 3), make_state())
        for time, learner in enumerate(arrivals):
            outcome = core.push(learner, 0, float(time), contribution=g(*values[learner]))
        results.append(core.state.params[0].clone())
        contributions.append([c.gradient.tolist() for c in outcome.contributions])
    in_float32 = [float(sum(torch.tensor(values[i][0]) for i in order)) for order in ([0, 1, 2], [2, 0, 1])]
    assert in_float32[0] != in_float32[1]  # (these values' sum depends on its order)
    assert all(torch.equal(r, results[0]) for r in results)
    assert all(c == contributions[0] for c in contributions)  # what the other paths hear too


def test_pauses_are_not_training_time():
    core = ServerCore(Variant.create("async", 2), make_state(), clock=10.0)
    core.push(0, 0, 12.0, contribution=g(1.0, 1.0))
    core.pause(13.0)
    assert core.running_time(20.0) == 3.0  # frozen while paused
    core.resume(20.0)
    core.push(1, 0, 21.0, contribution=g(1.0, 1.0))
    assert [r.clock for r in core.pop_records()] == [2.0, 4.0]  # 21 - 10 - 7 s of pause
    assert core.stats()["mean_update_interval_s"] == 2.0


def test_without_state_the_core_decides_and_keeps_the_books():
    """An engine whose learners apply updates themselves (e.g. an all-reduce) passes no state."""
    core = ServerCore(Variant.create("k_sync", 3, 2))
    core.push(1, 0, 1.0, loss=2.0, samples=4)
    outcome = core.push(0, 0, 2.0, loss=4.0, samples=4)
    assert [g.learner for g in outcome.update.gradients] == [1, 0]
    assert outcome.decision.cancel == (2,)  # the third learner's work is cancelled
    assert core.pop_records()[0].loss == 3.0 and core.stats()["samples"] == 8
    with pytest.raises(ValueError, match="needs the server's parameters"):
        ServerCore(Variant.create("k_async", 3, 2), compensation=StalenessCompensation("norm", c=1.0))


def test_epochs_end_after_their_pushes_and_the_limits_stop_training():
    core = ServerCore(Variant.create("async", 2), make_state(),
                      ServerLimits(max_epochs=2, pushes_per_epoch=3))
    outcomes = [core.push(i % 2, core.rules.learner_version(i % 2), float(i), contribution=g(1.0, 1.0))
                for i in range(6)]
    assert [o.epoch_ended for o in outcomes] == [False, False, True, False, False, True]
    # an epoch's end is a pause, not a restart: nobody is refreshed or cancelled by it
    assert outcomes[2].decision.refresh == (0,) and outcomes[2].decision.cancel == ()
    assert outcomes[-1].stopped and core.stopped and core.epoch == 2
    late = core.push(0, core.version, 7.0, contribution=g(1.0, 1.0))
    assert not late.stopped and late.decision.dropped == "in_flight_at_stop"
    assert balanced(core.stats())


def test_max_updates_stops_training():
    core = ServerCore(Variant.create("async", 2), make_state(), ServerLimits(max_updates=2))
    assert not core.push(0, 0, 1.0, contribution=g(1.0, 1.0)).stopped
    assert core.push(1, 0, 2.0, contribution=g(1.0, 1.0)).stopped and core.updates == 2


def test_adaptive_k_grows_between_updates():
    schedule = AdaptiveK(k0=1, interval_s=1.0, window=1)
    schedule.limit(3)
    core = ServerCore(Variant.create("k_batch_async", 3, 1), make_state(lr=0.0), adaptive=schedule)
    core.push(0, 0, 0.5, contribution=g(1.0, 1.0), loss=4.0)  # F(w_0) = 4
    core.push(0, 1, 1.5, contribution=g(1.0, 1.0), loss=1.0)  # boundary: K = ceil(sqrt(4 / 1)) = 2
    assert core.rules.k == 2 and core.stats()["k_history"] == [(0.0, 1), (1.5, 2)]


def test_norm_compensation_reads_the_parameters_each_gradient_was_computed_at():
    compensation = StalenessCompensation("norm", c=0.5)
    core = ServerCore(Variant.create("async", 2), make_state(), compensation=compensation)
    core.push(0, 0, 1.0, contribution=g(1.0, 0.0))  # w_1 = (-1, 0), staleness 0
    core.push(1, 0, 2.0, contribution=g(0.0, 2.0))  # computed at w_0: ||w_1 - w_0||^2 = 1
    # weight min(C / 1, eta_max = lr) / lr = 0.5: the stale step is halved
    assert core.state.params[0].tolist() == [[-1.0, -1.0]]


def test_a_checkpointed_core_resumes_version_updates_and_epoch():
    core = ServerCore(Variant.create("async", 2), make_state(), ServerLimits(pushes_per_epoch=2))
    for i in range(3):
        core.push(i % 2, core.rules.learner_version(i % 2), float(i), contribution=g(1.0, 1.0), samples=5)
    saved = core.state_dict()
    resumed = ServerCore(Variant.create("async", 2), make_state())
    resumed.load_state_dict(saved)
    assert (resumed.version, resumed.updates, resumed.epoch, resumed.samples) == (core.version, 3, 1, 15)
    assert resumed.push(0, resumed.version, 0.0, contribution=g(1.0, 1.0)).update.index == 4
    assert math.isnan(ServerCore(Variant.create("async", 2)).stats()["mean_update_interval_s"])


def test_staleness_weights_go_with_their_own_gradients_when_summed_in_learner_order():
    """Update 3 of K-async (P=3, K=2) gets learner 2's gradient of staleness 2 (weight 1/2) first,
    then learner 0's fresh one (weight 1): summed in learner order, each keeps its own weight."""
    core = ServerCore(Variant.create("k_async", 3, 2), make_state(lr=1.0),
                      compensation=StalenessCompensation("inverse"))
    for version in (0, 1):  # learners 0 and 1 make updates 1 and 2; learner 2 is slow
        core.push(0, version, 0.0, contribution=g(0.0, 0.0))
        core.push(1, version, 0.0, contribution=g(0.0, 0.0))
    core.push(2, 0, 1.0, contribution=g(0.0, 4.0))  # arrives first, staleness 2
    outcome = core.push(0, 2, 2.0, contribution=g(2.0, 0.0))  # arrives second, fresh
    assert [p.learner for p in outcome.update.gradients] == [2, 0] and outcome.update.staleness == (2, 0)
    assert outcome.weights == (1.0, 0.5)  # in learner order, as the contributions
    assert [c.gradient.tolist() for c in outcome.contributions] == [[2.0, 0.0], [0.0, 4.0]]
    # w_3 = w_2 - (lr / K) (1 * g_0 + 1/2 * g_2) = -(1/2) (2, 2)
    assert core.state.params[0].tolist() == [[-1.0, -1.0]]
    record = core.pop_records()[-1]
    assert (record.staleness_mean, record.staleness_max, record.num_gradients, record.k, record.learners) == \
        (1.0, 2, 2, 2, (2, 0))


def test_the_core_holds_accepted_gradients_until_their_update():
    core = ServerCore(Variant.create("k_async", 3, 2), make_state())
    first, second = g(1.0, 0.0), g(0.0, 1.0)
    core.push(0, 0, 0.0, contribution=first)
    assert core.holds(first) and not core.holds(second)
    core.push(1, 0, 0.0, contribution=second)
    assert not core.holds(first) and not core.holds(second)


def test_which_pushes_fit_in_the_epoch():
    core = ServerCore(Variant.create("async", 2), make_state(), ServerLimits(pushes_per_epoch=4))
    assert not core.pushes_fit_in_epoch(1)  # nothing pushed in this epoch yet: not known
    core.push(0, 0, 0.0, contribution=g(0.0, 0.0))
    assert core.pushes_fit_in_epoch(3) and not core.pushes_fit_in_epoch(4)
    core.stop()
    assert not core.pushes_fit_in_epoch(1)
    unbounded = ServerCore(Variant.create("async", 2), make_state())  # the engine ends epochs
    unbounded.push(0, 0, 0.0, contribution=g(0.0, 0.0))
    assert not unbounded.pushes_fit_in_epoch(1)


def test_a_death_that_lowers_k_to_the_pending_gradients_applies_them_now():
    core = ServerCore(Variant.create("k_async", 3, 3), make_state(lr=1.0), ServerLimits(max_updates=1))
    core.push(0, 0, 1.0, contribution=g(2.0, 0.0), loss=1.0, samples=4)
    core.push(1, 0, 2.0, contribution=g(0.0, 4.0), loss=3.0, samples=4)
    quiet = core.remove_learner(2, 3.0)
    assert quiet.update is not None and quiet.decision.refresh == (0, 1)
    assert [c.gradient.tolist() for c in quiet.contributions] == [[2.0, 0.0], [0.0, 4.0]]
    assert core.state.params[0].tolist() == [[-1.0, -2.0]]  # the mean of the two
    (record,) = core.pop_records()
    assert (record.update, record.clock, record.loss, record.k, record.learners) == (1, 3.0, 2.0, 2, (0, 1))
    assert quiet.stopped and core.stopped  # max_updates reached by the death's update
    nothing = ServerCore(Variant.create("k_async", 3, 2), make_state()).remove_learner(1, 0.0)
    assert nothing.update is None and not nothing.stopped and nothing.record is None



def test_a_death_is_not_one_of_the_epochs_pushes():
    """An epoch ends after its pushes only: a learner removed in it neither counts as one nor
    ends the epoch, even where its removal completes an update."""
    core = ServerCore(Variant.create("k_async", 3, 3), make_state(), ServerLimits(pushes_per_epoch=3))
    core.push(0, 0, 1.0, contribution=g(2.0, 0.0))
    core.push(1, 0, 2.0, contribution=g(0.0, 4.0))
    outcome = core.remove_learner(2, 3.0)
    assert outcome.update is not None and not outcome.epoch_ended and core.epoch == 0
    assert core.pushes_fit_in_epoch(1) and not core.pushes_fit_in_epoch(2)  # two of three pushed
    assert core.push(0, 1, 4.0, contribution=g(1.0, 1.0)).epoch_ended and core.epoch == 1


def test_a_dropped_push_is_not_held_and_only_a_keeping_core_keeps_old_parameters():
    core = ServerCore(Variant.create("k_sync", 2, 2), make_state())
    with pytest.raises(KeyError):  # not even the starting parameters
        core.parameters_at(0)
    core.push(0, 0, 1.0, contribution=g(1.0, 1.0))
    core.push(1, 0, 2.0, contribution=g(1.0, 1.0))  # update 1: both learners refreshed to w_1
    late = g(5.0, 5.0)
    outcome = core.push(0, 0, 3.0, contribution=late)  # computed at w_0 before the refresh: stale
    assert outcome.decision.dropped == "stale" and not core.holds(late)
    with pytest.raises(KeyError):  # the real server keeps no snapshots: it never computes
        core.parameters_at(1)
    keeping = ServerCore(Variant.create("k_sync", 2, 2), make_state(), keep_snapshots=True)
    keeping.push(0, 0, 1.0, contribution=g(1.0, 1.0))
    keeping.push(1, 0, 2.0, contribution=g(1.0, 1.0))
    assert keeping.parameters_at(1).tolist() == [-1.0, -1.0]


class Heard:
    """A `CoreObserver` that writes down what it is told, with the core it was told by."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda core, *args: self.calls.append((name, core, *args))


@pytest.mark.parametrize("stateful", [False, True])
def test_the_observer_hears_every_event_with_its_arguments(stateful):
    heard = Heard()
    core = ServerCore(Variant.create("k_async", 3, 2), make_state(lr=0.5) if stateful else None,
                      ServerLimits(pushes_per_epoch=3), observer=heard)
    first = core.push(1, 0, 1.0, contribution=g(2.0, 0.0), loss=3.0, samples=4)
    second = core.push(0, 0, 2.0, contribution=g(0.0, 2.0), loss=1.0, samples=4)
    core.remove_learner(2, 2.5)
    held = g(1.0, 1.0)
    core.push(0, 1, 3.0, contribution=held, loss=0.5, samples=4)  # the epoch's third push
    core.begin_epoch(4.0, {"val/loss": 0.25})
    core.stop()
    assert [c[0] for c in heard.calls] == ["on_push", "on_push", "on_update", "on_remove_learner", "on_push",
                                           "on_epoch_end", "on_validation", "on_stop"]
    assert all(c[1] is core for c in heard.calls)
    assert heard.calls[0][2:] == (first.decision, 1.0, 3.0) and heard.calls[1][2:] == (second.decision, 2.0, 1.0)
    update, order, weights, lrs = heard.calls[2][2:]
    assert update is second.update and order == (1, 0) and weights is None  # summed in learner order
    assert lrs == ((0.5,) if stateful else None)  # read where the core steps the optimizer
    assert heard.calls[3][2:] == (2, 2.5) and heard.calls[4][3:] == (3.0, 0.5)
    assert heard.calls[6][2:] == ({"val/loss": 0.25},)
    assert heard.calls[7][2:] == ((2,),)  # the held push, in flight at the stop
    core.stop()
    assert len(heard.calls) == 8  # a second stop is not heard

def scheduled_state():
    """SGD at lr 1 halved after every update (a per-step StepLR, as Lightning configures it)."""
    from pytorch_lightning.utilities.types import LRSchedulerConfig

    module = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(module.weight)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return ServerState(module, optimizer, [LRSchedulerConfig(scheduler, interval="step")]), scheduler


def test_a_checkpoint_carries_the_schedulers_and_a_stateless_core_has_none():
    state, scheduler = scheduled_state()
    core = ServerCore(Variant.create("async", 2), state)
    core.push(0, 0, 0.0, contribution=g(1.0, 1.0))
    core.push(1, 0, 1.0, contribution=g(1.0, 1.0))
    saved = core.state_dict()
    assert saved["schedulers"] == [scheduler.state_dict()] and saved["schedulers"][0]["last_epoch"] == 2
    fresh, fresh_scheduler = scheduled_state()
    resumed = ServerCore(Variant.create("async", 2), fresh)
    resumed.load_state_dict(saved)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()  # (the lr is the optimizer state's)
    assert ServerCore(Variant.create("async", 2)).state_dict()["schedulers"] == []


def test_a_short_pause_is_taken_off_whole():
    core = ServerCore(Variant.create("async", 2), make_state(), clock=0.0)
    core.pause(2.0)
    core.resume(2.25)
    assert core.running_time(3.0) == pytest.approx(2.75)


@pytest.mark.parametrize("limits", [ServerLimits(max_epochs=0, pushes_per_epoch=1),
                                    ServerLimits(max_updates=0, pushes_per_epoch=1),
                                    ServerLimits(max_updates=1, pushes_per_epoch=1)])
def test_an_epochs_end_stops_training_at_the_limits_including_zero(limits):
    core = ServerCore(Variant.create("async", 2), make_state(), limits)
    outcome = core.push(0, 0, 0.0, contribution=g(1.0, 1.0))
    assert outcome.epoch_ended and outcome.stopped and core.stats()["epochs"] == 1


def test_an_epochs_end_below_the_limits_goes_on_and_counts_the_epoch():
    core = ServerCore(Variant.create("async", 2), make_state(),
                      ServerLimits(max_epochs=3, max_updates=5, pushes_per_epoch=2))
    core.push(0, 0, 0.0, contribution=g(1.0, 1.0))
    outcome = core.push(1, 0, 1.0, contribution=g(1.0, 1.0))
    assert outcome.epoch_ended and not outcome.stopped and core.stats()["epochs"] == 1


def test_the_snapshots_kept_are_the_parameters_of_their_versions():
    core = ServerCore(Variant.create("async", 2), make_state(lr=1.0), keep_snapshots=True)
    core.push(0, 0, 0.0, contribution=g(1.0, 2.0))  # learner 0 now holds version 1
    assert core.parameters_at(1).tolist() == [-1.0, -2.0] and core.parameters_at(0).tolist() == [0.0, 0.0]
    core.push(0, 1, 1.0, contribution=g(1.0, 0.0))  # version 2; learner 1 still holds version 0
    assert core.parameters_at(2).tolist() == [-2.0, -2.0] and core.parameters_at(0).tolist() == [0.0, 0.0]
    with pytest.raises(KeyError):
        core.parameters_at(1)  # no learner holds it and no gradient was computed at it


def test_an_unusable_push_is_dropped_and_a_late_one_keeps_its_version():
    core = ServerCore(Variant.create("k_async", 2, 2), make_state(), ServerLimits(max_updates=1))
    dropped = core.push(0, 0, 0.0, unusable="overflow")
    assert dropped.decision.dropped == "overflow" and dropped.decision.resume == (0,) and dropped.update is None
    core.push(0, 0, 1.0, contribution=g(1.0, 1.0))  # (no samples given: none counted)
    assert core.push(1, 0, 2.0, contribution=g(1.0, 1.0)).stopped and core.samples == 0
    late = core.push(0, 1, 3.0, contribution=g(1.0, 1.0))
    assert late.decision.dropped == "in_flight_at_stop" and late.decision.push.version == 1
    assert core.stats()["gradients_dropped_by_reason"] == {"overflow": 1} and core.stats()["samples"] == 0


def test_without_epochs_the_core_ends_none_and_max_updates_zero_stops_at_once():
    core = ServerCore(Variant.create("async", 2), make_state())
    assert not any(core.push(i % 2, core.rules.learner_version(i % 2), float(i), contribution=g(1.0, 1.0)).epoch_ended
                   for i in range(3))
    assert core.stats()["epochs"] == 0 and not core.stopped
    at_once = ServerCore(Variant.create("async", 2), make_state(), ServerLimits(max_updates=0))
    assert at_once.push(0, 0, 0.0, contribution=g(1.0, 1.0)).stopped


def test_without_state_the_weights_come_from_staleness_alone():
    core = ServerCore(Variant.create("async", 2), compensation=StalenessCompensation("inverse"))
    core.push(0, 0, 0.0)
    core.push(0, 1, 1.0)
    outcome = core.push(1, 0, 2.0)  # computed at version 0, two updates ago
    assert outcome.update.staleness == (2,) and outcome.weights == (0.5,)


def test_the_norm_compensation_measures_the_parameters_without_the_buffers():
    module = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(module.weight)
    module.register_buffer("running", torch.zeros(1))
    core = ServerCore(Variant.create("async", 2), ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0)),
                      compensation=StalenessCompensation("norm", c=0.5))
    core.push(0, 0, 1.0, contribution=Contribution(torch.tensor([1.0, 0.0]), torch.tensor([10.0])))
    core.push(1, 0, 2.0, contribution=Contribution(torch.tensor([0.0, 2.0]), torch.tensor([10.0])))
    # ||w_1 - w_0||^2 = 1 over the parameters (the buffer's 10 left out): weight 0.5
    assert core.state.params[0].tolist() == [[-1.0, -1.0]] and core.state.buffers[0].tolist() == [10.0]


def test_every_pause_is_taken_off_and_a_resume_without_a_pause_takes_nothing():
    core = ServerCore(Variant.create("async", 2), make_state(), clock=0.0)
    core.pause(1.0)
    core.resume(2.0)
    core.pause(3.0)
    core.resume(5.0)
    core.resume(5.5)  # not paused: nothing to take off
    assert core.running_time(6.0) == pytest.approx(3.0)


def test_max_updates_zero_stops_at_a_death_before_any_push():
    core = ServerCore(Variant.create("k_async", 3, 2), make_state(), ServerLimits(max_updates=0))
    assert core.remove_learner(2, 0.0).stopped and core.stopped


def test_an_older_checkpoint_without_samples_or_schedulers_loads():
    state, scheduler = scheduled_state()
    core = ServerCore(Variant.create("async", 2), state)
    core.load_state_dict({"version": 2, "updates": 2, "epoch": 1})
    assert (core.version, core.updates, core.epoch, core.samples) == (2, 2, 1, 0)
    assert scheduler.last_epoch == 0  # left as it was


def test_a_new_epoch_steps_the_epoch_schedulers_with_the_metrics_and_resumes_the_clock():
    from pytorch_lightning.utilities.types import LRSchedulerConfig

    module = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    config = LRSchedulerConfig(plateau, interval="epoch", monitor="val/loss", reduce_on_plateau=True)
    core = ServerCore(Variant.create("async", 2), ServerState(module, optimizer, [config]),
                      ServerLimits(pushes_per_epoch=1), clock=0.0)
    core.push(0, 0, 1.0, contribution=g(0.0, 0.0))  # epoch 0 ends
    core.pause(1.0)
    core.begin_epoch(3.0, {"val/loss": 2.0})
    core.push(1, 0, 4.0, contribution=g(0.0, 0.0))  # epoch 1 ends
    core.begin_epoch(4.0, {"val/loss": 2.0})  # no better: the plateau halves the lr
    assert core.state.optimizer.param_groups[0]["lr"] == 0.5
    assert core.running_time(5.0) == pytest.approx(3.0)  # 2 s of pause taken off
    core.report_metrics({"train/loss": 1.5})
    assert core.state.schedules.metrics == {"train/loss": 1.5}
    ServerCore(Variant.create("async", 2)).report_metrics({"train/loss": 1.0})  # no state: nothing to do


def test_schedulers_due_every_second_update_step_at_the_second():
    from pytorch_lightning.utilities.types import LRSchedulerConfig

    module = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    core = ServerCore(Variant.create("async", 2),
                      ServerState(module, optimizer, [LRSchedulerConfig(scheduler, interval="step", frequency=2)]))
    core.push(0, 0, 0.0, contribution=g(0.0, 0.0))
    assert scheduler.last_epoch == 0
    core.push(1, 0, 1.0, contribution=g(0.0, 0.0))
    assert scheduler.last_epoch == 1 and core.state.optimizer.param_groups[0]["lr"] == 0.5


def test_epoch_schedulers_step_after_the_epochs_they_are_due_and_not_at_the_start():
    from pytorch_lightning.utilities.types import LRSchedulerConfig

    module = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = LRSchedulerConfig(scheduler, interval="epoch", frequency=3)
    core = ServerCore(Variant.create("async", 2), ServerState(module, optimizer, [config]),
                      ServerLimits(pushes_per_epoch=1))
    core.begin_epoch(0.0)  # the start: no epoch has ended
    stepped = []
    for i in range(4):
        core.push(i % 2, core.rules.learner_version(i % 2), float(i), contribution=g(0.0, 0.0))
        core.begin_epoch(float(i))
        stepped.append(scheduler.last_epoch)
    assert stepped == [0, 0, 1, 1]  # after epochs 0, 1, 2 (due every third), 3
    stateless = ServerCore(Variant.create("async", 2), limits=ServerLimits(pushes_per_epoch=1))
    stateless.push(0, 0, 0.0)
    stateless.begin_epoch(1.0)  # nothing to step, and no error
    assert stateless.epoch == 1


def test_a_decision_carries_the_servers_version_after_an_update():
    r = ServerCore(Variant.create("k_async", 3, 2)).rules
    r.on_push(0, 0)
    r.on_push(1, 0)  # version 1
    assert r.on_push(0, 1).version == 1  # accepted, waits
    batch = ServerCore(Variant.create("k_batch_async", 2, 2)).rules
    batch.on_push(0, 0)
    batch.on_push(1, 0)  # version 1; learner 1 got it
    assert batch.on_push(1, 1).version == 1  # accepted, goes on
