"""Run under torchrun as two nodes of two processes each (see tests/integration/test_engine_processes.py):
the same strategy, with P = devices x num_nodes = 4, through Lightning's cluster environment."""

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.plugins.environments import TorchElasticEnvironment

from common import QUIET, CaptureRecords, summary, write_results
from lightning_stale import StaleStrategy
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import Exponential
from lightning_stale.models import MLP, Classifier

pl.seed_everything(0)
dm = DigitsDataModule(batch_size=16)
capture = CaptureRecords()
trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_steps=40, callbacks=[capture],
                     strategy=StaleStrategy("k_batch_async", 2, delay=Exponential(mean=0.005, seed=0)), **QUIET)
trainer.fit(Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.2), dm)
result = summary(trainer, capture) if trainer.global_rank == 0 else {}
result["environment"] = type(trainer.strategy.cluster_environment).__name__
result["is_torchelastic"] = isinstance(trainer.strategy.cluster_environment, TorchElasticEnvironment)
# The sharded path across the two nodes with its pieces and slices on device channels (gloo groups
# here), 0.4M parameters so that they exceed a header's frame.
capture = CaptureRecords()
trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_steps=20, callbacks=[capture],
                     strategy=StaleStrategy("k_async", 2, server="sharded", payload_channels=True,
                                            delay=Exponential(mean=0.005, seed=0)), **QUIET)
trainer.fit(Classifier(MLP(dm.input_shape, dm.num_classes, hidden_sizes=(1024, 320)), lr=0.05), dm)
if trainer.global_rank == 0:
    result["channels"] = summary(trainer, capture)
write_results(trainer, result)
# Leave together and tear the default group down before exiting, as torchrun scripts should:
# a worker exiting while another still uses the group or the agents' store can abort at exit.
dist.barrier()
dist.destroy_process_group()
