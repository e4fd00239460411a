"""One injected fault per launch (run by tests/integration/test_faults.py):

    python faults.py CASE OUT_DIR [CHECKPOINT]

CASE names the fault (see CASES); the fault is injected once every learner is training (each has
pushed a few gradients) and the server has made FAULT_AT updates. Each process writes into
OUT_DIR what the test asserts: its pid (``pid_<rank>``) at the start of training, the fault's
wall-clock time (``fault.json``, by the process that injects it), the exception it ends with
(``exception_<rank>.json``, from ``on_exception``), whether ``fit`` raised (``end_<rank>.json``:
the process then exits with status 1) and, on rank 0 once ``fit`` has ended, the server's
counters, what its checkpoint holds and its learners' exit statuses as far as the launcher knows
them then (``rank0.json``; it does not wait for them, so as not to delay its own exit).
Logs (``wallclock.csv``, ``delays.csv``) go to OUT_DIR/logs/version_0, OnExceptionCheckpoint
writes OUT_DIR/on_exception.ckpt. Case "resume" continues from CHECKPOINT to MAX_STEPS. The
"continue" cases validate at every epoch's end (short epochs), before and after the death.
"""

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStrategy, WallClockLogger
from lightning_stale.delays import Exponential
from lightning_stale.models import MLP, Classifier

CASE, OUT = sys.argv[1], Path(sys.argv[2])
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks on a hang
FAULT_AT = 15  # server updates before the fault
MAX_STEPS = 60
torch.set_num_threads(1)

# case: (rank that injects the fault, the fault, processes, variant, K, strategy options)
CONTINUE = {"on_learner_failure": "continue"}
CASES = {
    "scheduler": (0, "scheduler", 2, "k_async", 1, {}),
    "optimizer": (0, "optimizer", 2, "k_async", 1, {}),
    "training_step": (1, "training_step", 2, "k_async", 1, {}),
    "callback": (0, "callback", 2, "k_async", 1, {}),
    "sigterm_launcher": (0, signal.SIGTERM, 2, "k_async", 1, {}),
    "sigterm_child": (1, signal.SIGTERM, 2, "k_async", 1, {}),
    "sigint_launcher": (0, signal.SIGINT, 2, "k_async", 1, {}),
    "sigint_child": (1, signal.SIGINT, 2, "k_async", 1, {}),
    "sigkill_server": (0, signal.SIGKILL, 2, "k_async", 1, {}),
    # the server's thread stuck in a step (as behind a GPU payload that never comes), then rank
    # 1 SIGKILLed: rank 0 must end without its server loop hearing of the death
    "stuck_server_child_killed": (1, "stuck_server", 2, "k_async", 1, {}),
    "sigstop_server": (0, signal.SIGSTOP, 2, "k_async", 1, {"server_timeout": 3.0}),
    # rank 0 SIGKILLs learner 2 (VICTIM): only the server knows when every learner is training
    "continue_k_async": (0, signal.SIGKILL, 3, "k_async", 2, CONTINUE),
    "continue_k_batch_sync": (0, signal.SIGKILL, 3, "k_batch_sync", 2, CONTINUE),
    # learner 2 frozen (SIGSTOP) mid-epoch, SIGKILLed 1 s after the server ended that epoch: the
    # others wait at the roll call then, and learn of the death before Lightning's collectives
    "continue_killed_at_epoch_end": (0, "freeze_then_kill", 3, "k_async", 2, CONTINUE),
    # learner 2 frozen mid-epoch for good: the roll call at the epoch's end fails the run after
    # the strategy's timeout (that of Lightning's collectives, which would wait as long), 4 s here
    "continue_frozen_at_epoch_end": (0, signal.SIGSTOP, 3, "k_async", 2, CONTINUE),
    "resume": (None, None, 2, "k_async", 1, {}),
    # the scaled paths: the learners' own all-reduce and optimizer step (collective), the shard
    # owners' threads in every process (sharded)
    "training_step_collective": (1, "training_step", 2, "k_sync", 2, {"server": "collective"}),
    "optimizer_collective": (0, "optimizer", 2, "k_sync", 2, {"server": "collective"}),
    # local updates there: a learner's exception between two inner steps of its round
    "training_step_collective_local": (1, "training_step", 2, "k_sync", 2, {"server": "collective", "local_steps": 2}),
    "training_step_sharded": (1, "training_step", 2, "k_async", 1, {"server": "sharded"}),
    "optimizer_sharded": (0, "optimizer", 2, "k_async", 1, {"server": "sharded"}),
    "sigkill_child_sharded": (1, signal.SIGKILL, 2, "k_async", 1, {"server": "sharded"}),
    # K = P: the learners reduce during backward (the overlap's groups), a round may be pending
    "sigkill_child_collective": (1, signal.SIGKILL, 2, "k_sync", 2, {"server": "collective"}),
    # the central path with pushes and answers too large for a frame: they cross in shared memory
    "sigkill_child_lanes": (1, signal.SIGKILL, 2, "k_async", 1, {"server": "central"}),
    "continue_k_async_lanes": (0, signal.SIGKILL, 3, "k_async", 2, CONTINUE),
    # the same with the payloads on device channels (gloo groups on CPU), not in shared memory
    "sigkill_child_channels": (1, signal.SIGKILL, 2, "k_async", 1, {"server": "central", "payload_channels": True}),
}
# 0.1M parameters (0.4 MB payloads, over INLINE_PAYLOAD_BYTES) for the lanes' and channels' cases,
# else 0.2k
HIDDEN = (320, 320) if CASE.endswith(("_lanes", "_channels")) else (16,)
INJECTOR, FAULT, DEVICES, VARIANT, K, OPTIONS = CASES[CASE]
SURVIVE = OPTIONS.get("on_learner_failure") == "continue"
VICTIM = 2 if SURVIVE else INJECTOR  # the process a signal is sent to
armed = False  # the server's own faults (optimizer, scheduler) fire once this is set


def write_json(name, value):
    partial = OUT / f".{name}.tmp"
    partial.write_text(json.dumps(value, default=str))
    os.replace(partial, OUT / name)


def fault_now(what):
    write_json("fault.json", {"time": time.time(), "what": what})


class FailingSGD(torch.optim.SGD):
    """SGD whose step raises once armed (the server's copy of the optimizer is the one that
    steps, on the server thread)."""

    def step(self, closure=None):
        if armed:
            fault_now("optimizer")
            raise RuntimeError("optimizer step failed")
        return super().step(closure)


class StickingSGD(torch.optim.SGD):
    """SGD whose step (on the server's thread) blocks once the injector has asked for it."""

    def step(self, closure=None):
        while (OUT / "stick").exists():
            time.sleep(0.05)
        return super().step(closure)


def lr_factor(step):
    if armed:
        fault_now("scheduler")
        raise RuntimeError("scheduler failed")
    return 1.0


class Model(Classifier):
    def training_step(self, batch, batch_idx):
        if FAULT == "training_step" and armed:
            fault_now(FAULT)
            raise ValueError("boom")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        if FAULT == "optimizer":
            return FailingSGD(self.parameters(), lr=0.05)
        if FAULT == "stuck_server":
            return StickingSGD(self.parameters(), lr=0.05)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        if FAULT != "scheduler":
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Inject(pl.Callback):
    """Writes this process's pid, arms or injects the fault, and records how this process ends."""

    def __init__(self):
        self.batches = 0
        self.epoch_start = None  # rank 0: the server's pushes per learner at the epoch's start
        self.updates_at_death = None  # rank 0: the server's updates when it lost a learner
        self.epoch_at_death = None  # rank 0: its epoch then

    def on_train_start(self, trainer, module):
        write_json(f"pid_{trainer.global_rank}", os.getpid())  # atomic: the test polls for it
        if CASE == "continue_frozen_at_epoch_end":
            # the bound of the collectives, cut once set up (the launch itself takes longer)
            trainer.strategy._timeout = timedelta(seconds=4)

    def on_train_epoch_start(self, trainer, module):
        core = trainer.strategy.core
        if core is not None:
            self.epoch_start = list(core.rules.counts.pushes_per_learner)

    def on_train_batch_end(self, trainer, *args):
        global armed
        self.batches += 1
        core = trainer.strategy.core
        if core is not None and core.rules.counts.dead_learners and self.updates_at_death is None:
            self.updates_at_death, self.epoch_at_death = core.updates, trainer.current_epoch
        if trainer.global_rank != INJECTOR or armed or not self._ready(trainer):
            return
        armed = True
        if FAULT == "callback":
            fault_now(FAULT)
            raise KeyError("callback failed")
        pid = os.getpid() if VICTIM == INJECTOR else json.loads((OUT / f"pid_{VICTIM}").read_text())
        if isinstance(FAULT, signal.Signals):
            fault_now(FAULT.name)
            os.kill(pid, FAULT)
        if FAULT == "stuck_server":
            (OUT / "stick").touch()
            time.sleep(1.0)  # the server's next step has begun by now, and blocks
            fault_now("SIGKILL")
            os.kill(pid, signal.SIGKILL)
        if FAULT == "freeze_then_kill":
            os.kill(pid, signal.SIGSTOP)
            threading.Thread(target=self.kill_after_epoch_end, args=(trainer.strategy.core, pid), daemon=True).start()

    @staticmethod
    def kill_after_epoch_end(core, pid):
        epoch, deadline = core.epoch, time.monotonic() + 60
        while core.epoch == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # the others have paused at the epoch's end by now
        fault_now("SIGKILL")
        os.kill(pid, signal.SIGKILL)

    def _ready(self, trainer):
        core = trainer.strategy.core  # on rank 0
        if SURVIVE:
            # Killed while every learner trains, well inside an epoch (after the first): every
            # learner has pushed twice since the epoch's start (so none is still validating: one
            # push may have left before the epoch's end), and the server has received at most
            # half the epoch's 24 pushes (an epoch counts pushes: under K-batch-sync it is fewer
            # than 12 updates). A learner that dies while the others validate at an epoch's end
            # ends the run even under "continue" (README, "Faults"); a learner's own count cannot
            # tell: one starved of CPU can see the epoch's start after the others reach its end.
            if trainer.current_epoch < 1 or self.epoch_start is None:
                return False
            gained = [now - then for now, then in zip(core.rules.counts.pushes_per_learner, self.epoch_start)]
            return min(gained) >= 2 and sum(gained) <= 12
        if trainer.global_step < FAULT_AT or self.batches < 3:
            return False
        return core is None or min(core.rules.counts.pushes_per_learner) >= 3

    def on_exception(self, trainer, module, exception):
        write_json(f"exception_{trainer.global_rank}.json",
                   {"type": type(exception).__name__, "message": str(exception), "time": time.time()})


def main():
    OUT.mkdir(exist_ok=True)
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(20_000, 8), torch.randint(0, 4, (20_000,)))
    model = Model(MLP((8,), 4, hidden_sizes=HIDDEN), lr=0.05)
    strategy = StaleStrategy(VARIANT, K, delay=Exponential(mean=0.01, seed=0), **OPTIONS)
    wallclock = WallClockLogger()
    # K = 2 of 3 learners, 8 mini-batches per learner and epoch: an epoch is 12 updates
    epochs = dict(limit_train_batches=8, limit_val_batches=2) if SURVIVE else {}
    trainer = pl.Trainer(accelerator="cpu", devices=DEVICES, max_steps=MAX_STEPS, strategy=strategy,
                         logger=CSVLogger(OUT, name="logs", version=0),
                         callbacks=[Inject(), wallclock, OnExceptionCheckpoint(OUT)],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **epochs)
    loaders = [DataLoader(data, batch_size=16)] + ([DataLoader(data, batch_size=16)] if epochs else [])
    resume = {"ckpt_path": sys.argv[3]} if CASE == "resume" else {}
    try:
        trainer.fit(model, *loaders, **resume)
    except BaseException as exc:
        write_json(f"end_{trainer.global_rank}.json", {"raised": type(exc).__name__})
        raise
    else:
        write_json(f"end_{trainer.global_rank}.json", {"raised": None})
    finally:
        if trainer.global_rank == 0:
            report(trainer, wallclock, model)


def report(trainer, wallclock, model):
    """Rank 0, once fit has ended: the counters, its learners' exit statuses (None: running), its
    checkpoint."""
    statuses = [proc.poll() for proc in getattr(trainer.strategy.launcher, "procs", [])]
    inject = next(c for c in trainer.callbacks if isinstance(c, Inject))
    result = {"stats": trainer.strategy.stats, "statuses": statuses, "updates_at_death": inject.updates_at_death,
              "epoch_at_death": inject.epoch_at_death, "overlapped": trainer.strategy.overlapped_updates,
              "updates": [int(row["update"]) for row in wallclock.rows],
              "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()}}
    ckpt = OUT / "on_exception.ckpt"
    if ckpt.exists() and CASE != "resume":
        saved = torch.load(ckpt, weights_only=False)
        # None off the central path: rank 0's module holds it, or with local updates on the
        # collective path its copy of the server's state (the module holds its round's)
        state = trainer.strategy.core.state or getattr(trainer.strategy._side, "server", None)
        server = state.named_state(model) if state is not None else model.state_dict()
        result["checkpoint"] = {
            "server": saved["stale_server"],
            "matches_server": all(torch.equal(saved["state_dict"][name], value) for name, value in server.items())}
    write_json("rank0.json", result)


if __name__ == "__main__":
    main()
