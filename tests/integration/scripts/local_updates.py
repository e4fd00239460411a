"""Local updates through StaleStrategy's central path on 2 CPU processes (learner 1 pushes its
pseudo-gradients through shared memory, then over gloo), and its collective path (the learners
all-reduce them over gloo, each applying the outer step), one launch for every fit."""

import pytorch_lightning as pl
import torch

from common import QUIET, CaptureRecords, on_every_rank, summary, write_results
from lightning_stale import StaleStrategy
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import ShiftedExponential, SlowLearners
from lightning_stale.models import MLP, Classifier

torch.set_num_threads(1)
DILOCO = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
RUNS = {
    # (a model of 90k values: its pushes exceed a header's frame, so learner 1's take a lane)
    "sync_diloco": dict(variant="sync", local_steps=4, outer_optimizer=DILOCO),
    "async_slow_learner": dict(variant="async", local_steps=3,
                               delay=SlowLearners(ShiftedExponential(shift=0.002, mean=0.004, seed=1),
                                                  learners=[1], factor=6)),
    "k_batch_sync_gloo": dict(variant="k_batch_sync", k=2, local_steps=2, shared_memory=False,
                              delay_mode="total"),  # (the push's whole time: its sum of H draws)
    # short epochs (12 batches a learner: 8 pushes), each validated: rounds span their ends
    "async_epochs": dict(variant="async", local_steps=3),
    # the collective path: K = 1 of 2, so each update (the first round to end) cancels the other
    # learner's round; each process applies DiLoCo's outer step to its own copy; short epochs
    "k_sync_collective": dict(variant="k_sync", k=1, local_steps=3, outer_optimizer=DILOCO, server="collective",
                              delay=ShiftedExponential(shift=0.002, mean=0.02, seed=1)),
    # the inner optimizer's cosine schedule (over 120 inner steps), stepped by each learner
    "scheduled_sync": dict(variant="sync", local_steps=3),
}
TRAINER = {"async_epochs": dict(limit_train_batches=12, check_val_every_n_epoch=1, max_steps=60),
           "k_sync_collective": dict(limit_train_batches=12, check_val_every_n_epoch=1, max_steps=60),
           "scheduled_sync": dict(limit_train_batches=12, max_steps=60)}
MODEL = {"scheduled_sync": dict(scheduler="cosine", scheduler_interval="step", schedule_length=120)}
results = {}
trainer = None
for name, options in RUNS.items():
    pl.seed_everything(0)
    dm = DigitsDataModule(batch_size=16)
    hidden = (1200,) if name == "sync_diloco" else (64,)
    model = Classifier(MLP(dm.input_shape, dm.num_classes, hidden), lr=0.1, **MODEL.get(name, {}))
    capture = CaptureRecords()
    options = {"delay": ShiftedExponential(shift=0.001, mean=0.002, seed=1), **options}
    trainer = pl.Trainer(accelerator="cpu", devices=2, callbacks=[capture],
                         strategy=StaleStrategy(**options, record_trace=False),
                         **{**QUIET, "max_steps": 48, **TRAINER.get(name, {})})
    trainer.fit(model, dm)
    collective = options.get("server") == "collective"
    # (on the collective path every learner holds a copy of the server's state; central: rank 0)
    state = (trainer.strategy._side.server if collective
             else trainer.strategy.core.state if trainer.global_rank == 0 else None)
    if collective:  # the copies, outer optimizer state included, must agree across the processes
        outer_state = [s["momentum_buffer"].tolist() for s in state.optimizer.state.values()]
        replicas = on_every_rank([[p.tolist() for p in state.params], outer_state,
                                  [p.tolist() for p in model.parameters()]])
    schedules = [(c.scheduler.last_epoch, c.scheduler.optimizer.param_groups[0]["lr"])
                 for c in trainer.lr_scheduler_configs]
    schedules = on_every_rank(schedules)  # (a collective: before rank 0's results)
    if trainer.global_rank == 0:
        results[name] = summary(trainer, capture)
        results[name]["global_step"] = trainer.global_step
        results[name]["schedules"] = schedules  # per rank: (last_epoch, lr) of each scheduler
        results[name]["module_matches_server"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), state.params))
        results[name]["outer"] = type(state.optimizer).__name__
        results[name]["outer_momentum"] = ["momentum_buffer" in s for s in state.optimizer.state.values()]
        if collective:
            results[name]["replicas_agree"] = all(replica == replicas[0] for replica in replicas[1:])
            results[name]["cancelled"] = trainer.strategy.stats.get("cancellations")
write_results(trainer, results)
