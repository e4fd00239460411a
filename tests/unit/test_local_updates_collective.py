"""Local updates on the real engine's collective path (docs/how-to/local-updates.md): P = 2 real
learners on threads that are the ranks of the path's all-reduces (tests/thread_ranks.py) and the
real server deciding from headers, in one process (tests/inprocess.py). Each learner keeps its
pseudo-gradients until an update takes them, the K of an update meet in one all-reduce and every
learner applies the outer optimizer to its own copy of the server's parameters. Every push and
every update are recomputed by hand (`check_outer_rule`, shared with the central path's tests),
and the learners' copies, outer optimizer state included, must agree at every version."""

import pytest
import torch

import user_modules as um
from inprocess import InProcessRun, blob_batches, isclose
from lightning_stale import StaleStrategy
from test_local_updates_real import NESTEROV, AdamWClassifier, MomentumClassifier, books_balance, check_outer_rule


def replicated(run: InProcessRun) -> None:
    """Every learner holds the same server parameters and buffers at every version, and the same
    outer optimizer state at the end: what one applies, all apply."""
    versions = [learner.exchange.versions for learner in run.learners]
    assert sorted(versions[0]) == list(range(len(run.updates) + 1))
    for other in versions[1:]:
        assert sorted(other) == sorted(versions[0])
        assert all(torch.equal(other[v], versions[0][v]) for v in versions[0])
    states = [learner.exchange.server.optimizer.state_dict() for learner in run.learners]
    for other in states[1:]:
        assert other["param_groups"] == states[0]["param_groups"]
        assert other["state"].keys() == states[0]["state"].keys()
        for key, state in states[0]["state"].items():
            assert all(torch.equal(other["state"][key][name], value) for name, value in state.items())
    # and the modules end where the server's last version is (the stop loads it)
    for learner in run.learners:
        assert torch.equal(learner.vectors.state_vector(), versions[0][len(run.updates)])


def collective_and_central(model_factory, **options):
    runs = {}
    for path in ("collective", "central"):
        torch.manual_seed(0)
        runs[path] = InProcessRun(model_factory(), blob_batches(), path=path, **options).fit()
    return runs["collective"], runs["central"]


@pytest.mark.parametrize("outer,rule", [(None, {}), (NESTEROV, {"lr": 0.7, "momentum": 0.9, "nesterov": True})])
def test_fully_sync_rounds_meet_in_one_all_reduce_and_match_the_central_path(outer, rule):
    run, central = collective_and_central(lambda: MomentumClassifier(lr=0.05), variant="sync", p=2,
                                          max_updates=4, local_steps=3, outer_optimizer=outer)
    assert run.stats["updates"] == 4 and run.stats["pushes_per_learner"] == [4, 4]
    assert all(sorted(g.learner for g in u.update.gradients) == [0, 1] for u in run.updates)
    assert all(starts[:4] == [(0, 0), (3, 1), (6, 2), (9, 3)] for starts in run.round_starts.values())
    check_outer_rule(run, h=3, **rule)  # every pseudo-gradient and every update by hand
    replicated(run)
    # one all-reduce per update on each learner (no integer buffers: no second one)
    assert run.ranks.calls == [4, 4]
    # the same pushes (every round of both learners, from the same versions) as on the central path
    assert [(p.learner, p.version, p.batch) for p in sorted(run.pushes, key=lambda p: (p.learner, p.id))] == \
        [(p.learner, p.version, p.batch) for p in sorted(central.pushes, key=lambda p: (p.learner, p.id))]
    for version in range(5):
        assert isclose(run.versions[version], central.versions[version]), f"version {version}"
    assert books_balance(run.stats) and books_balance(central.stats)


def test_diloco_adamw_inner_steps_with_the_outer_nesterov_state_replicated_on_every_learner():
    run, central = collective_and_central(AdamWClassifier, variant="sync", p=2, max_updates=5, local_steps=4,
                                          outer_optimizer=NESTEROV)
    check_outer_rule(run, h=4, lr=0.7, momentum=0.9, nesterov=True)
    replicated(run)  # the momentum buffers on both learners: equal
    outer = run.learners[0].exchange.server.optimizer
    assert all("momentum_buffer" in s for s in outer.state.values())
    assert isclose(run.versions[5], central.versions[5])
    steps = [int(s["step"]) for opt in run.inner_optimizers for s in opt.state.values()]
    assert steps and all(step == 20 for step in steps)  # the inner AdamW's count went on across rounds


def test_a_learner_whose_outer_state_diverges_is_caught(monkeypatch):
    """The check `replicated` relies on fails where one learner's outer optimizer differs: here
    learner 1's momentum is 0.5 instead of 0.9, so its copy of the parameters drifts away."""
    import inprocess

    made = inprocess.RecordingLocalExchange.__init__

    def init(self, run, rank, *args):
        made(self, run, rank, *args)
        for group in self.server.optimizer.param_groups:
            group["momentum"] = 0.5 if rank == 1 else group["momentum"]

    monkeypatch.setattr(inprocess.RecordingLocalExchange, "__init__", init)
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), "sync", p=2, max_updates=3, local_steps=2,
                       outer_optimizer=NESTEROV, path="collective").fit()
    with pytest.raises(AssertionError):
        replicated(run)
    first, second = (learner.exchange.versions for learner in run.learners)
    assert torch.equal(first[0], second[0]) and not torch.equal(first[3], second[3])


def test_k_sync_cancels_the_stragglers_round_and_the_update_takes_the_first():
    torch.manual_seed(0)
    run = InProcessRun(MomentumClassifier(lr=0.05), blob_batches(), "k_sync", p=2, k=1,
                       delays={0: 0.0, 1: 60.0}, max_updates=4, local_steps=2, outer_optimizer=NESTEROV,
                       path="collective").fit()
    assert len(run.updates) == 4 and all(u.update.staleness == (0,) for u in run.updates)
    assert run.learners[1].cancelled >= 1 and run.stats["cancellations"] >= 1  # its rounds abandoned
    check_outer_rule(run, h=2, lr=0.7, momentum=0.9, nesterov=True)
    replicated(run)  # the straggler took part in every all-reduce, adding nothing
    assert run.ranks.calls == [4, 4]
    assert books_balance(run.stats)
    assert sum(run.stats["pushes_per_learner"]) == run.stats["gradients_received"]


def test_k_batch_sync_takes_several_rounds_of_a_fast_learner_from_one_version():
    torch.manual_seed(0)
    run = InProcessRun(um.Classifier(lr=0.05), blob_batches(), "k_batch_sync", p=2, k=2,
                       delays={0: 0.0, 1: 60.0}, max_updates=4, local_steps=2, path="collective").fit()
    # the fast learner pushes on without an answer: its next round restarts from the version it holds
    assert any(len([g for g in u.update.gradients if g.learner == 0]) == 2 for u in run.updates)
    check_outer_rule(run, h=2)
    replicated(run)
    assert books_balance(run.stats)


def test_batchnorm_buffers_are_averaged_and_counters_take_the_largest():
    torch.manual_seed(0)
    run = InProcessRun(um.BatchNormCNN(lr=0.05), blob_batches(image=True), "sync", p=2, max_updates=3,
                       local_steps=3, path="collective").fit()
    check_outer_rule(run, h=3)
    replicated(run)
    from test_local_updates_real import expected_pushes

    ended = expected_pushes(run, h=3, buffers=True)
    floats = [b.is_floating_point() for b in run.server_vectors.buffers]
    sizes = [b.numel() for b in run.server_vectors.buffers]
    for recorded in run.updates:
        pushed = torch.stack([ended[g.id] for g in recorded.update.gradients])
        server, start = run.buffers(recorded.update.version), 0
        for size, is_float in zip(sizes, floats):
            part = slice(start, start + size)
            expected = pushed[:, part].mean(0) if is_float else pushed[:, part].max(0).values
            assert isclose(server[part], expected)
            start += size
    assert run.ranks.calls == [6, 6]  # each update: the sum, and the integer counters' maximum
    counters = [i for i, f in enumerate(floats) if not f]
    assert counters and all(int(run.buffers(3)[sum(sizes[:i])]) == 9 for i in counters)


# ------------------------------------------------------------------ the strategy's options
def test_the_collective_path_takes_local_updates_for_the_sync_family_only():
    chosen = StaleStrategy("k_sync", 2, local_steps=4, outer_optimizer=NESTEROV, server="collective")
    assert (chosen.server, chosen.local_updates) == ("collective", True)
    assert StaleStrategy("sync", local_steps=4, server="auto").server == "central"  # ("auto": central)
    with pytest.raises(ValueError, match=r"server='collective' serves the sync family.*'k_async'.*"
                                         r"server='central' or 'auto'"):
        StaleStrategy("k_async", local_steps=4, server="collective")
    with pytest.raises(ValueError, match=r"server='sharded' with local_steps=4.*server='central'"):
        StaleStrategy("sync", local_steps=4, server="sharded")
    with pytest.raises(ValueError, match=r"server='collective' needs every learner's process.*server='central'"):
        StaleStrategy("k_sync", 1, local_steps=4, server="collective", on_learner_failure="continue")


def test_the_hydra_app_takes_local_updates_on_the_collective_path_for_the_sync_family():
    from lightning_stale.config import ConfigError, compose_config
    from lightning_stale.train import build_strategy

    real = build_strategy(compose_config("train", ["race=none", "engine=server", "variant=sync",
                                                   "engine.strategy.server=collective", "variant.local_steps=4"]))
    assert isinstance(real, StaleStrategy) and (real.server, real.local_steps, real.local_updates) == \
        ("collective", 4, True)
    with pytest.raises(ConfigError, match=r"server=collective with variant=k_async.*sync family"):
        compose_config("train", ["race=none", "engine=server", "variant=k_async", "variant.local_steps=4",
                                 "engine.strategy.server=collective"])
    with pytest.raises(ConfigError, match=r"server=sharded with variant.local_steps=4.*server=central"):
        compose_config("train", ["race=none", "engine=server", "variant.local_steps=4",
                                 "engine.strategy.server=sharded"])


# ------------------------------------------------------------------ one learner's side
def test_validation_and_checkpoints_see_the_servers_copy_not_the_round_in_progress(monkeypatch):
    from thread_ranks import ThreadRanks

    from lightning_stale.engine.distributed.messages import Kind, Message
    from lightning_stale.engine.distributed.paths.base import CheckpointView
    from lightning_stale.engine.distributed.paths.collective import path as collective_path
    from lightning_stale.engine.distributed.paths.collective.local import CollectiveLocalExchange
    from lightning_stale.engine.distributed.paths.collective.path import CollectiveCheckpoint
    from lightning_stale.engine.schedules import Schedules
    from lightning_stale.engine.state import ModelVectors
    from lightning_stale.strategies.local_updates import outer_optimizer_factory

    ranks = ThreadRanks(1)  # a world of one: the all-reduce is the identity
    ranks.local.rank = 0
    monkeypatch.setattr(collective_path, "dist", ranks)
    torch.manual_seed(0)
    module = MomentumClassifier(lr=0.05)
    inner = module.configure_optimizers()
    vectors = ModelVectors.of(module)
    side = CollectiveLocalExchange(vectors, inner, Schedules([], inner), 0, torch.device("cpu"), module,
                                   outer_optimizer_factory(NESTEROV), 2)
    batches = blob_batches()

    def inner_step(i):
        inner.zero_grad()
        torch.nn.functional.cross_entropy(module(batches(0, i)[0]), batches(0, i)[1]).backward()
        inner.step()

    start = vectors.state_vector()
    inner_step(0), inner_step(1)
    pseudo = start - vectors.state_vector()
    push = Message(Kind.PUSH)
    side.fill_push(push), side.before_push(push), side.after_push(push)
    side.take(Message(Kind.PARAMS, version=1, payload=torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)))
    server = start - 0.7 * (1 + 0.9) * pseudo  # Nesterov's first step: (1 + mu) x the pseudo-gradient
    assert isclose(side.pulled, server) and isclose(vectors.state_vector(), server)
    inner_step(2)  # a round in progress moves the module
    assert not isclose(vectors.state_vector(), server)
    epoch = Message(Kind.EPOCH, version=1)
    side.resolve(epoch, check=lambda: None)
    assert torch.equal(epoch.payload, side.pulled)  # validation runs on the server's copy

    class Books:
        def state_dict(self):
            return {"updates": 1}

    part = CollectiveCheckpoint(CheckpointView(Books(), module, optimizer=lambda: inner, learner=lambda: None,
                                               learner_side=side))
    saved = part.module_state(module.state_dict())
    names = [name for name, p in module.named_parameters()]
    assert isclose(torch.cat([saved[name].reshape(-1) for name in names]), server)
    assert "momentum_buffer" in next(iter(part.optimizer_state({})["state"].values()))  # the inner one's
    books = part.engine_state()
    assert books["updates"] == 1
    assert isclose(torch.cat([s["momentum_buffer"].reshape(-1) for s in books["outer_optimizer"]["state"].values()]),
                   pseudo)  # DiLoCo's momentum, in the engine's part


def test_through_lightning_the_collective_path_ends_where_the_central_one_does(one_process, tmp_path):
    """P = 1 through Lightning's loops (a gloo group of one): the same rounds on both paths, so
    the same parameters, steps and pushes."""
    from test_local_updates_real import _lightning_fit

    fits = {path: _lightning_fit(StaleStrategy("sync", local_steps=3, outer_optimizer=NESTEROV, server=path,
                                               record_trace=False), tmp_path / path, max_steps=9)
            for path in ("collective", "central")}
    collective, central = fits["collective"], fits["central"]
    assert collective.strategy.stats["server_path"] == "collective"
    assert collective.strategy.stats["updates"] == central.strategy.stats["updates"] == 3
    assert collective.global_step == central.global_step == 9
    assert collective.strategy.stats["pushes_per_learner"] == central.strategy.stats["pushes_per_learner"] == [3]
    for a, b in zip(collective.lightning_module.parameters(), central.lightning_module.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(collective.lightning_module.parameters(),
                                                      MomentumClassifier(lr=0.05).parameters()))


@pytest.mark.parametrize("local_updates", [False, True])
def test_the_all_reduce_never_overlaps_backward_with_local_updates(monkeypatch, local_updates):
    """Fully sync on P = 2 overlaps its all-reduce with backward on gloo, but not with local
    updates: a round's push is no backward's gradient (the path asserts it never gets both)."""
    from types import SimpleNamespace

    from lightning_stale.method.variants import Variant
    from lightning_stale.strategies import options

    monkeypatch.setattr(options, "dist", SimpleNamespace(get_backend=lambda: "gloo"))
    strategy = SimpleNamespace(world_size=2, global_rank=1, lightning_module=um.Classifier(lr=0.05),
                               precision_plugin=None, overlap_allreduce=None, path="collective", _adaptive=None,
                               payload_channels=False, root_device=torch.device("cpu"), on_learner_failure="stop",
                               _server_group=None, local_updates=local_updates)
    trainer = SimpleNamespace(accumulate_grad_batches=1, callbacks=[])
    overlap, channels = options.settle_transport(strategy, trainer, Variant.create("sync", 2))
    assert (overlap, channels) == (not local_updates, None)


@pytest.mark.parametrize("module,still", [(um.FrozenBackbone, "backbone"), (um.UnusedHead, "aux_head")],
                         ids=["frozen-backbone", "unused-head"])
def test_users_modules_with_frozen_or_unused_parameters_train_on_the_collective_path(module, still):
    """A frozen backbone handed to AdamW, and a head no gradient reaches (its presence mask says
    so): the rounds' updates by hand, the copies equal on both learners, and neither part moved
    by AdamW's weight decay, in the rounds or through the outer step."""
    torch.manual_seed(0)
    model = module(lr=0.05)
    start = [p.detach().clone() for p in getattr(model, still).parameters()]
    run = InProcessRun(model, blob_batches(), "sync", p=2, max_updates=3, local_steps=2, path="collective").fit()
    check_outer_rule(run, h=2)
    replicated(run)
    assert books_balance(run.stats)
    for learner in run.modules:
        assert all(torch.equal(a, b) for a, b in zip(getattr(learner, still).parameters(), start))
    assert any(not torch.equal(a, b) for a, b in zip(run.modules[0].net.parameters(), model.net.parameters()))
