"""Shared pieces of the multi-process scripts (run by tests/integration/test_engine_processes.py)."""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch.distributed as dist

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0)


class CaptureRecords(pl.Callback):
    """Keeps every update record on rank 0 (in place of WallClockLogger, which would drain them)."""

    def __init__(self):
        self.records = []

    def on_train_batch_end(self, trainer, *args):
        self.records += trainer.strategy.pop_update_records()

    def on_train_end(self, trainer, *args):
        self.records += trainer.strategy.pop_update_records()


def summary(trainer, capture):
    return {"stats": {k: v for k, v in trainer.strategy.stats.items()},
            "learners": [list(r.learners) for r in capture.records],
            "staleness_max": [r.staleness_max for r in capture.records],
            "losses": [r.loss for r in capture.records],
            "updates": [r.update for r in capture.records],
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}


def write_results(trainer, results):
    if trainer.global_rank == 0:
        path = Path(sys.argv[1])
        path.write_text(json.dumps(results, default=str))


def on_every_rank(value):
    """``value`` as every rank has it, in rank order (a collective: every rank calls it)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
