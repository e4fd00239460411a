"""Modules as users write them for ``strategy="ddp"``, unchanged on both engines, in this process:
the simulated engine (P = 2 or 3 learners) and the real engine with one learner process (P = 1).
Optimizers, frozen and unused parameters, buffers; schedules and the Trainer's limits are in
test_user_schedules.py.

What DDP would do is spelled out in each test: the same optimizer step on the same gradient,
parameters that no gradient reached left alone, buffers that are model state.
"""

import copy

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback

import user_modules as um
from engines import fit

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

OPTIMIZERS = sorted(
    n
    for n in dir(torch.optim)
    if isinstance(getattr(torch.optim, n), type)
    and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
    and n not in ("Optimizer", "LBFGS", "SparseAdam")
)
OPTIONS = {
    "SGD": dict(momentum=0.9, nesterov=True),
    "Adadelta": dict(lr=0.5),
    "Adam": dict(amsgrad=True),
    "RMSprop": dict(momentum=0.5, centered=True),
}




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
    assert [g["lr"] for g in server.param_groups] == [
        g["lr"] for g in expected.configure_optimizers().param_groups
    ]
    # a checkpoint written after fit holds the server's optimizer state (momentum, moments)
    trainer.save_checkpoint("after_fit.ckpt")
    saved = torch.load("after_fit.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    held = server.state_dict()["state"]
    assert held and saved.keys() == held.keys()
    for index, values in held.items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(saved[index][key]), torch.as_tensor(value)), (index, key)


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
    with pytest.raises(
        ValueError, match=r"LBFGS re-evaluates the loss.*Use a first-order optimizer"
    ):
        fit(engine, module, max_steps=3)


def test_a_third_party_optimizer_with_an_option_outside_its_defaults(engine):
    torch.manual_seed(0)
    module = um.AnyOptimizer(
        lambda groups: um.Lion(groups, lr=0.01, weight_decay=0.1, sign_scale=0.5)
    )
    expected = alone(module, 3)
    trainer = fit(engine, module, max_steps=3)
    assert_same_parameters(module, expected)
    assert trainer.strategy.core.state.optimizer.sign_scale == 0.5


def test_an_optimizer_that_cannot_be_rebuilt_with_a_scheduler(engine):
    class WithSchedule(um.AnyOptimizer):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

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
    # the learner's never steps; after fit it holds the server's state (what checkpoints save)
    learner, held = trainer.optimizers[0].state_dict()["state"], server.state_dict()["state"]
    assert learner.keys() == held.keys() and all(
        torch.equal(learner[i]["momentum_buffer"], held[i]["momentum_buffer"]) for i in held)


@pytest.mark.parametrize(
    "cls,still", [(um.FrozenBackbone, "backbone"), (um.UnusedHead, "aux_head")]
)
def test_frozen_backbone_and_unused_head_under_weight_decay(engine, cls, still):
    pl.seed_everything(0)
    model = cls()
    before = copy.deepcopy(model)
    trainer = fit(engine, model, um.BlobData(), variant="k_async", max_steps=8)
    for (name, p), q in zip(
        getattr(model, still).named_parameters(), getattr(before, still).parameters()
    ):
        assert torch.equal(p, q), name
    assert not torch.equal(model.net[0].weight, before.net[0].weight)
    # AdamW never stepped them: no moments for them on the server
    state = trainer.strategy.core.state
    server_of = dict(zip([n for n, p in model.named_parameters() if p.requires_grad], state.params))
    kept = {
        id(server_of.get(n, p)) for n, p in model.named_parameters() if n.startswith(still + ".")
    }
    held = [p for group in state.optimizer.param_groups for p in group["params"]]
    assert kept and kept <= {id(p) for p in held}
    assert all(bool(state.optimizer.state.get(p)) == (id(p) not in kept) for p in held)


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
            self.same.append(
                all(torch.equal(pl_module.state_dict()[n], v) for n, v in named.items())
            )

    pl.seed_everything(0)
    data = um.BlobData(image=True)
    model = Checked()
    model.started_at_server = []
    initial_mean = model.net[1].running_mean.clone()
    validations = ValidatesServerState()
    trainer = fit(
        engine,
        model,
        data,
        variant="k_sync",
        k=2,
        learners=3,
        max_epochs=2,
        check_val_every_n_epoch=1,
        callbacks=[validations],
    )
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
        float(trainer.callback_metrics["val/loss"]), rel=1e-5
    )
