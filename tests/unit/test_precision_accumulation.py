"""Precision plugins and gradient accumulation on both engines, in this process (the simulated
engine with three learners, the real one with P = 1): counts, losses, what a push carries.

On CPU, ``Trainer(precision="16-mixed")`` becomes ``bf16-mixed`` (Lightning's own rule, under DDP
too), so fp16 with its gradient scaler is asked for with ``MixedPrecision("16-mixed", "cpu")``.
"""

import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

import user_modules as um
from engines import books_balance
from lightning_stale import WallClockLogger
from lightning_stale.engine.core import ServerCore

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]




def mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize(
    "precision,param_dtype",
    [
        ("bf16-mixed", torch.float32),
        ("16-mixed", torch.float32),
        ("bf16-true", torch.bfloat16),
        ("64-true", torch.float64),
    ],
)
def test_precision_plugins_train_with_every_gradient_counted(engine, precision, param_dtype):
    pl.seed_everything(0)
    model = um.Classifier(lr=0.2)
    clock = WallClockLogger()
    options = (
        dict(plugins=[MixedPrecision("16-mixed", "cpu")])
        if precision == "16-mixed"
        else dict(precision=precision)
    )
    trainer = um.fit_user_module(
        engine, model, um.BlobData(), max_steps=30, callbacks=[clock], **options
    )
    stats = trainer.strategy.stats
    assert stats["updates"] == 30 == trainer.global_step and books_balance(stats)
    assert stats["gradients_applied"] == 30 * stats["k"]  # every push applied (K-async)
    losses = [row["train/loss"] for row in clock.rows]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert mean(losses[-5:]) < 0.7 * mean(losses[:5])
    # the server's weights have the dtype the plugin gives the module: fp32 master weights in
    # the mixed modes, the module's own dtype in the true ones (as DDP steps them)
    assert {p.dtype for p in trainer.strategy.core.state.params} == {param_dtype}
    assert model.net[0].weight.dtype == param_dtype


class OverflowOnce(um.Classifier):
    """Its fourth push's loss is infinite, as an fp16 overflow would make it."""

    def __init__(self):
        super().__init__(lr=0.2)
        self.pushes = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.pushes += 1
        return loss * float("inf") if self.pushes == 4 else loss


def test_an_overflowing_fp16_gradient_is_dropped_and_the_scale_halved(engine):
    pl.seed_everything(0)
    plugin = MixedPrecision("16-mixed", "cpu")
    trainer = um.fit_user_module(
        engine, OverflowOnce(), um.BlobData(), max_steps=10, plugins=[plugin]
    )
    stats = trainer.strategy.stats
    assert stats["gradients_dropped_by_reason"] == {"overflow": 1}
    assert stats["updates"] == 10 and books_balance(stats)
    # 2**16 at the start, no growth in so few steps (growth_interval=2000), halved once
    assert plugin.scaler.get_scale() == 2.0**15
    assert all(torch.isfinite(p).all() for p in trainer.strategy.core.state.params)


class Recorded(pl.LightningModule):
    """y = w.x + b fitted by least squares; keeps every micro-batch with the parameters it was
    computed at."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.micro_batches = []

    def loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def training_step(self, batch, batch_idx):
        params = [p.detach().clone() for p in self.parameters()]
        self.micro_batches.append(([t.clone() for t in batch], params))
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 3, generator=g)
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5])), batch_size=4
        )


@pytest.fixture
def pushes(monkeypatch):
    """Every contribution the server core receives, in order (both engines go through it)."""
    seen = []
    push = ServerCore.push

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("contribution"), kwargs.get("samples")))
        return push(self, *args, **kwargs)

    monkeypatch.setattr(ServerCore, "push", spy)
    return seen


def test_accumulated_push_is_the_mean_gradient_of_its_micro_batches(engine, pushes):
    n, batch = 3, 4
    torch.manual_seed(0)
    model = Recorded()
    clock = WallClockLogger()
    trainer = um.fit_user_module(
        engine, model, variant="k_sync", max_steps=6, accumulate_grad_batches=n, callbacks=[clock]
    )
    k = trainer.strategy.stats["k"]
    # a push is n micro-batches; an update takes K pushes: n x batch x K samples
    steps = [
        int(b) - int(a)
        for a, b in zip(
            [0] + [r["samples"] for r in clock.rows], [r["samples"] for r in clock.rows]
        )
    ]
    assert steps == [n * batch * k] * 6
    assert all(samples == n * batch for _, samples in pushes)
    assert len(model.micro_batches) >= n * len(pushes)
    for i, (contribution, _) in enumerate(pushes):
        group = model.micro_batches[n * i : n * (i + 1)]
        params = group[0][1]
        assert all(
            all(torch.equal(a, b) for a, b in zip(params, g[1])) for g in group
        )  # one version
        reference = Recorded()
        with torch.no_grad():
            for p, value in zip(reference.parameters(), params):
                p.copy_(value)
        loss = sum(reference.loss(micro) for micro, _ in group) / n  # DDP's step: their mean
        loss.backward()
        expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(contribution.gradient, expected, rtol=1e-5, atol=1e-7)
