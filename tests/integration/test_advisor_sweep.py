"""The advisor's choice against an exhaustive sweep (scripts/advisor_sweep.py, in its own
process: the two sweeps train for a minute)."""

import math

import numpy as np
import pytest

from lightning_stale.analysis.sweeps import configurations, same_as

P = 4


@pytest.fixture(scope="module")
def advised(launched):
    return launched("advisor_sweep")


def test_digits_recommendation_matches_an_exhaustive_sweep(advised):
    """A recorded shifted-exponential trace, replayed: the advisor's choice is, within noise, the
    best of an exhaustive sweep of every variant and K run with the true law on other seeds."""
    assert advised["chosen"] is not None
    chosen = tuple(advised["chosen"])
    timed = {(variant, k): t for variant, k, t in advised["timed"]}
    exhaustive = {config: timed[same_as(*config, P)] for config in configurations(P, distinct=False)}
    best = min((t, config) for config, t in exhaustive.items() if not math.isnan(t))
    # noise: how far two independent estimates of the same configuration's time fall apart
    # (the advisor's sweep against the exhaustive one), the median over configurations
    differences = [abs(t / exhaustive[(variant, k)] - 1) for variant, k, t in advised["advised"]
                   if not math.isnan(t + exhaustive[(variant, k)])]
    noise = float(np.median(differences))
    assert exhaustive[chosen] <= best[0] * (1 + 2 * noise)
