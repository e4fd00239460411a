"""Recorded runs of the real engine (2 CPU processes, one launch of tests/integration/scripts/replay.py),
replayed in this process by `SimulatedStaleStrategy(replay=path)`.

Tolerance: the replay computes every push on the recorded version's parameters and its learner's
buffers, the recorded mini-batch and random seed, and the server core sums each update's
gradients in the order the log names, with the recorded intra-op thread count (the log's
header has it: the replay takes it for its fit, whatever this process's count after the tests
before), so on the same machine every state is bit-identical. The collective path sums an
update's gradients in its all-reduce's order, not the log's (the same sum for two learners, a
few ulps apart for more): a few ulps per update, so the bound asserted is a relative difference
of 1e-6 (float32's epsilon is 1.2e-7)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_stale import SimulatedStaleStrategy
from lightning_stale.replay import EventLogError, read_events
from processes import SCRIPTS


def _script_module(name):
    """A module of tests/integration/scripts/ (without putting that folder on sys.path, where its
    user_modules.py would hide tests/user_modules.py)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (Lightning pickles nothing here, but the classes name their module)
    spec.loader.exec_module(module)
    return module


_replay_module = _script_module("replay_module")
LIMITS, QUIET, Blobs = _replay_module.LIMITS, _replay_module.QUIET, _replay_module.Blobs
DropoutBatchNormAdamW, build_module = _replay_module.DropoutBatchNormAdamW, _replay_module.build_module

# every variant a path runs (the collective path serves the sync family only)
RUNS = [f"{variant}-central" for variant in ("async", "k_batch_async", "sync", "k_sync", "k_batch_sync", "k_async")]
RUNS += [f"{variant}-collective" for variant in ("sync", "k_sync", "k_batch_sync")]
RUNS += [f"{variant}-sharded" for variant in ("async", "k_batch_sync", "sync", "k_sync", "k_async", "k_batch_async")]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def recorded(launched):
    return launched("replay")  # tests/integration/conftest.py


def replay(path, tmp_path, module=build_module, **options):
    strategy = SimulatedStaleStrategy(replay=path, **options)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, default_root_dir=str(tmp_path),
                         **QUIET, **LIMITS)
    trainer.fit(module(), Blobs())
    return strategy.replay_report


@pytest.mark.parametrize("name", RUNS)
def test_a_real_run_replays_update_for_update(recorded, name, tmp_path):
    path = recorded[name]["events_path"]
    log = read_events(path)
    server = name.split("-")[1]
    assert log.header["engine"] == "stale" and log.header["server"] == server
    assert recorded[name]["stats"]["updates"] == 8 == len(log.updates)
    assert any(e["kind"] == "epoch_end" for e in log.events)  # the run crossed an epoch's end
    assert all(p["indices"] and isinstance(p["rng"], int) for p in log.pushes)
    assert {p["learner"] for p in log.pushes} == {0, 1}
    report = replay(path, tmp_path)
    # the central server digests its state after every update; on the other paths rank 0 digests
    # its module (and, collective, its optimizer) after the fit
    assert report["checked_updates"] == (8 if server == "central" else 0) and report["final_checked"]
    assert report["max_relative_difference"] <= TOLERANCE
    # every decision, contribution, order, learning rate and K agrees; states only within tolerance
    assert all(d["what"] in ("parameters (sha256)", "optimizer state (optimizer_sha256)")
               for d in report["differences"]), report["differences"]


def test_a_run_that_lost_a_learner_replays_with_the_removal(recorded, tmp_path):
    """Learner 1's process dies after three steps, inside the first epoch, under
    on_learner_failure="continue": its pushes so far are in the log (its side log was flushed
    line by line), the removal is one line where the server heard of it, and the replay removes
    it there too."""
    run = recorded["k_async-central-killed"]
    assert run["stats"]["dead_learners"] == [1] and run["stats"]["updates"] == 8
    log = read_events(run["events_path"])
    removals = [e for e in log.events if e["kind"] == "remove_learner"]
    assert [e["learner"] for e in removals] == [1]
    assert sum(p["learner"] == 1 for p in log.pushes) == 3
    report = replay(run["events_path"], tmp_path)
    assert report["checked_updates"] == 8 and report["max_relative_difference"] <= TOLERANCE
    assert all(d["what"] in ("parameters (sha256)", "optimizer state (optimizer_sha256)")
               for d in report["differences"]), report["differences"]


class HalfLearningRate(DropoutBatchNormAdamW):
    def configure_optimizers(self):
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["lr"] = group["initial_lr"] = 0.01
        return config


def half_learning_rate():
    pl.seed_everything(3, verbose=False)  # the recorded run's initial parameters (build_module)
    return HalfLearningRate()


def test_a_counterfactual_on_a_real_arrival_pattern(recorded, tmp_path):
    """The same arrival pattern with half the learning rate: every decision as recorded, the
    learning rates and so the states differ from the first update on."""
    path = recorded["k_batch_async-central"]["events_path"]
    report = replay(path, tmp_path, half_learning_rate)
    kinds = {d["what"] for d in report["differences"]}
    assert report["first_differing_update"] == 1 and "update.lr" in kinds
    assert kinds <= {"update.lr", "parameters (sha256)", "optimizer state (optimizer_sha256)", "push.loss"}
    assert report["max_relative_difference"] > 1e-3


def test_the_logs_name_the_merged_file_only(recorded):
    for name in RUNS:
        path = recorded[name]["events_path"]
        assert path.endswith(f"{name}.jsonl")
        folder = Path(path).parent
        assert not list(folder.glob(f"{name}.rank*.jsonl")) and not list(folder.glob(f"{name}.server.jsonl"))


def test_a_wrong_version_in_the_log_fails_the_comparison(recorded, tmp_path):
    path = recorded["async-central"]["events_path"]
    lines = [json.loads(line) for line in open(path)]
    log = read_events(path)
    # the first applied push computed at a version > 0, moved one version back
    push = next(p for p in log.pushes if p["version"] > 0 and log.fate(p["push"]).get("applied"))
    for event in lines:
        if event["kind"] == "push" and event["push"] == push["push"]:
            event["version"] -= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(e) + "\n" for e in lines))
    report = replay(bad, tmp_path)
    applied = log.fate(push["push"])["applied"]
    assert report["first_differing_update"] == applied
    assert report["max_relative_difference"] > TOLERANCE


class Wider(DropoutBatchNormAdamW):
    def __init__(self):
        super().__init__()
        self.net[0] = torch.nn.Linear(8, 16, bias=False)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"), ("cut", "does not parse"), ("newer", "newer than version"), ("variant", "variant='k_sync'"),
    ("model", "another model")])
def test_bad_input_is_refused_at_once(recorded, tmp_path, damage, message):
    path = recorded["async-central"]["events_path"]
    text = open(path).read()
    bad = tmp_path / "bad.jsonl"
    module, options = build_module, {}
    if damage == "truncate":  # whole lines, the stop missing
        lines = text.splitlines(keepends=True)
        bad.write_text("".join(lines[: len(lines) // 2]))
    elif damage == "cut":  # inside a line
        bad.write_text(text[: len(text) // 2])
    elif damage == "newer":
        header, rest = text.split("\n", 1)
        bad.write_text(header.replace('"version":1', '"version":2', 1) + "\n" + rest)
    else:
        bad.write_text(text)
        if damage == "variant":
            options = {"variant": "k_sync"}
        else:
            module = Wider
    with pytest.raises(EventLogError, match=message):
        replay(bad, tmp_path, module, **options)
