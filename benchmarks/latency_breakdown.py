"""Diagnostic: where the real engine's per-push overhead goes (not a pass/fail benchmark).

Runs `StaleStrategy` with injected Exponential delays, timestamps the engine's steps with
``time.monotonic()`` (CLOCK_MONOTONIC, comparable across processes on one machine) by wrapping
a few of its internal functions in this benchmark's processes only, and splits one learner's
cycle (gradient pushed -> next delay starts) into:

* ``uplink``: the learner starts its push -> the server loop starts deciding on it (the gloo
  header and payload messages, the server's receive thread, the event queue);
* ``decide``: the server's decision (rules, averaging and optimizer step when it updates,
  flattening the new parameters, queueing the answers);
* ``downlink``: the server queues an answer -> the learner's receive thread has it (the sender
  thread, gloo header and payload);
* ``wake``: the answer is in the learner's inbox -> the learner's main thread returns from its
  wait;
* ``restart``: the learner has its answer (or a cancellation interrupted its delay) -> its next
  injected delay starts (loading the parameters, the rest of Lightning's step, the next batch,
  forward and backward).

Rank 0's learner talks to the server through in-process queues; ranks 1..P-1 through gloo.
The wrapped functions are internals (`lightning_stale.engine.distributed.transport.send/recv`,
`LearnerEndpoint.push`, `Learner._wait`, `ParameterServer._on_push`, `ParameterServer._send`);
the script stops with a clear error if they change.

With ``--switch-intervals 0.005 0.0005`` every configuration runs once per interval of
``sys.setswitchinterval`` (Python's default is 5 ms), side by side in one launch and with the
same delays: a test of how much of the overhead is threads waiting for the GIL.

    python benchmarks/latency_breakdown.py [--runs k_sync:2 async:1] [--updates 300]
        [--switch-intervals 0.005 0.0005]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
from pytorch_lightning import Trainer, seed_everything

from _common import (TinyRegression, apply_process_settings, base_parser, is_rank_zero,
                     prepare_out, regression_loader, require_internals, table, trainer_kwargs,
                     write_results)
from lightning_stale import StaleStrategy
from lightning_stale.delays import Exponential
from lightning_stale.method.theory import expected_iteration_time

EVENTS: list[tuple] = []


def instrument() -> None:
    import lightning_stale.engine.distributed.learner as learner_mod
    import lightning_stale.engine.distributed.server as server_mod
    import lightning_stale.engine.distributed.transport as transport

    needed = [(transport, "recv"), (transport.LearnerEndpoint, "push"), (learner_mod.Learner, "_wait"),
              (server_mod.ParameterServer, "_on_push"), (server_mod.ParameterServer, "_send")]
    require_internals("latency_breakdown", needed)
    now = time.monotonic
    recv, push, wait = transport.recv, transport.LearnerEndpoint.push, learner_mod.Learner._wait
    on_push, send = server_mod.ParameterServer._on_push, server_mod.ParameterServer._send

    def recv_(group, tags, *args, **kwargs):
        message = recv(group, tags, *args, **kwargs)
        if tags[0] == transport.DOWN:  # a learner's receive thread
            EVENTS.append(("inbox", int(message.kind), message.version, now()))
        return message

    def push_(self, message):
        if message.kind == transport.Kind.PUSH:
            EVENTS.append(("push", self.rank, 0, now()))
        return push(self, message)

    def wait_(self, timeout):
        start = now()
        messages = wait(self, timeout)
        end = now()
        EVENTS.append(("wait", self.rank, -1.0 if timeout is None else timeout, start, end, len(messages)))
        return messages

    def on_push_(self, message):
        start = now()
        on_push(self, message)
        EVENTS.append(("decide", message.learner, int(message.kind), start, now()))

    def send_(self, learner, kind, decision=None):
        EVENTS.append(("answer", learner, int(kind), self.core.version, now()))
        send(self, learner, kind, decision)

    transport.recv, transport.LearnerEndpoint.push, learner_mod.Learner._wait = recv_, push_, wait_
    server_mod.ParameterServer._on_push, server_mod.ParameterServer._send = on_push_, send_


def _stats(values: list[float]) -> dict:
    a = np.asarray(values, dtype=float) * 1e3
    return {"median_ms": float(np.median(a)) if len(a) else float("nan"),
            "mean_ms": float(a.mean()) if len(a) else float("nan"),
            "p90_ms": float(np.percentile(a, 90)) if len(a) else float("nan"), "n": len(a)}


def analyse(per_rank: list[list[tuple]]) -> dict[str, dict[str, list[float]]]:
    server = per_rank[0]
    decides = [e for e in server if e[0] == "decide" and e[2] == 1]  # kind PUSH
    answers = [e for e in server if e[0] == "answer"]
    parts: dict[str, dict[str, list[float]]] = {}
    for rank, events in enumerate(per_rank):
        where = "local (rank 0)" if rank == 0 else "remote (ranks 1..)"
        seg = parts.setdefault(where, {k: [] for k in ("uplink", "decide", "downlink", "wake", "restart")})
        pushes = [e[3] for e in events if e[0] == "push" and e[1] == rank]
        mine = [e for e in decides if e[1] == rank]
        for t_push, d in zip(pushes, mine):
            seg["uplink"].append(d[3] - t_push)
            seg["decide"].append(d[4] - d[3])
        # Downlink: the server queues an answer of (version) -> this learner's inbox has it.
        if rank > 0:
            inbox = [e for e in events if e[0] == "inbox"]
            sent = [e for e in answers if e[1] == rank]
            for a in sent:
                match = next((e for e in inbox if e[2] == a[3] and e[3] >= a[4]), None)
                if match is not None:
                    seg["downlink"].append(match[3] - a[4])
        waits = [e for e in events if e[0] == "wait" and e[1] == rank]
        delay_starts = np.array([e[3] for e in waits if e[2] > 0])
        inbox_times = np.array([e[3] for e in events if e[0] == "inbox"]) if rank > 0 else None
        for w in waits:
            if w[5] == 0:
                continue  # a delay that ran out: no answer to wake up for
            # An answer after a push, or a message interrupting a delay (cancellation).
            # The answer's arrival in the inbox (remote) -> the main thread has it.
            if inbox_times is not None and len(inbox_times):
                i = np.searchsorted(inbox_times, w[4]) - 1
                if i >= 0 and inbox_times[i] >= w[3]:
                    seg["wake"].append(w[4] - inbox_times[i])
            j = np.searchsorted(delay_starts, w[4])
            if j < len(delay_starts):
                seg["restart"].append(delay_starts[j] - w[4])
    return parts


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["k_sync:2", "async:1"], help="variant:K")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--mean", type=float, default=0.05)
    parser.add_argument("--switch-intervals", type=float, nargs="+", default=None,
                        help="run every configuration once per GIL switch interval (seconds), "
                             "side by side and with the same delays, e.g. 0.005 0.0005")
    args = parser.parse_args()
    apply_process_settings(args)
    instrument()
    out = prepare_out(args.out) if is_rank_zero() else Path(args.out)
    rows, summary = [], []
    switches = args.switch_intervals or [sys.getswitchinterval()]
    for index, spec in enumerate(args.runs):
        name, k = spec.split(":")
        k = int(k)
        for switch in switches:
            sys.setswitchinterval(switch)  # every rank runs this same sequence
            EVENTS.clear()
            seed_everything(args.seed, verbose=False)
            # The same seed for every switch interval: the same delays, paired comparison.
            strategy = StaleStrategy(name, k, delay=Exponential(args.mean, seed=args.seed + index),
                                     seed=args.seed, record_trace=False)
            trainer = Trainer(devices=args.learners, max_steps=args.updates, strategy=strategy,
                              **trainer_kwargs())
            trainer.fit(TinyRegression(),
                        train_dataloaders=regression_loader(32 * 2 * args.learners * (args.updates + 50)))
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, list(EVENTS))
            if not is_rank_zero():
                continue
            interval = trainer.strategy.stats["mean_update_interval_s"]
            theory = expected_iteration_time(name, args.learners, k, Exponential(args.mean))
            line = {"variant": name, "k": k, "switch_interval_ms": switch * 1e3,
                    "update_interval_ms": interval * 1e3, "theory_ms": theory * 1e3,
                    "measured/theory": interval / theory}
            for where, seg in analyse(gathered).items():
                parts = [{"variant": name, "k": k, "switch_interval_ms": switch * 1e3, "learner": where,
                          "part": part, **_stats(values)} for part, values in seg.items() if values]
                total = {key: sum(r[key] for r in parts) for key in ("median_ms", "mean_ms")}
                rows += parts + [{"variant": name, "k": k, "switch_interval_ms": switch * 1e3,
                                  "learner": where, "part": "sum (one cycle)", **total}]
                line[f"cycle_{where.split()[0]}_mean_ms"] = total["mean_ms"]
            summary.append(line)
            print(f"{name} K={k} switch interval {switch * 1e3:g} ms: mean update interval "
                  f"{interval * 1e3:.2f} ms (theory {theory * 1e3:.2f})", flush=True)
    if not is_rank_zero():
        return
    print()
    print(f"P = {args.learners}, Exponential(mean={args.mean}) delays, {args.updates} updates per run; "
          "a learner's cycle costs the sum of the parts on top of its delay")
    print(table(rows, ["variant", "k", "switch_interval_ms", "learner", "part", "median_ms", "mean_ms",
                       "p90_ms", "n"]))
    print()
    print(table(summary, ["variant", "k", "switch_interval_ms", "theory_ms", "update_interval_ms",
                          "measured/theory", "cycle_local_mean_ms", "cycle_remote_mean_ms"]))
    paths = write_results(out, "latency_breakdown", rows,
                          {"summary": summary, "learners": args.learners, "delay_mean_s": args.mean,
                           "updates": args.updates, "threads": args.threads})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
