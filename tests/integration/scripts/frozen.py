"""A learner frozen with SIGSTOP for a few seconds must not stall the server when K < P; after
SIGCONT it rejoins. Rank 0 freezes rank 3 from a watcher thread, and once rank 3 has pushed again
ends the run from its own side (a learner-initiated stop)."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from common import QUIET, write_results
from lightning_stale import StaleStrategy
from lightning_stale.delays import Exponential
from lightning_stale.models import MLP, Classifier

FREEZE_S = 3.0
torch.set_num_threads(1)
pid_dir = Path(sys.argv[1]).parent


class Freezer(pl.Callback):
    def __init__(self):
        self.result = {}

    def on_train_start(self, trainer, module):
        name = f"pid_{trainer.global_rank}_{trainer.strategy.variant_name}"
        (pid_dir / f".{name}.tmp").write_text(str(os.getpid()))
        os.replace(pid_dir / f".{name}.tmp", pid_dir / name)  # atomic: rank 0's watcher polls for it
        if trainer.global_rank == 0:
            threading.Thread(target=self._freeze, args=(trainer,), daemon=True).start()

    def _freeze(self, trainer):
        while trainer.strategy.core is None:  # the strategy starts it after the callbacks' hook
            time.sleep(0.01)
        counts = trainer.strategy.core.rules.counts
        pid_file = pid_dir / f"pid_3_{trainer.strategy.variant_name}"
        while counts.updates < 20 or not pid_file.exists():
            time.sleep(0.01)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGSTOP)
        frozen_at = (counts.updates, counts.pushes_per_learner[3])
        time.sleep(FREEZE_S)
        thawed_at = (counts.updates, counts.pushes_per_learner[3])
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while counts.pushes_per_learner[3] < thawed_at[1] + 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.result = {"updates_frozen": thawed_at[0] - frozen_at[0], "pushes_while_frozen": thawed_at[1] - frozen_at[1],
                       "pushes_3_at_thaw": thawed_at[1], "updates_at_stop_request": counts.updates}
        trainer.should_stop = True  # rank 0 leaves; its goodbye stops the server and every learner


data = TensorDataset(torch.randn(200_000, 8), torch.randint(0, 4, (200_000,)))  # one long epoch
results = {}
trainer = None
for name, k in [("k_async", 2), ("k_sync", 3)]:
    pl.seed_everything(0)
    freezer = Freezer()
    model = Classifier(MLP((8,), 4, hidden_sizes=(16,)), lr=0.05)
    trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=100_000, callbacks=[freezer],
                         strategy=StaleStrategy(name, k, delay=Exponential(mean=0.004, seed=0)), **QUIET)
    start = time.monotonic()
    trainer.fit(model, DataLoader(data, batch_size=16))
    if trainer.global_rank == 0:
        results[name] = {"stats": trainer.strategy.stats, "wall_s": time.monotonic() - start, **freezer.result}
write_results(trainer, results)
