"""Recorded runs of the real engine on 2 CPU processes, one launch: an event log per variant and
server path (tests/integration/test_replay_processes.py replays them in one process)."""

import json
import os
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_stale import StaleStrategy
from lightning_stale.delays import Exponential
from replay_module import LIMITS, QUIET, Blobs, build_module

torch.set_num_threads(1)
out = Path(sys.argv[1])
# Every variant each path runs: all six on the central and sharded paths, the sync family on the
# collective path (its all-reduce refreshes every learner at every update)
RUNS = [("async", None, "central"), ("k_batch_async", 2, "central"), ("sync", None, "central"),
        ("k_sync", 1, "central"), ("k_batch_sync", 2, "central"), ("k_async", 2, "central"),
        ("sync", None, "collective"), ("k_sync", 1, "collective"), ("k_batch_sync", 2, "collective"),
        ("async", None, "sharded"), ("k_batch_sync", 1, "sharded"), ("sync", None, "sharded"),
        ("k_sync", 1, "sharded"), ("k_async", 2, "sharded"), ("k_batch_async", 2, "sharded")]



class DieAfterThreePushes(pl.Callback):
    """Learner 1's process dies after its third training step (the server goes on without it).
    Rank 0 waits at its third mini-batch until learner 1 is gone, so the death falls inside the
    first epoch (at most five of its six pushes made) and before the stop, however slowly
    learner 1's process starts on a loaded machine."""

    def __init__(self, folder):
        self.gone, self.steps = folder / "learner-1-gone", 0

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_rank == 0 and self.steps == 2:
            deadline = time.monotonic() + 120
            while not self.gone.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("learner 1 made no third step within 120 s")
                time.sleep(0.01)

    def on_train_batch_end(self, trainer, *args):
        self.steps += 1
        if trainer.global_rank == 1 and self.steps == 3:
            self.gone.write_text("3")
            os._exit(1)


results = {}
for variant, k, path in RUNS + [("k_async", 1, "central")]:
    dies = (variant, k) == ("k_async", 1)
    name = f"{variant}-{path}" + ("-killed" if dies else "")
    strategy = StaleStrategy(variant, k, delay=Exponential(0.01, seed=4), server=path, seed=2,
                             record_events=out.parent / f"{name}.jsonl", digest_every=1, record_trace=False,
                             on_learner_failure="continue" if dies else "stop")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, **QUIET, **LIMITS,
                         callbacks=[DieAfterThreePushes(out.parent)] if dies else [])
    trainer.fit(build_module(), Blobs())
    if trainer.global_rank == 0:
        results[name] = {"events_path": trainer.strategy.stats.get("events_path"),
                         "stats": {k: v for k, v in trainer.strategy.stats.items()}}
if pl.utilities.rank_zero.rank_zero_only.rank == 0:
    out.write_text(json.dumps(results, default=str))
