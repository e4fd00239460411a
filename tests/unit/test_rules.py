"""The six variants' rules, driven with hand-built events (docs/method.md, "The six variants")."""

import random

import pytest

from lightning_stale.delays import Exponential
from lightning_stale.method.rules import ProtocolError, ServerRules
from lightning_stale.method.virtual_clock import VirtualCluster
from lightning_stale.method.variants import VARIANT_NAMES, Variant


def rules(name, p=4, k=None):
    return ServerRules(Variant.create(name, p, k))


# ---------------------------------------------------------------- construction and K
@pytest.mark.parametrize("name,k,expected", [("sync", None, 4), ("async", None, 1), ("k_sync", None, 2),
                                             ("k_batch_async", 3, 3), ("k_async", 4, 4)])
def test_k_defaults_and_values(name, k, expected):
    assert Variant.create(name, 4, k).k == expected


@pytest.mark.parametrize("name,k,match", [
    ("k_sync", 5, r"1 <= K <= P=4, got K=5"),
    ("k_async", 0, r"got K=0"),
    ("k_batch_sync", 2.5, r"integer .* got 2.5"),
    ("sync", 2, r"'sync' means K=P=4, got K=2"),
    ("async", 3, r"'async' means K=1, got K=3"),
    ("fast", None, r"unknown variant 'fast'; choose one of sync, k_sync"),
])
def test_bad_variant_or_k_is_a_clear_error(name, k, match):
    with pytest.raises(ValueError, match=match):
        Variant.create(name, 4, k)


def test_only_a_k_batch_sync_pusher_goes_on_without_an_answer():
    assert [n for n in VARIANT_NAMES if not Variant.create(n, 4).pusher_needs_answer] == ["k_batch_sync"]


def test_switches_describe_all_six():
    table = {n: (Variant.create(n, 4).counts, Variant.create(n, 4).synchronous) for n in VARIANT_NAMES}
    assert table == {
        "sync": ("learners", True), "k_sync": ("learners", True), "k_batch_sync": ("batches", True),
        "async": ("learners", False), "k_async": ("learners", False), "k_batch_async": ("batches", False),
    }


# ---------------------------------------------------------------- sync family
def test_fully_sync_waits_for_all_and_refreshes_all():
    r = rules("sync")
    for learner in (2, 0, 3):
        d = r.on_push(learner, 0)
        assert d.accepted and d.update is None and d.refresh == () and r.is_waiting(learner)
    d = r.on_push(1, 0)
    assert d.update.index == 1 and {g.learner for g in d.update.gradients} == {0, 1, 2, 3}
    assert d.refresh == (0, 1, 2, 3) and d.cancel == () and d.update.staleness == (0, 0, 0, 0)


def test_k_sync_cancels_stragglers_and_drops_their_late_gradient():
    r = rules("k_sync", k=2)
    r.on_push(3, 0)
    d = r.on_push(1, 0)
    assert d.update is not None and [g.learner for g in d.update.gradients] == [3, 1]
    assert d.refresh == (0, 1, 2, 3) and d.cancel == (0, 2)
    # learner 0 had finished at w_0 before its cancellation reached it: dropped, not applied
    late = r.on_push(0, 0)
    assert late.dropped == "stale" and not late.accepted and late.refresh == ()
    assert r.learner_version(0) == 1 and not r.is_waiting(0)
    # learner 0 now pushes at w_1 like everyone else
    assert r.on_push(0, 1).accepted
    assert r.counts.dropped["stale"] == 1 and r.accounting_ok()


def test_k_sync_one_gradient_per_learner_per_update():
    r = rules("k_sync", k=3)
    r.on_push(0, 0)
    with pytest.raises(ProtocolError, match="waiting"):
        r.on_push(0, 0)


def test_k_batch_sync_counts_minibatches_from_any_learner():
    r = rules("k_batch_sync", k=3)
    d1 = r.on_push(2, 0)
    assert d1.resume == (2,) and d1.refresh == ()  # goes on at the same w_0
    d2 = r.on_push(2, 0)
    assert d2.resume == (2,)
    d3 = r.on_push(0, 0)
    assert [g.learner for g in d3.update.gradients] == [2, 2, 0]
    # everyone restarts; all but the pusher were computing and are cancelled
    assert d3.refresh == (0, 1, 2, 3) and d3.cancel == (1, 2, 3)
    assert r.on_push(2, 0).dropped == "stale"
    assert r.accounting_ok()


# ---------------------------------------------------------------- async family
def test_async_applies_every_gradient_and_only_pusher_refreshes():
    r = rules("async")
    d = r.on_push(1, 0)
    assert d.update.index == 1 and d.refresh == (1,) and d.cancel == ()
    d = r.on_push(3, 0)  # computed at w_0, applied to w_1: staleness 1
    assert d.update.staleness == (1,) and d.refresh == (3,)
    d = r.on_push(0, 0)
    assert d.update.staleness == (2,)
    assert r.counts.staleness == {0: 1, 1: 1, 2: 1}


def test_k_async_needs_k_distinct_learners_and_refreshes_only_them():
    r = rules("k_async", k=2)
    d = r.on_push(0, 0)
    assert d.accepted and d.update is None and d.refresh == ()
    with pytest.raises(ProtocolError):
        r.on_push(0, 0)  # a pusher waits for w_1
    d = r.on_push(2, 0)
    assert d.update.version == 1 and d.refresh == (0, 2) and d.cancel == ()
    # learners 1 and 3 kept computing on w_0: their gradients are applied with staleness 1
    r.on_push(1, 0)
    d = r.on_push(0, 1)
    assert sorted(zip([g.learner for g in d.update.gradients], d.update.staleness)) == [(0, 0), (1, 1)]
    assert d.refresh == (0, 1)


def test_k_batch_async_pusher_pulls_current_parameters_at_once():
    r = rules("k_batch_async", k=2)
    d = r.on_push(1, 0)
    assert d.resume == (1,)  # nothing newer than what it holds
    d = r.on_push(1, 0)
    assert d.update is not None and d.refresh == (1,)  # its push made w_1: it gets w_1
    d = r.on_push(3, 0)
    assert d.refresh == (3,) and d.update is None  # pulls w_1 right away
    d = r.on_push(0, 0)
    assert d.update.staleness == (1, 1) and d.refresh == (0,)


# ---------------------------------------------------------------- flush, stop, accounting
def test_an_unusable_push_is_dropped_and_its_learner_goes_on():
    r = rules("k_sync", k=2)
    d = r.on_push(1, 0, unusable="overflow")
    assert d.dropped == "overflow" and d.resume == (1,) and not r.is_waiting(1)
    assert r.on_push(1, 0).accepted and r.counts.dropped == {"overflow": 1} and r.accounting_ok()


@pytest.mark.parametrize("name", ["k_sync", "k_batch_sync", "k_async"])
def test_a_dead_learner_lowers_k_and_its_gradients_still_count(name):
    r = rules(name, k=3)
    r.on_push(0, 0)
    r.on_push(1, 0)  # two of three pending
    d = r.remove_learner(2)  # learner 2 dies: K = 3 still fits the three learners left
    assert d.update is None and r.k == 3 and r.alive == (0, 1, 3)
    d = r.remove_learner(3)  # two left: K is clamped to 2, which the pending gradients meet
    assert r.k == 2 and [g.learner for g in d.update.gradients] == [0, 1]
    assert d.refresh == (0, 1) and 2 not in d.cancel + d.refresh
    assert r.stats()["dead_learners"] == [2, 3] and r.accounting_ok()


def test_a_dead_learner_is_never_refreshed_or_cancelled():
    r = rules("k_sync", k=2)
    r.remove_learner(3)
    r.on_push(0, 0)
    d = r.on_push(1, 0)
    assert d.refresh == (0, 1, 2) and d.cancel == (2,)


def test_stop_counts_pending_and_late_pushes_as_in_flight():
    r = rules("k_async", k=3)
    r.on_push(0, 0)
    r.on_push(1, 0)
    r.stop()
    assert r.on_push(2, 0).dropped == "in_flight_at_stop"
    s = r.stats()
    assert s["gradients_in_flight_at_stop"] == 3 and s["gradients_received"] == 3 and r.accounting_ok()


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_random_interleavings_keep_the_books(name):
    """Drive the rules with a random but protocol-respecting schedule: every push is accounted."""
    rng = random.Random(7)
    r = ServerRules(Variant.create(name, 5, None if name in ("sync", "async") else 3))
    # learners with a push in flight to the server: (learner, version); like the real engine,
    # the rules may already have refreshed a learner whose push has not arrived yet
    in_flight, busy = [], set()
    for _ in range(2000):
        idle = [l for l in range(5) if l not in busy and not r.is_waiting(l)]
        if in_flight and (not idle or rng.random() < 0.5):
            learner, version = in_flight.pop(rng.randrange(len(in_flight)))
            busy.discard(learner)
            d = r.on_push(learner, version)
            if r.variant.synchronous:
                assert d.update is None or set(d.update.staleness) == {0}
        elif idle:
            learner = rng.choice(idle)
            busy.add(learner)
            in_flight.append((learner, r.learner_version(learner)))
        assert r.accounting_ok()
    r.stop()
    s = r.stats()
    assert s["gradients_received"] == s["gradients_applied"] + s["gradients_dropped"] + s["gradients_in_flight_at_stop"]
    assert s["updates"] > 50
    assert sum(s["staleness_histogram"].values()) == s["gradients_applied"]


# ---------------------------------------------------------------- the clock
def test_virtual_cluster_k_async_uses_k_distinct_learners():
    r = rules("k_async", k=2)
    cluster = VirtualCluster(r, Exponential(mean=1.0, seed=3))
    updates = 0
    while updates < 200:
        d = cluster.step()
        if d.update:
            updates += 1
            assert len({g.learner for g in d.update.gradients}) == 2
    assert r.accounting_ok() and cluster.now > 0


def test_virtual_cluster_batch_variant_lets_one_learner_push_twice():
    r = rules("k_batch_sync", k=4)
    cluster = VirtualCluster(r, Exponential(mean=1.0, seed=1))
    repeated = 0
    for _ in range(400):
        d = cluster.step()
        if d.update:
            learners = [g.learner for g in d.update.gradients]
            repeated += len(learners) != len(set(learners))
    assert repeated > 0


# ---------------------------------------------------------------- resume, overflow, deaths
def test_after_a_resume_staleness_counts_the_updates_since_the_resumed_version():
    """A run resumed at update 10 (version 10): a gradient computed at version 10 is fresh, not
    10 updates stale; staleness compensation weighs it by what happened since."""
    r = rules("k_batch_async", p=2, k=1)
    r.resume_at(version=10, updates=10)
    assert r.staleness_of(10) == 0
    first = r.on_push(0, 10)
    assert first.update.staleness == (0,) and first.update.index == 11
    second = r.on_push(1, 10)  # computed before the first update after the resume
    assert second.update.staleness == (1,) and r.counts.staleness == {0: 1, 1: 1}
    third = r.on_push(0, 11)  # computed at the first version made after the resume
    assert third.update.staleness == (1,) and r.staleness_of(13) == 0


@pytest.mark.parametrize("name", ["k_sync", "k_batch_sync"])
def test_a_sync_push_both_stale_and_unusable_is_answered_once_by_the_refresh(name):
    """Learner 2 was interrupted by update 1 and told to restart (a refresh); its overflowed
    push at version 0 crossed that refresh: it must not also be told to go on with what it holds."""
    r = rules(name, p=3, k=2)
    r.on_push(0, 0)
    update = r.on_push(1, 0)
    assert update.update is not None and 2 in update.refresh and 2 in update.cancel
    late = r.on_push(2, 0, unusable="overflow")
    assert (late.dropped, late.resume, late.refresh, late.update) == ("overflow", (), (), None)
    assert r.counts.dropped == {"overflow": 1} and r.accounting_ok()


@pytest.mark.parametrize("name", ["k_async", "k_batch_async"])
def test_an_async_push_stale_and_unusable_goes_on_with_what_it_holds(name):
    r = rules(name, p=3, k=2)
    r.on_push(0, 0)
    r.on_push(1, 0)  # update 1; learner 2 keeps computing at version 0
    late = r.on_push(2, 0, unusable="overflow")
    assert (late.dropped, late.resume, late.refresh) == ("overflow", (2,), ())


def test_adaptive_k_is_never_set_above_the_learners_alive():
    """After deaths under on_learner_failure="continue", AdaSync asking for a larger K gets the
    learners left: an update waiting for more gradients than learners would never come."""
    r = rules("k_async", p=4, k=2)
    r.remove_learner(0)
    r.remove_learner(1)
    r.set_k(4)
    assert r.k == 2 and r.variant.k == 4  # the variant keeps what was asked, validated against P
    r.on_push(2, 0)
    assert r.on_push(3, 0).update is not None  # the two alive learners make an update
    r.remove_learner(2)
    r.set_k(3)
    assert r.k == 1 and r.on_push(3, 1).update is not None


@pytest.mark.parametrize("p,expected", [(3, 2), (5, 3), (7, 4), (1, 1), (2, 1), (4, 2)])
@pytest.mark.parametrize("name", ["k_sync", "k_batch_sync", "k_async", "k_batch_async"])
def test_the_default_k_of_a_k_variant_is_half_of_p_rounded_up(name, p, expected):
    from lightning_stale.method.variants import default_k

    assert default_k(name, p) == expected == Variant.create(name, p).k
    assert default_k("sync", p) == p and default_k("async", p) == 1


def test_the_counters_of_a_run_with_a_drop_a_death_and_a_push_after_the_stop():
    r = rules("k_async", p=3, k=2)
    r.on_push(0, 0)
    assert r.on_push(1, 0).update.staleness == (0, 0)
    assert r.on_push(2, 0, unusable="overflow").resume == (2,)
    assert r.on_push(2, 0).accepted and r.is_waiting(2)
    assert r.remove_learner(1).update is None and r.alive == (0, 2) and r.k == 2
    second = r.on_push(0, 1)
    assert second.update.staleness == (1, 0) and second.refresh == (0, 2)
    assert r.versions_in_use() == {2} and r.learner_version(2) == 2
    r.stop()
    assert r.on_push(2, 2).dropped == "in_flight_at_stop"
    assert r.stats() == {
        "updates": 2, "gradients_received": 6, "gradients_applied": 4, "gradients_dropped": 1,
        "gradients_dropped_by_reason": {"overflow": 1}, "gradients_pending": 0,
        "gradients_in_flight_at_stop": 1, "cancellations": 0, "staleness_histogram": {0: 3, 1: 1},
        "pushes_per_learner": [2, 1, 3], "dead_learners": [1], "k": 2, "p": 3, "variant": "k_async"}
    assert r.accounting_ok()


def test_removing_a_learner_answers_with_the_current_version_and_it_waits_no_more():
    r = rules("k_async", p=3, k=2)
    r.on_push(0, 0)
    r.on_push(1, 0)  # update 1
    r.on_push(2, 0)  # learner 2 waits for update 2
    assert r.is_waiting(2)
    removed = r.remove_learner(2)
    assert (removed.push, removed.update, removed.version) == (None, None, 1) and not r.is_waiting(2)
    again = r.remove_learner(2)  # a death heard twice changes nothing
    assert (again.push, again.update, again.version) == (None, None, 1)
    assert r.counts.dead_learners == [2] and r.alive == (0, 1)


def test_a_dropped_push_is_named_in_its_decision_with_the_current_version():
    r = rules("k_sync", p=3, k=2)
    r.on_push(0, 0)
    r.on_push(1, 0)  # update 1
    stale = r.on_push(2, 0)
    assert (stale.dropped, stale.push.learner, stale.push.version, stale.version) == ("stale", 2, 0, 1)


def test_every_decision_names_its_push_and_the_version_after_it():
    r = rules("k_async", p=2, k=2)
    assert r.stopped is False
    with pytest.raises(ProtocolError, match="learner 2 does not exist"):
        r.on_push(2, 0)
    waiting = r.on_push(0, 0)
    assert (waiting.push.learner, waiting.accepted, waiting.version) == (0, True, 0)
    update = r.on_push(1, 0)
    assert update.version == 1 == update.update.version
    overflow = r.on_push(0, 1, unusable="overflow")
    assert (overflow.push.learner, overflow.push.version, overflow.version) == (0, 1, 1)
    r.stop()
    late = r.on_push(1, 1)
    assert (late.push.learner, late.dropped, late.version) == (1, "in_flight_at_stop", 1)
    batch = rules("k_batch_async", p=2, k=2)
    goes_on = batch.on_push(0, 0)
    assert (goes_on.push.learner, goes_on.accepted, goes_on.version, goes_on.resume) == (0, True, 0, (0,))


def test_cancellations_add_up_over_updates():
    r = rules("k_sync", p=3, k=2)
    for version in (0, 1):
        r.on_push(0, version)
        assert r.on_push(1, version).cancel == (2,)
    assert r.counts.cancellations == 2 and r.stats()["cancellations"] == 2


def test_a_k_batch_async_update_completed_by_a_death_refreshes_nobody():
    r = rules("k_batch_async", p=3, k=3)
    r.on_push(0, 0)
    r.on_push(1, 0)
    completed = r.remove_learner(2)
    assert completed.update is not None and completed.refresh == () and completed.version == 1


def test_check_variant_name_returns_a_known_name_and_lists_the_six_for_another():
    from lightning_stale.method.variants import check_variant_name

    assert [check_variant_name(name) for name in VARIANT_NAMES] == list(VARIANT_NAMES)
    with pytest.raises(ValueError, match=r"unknown variant 'fast'; choose one of sync, "):
        check_variant_name("fast")


@pytest.mark.parametrize("name,k,equivalent", [
    ("sync", None, None), ("async", None, None),
    ("k_sync", 4, "Fully sync"), ("k_sync", 1, None), ("k_sync", 2, None),
    ("k_batch_sync", 4, None), ("k_batch_sync", 1, None),
    ("k_async", 4, "Fully sync"), ("k_async", 1, "Async"), ("k_async", 2, None),
    ("k_batch_async", 1, "Async"), ("k_batch_async", 4, None), ("k_batch_async", 2, None)])
def test_a_k_variant_at_an_edge_of_k_is_the_papers_sync_or_async(name, k, equivalent):
    assert Variant.create(name, 4, k).equivalent() == equivalent


def test_the_virtual_cluster_starts_every_learner_at_time_zero():
    from lightning_stale.delays import Constant

    cluster = VirtualCluster(ServerRules(Variant.create("async", 2)), Constant(0.5), compute_time=0.25)
    assert cluster.now == 0.0
    first = cluster.next_finish()
    assert (first.time, first.started) == (0.75, 0.0) and cluster.now == 0.75


class Scripted:
    """Each learner's mini-batch times, in order (a delay model with no randomness)."""

    def __init__(self, times):
        self.times = {learner: list(values) for learner, values in times.items()}

    def sample(self, learner):
        return self.times[learner].pop(0)


def test_the_virtual_cluster_breaks_ties_by_the_order_the_mini_batches_started():
    # learner 1 finishes at 1 and restarts, learner 0 at 2: both next finish at 3, learner 1's
    # mini-batch started first, so it finishes first (then learner 0's, started at 2)
    cluster = VirtualCluster(ServerRules(Variant.create("async", 2)), Scripted({0: [2.0, 1.0, 9.0], 1: [1.0, 2.0, 9.0]}))
    finishes = []
    for _ in range(4):
        finish = cluster.next_finish()
        finishes.append((finish.time, finish.learner, finish.started))
        cluster.apply(cluster.rules.on_push(finish.learner, finish.version))
    assert finishes == [(1.0, 1, 0.0), (2.0, 0, 0.0), (3.0, 1, 1.0), (3.0, 0, 2.0)]


def test_kind_of_and_create_refuse_what_is_not_a_variant_or_a_number_of_learners():
    from lightning_stale.method.variants import kind_of

    with pytest.raises(ValueError, match=r"unknown variant \['sync'\]; choose one of"):
        kind_of(["sync"])
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"^the number of learners P must be a positive integer, got {bad!r}$"):
            Variant.create("sync", bad)


def test_a_k_batch_async_pusher_behind_the_server_is_answered_with_the_current_version():
    r = rules("k_batch_async", k=2)
    r.on_push(0, 0)
    assert r.on_push(0, 0).update is not None and r.version == 1  # learner 0's two batches
    behind = r.on_push(1, 0)  # learner 1 computed at w_0: it pulls w_1 and goes on
    assert behind.accepted and behind.refresh == (1,) and behind.version == 1
    assert r.learner_version(1) == 1
