"""Local updates on the real engine's central path (docs/how-to/local-updates.md): P = 2 and 3
real learners and the real server in one process (tests/inprocess.py), each learner taking H
steps of its own inner optimizer per push. Every update is recomputed by hand from the server's
parameters of the versions the rounds started from, the learners' mini-batches, the inner
optimizer (its state kept per learner from one pushed round to the next) and the outer one."""

import copy
import time

import pytest
import torch
from pytorch_lightning.loggers import Logger

import user_modules as um
from inprocess import InProcessRun, blob_batches, isclose, optimizer_and_schedulers
from lightning_stale import StaleStrategy
from lightning_stale.engine.state import ModelVectors

NESTEROV = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}


class MomentumClassifier(um.Classifier):
    """An inner optimizer with state of its own (momentum), kept per learner between rounds."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.8)


class AdamWClassifier(um.Classifier):
    """DiLoCo's inner optimizer: AdamW, its moments and step count kept per learner."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def books_balance(stats):
    return stats["gradients_received"] == (stats["gradients_applied"] + stats["gradients_dropped"]
                                           + stats["gradients_pending"] + stats["gradients_in_flight_at_stop"])


def expected_pushes(run: InProcessRun, h: int, buffers: bool = False, lr_of=None,
                    losses: dict | None = None) -> dict[int, torch.Tensor]:
    """By hand, every usable push's pseudo-gradient: the learner's H inner steps (its module's
    own optimizer, torch's, whose state each learner carries from its previous push) on its
    mini-batches ``batch - H + 1 .. batch`` from the server's parameters and buffers of the
    push's version, minus where they end (with ``buffers``: the buffers where they end).
    ``lr_of(push, n, j)``: the learning rate of the push's inner step j (from 0), n being the
    learner's pushes before it (None: the optimizer's own, unscheduled). ``losses``, if given,
    gets each push's loss: the mean of its H inner steps' mini-batch losses."""
    expected = {}
    for learner in range(run.p):
        module = copy.deepcopy(run.module)
        vectors = ModelVectors.of(module)
        optimizer, _ = optimizer_and_schedulers(module)  # (its schedule: ``lr_of``)
        mine = sorted((p for p in run.pushes if p.learner == learner), key=lambda p: p.id)
        for n, push in enumerate(mine):
            start = run.versions[push.version]
            vectors.load_state(start)
            inner = []
            for j, batch in enumerate(range(push.batch - h + 1, push.batch + 1)):
                if lr_of is not None:
                    for group in optimizer.param_groups:
                        group["lr"] = lr_of(push, n, j)
                optimizer.zero_grad()
                loss = run.loss(module, run.batches(learner, batch))
                loss.backward()
                optimizer.step()
                inner.append(float(loss.detach()))
            if losses is not None:
                losses[push.id] = sum(inner) / len(inner)
            end = vectors.state_vector()
            expected[push.id] = end[vectors.numel:] if buffers else start[:vectors.numel] - end[:vectors.numel]
    return expected


def check_outer_rule(run: InProcessRun, h: int, lr: float = 1.0, momentum: float = 0.0,
                     nesterov: bool = False, inner_lr=None) -> None:
    """Every update is w_{j+1} = w_j - lr * d_j for the mean Delta_j of its K pseudo-gradients
    (each weighted by the update's staleness compensation, if any), with d_j = Delta_j (plain averaging: lr 1) or SGD's Nesterov step: b_j = mu b_{j-1} + Delta_j
    (b_1 = Delta_1), d_j = Delta_j + mu b_j (torch.optim.SGD; DiLoCo, Douillard et al. 2023).
    ``inner_lr``: `expected_pushes`' ``lr_of`` (a scheduled inner optimizer)."""
    assert [u.update.index for u in run.updates] == list(range(1, len(run.updates) + 1))
    pushes = expected_pushes(run, h, lr_of=inner_lr)
    momentum_buffer = None
    for recorded in run.updates:
        update = recorded.update
        mean = torch.zeros_like(run.parameters(0))
        weights = recorded.weights or [1.0] * len(update.gradients)
        by_learner = sorted(update.gradients, key=lambda g: g.learner)  # weights are in learner order
        for push, weight in zip(by_learner, weights):
            assert run.pushes[push.id].version == push.version
            pushed = run.pushed(push.id).gradient
            assert isclose(pushed, pushes[push.id]), f"push {push.id}"
            mean += weight * pushed / len(update.gradients)
        step = mean
        if momentum:
            momentum_buffer = mean.clone() if momentum_buffer is None else momentum * momentum_buffer + mean
            step = mean + momentum * momentum_buffer if nesterov else momentum_buffer
        expected = run.parameters(update.version - 1) - lr * step
        assert isclose(run.parameters(update.version), expected), f"update {update.index}"


def test_fully_sync_with_local_steps_averages_the_learners_rounds():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "sync", p=3, max_updates=4,
                       local_steps=3).fit()
    assert run.stats["updates"] == 4
    assert all(sorted(g.learner for g in u.update.gradients) == [0, 1, 2] for u in run.updates)
    # every round starts from the server's latest version and takes three mini-batches
    assert all(starts[:4] == [(0, 0), (3, 1), (6, 2), (9, 3)] for starts in run.round_starts.values())
    assert all(p.batch % 3 == 2 for p in run.pushes)
    check_outer_rule(run, h=3)
    # plain averaging: the new parameters are the mean of where the learners' rounds ended
    assert books_balance(run.stats) and run.stats["pushes_per_learner"] == [4, 4, 4]


def test_diloco_adamw_inner_steps_and_a_nesterov_outer_step_over_several_rounds():
    torch.manual_seed(0)
    run = InProcessRun(AdamWClassifier(), blob_batches(), "sync", p=2, max_updates=5, local_steps=4,
                       outer_optimizer=NESTEROV).fit()
    assert run.stats["updates"] == 5 and run.stats["pushes_per_learner"] == [5, 5]
    check_outer_rule(run, h=4, lr=0.7, momentum=0.9, nesterov=True)  # AdamW's state chained per learner
    steps = [int(s["step"]) for opt in run.inner_optimizers for s in opt.state.values()]
    assert steps and all(step >= 16 for step in steps)  # its step count went on across rounds


def test_batchnorm_buffers_go_with_the_rounds_and_are_averaged():
    torch.manual_seed(0)
    run = InProcessRun(um.BatchNormCNN(lr=0.05), blob_batches(image=True), "sync", p=2, max_updates=3,
                       local_steps=3).fit()
    check_outer_rule(run, h=3)  # each round starts from the server's buffers of its version
    ended = expected_pushes(run, h=3, buffers=True)
    floats = [b.is_floating_point() for b in run.server_vectors.buffers]
    sizes = [b.numel() for b in run.server_vectors.buffers]
    for recorded in run.updates:
        update = recorded.update
        pushed = torch.stack([run.pushed(g.id).buffers for g in update.gradients])
        assert all(isclose(run.pushed(g.id).buffers, ended[g.id]) for g in update.gradients)
        server, start = run.buffers(update.version), 0
        for size, is_float in zip(sizes, floats):
            part = slice(start, start + size)
            expected = pushed[:, part].mean(0) if is_float else pushed[:, part].max(0).values
            assert isclose(server[part], expected)
            start += size
    counters = [i for i, f in enumerate(floats) if not f]  # num_batches_tracked: H per update
    assert counters and all(int(run.buffers(3)[sum(sizes[:i])]) == 9 for i in counters)


def test_k_sync_cancels_the_stragglers_round_and_applies_a_nesterov_outer_step():
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), "k_sync", p=3, k=2,
                       delays={0: 0.0, 1: 0.0, 2: 60.0}, max_updates=4, local_steps=2,
                       outer_optimizer=NESTEROV).fit()
    assert len(run.updates) == 4 and all(u.update.staleness == (0, 0) for u in run.updates)
    # the straggler's rounds were abandoned when the update it missed arrived
    assert run.learners[2].cancelled >= 1 and run.stats["cancellations"] >= 1
    check_outer_rule(run, h=2, lr=0.7, momentum=0.9, nesterov=True)
    outer = run.core.state.optimizer
    assert isinstance(outer, torch.optim.SGD) and outer.param_groups[0]["nesterov"]
    assert all("momentum_buffer" in s for s in outer.state.values())
    assert books_balance(run.stats)


def test_a_round_abandoned_between_inner_steps_leaves_the_inner_state_as_it_was():
    """Learner 2 computes slowly in its first round: the update of the two others arrives between
    its inner steps, so it abandons the round, and its later pushes start from the momentum of
    its last pushed round (none), not from the abandoned steps' (`expected_pushes` chains it)."""
    torch.manual_seed(0)
    blobs = blob_batches()

    def batches(rank, i):
        if rank == 2 and i == 0:
            time.sleep(0.2)  # a compute straggler: learners 0 and 1 finish their rounds meanwhile
        return blobs(rank, i)

    run = InProcessRun(MomentumClassifier(lr=0.05), batches, "k_sync", p=3, k=2, max_updates=12,
                       delays={0: 0.01, 1: 0.01}, local_steps=3, outer_optimizer=NESTEROV).fit()
    first, second = run.round_starts[2][:2]
    assert first == (0, 0) and second[0] == 1 and second[1] >= 1  # restarted after one inner step
    assert run.learners[2].cancelled >= 1
    assert any(p.learner == 2 for p in run.pushes)  # and pushed later rounds
    check_outer_rule(run, h=3, lr=0.7, momentum=0.9, nesterov=True)
    assert books_balance(run.stats)


def test_async_local_rounds_are_applied_stale_and_the_books_balance():
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), "async", p=2,
                       delays={0: 0.005, 1: 0.05}, max_updates=16, local_steps=2).fit()
    for u in run.updates:  # staleness j - tau(l, j): updates applied since the round's version
        assert u.update.staleness == tuple(u.update.index - 1 - g.version for g in u.update.gradients)
    slow = [u for u in run.updates if u.update.gradients[0].learner == 1]
    assert slow and max(u.update.staleness[0] for u in slow) >= 2  # the fast learner went on
    check_outer_rule(run, h=2)  # a stale round is the one from w_tau, applied at w_j
    stats = run.stats
    assert books_balance(stats)
    assert sum(stats["pushes_per_learner"]) == len(run.pushes) == stats["gradients_received"]


def test_k_async_waits_for_k_rounds_of_different_learners_and_lets_the_rest_go_on():
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), "k_async", p=3, k=2,
                       delays={0: 0.003, 1: 0.006, 2: 0.04}, max_updates=12, local_steps=2).fit()
    assert all(len({g.learner for g in u.update.gradients}) == 2 for u in run.updates)
    assert any(max(u.update.staleness) >= 1 for u in run.updates)  # the slow learner's round, late
    check_outer_rule(run, h=2)
    assert books_balance(run.stats)


def test_k_batch_async_weighs_stale_rounds_by_inverse_staleness():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "k_batch_async", p=3, k=2,
                       delays={0: 0.003, 1: 0.003, 2: 0.03}, max_updates=20, local_steps=2,
                       compensation="inverse").fit()
    stale = [u for u in run.updates if max(u.update.staleness) > 1]
    assert stale and all(u.weights is not None for u in stale)
    assert any(min(u.weights) < 1.0 for u in stale)  # 1 / max(1, s): a stale round counts less
    check_outer_rule(run, h=2)
    assert books_balance(run.stats)


def test_k_batch_sync_pushers_start_each_round_from_the_version_they_hold():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "k_batch_sync", p=3, k=3,
                       delays={0: 0.0, 1: 0.0, 2: 0.05}, max_updates=4, local_steps=2).fit()
    # a pusher goes on without an answer: its next round restarts from the version it holds
    assert any(p.version == q.version for p in run.pushes for q in run.pushes
               if p.learner == q.learner and p.id < q.id)
    check_outer_rule(run, h=2)
    assert books_balance(run.stats)


# ------------------------------------------------------------------ the inner optimizer's LR schedules
WARMUP = 10  # inner steps of the warm-up


class WarmupAdamWClassifier(um.Classifier):
    """DiLoCo's inner AdamW with a linear warm-up, as users write it (a step-interval LambdaLR)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def warmup_lr(step: int) -> float:
    return 0.01 * min(1.0, (step + 1) / WARMUP)


class StepDecayClassifier(MomentumClassifier):
    """SGD with momentum whose learning rate halves every 3 inner steps (a step-interval StepLR)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def step_decay_lr(step: int) -> float:
    return 0.05 * 0.5 ** (step // 3)


def check_schedule(run: InProcessRun, h: int, schedule, **outer) -> None:
    """The simulated engine's meaning (docs/how-to/local-updates.md): the schedule advances H
    inner steps at every server update, and a round from version v runs all its H inner steps at
    the schedule's value of inner step v x H. Checked on every inner step each learner took
    (abandoned rounds' too), on every update (the pushes recomputed by hand at those rates), and
    against what it must not be: each alternative's pushes differ from what was pushed."""
    for rank, steps in run.inner_lrs.items():
        assert steps, f"learner {rank} took no inner step"
        for version, lrs in steps:
            assert lrs == pytest.approx([schedule(version * h)] * len(lrs)), f"learner {rank}, version {version}"
    assert len({lrs[0] for steps in run.inner_lrs.values() for _, lrs in steps}) > 2  # the rate moved
    check_outer_rule(run, h, inner_lr=lambda push, n, j: schedule(push.version * h), **outer)
    wrong = {
        "ignored": lambda push, n, j: schedule(0),
        "stepped once per update": lambda push, n, j: schedule(push.version),
        "stepped by the learner's own inner steps": lambda push, n, j: schedule(n * h + j),
        "stepped within the round": lambda push, n, j: schedule(push.version * h + j),
    }
    usable = [p for p in run.pushes if p.payload is not None]
    for name, lr_of in wrong.items():
        expected = expected_pushes(run, h, lr_of=lr_of)
        assert any(not isclose(run.pushed(p.id).gradient, expected[p.id]) for p in usable), name
    # at the stop every learner's schedule stands where the final parameters come from
    for configs in run.inner_schedulers:
        assert configs[0].scheduler.last_epoch == run.stats["updates"] * h


def test_k_sync_inner_adamw_warmup_follows_the_servers_trajectory():
    torch.manual_seed(0)
    run = InProcessRun(WarmupAdamWClassifier(), blob_batches(), "k_sync", p=3, k=2,
                       delays={0: 0.0, 1: 0.0, 2: 60.0}, max_updates=6, local_steps=2,
                       outer_optimizer=NESTEROV).fit()
    assert len(run.updates) == 6 and run.learners[2].cancelled >= 1  # the straggler's rounds abandoned
    check_schedule(run, 2, warmup_lr, lr=0.7, momentum=0.9, nesterov=True)
    assert books_balance(run.stats)


def test_async_inner_step_decay_runs_at_the_version_each_round_started_from():
    """Under the async family a round runs at the value of the version it pulled, however stale
    its push then is (the simulated engine, which computes a round at its push, takes the value
    of the server's count then: s x H steps later for a push of staleness s)."""
    torch.manual_seed(0)
    run = InProcessRun(StepDecayClassifier(lr=0.05), blob_batches(), "async", p=2,
                       delays={0: 0.005, 1: 0.05}, max_updates=12, local_steps=2).fit()
    assert max(max(u.update.staleness) for u in run.updates) >= 2  # the fast learner went on
    check_schedule(run, 2, step_decay_lr)
    assert books_balance(run.stats)


def test_fully_sync_step_decay_holds_each_rounds_rate_for_all_its_inner_steps():
    torch.manual_seed(0)
    run = InProcessRun(StepDecayClassifier(lr=0.05), blob_batches(), "sync", p=3, max_updates=5,
                       local_steps=2).fit()
    assert all(starts[:5] == [(0, 0), (2, 1), (4, 2), (6, 3), (8, 4)] for starts in run.round_starts.values())
    check_schedule(run, 2, step_decay_lr)  # (the rate halves within some rounds' span of steps: not there)


# ------------------------------------------------------------------ the strategy's options
def test_local_steps_are_checked_and_the_paths_without_them_refused():
    with pytest.raises(ValueError, match=r"local_steps must be an integer >= 1.*got 0"):
        StaleStrategy("sync", local_steps=0)
    with pytest.raises(ValueError, match=r"local_steps must be an integer >= 1.*got 2.5"):
        StaleStrategy("sync", local_steps=2.5)
    with pytest.raises(ValueError, match=r"server='sharded'.*local_steps=4.*server='central'"):
        StaleStrategy("sync", local_steps=4, server="sharded")  # (collective: test_local_updates_collective.py)
    with pytest.raises(ValueError, match=r"adaptive_h=8 with server='collective': AdaComm.s adaptive H runs on"):
        StaleStrategy("sync", local_steps=4, adaptive_h=8, server="collective")
    with pytest.raises(ValueError, match=r"record_events.*local updates"):
        StaleStrategy("sync", local_steps=4, record_events=True)
    with pytest.raises(ValueError, match=r"payload_channels=True.*local updates.*payload_channels=False"):
        StaleStrategy("sync", local_steps=4, payload_channels=True)
    # (adaptive_k, the "norm" compensation and on_learner_failure="continue" run with them:
    # test_local_updates_real_options.py)
    with pytest.raises(ValueError, match=r"outer_optimizer class_path 'torch.optim.Nope'"):
        StaleStrategy("sync", local_steps=4, outer_optimizer="torch.optim.Nope")
    chosen = StaleStrategy("k_sync", 2, local_steps=4, outer_optimizer=NESTEROV)
    assert (chosen.local_steps, chosen.server, chosen.local_updates) == (4, "central", True)
    assert StaleStrategy("sync").local_updates is False


# ------------------------------------------------------------------ through Lightning's loops
class OneSampleData(um.BlobData):
    """Every training sample the same: the engines' different samplers draw the same batches."""

    def setup(self, stage=None):
        super().setup(stage)
        x, y = self.train_set.tensors
        self.train_set = torch.utils.data.TensorDataset(x[:1].repeat(len(x), 1), y[:1].repeat(len(y)))


class WarmupDecayClassifier(MomentumClassifier):
    """As users write it: a linear warm-up over the first half of the run, sized from
    ``estimated_stepping_batches`` (LinearLR, every step), and a decay at every epoch's end."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        warmup_steps = max(1, self.trainer.estimated_stepping_batches // 2)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup_steps)
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return [optimizer], [{"scheduler": warmup, "interval": "step"}, {"scheduler": decay, "interval": "epoch"}]


class RecordingLogger(Logger):
    """What ``LearningRateMonitor`` logs, kept in memory."""

    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int | None, dict]] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _lightning_fit(strategy, tmp_path, ckpt_path=None, module=MomentumClassifier, n=32, data=None, **trainer_kwargs):
    import pytorch_lightning as pl

    from engines import QUIET

    pl.seed_everything(3, verbose=False)
    model = module(lr=0.05)
    options = {**QUIET, "default_root_dir": str(tmp_path), "max_steps": 7, "max_epochs": 10, **trainer_kwargs}
    trainer = pl.Trainer(strategy=strategy, **options)
    try:
        trainer.fit(model, datamodule=(data or OneSampleData)(batch_size=8, n=n), ckpt_path=ckpt_path)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


@pytest.mark.parametrize("module,server", [(MomentumClassifier, "central"), (WarmupDecayClassifier, "central"),
                                           (WarmupDecayClassifier, "collective")])
def test_the_real_engine_ends_where_the_simulated_one_does_counting_inner_steps(one_process, tmp_path, module,
                                                                                  server):
    from pytorch_lightning.callbacks import LearningRateMonitor

    from lightning_stale import SimulatedStaleStrategy
    from lightning_stale.delays import ShiftedExponential, Trace

    # (scheduled: epochs of 6 batches, 2 pushes, which both engines end after the same update)
    n = 32 if module is MomentumClassifier else 48

    def fit(strategy, folder):
        logger = RecordingLogger()
        trainer = _lightning_fit(strategy, tmp_path / folder, module=module, n=n, logger=logger, log_every_n_steps=1,
                                 callbacks=[LearningRateMonitor(logging_interval="step")])
        return trainer, [(step, m["lr-SGD"]) for step, m in logger.logged if "lr-SGD" in m]

    real, real_lrs = fit(StaleStrategy("sync", local_steps=3, outer_optimizer=NESTEROV, server=server,
                                       delay=ShiftedExponential(shift=0.001, mean=0.001, seed=2),
                                       record_trace=str(tmp_path / "delays.csv")), "real")
    simulated, simulated_lrs = fit(SimulatedStaleStrategy("sync", num_learners=1, local_steps=3,
                                                          outer_optimizer=NESTEROV), "simulated")
    if module is WarmupDecayClassifier:
        # the schedules read by Lightning: the warm-up stepped H times per update, the decay once
        # at the epoch's end, and the learning rate of every inner step as the monitor logged it
        for trainer in (real, simulated):
            warmup, decay = (c.scheduler for c in trainer.lr_scheduler_configs)
            assert (warmup.last_epoch, decay.last_epoch) == (9, 1) and trainer.strategy.stats["epochs"] == 1
        assert len(real_lrs) == 9 and len({lr for _, lr in real_lrs}) >= 3
        assert [lr for _, lr in real_lrs] == pytest.approx([lr for _, lr in simulated_lrs])
    # max_steps=7 counts inner steps, 3 per update: both stop after ceil(7 / 3) = 3 updates
    assert real.strategy.stats["updates"] == simulated.strategy.stats["updates"] == 3
    assert real.global_step == simulated.global_step == 9
    # an epoch is one pass worth of inner steps, 4 (6) batches: 2 pushes of one learner
    assert real.strategy.stats["epochs"] == 1
    assert real.strategy.stats["pushes_per_learner"] == [3]
    # the trace holds every mini-batch's draw: H per push
    assert Trace(tmp_path / "delays.csv").num_recorded(0) == 9
    for a, b in zip(real.lightning_module.parameters(), simulated.lightning_module.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    moved = [p for p in real.lightning_module.parameters()]
    start = MomentumClassifier(lr=0.05)
    assert any(not torch.equal(a, b) for a, b in zip(moved, start.parameters()))


class StepPlateau(um.Plateau):
    """ReduceLROnPlateau stepped at every optimizer step, on the training loss."""

    def configure_optimizers(self):
        configured = super().configure_optimizers()
        configured["lr_scheduler"].update(interval="step", monitor="train/loss")
        return configured


def test_step_plateau_schedulers_and_resuming_are_refused_with_local_updates(one_process, tmp_path):
    import pytorch_lightning as pl

    # stepped per update, each learner would step a ReduceLROnPlateau on its own logged metrics:
    # refused at setup (at every epoch's end it runs: test_local_updates_plateau.py)
    trainer = pl.Trainer(strategy=StaleStrategy("sync", local_steps=2, record_trace=False),
                         max_steps=4, **{**_quiet(), "default_root_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"local_steps=2 cannot run ReduceLROnPlateau with interval='step'.*"
                                         r"metrics it logged itself.*interval='epoch'.*LambdaLR, StepLR.*"
                                         r"SimulatedStaleStrategy"):
        trainer.fit(StepPlateau(), datamodule=OneSampleData(batch_size=8, n=64))
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    saved = _lightning_fit(StaleStrategy("sync", local_steps=2, record_trace=False), tmp_path / "first",
                           enable_checkpointing=True, max_steps=4)
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))
    state = torch.load(checkpoint, weights_only=False)
    assert "momentum_buffer" in next(iter(state["optimizer_states"][0]["state"].values()))  # the inner one's
    assert saved.strategy.stats["updates"] == 2
    with pytest.raises(ValueError, match=r"resuming a fit \(ckpt_path=.*local_steps=2 is not supported"):
        _lightning_fit(StaleStrategy("sync", local_steps=2, record_trace=False), tmp_path / "second",
                       ckpt_path=str(checkpoint), max_steps=8)


def _quiet():
    from engines import QUIET

    return dict(QUIET)
