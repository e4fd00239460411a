"""AdaComm's adaptive H (Wang and Joshi, SysML 2019) on the real engine's central path
(docs/how-to/local-updates.md, "Adaptive H"): the server owns the schedule, shrinking H from its
updates' losses, and its answers tell each learner the H of its next round. Real learners and
the real server in one process (tests/inprocess.py): the H of every round is checked against the
schedule recomputed by hand from the update losses, every push and update recomputed by hand, and
a one-process Lightning fit ends where `SimulatedStaleStrategy` with the same schedule ends."""

import copy
import math

import pytest
import torch

from inprocess import InProcessRun, blob_batches, isclose, optimizer_and_schedulers
from lightning_stale.engine.state import ModelVectors
from test_local_updates_real import (MomentumClassifier, OneSampleData, RecordingLogger, WarmupDecayClassifier,
                                     books_balance)

H0, WINDOW = 6, 2
# T0 far below the time between two updates: every update starts an interval of its own, so H
# is decided at every update (wall-clock seconds here, virtual ones on the simulated engine)
EVERY_UPDATE = {"interval_s": 1e-9, "window": WINDOW}


def hand_schedule(losses: list[float], h0: int = H0, window: int = WINDOW) -> list[int]:
    """H in force after each update (index j: after update j; index 0: H_0), by AdaComm's rule
    H = ceil(sqrt(F / F_0) H_0), at least 1 and never growing, with F_0 the first update's loss
    (its interval ended at once) and F the mean of the last ``window`` update losses."""
    schedule = [h0]
    for j in range(1, len(losses) + 1):
        recent = losses[max(0, j - window):j]
        current = sum(recent) / len(recent)
        target = max(1, math.ceil(math.sqrt(current / losses[0]) * h0 - 1e-9))
        schedule.append(min(schedule[-1], target))
    return schedule


def hand_rounds(run: InProcessRun, h_of_version: list[int]) -> tuple[dict, dict]:
    """By hand, every push's pseudo-gradient and loss: its learner's H inner steps (H the one in
    force at the version the round started from), the learner's momentum carried from its
    previous round, on its mini-batches ``batch - H + 1 .. batch``, from the server's parameters
    of that version."""
    pseudo, losses = {}, {}
    for learner in range(run.p):
        module = copy.deepcopy(run.module)
        vectors = ModelVectors.of(module)
        optimizer, _ = optimizer_and_schedulers(module)
        for push in sorted((p for p in run.pushes if p.learner == learner), key=lambda p: p.id):
            h = h_of_version[push.version]
            start = run.versions[push.version]
            vectors.load_state(start)
            inner = []
            for batch in range(push.batch - h + 1, push.batch + 1):
                optimizer.zero_grad()
                loss = run.loss(module, run.batches(learner, batch))
                loss.backward()
                optimizer.step()
                inner.append(float(loss.detach()))
            losses[push.id] = sum(inner) / len(inner)
            pseudo[push.id] = start[:vectors.numel] - vectors.state_vector()[:vectors.numel]
    return pseudo, losses


@pytest.mark.parametrize("variant,p,k,delays", [("sync", 2, None, {}), ("async", 2, None, {0: 0.0, 1: 0.004}),
                                                ("k_sync", 3, 2, {0: 0.0, 1: 0.0, 2: 0.01})])
def test_every_round_takes_the_h_the_server_decided_from_the_update_losses(variant, p, k, delays):
    run = InProcessRun(MomentumClassifier(lr=0.3), blob_batches(), variant, p=p, k=k, delays=delays,
                       max_updates=12, local_steps=H0, adaptive_h=EVERY_UPDATE).fit()
    records = run.core.pop_records()
    assert [r.update for r in records] == list(range(1, 13)) and books_balance(run.stats)
    if variant == "k_sync":  # the straggler's rounds are abandoned when the others' update arrives
        assert run.stats["computations_cancelled"] > 0
    schedule = hand_schedule([r.loss for r in records])
    assert len(set(schedule)) >= 3, f"the loss fell too little for H to shrink twice: {schedule}"
    # The H of every round: the one in force after the update that made the version it started
    # from (a new H goes with that update's answers; a round in progress keeps its own)
    assert [push.local_steps for push in run.pushes] == [schedule[push.version] for push in run.pushes]
    assert run.stats["h_history"][0] == (0.0, H0)
    assert [h for _, h in run.stats["h_history"]] == sorted(set(schedule), reverse=True)
    # every push's pseudo-gradient and loss, every update's loss and outer step, by hand
    pseudo, push_losses = hand_rounds(run, schedule)
    for push in run.pushes:
        assert isclose(run.pushed(push.id).gradient, pseudo[push.id]), push
        assert push.loss == pytest.approx(push_losses[push.id], rel=1e-5)
    steps = 0
    for record, recorded in zip(records, run.updates):
        update = recorded.update
        ids = [g.id for g in update.gradients]
        assert record.loss == pytest.approx(sum(push_losses[i] for i in ids) / len(ids), rel=1e-5)
        mean = torch.stack([pseudo[i] for i in ids]).mean(0)  # plain averaging: lr 1, no momentum
        assert isclose(run.parameters(update.version), run.parameters(update.version - 1) - mean)
        steps += run.pushes[max(ids)].local_steps  # the H of the push that completed the update
    # global_step: the sum of the H of the applied updates, as the server counts it and tells the
    # learners with their final parameters, not H_0 x updates
    assert run.core.inner_steps == steps != H0 * len(records)
    assert [rounds.inner_steps for rounds in run.rounds] == [steps] * p


def _fit(strategy, tmp_path, module, max_steps):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import LearningRateMonitor

    from engines import QUIET

    pl.seed_everything(3, verbose=False)
    logger = RecordingLogger()
    trainer = pl.Trainer(strategy=strategy, **{**QUIET, "default_root_dir": str(tmp_path), "max_steps": max_steps,
                                                "max_epochs": 1, "logger": logger, "log_every_n_steps": 1,
                                                "callbacks": [LearningRateMonitor(logging_interval="step")]})
    try:
        trainer.fit(module(lr=0.3), datamodule=OneSampleData(batch_size=8, n=8 * 64))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer, [m["lr-SGD"] for _, m in logger.logged if "lr-SGD" in m]


@pytest.mark.parametrize("module", [MomentumClassifier, WarmupDecayClassifier])
def test_the_real_engine_ends_where_the_simulated_one_does_with_adaptive_h(one_process, tmp_path, module):
    from lightning_stale import SimulatedStaleStrategy, StaleStrategy
    from lightning_stale.delays import ShiftedExponential

    max_steps = 40
    # (a delay on both: the virtual clock must move for an interval to end)
    delay = ShiftedExponential(shift=0.001, mean=0.001, seed=2)
    real, real_lrs = _fit(StaleStrategy("sync", local_steps=H0, adaptive_h=EVERY_UPDATE, record_trace=False,
                                        delay=delay), tmp_path / "real", module, max_steps)
    simulated, simulated_lrs = _fit(SimulatedStaleStrategy("sync", num_learners=1, local_steps=H0, delay=delay,
                                                           adaptive_h=EVERY_UPDATE), tmp_path / "simulated",
                                    module, max_steps)
    real_h = [h for _, h in real.strategy.stats["h_history"]]
    assert real_h == [h for _, h in simulated.strategy.stats["h_history"]] and len(real_h) >= 3
    updates = real.strategy.stats["updates"]
    assert updates == simulated.strategy.stats["updates"] and updates > max_steps // H0
    # both stop at the first update whose H make max_steps inner steps; global_step is their sum
    assert real.global_step == simulated.global_step >= max_steps
    assert real.global_step - real_h[-1] < max_steps
    assert len(real_lrs) == len(simulated_lrs) == real.global_step
    assert real_lrs == pytest.approx(simulated_lrs)
    if module is WarmupDecayClassifier:
        for trainer in (real, simulated):
            warmup, _ = (c.scheduler for c in trainer.lr_scheduler_configs)
            assert warmup.last_epoch == trainer.global_step
    for a, b in zip(real.lightning_module.parameters(), simulated.lightning_module.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
