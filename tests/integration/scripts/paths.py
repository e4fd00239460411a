"""The collective and sharded paths on 4 CPU processes, in one launch: every variant on the path
'auto' would pick at scale (forced here on a small model), the counts, the loss, every rank
ending with the same parameters, and checkpoints that resume on another path. Then the central
path with a model whose pushes and answers are too large for a header's frame: on one host they
travel through shared memory (and over gloo with ``shared_memory=False``), or on device channels
(gloo groups here) with the sharded path's pieces and slices too. Under ``sync`` the
collective path reduces during backward, on every learner alike, ending where reducing after the
decision ends, and a stop asked for inside a batch leaves no round waiting."""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint

from common import QUIET, CaptureRecords, on_every_rank, summary, write_results
from lightning_stale import StaleStrategy
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import ShiftedExponential
from lightning_stale.models import MLP, Classifier

torch.set_num_threads(1)
out = Path(sys.argv[1])
RUNS = [("sync", None, "collective"), ("k_sync", 2, "collective"), ("k_batch_sync", 3, "collective"),
        ("async", None, "sharded"), ("k_async", 2, "sharded"), ("k_batch_async", 2, "sharded"),
        ("k_sync", 2, "sharded")]


def model(optimizer="sgd", lr=0.2, hidden=(32, 32)):
    return Classifier(MLP((64,), 10, hidden_sizes=hidden), lr=lr, optimizer=optimizer)


def same_everywhere(module) -> bool:
    flat = torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()]).double()
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


class StopInsideABatch(pl.Callback):
    """Learner 2's Trainer wants to stop after update 20 (as EarlyStopping inside an epoch): every
    learner has armed its next backward, which the stop then cancels."""

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == 2 and trainer.global_step >= 20:
            trainer.should_stop = True


class BeforeTheLastUpdate(pl.Callback):
    """This learner's parameters at its last batch end before the final update."""

    def __init__(self, last: int):
        self.last, self.parameters = last, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step < self.last:
            self.parameters = [p.detach().clone() for p in pl_module.parameters()]

    def moved_since(self, module) -> bool:
        return any(not torch.equal(a, p) for a, p in zip(self.parameters, module.parameters()))


class EpochEnds(pl.Callback):
    """The update at which each epoch ended."""

    def __init__(self):
        self.updates = []

    def on_train_epoch_end(self, trainer, *args):
        self.updates.append(trainer.global_step)


def fit(strategy, module, max_steps, callbacks=(), ckpt_path=None, **kwargs):
    pl.seed_everything(0)
    capture = CaptureRecords()
    trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=max_steps, strategy=strategy,
                         callbacks=[capture, *callbacks], check_val_every_n_epoch=1, **{**QUIET, **kwargs})
    trainer.fit(module, DigitsDataModule(batch_size=16), ckpt_path=ckpt_path)
    return trainer, capture


results = {}
trainer = None
for name, k, path in RUNS:
    delay = ShiftedExponential(shift=0.002, mean=0.01, seed=1)
    module, before_last = model(), BeforeTheLastUpdate(60)
    trainer, capture = fit(StaleStrategy(name, k, delay=delay, server=path, record_trace=False), module, 60,
                           callbacks=[before_last])
    same = same_everywhere(module)
    overlapped = on_every_rank(trainer.strategy.overlapped_updates)
    # every learner applied the update that stopped training (it came with the stop)
    final_applied = on_every_rank(int(before_last.moved_since(module)))
    if trainer.global_rank == 0:
        results[f"{name}@{path}"] = {**summary(trainer, capture), "same_everywhere": same,
                                     "overlapped": overlapped, "final_update_applied": final_applied}

# The same 60 updates (three epochs' ends among them) reduced during backward, after the
# decision, and during backward again: the same fit, and bit for bit the same fit when run again.
compared = []
for overlap in (True, False, True):
    torch.manual_seed(0)
    module, epoch_ends = model(), EpochEnds()
    trainer, capture = fit(StaleStrategy("sync", server="collective", overlap_allreduce=overlap,
                                         record_trace=False), module, 60, callbacks=[epoch_ends])
    overlapped = on_every_rank(trainer.strategy.overlapped_updates)
    compared.append(([p.detach().clone() for p in module.parameters()], summary(trainer, capture), overlapped))
largest_difference = max(float((a - b).abs().max()) for a, b in zip(compared[0][0], compared[1][0]))
identical_again = all(torch.equal(a, b) for a, b in zip(compared[0][0], compared[2][0]))
if trainer.global_rank == 0:
    results["sync@collective-compared"] = {"losses": [c[1]["losses"] for c in compared],
                                           "epoch_ends": epoch_ends.updates,
                                           "overlapped": [c[2] for c in compared],
                                           "largest_difference": largest_difference,
                                           "identical_again": identical_again}
# A stop asked for inside a batch: the rounds launched for the cancelled work are completed and
# waited for at the end; the fit ends, nothing waits.
module = model()
trainer, capture = fit(StaleStrategy("sync", server="collective", record_trace=False), module, 60,
                       callbacks=[StopInsideABatch()])
same = same_everywhere(module)
overlapped = on_every_rank(trainer.strategy.overlapped_updates)
if trainer.global_rank == 0:
    results["sync@collective-stopped"] = {**summary(trainer, capture), "overlapped": overlapped,
                                          "same_everywhere": same}

# Central, with 0.2M parameters (0.8 MB pushes, over INLINE_PAYLOAD_BYTES): lanes, then gloo.
WIDE = (512, 320)
for name, k, lanes in [("k_batch_async", 2, True), ("k_sync", 3, True), ("k_async", 2, False)]:
    module = model(hidden=WIDE, lr=0.05)
    delay = ShiftedExponential(shift=0.002, mean=0.01, seed=1)
    trainer, capture = fit(StaleStrategy(name, k, delay=delay, server="central", shared_memory=lanes,
                                         record_trace=False), module, 40)
    same = same_everywhere(module)
    if trainer.global_rank == 0:
        results[f"{name}@central" + ("" if lanes else "-gloo")] = {
            **summary(trainer, capture), "same_everywhere": same,
            "parameters": sum(p.numel() for p in module.parameters())}

# Payloads on channels, one gloo group per direction between two ranks (NCCL's way on GPUs):
# central with whole-model payloads, sharded with 0.4M parameters, so that two owners' pieces and
# slices exceed a frame (the others' travel in it).
for name, k, path, hidden in [("k_async", 2, "central", WIDE), ("k_batch_async", 2, "sharded", (1024, 320))]:
    module = model(hidden=hidden, lr=0.05)
    delay = ShiftedExponential(shift=0.002, mean=0.01, seed=1)
    trainer, capture = fit(StaleStrategy(name, k, delay=delay, server=path, payload_channels=True,
                                         record_trace=False), module, 40)
    same = same_everywhere(module)
    if trainer.global_rank == 0:
        results[f"{name}@{path}-channels"] = {**summary(trainer, capture), "same_everywhere": same,
                                              "parameters": sum(p.numel() for p in module.parameters())}

# A checkpoint written during training on the sharded path (gathered from every owner), resumed
# on the central path; one written after fit on the collective path, resumed on the sharded one.
# (every 2 updates: rank 0's step jumps by several updates at once under K-async, and on a busy
# machine it passed over every multiple of 5 before the end once)
saver = ModelCheckpoint(dirpath=out.parent / "ckpt", every_n_train_steps=2, save_top_k=-1)
adam = model("adam", 0.01)
trainer, _ = fit(StaleStrategy("k_async", 2, server="sharded", record_trace=False), adam, 20,
                 callbacks=[saver], enable_checkpointing=True)
# The first one written during training (rank 0's step, the version it holds, may jump past a
# multiple of 2 when several updates come at once).
middle = min((out.parent / "ckpt").glob("*.ckpt"), key=lambda path: torch.load(path, weights_only=True)["global_step"])
resumed = model("adam", 0.01)
trainer, capture = fit(StaleStrategy("k_async", 2, server="central", record_trace=False), resumed, 30,
                       ckpt_path=middle)
if trainer.global_rank == 0:
    saved = torch.load(middle, weights_only=True)
    results["sharded_checkpoint"] = {
        "saved_server": saved["stale_server"], "adam_states": len(saved["optimizer_states"][0]["state"]),
        "trainable_tensors": sum(1 for p in adam.parameters() if p.requires_grad),
        "lr": saved["optimizer_states"][0]["param_groups"][0]["lr"],
        "differs_from_final": any(not torch.equal(saved["state_dict"][n], p)
                                  for n, p in adam.named_parameters()),
        "resumed": summary(trainer, capture)}
collective = model("adam", 0.01)
trainer, _ = fit(StaleStrategy("k_sync", 2, server="collective", record_trace=False), collective, 15)
after = out.parent / "after.ckpt"
trainer.save_checkpoint(after)
final = {n: p.detach().clone() for n, p in collective.named_parameters()}
sharded = model("adam", 0.01)
trainer, capture = fit(StaleStrategy("k_async", 2, server="sharded", record_trace=False), sharded, 25,
                       ckpt_path=after)
same = same_everywhere(sharded)
if trainer.global_rank == 0:
    saved = torch.load(after, weights_only=True)
    results["collective_checkpoint"] = {
        "saved_server": saved["stale_server"], "matches_module": all(
            torch.equal(saved["state_dict"][n], p) for n, p in final.items()),
        "adam_states": len(saved["optimizer_states"][0]["state"]),
        "resumed": summary(trainer, capture), "same_everywhere": same}
write_results(trainer, results)
