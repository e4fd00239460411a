"""Diagnostic: where a learner's cycle goes on each server path, beside stock ddp's step.

Complements ``latency_breakdown.py`` (the central path's message latencies, event by event):
here every path is timed the same way, by wrapping a few of the engine's internal functions in
this benchmark's processes only and adding up the time each thread spends inside them after
``--warmup`` updates. A learner's main thread, per push (ms):

* ``compute``: Lightning's closure (forward, backward, the hooks around them);
* ``pack``: the gradients flattened into one push vector (``exchange.fill_push``, or on the
  collective path ``exchange.after_push``, once the header has left);
* ``send``: handing the push over (``exchange.before_push`` and ``LearnerEndpoint.push``:
  central: the vector over gloo or into a shared-memory lane or, on rank 0, the in-process
  queue; sharded: the pieces to the mesh's sender threads; collective: the header only);
* ``wait``: waiting for the answer (``Learner._wait``: the other learners, the decision's round
  trip, and on the central path the server's averaging and optimizer step);
* ``resolve``: the sharded path's wait for every owner's slice of the new parameters;
* ``apply``: taking the answer (``exchange.take``): loading the parameters (central,
  sharded), or the all-reduce and the learner's own optimizer step (collective), of which
  ``all_reduce`` is the collective alone;
* ``other``: the rest of the cycle (Lightning's loop, the data, the strategy's bookkeeping).

Helper threads, per push of the rank they run on (they overlap the main thread): ``decide``
(the server loop on rank 0: the rules, and on the central path the averaging, the optimizer
step and flattening the new parameters), ``owner apply`` (a shard owner's averaging and
optimizer step, including ``owner wait``, its wait for the pieces) and ``owner send`` (a slice
of new parameters to a learner).

    python benchmarks/path_breakdown.py [--devices 2] [--size 4M] [--steps 60]
        [--runs sync:central sync:collective k_async:central k_async:sharded k_async:central-gloo]
        [--model mlp | resnet | transformer]

(``--model``: the deep MLP of ``--size``, batch 32, or one of the users' models of
``architectures.py``, batch 16, where ``--size`` is not used. ``central-gloo``: the central path with ``shared_memory=False``, every payload over gloo;
``collective-late``: the collective path with ``overlap_allreduce=False``, the all-reduce after
the decision. Where it runs during backward, its buckets are launched inside ``compute`` and
waited for in ``apply``.)

The internals wrapped are named in ``WRAPPED``; the script stops with a clear error if they change.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch.distributed as dist
from pytorch_lightning import Trainer, seed_everything
from torch.utils.data import DataLoader

from _common import (MLPClassifier, StepTimer, apply_process_settings, base_parser, classification_loader,
                     is_rank_zero, prepare_out, require_internals, table, trainer_kwargs, write_results)
from architectures import BATCH, build
from overhead_vs_ddp import k_of
from scaling import SIZES, RecordTimes

MAIN_PARTS = ("compute", "pack", "send", "wait", "resolve", "apply", "all_reduce")
THREAD_PARTS = ("decide", "owner apply", "owner wait", "owner send")
TOTALS: dict[str, float] = defaultdict(float)
STATE = {"steps": 0, "warmup": 0, "first": None, "last": None, "pushes": 0, "at_last": {}}
_LOCK = threading.Lock()


def _wrapped():
    import lightning_stale.engine.distributed.learner as learner
    import lightning_stale.engine.distributed.paths.central.path as central
    import lightning_stale.engine.distributed.paths.collective.path as collective
    import lightning_stale.engine.distributed.paths.sharded.owner as owner
    import lightning_stale.engine.distributed.paths.sharded.path as sharded
    import lightning_stale.engine.distributed.server as server
    import lightning_stale.engine.distributed.transport as transport
    from lightning_stale.strategies.base import ServerStrategyMixin

    exchanges = (central.CentralExchange, collective.CollectiveExchange, sharded.ShardedExchange)
    return ([(ServerStrategyMixin, "compute_gradient", "compute"), (learner.Learner, "_wait", "wait"),
             (transport.LearnerEndpoint, "push", "send"), (server.ParameterServer, "_on_push", "decide"),
             (owner.ShardOwner, "_apply", "owner apply"), (owner.ShardOwner, "_take", "owner wait"),
             (owner.ShardOwner, "_send", "owner send")]
            + [(e, method, part) for e in exchanges for method, part in
               (("fill_push", "pack"), ("after_push", "pack"), ("before_push", "send"), ("resolve", "resolve"),
                ("take", "apply"))])


def _timed(function, part: str):
    def wrapper(*args, **kwargs):
        if STATE["first"] is None:  # still warming up
            return function(*args, **kwargs)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            with _LOCK:
                TOTALS[part] += time.perf_counter() - start
    return wrapper


def instrument() -> None:
    from lightning_stale.strategies.stale import StaleStrategy

    wrapped = _wrapped()
    require_internals("path_breakdown", [(cls, name) for cls, name, _ in wrapped])
    for cls, name, part in wrapped:
        setattr(cls, name, _timed(cls.__dict__[name], part))
    all_reduce = dist.all_reduce

    def all_reduce_(*args, **kwargs):  # the learners' all-reduce runs on their main thread
        if STATE["first"] is None or threading.current_thread() is not threading.main_thread():
            return all_reduce(*args, **kwargs)
        start = time.perf_counter()
        result = all_reduce(*args, **kwargs)
        TOTALS["all_reduce"] += time.perf_counter() - start
        return result

    dist.all_reduce = all_reduce_
    optimizer_step = StaleStrategy.optimizer_step

    def optimizer_step_(self, *args, **kwargs):  # a learner's cycle: one push per optimizer step
        STATE["steps"] += 1
        now = time.perf_counter()
        if STATE["steps"] == STATE["warmup"]:
            STATE["first"] = now
        elif STATE["first"] is not None:  # the parts of whole cycles only, not the shutdown's
            with _LOCK:
                STATE["last"], STATE["pushes"], STATE["at_last"] = now, STATE["pushes"] + 1, dict(TOTALS)
        return optimizer_step(self, *args, **kwargs)

    StaleStrategy.optimizer_step = optimizer_step_


def reset(warmup: int) -> None:
    TOTALS.clear()
    STATE.update(steps=0, warmup=warmup, first=None, last=None, pushes=0, at_last={})


def per_push(state: dict) -> dict[str, float]:
    """ms per push of every part on one rank (between the warm-up's last push and the last
    push), and the cycle's rest as ``other``."""
    n, totals = max(state["pushes"], 1), state["at_last"]
    row = {part: 1e3 * totals.get(part, 0.0) / n for part in MAIN_PARTS + THREAD_PARTS}
    cycle = 1e3 * (state["last"] - state["first"]) / n if state["last"] is not None else float("nan")
    main = sum(row[p] for p in MAIN_PARTS if p != "all_reduce")
    return {"cycle": cycle, **row, "other": cycle - main}


def main() -> None:
    from lightning_stale import StaleStrategy

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--size", default="4M", choices=list(SIZES))
    parser.add_argument("--model", default="mlp", choices=["mlp", "resnet", "transformer"])
    parser.add_argument("--steps", type=int, default=60, help="updates per fit")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", nargs="+", default=["sync:central", "sync:collective", "k_async:central",
                                                       "k_async:sharded"],
                        help="variant:server (central-gloo: no shared memory; collective-late: no overlap)")
    args = parser.parse_args()
    apply_process_settings(args)
    instrument()
    p, batch = args.devices, 32 if args.model == "mlp" else BATCH
    out = prepare_out(args.out) if is_rank_zero() else None
    rows, summary = [], []
    for spec in ["ddp:ddp", *args.runs]:
        variant, path = spec.split(":")
        server, _, how = path.partition("-")  # "central-gloo": no lanes; "collective-late": no overlap
        seed_everything(args.seed, verbose=False)
        reset(args.warmup)
        timer, records = StepTimer(warmup=args.warmup), RecordTimes()
        strategy = "ddp" if variant == "ddp" else StaleStrategy(
            variant, k_of(variant, p), seed=args.seed,
            record_trace=False, server=server, shared_memory=how != "gloo", overlap_allreduce=how != "late")
        trainer = Trainer(devices=p, strategy=strategy, max_steps=args.steps,
                          callbacks=[timer if variant == "ddp" else records], **trainer_kwargs())
        if args.model == "mlp":
            module = MLPClassifier(features=64, hidden=SIZES[args.size], classes=10, lr=0.01)
            loader = classification_loader(32 * p * (args.steps + 20) * 2, seed=args.seed)
        else:
            module, data = build(args.model)
            loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
        trainer.fit(module, train_dataloaders=loader)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, dict(STATE))
        if not is_rank_zero():
            continue
        if variant == "ddp":
            interval = timer.mean_interval_s
            samples_per_s = batch * p / interval
        else:
            interval, samples_per_s = records.rate(args.warmup)
        # rank 0's learner pushes through a queue, the others over the host's links: its share
        # of the gradients applied says how unequal the race is (1/P when the learners are alike)
        share = records.learners.count(0) / len(records.learners) if variant != "ddp" else 1 / p
        summary.append({"variant": variant, "server": path, "ms_per_update": 1e3 * interval,
                        "samples_per_s": samples_per_s, "rank0_share": round(share, 2)})
        if variant != "ddp":
            for rank, state in enumerate(gathered):
                rows.append({"variant": variant, "server": path, "rank": rank,
                             **{k: round(v, 2) for k, v in per_push(state).items()}})
        print(f"{variant} on {path}: {1e3 * interval:.1f} ms per update", flush=True)
    if not is_rank_zero():
        return
    numel = sum(t.numel() for t in module.parameters())
    what = f"MLP of {numel / 1e6:.1f}M parameters" if args.model == "mlp" else f"{args.model} of {numel / 1e6:.1f}M parameters"
    print(f"\nP = {p}, {what}, batch {batch}, no injected delay, "
          f"{args.steps} updates per fit after {args.warmup} left out; ms per push on each rank")
    print(table(summary, ["variant", "server", "ms_per_update", "samples_per_s", "rank0_share"]))
    print()
    print(table(rows, ["variant", "server", "rank", "cycle", *MAIN_PARTS, "other", *THREAD_PARTS]))
    paths = write_results(out, "path_breakdown", rows, {"summary": summary, "devices": p, "size": args.size,
                                                        "model": args.model, "parameters": numel, "steps": args.steps})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
