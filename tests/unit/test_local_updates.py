"""Local updates on the simulated engine (docs/how-to/local-updates.md): H inner steps of the
module's own optimizer per push, the pseudo-gradient, the outer optimizer, the variants' rules at
the outer level, and the theory of E[T] per outer update against the engine's virtual clock.

Modules as users write them (tests/user_modules.py: AdamW with a warm-up sized from
``estimated_stepping_batches``, BatchNorm) and a linear model whose steps can be redone by hand.
"""

import copy
import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import user_modules as um
from engines import QUIET, books_balance
from pytorch_lightning import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.delays import Exponential
from lightning_stale.engine.state import Contribution, ServerState
from lightning_stale.method.local import (
    closed_form_local_update_time,
    erlang_order_statistic_mean,
    expected_local_update_time,
    monte_carlo_local_update_times,
)
from lightning_stale.method.theory import closed_form_iteration_time, harmonic
from lightning_stale.method.variants import Variant
from lightning_stale.strategies.local_updates import outer_optimizer_factory, plain_averaging

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

DILOCO = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}


class CountBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1


def fit(model, datamodule=None, *, variant="sync", k=None, learners=2, callbacks=(), strategy_kwargs=None,
        **trainer_kwargs):
    strategy = SimulatedStaleStrategy(variant, k, num_learners=learners, record_trace=False,
                                      **(strategy_kwargs or {}))
    trainer = pl.Trainer(strategy=strategy, callbacks=list(callbacks), **{**QUIET, **trainer_kwargs})
    trainer.fit(model, datamodule=datamodule)
    return trainer, strategy


def inner_steps(strategy, learner):
    """The inner optimizer's step count of ``learner`` (AdamW keeps one per parameter)."""
    states = strategy.server.inner_states.get(learner)
    return 0 if states is None else int(next(s for s in states if s)["step"])


# ---------------------------------------------------------------- H = 1 is today's method
@pytest.mark.parametrize("cls,data", [(um.WarmupAdamW, {}), (um.BatchNormCNN, {"image": True})])
def test_one_local_step_is_bit_identical_to_a_push_per_step(cls, data):
    runs = []
    for options in ({}, {"local_steps": 1, "outer_optimizer": None}):
        torch.manual_seed(0)
        module = cls()
        trainer, strategy = fit(module, um.BlobData(**data), variant="k_async", k=2, learners=3,
                                strategy_kwargs={"delay": Exponential(1.0), **options}, max_epochs=2)
        runs.append((module, strategy.stats, trainer.global_step))
    (a, stats_a, step_a), (b, stats_b, step_b) = runs
    assert step_a == step_b and stats_a == stats_b
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- counts and meaning
def test_counts_of_pushes_inner_steps_and_schedules_with_adamw_warmup():
    h, epochs = 4, 2
    torch.manual_seed(0)
    module, counter = um.WarmupAdamW(), CountBatches()
    trainer, strategy = fit(module, um.BlobData(), variant="k_async", k=2, learners=3,
                            callbacks=[counter], max_epochs=epochs,
                            strategy_kwargs={"delay": Exponential(1.0), "local_steps": h})
    stats = strategy.stats
    pushes = stats["pushes_per_learner"]
    assert counter.batches == 12 * epochs  # 192 samples in batches of 16, per epoch
    assert sum(pushes) * h == counter.batches  # a push after every H inner steps
    assert books_balance(stats) and stats["gradients_received"] == sum(pushes)
    assert trainer.global_step == stats["updates"] * h  # the trainer counts inner steps
    for learner, n in enumerate(pushes):  # each learner's AdamW took H steps per push of its own
        assert n > 0 and inner_steps(strategy, learner) == n * h
    # the warm-up's schedule was sized in inner steps and stepped H times per update
    pushes_per_epoch = math.ceil(12 / h)
    assert module.total_steps == math.ceil(pushes_per_epoch / 2) * h * epochs
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == trainer.global_step
    assert stats["epochs"] == epochs
    assert stats["mean_update_interval_s"] == pytest.approx(
        strategy.server.core._last_update_s / stats["updates"])


def test_max_steps_counts_inner_steps():
    torch.manual_seed(0)
    trainer, strategy = fit(um.WarmupAdamW(), um.BlobData(), variant="sync", learners=2, max_steps=9,
                            strategy_kwargs={"local_steps": 3})
    assert strategy.stats["updates"] == 3 and trainer.global_step == 9


def test_batchnorm_statistics_travel_with_the_rounds():
    """Under sync every learner pulls the server's buffers and counts its H batches on top; the
    server keeps the largest count, so it counts H per update, like the trainer's steps."""
    torch.manual_seed(0)
    module = um.BatchNormCNN()
    start = module.net[1].running_mean.clone()
    trainer, strategy = fit(module, um.BlobData(image=True), variant="sync", learners=2, max_epochs=2,
                            strategy_kwargs={"local_steps": 3})
    batchnorm = module.net[1]
    assert int(batchnorm.num_batches_tracked) == trainer.global_step == strategy.stats["updates"] * 3
    assert not torch.equal(batchnorm.running_mean, start)


# ---------------------------------------------------------------- the pseudo-gradient and the outer step
class Linear(pl.LightningModule):
    """y = x w + b with plain SGD; records every batch and which learner computed it."""

    def __init__(self, lr=0.1):
        super().__init__()
        torch.manual_seed(1)
        self.layer = nn.Linear(3, 1)
        self.lr = lr
        self.seen = []  # (learner, x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        round_ = self.trainer.strategy._round
        self.seen.append((round_.finish.learner, x.clone(), y.clone()))
        return F.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 3, generator=g)
        return DataLoader(TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3), batch_size=8)


def sgd_steps(weight, bias, batches, lr):
    """Plain SGD by hand on ``batches`` from (weight, bias)."""
    weight, bias = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    for x, y in batches:
        loss = F.mse_loss((x @ weight.T + bias).squeeze(-1), y)
        gw, gb = torch.autograd.grad(loss, [weight, bias])
        with torch.no_grad():
            weight -= lr * gw
            bias -= lr * gb
    return weight.detach(), bias.detach()


def test_one_learner_averaging_its_local_steps_is_those_steps():
    """P = 1, K = 1, plain averaging: w - (w - w_H) is w_H, so the run is plain SGD on the same
    batches in the same order."""
    module = Linear()
    w0, b0 = module.layer.weight.detach().clone(), module.layer.bias.detach().clone()
    _, strategy = fit(module, variant="sync", learners=1, max_steps=12,
                      strategy_kwargs={"local_steps": 4})
    assert strategy.stats["updates"] == 3 and len(module.seen) == 12
    w, b = sgd_steps(w0, b0, [(x, y) for _, x, y in module.seen], 0.1)
    torch.testing.assert_close(module.layer.weight.detach(), w)
    torch.testing.assert_close(module.layer.bias.detach(), b)


def test_each_inner_step_is_clipped_and_accumulated_as_lightning_does():
    """Gradient clipping applies to every inner step (as on a DDP rank), and an inner step is
    ``accumulate_grad_batches`` micro-batches: P = 1 is plain clipped SGD on the summed losses."""
    module = Linear()
    w0, b0 = module.layer.weight.detach().clone(), module.layer.bias.detach().clone()
    _, strategy = fit(module, variant="sync", learners=1, max_steps=4, gradient_clip_val=0.05,
                      accumulate_grad_batches=2, strategy_kwargs={"local_steps": 2})
    assert strategy.stats["updates"] == 2 and len(module.seen) == 8  # 2 x 2 x 2 micro-batches
    weight, bias = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    for i in range(4):
        loss = sum(F.mse_loss((x @ weight.T + bias).squeeze(-1), y) / 2
                   for _, x, y in module.seen[2 * i:2 * i + 2])
        grads = torch.autograd.grad(loss, [weight, bias])
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
        scale = min(1.0, 0.05 / (float(norm) + 1e-6))
        assert scale < 1.0  # the clip did bite
        with torch.no_grad():
            weight -= 0.1 * scale * grads[0]
            bias -= 0.1 * scale * grads[1]
    torch.testing.assert_close(module.layer.weight.detach(), weight.detach())
    torch.testing.assert_close(module.layer.bias.detach(), bias.detach())


def test_outer_nesterov_is_diloco_by_hand():
    """P = 2 under sync, H = 2 SGD steps each, outer SGD with Nesterov momentum (DiLoCo): by hand,
    Delta = mean over learners of (w - w_l), b = 0.9 b + Delta, w <- w - 0.7 (Delta + 0.9 b)."""
    h, updates = 2, 3
    module = Linear()
    w, b = module.layer.weight.detach().clone(), module.layer.bias.detach().clone()
    fit(module, variant="sync", learners=2, max_steps=h * updates,
        strategy_kwargs={"local_steps": h, "outer_optimizer": DILOCO})
    assert len(module.seen) == 2 * h * updates
    momentum = None
    for j in range(updates):
        rounds = module.seen[j * 2 * h:(j + 1) * 2 * h]
        deltas = []
        for learner in (0, 1):
            mine = [(x, y) for who, x, y in rounds if who == learner]
            assert len(mine) == h
            wl, bl = sgd_steps(w, b, mine, 0.1)
            deltas.append(torch.cat([(w - wl).reshape(-1), b - bl]))
        delta = 0.5 * deltas[0] + 0.5 * deltas[1]
        momentum = delta.clone() if momentum is None else 0.9 * momentum + delta
        step = 0.7 * (delta + 0.9 * momentum)
        w, b = w - step[:3].view_as(w), b - step[3:]
    torch.testing.assert_close(module.layer.weight.detach(), w)
    torch.testing.assert_close(module.layer.bias.detach(), b)


def test_server_applies_weighted_pseudo_gradients_with_the_outer_optimizer():
    """Staleness compensation weighs pseudo-gradients as it weighs gradients; plain averaging
    then moves w by their weighted mean, and the inner optimizer is left as it is."""
    layer = nn.Linear(2, 1)
    inner = torch.optim.AdamW(layer.parameters(), lr=0.01)
    state = ServerState(layer, inner, outer=plain_averaging(), steps_per_update=4)
    before = state.vectors.state_vector()
    d1, d2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 4.0, 1.0])
    state.apply([Contribution(d1), Contribution(d2)], weights=[1.0, 0.5])
    torch.testing.assert_close(state.vectors.state_vector(), before - (d1 + 0.5 * d2) / 2)
    assert isinstance(state.optimizer, torch.optim.SGD) and inner.state == {}


def test_staleness_compensation_on_pseudo_gradients_in_a_fit():
    torch.manual_seed(0)
    module = um.WarmupAdamW()
    _, strategy = fit(module, um.BlobData(), variant="async", learners=3, max_epochs=2,
                      strategy_kwargs={"local_steps": 2, "delay": Exponential(1.0),
                                       "staleness_compensation": {"mode": "norm", "c": 1e-3}})
    histogram = strategy.stats["staleness_histogram"]
    assert any(s > 0 for s in histogram) and books_balance(strategy.stats)
    assert all(torch.isfinite(p).all() for p in module.parameters())


# ---------------------------------------------------------------- the variants' rules at the outer level
@pytest.mark.parametrize("variant,k", [("sync", None), ("k_sync", 2), ("k_batch_sync", 2), ("async", None),
                                       ("k_async", 2), ("k_batch_async", 2)])
def test_every_variant_takes_pushes_of_h_inner_steps(variant, k):
    h = 3
    torch.manual_seed(0)
    counter = CountBatches()
    trainer, strategy = fit(um.WarmupAdamW(), um.BlobData(), variant=variant, k=k, learners=3,
                            callbacks=[counter], max_steps=6 * h, limit_val_batches=0,
                            strategy_kwargs={"local_steps": h, "delay": Exponential(1.0)})
    stats = strategy.stats
    assert stats["updates"] == 6 and trainer.global_step == 6 * h and books_balance(stats)
    assert counter.batches == sum(stats["pushes_per_learner"]) * h
    for learner, n in enumerate(stats["pushes_per_learner"]):
        assert inner_steps(strategy, learner) == n * h
    # staleness only where the rules allow it
    stale = any(s > 0 for s in stats["staleness_histogram"])
    assert stale == (not Variant.create(variant, 3, k).synchronous)


def test_adaptive_k_changes_k_between_outer_updates():
    torch.manual_seed(0)
    _, strategy = fit(um.WarmupAdamW(), um.BlobData(), variant="k_sync", k=1, learners=3, max_steps=30,
                      limit_val_batches=0, strategy_kwargs={"local_steps": 2, "delay": Exponential(1.0),
                                                            "adaptive_k": {"k0": 1, "interval_s": 3.0}})
    history = strategy.stats["k_history"]
    assert len({k for _, k in history}) > 1 and books_balance(strategy.stats)


def test_cancellation_under_k_sync_abandons_the_local_steps():
    h = 3
    torch.manual_seed(0)
    counter = CountBatches()
    _, strategy = fit(um.WarmupAdamW(), um.BlobData(), variant="k_sync", k=2, learners=4,
                      callbacks=[counter], max_steps=10 * h,
                      strategy_kwargs={"local_steps": h, "delay": Exponential(1.0)})
    stats = strategy.stats
    assert stats["updates"] == 10 and stats["cancellations"] > 0
    assert set(stats["staleness_histogram"]) == {0}
    # abandoned rounds are never computed: every batch trained on belongs to a push, and each
    # learner's inner optimizer holds the steps of its pushes only
    assert counter.batches == sum(stats["pushes_per_learner"]) * h
    for learner, n in enumerate(stats["pushes_per_learner"]):
        assert inner_steps(strategy, learner) == n * h


def test_validation_inside_a_round_sees_the_server_and_the_round_goes_on():
    """An epoch of 12 batches with H = 5 ends inside a round: validation sees the server's
    parameters, and the learner resumes its round from its own."""
    seen = []

    class Watch(Callback):
        def on_validation_start(self, trainer, pl_module):
            server = trainer.strategy.server.state.vectors.state_vector()
            seen.append(torch.equal(server[:sum(p.numel() for p in pl_module.parameters())],
                                    torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])))

    torch.manual_seed(0)
    reference = copy.deepcopy(um.WarmupAdamW())
    module = copy.deepcopy(reference)
    counter = CountBatches()
    fit(module, um.BlobData(), variant="sync", learners=1, callbacks=[counter, Watch()],
        max_epochs=2, strategy_kwargs={"local_steps": 5})
    assert seen == [True, True]
    # P = 1 with plain averaging is plain training: the same as validating never
    torch.manual_seed(0)
    quiet = copy.deepcopy(reference)
    fit(quiet, um.BlobData(), variant="sync", learners=1, max_epochs=2, limit_val_batches=0,
        strategy_kwargs={"local_steps": 5})
    for a, b in zip(module.parameters(), quiet.parameters()):
        torch.testing.assert_close(a, b)


def test_checkpoint_inside_a_round_resumes(tmp_path):
    torch.manual_seed(0)
    options = {"local_steps": 5, "outer_optimizer": DILOCO, "delay": Exponential(1.0)}
    fit(um.WarmupAdamW(), um.BlobData(), variant="k_async", k=2, learners=3, max_epochs=1,
        enable_checkpointing=True, default_root_dir=tmp_path, strategy_kwargs=options)
    saved = next(tmp_path.rglob("*.ckpt"))
    checkpoint = torch.load(saved, weights_only=True)
    engine = checkpoint["stale_server"]
    assert engine["round"] is not None  # 12 batches: saved two steps into a round
    assert engine["outer_optimizer"]["state"]  # the outer momentum is kept
    module = um.WarmupAdamW()
    strategy = SimulatedStaleStrategy("k_async", 2, num_learners=3, record_trace=False, **options)
    trainer = pl.Trainer(strategy=strategy, **{**QUIET, "max_epochs": 3})
    trainer.fit(module, datamodule=um.BlobData(), ckpt_path=str(saved))
    stats = strategy.stats
    assert books_balance(stats) and stats["updates"] > engine["stats"]["updates"]
    assert trainer.global_step == stats["updates"] * 5
    assert strategy.server.core.state.optimizer.state  # the outer optimizer went on
    # every learner's AdamW state came back: its step count covers its pushes before the save
    # too, and the round cut by the save started again from the state before it
    for learner, n in enumerate(stats["pushes_per_learner"]):
        assert n > 0 and inner_steps(strategy, learner) == n * 5


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "2", None])
def test_bad_local_steps_are_refused_at_construction(value):
    with pytest.raises(ValueError, match=f"local_steps must be an integer >= 1.*{value!r}"):
        SimulatedStaleStrategy("sync", num_learners=2, local_steps=value)


@pytest.mark.parametrize("spec,message", [
    ("torch.optim.Nothing", "names no torch.optim.Optimizer"),
    ("torch.nn.Linear", "names no torch.optim.Optimizer"),
    ({"class_path": "torch.optim.SGD", "init_args": {"lr": -1.0}}, "cannot be built.*Invalid learning rate"),
    ({"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "nesterov_momentum": 0.9}},
     "cannot be built"),
    ({"optimizer": "torch.optim.SGD"}, "needs the keys class_path"),
    (0.7, "must be None, a class path"),
])
def test_bad_outer_optimizers_are_refused_at_construction(spec, message):
    with pytest.raises(ValueError, match=message):
        SimulatedStaleStrategy("sync", num_learners=2, local_steps=2, outer_optimizer=spec)


def test_local_updates_refuse_event_logs():
    with pytest.raises(ValueError, match="record_events and replay cannot go with local updates"):
        SimulatedStaleStrategy("sync", num_learners=2, local_steps=2, record_events=True)


def test_stale_strategy_takes_local_steps_on_the_central_path_only():
    assert StaleStrategy("sync", local_steps=1).local_steps == 1
    assert StaleStrategy("sync", local_steps=4).server == "central"  # (tests/unit/test_local_updates_real.py)
    with pytest.raises(ValueError, match="server='sharded' with local_steps=4: local updates run on the central path"):
        StaleStrategy("sync", local_steps=4, server="sharded")
    with pytest.raises(ValueError, match=r"local_steps must be an integer >= 1.*got 0"):
        StaleStrategy("sync", local_steps=0)


def test_outer_optimizer_forms():
    params = [torch.zeros(2, requires_grad=True)]
    assert outer_optimizer_factory(None) is None
    assert isinstance(outer_optimizer_factory("torch.optim.Adam")(params), torch.optim.Adam)
    built = outer_optimizer_factory(DILOCO)(params)
    assert built.defaults["momentum"] == 0.9 and built.defaults["nesterov"] is True
    assert plain_averaging()(params).defaults["lr"] == 1.0 and plain_averaging()(params).defaults["momentum"] == 0


# ---------------------------------------------------------------- theory against the clock
@pytest.mark.parametrize("k", [1, 2, 4])
def test_erlang_order_statistic_with_one_step_is_the_paper_s(k):
    assert erlang_order_statistic_mean(k, 4, 1, 2.0) == pytest.approx((harmonic(4) - harmonic(4 - k)) / 2.0,
                                                                        rel=1e-9)


def test_erlang_order_statistic_of_one_learner_is_the_erlang_mean():
    assert erlang_order_statistic_mean(1, 1, 5, 0.5) == pytest.approx(10.0, rel=1e-9)


@pytest.mark.parametrize("variant,k", [("sync", None), ("k_sync", 2), ("async", None), ("k_batch_async", 2),
                                       ("k_batch_sync", 1), ("k_async", 4)])
def test_closed_forms_match_the_virtual_clock(variant, k):
    delay = Exponential(1.0)
    v = Variant.create(variant, 4, k)
    closed = closed_form_local_update_time(v, delay, 3)
    simulated = expected_local_update_time(v, delay=delay, local_steps=3, method="monte_carlo", updates=30000)
    assert simulated == pytest.approx(closed, rel=0.02)
    assert closed_form_local_update_time(v, delay, 1) == closed_form_iteration_time(v, delay)


def test_no_closed_form_where_memorylessness_is_lost():
    with pytest.raises(ValueError, match="not memoryless"):
        closed_form_local_update_time(Variant.create("k_batch_sync", 4, 2), Exponential(1.0), 2)
    assert expected_local_update_time("k_batch_sync", 4, 2, local_steps=2, updates=2000) > 0


@pytest.mark.parametrize("variant,k,h", [("k_sync", 2, 3), ("k_batch_async", 2, 2)])
def test_theory_matches_the_simulated_engine(variant, k, h):
    """The engine's measured virtual time per update is the theory's Monte Carlo run of the same
    delays (the same clock), and close to the closed form."""
    updates, delay = 150, Exponential(1.0, seed=3)
    module = um.Classifier()
    _, strategy = fit(module, um.BlobData(n=512, batch_size=8), variant=variant, k=k, learners=4,
                      max_steps=updates * h, limit_val_batches=0,
                      strategy_kwargs={"local_steps": h, "delay": delay})
    measured = strategy.stats["mean_update_interval_s"]
    assert strategy.stats["updates"] == updates
    clock = monte_carlo_local_update_times(variant, 4, k, delay, local_steps=h, updates=updates, seed=None)
    assert measured == pytest.approx(float(np.mean(clock)), rel=1e-9)
    assert measured == pytest.approx(closed_form_local_update_time(Variant.create(variant, 4, k), delay, h),
                                     rel=0.12)


# ---------------------------------------------------------------- the Hydra app
def test_hydra_config_sets_local_steps_and_the_outer_optimizer():
    from lightning_stale.config import compose_config
    from lightning_stale.train import build_strategy

    cfg = compose_config("train", ["race=none", "engine=simulated", "variant=k_async", "variant.k=2",
                                   "variant.local_steps=4",
                                   "variant.outer_optimizer={class_path: torch.optim.SGD, "
                                   "init_args: {lr: 0.7, momentum: 0.9, nesterov: true}}"])
    strategy = build_strategy(cfg)
    assert isinstance(strategy, SimulatedStaleStrategy)
    assert strategy.local_steps == 4 and strategy.local_updates
    built = strategy._outer([torch.zeros(1, requires_grad=True)])
    assert isinstance(built, torch.optim.SGD) and built.defaults["nesterov"] is True
    assert built.defaults["lr"] == 0.7 and built.defaults["momentum"] == 0.9
    default = build_strategy(compose_config("train", ["race=none", "engine=simulated"]))
    assert default.local_steps == 1 and not default.local_updates
    # the server engine: the real learners' rounds on the central path
    real = build_strategy(compose_config("train", ["race=none", "engine=server", "variant=k_async",
                                                   "variant.k=2", "variant.local_steps=4"]))
    assert isinstance(real, StaleStrategy) and real.local_steps == 4 and real.local_updates
    assert real.server == "central" and real.outer_optimizer is None
    default = build_strategy(compose_config("train", ["race=none", "engine=server"]))
    assert default.local_steps == 1 and not default.local_updates


@pytest.mark.parametrize("overrides,message", [
    (["race=none", "engine=simulated", "variant.local_steps=0"], r"local_steps must be an integer >= 1.*got 0"),
    (["race=none", "engine=simulated", "variant.outer_optimizer=torch.optim.Nope"], "names no torch.optim"),
    (["race=none", "variant.local_steps=4", "engine.strategy.server=sharded"],
     r"engine.strategy.server=sharded with variant.local_steps=4: local updates run on the central path"),
    (["race=none", "engine=ddp", "variant.outer_optimizer=torch.optim.SGD"], r"not engine=ddp"),
])
def test_hydra_config_refuses_bad_local_updates(overrides, message):
    from lightning_stale.config import ConfigError, compose_config

    with pytest.raises(ConfigError, match=message):
        compose_config("train", overrides)


def test_lightning_cli_sets_local_steps_and_the_outer_optimizer():
    from test_namespaces import SIMULATED_ARGS, cli

    args = [*SIMULATED_ARGS, "--trainer.strategy.local_steps=4",
            "--trainer.strategy.outer_optimizer={class_path: torch.optim.SGD, init_args: "
            "{lr: 0.7, momentum: 0.9, nesterov: true}}"]
    strategy = cli("pytorch_lightning", args).trainer.strategy
    assert isinstance(strategy, SimulatedStaleStrategy) and strategy.local_steps == 4
    assert strategy.outer_optimizer == DILOCO


# ---------------------------------------------------------------- parameters without gradients
@pytest.mark.parametrize("cls,still", [(um.FrozenBackbone, "backbone"), (um.UnusedHead, "aux_head")])
def test_parameters_without_gradients_stay_put_under_local_updates(cls, still):
    """A frozen backbone (requires_grad_(False), handed to AdamW anyway) and a head no loss
    reaches (under weight decay) stay where they started, as under DDP; the rest trains. The
    outer step is DiLoCo's Nesterov with weight decay, which would move a parameter handed a zero
    pseudo-gradient instead of none."""
    decaying = {"class_path": DILOCO["class_path"], "init_args": {**DILOCO["init_args"], "weight_decay": 0.1}}
    torch.manual_seed(0)
    module = cls()
    start = {name: p.detach().clone() for name, p in module.named_parameters()}
    fit(module, um.BlobData(batch_size=16), variant="k_async", k=1, learners=2,
        strategy_kwargs={"local_steps": 3, "outer_optimizer": decaying}, max_steps=12, max_epochs=4)
    for name, p in module.named_parameters():
        moved = not torch.equal(p.detach(), start[name])
        assert moved != name.startswith(still), name
