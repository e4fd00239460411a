"""Modules as users write them (tests/user_modules.py) on 2 CPU learner processes, several fits
in one launch (the popen launcher reuses the processes): BatchNorm state identical on every
learner at every validation and equal to the checkpoint's; a StepLR and a ReduceLROnPlateau per
epoch stepped by the server between epochs; the warm-up sized from estimated_stepping_batches;
the collective and sharded paths (forced: 'auto' keeps these small models central) with BatchNorm,
an AdamW warm-up and a frozen backbone; a ``lightning.pytorch`` Trainer in the same processes
when ``lightning`` is installed."""

import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: user_modules

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

import user_modules as um  # noqa: E402
from common import QUIET, on_every_rank, write_results  # noqa: E402
from lightning_stale import StaleStrategy  # noqa: E402
from lightning_stale.engine.core import ServerCore  # noqa: E402
from lightning_stale.engine.distributed.lanes import Lane  # noqa: E402
from lightning_stale.engine.distributed.messages import Kind  # noqa: E402
from lightning_stale.engine.distributed.transport import ServerEndpoint  # noqa: E402
from lightning_stale.engine.state import ModelVectors, ServerState  # noqa: E402

torch.set_num_threads(1)
results = {}
OUT = Path(sys.argv[1])
applied = []  # rank 0: (paused, lr, epochs ended) of every update the server applied
_apply = ServerState.apply


def recording_apply(self, contributions, weights=None, update_index=0):
    core = getattr(self, "core_for_test", None)  # none where a shard owner applies
    if core is not None:
        applied.append((core._paused_at is not None, self.optimizer.param_groups[0]["lr"], core.epoch))
    return _apply(self, contributions, weights, update_index)


ServerState.apply = recording_apply
_core_init = ServerCore.__init__


def core_init(self, variant, state=None, *args, **kwargs):
    _core_init(self, variant, state, *args, **kwargs)
    if state is not None:
        state.core_for_test = self


ServerCore.__init__ = core_init
placed = []  # rank 0: answers the server wrote straight into a learner's slot
_place_for = ServerEndpoint.place_for


def counting_place_for(self, learner, numel, dtype):
    place = _place_for(self, learner, numel, dtype)
    placed.append(place is not None)
    return place


ServerEndpoint.place_for = counting_place_for
lent = []  # rank 0: pushes the server read in their slot (`Lane.lend` there lends nothing else)
_lend = Lane.lend


def counting_lend(self, message, numel, dtype):
    lent.append(message.kind)
    _lend(self, message, numel, dtype)


Lane.lend = counting_lend


class Books(pl.Callback):
    """Whether the module's parameters and buffers are the same on every learner whenever
    validation starts."""

    def __init__(self):
        self.same = []

    def on_validation_start(self, trainer, pl_module):
        flat = torch.cat([t.detach().reshape(-1).double() for t in pl_module.state_dict().values()])
        gathered = trainer.strategy.all_gather(flat)
        self.same.append(bool((gathered == gathered[0]).all()))


class ValidationLosses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_validation_end(self, trainer, *args):
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.losses.append(float(trainer.callback_metrics["val/loss"]))


def fit(model, data, strategy, callbacks=(), trainer_cls=pl.Trainer, **kwargs):
    applied.clear()
    trainer = trainer_cls(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=list(callbacks),
        **{**QUIET, **kwargs},
    )
    trainer.fit(model, data)
    return trainer


def evaluate(module, loader):
    module.eval()
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(module(x), y) for x, y in loader]
    return float(sum(losses) / len(losses))


# BatchNorm CNN, Async on 2 learners (they hold different versions while training).
pl.seed_everything(0)
data, model, books, seen = um.BlobData(image=True), um.BatchNormCNN(), Books(), ValidationLosses()
trainer = fit(model, data, StaleStrategy("async", record_trace=False), [books, seen], max_epochs=3)
ckpt = OUT.with_suffix(".bn.ckpt")
trainer.save_checkpoint(ckpt)
after_fit = trainer.validate(model, data, verbose=False)[0]["val/loss"]
if trainer.global_rank == 0:
    restored = um.BatchNormCNN.load_from_checkpoint(ckpt)
    data.setup()
    state = trainer.strategy.core.state
    results["batchnorm"] = {
        "same_on_every_learner": books.same,
        "logged": seen.losses,
        "after_fit": after_fit,
        "checkpoint_eval": evaluate(restored, data.val_dataloader()),
        "buffers_in_checkpoint": sorted(
            k
            for k in torch.load(ckpt, weights_only=False)["state_dict"]
            if "running" in k or "num_batches" in k
        ),
        "server_buffers_match_module": all(
            torch.equal(v, model.state_dict()[k]) for k, v in state.named_state(model).items()
        ),
        "applied_while_paused": sum(p for p, _, _ in applied),
        "stats": trainer.strategy.stats,
    }


# A StepLR per epoch: every update of epoch e must use lr * gamma**e.
class Stepped(um.Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


pl.seed_everything(0)
trainer = fit(Stepped(), um.BlobData(), StaleStrategy("async", record_trace=False), max_epochs=3)
if trainer.global_rank == 0:
    results["steplr"] = {
        "applied": list(applied),
        "stats": trainer.strategy.stats,
        "final_lr": trainer.strategy.core.state.optimizer.param_groups[0]["lr"],
    }

# ReduceLROnPlateau on val/loss, per epoch, on validation data it cannot keep improving on.
pl.seed_everything(0)
seen = ValidationLosses()
trainer = fit(
    um.Plateau(lr=0.2, factor=0.5),
    um.BlobData(val_noise_labels=True),
    StaleStrategy("async", record_trace=False),
    [seen],
    max_epochs=4,
)
if trainer.global_rank == 0:
    results["plateau"] = {
        "losses": seen.losses,
        "applied": list(applied),
        "final_lr": trainer.strategy.core.state.optimizer.param_groups[0]["lr"],
    }

# AdamW warm-up sized from estimated_stepping_batches, max_epochs only.
pl.seed_everything(0)
model = um.WarmupAdamW()
trainer = fit(model, um.BlobData(), StaleStrategy("async", record_trace=False), max_epochs=2)
if trainer.global_rank == 0:
    results["warmup"] = {"total_steps": model.total_steps, "stats": trainer.strategy.stats}


# max_time on two learners: whoever passes it first ends training for all.
pl.seed_everything(0)
started = time.monotonic()
trainer = fit(
    um.SlowSteps(),
    um.BlobData(),
    StaleStrategy("async", record_trace=False),
    max_time={"seconds": 2},
)
if trainer.global_rank == 0:
    results["max_time"] = {
        "elapsed": time.monotonic() - started,
        "stats": trainer.strategy.stats,
        "global_step": trainer.global_step,
        "finished": trainer.state.finished,
    }



# The module's own on_train_batch_end (after every callback's) stops training on learner 1 only:
# every learner stops, validating once together, as all DDP ranks would.
class StopsItself(um.Classifier):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step >= 20:
            self.trainer.should_stop = True


pl.seed_everything(0)
seen = ValidationLosses()
trainer = fit(StopsItself(), um.BlobData(), StaleStrategy("async", record_trace=False), [seen], max_epochs=30)
if trainer.global_rank == 0:
    results["module_stop"] = {"finished": trainer.state.finished, "stats": trainer.strategy.stats,
                              "validations": len(seen.losses), "epoch": trainer.current_epoch}


# A stop asked for at an epoch's end (learner 0, paused by it already) while learner 1 is still
# computing its first mini-batch of that epoch: learner 1 hears the epoch's end and the stop
# together, before its end of the epoch, learner 0 only after its own. Every learner must stop
# with the others, validating in step (the books gather from all of them).
class StopsAtAnEpochsEnd(um.Classifier):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.current_epoch == 1 and batch_idx == 0:
            time.sleep(0.5)  # learner 0 ends the epoch meanwhile (an epoch is 12 updates)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0 and self.current_epoch == 1 and self.trainer.strategy._learner.paused:
            self.trainer.should_stop = True


pl.seed_everything(0)
seen, books = ValidationLosses(), Books()
trainer = fit(StopsAtAnEpochsEnd(), um.BlobData(), StaleStrategy("async", record_trace=False), [seen, books],
              max_epochs=30)
if trainer.global_rank == 0:
    results["epoch_end_stop"] = {"finished": trainer.state.finished, "stats": trainer.strategy.stats,
                                 "validations": len(seen.losses), "same": books.same}


class Rates(pl.Callback):
    """(version, lr) on this learner after every push: the collective path steps every
    learner's own scheduler per update."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))


def same_everywhere(trainer, module):
    flat = torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])
    gathered = trainer.strategy.all_gather(flat)
    return bool((gathered == gathered[0]).all())


# The scaled paths with users' modules. BatchNorm: buffers averaged over each update's gradients.
for name, path in (("sync", "collective"), ("async", "sharded")):
    pl.seed_everything(0)
    data, model, books, seen = um.BlobData(image=True), um.BatchNormCNN(), Books(), ValidationLosses()
    trainer = fit(model, data, StaleStrategy(name, server=path, record_trace=False), [books, seen],
                  max_epochs=2)
    overlapped = on_every_rank(trainer.strategy.overlapped_updates)
    ckpt = OUT.with_suffix(f".bn-{path}.ckpt")
    trainer.save_checkpoint(ckpt)
    after_fit = trainer.validate(model, data, verbose=False)[0]["val/loss"]
    same = same_everywhere(trainer, model)
    if trainer.global_rank == 0:
        data.setup()
        results[f"batchnorm@{path}"] = {
            "same_on_every_learner": books.same,
            "same_after_fit": same,
            "logged": seen.losses,
            "after_fit": after_fit,
            "checkpoint_eval": evaluate(um.BatchNormCNN.load_from_checkpoint(ckpt), data.val_dataloader()),
            "stats": trainer.strategy.stats,
            "overlapped": overlapped,
        }

# AdamW with a warm-up sized from estimated_stepping_batches, each learner stepping it (collective).
pl.seed_everything(0)
model, rates = um.WarmupAdamW(), Rates()
trainer = fit(model, um.BlobData(), StaleStrategy("k_sync", 2, server="collective", record_trace=False),
              [rates], max_epochs=2)
same, seen_everywhere = same_everywhere(trainer, model), on_every_rank(rates.seen)
overlapped = on_every_rank(trainer.strategy.overlapped_updates)
if trainer.global_rank == 0:
    results["warmup@collective"] = {"total_steps": model.total_steps, "stats": trainer.strategy.stats,
                                    "overlapped": overlapped,
                                    "rates": seen_everywhere, "same_after_fit": same,
                                    "lr": model.hparams.lr, "warmup": model.hparams.warmup}

# A frozen backbone under AdamW's weight decay: its optimizer state cut into shards (sharded),
# and every learner stepping its own with the gradients reduced during backward (collective).
for name, k, path in (("k_async", 1, "sharded"), ("sync", None, "collective")):
    pl.seed_everything(0)
    model = um.FrozenBackbone()
    frozen = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    head = {k: v.clone() for k, v in model.net.state_dict().items()}
    trainer = fit(model, um.BlobData(), StaleStrategy(name, k, server=path, record_trace=False), max_epochs=2)
    overlapped = on_every_rank(trainer.strategy.overlapped_updates)
    ckpt = OUT.with_suffix(f".frozen-{path}.ckpt")
    trainer.save_checkpoint(ckpt)
    same = same_everywhere(trainer, model)
    if trainer.global_rank == 0:
        saved = torch.load(ckpt, weights_only=False)
        results[f"frozen@{path}"] = {
            "backbone_unchanged": all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in frozen.items()),
            "backbone_unchanged_in_checkpoint": all(torch.equal(v, saved["state_dict"][f"backbone.{k}"])
                                                    for k, v in frozen.items()),
            "head_moved": any(not torch.equal(v, model.net.state_dict()[k]) for k, v in head.items()),
            "adamw_states": len(saved["optimizer_states"][0]["state"]),
            "trainable_tensors": sum(1 for p in model.parameters() if p.requires_grad),
            "same_after_fit": same,
            "overlapped": overlapped,
            "stats": trainer.strategy.stats,
        }

# The central path with a module whose pushes and answers cross in shared memory (frozen backbone,
# BatchNorm, AdamW with a warm-up), K-async on its default ('auto') path.
pl.seed_everything(0)
placed.clear()
lent.clear()
model, books = um.WideFrozenBatchNorm(), Books()
frozen = {k: v.clone() for k, v in model.backbone.state_dict().items()}
head = {k: v.clone() for k, v in model.net.state_dict().items()}
trainer = fit(model, um.BlobData(), StaleStrategy("k_async", 1, record_trace=False), [books], max_epochs=2)
same = same_everywhere(trainer, model)
if trainer.global_rank == 0:
    results["wide@central"] = {
        "same_on_every_learner": books.same, "same_after_fit": same,
        "backbone_unchanged": all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in frozen.items()),
        "head_moved": any(not torch.equal(v, model.net.state_dict()[k]) for k, v in head.items()),
        "push_bytes": 4 * ModelVectors.of(model).max_push_numel(),
        "total_steps": model.total_steps, "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "configured_lr": model.hparams.lr, "stats": trainer.strategy.stats,
        "placed_answers": sum(placed), "lent_pushes": lent.count(Kind.PUSH),
    }

# The same module with its pushes and answers on device channels (gloo groups on CPU) instead.
pl.seed_everything(0)
model, books = um.WideFrozenBatchNorm(), Books()
frozen = {k: v.clone() for k, v in model.backbone.state_dict().items()}
trainer = fit(model, um.BlobData(), StaleStrategy("k_async", 1, payload_channels=True, record_trace=False),
              [books], max_epochs=2)
same = same_everywhere(trainer, model)
if trainer.global_rank == 0:
    results["wide@central-channels"] = {
        "same_on_every_learner": books.same, "same_after_fit": same,
        "backbone_unchanged": all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in frozen.items()),
        "total_steps": model.total_steps, "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "configured_lr": model.hparams.lr, "stats": trainer.strategy.stats,
    }

# `sync` on the 'auto' path with a model that is central only where every learner shares memory
# with rank 0 (`ranks.settle_path` opens the lanes to decide, and the central path takes them).
pl.seed_everything(0)
model, books = um.WideFrozenBatchNorm(width=2100), Books()
trainer = fit(model, um.BlobData(), StaleStrategy("sync", record_trace=False), [books], max_epochs=1)
same = same_everywhere(trainer, model)
if trainer.global_rank == 0:
    results["wider@auto"] = {"same_on_every_learner": books.same, "same_after_fit": same,
                             "numel": ModelVectors.of(model).numel, "stats": trainer.strategy.stats}

# The same processes under a lightning.pytorch Trainer.
if importlib.util.find_spec("lightning") is not None:
    import lightning as L
    import lightning_modules as lm

    # the registered name (the central path), then the two scaled paths, forced
    for label, strategy in [("lightning", "k_async"),
                            ("lightning@collective", StaleStrategy("k_sync", 2, server="collective")),
                            ("lightning@sharded", StaleStrategy("k_async", 1, server="sharded"))]:
        pl.seed_everything(0)
        model = lm.LitClassifier()
        trainer = fit(model, lm.LitBlobs(), strategy, trainer_cls=L.Trainer, max_steps=12)
        overlapped = on_every_rank(trainer.strategy.overlapped_updates)
        if trainer.global_rank == 0:
            results[label] = {
                "trainer": type(trainer).__module__,
                "stats": trainer.strategy.stats,
                "total_steps": model.total_steps,
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "val_loss": float(trainer.callback_metrics["val/loss"]),
                "overlapped": overlapped,
            }
write_results(trainer, results)
