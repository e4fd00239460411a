"""The delayed Nesterov momentum (DN) outer optimizer (lightning_stale.method.delayed_nesterov; Liu
et al., arXiv 2401.09135, Algorithm 3): its updates by hand, N = 1 as Nesterov, a cycle as one
Nesterov step on the cycle's mean, a state_dict taken inside a cycle, bad arguments, and fits
through ``outer_optimizer``: on the simulated engine (one by hand, some with stale pushes) and on
StaleStrategy's engine in process (tests/inprocess.py: central and collective paths, every update
by hand)."""

import copy
import io

import pytest
import pytorch_lightning as pl
import torch
import user_modules as um
from engines import QUIET, books_balance
from inprocess import InProcessRun, blob_batches, isclose
from test_local_updates_real import MomentumClassifier
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.delays import Exponential
from lightning_stale.method.delayed_nesterov import DelayedNesterov

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

DN_PATH = "lightning_stale.method.delayed_nesterov.DelayedNesterov"


def run(optimizer, params, grads):
    """Step ``optimizer`` once per entry of ``grads`` (one tensor per parameter); the parameters
    after each step."""
    seen = []
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        optimizer.step()
        seen.append([p.detach().clone() for p in params])
    return seen


def algorithm_3(theta, grads, lr, beta, n, c):
    """Algorithm 3 of the paper written out line by line on one tensor: the thetas after each update."""
    m, delta, out = torch.zeros_like(theta), torch.zeros_like(theta), []
    for t, g in enumerate(grads):
        delta = delta + g
        if (t + 1) % n == 0:
            m = beta * m + delta / n
            theta = theta - lr * ((1 - c * n + c) * beta * m + g / n)
            delta = torch.zeros_like(theta)
        else:
            theta = theta - lr * (c * beta * m + g / n)
        out.append(theta)
    return out


def random_grads(steps, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(steps)]


# ---------------------------------------------------------------- the updates by hand
@pytest.mark.parametrize("c,expected", [
    # N = 2, beta = 0.5, lr = 1, g = 1, 2, 3, 4 from theta = 0, worked out on paper:
    # c = 0: t0 -0.5 (g/N); t1 m = 3/2, -0.5 - (0.5 * 1.5 + 1); t2 -1.5; t3 m = 0.75 + 7/2, -(0.5 * 4.25 + 2)
    (0.0, [-0.5, -2.25, -3.75, -7.875]),
    # c = 1/N: every step carries c beta m (the old m between momentum updates), the milestone (1 - cN + c) = 1/2
    (0.5, [-0.5, -1.875, -3.75, -6.8125]),
    # c = 1/4: the milestone carries 1 - 1/2 + 1/4 = 3/4 of beta m
    (0.25, [-0.5, -2.0625, -3.75, -7.34375]),
])
def test_updates_by_hand(c, expected):
    theta = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = DelayedNesterov([theta], lr=1.0, momentum=0.5, period=2, momentum_activation=c)
    got = run(optimizer, [theta], [[torch.tensor([g], dtype=torch.float64)] for g in (1.0, 2.0, 3.0, 4.0)])
    assert [float(p[0]) for p in got] == expected
    state = optimizer.state[theta]
    assert state["step"] == 4 and float(state["momentum_buffer"]) == 4.25
    assert float(state["pseudo_gradient_sum"]) == 0.0  # emptied at the 4th, a momentum update


@pytest.mark.parametrize("n,c", [(3, 0.0), (3, 1 / 3), (4, 0.1), (5, 0.0)])
def test_several_parameters_follow_algorithm_3(n, c):
    shapes = [(3, 2), (2,)]
    params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    with torch.no_grad():
        params[0].normal_(generator=torch.Generator().manual_seed(5))
    start = [p.detach().clone() for p in params]
    grads = random_grads(11, shapes)  # several cycles and a partial one
    got = run(DelayedNesterov(params, lr=0.3, momentum=0.9, period=n, momentum_activation=c), params, grads)
    for i in range(len(shapes)):
        for mine, theirs in zip([step[i] for step in got], algorithm_3(start[i], [g[i] for g in grads],
                                                                        0.3, 0.9, n, c)):
            torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("c", [0.0, 0.4, 1.0])
def test_a_period_of_one_is_nesterov_on_every_update(c):
    """N = 1: m_{t+1} = beta m_t + g_t, theta - eps (beta m_{t+1} + g_t), which is the paper's
    Eq. 4 (theta - eps (beta^2 m_t + (1 + beta) g_t)) and torch's SGD with Nesterov momentum."""
    shapes = [(4,), (2, 3)]
    grads = random_grads(6, shapes, seed=1)
    mine = [torch.ones(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    torchs = [torch.ones(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    got = run(DelayedNesterov(mine, lr=0.7, momentum=0.9, period=1, momentum_activation=c), mine, grads)
    want = run(torch.optim.SGD(torchs, lr=0.7, momentum=0.9, nesterov=True), torchs, grads)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    # Eq. 4 by hand on the first parameter
    theta, m = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for step, gs in zip(got, grads):
        theta = theta - 0.7 * (0.81 * m + 1.9 * gs[0])
        m = 0.9 * m + gs[0]
        torch.testing.assert_close(step[0], theta)


def test_a_cycle_is_one_nesterov_step_on_the_mean_of_its_pseudo_gradients():
    """c = 0: after every N-th update theta is where Nesterov (N = 1) on the cycles' means puts it."""
    n, cycles = 4, 3
    grads = random_grads(n * cycles, [(5,)], seed=2)
    delayed = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    plain = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    got = run(DelayedNesterov([delayed], lr=0.5, momentum=0.8, period=n), [delayed], grads)
    means = [[torch.stack([g[0] for g in grads[i * n:(i + 1) * n]]).mean(0)] for i in range(cycles)]
    want = run(DelayedNesterov([plain], lr=0.5, momentum=0.8, period=1), [plain], means)
    for i in range(cycles):
        torch.testing.assert_close(got[(i + 1) * n - 1][0], want[i][0])
    assert not torch.allclose(got[n][0], got[n - 1][0])  # and it moves in between


def test_a_parameter_without_a_pseudo_gradient_is_skipped_and_its_cycle_waits():
    a = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    b = torch.ones(2, dtype=torch.float64, requires_grad=True)
    optimizer = DelayedNesterov([a, b], lr=1.0, momentum=0.5, period=2)
    a.grad, b.grad = torch.ones(2, dtype=torch.float64), None
    optimizer.step()
    assert torch.equal(b, torch.ones(2, dtype=torch.float64)) and b not in optimizer.state
    assert optimizer.state[a]["step"] == 1
    a.grad = b.grad = torch.ones(2, dtype=torch.float64)
    optimizer.step()
    assert optimizer.state[a]["step"] == 2 and optimizer.state[b]["step"] == 1
    assert float(optimizer.state[a]["momentum_buffer"][0]) == 1.0  # a's momentum update
    assert float(optimizer.state[b]["momentum_buffer"][0]) == 0.0  # b's first update of its cycle


# ---------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_inside_a_cycle():
    shapes = [(3,), (2, 2)]
    grads = random_grads(10, shapes, seed=3)
    through = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    optimizer = DelayedNesterov(through, lr=0.4, momentum=0.9, period=3, momentum_activation=0.1)
    want = run(optimizer, through, grads)

    first = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    before = DelayedNesterov(first, lr=0.4, momentum=0.9, period=3, momentum_activation=0.1)
    run(before, first, grads[:5])  # 5 updates: two into the second cycle
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "optimizer": before.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # as a Lightning checkpoint is read
    assert saved["optimizer"]["state"][0]["step"] == 5
    assert saved["optimizer"]["state"][0]["pseudo_gradient_sum"].abs().sum() > 0  # a sum in progress

    resumed = [p.clone().requires_grad_(True) for p in saved["params"]]
    after = DelayedNesterov(resumed, lr=1.0, momentum=0.5, period=7)  # the state's groups replace these
    after.load_state_dict(saved["optimizer"])
    assert after.param_groups[0]["period"] == 3 and after.param_groups[0]["momentum_activation"] == 0.1
    got = run(after, resumed, grads[5:])
    for a, b in zip(got, want[5:]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("kwargs,message", [
    ({"lr": -0.1}, r"lr must be a finite number >= 0, got -0.1"),
    ({"lr": float("nan")}, r"lr must be a finite number >= 0, got nan"),
    ({"momentum": 0.0}, r"momentum \(beta\) must be in \(0, 1\), got 0.0"),
    ({"momentum": 1.0}, r"momentum \(beta\) must be in \(0, 1\), got 1.0"),
    ({"momentum": True}, r"momentum \(beta\) must be in \(0, 1\), got True"),
    ({"period": 0}, r"period \(N\) must be an integer >= 1, got 0"),
    ({"period": 2.5}, r"period \(N\) must be an integer >= 1, got 2.5"),
    ({"period": True}, r"period \(N\) must be an integer >= 1, got True"),
    ({"momentum_activation": -0.1}, r"momentum_activation \(c\) must be in \[0, 1/period\] = \[0, 0.25\], got -0.1"),
    ({"period": 4, "momentum_activation": 0.3}, r"\[0, 0.25\], got 0.3"),
])
def test_bad_arguments_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedNesterov([torch.zeros(1, requires_grad=True)], **kwargs)


def test_a_bad_value_in_a_parameter_group_is_refused():
    with pytest.raises(ValueError, match=r"period \(N\) must be an integer >= 1, got -2"):
        DelayedNesterov([{"params": [torch.zeros(1, requires_grad=True)], "period": -2}])


def test_the_strategies_take_the_class_path_and_refuse_its_bad_arguments():
    spec = {"class_path": DN_PATH, "init_args": {"lr": 0.7, "momentum": 0.9, "period": 4}}
    assert SimulatedStaleStrategy("async", num_learners=2, local_steps=2, outer_optimizer=spec).local_updates
    assert StaleStrategy("async", local_steps=2, outer_optimizer=spec).local_steps == 2
    bad = {"class_path": DN_PATH, "init_args": {"period": 0}}
    for build in (lambda: SimulatedStaleStrategy("async", num_learners=2, local_steps=2, outer_optimizer=bad),
                  lambda: StaleStrategy("async", local_steps=2, outer_optimizer=bad)):
        with pytest.raises(ValueError, match=r"cannot be built.*period \(N\) must be an integer >= 1, got 0"):
            build()


# ---------------------------------------------------------------- fits through outer_optimizer
class Linear(pl.LightningModule):
    """y = x w + b with plain SGD; records every batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layer = nn.Linear(3, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        return F.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 3, generator=g)
        return DataLoader(TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3), batch_size=8)


def test_a_fit_applies_algorithm_3_to_each_server_update():
    """One learner under async, H = 2 SGD steps per push: each push is a server update, and the
    server's parameters follow Algorithm 3 on the pushes' pseudo-gradients, worked out here."""
    h, updates, n = 2, 5, 2
    module = Linear()
    w, b = module.layer.weight.detach().clone(), module.layer.bias.detach().clone()
    strategy = SimulatedStaleStrategy("async", num_learners=1, record_trace=False, local_steps=h,
                                      outer_optimizer={"class_path": DN_PATH,
                                                       "init_args": {"lr": 0.7, "momentum": 0.9, "period": n}})
    pl.Trainer(strategy=strategy, max_steps=h * updates, **QUIET).fit(module)
    assert strategy.stats["updates"] == updates and len(module.seen) == h * updates
    theta = torch.cat([w.reshape(-1), b])
    m, delta = torch.zeros(4), torch.zeros(4)
    for t in range(updates):
        weight, bias = theta[:3].view(1, 3).clone().requires_grad_(True), theta[3:].clone().requires_grad_(True)
        for x, y in module.seen[t * h:(t + 1) * h]:
            loss = F.mse_loss((x @ weight.T + bias).squeeze(-1), y)
            gw, gb = torch.autograd.grad(loss, [weight, bias])
            with torch.no_grad():
                weight -= 0.1 * gw
                bias -= 0.1 * gb
        g = theta - torch.cat([weight.detach().reshape(-1), bias.detach()])  # the pseudo-gradient
        delta = delta + g
        if (t + 1) % n == 0:
            m = 0.9 * m + delta / n
            theta = theta - 0.7 * (0.9 * m + g / n)
            delta = torch.zeros(4)
        else:
            theta = theta - 0.7 * g / n
    torch.testing.assert_close(module.layer.weight.detach().reshape(-1), theta[:3])
    torch.testing.assert_close(module.layer.bias.detach(), theta[3:])


@pytest.mark.parametrize("variant,k", [("async", None), ("k_async", 2)])
def test_a_fit_with_stale_pushes_trains_with_delayed_nesterov(variant, k):
    torch.manual_seed(0)
    module, data = um.WarmupAdamW(), um.BlobData()
    data.setup("fit")
    x, y = um.blobs()
    with torch.no_grad():
        start = float(F.cross_entropy(module(x), y))
    spec = {"class_path": DN_PATH, "init_args": {"lr": 0.7, "momentum": 0.9, "period": 3}}
    strategy = SimulatedStaleStrategy(variant, k, num_learners=3, record_trace=False, local_steps=2,
                                      delay=Exponential(1.0), outer_optimizer=spec)
    pl.Trainer(strategy=strategy, max_epochs=3, **QUIET).fit(module, datamodule=data)
    stats = strategy.stats
    outer = strategy.server.core.state.optimizer
    assert isinstance(outer, DelayedNesterov) and outer.defaults["period"] == 3
    assert {s["step"] for s in outer.state.values()} == {stats["updates"]}  # one DN step per update
    assert any(s > 0 for s in stats["staleness_histogram"]) and books_balance(stats)
    with torch.no_grad():
        end = float(F.cross_entropy(module(x), y))
    assert end < 0.7 * start, (start, end)


def test_a_checkpoint_keeps_the_delayed_nesterov_state(tmp_path):
    torch.manual_seed(0)
    spec = {"class_path": DN_PATH, "init_args": {"period": 3}}
    strategy = SimulatedStaleStrategy("async", num_learners=2, record_trace=False, local_steps=2,
                                      delay=Exponential(1.0), outer_optimizer=spec)
    trainer = pl.Trainer(strategy=strategy, **{**QUIET, "max_epochs": 1, "enable_checkpointing": True,
                                                "default_root_dir": tmp_path})
    trainer.fit(um.WarmupAdamW(), datamodule=um.BlobData())
    saved = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=True)["stale_server"]["outer_optimizer"]
    live = copy.deepcopy(strategy.server.core.state.optimizer.state_dict())
    assert saved["param_groups"][0]["period"] == 3
    for i, state in live["state"].items():
        assert saved["state"][i]["step"] == state["step"] == strategy.stats["updates"]
        torch.testing.assert_close(saved["state"][i]["momentum_buffer"], state["momentum_buffer"])
        torch.testing.assert_close(saved["state"][i]["pseudo_gradient_sum"], state["pseudo_gradient_sum"])


def test_the_hydra_app_takes_the_class_path_and_refuses_its_bad_arguments():
    from lightning_stale.config import ConfigError, compose_config
    from lightning_stale.train import build_strategy

    base = ["race=none", "engine=simulated", "variant=async", "variant.local_steps=4"]
    cfg = compose_config("train", [*base, f"variant.outer_optimizer={{class_path: {DN_PATH}, "
                                          "init_args: {lr: 0.5, period: 8, momentum_activation: 0.1}}"])
    built = build_strategy(cfg)._outer([torch.zeros(1, requires_grad=True)])
    assert isinstance(built, DelayedNesterov)
    assert (built.defaults["lr"], built.defaults["period"], built.defaults["momentum_activation"]) == (0.5, 8, 0.1)
    with pytest.raises(ConfigError, match=r"variant.outer_optimizer.*momentum_activation \(c\) must be in "
                                          r"\[0, 1/period\] = \[0, 0.125\], got 0.5"):
        compose_config("train", [*base, f"variant.outer_optimizer={{class_path: {DN_PATH}, "
                                        "init_args: {period: 8, momentum_activation: 0.5}}"])


# ---------------------------------------------------------------- StaleStrategy's engine, in process
def check_algorithm_3(run, lr, beta, n):
    """Every server update of a real-engine run, by hand: g_t is the mean of the update's pushed
    pseudo-gradients, and w moves as Algorithm 3 says."""
    assert [u.update.index for u in run.updates] == list(range(1, len(run.updates) + 1))
    m = delta = torch.zeros_like(run.parameters(0))
    for t, recorded in enumerate(run.updates):
        update = recorded.update
        g = sum(run.pushed(p.id).gradient for p in update.gradients) / len(update.gradients)
        delta = delta + g
        if (t + 1) % n == 0:
            m = beta * m + delta / n
            step, delta = beta * m + g / n, torch.zeros_like(delta)
        else:
            step = g / n
        assert isclose(run.parameters(update.version), run.parameters(update.version - 1) - lr * step), t


@pytest.mark.parametrize("variant,path", [("async", "central"), ("k_async", "central"), ("sync", "collective")])
def test_the_real_engine_applies_algorithm_3(variant, path):
    torch.manual_seed(0)
    spec = {"class_path": DN_PATH, "init_args": {"lr": 0.7, "momentum": 0.9, "period": 3}}
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), variant, p=2,
                       k=2 if variant == "k_async" else None, max_updates=7, local_steps=2,
                       outer_optimizer=spec, path=path).fit()
    assert run.stats["updates"] == 7 and books_balance(run.stats)
    if variant == "async":  # P = 2, one push per update: every push after the first is stale
        assert run.stats["staleness_histogram"].get(1, 0) > 0
    check_algorithm_3(run, 0.7, 0.9, 3)
