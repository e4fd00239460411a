"""Local updates on the real engine with AdaSync's growing K, the "norm" staleness compensation
and learners dying under ``on_learner_failure="continue"`` (docs/how-to/local-updates.md, "On
the real engine"): real learners and the real server in one process (tests/inprocess.py). Every
push and update is recomputed by hand (`check_outer_rule`), and so are what each option adds:
the K of every update from the rounds' losses, the compensation's weights from the server's
parameters, and which rounds of a dead learner count."""

import math

import pytest
import torch
from inprocess import InProcessRun, blob_batches
from test_local_updates_real import NESTEROV, MomentumClassifier, books_balance, check_outer_rule, expected_pushes

from lightning_stale import StaleStrategy

NESTEROV_RULE = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


# ------------------------------------------------------------------ AdaSync's K (adaptive_k)
def adasync_ks(losses: list[float], k0: int, p: int) -> list[int]:
    """By hand, AdaSync's K after each update (docs/method.md, "Gradually increasing synchrony";
    Dutta et al., arXiv 2003.10579) with a window of one update and an interval shorter than any
    gap between two updates: F(w_0) is the first update's loss, and after update j
    K = max(K, min(P, ceil(K_0 sqrt(F(w_0) / F_j))))."""
    ks, k = [], k0
    for loss in losses:
        k = max(k, min(p, math.ceil(k0 * math.sqrt(losses[0] / loss) - 1e-9)))
        ks.append(k)
    return ks


@pytest.mark.parametrize("path", ["central", "collective"])
def test_adaptive_k_grows_k_from_the_rounds_losses_and_each_update_waits_for_it(path):
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.2), blob_batches(), "k_sync", p=3, k=1, max_updates=12,
                       local_steps=2, outer_optimizer=NESTEROV, path=path,
                       adaptive_k={"interval_s": 1e-9, "window": 1}).fit()
    # each push's loss is its round's: the mean of its H inner steps' losses, recomputed by hand
    round_losses: dict[int, float] = {}
    expected_pushes(run, 2, losses=round_losses)
    usable = [p for p in run.pushes if p.payload is not None]
    assert usable and all(p.loss == pytest.approx(round_losses[p.id], rel=1e-5) for p in usable)
    # an update's loss is the mean of its rounds' losses; K follows AdaSync's rule from them
    update_losses = [math.fsum(run.pushes[g.id].loss for g in u.update.gradients) / len(u.update.gradients)
                     for u in run.updates]
    ks = adasync_ks(update_losses, k0=1, p=3)
    assert [u.k_after for u in run.updates] == ks
    assert ks[-1] > 1, "K must grow as the rounds' losses fall"
    # every update takes as many rounds as the K in force when it was decided
    assert [len(u.update.gradients) for u in run.updates] == [1] + ks[:-1]
    assert [k for _, k in run.stats["k_history"]] == sorted(set([1] + ks))
    assert run.stats["k"] == ks[-1]
    check_outer_rule(run, h=2, **NESTEROV_RULE)
    assert books_balance(run.stats)


# ------------------------------------------------------------------ the "norm" compensation
C = 0.05


def norm_weights(run: InProcessRun, update, outer_lr: float, eta_max: float | None = None) -> list[float]:
    """By hand, the weights of the "norm" rule (Dutta, Wang, Joshi, arXiv 2003.10579): each round
    of version tau applied at w_j gets min(C / ||w_j - w_tau||^2, eta_max) / eta, eta the outer
    optimizer's learning rate (eta_max: eta unless given), in the learners' order."""
    eta_max = outer_lr if eta_max is None else eta_max
    current = run.parameters(update.version - 1)
    weights = []
    for push in sorted(update.gradients, key=lambda g: g.learner):
        distance_sq = float(((current - run.parameters(push.version)) ** 2).sum())
        weights.append((eta_max if distance_sq == 0 else min(C / distance_sq, eta_max)) / outer_lr)
    return weights


@pytest.mark.parametrize("outer,rule,eta_max", [(NESTEROV, NESTEROV_RULE, None), (None, {}, 2.0)])
def test_norm_compensation_weighs_each_round_by_how_far_the_server_moved_since_its_version(outer, rule, eta_max):
    torch.manual_seed(0)
    compensation = {"mode": "norm", "c": C} if eta_max is None else {"mode": "norm", "c": C, "eta_max": eta_max}
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), "k_batch_async", p=3, k=2,
                       delays={0: 0.003, 1: 0.003, 2: 0.03}, max_updates=20, local_steps=2,
                       outer_optimizer=outer, compensation=compensation).fit()
    outer_lr = rule.get("lr", 1.0)
    weights = [list(u.weights) for u in run.updates]
    assert weights == [pytest.approx(norm_weights(run, u.update, outer_lr, eta_max), rel=1e-5) for u in run.updates]
    top = (outer_lr if eta_max is None else eta_max) / outer_lr  # a fresh round's: eta_max / eta
    by_staleness = [(s, w) for u, ws in zip(run.updates, weights)
                    for (_, s), w in zip(sorted(zip(u.update.gradients, u.update.staleness),
                                                key=lambda pair: pair[0].learner), ws)]
    assert any(s == 0 for s, _ in by_staleness) and all(w == pytest.approx(top) for s, w in by_staleness if s == 0)
    assert any(w < top for s, w in by_staleness if s > 0), "a stale round must count less here"
    check_outer_rule(run, h=2, **rule)  # the weighted pseudo-gradients, through the outer step
    assert books_balance(run.stats)


# ------------------------------------------------------------------ dead learners ("continue")
@pytest.mark.parametrize("variant,k,delays", [("k_sync", 2, {1: 0.01}), ("k_async", 1, {0: 0.002, 1: 0.004, 2: 0.002})])
def test_a_learner_dying_mid_round_loses_that_round_and_the_others_go_on(variant, k, delays):
    h, dies = 3, 7  # learner 2 dies before its 8th mini-batch: one inner step into its third round
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), variant, p=3, k=k, delays=delays,
                       max_updates=14, local_steps=h, outer_optimizer=NESTEROV, on_learner_failure="continue",
                       die_at={2: dies}).fit()
    stats = run.stats
    assert stats["dead_learners"] == [2] and stats["updates"] == 14  # the others went on to the end
    assert run.learners[2].pushes <= dies // h
    mine = [p for p in run.pushes if p.learner == 2]
    # only its whole rounds were pushed: the round it died in is lost, not pushed nor counted
    assert mine and all(p.batch % h == h - 1 and p.batch < dies for p in mine)
    assert stats["pushes_per_learner"][2] == len(mine) == run.learners[2].pushes
    assert stats["gradients_received"] == len(run.pushes) == sum(stats["pushes_per_learner"])
    # after its last round applied, every update takes K rounds of the survivors (K clamped to 2)
    last = max(i for i, u in enumerate(run.updates) if any(g.learner == 2 for g in u.update.gradients))
    after = run.updates[last + 1:]
    assert after and all(len({g.learner for g in u.update.gradients} - {0, 1}) == 0
                         and len(u.update.gradients) == min(k, 2) for u in after)
    assert stats["k"] == min(k, 2)
    check_outer_rule(run, h=h, **NESTEROV_RULE)  # every update, before and after the death, by hand
    assert books_balance(stats)


# ------------------------------------------------------------------ the strategy's options
def test_the_options_run_with_local_updates_on_the_paths_that_run_them():
    adaptive = StaleStrategy("k_sync", local_steps=4, adaptive_k=2.0, outer_optimizer=NESTEROV)
    assert adaptive.local_updates and adaptive.adaptive_k == 2.0 and adaptive.server == "central"
    assert StaleStrategy("k_sync", local_steps=4, adaptive_k=2.0, server="collective").server == "collective"
    norm = StaleStrategy("k_async", local_steps=4, staleness_compensation={"mode": "norm", "c": 0.05})
    assert norm.staleness_compensation.mode == "norm" and norm.server == "central"
    surviving = StaleStrategy("k_sync", 1, local_steps=4, on_learner_failure="continue")
    assert surviving.on_learner_failure == "continue" and surviving.server == "central"
    # the collective path needs every learner and cannot see the parameters in one place
    with pytest.raises(ValueError, match=r"server='collective' needs every learner's process.*server='central'"):
        StaleStrategy("k_sync", 1, local_steps=4, on_learner_failure="continue", server="collective")
    with pytest.raises(ValueError, match=r"'norm' staleness compensation needs the server's parameters.*'central'"):
        StaleStrategy("k_sync", 1, local_steps=4, staleness_compensation={"mode": "norm", "c": 0.05},
                      server="collective")


# ------------------------------------------------------------------ through Lightning's loops
def test_through_lightning_the_norm_weights_reach_the_outer_step_as_on_the_simulated_engine(one_process, tmp_path):
    """One learner, so every round is fresh (distance 0) and the "norm" rule gives it
    eta_max / eta = 2: the real engine must end where the simulated one does with the same
    compensation, and elsewhere than without it."""
    from test_local_updates_real import _lightning_fit

    from lightning_stale import SimulatedStaleStrategy

    norm = {"mode": "norm", "c": 0.05, "eta_max": 1.4}  # the outer lr is 0.7: weight 2

    def fit(strategy, folder):
        trainer = _lightning_fit(strategy, tmp_path / folder)
        return [p.detach().clone() for p in trainer.lightning_module.parameters()], trainer.strategy.stats

    real, stats = fit(StaleStrategy("sync", local_steps=3, outer_optimizer=NESTEROV, record_trace=False,
                                    staleness_compensation=norm), "real")
    simulated, _ = fit(SimulatedStaleStrategy("sync", num_learners=1, local_steps=3, outer_optimizer=NESTEROV,
                                              staleness_compensation=norm), "simulated")
    plain, _ = fit(SimulatedStaleStrategy("sync", num_learners=1, local_steps=3, outer_optimizer=NESTEROV), "plain")
    assert stats["updates"] == 3
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(real, simulated))
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(real, plain))
