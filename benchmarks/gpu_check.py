"""GPU path check (run by hand on a machine with GPUs; not a timing benchmark).

Runs the six variants of `StaleStrategy` on each server path with Lightning's default collectives
on NCCL, and checks what only a GPU run can show:

* central (every variant): the default group is NCCL while the server's group is gloo; the
  learners' and the server's parameters live on the GPU; with several GPUs on NCCL, payloads
  larger than a header's frame travel GPU to GPU on device channels with ``--payload-channels
  on`` (``payload_channels=True``, a NCCL group per direction, unverified on several GPUs;
  ``--hidden 1024 320`` makes them that large), else as CPU vectors;
  after fit the module holds the server's parameters;
* collective (the sync family): the K gradients of an update meet in an all-reduce of CUDA
  tensors on the default (NCCL) group, and every learner steps its own optimizer on the GPU;
  under ``sync`` the all-reduce runs in buckets during backward, on a group of its own,
  launched from the autograd hooks (``overlapped``: updates reduced so, on rank 0): by default
  where the default group is gloo, on NCCL with ``--overlap on`` (unverified on several GPUs);
* sharded (the async family): every rank's owner holds its shard on the GPU; pieces and slices
  travel on device channels like the central path's payloads;

and on every path: every gradient is counted, the loss falls, every learner ends with the same
parameters, on its GPU, and no process allocated memory on another process's GPU (rank 0 gathers
the shard owners' optimizer states: ``--optimizer adamw`` gives them state to gather).
``--checkpoint-every N`` saves a checkpoint every N updates (the server's state read beside its
thread, the owners' gathered).

With one GPU (``--devices 1``, the default when one is visible) the learner on rank 0 talks to
the server through in-process queues and every path is central, so only the device side is
exercised; ``--devices 2`` or more (one GPU each) runs every path. NCCL refuses two ranks on one
GPU, so ``--learners-per-gpu 2`` puts two learner processes on each GPU with the default group on
gloo instead (its all-reduce and broadcast take CUDA tensors, staged through host memory): every
path then runs with CUDA tensors through it on a machine of one GPU, NCCL aside.
``--accelerator cpu`` runs the same checks on CPU processes (gloo default group), to try the
script itself.

    python benchmarks/gpu_check.py [--devices 2] [--learners-per-gpu 2] [--updates 60]
        [--precision 16-mixed] [--accelerator gpu] [--hidden 1024 320] [--payload-channels on]
        [--optimizer adamw] [--checkpoint-every 20] [--overlap on]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import tempfile

from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint

from _common import apply_process_settings, base_parser, is_rank_zero, prepare_out, table, write_results
from lightning_stale import StaleStrategy
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import ShiftedExponential
from lightning_stale.engine.distributed.messages import INLINE_PAYLOAD_BYTES
from lightning_stale.models import MLP, Classifier

VARIANTS = ("sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async")
SYNC_FAMILY = ("sync", "k_sync", "k_batch_sync")


class Placement(Callback):
    """Where a fit ran, read while training: the default group's and the server group's backends
    (teardown drops the server group), the module's device and the device of the parameters the
    server's optimizer steps (rank 0's central state, this rank's shard, or the learner's own
    module on the collective path). At teardown Lightning moves the module back to the CPU."""

    def on_train_start(self, trainer, *args) -> None:
        group = trainer.strategy._server_group
        self.default = dist.get_backend()
        self.server = dist.get_backend(group) if group is not None else "(P = 1: queues)"

    def on_train_end(self, trainer, module) -> None:
        core, exchange = trainer.strategy.core, trainer.strategy._learner.exchange
        owner = getattr(exchange, "owner", None)
        stepped = (core.state.params if core is not None and core.state is not None
                   else owner.state.params if owner is not None else list(module.parameters()))
        self.module_device = str(next(module.parameters()).device)
        self.server_device = str(stepped[0].device)
        # sharded: this rank's owner (read after fit, its thread done) and the tensors it owns
        self.owner = owner
        self.owned = (list(trainer.strategy.shard_layout.tensors[trainer.global_rank])
                      if owner is not None else [])


def on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (an all-reduce on the default group's device)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=group_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def owns_nothing_elsewhere() -> bool:
    """No tensor of this process on a GPU other than its own (e.g. another owner's optimizer
    state restored onto that owner's GPU index)."""
    if not torch.cuda.is_available():
        return True
    own = torch.cuda.current_device()
    return all(torch.cuda.memory_allocated(d) == 0 for d in range(torch.cuda.device_count()) if d != own)


def shard_matches_module(placement, model) -> bool:
    """Sharded path: the module after fit (the gathered state) holds what this rank's owner
    stepped, for the tensors it owns."""
    if placement.owner is None:
        return True
    params = [p for p in model.parameters() if p.requires_grad]
    return all(torch.equal(params[i].detach().cpu(), mine.detach().cpu())
               for i, mine in zip(placement.owned, placement.owner.state.params))


def group_device() -> torch.device:
    """Where the default group's collectives take their tensors: NCCL CUDA ones, gloo host ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def same_on_every_rank(model) -> bool:
    """Every learner holds the same parameters (compared through the default group)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not dist.is_initialized():
        return True
    flat = flat.to(group_device())
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, flat) for g in gathered)


def check(name: str, path: str, args) -> dict:
    seed_everything(args.seed, verbose=False)
    dm = DigitsDataModule(batch_size=32)
    hidden = {} if args.hidden is None else {"hidden_sizes": tuple(args.hidden)}
    lr = (0.1 if args.hidden is None else 0.05) if args.optimizer == "sgd" else 1e-3
    model = Classifier(MLP(dm.input_shape, dm.num_classes, **hidden), lr=lr, optimizer=args.optimizer)
    sharing = {}
    if args.learners_per_gpu > 1:  # NCCL refuses two ranks on one GPU: the default group on gloo
        sharing = dict(parallel_devices=[torch.device("cuda", i) for i in range(args.devices)
                                         for _ in range(args.learners_per_gpu)],
                       process_group_backend="gloo")
    strategy = StaleStrategy(name, delay=ShiftedExponential(shift=0.002, mean=0.01, seed=args.seed),
                             record_trace=False, server=path, payload_channels=args.channels,
                             overlap_allreduce=args.overlap, **sharing)
    placement = Placement()
    callbacks = [placement]
    with tempfile.TemporaryDirectory() as folder:
        if args.checkpoint_every:
            callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=args.checkpoint_every,
                                             save_top_k=-1))
        trainer = Trainer(accelerator=args.accelerator, devices=args.devices, max_steps=args.updates,
                          precision=args.precision, strategy=strategy, callbacks=callbacks, logger=False,
                          enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, dm)
    same = same_on_every_rank(model)
    shards = on_every_rank(shard_matches_module(placement, model))
    contained = on_every_rank(owns_nothing_elsewhere())
    if not is_rank_zero():
        return {}
    core = trainer.strategy.core
    ran = trainer.strategy.stats.get("server_path", path)
    server_params = core.state.params if core.state is not None else list(model.parameters())
    stats = trainer.strategy.stats
    records = trainer.strategy.pop_update_records()
    losses = [r.loss for r in records]
    return {
        "variant": name, "path": ran, "updates": stats["updates"],
        "default_backend": placement.default, "server_backend": placement.server,
        "module_device": placement.module_device, "server_device": placement.server_device,
        "counts_balance": stats["gradients_received"] == stats["gradients_applied"] + stats["gradients_dropped"]
        + stats["gradients_in_flight_at_stop"],
        "loss_first_10": sum(losses[:10]) / max(1, len(losses[:10])),
        "loss_last_10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "module_matches_server": all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.parameters(), server_params)),
        "same_on_every_rank": same, "shards_match_module": shards, "own_gpu_only": contained,
        "val_acc": float(trainer.callback_metrics.get("val/acc", float("nan"))),
        "overlapped": trainer.strategy.overlapped_updates,
        "scaler": getattr(trainer.strategy.precision_plugin, "scaler", None) is not None,
        "channels": stats.get("payload_channels"), "on_channels": stats.get("payloads_on_channels", 0),
        # (fp32 bytes) channels open where a push exceeds a frame; and where even a sharded piece,
        # on up to 4 owners, does, payloads must have gone on them
        "over_frame": 4 * sum(p.numel() for p in model.parameters()) > INLINE_PAYLOAD_BYTES,
        "large_payloads": 4 * sum(p.numel() for p in model.parameters()) > 4 * INLINE_PAYLOAD_BYTES,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--devices", type=int, default=None, help="GPUs (one learner each, or --learners-per-gpu); default: the GPUs visible (CPU: 2 processes)")
    parser.add_argument("--learners-per-gpu", type=int, default=1,
                        help="learner processes on each GPU; above 1 the default group runs on gloo")
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--payload-channels", dest="channels", default="off", choices=["on", "off"],
                        help="StaleStrategy(payload_channels=): on (NCCL groups on GPUs, gloo on CPU), off")
    parser.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                        help="StaleStrategy(overlap_allreduce=): auto (where the default group is gloo), on, off")
    parser.add_argument("--hidden", type=int, nargs="+", default=None,
                        help="the MLP's hidden widths (default: the digits MLP's, 19k parameters, whose "
                             "payloads fit a header's frame; 1024 320: 0.4M, payloads on channels)")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                        help="the Classifier's optimizer (adamw: optimizer state for the owners to hand over)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="save a checkpoint every N updates (0: none)")
    parser.add_argument("--precision", default="32-true",
                        help="the Trainer's precision (on CUDA, 16-mixed runs with a gradient scaler)")
    args = parser.parse_args()
    args.channels = args.channels == "on"
    args.overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    apply_process_settings(args)
    if args.devices is None:
        args.devices = torch.cuda.device_count() if args.accelerator == "gpu" else 2
    if args.accelerator == "gpu" and not 1 <= args.devices <= torch.cuda.device_count():
        raise SystemExit(f"gpu_check: --devices {args.devices} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    if args.learners_per_gpu < 1 or (args.learners_per_gpu > 1 and args.accelerator != "gpu"):
        raise SystemExit(f"gpu_check: --learners-per-gpu {args.learners_per_gpu}: 1, or more with "
                         "--accelerator gpu")
    learners = args.devices * args.learners_per_gpu
    runs = [(name, "central") for name in VARIANTS]
    if learners > 1:
        runs += [(name, "collective" if name in SYNC_FAMILY else "sharded") for name in VARIANTS]
    rows = [check(name, path, args) for name, path in runs]
    if not is_rank_zero():
        return
    expected_device = "cuda" if args.accelerator == "gpu" else "cpu"
    expected_default = "nccl" if args.accelerator == "gpu" and args.learners_per_gpu == 1 else "gloo"
    # device channels where asked for, between several learners, on the paths with payloads, for a
    # model whose pushes exceed a frame (--hidden 1024 320; the digits MLP's do not)
    channels = (None if learners == 1 or not args.channels else
                "nccl" if expected_default == "nccl" else "gloo")
    overlap = args.overlap if args.overlap is not None else expected_default == "gloo"
    failed = [f"{r['variant']}@{r['path']}" for r in rows
              if not (r["counts_balance"] and r["module_matches_server"] and r["same_on_every_rank"]
                      and r["shards_match_module"] and r["own_gpu_only"]
                      and r["loss_last_10"] < r["loss_first_10"]
                      # (a gradient scaler's unscaling follows the decision: no overlap then)
                      and (r["overlapped"] > 0) == (overlap and r["variant"] == "sync" and r["path"] == "collective"
                                                    and not r["scaler"])
                      and r["module_device"].startswith(expected_device)
                      and r["server_device"].startswith(expected_device)
                      and r["default_backend"] == expected_default
                      and r["channels"] == (channels if r["path"] in ("central", "sharded") and r["over_frame"]
                                            else None)
                      and ((r["on_channels"] > 0 or not r["large_payloads"]) if r["channels"]
                           else r["on_channels"] == 0)
                      and r["server_backend"] == ("gloo" if learners > 1 else "(P = 1: queues)"))]
    print(table(rows, list(rows[0])))
    paths = write_results(prepare_out(args.out), "gpu_check", rows,
                          {"accelerator": args.accelerator, "devices": args.devices,
                           "learners_per_gpu": args.learners_per_gpu, "updates": args.updates,
                           "precision": args.precision, "optimizer": args.optimizer,
                           "checkpoint_every": args.checkpoint_every},
                          kind="gpu" if args.accelerator == "gpu" else "cpu")
    print("results:", *map(str, paths))
    if failed:
        raise SystemExit(f"gpu_check: checks failed for {', '.join(failed)}")
    print(f"gpu_check: all {len(rows)} runs (six variants, {len({r['path'] for r in rows})} server paths) "
          f"passed on {learners} {args.accelerator} learner(s) on {args.devices} device(s)")


if __name__ == "__main__":
    main()
