"""Documented options that had no test: each test fails if its option were ignored (the real
engine as P = 1 in this process, the simulated engine, the advisor and its command)."""

import math
import types

import pytest
import torch

import user_modules as um
from engines import fit
from lightning_stale import StaleStrategy
from lightning_stale.analysis import advise_cli
from lightning_stale.analysis.advise import advise
from lightning_stale.delays import Constant, ShiftedExponential, TraceRecorder
from lightning_stale.engine.distributed import ranks as ranks_module
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.strategies import stale as stale_module
from lightning_stale.strategies.sampling import IndependentBatchSampler



@pytest.fixture
def learners_built(monkeypatch):
    """The real engine's learners of the fits in the test (ranks.py builds them)."""
    built = []

    class Recorded(Learner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(ranks_module, "Learner", Recorded)
    return built


def fit_stale(**strategy_kwargs):
    torch.manual_seed(0)
    return fit("stale", um.Classifier(), um.BlobData(batch_size=16), variant="async",
               max_steps=3, strategy_kwargs=strategy_kwargs)


# ---------------------------------------------------------------- StaleStrategy
@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize("mode,total", [("total", True), ("after_compute", False)])
def test_delay_mode_reaches_the_learners_clock(learners_built, mode, total):
    trainer = fit_stale(delay=Constant(0.001), delay_mode=mode)
    (learner,) = learners_built
    assert learner.clock.total is total and learner.delays == [0.001] * 3
    assert trainer.strategy.stats["updates"] == 3


@pytest.mark.parametrize("name", ["server_timeout", "shutdown_timeout"])
@pytest.mark.parametrize("bad", [0, -1.0, True, "10", None])
def test_timeouts_must_be_positive_seconds(name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be a number of seconds > 0, got {bad!r}"):
        StaleStrategy("async", **{name: bad})


@pytest.mark.usefixtures("one_process")
def test_server_timeout_is_the_learners_and_shutdown_timeout_bounds_the_leaving(learners_built, monkeypatch):
    waited = []
    close, join = Learner.close, ParameterServer.join
    monkeypatch.setattr(Learner, "close", lambda self, timeout: (waited.append(("learner", timeout)),
                                                                 close(self, timeout))[1])
    monkeypatch.setattr(ParameterServer, "join", lambda self, timeout: (waited.append(("server", timeout)),
                                                                       join(self, timeout))[1])
    fit_stale(server_timeout=7.5, shutdown_timeout=12.0)
    (learner,) = learners_built
    assert learner.server_timeout == 7.5
    assert waited == [("learner", 12.0), ("server", 12.0)]


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize("hold", [True, False])
def test_hold_freed_memory_holds_the_allocators_freed_memory_or_not(monkeypatch, hold):
    calls = []
    monkeypatch.setattr(stale_module.allocator, "hold_freed_memory", lambda: calls.append(1))
    fit_stale(hold_freed_memory=hold)
    assert calls == ([1] if hold else [])


def test_each_learners_sampler_draws_its_own_stream_from_the_seed_and_its_rank():
    def first_batches(seed, rank):
        sampler = IndependentBatchSampler(1000, 8, seed, rank)
        it = iter(sampler)
        return [next(it) for _ in range(3)]

    assert first_batches(0, 0) == first_batches(0, 0)
    streams = [first_batches(seed, rank) for seed in (0, 1) for rank in (0, 1)]
    assert all(a != b for i, a in enumerate(streams) for b in streams[i + 1:])


class SeenBatches(um.Classifier):
    def __init__(self):
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[1].tolist())
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("one_process")
def test_the_strategys_seed_chooses_the_learners_mini_batches():
    def batches(seed):
        model = SeenBatches()
        torch.manual_seed(0)
        fit("stale", model, um.BlobData(batch_size=16), variant="async", max_steps=3,
            strategy_kwargs={"seed": seed})
        return model.seen

    assert batches(3) == batches(3) and batches(3) != batches(4)


# ---------------------------------------------------------------- SimulatedStaleStrategy
def test_the_simulated_strategy_runs_on_the_device_it_is_given():
    torch.manual_seed(0)
    given = fit("simulated", um.Classifier(), um.BlobData(batch_size=16), variant="async",
                learners=2, max_steps=2, strategy_kwargs={"device": "cpu:0"})
    assert given.strategy.root_device == torch.device("cpu", 0)
    chosen = fit("simulated", um.Classifier(), um.BlobData(batch_size=16), variant="async",
                 learners=2, max_steps=2)
    assert chosen.strategy.root_device == torch.device("cpu")  # the accelerator's, when not given


# ---------------------------------------------------------------- the advisor
def recorded_trace(path, learners=3, per_learner=120):
    recorder = TraceRecorder()
    slow = ShiftedExponential(0.01, 0.05, seed=4)
    for i in range(per_learner):
        for learner in range(learners):
            # a slow start (warm-up) of 0.5 s, then the shifted exponential
            recorder.record(learner, 0.5 if i < 5 else slow.sample(learner))
    return recorder.write(path)


def test_the_advisors_command_passes_every_option_on(monkeypatch, tmp_path):
    seen = {}

    def fake_advise(trace, p, **options):
        seen.update(trace=trace, p=p, **options)
        return types.SimpleNamespace(report=lambda: "report")

    monkeypatch.setattr(advise_cli, "advise", fake_advise)
    monkeypatch.setattr(advise_cli, "write_outputs", lambda advice, out: [out])
    assert advise_cli.main([
        "t.csv", "--learners", "5", "--column", "compute_s", "--ks", "2", "3", "--variants", "k_sync",
        "async", "--target", "0.25", "--budget-s", "9", "--pushes", "50", "--window", "7", "--replay",
        "fitted", "--config-name", "mnist", "--override", "model.lr=0.3", "--override", "seed=2",
        "--no-sweep", "--no-adaptive", "--discard-first", "4", "--et-updates", "300", "--seed", "11",
        "--out", str(tmp_path)]) == 0
    progress = seen.pop("progress")
    assert callable(progress)
    assert seen == dict(trace="t.csv", p=5, column="compute_s", ks=[2, 3], variants=["k_sync", "async"],
                        target=0.25, budget_s=9.0, pushes=50, window=7, replay="fitted",
                        config_name="mnist", overrides=["model.lr=0.3", "seed=2"], sweep=False,
                        adaptive=False, discard_first=4, et_updates=300, seed=11)


def test_the_advisors_options_change_its_advice(tmp_path):
    trace = recorded_trace(tmp_path / "t.csv")
    quick = dict(sweep=False, adaptive=False, et_updates=300, progress=None)
    base = advise(trace, **quick)
    assert base.p == 3  # the learners in the trace
    assert advise(trace, 5, **quick).p == 5
    pairs = {(r["variant"], r["k"]) for r in advise(trace, ks=[2], variants=["k_sync", "sync"], **quick).iteration_times}
    assert pairs == {("k_sync", 2), ("sync", 3)}
    # the warm-up's 0.5 s values move the fitted mean; discarding them brings it back
    mean = lambda a: sum(a.fitted.learner_means.values()) / 3  # noqa: E731
    assert mean(advise(trace, discard_first=5, **quick)) < mean(base) - 0.01
    # the seed drives the Monte Carlo E[T] of the empirical law
    empirical = lambda a: [r["E[T] empirical"] for r in a.iteration_times if r["method empirical"] != "closed form"]  # noqa: E731
    assert empirical(advise(trace, seed=1, **quick)) != empirical(base)
    # budget and window are the advice's when given, derived from the trace when not
    given = advise(trace, budget_s=2.5, window=5, **quick)
    assert (given.budget_s, given.window) == (2.5, 5) and (base.window, base.budget_s) != (5, 2.5)
    assert advise(trace, pushes=10, **quick).budget_s == pytest.approx(base.budget_s / 120)
    replayed = advise(trace, replay="fitted", **quick)
    assert replayed.replay == "fitted" and replayed.replayed is replayed.fitted.model
    assert base.replayed is not base.fitted.model  # the recorded times, resampled


def test_the_advisor_reads_the_column_and_keeps_each_learners_record_as_told(tmp_path):
    trace = recorded_trace(tmp_path / "t.csv")
    lines = trace.read_text().splitlines()
    # the same records with a second column, twice as long: what MiniBatchTimer writes as compute_s
    two = tmp_path / "two.csv"
    two.write_text("\n".join([lines[0] + ",compute_s"] +
                             [f"{line},{2 * float(line.split(',')[2])!r}" for line in lines[1:]]) + "\n")
    quick = dict(sweep=False, adaptive=False, et_updates=300, progress=None)
    mean = lambda a: sum(a.fitted.learner_means.values()) / 3  # noqa: E731
    delay, compute = advise(two, **quick), advise(two, column="compute_s", **quick)
    assert (delay.fitted.column, compute.fitted.column) == ("delay_s", "compute_s")
    assert mean(compute) == pytest.approx(2 * mean(delay))
    # the empirical law pools the learners' records when P differs from the learners recorded,
    # keeps each one's own when told (or when P is theirs)
    assert advise(trace, 2, **quick).replayed.per_learner is False
    assert advise(trace, 2, per_learner=True, **quick).replayed.per_learner is True
    assert advise(trace, **quick).replayed.per_learner is True
    # more Monte Carlo updates: another estimate of the same E[T]
    estimates = lambda a: [r["E[T] empirical"] for r in a.iteration_times if r["method empirical"] != "closed form"]  # noqa: E731
    assert estimates(advise(trace, **{**quick, "et_updates": 900})) != estimates(advise(trace, **quick))


def test_the_advisors_sweep_trains_the_config_it_is_given_to_the_target_it_is_given(tmp_path):
    trace = recorded_trace(tmp_path / "t.csv")
    quick = dict(ks=[1], variants=["async"], pushes=40, adaptive=False, et_updates=300, progress=None)
    trained = advise(trace, 2, overrides=["model.lr=0.3"], **quick)
    (run,) = trained.runs
    assert trained.target == run.final_error  # by default the median final loss of the runs
    assert trained.adaptive is None  # adaptive=False: no AdaSync run
    # the overrides reach the model trained: with a step of 0 the loss stays where it starts
    still = advise(trace, 2, overrides=["model.lr=0.0"], **quick).runs[0]
    assert still.losses[0] == run.losses[0] and run.final_error < still.final_error - 0.5
    # another config trains another model on other data (least squares: not digits' ln 10)
    convex = advise(trace, 2, config_name="convex_variants", **quick).runs[0]
    assert abs(convex.losses[0] - run.losses[0]) > 1.0
    # a given target is the one the runs are timed to: a loss above every smoothed value is
    # reached at the first update
    given = advise(trace, 2, overrides=["model.lr=0.3"], target=5.0, **quick)
    assert given.target == 5.0 and given.time_of(given.runs[0]) == given.runs[0].times[0]
    assert math.isnan(trained.time_of(run))  # its own final loss, smoothed over 16 gradients: not reached
    # with AdaSync on, the best configuration's family runs once more with an adaptive K
    checked = advise(trace, 2, overrides=["model.lr=0.3"], target=5.0, **{**quick, "adaptive": True})
    assert checked.adaptive is not None and checked.adaptive.adaptive and checked.adaptive.variant == "k_async"
