"""MiniBatchTimer on real processes: every learner's rows reach rank 0's trace, and `fit` reads it."""

import csv
from statistics import median

import pytest

from lightning_stale.delays import Trace, fit


@pytest.fixture(scope="module")
def traces(launched):
    return launched("minibatch_timer")  # tests/integration/conftest.py


def rows_by_learner(path):
    rows = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            rows.setdefault(int(row["learner"]), []).append(row)
    return rows


def test_ddp_trace_covers_both_learners_with_their_own_computation(traces):
    rows = rows_by_learner(traces["ddp"])
    assert sorted(rows) == [0, 1]
    for learner_rows in rows.values():  # one row per optimizer step, indexed in order
        assert [int(r["index"]) for r in learner_rows] == list(range(60))
        assert all(r["total_s"] == "" and r["delay_s"] == r["compute_s"] for r in learner_rows)
    compute = {learner: median(float(r["compute_s"]) for r in rs) for learner, rs in rows.items()}
    # Learner 1 sleeps 30 ms after each backward, learner 0 5 ms. Learner 0 waits for learner 1
    # inside every all-reduce; that wait is not its computation, so its median stays far below.
    assert compute[1] >= 0.030
    assert compute[0] < 0.5 * compute[1]
    result = fit(traces["ddp"])
    assert result.n == 120 and result.slow_learners == (1,)
    assert Trace(traces["ddp"], column="compute_s").learners == [0, 1]


def test_stale_engine_trace_is_gathered_after_training(traces):
    rows = rows_by_learner(traces["stale"])
    assert sorted(rows) == [0, 1] and all(len(rs) > 0 for rs in rows.values())
    assert fit(traces["stale"]).n == sum(len(rs) for rs in rows.values())
