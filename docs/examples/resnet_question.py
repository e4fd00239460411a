"""Is it the method or the engine? A small Hugging Face ResNet with BatchNorm under SGD with
Nesterov momentum and a OneCycle schedule, on two CPU learners without injected delay.
Needs `pip install transformers` (the model is built from a config: nothing is downloaded).

    nice -n 10 python docs/examples/resnet_question.py --launches 4 --out /tmp/rq

1. One launch of two CPU processes fits stock `ddp`, `k_batch_sync` K = 1, `sync` and
   `--launches` times `k_batch_async` K = 1 for 40 updates, recording the k_batch_async runs
   (`record_events`, `digest_every=1`). It writes each run's final training loss (mean over
   rank 0's last quarter of steps) and event log to `<out>/runs.json`.
2. In this process: replay the first k_batch_async log as recorded (did the engine apply what
   the method prescribes for the events that happened?), then on the same arrival pattern with
   a constant momentum of 0 and of 0.5, with `staleness_compensation="inverse"` and with the
   learning rate halved and quartered; the reports go to `<out>/replays.json`.
   `--replay-only` replays the logs of an earlier run in `--out` again.
Figures and the conclusion: docs/replay.md, "Is it the method or the engine?".
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from transformers import ResNetConfig, ResNetForImageClassification

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0)
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK")


class Digits(pl.LightningDataModule):
    """sklearn's 1797 handwritten digits as 1-channel 8x8 images in [0, 1], batches of 32."""

    def setup(self, stage=None):
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        self.train_set = TensorDataset(x, torch.tensor(digits.target))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=32, shuffle=True)


class ResNetDigits(pl.LightningModule):
    """transformers' ResNet (BatchNorm in every block), SGD with Nesterov momentum 0.9, OneCycleLR.

    As a user writes it, OneCycleLR cycles the momentum too (`cycle_momentum`, 0.95 to 0.85 and
    back), overriding the optimizer's 0.9. A counterfactual `momentum` turns the cycling off and
    holds the given momentum (Nesterov when above 0)."""

    def __init__(self, steps, lr=0.1, momentum=None):
        super().__init__()
        config = ResNetConfig(num_channels=1, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                              layer_type="basic", num_labels=10)
        self.model = ResNetForImageClassification(config)
        self.steps, self.lr, self.momentum = steps, lr, momentum
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(pixel_values=x, labels=y).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        momentum = 0.9 if self.momentum is None else self.momentum
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=momentum, nesterov=momentum > 0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.steps,
                                                       cycle_momentum=self.momentum is None)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def build(steps, **options):
    pl.seed_everything(0, verbose=False)  # the same initial parameters in every run and replay
    return ResNetDigits(steps, **options)


def final_loss(losses):
    return sum(losses[-max(1, len(losses) // 4):]) / max(1, len(losses) // 4)


def record(out, steps, launches, baselines=True):
    """All fits on two CPU processes (this function runs on both ranks)."""
    from lightning_stale import StaleStrategy

    torch.set_num_threads(1)
    runs = [("ddp", None), ("k_batch_sync", 1), ("sync", None)] if baselines else []
    runs += [("k_batch_async", 1)] * launches
    results = []
    for index, (variant, k) in enumerate(runs):
        name = f"{index}-{variant}"
        if variant == "ddp":
            strategy = "ddp"
        else:
            recorded = variant == "k_batch_async"
            strategy = StaleStrategy(variant, k, record_trace=False, digest_every=1,
                                     record_events=out / f"{name}.jsonl" if recorded else False)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                             default_root_dir=str(out), **QUIET)
        module = build(steps)
        trainer.fit(module, Digits())
        if trainer.global_rank == 0:
            stats = getattr(trainer.strategy, "stats", {})
            results.append({"name": name, "variant": variant, "k": k, "final_loss": final_loss(module.losses),
                            "events_path": stats.get("events_path"), "updates": stats.get("updates")})
    if trainer.global_rank == 0:
        (out / "runs.json").write_text(json.dumps(results, indent=1))


def replay(path, steps, **options):
    from lightning_stale import SimulatedStaleStrategy

    compensation = options.pop("staleness_compensation", None)
    strategy = SimulatedStaleStrategy(replay=path, staleness_compensation=compensation)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, **QUIET)
    module = build(steps, **options)
    trainer.fit(module, Digits())
    report = strategy.replay_report
    return {"checked_updates": report["checked_updates"], "identical": report["identical"],
            "first_differing_update": report["first_differing_update"],
            "max_relative_difference": report["max_relative_difference"],
            "late_loss": report["late_loss"], "differences": report["differences"][:3]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="resnet_question")
    parser.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)  # the two ranks
    parser.add_argument("--replays", help="comma-separated names of the replays to run (default: all)")
    parser.add_argument("--no-baselines", action="store_true", help="record k_batch_async only")
    parser.add_argument("--replay-only", action="store_true", help="replay the logs of an earlier run in --out")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.record_only:
        record(out, args.steps, args.launches, not args.no_baselines)
        return
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    if not args.replay_only:
        subprocess.run([sys.executable, __file__, "--record-only", "--launches", str(args.launches),
                        "--steps", str(args.steps), "--out", str(out)] + ["--no-baselines"] * args.no_baselines,
                       check=True, env=env)
    runs = json.loads((out / "runs.json").read_text())
    for run in runs:
        print(f"{run['name']:>18}  final training loss {run['final_loss']:.3f}")
    torch.set_num_threads(1)  # as the recorded learners ran: bit-identical sums
    path = next(run["events_path"] for run in runs if run["variant"] == "k_batch_async")
    counterfactuals = {"as recorded": {}, "momentum 0": {"momentum": 0.0},
                       "staleness compensation inverse": {"staleness_compensation": "inverse"},
                       "momentum 0.5": {"momentum": 0.5}, "learning rate halved": {"lr": 0.05},
                       "learning rate quartered": {"lr": 0.025}}
    names = args.replays.split(",") if args.replays else list(counterfactuals)
    replays = {name: replay(path, args.steps, **counterfactuals[name]) for name in names}
    for name, report in replays.items():
        print(f"replay {name}: {json.dumps(report, default=str)}")
    (out / "replays.json").write_text(json.dumps(replays, indent=1, default=str))


if __name__ == "__main__":
    main()
