"""The learner's side of the protocol, with a fake endpoint: pushes, cancellations, delays in
both modes, epoch pauses that carry work over, validation on the server's parameters, and the
ways a run fails."""

import queue
import threading
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from fake_clock import FakeTime
from lightning_stale.engine.distributed import clocks as clocks_module
from lightning_stale.engine.distributed import learner as learner_module
from lightning_stale.engine.distributed.clocks import POLL_S
from lightning_stale.engine.distributed.paths.central.path import CentralExchange
from lightning_stale.engine.distributed.paths.collective.path import CollectiveExchange
from lightning_stale.engine.distributed.learner import Learner, RunInterrupted, ServerFailed
from lightning_stale.engine.distributed.messages import Flag, Kind, Message
from lightning_stale.engine.distributed.transport import LearnerEndpoint
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors


class ScheduledInbox:
    """A learner's inbox on a `FakeTime`: messages put now or at a given instant; a ``get`` that
    times out moves the clock by its timeout, one that finds a message due moves it to then."""

    def __init__(self, clock):
        self.clock, self._due = clock, []

    def put(self, message):
        self.put_at(0.0, message)

    def put_at(self, after_s, message):
        """``message`` arrives ``after_s`` seconds from now."""
        self._due.append((self.clock.now + after_s, len(self._due), message))
        self._due.sort(key=lambda due: due[:2])

    def get(self, timeout=None):
        if self._due and (timeout is None or self._due[0][0] <= self.clock.now + timeout):
            at, _, message = self._due.pop(0)
            self.clock.now = max(self.clock.now, at)
            return message
        if timeout is None:
            raise AssertionError("the learner waits forever: no message is scheduled")
        self.clock.now += timeout
        raise queue.Empty

    def get_nowait(self):
        return self.get(timeout=0.0)


@pytest.fixture
def fake_time(monkeypatch):
    """The learner's and its clocks' ``time`` replaced by a `FakeTime` (see `ScheduledInbox`)."""
    clock = FakeTime()
    monkeypatch.setattr(learner_module, "time", clock)
    monkeypatch.setattr(clocks_module, "time", clock)
    return clock


class FakeLearnerEndpoint:
    local = False

    def __init__(self, rank=1, clock=None):
        self.clock = clock or time  # a FakeTime, or the real clock
        self.rank, self.pushed = rank, []
        self.inbox = queue.Queue() if clock is None else ScheduledInbox(clock)
        self.answer = None  # message to answer every push with
        self.round_trip = None  # (wire seconds, server hold seconds): stamp answers like the server
        self.wire_seconds = []  # what each round trip took off the server, as slept
        self.last_heard = self.clock.monotonic()
        self.failure = None
        self.server_aborted = False

    def push(self, message):
        self.pushed.append(message)
        if self.answer is not None and message.kind == Kind.PUSH:
            answer = replace(self.answer)
            if self.round_trip is not None:
                wire, hold = self.round_trip
                pushes = sum(m.kind == Kind.PUSH for m in self.pushed)
                clock = self.clock
                sent = clock.monotonic()
                clock.sleep(wire / 2)
                arrived = clock.monotonic()
                clock.sleep(hold)
                held = clock.monotonic() - arrived
                clock.sleep(wire / 2)
                answer.pushes, answer.hold, answer.received_at = pushes, held, clock.monotonic()
                self.wire_seconds.append(answer.received_at - sent - held)
            self.inbox.put(answer)

    def join(self, timeout):
        return True

    connection_broke = LearnerEndpoint.connection_broke


class Delay:
    def __init__(self, seconds):
        self.seconds = seconds

    def sample(self, learner):
        return self.seconds


def make_learner(delay=None, clock=None, **options):
    """A learner on a fake endpoint; with ``clock`` (the `fake_time` fixture), on that clock."""
    module = nn.Linear(2, 1, bias=False)
    module.weight.grad = torch.ones_like(module.weight)
    endpoint = FakeLearnerEndpoint(clock=clock)
    vectors = ModelVectors.of(module)
    options.setdefault("exchange", CentralExchange(vectors))
    learner = Learner(endpoint, vectors, delay, **options)
    endpoint.inbox.put(Message(Kind.PARAMS, version=0, payload=torch.zeros(2)))
    learner.wait_for_parameters()
    return learner, endpoint, module


def step(learner, started_at=None, **kwargs):
    now = learner.endpoint.clock.monotonic()
    learner.step(loss=0.5, samples=4, started_at=now if started_at is None else started_at, **kwargs)


def timed(clock, action, *args):
    """How long ``action(*args)`` took on ``clock``."""
    began = clock.now
    action(*args)
    return clock.now - began


def test_learner_pushes_then_loads_the_answer():
    learner, endpoint, module = make_learner()
    endpoint.answer = Message(Kind.PARAMS, version=5, payload=torch.tensor([1.0, 2.0]))
    step(learner)
    (pushed,) = endpoint.pushed
    assert (pushed.kind, pushed.version, pushed.samples, pushed.loss) == (Kind.PUSH, 0, 4, 0.5)
    assert pushed.payload.tolist() == [1.0, 1.0] and pushed.flags == 0  # the gradient, no mask
    assert learner.version == 5 and module.weight.tolist() == [[1.0, 2.0]]


def test_a_message_during_computation_cancels_the_push():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(Message(Kind.PARAMS, version=3, payload=torch.ones(2)))
    step(learner)
    assert endpoint.pushed == [] and learner.cancelled == 1 and learner.version == 3


def test_a_cancellation_interrupts_the_injected_delay_promptly(fake_time):
    learner, endpoint, _ = make_learner(delay=Delay(5.0), clock=fake_time)
    endpoint.inbox.put_at(0.1, Message(Kind.PARAMS, version=1, payload=torch.ones(2)))
    took = timed(fake_time, step, learner)
    assert took == pytest.approx(0.1) and endpoint.pushed == [] and learner.cancelled == 1  # not 5 s
    assert learner.delays == [5.0]  # the draw is recorded even though it was cut short


def test_heartbeats_do_not_interrupt_a_delay(fake_time):
    learner, endpoint, _ = make_learner(delay=Delay(0.3), clock=fake_time)
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    endpoint.inbox.put_at(0.1, Message(Kind.HEARTBEAT))
    took = timed(fake_time, step, learner)
    assert took == pytest.approx(0.3) and len(endpoint.pushed) == 1 and learner.cancelled == 0


def test_a_k_batch_sync_learner_pushes_without_waiting_for_an_answer():
    learner, endpoint, _ = make_learner(waits_for_answer=False)
    step(learner)
    step(learner)  # would block forever if it waited
    assert [m.version for m in endpoint.pushed] == [0, 0] and learner.cancelled == 0


def test_an_overflowing_gradient_is_pushed_as_unusable_without_its_payload():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    step(learner, unusable="overflow")
    (pushed,) = endpoint.pushed
    assert pushed.flags & Flag.UNUSABLE and pushed.error == "overflow" and pushed.payload is None


def test_a_total_delay_counts_the_time_already_spent_on_the_mini_batch(fake_time):
    learner, endpoint, _ = make_learner(delay=Delay(0.6), delay_is_total=True, clock=fake_time)
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    learner.clock._start = fake_time.now - 0.5  # the computation took 0.5 s of the 0.6 s
    assert timed(fake_time, step, learner) == pytest.approx(0.1) and learner.delays == [0.6]
    learner.clock.total = False  # added after the computation: the whole 0.6 s
    assert timed(fake_time, step, learner) == pytest.approx(0.6)


def test_the_learner_measures_its_message_latency_without_the_servers_hold(fake_time):
    learner, endpoint, _ = make_learner(clock=fake_time)
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    endpoint.round_trip = (0.004, 0.030)  # 4 ms on the wire, 30 ms waiting at the server
    for _ in range(3):
        step(learner)
    assert endpoint.wire_seconds == pytest.approx([0.004] * 3)
    assert learner.clock.latency.mean == pytest.approx(0.004)  # not 0.034: the hold is taken off
    endpoint.inbox.put(Message(Kind.PARAMS, version=1, payload=torch.ones(2), pushes=3, hold=0.0,
                               received_at=fake_time.now + 5.0))
    step(learner)  # a second message for push 3: not a sample
    assert learner.clock.latency.mean == pytest.approx(0.004)


def test_a_total_delay_also_covers_the_measured_message_latency(fake_time):
    learner, endpoint, _ = make_learner(delay=Delay(0.5), delay_is_total=True, clock=fake_time)
    learner.clock.latency.observe(0.3)  # the downlink that started this mini-batch and the uplink
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    step(learner)  # started on w_0: no message ahead of it
    assert timed(fake_time, step, learner) == pytest.approx(0.2)  # started on the first answer
    # The server took 0.1 s to send the message that starts the next mini-batch: that counts too.
    endpoint.answer = Message(Kind.CONTINUE, version=0, age=0.1)
    step(learner)
    assert timed(fake_time, step, learner) == pytest.approx(0.1)  # 0.5 - 0.3 (round trip) - 0.1 (age)
    # A K-batch-sync learner goes on right after its own push: no downlink started its next
    # mini-batch, and its uplinks cancel out between consecutive pushes, so nothing is taken off.
    learner.waits_for_answer, endpoint.answer = False, None
    step(learner)
    assert timed(fake_time, step, learner) == pytest.approx(0.5)


# ---------------------------------------------------------------- epoch pauses
def epoch_end(epoch=1, payload=(9.0, 9.0)):
    return Message(Kind.EPOCH, version=0, epoch=epoch, payload=torch.tensor(payload))


def test_an_epoch_end_carries_the_delayed_mini_batch_into_the_next_epoch(fake_time):
    learner, endpoint, _ = make_learner(delay=Delay(0.4), clock=fake_time)
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    endpoint.inbox.put_at(0.1, epoch_end())
    assert timed(fake_time, step, learner) == pytest.approx(0.1)  # paused 0.1 s into its 0.4 s delay
    assert endpoint.pushed == [] and learner.paused and learner.epoch_over(0)
    assert learner.cancelled == 0 and learner.carried is not None
    fake_time.sleep(0.3)  # the pause (validation) does not count toward the delay
    assert timed(fake_time, learner.resume) == pytest.approx(0.3)  # the remaining 0.3 s, then the push
    assert [m.kind for m in endpoint.pushed] == [Kind.PUSH] and not learner.paused


@pytest.mark.usefixtures("gloo_group_of_one")
def test_a_push_carried_over_an_epochs_end_leaves_with_the_gradient_computed_before_it():
    # The collective path packs a gradient when its header leaves; a push carried over an epoch's
    # end leaves after validation, and Lightning zeroes the gradients before validation.
    torch.manual_seed(0)
    module = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    vectors = ModelVectors.of(module)
    exchange = CollectiveExchange(vectors, optimizer, Schedules([], optimizer), rank=0, device=torch.device("cpu"))
    endpoint = FakeLearnerEndpoint(rank=0)
    learner = Learner(endpoint, vectors, Delay(0.4), exchange=exchange)
    endpoint.inbox.put(Message(Kind.PARAMS, version=0))  # w_0, which every learner holds already
    learner.wait_for_parameters()
    module(torch.ones(3, 2)).sum().backward()
    grad = module.weight.grad.clone()
    threading.Timer(0.1, endpoint.inbox.put, [epoch_end()]).start()
    step(learner)  # paused during its delay: carried
    assert learner.carried is not None and endpoint.pushed == []
    module.zero_grad()  # Lightning's on_validation_model_zero_grad
    before = module.weight.detach().clone()
    # the update takes this learner's one gradient (K = 1, P = 1)
    endpoint.answer = Message(Kind.PARAMS, version=1, payload=torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    learner.resume()
    assert [m.kind for m in endpoint.pushed] == [Kind.PUSH] and endpoint.pushed[0].payload is None
    assert learner.version == 1 and torch.allclose(module.weight, before - grad)


def test_an_answer_still_awaited_at_an_epoch_end_is_awaited_after_it():
    learner, endpoint, module = make_learner()
    endpoint.answer = epoch_end()  # the epoch ends before the answer comes
    step(learner)
    assert len(endpoint.pushed) == 1 and learner.carried.push is None
    endpoint.inbox.put(Message(Kind.PARAMS, version=4, payload=torch.tensor([3.0, 3.0])))
    learner.resume()
    assert learner.version == 4 and module.weight.tolist() == [[3.0, 3.0]]


def test_a_mini_batch_started_after_the_epoch_end_is_discarded_and_counted():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(epoch_end())
    step(learner)  # computing when the epoch ended: carried
    step(learner)  # the loader's prefetched batch, started during the pause
    assert learner.cancelled == 1 and endpoint.pushed == []
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    learner.resume()
    assert len(endpoint.pushed) == 1  # the carried one


def test_only_the_epoch_message_ends_an_epoch_not_the_refresh_sent_before_it():
    """The update that ends an epoch refreshes everyone (sync family) with the new epoch count,
    then sends the epoch's end: an epoch ended on the refresh would leave the learner paused in
    the next epoch, with no end in sight, once the epoch's own message arrived."""
    learner, endpoint, _ = make_learner(waits_for_answer=False)  # a K-batch-sync learner
    endpoint.inbox.put(Message(Kind.PARAMS, version=1, epoch=1, payload=torch.zeros(2)))
    endpoint.inbox.put(epoch_end(epoch=1))
    step(learner)  # the refresh cancels this mini-batch; the epoch's end follows it
    assert learner.paused and learner.epoch_over(0) and learner.cancelled == 1
    step(learner)  # the loader had fetched one more: started after the end, discarded
    assert learner.cancelled == 2 and learner.carried is None
    learner.resume()
    assert not learner.paused and not learner.epoch_over(1)


def test_the_answer_that_ends_an_epoch_pauses_the_learner_before_its_next_mini_batch(fake_time):
    """However late the epoch's own message comes after the answer that counted the new epoch,
    the learner waits for it there: the next mini-batch always starts after the end and is
    discarded, never carried (so a Fully sync fit is the same fit run after run)."""
    learner, endpoint, _ = make_learner(clock=fake_time)
    endpoint.answer = Message(Kind.PARAMS, version=1, epoch=1, payload=torch.ones(2))
    endpoint.inbox.put_at(0.3, epoch_end(epoch=1))
    took = timed(fake_time, step, learner)
    assert took == pytest.approx(0.3) and learner.paused and learner.epoch_over(0)  # waited for it
    step(learner)  # the batch the loader had fetched
    assert learner.carried is None and learner.cancelled == 1 and len(endpoint.pushed) == 1
    endpoint.answer = Message(Kind.PARAMS, version=2, epoch=1, payload=torch.ones(2))
    learner.resume()
    step(learner)  # an answer in the same epoch: no wait, no pause
    assert not learner.paused and learner.version == 2 and len(endpoint.pushed) == 2


def test_a_stop_in_place_of_the_epochs_end_ends_the_wait_for_it():
    learner, endpoint, module = make_learner()
    endpoint.answer = Message(Kind.PARAMS, version=1, epoch=1, payload=torch.ones(2))
    stop = Message(Kind.STOP, version=1, epoch=1, payload=torch.tensor([3.0, 4.0]))
    threading.Timer(0.2, lambda: endpoint.inbox.put(stop)).start()
    step(learner)  # waits for the epoch's end: the stop comes instead
    assert learner.stopped and not learner.paused and module.weight.tolist() == [[3.0, 4.0]]


def test_validation_runs_on_the_servers_parameters_then_training_on_the_learners():
    learner, endpoint, module = make_learner()
    endpoint.inbox.put(epoch_end(payload=(7.0, 8.0)))
    step(learner)
    learner.enter_validation()
    assert module.weight.tolist() == [[7.0, 8.0]]
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    learner.resume()
    assert module.weight.tolist() == [[0.0, 0.0]]  # its own w_0 again


def test_with_a_roll_call_the_learner_reports_the_epochs_end_and_waits_for_the_answer(fake_time):
    """on_learner_failure="continue": before Lightning's collectives the learner knows of every
    death the server noticed, however late; what came meanwhile waits for training, in order."""
    learner, endpoint, _ = make_learner(roll_call=True, clock=fake_time)
    endpoint.inbox.put(epoch_end(epoch=1))
    step(learner)
    assert learner.paused and [(m.kind, m.epoch) for m in endpoint.pushed] == [(Kind.PRESENT, 1)]
    refresh = Message(Kind.PARAMS, version=3, payload=torch.tensor([2.0, 2.0]))
    answer = Message(Kind.PRESENT, version=0, epoch=1, dead=1)
    for m in (refresh, answer):
        endpoint.inbox.put_at(0.2, m)
    took = timed(fake_time, learner.confirm_epoch_end, 5.0)
    assert took == pytest.approx(0.2) and learner.dead_learners == 1 and learner.version == 0
    learner.confirm_epoch_end(timeout=5.0)  # answered: no second wait
    learner.resume()  # the refresh, taken now, cancels the carried mini-batch
    assert learner.version == 3 and learner.cancelled == 1 and [m.kind for m in endpoint.pushed] == [Kind.PRESENT]


def test_a_roll_call_held_up_by_a_frozen_learner_fails_after_the_timeout_naming_it(fake_time):
    learner, endpoint, _ = make_learner(roll_call=True, clock=fake_time)
    endpoint.inbox.put(epoch_end(epoch=1))
    step(learner)
    began = fake_time.now
    with pytest.raises(TimeoutError, match="roll call at the end of epoch 0 within 0.3 s: .*frozen"):
        learner.confirm_epoch_end(timeout=0.3)
    assert fake_time.now - began == pytest.approx(0.3)  # the timeout fired at its deadline
    assert learner.failure is None  # the strategy reports it


def test_without_a_roll_call_nothing_is_reported_or_waited_for():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(epoch_end(epoch=1))
    step(learner)
    learner.confirm_epoch_end(timeout=5.0)
    assert learner.paused and endpoint.pushed == []


def test_a_stop_or_an_abort_ends_the_wait_for_the_roll_call():
    learner, endpoint, _ = make_learner(roll_call=True)
    endpoint.inbox.put(epoch_end(epoch=1))
    step(learner)
    endpoint.inbox.put(Message(Kind.STOP, version=0, payload=torch.tensor([5.0, 6.0])))
    learner.confirm_epoch_end(timeout=5.0)  # returns: nobody is removed after the stop
    learner.confirm_epoch_end(timeout=5.0)  # (the loader's prefetched batch) the stop is still waiting
    assert learner.stop_heard() and learner.dead_learners == 0
    learner, endpoint, _ = make_learner(roll_call=True)
    endpoint.inbox.put(epoch_end(epoch=1))
    step(learner)
    endpoint.inbox.put(Message(Kind.ABORT, version=0, error="learner 2 died: reset"))
    with pytest.raises(ServerFailed, match="learner 2 died"):
        learner.confirm_epoch_end(timeout=5.0)


def test_a_stop_heard_at_an_epochs_end_waits_untaken_then_closes_the_fit():
    """The stop that comes while the epoch ends: looked at (the learners agree to stop on it)
    but not taken before the fit ends; closing takes it, with the final parameters."""
    learner, endpoint, module = make_learner()
    endpoint.inbox.put(epoch_end(payload=(7.0, 8.0)))
    step(learner)
    assert not learner.stop_heard()  # nothing yet: training goes on after the epoch's end
    endpoint.inbox.put(Message(Kind.HEARTBEAT, version=0))
    endpoint.inbox.put(Message(Kind.STOP, version=0, payload=torch.tensor([5.0, 6.0])))
    assert learner.stop_heard() and learner.stop_heard()  # looked at twice, still there
    assert not learner.stopped and module.weight.tolist() == [[0.0, 0.0]]
    learner.close(timeout=0.5)  # no wait: the stop was queued already
    assert learner.stopped and module.weight.tolist() == [[5.0, 6.0]]
    assert endpoint.pushed[-1].kind == Kind.BYE


def test_a_learner_that_heard_no_stop_takes_what_it_looked_at_when_training_goes_on():
    learner, endpoint, module = make_learner()
    endpoint.inbox.put(epoch_end())
    step(learner)
    endpoint.inbox.put(Message(Kind.PARAMS, version=3, payload=torch.tensor([2.0, 2.0])))
    assert not learner.stop_heard()
    learner.resume()
    assert learner.version == 3 and module.weight.tolist() == [[2.0, 2.0]]


def test_looking_for_the_stop_raises_the_servers_abort_at_once():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(Message(Kind.ABORT, version=0, error="learner 2 failed: boom"))
    with pytest.raises(ServerFailed, match="learner 2 failed: boom"):
        learner.stop_heard()


# ---------------------------------------------------------------- failures and leaving
def test_an_abort_raises_the_servers_reason():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.ABORT, error="learner 2 failed: ValueError: bad batch")
    with pytest.raises(ServerFailed, match="learner 2 failed: ValueError: bad batch"):
        step(learner)
    assert learner.failure == "learner 2 failed: ValueError: bad batch"


def test_an_interruption_raises_run_interrupted():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.ABORT, flags=Flag.INTERRUPTED, error="SIGTERM on rank 3")
    with pytest.raises(RunInterrupted, match="SIGTERM on rank 3"):
        step(learner)


def test_an_interruption_announced_by_the_server_is_no_failure_the_learner_leaves_cleanly():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.INTERRUPT, error="SIGTERM on rank 0")
    stop = Message(Kind.STOP, version=0, payload=torch.zeros(2))
    threading.Timer(0.2, endpoint.inbox.put, [stop]).start()  # the server's STOP follows
    step(learner)  # hears why, keeps waiting, then stops: nothing raised
    assert learner.stopped and learner.interrupted == "SIGTERM on rank 0" and learner.failure is None
    learner.close(timeout=5.0)
    assert endpoint.pushed[-1].kind == Kind.BYE  # the goodbye protocol, as at a normal end


def test_interrupt_asks_the_server_to_stop_the_run():
    learner, endpoint, _ = make_learner()
    learner.interrupt("SIGTERM on rank 1")
    (message,) = endpoint.pushed
    assert message.kind == Kind.INTERRUPT and bytes(message.payload.tolist()).decode() == "SIGTERM on rank 1"
    assert learner.failure is None


def test_a_wanted_stop_is_asked_of_the_server_once_and_training_goes_on_until_its_stop():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.PARAMS, version=1, payload=torch.ones(2))
    learner.request_stop()
    learner.request_stop()  # asked again at the next batch: nothing more is sent
    step(learner)  # still training: the push is answered
    assert [m.kind for m in endpoint.pushed] == [Kind.HALT, Kind.PUSH] and not learner.stopped
    endpoint.answer = Message(Kind.STOP, version=1, payload=torch.ones(2))
    step(learner)
    assert learner.stopped
    learner.request_stop()  # stopped already: nothing to ask
    assert [m.kind for m in endpoint.pushed] == [Kind.HALT, Kind.PUSH, Kind.PUSH]


def test_abort_is_sent_once_and_becomes_the_learners_failure():
    learner, endpoint, _ = make_learner()
    learner.abort("learner 1 failed: ValueError: boom")
    learner.abort("learner 1 failed: again")  # the server no longer listens: nothing is sent
    assert [m.kind for m in endpoint.pushed] == [Kind.ABORT]
    assert learner.failure == "learner 1 failed: ValueError: boom"


def test_a_learner_leaving_a_failed_run_tells_the_server_once_unless_it_aborted_itself():
    # the server's thread receiving from this learner ends on that ABORT, before the exit
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.ABORT, error="learner 2 failed: ValueError: bad batch")
    with pytest.raises(ServerFailed):
        step(learner)
    learner.leave_after_failure()
    assert [m.kind for m in endpoint.pushed] == [Kind.PUSH]  # a server not known to be alive: none
    endpoint.server_aborted = True  # (the real endpoint's receiving thread sets it on the ABORT)
    learner.leave_after_failure()
    learner.leave_after_failure()
    aborts = [m for m in endpoint.pushed if m.kind == Kind.ABORT]
    assert len(aborts) == 1
    assert aborts[0].error == "learner 1 left after the failure: learner 2 failed: ValueError: bad batch"
    own, endpoint = make_learner()[:2]
    endpoint.server_aborted = True
    own.abort("learner 1 failed: ValueError: boom")
    own.leave_after_failure()  # its own ABORT ended the server's receiver already
    assert [m.kind for m in endpoint.pushed] == [Kind.ABORT]


def test_a_silent_server_is_taken_for_dead(fake_time):
    learner, endpoint, _ = make_learner(server_timeout=0.3, clock=fake_time)
    endpoint.last_heard = fake_time.now
    start = fake_time.now
    with pytest.raises(ServerFailed, match="no message from the server"):
        step(learner)  # pushes, then waits for an answer that never comes
    assert 0.3 < fake_time.now - start <= 0.3 + POLL_S + 1e-9  # at the first look past the timeout
    assert "no message from the server" in learner.failure


def test_learner_fails_loudly_when_the_transport_breaks():
    learner, endpoint, _ = make_learner()
    endpoint.answer = Message(Kind.FAILED, error="receiving from the server failed: reset")
    with pytest.raises(ServerFailed, match="reset"):
        step(learner)


def test_a_connection_that_breaks_under_a_push_fails_the_run_naming_the_server():
    # The server's process died and this learner's send noticed before its receiving thread.
    learner, endpoint, _ = make_learner()

    def broken(message):
        raise RuntimeError("Read error [127.0.0.1]:52934: Connection reset by peer")

    endpoint.push = broken
    with pytest.raises(ServerFailed, match=r"learner 1: the connection to the server \(rank 0\) broke.*reset by peer"):
        step(learner)
    assert learner.failure == endpoint.failure  # the receiving thread, noticing later, says no more


def test_close_says_goodbye_with_the_delays_and_waits_for_stop():
    learner, endpoint, _ = make_learner(delay=Delay(0.0))
    endpoint.answer = Message(Kind.CONTINUE, version=0)
    step(learner)
    endpoint.inbox.put(Message(Kind.STOP, version=0, payload=torch.zeros(2)))
    learner.close(timeout=5.0)
    bye = endpoint.pushed[-1]
    assert bye.kind == Kind.BYE and bye.payload.tolist() == [0.0] and learner.stopped
    assert bye.cancelled == learner.cancelled == 0


def test_close_gives_up_with_an_error_instead_of_hanging():
    learner, _, _ = make_learner()
    with pytest.raises(ServerFailed, match="no stop from the server within 0.2 s"):
        learner.close(timeout=0.2)


def test_abort_tells_the_server_why():
    learner, endpoint, _ = make_learner()
    learner.abort("SIGINT on rank 1", interrupted=True)
    (message,) = endpoint.pushed
    assert message.kind == Kind.ABORT and message.flags == Flag.INTERRUPTED
    assert bytes(message.payload.tolist()).decode() == "SIGINT on rank 1"


def test_parameters_lent_from_shared_memory_are_loaded_released_or_kept_across_a_pause(tmp_path):
    """Answers whose payload is still in its shared-memory slot (`lanes.LentPayload`): new
    parameters are loaded from the slot, parameters already held free it unread, and ones
    deferred over a pause survive the slot being written again (the receiving thread copies
    them out before it takes the next payload)."""
    from lightning_stale.engine.distributed.lanes import LaneFile, slot_bytes_for

    lanes, _ = LaneFile.create(str(tmp_path), slot_bytes_for(2, torch.float32))
    lane = lanes.down
    learner, endpoint, module = make_learner()

    def arrive(kind, version, values):  # the server writes the slot; the receiving thread lends it
        lane.write(torch.tensor(values), lambda: None)
        message = Message(kind, version=version)
        lane.lend(message, 2, torch.float32)
        endpoint.inbox.put(message)
        return message

    endpoint.answer = None
    same = arrive(Kind.PARAMS, 0, [9.0, 9.0])  # the version held already
    learner._absorb(learner._drain())
    assert same.payload is None and same.lent.settled and int(lane.control[2]) == 1
    fresh = arrive(Kind.PARAMS, 1, [1.0, 2.0])
    learner._absorb(learner._drain())
    assert fresh.lent.settled and fresh.payload.data_ptr() == lane._slots[1].data_ptr()  # no copy
    assert module.weight.tolist() == [[1.0, 2.0]] and int(lane.control[2]) == 2  # both slots free

    endpoint.inbox.put(epoch_end())
    step(learner)
    assert learner.paused
    deferred = arrive(Kind.PARAMS, 3, [2.0, 2.0])
    assert not learner.stop_heard() and not deferred.lent.settled  # looked at, held over the pause
    arrive(Kind.CONTINUE, 3, [0.0, 0.0]).lent.release()  # the next payload: the deferred one is copied out
    lane.write(torch.tensor([7.0, 7.0]), lambda: None)  # into the slot it was lent from
    learner.resume()
    assert learner.version == 3 and module.weight.tolist() == [[2.0, 2.0]]
