"""StaleStrategy in one process: option checks, registration and a P = 1 run of the full stack."""

import time

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_stale import StaleStrategy, WallClockLogger
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import Exponential, SlowLearners
from lightning_stale.method.variants import VARIANT_NAMES
from lightning_stale.models import MLP, Classifier
from user_modules import BlobData

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(variant="fastest"), r"unknown variant 'fastest'; choose one of sync"),
    (dict(variant="k_async", k=0), r"got K=0"),
    (dict(variant="async", k=2), r"'async' means K=1"),
    (dict(variant="k_async", find_unused_parameters=True), r"unknown options \['find_unused_parameters'\]"),
    (dict(variant="sync", adaptive_k=1.0), r"adaptive_k changes K, so it needs a K-variant"),
    (dict(variant="k_async", staleness_compensation="sqrt"), r"unknown staleness compensation 'sqrt'"),
    (dict(variant="k_async", delay_mode="before"), r"unknown delay_mode 'before'; choose one of after_compute, total"),
    (dict(variant="k_async", payload_channels="nccl"), r"payload_channels must be True or False, got 'nccl'"),
    (dict(variant="k_async", payload_channels=None), r"payload_channels must be True or False, got None"),
    (dict(variant="sync", overlap_allreduce="yes"), r"overlap_allreduce must be None .*, True or False, got 'yes'"),
    (dict(variant="k_async", k=2, payload_channels=True, on_learner_failure="continue"),
     r"payload_channels=True cannot go with on_learner_failure='continue'"),
])
def test_bad_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaleStrategy(**kwargs)


def test_k_larger_than_p_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"1 <= K <= P=4, got K=5"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=StaleStrategy("k_sync", 5))


def test_straggler_model_naming_a_missing_learner_fails_when_the_trainer_is_built():
    delay = SlowLearners(Exponential(mean=0.01), learners=[7], factor=3)
    with pytest.raises(ValueError, match="7"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=StaleStrategy("k_async", 2, delay=delay))


def test_a_gpu_only_backend_on_cpu_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' needs GPUs.*use 'gloo'"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=StaleStrategy("k_async", process_group_backend="nccl"))


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_variant_names_are_registered_strategies(name):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, **QUIET)
    assert isinstance(trainer.strategy, StaleStrategy) and trainer.strategy.variant_name == name


@pytest.mark.parametrize("trainer_kwargs,match", [
    (dict(val_check_interval=5), "val_check_interval must be 1.0"),
    (dict(sync_batchnorm=True), "sync_batchnorm must be False"),
])
def test_unsupported_trainer_settings_fail_before_training(one_process, trainer_kwargs, match):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, strategy=StaleStrategy("async"),
                         **trainer_kwargs, **QUIET)
    with pytest.raises(ValueError, match=match):
        trainer.fit(BoringModel())


def test_manual_optimization_fails_before_training(one_process):
    class Manual(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, strategy=StaleStrategy("async"), **QUIET)
    with pytest.raises(ValueError, match="manual optimization is not supported"):
        trainer.fit(Manual())


def test_one_process_runs_the_whole_stack(one_process, tmp_path):
    """P = 1: the server thread and the learner on the same rank, through Lightning's loops."""
    pl.seed_everything(0)
    dm = DigitsDataModule(batch_size=32)
    model = Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.2)
    clock = WallClockLogger()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=80, callbacks=[clock],
                         strategy=StaleStrategy("async", delay=Exponential(mean=0.001, seed=0),
                                                record_trace=tmp_path / "delays.csv"),
                         check_val_every_n_epoch=1, default_root_dir=tmp_path, **QUIET)
    trainer.fit(model, dm)
    stats = trainer.strategy.stats
    assert stats["updates"] == 80 and stats["gradients_applied"] == 80
    assert stats["epochs"] == 80 // 33  # ceil(1079 / 32) mini-batches per epoch
    assert set(stats["staleness_histogram"]) == {0}  # one learner is never stale
    assert [row["update"] for row in clock.rows] == list(range(1, 81))
    assert clock.rows[-1]["train/loss"] < clock.rows[0]["train/loss"]
    lines = (tmp_path / "delays.csv").read_text().splitlines()
    assert lines[0] == "learner,index,delay_s" and len(lines) - 1 >= 80
    assert trainer.callback_metrics["val/acc"] > 0.5


class BatchNormClassifier(pl.LightningModule):
    """Linear, BatchNorm, ReLU, Linear under SGD: a module whose forward passes change its buffers."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StopWhenTrainingGoesOn(pl.Callback):
    """At the first batch after the first epoch's end, asks the server to stop and waits until its
    STOP is in the learner's inbox: the strategy takes it as training goes on (before the batch's
    forward pass), as a learner does whose carried push the server answers with its stop."""

    def __init__(self):
        self.asked, self.stopped_before_backward = False, None

    def on_before_backward(self, trainer, *args):
        if self.asked and self.stopped_before_backward is None:
            self.stopped_before_backward = trainer.strategy._learner.stopped

    def on_train_batch_start(self, trainer, *args):
        if trainer.current_epoch == 1 and not self.asked:
            self.asked = True
            learner = trainer.strategy._learner
            learner.request_stop()
            deadline = time.monotonic() + 30
            while not learner.stop_heard():
                assert time.monotonic() < deadline, "no STOP within 30 s"
                time.sleep(0.01)


def test_a_batch_started_after_the_stop_leaves_no_trace_in_the_final_buffers(one_process):
    """The learner takes the server's STOP (its final parameters and buffers) when training goes
    on after an epoch's end; the batch that then runs is never pushed, so its forward pass must
    not count in the module's BatchNorm statistics: the module ends with the server's state."""
    pl.seed_everything(0)
    stop = StopWhenTrainingGoesOn()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, strategy=StaleStrategy("async"),
                         callbacks=[stop], limit_val_batches=0, **QUIET)
    model = BatchNormClassifier()
    trainer.fit(model, BlobData(batch_size=32, n=96))  # 3 batches an epoch
    assert stop.stopped_before_backward  # the STOP was loaded before that batch's forward pass
    assert trainer.strategy.stats["updates"] == 3
    server = trainer.strategy.core.state
    bn = model.net[1]
    assert int(bn.num_batches_tracked) == 3  # one per applied push, none for the discarded batch
    for mine, servers in zip((bn.running_mean, bn.running_var, bn.num_batches_tracked), server.buffers):
        assert torch.equal(mine, servers)
    for mine, servers in zip(model.parameters(), server.params):
        assert torch.equal(mine.detach(), servers)
