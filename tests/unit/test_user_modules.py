"""Modules as users write them for ``strategy="ddp"``, unchanged on both engines, in this process:
the simulated engine (P = 2 or 3 learners) and the real engine with one learner process (P = 1).

What DDP would do is spelled out in each test: the same optimizer step on the same gradient,
parameters that no gradient reached left alone, ``estimated_stepping_batches`` counting optimizer
steps (server updates here), a plateau scheduler stepped with the monitored value after each
epoch's validation, buffers that are model state.
"""

import copy

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback

import user_modules as um
from engines import QUIET, books_balance, fit, server_lr

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OPTIMIZERS = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                    and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
                    and n not in ("Optimizer", "LBFGS", "SparseAdam"))
OPTIONS = {"SGD": dict(momentum=0.9, nesterov=True), "Adadelta": dict(lr=0.5), "Adam": dict(amsgrad=True),
           "RMSprop": dict(momentum=0.5, centered=True)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_optimizer(name, lr=0.05):
    """``torch.optim.<name>`` with a learning rate per group and, where it has one, weight decay
    on the first group only."""
    cls = getattr(torch.optim, name)

    def build(groups):
        options = dict(OPTIONS.get(name, {}))
        base_lr = options.pop("lr", lr)
        first, second = dict(groups[0], lr=base_lr), dict(groups[1], lr=base_lr / 2)
        probe = cls([torch.zeros(2, 2, requires_grad=True)])
        if "weight_decay" in probe.defaults:
            first["weight_decay"] = 0.1
        return cls([first, second], **options)

    return build


def alone(module, steps):
    """What the module's own optimizer does in ``steps`` plain steps (what every DDP rank does
    with the all-reduced gradient, which here is the same on every mini-batch)."""
    module = copy.deepcopy(module)
    optimizer = module.configure_optimizers()
    batch = next(iter(module.train_dataloader()))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        module.loss(batch).backward()
        optimizer.step()
    return module


def assert_same_parameters(trained, reference):
    for (name, a), b in zip(trained.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_torch_optimizer_steps_as_it_does_alone(engine, name):
    torch.manual_seed(0)
    module = um.AnyOptimizer(make_optimizer(name))
    initial = copy.deepcopy(module)
    expected = alone(module, 3)
    trainer = fit(engine, module, max_steps=3)
    assert trainer.strategy.stats["updates"] == 3 == trainer.global_step
    assert_same_parameters(module, expected)
    assert not torch.equal(module.body.weight, initial.body.weight)
    # the frozen layer and the unused head (weight decay included) never move, as under DDP
    assert torch.equal(module.frozen.weight, initial.frozen.weight)
    assert torch.equal(module.unused.weight, initial.unused.weight)
    server = trainer.strategy.core.state.optimizer
    assert type(server) is getattr(torch.optim, name)
    assert [g["lr"] for g in server.param_groups] == [g["lr"] for g in expected.configure_optimizers().param_groups]


def test_sparse_adam_on_a_sparse_embedding(engine):
    torch.manual_seed(0)
    module = um.AnyOptimizer(lambda groups: torch.optim.SparseAdam(groups, lr=0.1), sparse=True)
    initial = copy.deepcopy(module)
    expected = alone(module, 3)
    fit(engine, module, max_steps=3)
    assert_same_parameters(module, expected)
    rows_moved = (module.embedding.weight != initial.embedding.weight).any(1)
    assert 0 < rows_moved.sum() < 10  # only the rows looked up


def test_lbfgs_is_refused_before_training_with_the_reason(engine):
    module = um.AnyOptimizer(lambda groups: torch.optim.LBFGS(groups[0]["params"]))
    with pytest.raises(ValueError, match=r"LBFGS re-evaluates the loss.*Use a first-order optimizer"):
        fit(engine, module, max_steps=3)


def test_a_third_party_optimizer_with_an_option_outside_its_defaults(engine):
    torch.manual_seed(0)
    module = um.AnyOptimizer(lambda groups: um.Lion(groups, lr=0.01, weight_decay=0.1, sign_scale=0.5))
    expected = alone(module, 3)
    trainer = fit(engine, module, max_steps=3)
    assert_same_parameters(module, expected)
    assert trainer.strategy.core.state.optimizer.sign_scale == 0.5


def test_an_optimizer_that_cannot_be_rebuilt_with_a_scheduler(engine):
    class WithSchedule(um.AnyOptimizer):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(0)
    module = WithSchedule(lambda groups: um.Scheduled(groups, milestones=[2], lr=0.1))
    reference = copy.deepcopy(module)
    configured = reference.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    batch = next(iter(reference.train_dataloader()))
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        reference.loss(batch).backward()
        optimizer.step()
        scheduler.step()
    trainer = fit(engine, module, max_steps=3)
    server = trainer.strategy.core.state.optimizer
    assert type(server) is um.Scheduled and server.milestones == [2]
    assert_same_parameters(module, reference)  # the server's copy stepped, not the learner's
    assert trainer.optimizers[0].state_dict()["state"] == {}  # the learner's never steps


@pytest.mark.parametrize("cls,still", [(um.FrozenBackbone, "backbone"), (um.UnusedHead, "aux_head")])
def test_frozen_backbone_and_unused_head_under_weight_decay(engine, cls, still):
    pl.seed_everything(0)
    model = cls()
    before = copy.deepcopy(model)
    trainer = fit(engine, model, um.BlobData(), variant="k_async", max_steps=8)
    for (name, p), q in zip(getattr(model, still).named_parameters(), getattr(before, still).parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.net[0].weight, before.net[0].weight)
    # AdamW never stepped them: no moments for them on the server
    state = trainer.strategy.core.state
    server_of = dict(zip([n for n, p in model.named_parameters() if p.requires_grad], state.params))
    kept = {id(server_of.get(n, p)) for n, p in model.named_parameters() if n.startswith(still + ".")}
    held = [p for group in state.optimizer.param_groups for p in group["params"]]
    assert kept and kept <= {id(p) for p in held}
    assert all(bool(state.optimizer.state.get(p)) == (id(p) not in kept) for p in held)


class LearningRates(Callback):
    """The server's learning rate after every training batch, with the update count."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append((trainer.global_step, server_lr(trainer), trainer.current_epoch))


@pytest.mark.parametrize("limits", [dict(max_steps=20), dict(max_epochs=2), dict(max_epochs=3, max_steps=40)])
def test_linear_warmup_sized_from_estimated_stepping_batches(engine, limits):
    pl.seed_everything(0)
    model = um.WarmupAdamW(warmup=0.5)
    lrs = LearningRates()
    trainer = fit(engine, model, um.BlobData(batch_size=16), variant="k_async", k=2, learners=3,
                  callbacks=[lrs], **limits)
    stats = trainer.strategy.stats
    # the warm-up was sized from the updates this fit made: max_steps, or epochs x updates per
    # epoch (K pushes of a 12-batch epoch each; the real engine's P = 1 learner makes 12)
    assert model.total_steps == stats["updates"] == trainer.global_step
    if "max_epochs" in limits and model.total_steps < limits.get("max_steps", 10**9):
        assert stats["epochs"] == limits["max_epochs"]
    warmup = int(0.5 * model.total_steps)
    for updates, lr, _ in lrs.seen:
        assert lr == pytest.approx(0.01 * min(1.0, (updates + 1) / warmup))
    assert server_lr(trainer) == pytest.approx(0.01)  # warm-up done
    assert books_balance(stats)


def test_lr_monitor_and_checkpoints_see_the_schedule_the_server_follows(engine, tmp_path):
    import csv

    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.loggers import CSVLogger

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6 and not (tmp_path / "mid.ckpt").exists():
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    pl.seed_everything(0)
    model = um.WarmupAdamW(warmup=0.5)  # 12 updates: 6 of warm-up
    trainer = fit(engine, model, um.BlobData(), variant="async", max_steps=12, log_every_n_steps=1,
                  logger=CSVLogger(tmp_path), callbacks=[LearningRateMonitor("step"), SaveAt()])
    rows = list(csv.DictReader(open(trainer.logger.log_dir + "/metrics.csv")))
    logged = [(int(r["step"]), float(r["lr-AdamW"])) for r in rows if r.get("lr-AdamW")]
    assert [step for step, _ in logged] == list(range(12))  # one learner's batches: updates here
    for step, lr in logged:
        assert lr == pytest.approx(0.01 * min(1.0, (step + 1) / 6))
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    assert saved["lr_schedulers"][0]["last_epoch"] == 6
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.01)
    # the checkpoint goes on under plain Lightning with the schedule where the server left it
    resumed = um.WarmupAdamW(warmup=0.5)
    plain = pl.Trainer(max_steps=8, **{**QUIET, "logger": False})
    plain.fit(resumed, um.BlobData(), ckpt_path=tmp_path / "mid.ckpt")
    assert plain.lr_scheduler_configs[0].scheduler.last_epoch == 8


class ValidationLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_validation_end(self, trainer, *args):
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val/loss"]))


def test_reduce_lr_on_plateau_falls_with_the_validation_loss(engine):
    pl.seed_everything(0)
    model = um.Plateau(lr=0.2, factor=0.5)
    seen, lrs = ValidationLosses(), LearningRates()
    trainer = fit(engine, model, um.BlobData(val_noise_labels=True), variant="async", max_epochs=5,
                  callbacks=[seen, lrs])
    # the same scheduler fed the same values after each epoch's validation, as Lightning does
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(reference, mode="min", factor=0.5, patience=0)
    expected = []
    for loss in seen.losses:
        plateau.step(loss)
        expected.append(reference.param_groups[0]["lr"])
    assert len(seen.losses) == 5 and expected[-1] < 0.2  # the loss stalled: the lr fell
    # during each epoch the server used the lr set after the previous epoch's validation
    for epoch in range(1, 5):
        assert [lr for _, lr, e in lrs.seen if e == epoch][-1] == pytest.approx(expected[epoch - 1])
    assert server_lr(trainer) == pytest.approx(expected[-1])  # the last epoch's step too


def evaluate(module, loader):
    """A single-process evaluation: the mean validation loss over the batches."""
    module.eval()
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(module(x), y) for x, y in loader]
    return float(sum(losses) / len(losses))


def test_batchnorm_buffers_are_server_state(engine, tmp_path):
    class Checked(um.BatchNormCNN):
        """Notes whether each mini-batch starts from the server's buffers (K-sync: every
        learner computes at the newest version)."""

        def training_step(self, batch, batch_idx):
            server = self.trainer.strategy.core.state
            self.started_at_server.append(torch.equal(self.net[1].running_mean, server.buffers[0]))
            return super().training_step(batch, batch_idx)

    class ValidatesServerState(Callback):
        """Every validation hook, a callback's ``on_validation_start`` included, sees the
        server's parameters and buffers."""

        def __init__(self):
            self.same = []

        def on_validation_start(self, trainer, pl_module):
            named = trainer.strategy.core.state.named_state(pl_module)
            self.same.append(all(torch.equal(pl_module.state_dict()[n], v) for n, v in named.items()))

    pl.seed_everything(0)
    data = um.BlobData(image=True)
    model = Checked()
    model.started_at_server = []
    initial_mean = model.net[1].running_mean.clone()
    validations = ValidatesServerState()
    trainer = fit(engine, model, data, variant="k_sync", k=2, learners=3, max_epochs=2,
                  check_val_every_n_epoch=1, callbacks=[validations])
    assert validations.same == [True, True]
    state = trainer.strategy.core.state
    named = state.named_state(model)
    # the server holds the buffers, and the module (validated, checkpointed) has the server's
    assert {"net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"} <= set(named)
    for name, value in named.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert not torch.equal(named["net.1.running_mean"], initial_mean)
    assert len(model.started_at_server) >= 24 and all(model.started_at_server)
    trainer.save_checkpoint(tmp_path / "bn.ckpt")
    restored = um.BatchNormCNN.load_from_checkpoint(tmp_path / "bn.ckpt")
    data.setup()
    assert evaluate(restored, data.val_dataloader()) == pytest.approx(
        float(trainer.callback_metrics["val/loss"]), rel=1e-5)


@pytest.mark.parametrize("limit,epochs,pushes", [(5, 3, 15), (0.5, 2, 12)])
def test_limit_train_batches_shapes_the_servers_epochs(engine, limit, epochs, pushes):
    pl.seed_everything(0)
    trainer = fit(engine, um.Classifier(), um.BlobData(batch_size=16), variant="async",
                  limit_train_batches=limit, max_epochs=epochs)
    stats = trainer.strategy.stats
    # 12 batches of 16 per epoch, cut to `limit`; one learner's worth of pushes per DDP step
    assert stats["epochs"] == epochs and stats["gradients_received"] == pushes
    assert stats["updates"] == pushes == trainer.global_step and books_balance(stats)


def test_max_time_stops_the_fit(engine):
    import time

    class Slow(um.Classifier):
        def training_step(self, batch, batch_idx):
            time.sleep(0.01)
            return super().training_step(batch, batch_idx)

    pl.seed_everything(0)
    started = time.monotonic()
    trainer = fit(engine, Slow(), um.BlobData(batch_size=16), variant="async",
                  max_time={"seconds": 1})
    elapsed = time.monotonic() - started
    stats = trainer.strategy.stats
    assert 1.0 <= elapsed < 6.0 and trainer.state.finished
    assert 0 < stats["updates"] == trainer.global_step < 100 and books_balance(stats)


def test_val_check_interval_mid_epoch_validates_the_server_or_is_refused_saying_what_to_do(engine):
    pl.seed_everything(0)
    seen = ValidationLosses()
    if engine == "stale":  # learners pause only at the server's epoch ends
        with pytest.raises(ValueError, match=r"val_check_interval must be 1.0.*check_val_every_n_epoch"
                                             r".*limit_train_batches"):
            fit(engine, um.Classifier(), um.BlobData(), max_epochs=1, val_check_interval=0.5)
        return
    trainer = fit(engine, um.Classifier(), um.BlobData(), variant="k_async", learners=3,
                  max_epochs=2, val_check_interval=0.5, callbacks=[seen])
    assert len(seen.losses) == 4 and trainer.strategy.stats["epochs"] == 2


class TwoOptimizers(um.Classifier):
    """Several optimizers: Lightning asks for manual optimization."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.Adam(self.net[2].parameters(), lr=0.01)]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for optimizer in self.optimizers():
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()


class Manual(um.Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


@pytest.mark.parametrize("cls,reason", [
    (Manual, r"manual optimization is not supported: .*use automatic optimization"),
    (TwoOptimizers, r"manual optimization is not supported.*; exactly one optimizer is supported, got 2"
                    r".*use one optimizer with a parameter group per part of the model"),
])
def test_manual_optimization_and_several_optimizers_are_refused_with_the_reason(engine, cls, reason):
    with pytest.raises(ValueError, match=reason):
        fit(engine, cls(), um.BlobData(), max_steps=3)
