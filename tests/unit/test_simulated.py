"""SimulatedStaleStrategy: P learners and a parameter server on a virtual clock, in one process."""

import logging
import math
import pickle

import numpy as np
import pytest
import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.data import ConvexDataModule, DigitsDataModule
from lightning_stale.delays import Exponential, Trace
from lightning_stale.models import Classifier, LeastSquares
from lightning_stale.models.nets import MLP
from lightning_stale.method.rules import ServerRules
from lightning_stale.method.virtual_clock import VirtualCluster
from lightning_stale.strategies.simulated import SimulatedStaleStrategy
from lightning_stale.engine.simulated import SimulatedServer
from lightning_stale.method.variants import VARIANT_NAMES, Variant

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)

SYNC_FAMILY = ("sync", "k_sync", "k_batch_sync")
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0, devices=1)




def fit(model, max_steps, datamodule=None, callbacks=(), trainer_kwargs=None, **strategy_kwargs):
    strategy = SimulatedStaleStrategy(**strategy_kwargs)
    options = {**QUIET, **(trainer_kwargs or {})}
    trainer = Trainer(strategy=strategy, max_steps=max_steps, callbacks=list(callbacks), **options)
    trainer.fit(model, datamodule=datamodule)
    return trainer, strategy


def digits_classifier(seed=0):
    torch.manual_seed(seed)
    return Classifier(net=MLP((64,), 10, (32,)), lr=0.5)


def flat_params(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def assert_accounting(stats):
    assert stats["gradients_received"] == (stats["gradients_applied"] + stats["gradients_dropped"]
                                           + stats["gradients_in_flight_at_stop"])
    assert stats["gradients_received"] == sum(stats["pushes_per_learner"])
    assert stats["gradients_applied"] == sum(stats["staleness_histogram"].values())


class Tiny(LightningModule):
    """y = 2x fitted by a 2-parameter linear model: cheap pushes for clock statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.layer(x).squeeze(-1) - y) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        self.seen.append(flat_params(self).clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _loader(self):
        x = torch.linspace(-1, 1, 64).unsqueeze(1)
        return DataLoader(TensorDataset(x, 2 * x[:, 0]), batch_size=4)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()


@pytest.fixture
def decisions(monkeypatch):
    """Every decision the simulated server takes, in order."""
    seen = []
    push = SimulatedServer.push

    def spy(self, *args, **kwargs):
        seen.append(push(self, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(SimulatedServer, "push", spy)
    return seen


def test_boring_model_runs_unchanged():
    model = BoringModel()
    trainer, strategy = fit(model, 12, variant="k_async", k=2, delay=Exponential(1.0),
                            trainer_kwargs=dict(limit_val_batches=2))
    stats = strategy.stats
    # global_step counts server updates, as DDP's counts optimizer steps; K = 2 pushes make one
    assert stats["updates"] == 12 == trainer.global_step and stats["gradients_received"] >= 24
    assert_accounting(stats)
    # the module holds the server's final parameters
    server_params = torch.cat([p.reshape(-1) for p in strategy.server.state.params])
    assert torch.equal(flat_params(model), server_params)
    # BoringModel's StepLR steps per epoch: 24 pushes are less than one 64-batch epoch
    assert strategy.server.state.optimizer.param_groups[0]["lr"] == 0.1
    assert strategy.lr_scheduler_configs  # restored for the learner side after fit
    assert trainer.fit_loop.epoch_loop.max_steps == 12  # Lightning's own limit did the stopping
    trainer.test(model, verbose=False)
    assert len(trainer.predict(model)) == 64
    assert torch.equal(flat_params(model), server_params)


def test_step_schedulers_follow_server_updates_and_epoch_schedulers_epochs():
    class Scheduled(Tiny):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            per_update = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            per_epoch = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
            return [optimizer], [{"scheduler": per_update, "interval": "step"},
                                 {"scheduler": per_epoch, "interval": "epoch"}]

    # 16 batches per epoch = 16 pushes = 8 updates of K-sync with K=2: 20 updates span 2 epochs
    _, strategy = fit(Scheduled(), 20, variant="k_sync", k=2, delay=Exponential(1.0),
                      trainer_kwargs=dict(limit_val_batches=0))
    lr = strategy.server.state.optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(0.05 * 0.5 ** 10 * 0.1 ** 2)


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_every_variant_on_digits(variant, decisions):
    k = {"sync": None, "async": None, "k_sync": 3, "k_async": 3}.get(variant, 4)
    trainer, strategy = fit(digits_classifier(), 40, DigitsDataModule(batch_size=32),
                            callbacks=[logger := WallClockLogger()], variant=variant, k=k,
                            delay=Exponential(1.0, seed=3), num_learners=4,
                            trainer_kwargs=dict(limit_val_batches=0))
    stats = strategy.stats
    assert stats["updates"] == 40
    assert_accounting(stats)
    updates = [d.update for d in decisions if d.update is not None]
    assert len(updates) == 40 and all(len(u.gradients) == strategy.variant.k for u in updates)
    if variant in SYNC_FAMILY:
        assert set(stats["staleness_histogram"]) == {0}
    else:
        assert max(stats["staleness_histogram"]) > 0
    distinct = [len({push.learner for push in u.gradients}) == len(u.gradients) for u in updates]
    if strategy.variant.counts == "learners":
        assert all(distinct)  # K gradients from K distinct learners
    else:
        assert not all(distinct)  # a learner may contribute several mini-batches to one update
    losses = [row["train/loss"] for row in logger.rows]
    assert len(losses) == 40 and [row["update"] for row in logger.rows] == list(range(1, 41))
    assert np.mean(losses[-8:]) < 0.8 * np.mean(losses[:8])  # loss falls
    clock = [row["time/train_s"] for row in logger.rows]
    assert clock == sorted(clock) and clock[-1] == pytest.approx(stats["virtual_time_s"])


def run_digits_k_async(seed):
    model = digits_classifier()
    logger = WallClockLogger()
    _, strategy = fit(model, 25, DigitsDataModule(batch_size=16), callbacks=[logger],
                      variant="k_async", k=2, delay=Exponential(1.0, seed=7), seed=seed,
                      trainer_kwargs=dict(limit_val_batches=0))
    rows = [{key: value for key, value in row.items() if key != "time/validation_s"}
            for row in logger.rows]
    return flat_params(model), rows, strategy.stats


def test_same_seed_is_bit_identical_and_another_seed_differs():
    params_a, rows_a, stats_a = run_digits_k_async(seed=0)
    params_b, rows_b, stats_b = run_digits_k_async(seed=0)
    assert torch.equal(params_a, params_b)
    assert rows_a == rows_b and len(rows_a) == 25
    assert stats_a == stats_b
    params_c, rows_c, _ = run_digits_k_async(seed=1)
    assert not torch.equal(params_a, params_c)
    assert [r["train/loss"] for r in rows_a] != [r["train/loss"] for r in rows_c]


def test_clock_is_the_virtual_cluster_of_the_rules():
    """The strategy's update times are those of the stand-alone event simulation (which the
    theory module validates against the closed forms with many more pushes)."""
    logger = WallClockLogger()
    fit(Tiny(), 200, callbacks=[logger], variant="k_batch_async", k=3, num_learners=5,
        delay=Exponential(1.0, seed=5), compute_time=0.1)
    rules = ServerRules(Variant.create("k_batch_async", 5, 3))
    cluster = VirtualCluster(rules, Exponential(1.0, seed=5), compute_time=0.1)
    times = []
    while len(times) < 200:
        if cluster.step().update is not None:
            times.append(cluster.now)
    assert [row["time/train_s"] for row in logger.rows] == times


def test_a_cluster_pickled_before_per_learner_h_goes_on_with_its_h():
    """A simulation saved before each learner kept the H of its push in progress (a checkpoint
    of an earlier version) resumes as one saved now: every push in progress takes the cluster's H."""
    cluster = VirtualCluster(ServerRules(Variant.create("k_async", 3, 2)), Exponential(1.0, seed=5), local_steps=3)
    state = pickle.loads(pickle.dumps(cluster)).__dict__
    del state["_steps_of"]
    old = VirtualCluster.__new__(VirtualCluster)
    old.__setstate__(state)  # what unpickling such a checkpoint does
    runs = []
    for run in (old, pickle.loads(pickle.dumps(cluster))):
        finishes = []
        for _ in range(30):
            finishes.append(run.next_finish())
            run.apply(run.rules.on_push(finishes[-1].learner, finishes[-1].version))
        runs.append(finishes)
    assert runs[0] == runs[1] and {finish.local_steps for finish in runs[0]} == {3}


def test_a_pickled_cluster_keeps_the_h_each_push_in_progress_started_with():
    """After H changed (adaptive H), learners inside a round keep the H they started with, in a
    copy of the cluster too (a checkpoint taken then)."""
    cluster = VirtualCluster(ServerRules(Variant.create("async", 3)), Exponential(1.0, seed=5), local_steps=3)
    cluster.local_steps = 2  # learners started from now on take 2
    cluster.step()  # the pusher restarts with H = 2, the other two are inside rounds of 3
    copy = pickle.loads(pickle.dumps(cluster))
    finishes = [[run.next_finish() for _ in range(3)] for run in (cluster, copy)]  # one per learner
    assert finishes[0] == finishes[1] and sorted(f.local_steps for f in finishes[0]) == [2, 3, 3]


# The mean time per update of every variant against theory, over thousands of updates, is
# checked with epochs ending within rounds in tests/unit/test_epoch_boundaries.py (a stricter
# setting than here); the exact check above ties the clock to the event simulation, which
# tests/unit/test_theory.py validates with far more pushes.


def k_sync_error_floor(k, dm, updates=500):
    """Mean of F(w) - F* over the second half of a K-sync run started at w*."""
    model = LeastSquares(l2=dm.l2, lr=0.2, input_shape=dm.input_shape)
    model.load_weights(dm.optimum)  # start at the optimum: what remains is the noise floor
    gaps = []

    class Gap(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.strategy.server.updates > updates // 2:
                gaps.append(dm.objective(trainer.strategy.server.state.params[0]) - dm.optimal_loss)

    fit(model, updates, dm, callbacks=[Gap()], variant="k_sync", k=k, num_learners=4,
        delay=Exponential(1.0, seed=2), trainer_kwargs=dict(limit_val_batches=0))
    return float(np.mean(gaps))


def test_k_sync_error_floor_falls_as_k_grows():
    dm = ConvexDataModule(num_samples=256, num_features=4, noise=1.0, batch_size=1,
                          condition_number=4.0)
    floor_1, floor_4 = k_sync_error_floor(1, dm), k_sync_error_floor(4, dm)
    assert floor_4 < 0.5 * floor_1  # docs/method.md: the sync-family floor falls as 1/K


def test_trace_replay_reproduces_the_delays(tmp_path):
    kwargs = dict(variant="k_async", k=2, num_learners=3, trainer_kwargs=dict(limit_val_batches=0))
    model_a, model_b = Tiny(), Tiny()
    _, recorded = fit(model_a, 30, delay=Exponential(0.5, seed=4), record_trace=tmp_path / "a",
                      **kwargs)
    first = tmp_path / "a" / "delays.csv"
    _, replayed = fit(model_b, 30, delay=Trace(first), record_trace=tmp_path / "b.csv", **kwargs)
    assert (tmp_path / "b.csv").read_text() == first.read_text()
    assert replayed.stats == recorded.stats
    assert torch.equal(flat_params(model_a), flat_params(model_b))


def test_record_trace_true_writes_into_the_log_dir(tmp_path):
    _, strategy = fit(Tiny(), 5, variant="async", record_trace=True, delay=Exponential(1.0),
                      trainer_kwargs=dict(default_root_dir=tmp_path, limit_val_batches=0))
    assert (tmp_path / "delays.csv").read_text().startswith("learner,index,delay_s")
    assert len(strategy.trace_recorder) >= 5


def test_max_steps_counts_server_updates():
    trainer, strategy = fit(Tiny(), 15, variant="k_sync", k=3, delay=Exponential(1.0),
                            trainer_kwargs=dict(limit_val_batches=0))
    stats = strategy.stats
    assert stats["updates"] == 15 == trainer.global_step
    # K-sync with K = 3 of 4: the 45th push made the 15th update; the virtual clock never
    # finishes cancelled work, so nothing was dropped, and the epoch ends (every 16 pushes)
    # restarted nobody
    assert stats["gradients_received"] == 45 and stats["gradients_dropped"] == 0
    assert stats["epochs"] == 2


def test_an_epoch_end_is_a_pause_not_a_restart():
    kwargs = dict(variant="k_batch_async", k=3, delay=Exponential(1.0, seed=2),
                  trainer_kwargs=dict(limit_val_batches=0, max_epochs=3))
    trainer, strategy = fit(Tiny(), -1, **kwargs)
    stats = strategy.stats
    assert stats["gradients_received"] == 48 and stats["epochs"] == 3  # three epochs of 16 pushes
    # nothing pending was dropped at the two epoch ends: 48 pushes made 16 updates of K = 3
    assert stats["gradients_dropped"] == 0 and stats["updates"] == 16 == trainer.global_step
    assert_accounting(stats)


def test_validation_sees_the_server_parameters():
    seen_server = []

    class Spy(Callback):
        def on_validation_start(self, trainer, pl_module):
            server = trainer.strategy.server
            seen_server.append(torch.cat([p.detach().reshape(-1) for p in server.state.params]))

    model = Tiny()
    fit(model, 20, callbacks=[Spy()], variant="k_async", k=1, delay=Exponential(1.0),
        trainer_kwargs=dict(val_check_interval=7, limit_val_batches=1))
    assert len(model.seen) == len(seen_server) >= 2
    for learner_side, server_side in zip(model.seen, seen_server):
        assert torch.equal(learner_side, server_side)


def test_checkpoint_holds_the_server_and_resumes(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    trainer_kwargs = dict(limit_val_batches=0, enable_checkpointing=True)
    kwargs = dict(variant="k_async", k=2, num_learners=3, delay=Exponential(1.0, seed=1))
    fit(Tiny(), 10, callbacks=[saver], trainer_kwargs=trainer_kwargs, **kwargs)
    (path,) = tmp_path.glob("epoch=*-step=10.ckpt")  # global_step counts server updates
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["stale_server"]
    assert saved["engine"] is not None and saved["stats"]["updates"] == 10
    assert "state" in checkpoint["optimizer_states"][0]

    model = Tiny()
    strategy = SimulatedStaleStrategy(**kwargs)
    trainer = Trainer(strategy=strategy, max_steps=12, **{**QUIET, "limit_val_batches": 0})
    trainer.fit(model, ckpt_path=path)
    stats = strategy.stats
    assert stats["updates"] == 12
    assert stats["gradients_received"] > saved["stats"]["gradients_received"]
    assert_accounting(stats)


@pytest.mark.parametrize("kwargs,message", [
    (dict(variant="k_fancy"), "unknown variant 'k_fancy'"),
    (dict(variant="k_async", k=0), "K must satisfy"),
    (dict(variant="k_async", k=5, num_learners=4), "K=5"),
    (dict(variant="async", k=2), "means K=1"),
    (dict(num_learners=0), "num_learners must be an integer >= 1, got 0"),
    (dict(staleness_compensation="sqrt"), "unknown staleness compensation 'sqrt'"),
    (dict(variant="async", adaptive_k=10.0), "adaptive_k changes K"),
    (dict(compute_time=-1.0), "compute_time"),
    (dict(delay=Exponential(1.0), num_learners=2.5), "num_learners"),
])
def test_options_are_validated_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimulatedStaleStrategy(**kwargs)


class ManualModel(Tiny):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("model,trainer_kwargs,message", [
    (ManualModel, {}, "automatic optimization"),
])
def test_unsupported_setups_are_rejected(model, trainer_kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit(model(), 3, trainer_kwargs=trainer_kwargs)


def test_skipped_training_step_is_retried_by_the_same_learner():
    class Skipping(Tiny):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 3 == 0 else super().training_step(batch, batch_idx)

    trainer, strategy = fit(Skipping(), 10, variant="k_async", k=2, delay=Exponential(1.0),
                            trainer_kwargs=dict(limit_val_batches=0))
    assert strategy.stats["updates"] == 10 and math.isfinite(strategy.stats["virtual_time_s"])
    assert_accounting(strategy.stats)
