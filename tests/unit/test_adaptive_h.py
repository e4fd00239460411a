"""AdaComm's adaptive H (Wang and Joshi, SysML 2019): H_l = ceil(sqrt(F(x_l) / F(x_0)) H_0),
at least 1, never growing; and the simulated engine's learners taking the new H at the start of their next round
(docs/how-to/local-updates.md, "Adaptive H")."""

import pickle

import pytest
import pytorch_lightning as pl
import torch
import user_modules as um
from engines import QUIET, books_balance
from pytorch_lightning import Callback

from lightning_stale import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.delays import Exponential
from lightning_stale.engine.simulated import SimulatedServer
from lightning_stale.method.adaptive import AdaptiveH
from lightning_stale.method.rules import ServerRules
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import VirtualCluster

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ---------------------------------------------------------------- the decision object
def test_follows_the_square_root_rule_on_hand_fed_losses():
    schedule = AdaptiveH(h0=8, interval_s=1.0, window=1)
    assert schedule.observe(0.5, 4.0) is None  # F(x_0) = 4, no boundary yet
    assert schedule.observe(1.0, 1.0) == 4  # ceil(sqrt(1 / 4) * 8) = 4 (exact: no rounding up)
    assert schedule.observe(1.5, 0.5) is None  # inside interval 1
    assert schedule.observe(2.2, 0.36) == 3  # ceil(sqrt(0.09) * 8) = ceil(2.4) = 3
    assert schedule.observe(3.1, 0.01) == 1  # ceil(sqrt(0.0025) * 8) = ceil(0.4) = 1
    assert schedule.observe(4.0, 1e-8) is None  # never below 1
    assert schedule.observe(5.0, 40.0) is None  # the loss rose: H never grows
    assert schedule.h == 1
    assert schedule.history == [(0.0, 8), (1.0, 4), (2.2, 3), (3.1, 1)]


def test_running_mean_boundaries_and_odd_losses():
    schedule = AdaptiveH(h0=16, interval_s=10.0, window=2)
    for time_s, loss in [(1, 9.0), (2, 7.0), (3, float("nan")), (4, 3.0)]:
        assert schedule.observe(time_s, loss) is None  # NaN is ignored
    assert schedule.initial_loss == 8.0  # mean of the first `window` losses
    # at the boundary the estimate is mean(3, 1) = 2: ceil(sqrt(2 / 8) * 16) = 8
    assert schedule.observe(35.0, 1.0) == 8
    assert schedule.observe(39.0, 0.01) is None  # same interval as 35: the next boundary is 40
    assert schedule.observe(40.0, -1.0) == 1  # a non-positive estimate counts as converged
    schedule.reset()
    assert schedule.h == 16 and schedule.history == [(0.0, 16)] and schedule.initial_loss is None


def test_create_forms():
    assert AdaptiveH.create(None, h0=4) is None
    assert repr(AdaptiveH.create(2.5, h0=4)) == "AdaptiveH(h0=4, interval_s=2.5, window=10)"
    made = AdaptiveH.create({"interval_s": 1, "window": 3}, h0=4)
    assert (made.h0, made.interval_s, made.window) == (4, 1.0, 3)
    given = AdaptiveH(4, 1.0)
    assert AdaptiveH.create(given, h0=4) is given


@pytest.mark.parametrize("spec,h0,message", [
    (1.0, 1, r"local_steps, which is 1 here.*give local_steps > 1"),
    (0.0, 4, r"interval_s must be a finite number > 0, got 0.0"),
    (float("inf"), 4, r"interval_s must be a finite number > 0, got inf"),
    ({"interval_s": 1.0, "window": 0}, 4, r"window must be an integer >= 1, got 0"),
    ({"interval_s": 1.0, "h0": 8}, 4, r"local_steps=4 disagrees with adaptive_h's h0=8"),
    ({"interval": 1.0}, 4, r"interval"),
    ("fast", 4, r"adaptive_h must be None, an AdaptiveH, a dict.*got 'fast'"),
    (True, 4, r"adaptive_h must be None.*got True"),
])
def test_bad_specs_are_refused(spec, h0, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AdaptiveH.create(spec, h0=h0)


# ---------------------------------------------------------------- the virtual clock
class OneSecond:
    def sample(self, learner):
        return 1.0


def test_learners_take_a_new_h_at_the_start_of_their_next_round():
    rules = ServerRules(Variant.create("async", 2))
    cluster = VirtualCluster(rules, OneSecond(), local_steps=3)
    first = cluster.next_finish()
    assert (first.time, first.local_steps) == (3.0, 3)  # the sum of 3 draws of 1 s
    cluster.local_steps = 2  # H changes while both learners are in their rounds
    cluster.apply(rules.on_push(first.learner, first.version))
    second = cluster.next_finish()  # the other learner's round started with H = 3
    assert (second.time, second.local_steps) == (3.0, 3)
    cluster.apply(rules.on_push(second.learner, second.version))
    restarted = [cluster.next_finish(), cluster.next_finish()]
    assert [(f.time, f.local_steps) for f in restarted] == [(5.0, 2), (5.0, 2)]


# ---------------------------------------------------------------- the simulated engine
class CountBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1


def fit(variant, k, learners, adaptive_h, max_steps, local_steps=8):
    counter = CountBatches()
    strategy = SimulatedStaleStrategy(variant, k, num_learners=learners, record_trace=False,
                                      delay=Exponential(1.0), local_steps=local_steps, adaptive_h=adaptive_h)
    trainer = pl.Trainer(strategy=strategy, callbacks=[counter], max_steps=max_steps,
                         limit_val_batches=0, **QUIET)
    model = um.WarmupAdamW(warmup=0.1)
    trainer.fit(model, datamodule=um.BlobData())
    return trainer, strategy, model, counter


def inner_steps(strategy, learner):
    states = strategy.server.inner_states.get(learner)
    return 0 if states is None else int(next(s for s in states if s)["step"])


def test_sync_h_shrinks_as_the_loss_falls_and_the_books_hold():
    torch.manual_seed(0)
    spec = {"interval_s": 8.0, "window": 2}
    trainer, strategy, model, counter = fit("sync", None, 2, spec, max_steps=400)
    stats = strategy.stats
    history = stats["h_history"]
    hs = [h for _, h in history]
    assert history[0] == (0.0, 8) and len(hs) > 2 and hs[-1] < 8
    assert hs == sorted(hs, reverse=True) and len(set(hs)) == len(hs)  # only shrinks
    assert [t for t, _ in history] == sorted(t for t, _ in history)
    assert books_balance(stats)
    # Under sync both learners of an update ran the same H: every batch is an inner step of a
    # push, and global_step (the inner steps along the server's trajectory) is half of them.
    assert 400 <= trainer.global_step < 400 + 8  # the update that reaches max_steps ends the fit
    assert counter.batches == 2 * trainer.global_step
    assert counter.batches == inner_steps(strategy, 0) + inner_steps(strategy, 1)
    assert stats["updates"] > 400 // 8  # more updates than a fixed H = 8 makes
    # the inner schedule counted the varying H: one step per inner step
    assert model.lr_schedulers().last_epoch == trainer.global_step
    assert spec == {"interval_s": 8.0, "window": 2}  # the caller's spec is left as it was


def test_k_async_with_staleness_keeps_the_invariant_and_varying_rounds():
    torch.manual_seed(1)
    _, strategy, _, counter = fit("k_async", 1, 3, {"interval_s": 6.0, "window": 2}, max_steps=300)
    stats = strategy.stats
    hs = [h for _, h in stats["h_history"]]
    assert hs[-1] < 8 and books_balance(stats)
    assert any(s > 0 for s in stats["staleness_histogram"])  # stale pseudo-gradients were applied
    # every batch trained on belongs to a round: the learners' inner steps add up to them
    assert counter.batches == sum(inner_steps(strategy, learner) for learner in range(3))


def test_the_schedule_survives_pickling_with_the_server():
    torch.manual_seed(0)
    trainer, strategy, _, _ = fit("sync", None, 2, 8.0, max_steps=120)
    server = strategy.server
    copy = pickle.loads(pickle.dumps(server))
    assert isinstance(copy, SimulatedServer)
    assert copy.adaptive_h.history == server.adaptive_h.history and copy.adaptive_h.h == server.adaptive_h.h
    assert copy.inner_steps == server.inner_steps == trainer.global_step
    assert copy.cluster.local_steps == server.adaptive_h.h


def test_checkpoint_resume_goes_on_with_the_schedule(tmp_path):
    torch.manual_seed(0)
    options = dict(num_learners=2, record_trace=False, delay=Exponential(1.0), local_steps=8,
                   adaptive_h={"interval_s": 8.0, "window": 2})
    first = SimulatedStaleStrategy("sync", **options)
    data = dict(n=960)  # 60 batches an epoch
    pl.Trainer(strategy=first, **{**QUIET, "max_epochs": 2, "enable_checkpointing": True,
                                  "default_root_dir": tmp_path}).fit(um.WarmupAdamW(warmup=0.1),
                                                                     datamodule=um.BlobData(**data))
    saved = next(tmp_path.rglob("*.ckpt"))
    before = pickle.loads(torch.load(saved, weights_only=True)["stale_server"]["engine"])
    assert len(before.adaptive_h.history) > 1  # H shrank before the save
    strategy = SimulatedStaleStrategy("sync", **options)
    trainer = pl.Trainer(strategy=strategy, **{**QUIET, "max_epochs": 4})
    trainer.fit(um.WarmupAdamW(warmup=0.1), datamodule=um.BlobData(**data), ckpt_path=str(saved))
    history = strategy.stats["h_history"]
    assert history[:len(before.adaptive_h.history)] == before.adaptive_h.history  # it went on
    assert len(history) > len(before.adaptive_h.history)
    assert trainer.global_step == strategy.server.inner_steps > before.inner_steps
    assert books_balance(strategy.stats)


# ---------------------------------------------------------------- bad input and the options
@pytest.mark.parametrize("kwargs,message", [
    (dict(adaptive_h=2.0), r"local_steps, which is 1 here"),
    (dict(local_steps=4, adaptive_h="fast"), r"adaptive_h must be None.*got 'fast'"),
    (dict(local_steps=4, adaptive_h={"interval_s": -1}), r"interval_s must be a finite number > 0, got -1"),
    (dict(local_steps=4, adaptive_h={"h0": 8, "interval_s": 1.0}), r"local_steps=4 disagrees"),
])
def test_simulated_strategy_refuses_bad_adaptive_h_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimulatedStaleStrategy("sync", **kwargs)


def test_stale_strategy_checks_adaptive_h_and_runs_it_on_the_central_path_only():
    with pytest.raises(ValueError, match=r"local_steps, which is 1 here"):
        StaleStrategy("sync", adaptive_h=2.0)
    with pytest.raises(ValueError, match=r"adaptive_h=2.0 with server='collective'.*server='central'"):
        StaleStrategy("sync", local_steps=4, adaptive_h=2.0, server="collective")
    strategy = StaleStrategy("k_sync", 2, local_steps=4, adaptive_h={"interval_s": 0.5, "window": 3})
    assert (strategy.server, strategy.local_steps) == ("central", 4)
    schedule = strategy.fresh_adaptive_h()
    assert (schedule.h0, schedule.interval_s, schedule.window) == (4, 0.5, 3)


def test_hydra_config_sets_adaptive_h():
    from lightning_stale.config import compose_config
    from lightning_stale.train import build_strategy

    cfg = compose_config("train", ["race=none", "engine=simulated", "variant=sync", "variant.local_steps=8",
                                   "+engine.strategy.adaptive_h={interval_s: 2.0, window: 3}"])
    strategy = build_strategy(cfg)
    assert isinstance(strategy, SimulatedStaleStrategy) and strategy.local_steps == 8
    schedule = strategy._fresh_adaptive_h()
    assert (schedule.h0, schedule.interval_s, schedule.window) == (8, 2.0, 3)


@pytest.mark.parametrize("overrides,message", [
    (["engine=simulated", "+engine.strategy.adaptive_h=2.0"], r"adaptive_h: .*local_steps, which is 1 here"),
    (["engine=simulated", "variant.local_steps=4", "+engine.strategy.adaptive_h=-1"],
     r"interval_s must be a finite number > 0"),
    (["variant.local_steps=4", "engine.strategy.server=collective", "+engine.strategy.adaptive_h=2.0"],
     r"adaptive H runs on engine=simulated and on engine=server's central path, not engine=server with "
     r"engine.strategy.server=collective"),
    (["engine=ddp", "variant.local_steps=4", "+engine.strategy.adaptive_h=2.0"], r"local updates run on"),
])
def test_hydra_config_refuses_bad_adaptive_h(overrides, message):
    from lightning_stale.config import ConfigError, compose_config

    with pytest.raises(ConfigError, match=message):
        compose_config("train", ["race=none", *overrides])


def test_lightning_cli_sets_adaptive_h():
    from test_namespaces import SIMULATED_ARGS, cli

    args = [*SIMULATED_ARGS, "--trainer.strategy.local_steps=4",
            "--trainer.strategy.adaptive_h={interval_s: 0.5, window: 3}"]
    strategy = cli("pytorch_lightning", args).trainer.strategy
    assert isinstance(strategy, SimulatedStaleStrategy) and strategy.local_steps == 4
    schedule = strategy._fresh_adaptive_h()
    assert (schedule.h0, schedule.interval_s, schedule.window) == (4, 0.5, 3)
