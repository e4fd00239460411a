"""Event logs and their replay on the simulated engine (docs/replay.md): every variant recorded
with a user-style module and replayed bit for bit, a corrupted event caught by the comparison,
counterfactual options, and every kind of bad log refused at once."""

from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from engines import QUIET
from lightning_stale import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.replay import FORMAT_VERSION, EventLogError, read_events
from user_modules import BlobData, WarmupAdamW


# K-sync (drops and cancellations) in the quick loop, the other five variants with the slow tests.
VARIANTS = [pytest.param(name, k, marks=[] if name == "k_sync" else [pytest.mark.slow])
            for name, k in [("sync", None), ("k_sync", 2), ("k_batch_sync", 2), ("async", None),
                            ("k_async", 2), ("k_batch_async", 2)]]


class DropoutBatchNorm(WarmupAdamW):
    """AdamW with a linear warm-up, BatchNorm and dropout: buffers, optimizer state, a schedule
    and random state that a replay must all reproduce."""

    def __init__(self, hidden: int = 16):
        super().__init__(warmup=0.5, lr=0.02)
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(hidden, 3))


def _fit(strategy, tmp_path, make_model=DropoutBatchNorm, **trainer):
    pl.seed_everything(7, verbose=False)  # the same initial parameters in every fit
    model = make_model()
    options = {**QUIET, "max_epochs": 2, "default_root_dir": str(tmp_path), **trainer}
    t = pl.Trainer(strategy=strategy, **options)
    t.fit(model, datamodule=BlobData(batch_size=16, n=80))
    return t


def _record(tmp_path, variant="k_batch_async", k=2, **options):
    from lightning_stale.delays import Exponential

    options.setdefault("digest_every", 1)  # every update checked (the default checks every 100th)
    strategy = SimulatedStaleStrategy(variant, k, num_learners=3, delay=Exponential(1.0, seed=3),
                                      record_events=True, seed=5, **options)
    trainer = _fit(strategy, tmp_path)
    return trainer.strategy.stats["events_path"], trainer


def _replay(path, tmp_path, make_model=DropoutBatchNorm, trainer=None, **options):
    trainer = _fit(SimulatedStaleStrategy(replay=path, **options), tmp_path, make_model, **(trainer or {}))
    return trainer.strategy.replay_report, trainer


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _write(path, events):
    with open(path, "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))


@pytest.mark.parametrize("variant,k", VARIANTS)
def test_every_variant_replays_bit_for_bit(tmp_path, variant, k):
    path, recorded = _record(tmp_path, variant, k)
    log = read_events(path)
    assert log.header["variant"] == variant and log.header["p"] == 3
    assert len(log.updates) == recorded.strategy.stats["updates"] > 0
    assert sum(e["kind"] == "epoch_end" for e in log.events) == 2
    report, replayed = _replay(path, tmp_path / "replay")
    # The summation order is the log's, every push is computed on the same parameters, batch and
    # seed: every digest agrees bit for bit, every update is checked.
    assert report["differences"] == [] and report["identical"], report["differences"][:3]
    assert report["checked_updates"] == len(log.updates)
    assert report["max_relative_difference"] == 0.0
    for a, b in zip(recorded.model.state_dict().values(), replayed.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_replay_computes_with_the_recorded_thread_count(tmp_path):
    """A CPU matrix multiply splits its sums by thread: the replay takes the recorded run's
    intra-op thread count for the fit (a log recorded on one thread, replayed from a process of
    two, agrees bit for bit), and gives the process its own count back afterwards."""
    path, recorded = _record(tmp_path, "k_async", 2)
    assert read_events(path).header["intra_op_threads"] == torch.get_num_threads() == 1
    seen = []

    class Threads(pl.Callback):
        def on_train_batch_start(self, *args):
            seen.append(torch.get_num_threads())

    torch.set_num_threads(2)
    try:
        strategy = SimulatedStaleStrategy(replay=path)
        _fit(strategy, tmp_path / "replay", callbacks=[Threads()])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert seen and set(seen) == {1}
    report = strategy.replay_report
    assert report["identical"] and report["checked_updates"] == recorded.strategy.stats["updates"], \
        report["differences"][:3]


def test_the_default_digests_every_100th_update_and_the_stop(tmp_path):
    from lightning_stale.replay.setup import DIGEST_EVERY

    assert DIGEST_EVERY == 100 and SimulatedStaleStrategy().digest_every == DIGEST_EVERY
    assert StaleStrategy().digest_every == DIGEST_EVERY
    trainer = _fit(SimulatedStaleStrategy("k_async", 1, num_learners=3, record_events=True, seed=5), tmp_path)
    log = read_events(trainer.strategy.stats["events_path"])
    assert log.header["digest_every"] == DIGEST_EVERY and 0 < len(log.updates) < DIGEST_EVERY
    assert not any("digest" in u for u in log.updates) and log.stop["digest"]["sha256"]
    report, _ = _replay(trainer.strategy.stats["events_path"], tmp_path / "replay")
    assert report["checked_updates"] == 0 and report["final_checked"] and report["identical"]


def test_log_holds_what_the_format_says(tmp_path):
    path, trainer = _record(tmp_path, "k_sync", 2, digest_every=2)
    log = read_events(path)
    stats = trainer.strategy.stats
    assert log.header["version"] == FORMAT_VERSION
    assert [n for n, _ in log.header["parameters"]][:2] == ["net.0.weight", "net.0.bias"]
    assert log.header["optimizer"] == "AdamW"
    assert len(log.pushes) == stats["gradients_received"]
    dropped = [p for p in log.pushes if p["dropped"] == "stale"]
    assert len(dropped) == stats["gradients_dropped_by_reason"].get("stale", 0)
    assert sum(len(p["cancel"]) for p in log.pushes) == stats["cancellations"]
    assert all(("digest" in u) == (u["update"] % 2 == 0) for u in log.updates)
    # the learning rate each update's step took: the warm-up's value after j - 1 steps
    model = trainer.lightning_module
    warmup_steps = max(1, int(model.hparams.warmup * model.total_steps))
    expected = [0.02 * min(1.0, j / warmup_steps) for j in range(1, len(log.updates) + 1)]
    assert [u["lr"][0] for u in log.updates] == pytest.approx(expected, rel=1e-12)
    assert expected[0] < expected[-1]
    seeds = {p["rng"] for p in log.pushes}
    assert len(seeds) == len(log.pushes)  # one seed per (learner, push index)
    assert [p["draw"] for p in log.pushes] == list(range(len(log.pushes)))
    assert all(len(u["contributions"]) == u["k"] == 2 for u in log.updates)


def test_corrupted_version_fails_the_comparison(tmp_path):
    path, _ = _record(tmp_path, "k_batch_async", 2)
    events = _lines(path)
    log = read_events(path)
    # The first applied push computed at a version > 0: claim it was computed one version older.
    target = next(p for p in log.pushes if p["version"] > 0 and p["accepted"])
    update = next(u["update"] for u in log.updates if target["push"] in u["contributions"])
    for e in events:
        if e["kind"] == "push" and e["push"] == target["push"]:
            e["version"] -= 1
    _write(tmp_path / "corrupt.jsonl", events)
    report, _ = _replay(tmp_path / "corrupt.jsonl", tmp_path / "replay")
    assert not report["identical"]
    assert report["first_differing_update"] == update
    first = next(d for d in report["differences"] if d["update"] is not None)
    assert first["update"] == update and first["what"] in ("update.staleness", "parameters (sha256)")
    assert report["max_relative_difference"] > 0


def test_counterfactual_learning_rate_and_compensation(tmp_path):
    path, _ = _record(tmp_path, "k_batch_async", 2)
    log = read_events(path)
    report, trainer = _replay(path, tmp_path / "lr", staleness_compensation="inverse")
    assert trainer.strategy.stats["updates"] == len(log.updates)  # the same arrival pattern
    stale = [u["update"] for u in log.updates if max(u["staleness"]) > 1]
    assert stale, "the recorded run has no stale update to compensate"
    assert report["first_differing_update"] == stale[0]
    assert report["changed_options"] == {"staleness_compensation": [None, repr(StalenessCompensation.create("inverse"))]}
    assert any(d["what"] == "update.weights" for d in report["differences"])

    def faster():
        model = DropoutBatchNorm()
        model.hparams.lr = 0.05
        return model

    report, _ = _replay(path, tmp_path / "lr2", make_model=faster)
    assert report["first_differing_update"] == 1 and report["max_relative_difference"] > 0
    assert report["differences"][0]["what"] == "update.lr"
    assert report["changed_options"] == {}

    class WithSGD(DropoutBatchNorm):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)

    report, _ = _replay(path, tmp_path / "sgd", make_model=WithSGD)
    assert report["changed_options"] == {"optimizer": ["AdamW", "SGD"]}
    assert report["first_differing_update"] == 1
    assert report["differences"][0]["what"] == "update.lr"  # no warm-up any more


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorded")
    path, _ = _record(tmp, "k_async", 2)
    return path, _lines(path)


def test_refuses_another_variant_k_or_p(recorded):
    path, _ = recorded
    with pytest.raises(EventLogError, match=r"variant='k_async', but variant='sync' was asked"):
        SimulatedStaleStrategy("sync", replay=path)
    with pytest.raises(EventLogError, match=r"num_learners=3, but num_learners=4 was asked"):
        SimulatedStaleStrategy(num_learners=4, replay=path)
    with pytest.raises(EventLogError, match=r"k=2, but k=1 was asked"):
        SimulatedStaleStrategy(k=1, replay=path)


def test_refuses_a_log_of_another_model(recorded, tmp_path):
    path, _ = recorded
    with pytest.raises(EventLogError, match=r"another model: its tensor 0 is net.0.weight of shape "
                                            r"\(16, 8\), this module's is net.0.weight of shape \(12, 8\)"):
        _replay(path, tmp_path, make_model=lambda: DropoutBatchNorm(hidden=12))


def test_refuses_other_trainer_limits(recorded, tmp_path):
    path, _ = recorded
    with pytest.raises(EventLogError, match=r"max_epochs=3 \(recorded: 2\)"):
        _replay(path, tmp_path, trainer={"max_epochs": 3})


@pytest.mark.parametrize("damage,message", [
    (lambda ev: ev[:-3], r"without its stop event: the file is truncated"),
    (lambda ev: ev[:5] + ["{not json"] + ev[6:], r"line 6 does not parse as JSON"),
    (lambda ev: ev[:4] + ev[5:], r"push \d+ where push \d+ was due|update \d+ where update \d+ was due"),
    (lambda ev: ev[:-1] + [{**ev[-1], "pushes": ev[-1]["pushes"] + 1}], r"the stop counts \d+ pushes"),
    (lambda ev: [{**ev[0], "version": FORMAT_VERSION + 1}] + ev[1:],
     rf"format version {FORMAT_VERSION + 1}, newer than version {FORMAT_VERSION}"),
    (lambda ev: [{**ev[0], "format": "something else"}] + ev[1:], r"not a lightning_stale.events log"),
    (lambda ev: [], r"is empty"),
    (lambda ev: [{**ev[0], "intra_op_threads": 0}] + ev[1:], r"line 1: intra_op_threads 0 is not a thread count"),
])
def test_refuses_bad_logs_at_once(recorded, tmp_path, damage, message):
    _, events = recorded
    bad = tmp_path / "bad.jsonl"
    lines = damage(list(events))
    bad.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in lines))
    with pytest.raises(EventLogError, match=message):
        SimulatedStaleStrategy(replay=bad)  # at construction: before any fit


def test_record_events_paths_and_options(tmp_path):
    with pytest.raises(ValueError, match="record_events must be a bool or a path, got 3"):
        SimulatedStaleStrategy(record_events=3)
    with pytest.raises(ValueError, match="digest_every must be an integer >= 0, got -1"):
        SimulatedStaleStrategy(digest_every=-1)
    path, _ = _record(tmp_path, "async", None)
    assert path == str(tmp_path / "events.jsonl")
    strategy = SimulatedStaleStrategy("async", num_learners=2, record_events=tmp_path / "x" / "run.jsonl")
    trainer = _fit(strategy, tmp_path, max_epochs=1)
    assert trainer.strategy.stats["events_path"] == str(tmp_path / "x" / "run.jsonl")
    assert read_events(tmp_path / "x" / "run.jsonl").stop["epochs"] == 1


def test_adaptive_k_replays_with_the_recorded_k(tmp_path):
    path, trainer = _record(tmp_path, "k_async", None, adaptive_k={"interval_s": 0.3, "k0": 1, "window": 2})
    log = read_events(path)
    ks = [u["k"] for u in log.updates]
    assert len(set(ks)) > 1, ks  # AdaSync changed K during the run
    assert log.header["adaptive_k"] is not None
    report, replayed = _replay(path, tmp_path / "replay")
    assert report["identical"], report["differences"][:3]
    assert replayed.strategy.stats["updates"] == len(ks)


def test_fate_of_every_push(tmp_path):
    path, trainer = _record(tmp_path, "k_sync", 2, staleness_compensation="inverse")
    log = read_events(path)
    fates = [log.fate(p["push"]) for p in log.pushes]
    stats = trainer.strategy.stats
    assert sum("applied" in f for f in fates) == stats["gradients_applied"]
    assert sum("dropped" in f for f in fates) == stats["gradients_dropped"]
    assert sum("in_flight_at_stop" in f for f in fates) == stats["gradients_in_flight_at_stop"]
    assert all(f["weight"] == 1.0 for f in fates if "applied" in f)  # K-sync: never stale


def test_recording_changes_nothing_but_the_random_state(tmp_path):
    from user_modules import Classifier  # no dropout: the per-push seeds draw nothing

    def final_state(record_events):
        strategy = SimulatedStaleStrategy("k_batch_async", 2, num_learners=3, record_events=record_events)
        return _fit(strategy, tmp_path, Classifier).model.state_dict()

    recorded, plain = final_state(True), final_state(False)
    assert all(torch.equal(recorded[name], plain[name]) for name in plain)


def test_refuses_a_push_from_a_version_never_made(recorded, tmp_path):
    _, events = recorded
    first_push = next(i for i, e in enumerate(events) if e["kind"] == "push")
    bad = [dict(e) for e in events]
    bad[first_push]["version"] = 3
    _write(tmp_path / "bad.jsonl", bad)
    with pytest.raises(EventLogError, match=r"line 2: push 0 was computed at version 3, but 0 updates "
                                            r"came before it"):
        SimulatedStaleStrategy(replay=tmp_path / "bad.jsonl")


def test_checkpoints_of_a_recorded_fit(tmp_path):
    strategy = SimulatedStaleStrategy("k_async", 2, num_learners=3, record_events=True)
    trainer = _fit(strategy, tmp_path, enable_checkpointing=True, max_epochs=1)
    checkpoint = next(tmp_path.rglob("*.ckpt"))  # saved mid-fit: the open log is not pickled
    assert read_events(trainer.strategy.stats["events_path"]).stop["epochs"] == 1
    resumed = SimulatedStaleStrategy("k_async", 2, num_learners=3, record_events=tmp_path / "again")
    with pytest.warns(UserWarning, match="a resumed fit is not recorded"):
        pl.Trainer(strategy=resumed, **{**QUIET, "max_epochs": 2}).fit(
            DropoutBatchNorm(), datamodule=BlobData(batch_size=16, n=80), ckpt_path=checkpoint)
    assert not (tmp_path / "again" / "events.jsonl").exists()
    assert "events_path" not in resumed.stats
