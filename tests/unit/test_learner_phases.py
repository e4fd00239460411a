"""The learner's protocol as phases (`engine.distributed.phases`): the table of moves refuses
what it does not list, and a learner driven in-process by hand-built server messages passes
through each move it lists."""

import threading

import pytest
import torch

from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.phases import MOVES, Phase, ProtocolError, ServerFailed, advance
from test_learner import Delay, epoch_end, make_learner, step

C, PU, PA, S, L, D, F = (Phase.COMPUTING, Phase.PUSHED, Phase.PAUSED, Phase.STOPPED, Phase.LEFT, Phase.DONE,
                         Phase.FAILED)


def recorded(learner):
    """The learner's moves from now on, as (from, to) pairs."""
    moves, move = [], learner._to

    def to(phase):
        moves.append((learner.phase, phase))
        move(phase)
    learner._to = to
    return moves


def params(version, epoch=0):
    return Message(Kind.PARAMS, version=version, epoch=epoch, payload=torch.full((2,), float(version)))


def stop(version=1):
    return Message(Kind.STOP, version=version, payload=torch.zeros(2))


def test_the_table_refuses_every_move_it_does_not_list_naming_the_allowed_ones():
    for current in Phase:
        for to in Phase:
            if to is current or to in MOVES[current]:
                assert advance(current, to) is to
            else:
                with pytest.raises(ProtocolError, match=f"from {current.value} to {to.value}"):
                    advance(current, to)
    assert MOVES[F] == frozenset() and all(F in MOVES[p] for p in Phase if p is not F)
    with pytest.raises(ProtocolError, match=r"from stopped: done, failed"):
        advance(S, C)  # training does not go on after the stop


def test_a_push_waits_pushed_and_computes_again_on_its_answer():
    learner, endpoint, _ = make_learner()
    assert learner.phase is C
    moves = recorded(learner)
    endpoint.answer = params(1)
    step(learner)
    assert moves == [(C, PU), (PU, C)] and learner.version == 1


def test_a_variant_that_needs_no_answer_never_waits_pushed():
    learner, endpoint, _ = make_learner(waits_for_answer=False)
    moves = recorded(learner)
    step(learner)
    assert moves == [] and learner.phase is C and len(endpoint.pushed) == 1


def test_an_epochs_end_pauses_a_waiting_learner_and_resuming_waits_on_for_its_answer():
    learner, endpoint, _ = make_learner()
    moves = recorded(learner)
    endpoint.answer = epoch_end()  # the epoch ends while the push waits
    step(learner)
    assert moves == [(C, PU), (PU, PA)] and learner.paused and learner.carried.push is None
    threading.Timer(0.2, lambda: endpoint.inbox.put(params(1, epoch=1))).start()  # after the pause
    learner.resume()
    assert moves[2:] == [(PA, C), (C, PU), (PU, C)] and not learner.paused and learner.version == 1


def test_an_epochs_end_pauses_a_computing_learner_until_training_resumes():
    learner, endpoint, _ = make_learner(delay=Delay(0.05))
    moves = recorded(learner)
    endpoint.inbox.put(epoch_end())
    step(learner)  # the epoch ended during its computation: its push is carried
    assert moves == [(C, PA)] and learner.carried.push is not None and endpoint.pushed == []
    endpoint.answer = params(1, epoch=1)
    learner.resume()  # the carried push leaves
    assert moves[1:] == [(PA, C), (C, PU), (PU, C)] and len(endpoint.pushed) == 1


def test_the_stop_ends_training_from_computing_waiting_or_paused():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(stop())
    moves = recorded(learner)
    step(learner)  # computing
    assert moves == [(C, S)] and learner.stopped and learner.cancelled == 1

    learner, endpoint, _ = make_learner()
    moves = recorded(learner)
    endpoint.answer = stop()  # waiting for the answer
    step(learner)
    assert moves == [(C, PU), (PU, S)] and learner.stopped

    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(epoch_end())
    step(learner)
    moves = recorded(learner)
    endpoint.inbox.put(stop())
    learner.resume()  # the stop that came during the pause is taken now
    assert moves == [(PA, C), (C, S)] and learner.stopped


def test_goodbye_after_the_stop_is_done_at_once_and_before_it_waits_left():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(stop())
    step(learner)
    moves = recorded(learner)
    learner.close(timeout=2.0)
    assert moves == [(S, D)] and endpoint.pushed[-1].kind == Kind.BYE

    learner, endpoint, _ = make_learner()
    moves = recorded(learner)
    endpoint.push = lambda message: endpoint.inbox.put(stop()) if message.kind == Kind.BYE else None
    learner.close(timeout=2.0)  # the stop answers the goodbye
    assert moves == [(C, L), (L, D)] and learner.stopped


def test_a_paused_learner_may_leave_and_a_stop_while_paused_waits_for_it():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(epoch_end())
    step(learner)
    endpoint.inbox.put(stop())
    assert learner.stop_heard() and learner.phase is PA  # heard, not taken: validation first
    moves = recorded(learner)
    learner.close(timeout=2.0)  # the stop is taken, then the goodbye
    assert moves == [(PA, S), (S, D)]


def test_a_failure_is_final():
    learner, endpoint, _ = make_learner()
    endpoint.inbox.put(Message(Kind.ABORT, error="learner 2 failed"))
    with pytest.raises(ServerFailed, match="learner 2 failed"):
        step(learner)
    assert learner.phase is F and learner.failure == "learner 2 failed"
    with pytest.raises(ProtocolError, match="from failed to computing"):
        learner._to(C)

    learner, endpoint, _ = make_learner()
    learner.abort("out of memory")
    learner.abort("a second reason")  # once only
    assert learner.phase is F and learner.failure == "out of memory"
    assert [m.error for m in endpoint.pushed] == ["out of memory"]
