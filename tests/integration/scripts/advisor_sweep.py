"""The advisor on a recorded shifted-exponential trace, and an exhaustive sweep of every variant
and K run with the true law on other seeds (tests/integration/test_advisor_sweep.py): one
process, in the background beside the unit tests, since the two sweeps train for a minute."""

import json
import sys
from pathlib import Path

import torch

from lightning_stale.analysis.advise import advise
from lightning_stale.analysis.sweeps import Sweep, configurations
from lightning_stale.config import compose_config
from lightning_stale.delays import ShiftedExponential, TraceRecorder

torch.set_num_threads(1)
P = 4
true = ShiftedExponential(0.01, 0.05, seed=5)
recorder = TraceRecorder()  # what a recording of the true law on 4 learners would write
for _ in range(300):
    for learner in range(P):
        recorder.record(learner, true.sample(learner))
trace = recorder.write(Path(sys.argv[1]).parent / "t.csv")
advice = advise(trace, P, overrides=["model.lr=0.3"], pushes=600, adaptive=False, et_updates=500, progress=None)
truth = Sweep(compose_config("train", ["model.lr=0.3", "seed=1"]), P, ShiftedExponential(0.01, 0.05, seed=9),
              advice.budget_s, progress=None)
# every variant and K: one run per distinct process (K-sync with K = P is Fully sync, ...)
timed = [[run.variant, run.k, run.time_to(advice.target, advice.window)]
         for run in truth.run_all(configurations(P, distinct=True))]
Path(sys.argv[1]).write_text(json.dumps({
    "chosen": None if advice.best is None else [advice.best.variant, advice.best.k],
    "advised": [[run.variant, run.k, advice.time_of(run)] for run in advice.runs],
    "timed": timed,
}))
