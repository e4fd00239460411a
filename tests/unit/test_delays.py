from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_stale.delays import (
    Constant,
    DelayModel,
    Exponential,
    NoDelay,
    Pareto,
    RecordingDelay,
    ShiftedExponential,
    SlowLearners,
    Trace,
    TraceExhaustedError,
    TraceRecorder,
)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "delay"
N = 20_000  # enough draws for sample means within ~1% at these seeds


def draws(model: DelayModel, learner: int, n: int) -> np.ndarray:
    return np.array([model.sample(learner) for _ in range(n)])


def random_models() -> list[DelayModel]:
    return [
        Exponential(mean=0.05, seed=3),
        ShiftedExponential(shift=0.01, mean=0.05, seed=3),
        Pareto(scale=0.02, alpha=3.0, seed=3),
        SlowLearners(base=Exponential(mean=0.05, seed=3), learners=[1], factor=2.0),
    ]


def write_trace(path: Path, rows: dict[int, list[float]]) -> Path:
    recorder = TraceRecorder()
    for learner, delays in rows.items():
        for delay in delays:
            recorder.record(learner, delay)
    return recorder.write(path)


# Reproducibility and independence of the per-learner streams


@pytest.mark.parametrize("model", random_models(), ids=lambda m: type(m).__name__)
def test_same_seed_same_stream_and_reset_restarts(model):
    first = draws(model, 1, 600)  # more than one block
    model.reset()
    assert np.array_equal(draws(model, 1, 600), first)
    twin = pickle.loads(pickle.dumps(model))
    twin.reset()
    assert np.array_equal(draws(twin, 1, 600), first)


def test_different_seeds_and_learners_differ():
    a, b = Exponential(mean=1.0, seed=0), Exponential(mean=1.0, seed=1)
    assert not np.array_equal(draws(a, 0, 50), draws(b, 0, 50))
    a.reset()
    assert not np.array_equal(draws(a, 0, 50), draws(a, 1, 50))


@pytest.mark.parametrize("model", random_models(), ids=lambda m: type(m).__name__)
def test_interleaving_does_not_change_a_learners_stream(model):
    alone = draws(model, 2, 700)
    model.reset()
    interleaved = []
    for i in range(700):
        interleaved.append(model.sample(2))
        for other in (0, 1, 3)[: i % 4]:  # uneven use of the others, including the slowed learner 1
            model.sample(other)
    assert np.array_equal(np.array(interleaved), alone)


def test_pickle_continues_mid_stream():
    model = ShiftedExponential(shift=0.01, mean=0.05, seed=7)
    draws(model, 0, 300)
    twin = pickle.loads(pickle.dumps(model))
    assert np.array_equal(draws(twin, 0, 400), draws(model, 0, 400))
    assert twin.shift == 0.01 and twin.rate == pytest.approx(20.0) and twin.seed == 7


# Distributions


def test_no_delay_and_constant():
    assert NoDelay().sample(5) == 0.0 and NoDelay().mean == 0.0
    model = Constant(value=0.2)
    assert [model.sample(learner) for learner in range(3)] == [0.2] * 3
    assert model.mean == 0.2 and model.mean_of(9) == 0.2


def test_exponential_mean_and_spread():
    model = Exponential(mean=0.05, seed=0)
    x = draws(model, 0, N)
    assert x.min() >= 0
    assert x.mean() == pytest.approx(0.05, rel=0.03)
    assert x.std() == pytest.approx(0.05, rel=0.05)  # exponential: std equals mean
    assert model.mean == 0.05 and model.rate == pytest.approx(20.0) and model.shift == 0.0


def test_shifted_exponential_mean_and_minimum():
    model = ShiftedExponential(shift=0.01, mean=0.05, seed=0)
    x = draws(model, 0, N)
    assert x.min() >= 0.01
    assert x.min() < 0.0101  # the shift is the infimum, not just a lower bound
    assert x.mean() == pytest.approx(0.06, rel=0.03)
    assert x.std() == pytest.approx(0.05, rel=0.05)
    assert model.mean == pytest.approx(0.06) and model.rate == pytest.approx(20.0)


def test_shifted_exponential_is_exponential_plus_shift():
    shifted = draws(ShiftedExponential(shift=0.5, mean=2.0, seed=4), 3, 300)
    plain = draws(Exponential(mean=2.0, seed=4), 3, 300)
    assert np.allclose(shifted, plain + 0.5)


def test_pareto_minimum_mean_and_tail():
    model = Pareto(scale=0.02, alpha=5.0, seed=0)
    x = draws(model, 0, N)
    assert x.min() >= 0.02
    assert model.mean == pytest.approx(0.02 * 5.0 / 4.0)
    assert x.mean() == pytest.approx(model.mean, rel=0.02)
    # P(X > 2 scale) = 2 ** -alpha for the classical Pareto.
    assert np.mean(x > 0.04) == pytest.approx(2.0**-5.0, abs=0.005)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_pareto_infinite_mean_raises(alpha):
    model = Pareto(scale=1.0, alpha=alpha)
    assert model.sample(0) >= 1.0  # construction and sampling are allowed
    with pytest.raises(ValueError, match=r"infinite for alpha <= 1"):
        model.mean


def test_slow_learners():
    slow = SlowLearners(base=Exponential(mean=0.05, seed=2), learners=[1, 3], factor=3.0)
    reference = Exponential(mean=0.05, seed=2)
    for learner in range(4):
        expected = draws(reference, learner, 50) * (3.0 if learner in (1, 3) else 1.0)
        assert np.allclose(draws(slow, learner, 50), expected)
    assert slow.mean_of(0) == pytest.approx(0.05) and slow.mean_of(3) == pytest.approx(0.15)
    assert slow.seed == 2
    with pytest.raises(ValueError, match=r"no common mean.*mean_of"):
        slow.mean
    slow.check_learners(4)
    with pytest.raises(ValueError, match=r"slows learner 3, but there are only 3 learners"):
        slow.check_learners(3)


# Traces


def test_trace_round_trip_through_recorder(tmp_path):
    source = Exponential(mean=0.05, seed=11)
    recording = RecordingDelay(source)
    used = {learner: [] for learner in range(3)}
    for step in range(40):
        learner = step % 3 if step % 5 else 0  # interleaved, uneven
        used[learner].append(recording.sample(learner))
    assert len(recording.recorder) == 40
    path = recording.recorder.write(tmp_path / "sub" / "trace.csv")
    assert path.read_text().splitlines()[0] == "learner,index,delay_s"

    trace = Trace(path=path)
    for learner in (2, 0, 1):  # any order: each learner replays its own record exactly
        assert [trace.sample(learner) for _ in used[learner]] == used[learner]
    assert trace.learners == [0, 1, 2]
    assert trace.mean_of(1) == pytest.approx(np.mean(used[1]))
    trace.check_learners(3)
    with pytest.raises(ValueError, match=r"learners \[2\], but there are only 2"):
        trace.check_learners(2)
    with pytest.raises(ValueError, match=r"no delays for learners \[3\]"):
        trace.check_learners(4)
    with pytest.raises(ValueError, match=r"no common mean.*mean_of"):
        trace.mean


def test_trace_exhaustion_error_and_cycle(tmp_path):
    path = write_trace(tmp_path / "t.csv", {0: [0.1, 0.2], 1: [0.3]})
    strict = Trace(path=path, on_exhausted="error")
    assert [strict.sample(0), strict.sample(0)] == [0.1, 0.2]
    with pytest.raises(TraceExhaustedError, match=r"learner 0 .* recorded only 2"):
        strict.sample(0)
    assert strict.sample(1) == 0.3  # other learners are unaffected
    strict.reset()
    assert strict.sample(0) == 0.1

    cycling = Trace(path=path, on_exhausted="cycle")
    assert [cycling.sample(0) for _ in range(5)] == [0.1, 0.2, 0.1, 0.2, 0.1]
    assert [cycling.sample(1) for _ in range(2)] == [0.3, 0.3]
    twin = pickle.loads(pickle.dumps(cycling))
    assert twin.sample(0) == cycling.sample(0) == 0.2


def test_recorder_pickles(tmp_path):
    recorder = TraceRecorder()
    recorder.record(1, 0.5)
    twin = pickle.loads(pickle.dumps(recorder))
    twin.record(1, 0.25)
    assert twin.rows == [(1, 0, 0.5), (1, 1, 0.25)]


# Validation


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Constant(value=-1.0), r"Constant value must be a finite number >= 0, got -1.0"),
        (lambda: Exponential(mean=0.0), r"Exponential mean must be a finite number > 0, got 0.0"),
        (lambda: Exponential(mean=-0.1), r"Exponential mean .* got -0.1"),
        (lambda: Exponential(mean=1.0, seed=-1), r"seed must be an integer >= 0, got -1"),
        (lambda: ShiftedExponential(shift=-0.1, mean=1.0), r"shift must be .* >= 0, got -0.1"),
        (lambda: ShiftedExponential(shift=0.1, mean=0.0), r"ShiftedExponential mean .* > 0"),
        (lambda: Pareto(scale=0.0, alpha=2.0), r"Pareto scale must be .* > 0, got 0.0"),
        (lambda: Pareto(scale=1.0, alpha=-2.0), r"Pareto alpha must be .* > 0, got -2.0"),
        (lambda: SlowLearners(base=NoDelay(), learners=[0], factor=0.0), r"factor .* got 0.0"),
        (lambda: SlowLearners(base=NoDelay(), learners=[], factor=2.0), r"at least one learner"),
        (lambda: SlowLearners(base=NoDelay(), learners=[-1], factor=2.0), r"integer >= 0, got -1"),
        (lambda: SlowLearners(base=0.1, learners=[0], factor=2.0), r"must be a DelayModel"),
        (lambda: Exponential(mean=1.0).sample(-2), r"learner index must be .* got -2"),
        (lambda: NoDelay().check_learners(0), r"num_learners must be an integer >= 1, got 0"),
    ],
)
def test_validation_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_trace_validation(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(FileNotFoundError, match=r"nope\.csv"):
        Trace(path=missing)
    good = write_trace(tmp_path / "good.csv", {0: [0.1]})
    with pytest.raises(ValueError, match=r"on_exhausted must be 'error' or 'cycle', got 'wrap'"):
        Trace(path=good, on_exhausted="wrap")

    bad_files = {
        "learner,delay\n0,0.1\n": r"line 1: expected the header",
        "": r"line 1: expected the header",
        "learner,index,delay_s\n": r"holds no delays",
        "learner,index,delay_s\n0,0,0.1\n0,1\n": r"line 3: expected 3 fields",
        "learner,index,delay_s\n0,0,abc\n": r"line 2: cannot parse",
        "learner,index,delay_s\n0,0,-0.5\n": r"line 2: delay_s must be .* >= 0",
        "learner,index,delay_s\n-1,0,0.5\n": r"line 2: learner must be >= 0",
        "learner,index,delay_s\n0,0,0.1\n1,0,0.1\n0,2,0.1\n": r"line 4: learner 0 has index 2, expected 1",
    }
    for i, (text, match) in enumerate(bad_files.items()):
        path = tmp_path / f"bad{i}.csv"
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            Trace(path=path)


# Hydra configs


def test_every_delay_config_instantiates(tmp_path):
    trace_path = write_trace(tmp_path / "trace.csv", {0: [0.1, 0.2], 1: [0.3]})
    configs = sorted(CONF_DIR.glob("*.yaml"))
    names = {path.stem for path in configs}
    assert {"none", "exponential", "shifted_exponential", "pareto", "slow_learners", "trace"} <= names
    for path in configs:
        cfg = OmegaConf.load(path)
        if path.stem == "trace":
            assert OmegaConf.is_missing(cfg, "path")  # the user must name the trace
            cfg.path = str(trace_path)
        model = instantiate(cfg)
        assert isinstance(model, DelayModel), path.name
        model.check_learners(2)
        for learner in range(2):
            delay = model.sample(learner)
            assert delay >= 0 and math.isfinite(delay) and math.isfinite(model.mean_of(learner))
        pickle.loads(pickle.dumps(model))

    slow = instantiate(OmegaConf.load(CONF_DIR / "slow_learners.yaml"))
    assert isinstance(slow.base, Exponential) and slow.learners == (0,) and slow.factor == 3.0
    shifted = instantiate(OmegaConf.load(CONF_DIR / "shifted_exponential.yaml"))
    assert shifted.mean == pytest.approx(0.06)
