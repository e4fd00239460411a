"""The real engine's learners and server with P = 2 and 3 in one process (tests/inprocess.py):
what docs/method.md says about staleness, cancellation, averaging across learners and BatchNorm
buffers, checked against the pushes as the server received them."""

import torch

import user_modules as um
from inprocess import InProcessRun, blob_batches, isclose



def check_update_rule(run: InProcessRun, lr: float, weighted: bool = False) -> None:
    """Every update is w_{j+1} = w_j - (eta / K) sum_l a_l g(w_{tau(l,j)}, xi_{l,j}) (SGD),
    with each g the gradient of its learner's mini-batch at the version it was computed at,
    recomputed here from the server's parameters of that version."""
    assert [u.update.index for u in run.updates] == list(range(1, len(run.updates) + 1))
    for recorded in run.updates:
        update = recorded.update
        total = torch.zeros_like(run.parameters(0))
        weights = recorded.weights or [1.0] * len(update.gradients)
        by_learner = sorted(update.gradients, key=lambda g: g.learner)  # weights are in learner order
        for push, weight in zip(by_learner, weights):
            recorded_push = run.pushes[push.id]
            assert (recorded_push.learner, recorded_push.version) == (push.learner, push.version)
            pushed = run.pushed(push.id).gradient
            assert isclose(pushed, run.gradient_at(push.version, push.learner, recorded_push.batch))
            total += weight * pushed
        expected = run.parameters(update.version - 1) - lr / len(update.gradients) * total
        assert isclose(run.parameters(update.version), expected), f"update {update.index}"
    if not weighted:
        assert all(u.weights is None for u in run.updates)


def books_balance(stats):
    return stats["gradients_received"] == (stats["gradients_applied"] + stats["gradients_dropped"]
                                           + stats["gradients_pending"] + stats["gradients_in_flight_at_stop"])


def test_fully_sync_averages_the_gradients_of_all_three_learners():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "sync", p=3, max_updates=4).fit()
    assert run.stats["updates"] == 4 and len(run.updates) == 4
    assert all(sorted(g.learner for g in u.update.gradients) == [0, 1, 2] for u in run.updates)
    assert all(u.update.staleness == (0, 0, 0) for u in run.updates)
    check_update_rule(run, lr=0.05)
    assert books_balance(run.stats)


def test_async_applies_a_slow_learners_stale_gradient_computed_at_its_old_version():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "async", p=2,
                       delays={0: 0.01, 1: 0.1}, max_updates=20).fit()
    for u in run.updates:  # staleness j - tau(l, j): updates applied since its version
        assert u.update.staleness == tuple(u.update.index - 1 - g.version for g in u.update.gradients)
    slow = [u for u in run.updates if u.update.gradients[0].learner == 1]
    assert slow and max(u.update.staleness[0] for u in slow) >= 2  # the fast learner went on
    histogram = run.stats["staleness_histogram"]
    assert sum(histogram.values()) == len(run.updates) and max(histogram) >= 2
    check_update_rule(run, lr=0.05)  # the stale gradient is the one at w_tau, not at w_j
    assert books_balance(run.stats)


def test_k_sync_cancels_the_straggler_and_restarts_everyone_from_the_new_version():
    torch.manual_seed(0)
    # learner 2's injected delay outlasts any run: every update (K = 2 of 3) cancels its round, on a
    # busy machine too, and the stop ends its wait (an interruptible wait: the test takes no minute)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "k_sync", p=3, k=2,
                       delays={0: 0.0, 1: 0.0, 2: 60.0}, max_updates=4).fit()
    stats = run.stats
    assert stats["cancellations"] >= 1 and stats["computations_cancelled"] >= 1
    assert all(u.update.staleness == (0, 0) for u in run.updates)  # never stale in the sync family
    assert all(push.version == run.pushes[push.id].version for u in run.updates for push in u.update.gradients)
    assert run.learners[2].cancelled >= 1
    check_update_rule(run, lr=0.05)
    assert books_balance(stats)


def test_k_batch_async_weighs_stale_gradients_by_inverse_staleness():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "k_batch_async", p=3, k=2,
                       delays={0: 0.01, 1: 0.01, 2: 0.1}, max_updates=30, compensation="inverse").fit()
    assert any(max(u.update.staleness) > 1 for u in run.updates)
    for u in run.updates:  # the weights in learner order, each 1 / max(1, its staleness)
        by_learner = sorted(zip(u.update.gradients, u.update.staleness), key=lambda gs: gs[0].learner)
        assert list(u.weights) == [1.0 / max(1, s) for _, s in by_learner]
    check_update_rule(run, lr=0.05, weighted=True)


def test_batchnorm_buffers_are_averaged_over_the_learners_of_each_update():
    torch.manual_seed(0)
    run = InProcessRun(um.BatchNormCNN(lr=0.05), blob_batches(image=True), "sync", p=2, max_updates=3).fit()
    for recorded in run.updates:
        update = recorded.update
        pushed = torch.stack([run.pushed(g.id).buffers for g in update.gradients])
        buffers = run.buffers(update.version)
        numel = [b.numel() for b in run.server_vectors.buffers]
        floats = [b.is_floating_point() for b in run.server_vectors.buffers]
        start = 0
        for n, is_float in zip(numel, floats):
            part = slice(start, start + n)
            expected = pushed[:, part].mean(0) if is_float else pushed[:, part].max(0).values.round()
            assert isclose(buffers[part], expected)
            start += n
        # the learners' running statistics differ (their own mini-batches): the mean is not either
        assert not torch.equal(pushed[0], pushed[1])
    # every learner goes on from the averaged buffers: its next push starts from them
    assert run.stats["updates"] == 3
