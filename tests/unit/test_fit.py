"""Fitting straggler models to recorded times (`delays.fit`), the empirical law (`Empirical`)
and traces with extra columns."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_stale.config import compose_config, validate_config
from lightning_stale.delays import (Empirical, Exponential, Pareto, ShiftedExponential,
                                    SlowLearners, Trace, TraceRecorder, fit)

DRAWS = 10_000


def record(model, learners: int, draws: int = DRAWS) -> dict[int, list[float]]:
    """`draws` delays of `model`, split evenly over the learners."""
    return {l: [model.sample(l) for _ in range(draws // learners)] for l in range(learners)}


def parameters(model) -> dict[str, float]:
    if isinstance(model, SlowLearners):
        return {**{f"base.{k}": v for k, v in parameters(model.base).items()},
                "factor": model.factor}
    if isinstance(model, Pareto):
        return {"scale": model.scale, "alpha": model.alpha}
    if isinstance(model, ShiftedExponential):
        return {"shift": model.shift, "mean": model.exponential_mean}
    return {"mean": model.mean}


def write(path, rows: dict[int, list[float]]):
    recorder = TraceRecorder()
    for learner, values in rows.items():
        for value in values:
            recorder.record(learner, value)
    return recorder.write(path)


# Known answers: each model's own draws give back its family and parameters.
TRUE_MODELS = [
    Exponential(mean=0.05, seed=3),
    ShiftedExponential(shift=0.01, mean=0.05, seed=3),
    Pareto(scale=0.03, alpha=2.5, seed=3),
    # one slow learner in two: 5,000 draws each side, so the factor's standard error is ~2%
    SlowLearners(Exponential(mean=0.05, seed=3), learners=[1], factor=2.0),
    SlowLearners(ShiftedExponential(shift=0.01, mean=0.05, seed=3), learners=[0], factor=3.0),
]


@pytest.mark.parametrize("true", TRUE_MODELS, ids=lambda m: repr(m))
def test_recovers_family_and_parameters_within_5_percent(true):
    result = fit(record(true, learners=2))
    assert result.n == DRAWS
    assert type(result.model) is type(true)
    if isinstance(true, SlowLearners):
        assert type(result.model.base) is type(true.base)
        assert result.model.learners == true.learners == result.slow_learners
    found, expected = parameters(result.model), parameters(true)
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert found[name] == pytest.approx(value, rel=0.05), name
    # the chosen law fits: KS below its 1% critical value for n draws (1.63 / sqrt(n))
    assert result.best.ks < 1.63 / math.sqrt(DRAWS)
    assert [c.bic for c in result.candidates] == sorted(c.bic for c in result.candidates)


def test_no_slow_learner_is_flagged_among_identical_learners():
    result = fit(record(ShiftedExponential(0.01, 0.05, seed=4), learners=4))
    assert result.slow_learners == ()
    assert all(p > 0.01 for p in result.slow_p_values.values())
    assert not any(c.name.startswith("slow_learners") for c in result.candidates)


def test_aic_criterion_orders_by_aic():
    result = fit(record(Exponential(0.05, seed=5), learners=1), criterion="aic")
    assert result.criterion == "aic"
    assert [c.aic for c in result.candidates] == sorted(c.aic for c in result.candidates)


@pytest.mark.parametrize("true", TRUE_MODELS, ids=lambda m: repr(m))
def test_config_snippet_instantiates_the_fitted_model(true):
    result = fit(record(true, learners=2), seed=7)
    snippet = OmegaConf.create(result.yaml(seed=7))  # the text a user pastes
    model = instantiate(snippet)
    assert type(model) is type(result.model) and model.seed == 7
    for name, value in parameters(result.model).items():
        assert parameters(model)[name] == pytest.approx(value, rel=1e-5), name
    # as the app's delay= group: validated against P = 4 learners (instantiated and checked)
    cfg = compose_config("train", ["engine=simulated"])
    cfg.delay = snippet
    assert validate_config(cfg) == 4
    assert all(model.sample(learner) > 0 for learner in range(4))


def test_fit_reads_a_trace_file_and_chooses_its_column(tmp_path):
    path = tmp_path / "times.csv"
    rng = np.random.default_rng(0)
    compute = rng.exponential(0.02, (2, 300))
    total = 0.01 + compute + rng.exponential(0.05, (2, 300))
    lines = ["learner,index,delay_s,compute_s,total_s"]
    for learner in range(2):
        for i in range(300):
            c, t = float(compute[learner, i]), float(total[learner, i])
            known = i % 3 != 0  # the engine reported X for two mini-batches in three
            lines.append(f"{learner},{i},{t!r},{c!r},{t!r}" if known else
                         f"{learner},{i},{c!r},{c!r},")
    path.write_text("\n".join(lines) + "\n")
    assert Trace(path).num_recorded(0) == 300  # extra columns are ignored by default
    by_total = fit(path, column="total_s")
    assert by_total.n == 400 and by_total.column == "total_s"
    assert by_total.learner_means[0] == pytest.approx(np.mean(total[0][np.arange(300) % 3 != 0]))
    assert fit(Trace(path, column="compute_s")).model.mean == pytest.approx(compute.mean())
    with pytest.raises(ValueError, match=r"no column 'wall_s'; the trace has learner, index, "
                                         r"delay_s, compute_s, total_s"):
        fit(path, column="wall_s")
    bad = tmp_path / "bad.csv"
    bad.write_text("learner,index,delay_s,compute_s\n0,0,0.1,-1\n")
    with pytest.raises(ValueError, match=r"line 2: compute_s must be a finite number >= 0"):
        Trace(bad, column="compute_s")


@pytest.mark.parametrize("values, kwargs, match", [
    ({0: [0.1] * 50}, {}, r"all 50 values of delay_s equal 0.1: there is no straggling.*Constant"),
    ({0: [0.1, 0.2]}, {}, r"2 values of delay_s are too few"),
    ({0: [0.1, -0.2] * 10}, {}, r"must be finite numbers >= 0.*learners \[0\]"),
    ({0: [0.1, 0.2] * 10}, {"criterion": "hqic"}, r"criterion must be one of bic, aic, got 'hqic'"),
    ({0: [0.1, 0.2] * 10}, {"families": ["gamma"]}, r"families must be .* got \['gamma'\]"),
    ({0: [0.1, 0.2] * 10}, {"discard_first": -1}, r"discard_first must be an integer >= 0"),
    ({0: [0.1, 0.2] * 10}, {"discard_first": 20}, r"no values .* after discarding the first 20"),
])
def test_bad_input_is_named(values, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit(values, **kwargs)
    with pytest.raises(ValueError, match=r"fit needs a Trace, a trace CSV path or a mapping"):
        fit(3.5)


def test_pareto_is_left_out_when_a_value_is_zero():
    values = list(np.random.default_rng(1).exponential(0.05, 500)) + [0.0]
    names = [c.name for c in fit({0: values}).candidates]
    assert "pareto" not in names and "exponential" in names


# The empirical law
def test_empirical_resamples_recorded_values_with_per_learner_streams(tmp_path):
    path = write(tmp_path / "t.csv", {0: [0.1, 0.2, 0.3], 1: [1.0, 2.0]})
    pooled = Empirical(path, seed=3)
    draws = [pooled.sample(1) for _ in range(600)]
    assert set(draws) == {0.1, 0.2, 0.3, 1.0, 2.0} and pooled.mean == pytest.approx(0.72)
    # each learner's stream is numpy.random.default_rng([seed, learner]), whatever the order
    other = Empirical(path, seed=3)
    assert [other.sample(0) for _ in range(5)] and [other.sample(1) for _ in range(600)] == draws
    expected = np.random.default_rng([3, 1]).choice([0.1, 0.2, 0.3, 1.0, 2.0], 256)
    assert draws[:256] == expected.tolist()
    pooled.reset()
    assert [pooled.sample(1) for _ in range(600)] == draws
    assert pickle.loads(pickle.dumps(pooled)).path == str(path)

    own = Empirical(Trace(path), per_learner=True)
    assert {own.sample(1) for _ in range(200)} == {1.0, 2.0}
    assert own.mean_of(0) == pytest.approx(0.2)
    own.check_learners(2)
    with pytest.raises(ValueError, match=r"no delay_s values for learners \[2\].*per_learner=False"):
        own.check_learners(3)
    pooled.check_learners(5)  # pooled: any number of learners
    with pytest.raises(ValueError, match=r"no common mean"):
        own.mean
    warm = Empirical(path, per_learner=True, discard_first=1)
    assert warm.values(0).tolist() == [0.2, 0.3] and warm.values(1).tolist() == [2.0]
    with pytest.raises(ValueError, match=r"no delay_s values left after discarding the first 3"):
        Empirical(path, discard_first=3)
    model = instantiate(OmegaConf.create({"_target_": "lightning_stale.delays.Empirical",
                                          "path": str(path), "per_learner": True, "seed": 1}))
    assert model.per_learner and model.learners == [0, 1]
