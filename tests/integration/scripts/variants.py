"""Every variant through StaleStrategy on 4 CPU processes, plus BoringModel, an LR schedule and a
checkpoint resume, all in one launch (the popen launcher reuses the processes for every fit)."""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.demos.boring_classes import BoringModel

from common import QUIET, CaptureRecords, summary, write_results
from lightning_stale import StaleStrategy
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import ShiftedExponential, SlowLearners
from lightning_stale.models import MLP, Classifier

torch.set_num_threads(1)
RUNS = [("sync", None), ("k_sync", 2), ("k_batch_sync", 3), ("async", None), ("k_async", 2), ("k_batch_async", 2)]
results = {}
trainer = None
for name, k in RUNS:
    pl.seed_everything(0)
    dm = DigitsDataModule(batch_size=16)
    scheduler = "cosine" if name == "k_batch_async" else None
    model = Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.2, scheduler=scheduler)
    capture = CaptureRecords()
    delay = ShiftedExponential(shift=0.002, mean=0.01, seed=1)
    if name == "k_batch_async":
        # learner 0 five times faster than the rest: it surely pushes twice into some update, which
        # the test checks (with equal learners a busy machine can settle them into turns)
        delay = SlowLearners(delay, learners=[1, 2, 3], factor=5)
    strategy = StaleStrategy(name, k, delay=delay)
    trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=60, strategy=strategy,
                         callbacks=[capture], check_val_every_n_epoch=1, **QUIET)
    trainer.fit(model, dm)
    if trainer.global_rank == 0:
        results[name] = summary(trainer, capture)
        results[name]["server_lr"] = trainer.strategy.core.state.optimizer.param_groups[0]["lr"]
        results[name]["module_matches_server"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), trainer.strategy.core.state.params))

# Beyond the paper: adaptive K with inverse-staleness weights, and the norm-adaptive step.
for label, options in [("adaptive", dict(variant="k_batch_async", adaptive_k={"k0": 1, "interval_s": 0.15},
                                          staleness_compensation="inverse")),
                       ("norm", dict(variant="k_async", k=2, staleness_compensation={"mode": "norm", "c": 0.05}))]:
    pl.seed_everything(0)
    dm = DigitsDataModule(batch_size=16)
    model = Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.2)
    capture = CaptureRecords()
    trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=120, callbacks=[capture], **QUIET,
                         strategy=StaleStrategy(**options, delay=ShiftedExponential(shift=0.002, mean=0.01, seed=1)))
    trainer.fit(model, dm)
    if trainer.global_rank == 0:
        results[label] = summary(trainer, capture)
        results[label]["k"] = [r.k for r in capture.records]

# Lightning's BoringModel, unchanged: fit, then validate, test and predict on the same strategy.
pl.seed_everything(0)
boring = BoringModel()
trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=20, strategy=StaleStrategy("k_async", 2), **QUIET)
trainer.fit(boring)
validated = trainer.validate(boring, verbose=False)
tested = trainer.test(boring, verbose=False)
predicted = trainer.predict(boring)
if trainer.global_rank == 0:
    results["boring"] = {"stats": trainer.strategy.stats, "validated": validated, "tested": tested,
                         "predicted": len(predicted)}

# Checkpoint after 30 updates, resume to 50.
ckpt = Path(sys.argv[1]).with_suffix(".ckpt")
pl.seed_everything(0)
dm = DigitsDataModule(batch_size=16)
model = Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.01, optimizer="adam")
trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=30, strategy=StaleStrategy("k_async", 2), **QUIET)
trainer.fit(model, dm)
trainer.save_checkpoint(ckpt)
before = summary(trainer, CaptureRecords()) if trainer.global_rank == 0 else None
saved_params = [p.detach().clone() for p in model.parameters()]
capture = CaptureRecords()
resumed = Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.01, optimizer="adam")
trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=50, strategy=StaleStrategy("k_async", 2),
                     callbacks=[capture], **QUIET)
trainer.fit(resumed, dm, ckpt_path=ckpt)
if trainer.global_rank == 0:
    saved = torch.load(ckpt, weights_only=False)
    results["resume"] = {"saved_server": saved["stale_server"], "adam_state": len(saved["optimizer_states"][0]["state"]),
                         "saved_matches_final": all(torch.equal(a, saved["state_dict"][n]) for (n, _), a in
                                                    zip(model.named_parameters(), saved_params)),
                         "first_run_updates": before["stats"]["updates"], **summary(trainer, capture)}
write_results(trainer, results)
