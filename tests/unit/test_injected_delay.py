"""InjectedDelay: Lightning's own strategies (ddp) face the same stragglers as the engines."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import WallClockLogger
from lightning_stale.delays import Exponential, SlowLearners
from lightning_stale.models import MLP, Classifier
from lightning_stale.strategies.injected_delay import InjectedDelay


def tiny_fit(callback: InjectedDelay, steps: int) -> WallClockLogger:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randint(3, (64,), generator=torch.Generator().manual_seed(1))
    clock = WallClockLogger()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[clock, callback])
    trainer.fit(Classifier(MLP((8,), 3, hidden_sizes=(4,)), lr=0.1),
                train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=8))
    return clock


def test_each_step_sleeps_a_draw_from_the_ranks_own_stream():
    callback = InjectedDelay(Exponential(mean=0.02, seed=5))
    clock = tiny_fit(callback, steps=6)
    fresh = Exponential(mean=0.02, seed=5)
    expected = sum(fresh.sample(0) for _ in range(6))  # rank 0 draws learner 0's stream
    assert callback.slept_s == pytest.approx(expected, rel=1e-12)
    assert clock.rows[-1]["time/train_s"] >= expected  # the sleeps are training time


def test_bad_models_fail_early():
    with pytest.raises(ValueError, match="straggler model"):
        InjectedDelay(0.1)
    with pytest.raises(ValueError, match="learner"):
        tiny_fit(InjectedDelay(SlowLearners(Exponential(0.01), learners=[3], factor=2.0)),
                 steps=1)
