"""Recording the real engine in one process (P = 1: the server thread and the learner on one
rank, through Lightning's loops), the merge of the learners' side logs, the replay's batches, and
the Hydra app's option. Two processes and every variant: tests/integration/test_replay_processes.py."""

import json

import pytest
import pytorch_lightning as pl
from torch import nn

from engines import QUIET
from lightning_stale import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.config import compose_config
from lightning_stale.replay import EventLogError, read_events
from lightning_stale.replay.real import LogBatchSampler, learner_part, merge_parts, server_part
from user_modules import BlobData, WarmupAdamW



class DropoutBatchNorm(WarmupAdamW):
    def __init__(self):
        super().__init__(warmup=0.5, lr=0.02)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(16, 3))


class EpochMetrics(pl.Callback):
    """The logged values when each epoch after the first starts: what the epoch that ended
    hands its schedulers (after its validation)."""

    def __init__(self):
        self.handed: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, *args):
        if trainer.current_epoch > 0 and trainer.current_epoch not in self.handed:
            self.handed[trainer.current_epoch] = {k: float(v) for k, v in trainer.callback_metrics.items()}


def _fit(strategy, tmp_path, callbacks=()):
    pl.seed_everything(7, verbose=False)
    model = DropoutBatchNorm()
    trainer = pl.Trainer(strategy=strategy, max_steps=12, max_epochs=3, callbacks=list(callbacks),
                         **{**QUIET, "default_root_dir": str(tmp_path)})
    trainer.fit(model, datamodule=BlobData(batch_size=16, n=80))
    return trainer


def test_a_one_process_run_is_recorded_and_replays_bit_for_bit(one_process, tmp_path):
    epochs = EpochMetrics()
    trainer = _fit(StaleStrategy("k_async", 1, record_events=True, digest_every=1, record_trace=False,
                                 seed=3), tmp_path, [epochs])
    path = trainer.strategy.stats["events_path"]
    assert path == str(tmp_path / "events.jsonl")
    assert sorted(p.name for p in tmp_path.glob("events*")) == ["events.jsonl"]  # the parts merged
    log = read_events(path)
    assert log.header["engine"] == "stale" and log.header["p"] == 1 and len(log.updates) == 12
    assert [p["index"] for p in log.pushes] == list(range(len(log.pushes)))
    assert all(len(p["indices"]) == 1 and len(p["indices"][0]) == 16 for p in log.pushes)
    assert sum(e["kind"] == "epoch_end" for e in log.events) == 2  # 5 pushes an epoch
    # the learning rate each update's step took: the warm-up's value after j - 1 steps
    model = trainer.lightning_module
    warmup_steps = max(1, int(model.hparams.warmup * model.total_steps))
    expected = [0.02 * min(1.0, j / warmup_steps) for j in range(1, 13)]
    assert [u["lr"][0] for u in log.updates] == pytest.approx(expected, rel=1e-12)
    # Each epoch's end is followed by its validation point, before the next epoch's pushes,
    # with the metrics handed to the epoch's schedulers (the fit stops inside the third epoch).
    kinds = [e["kind"] for e in log.events]
    ends = [i for i, kind in enumerate(kinds) if kind == "epoch_end"]
    validations = [i for i, kind in enumerate(kinds) if kind == "validation"]
    assert [log.events[i]["epoch"] for i in validations] == [1, 2] == sorted(epochs.handed)
    for end, validation in zip(ends, validations):
        assert end < validation and {"push", "update"}.isdisjoint(kinds[end:validation])
        assert kinds[validation + 1] == "push"
    for i in validations:
        metrics = log.events[i]["metrics"]
        assert "val/loss" in metrics and metrics == pytest.approx(epochs.handed[log.events[i]["epoch"]])
    replayed = _fit(SimulatedStaleStrategy(replay=path), tmp_path / "replay").strategy.replay_report
    assert replayed["checked_updates"] == 12 and replayed["identical"], replayed["differences"]


def _part(path, rank, lines):
    learner_part(path, rank).write_text("".join(json.dumps(e) + "\n" for e in lines))


def _server(path, pushes):
    header = {"kind": "header", "format": "lightning_stale.events", "version": 1, "engine": "stale"}
    events = [header] + [{"kind": "push", "push": i, "learner": learner, "index": index, "version": version}
                         for i, (learner, index, version) in enumerate(pushes)]
    server_part(path).write_text("".join(json.dumps(e) + "\n" for e in events))


def _side(learner, index, version, indices):
    return {"learner": learner, "index": index, "version": version, "rng": 5, "batches": 1,
            "indices": [indices], "batch": "ab"}


def test_merge_joins_pushes_with_their_learners_lines(tmp_path):
    path = tmp_path / "run.jsonl"
    _server(path, [(1, 0, 0), (0, 0, 0), (1, 1, 1)])
    _part(path, 0, [_side(0, 0, 0, [4, 5])])
    _part(path, 1, [_side(1, 0, 0, [1, 2]), _side(1, 1, 1, [3, 3])])
    merge_parts(path, 2)
    pushes = [json.loads(line) for line in path.read_text().splitlines()][1:]
    assert [p["indices"] for p in pushes] == [[[1, 2]], [[4, 5]], [[3, 3]]]
    assert all(p["rng"] == 5 for p in pushes)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["run.jsonl"]


def test_merge_refuses_a_learner_that_disagrees_about_a_version(tmp_path):
    path = tmp_path / "run.jsonl"
    _server(path, [(0, 0, 0), (0, 1, 1)])
    _part(path, 0, [_side(0, 0, 0, [1]), _side(0, 1, 2, [2])])
    with pytest.raises(EventLogError, match="push 1 was computed at version 2 by its own log, 1 by the server's"):
        merge_parts(path, 1)


def test_replay_batches_follow_the_log_epoch_by_epoch_up_to_the_stop():
    class Log:
        path = "run.jsonl"
        pushes = [{"push": i, "indices": [[i]], "dropped": None} for i in range(5)] + \
            [{"push": 5, "indices": [[5]], "dropped": "in_flight_at_stop"}]
        events = [{"kind": "epoch_end", "pushes": 2}, {"kind": "epoch_end", "pushes": 4}]

    sampler = LogBatchSampler(Log)
    assert [list(sampler) for _ in range(4)] == [[[0], [1]], [[2], [3]], [[4]], []]
    assert len(sampler) == 2
    Log.pushes[1]["indices"] = [None]
    with pytest.raises(EventLogError, match="push 1 lacks its mini-batch indices"):
        LogBatchSampler(Log)


@pytest.mark.parametrize("engine, overrides", [("server", []), ("simulated", ["engine=simulated"])])
def test_the_app_passes_record_events_and_digest_every(engine, overrides):
    cfg = compose_config("train", ["race=none", *overrides, "engine.strategy.record_events=true",
                                   "engine.strategy.digest_every=5"])
    assert cfg.engine.name == engine
    assert cfg.engine.strategy.record_events is True and cfg.engine.strategy.digest_every == 5
    default = compose_config("train", ["race=none", *overrides])
    assert default.engine.strategy.record_events is False and default.engine.strategy.digest_every == 100
