"""The engine against stock ``ddp`` on the kind of model people train, not an MLP.

`scaling.py` grows deep MLPs: a handful of large tensors and no buffers. The models here are
written the way users write them, with AdamW and a linear warm-up stepped per update:

* ``resnet``: a CIFAR-style ResNet-20 (`lightning_stale.models.ResNet`) of width 64, 4.3M
  parameters in 65 tensors, with 21 BatchNorm layers (63 buffers: running statistics, which
  every update averages, and integer batch counts, which it takes the largest of), on
  synthetic 3x16x16 images, batch 16;
* ``transformer``: a 4-layer pre-norm transformer encoder (d = 256, 4 heads, feed-forward
  1024) over 32 tokens of a 1000-word vocabulary, mean-pooled into a linear classifier: 3.4M
  parameters in 54 tensors, batch 16.

Many tensors put the per-parameter hooks of the sync family's all-reduce during backward, and
the buffers the packing of every update, on the clock. No injected delay. Per process count
(one launch each, ``--devices``) and model, every mode runs interleaved ``--repeats`` times:
``ddp``; ``sync`` and ``k_sync`` (K = P) on the path ``"auto"`` picks (collective, or central
where CPU learners outnumber the cores); ``sync`` with the all-reduce after the server's decision
(``sync:collective-late``); ``k_async`` and ``k_batch_async`` (K = P/2) on their ``"auto"``
path; on request (``--modes``), ``sync:collective``, forced onto the collective path. Measured and summarised as in
`scaling.py` (``vs_ddp``: the median over repeats of samples/s over ddp's in the same repeat).

    python benchmarks/architectures.py [--devices 2 4] [--models resnet transformer] [--repeats 3]
        [--modes ddp sync k_sync sync:collective-late k_async k_batch_async]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from pytorch_lightning import LightningModule, seed_everything
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from _common import base_parser, is_rank_zero, run_per_device_count, table, write_results
from lightning_stale.models import ResNet
from overhead_vs_ddp import k_of
from scaling import add_run_arguments, chosen, summarise, time_fit

BATCH = 16
STEPS = {"resnet": 30, "transformer": 30}
MODES = [("ddp", ""), ("sync", "auto"), ("k_sync", "auto"), ("sync", "collective-late"),
         ("k_async", "auto"), ("k_batch_async", "auto"), ("sync", "collective")]  # the last on request


class WarmedUp(LightningModule):
    """Cross-entropy, AdamW with weight decay and a linear warm-up over the first 10 updates."""

    def __init__(self, net: nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class TokenClassifier(nn.Module):
    """Token and position embeddings, a pre-norm transformer encoder, mean pooling, a linear head."""

    def __init__(self, vocab: int = 1000, length: int = 32, width: int = 256, heads: int = 4,
                 layers: int = 4, feedforward: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, feedforward, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.tokens(x) + self.positions)
        return self.head(self.norm(hidden).mean(dim=1))


def build(model: str) -> tuple[LightningModule, TensorDataset]:
    """The module and a synthetic training set of 4096 samples (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    samples = 4096
    if model == "resnet":
        net = ResNet((3, 16, 16), 10, depth=20, width=64)
        data = TensorDataset(torch.randn(samples, 3, 16, 16, generator=g), torch.randint(10, (samples,), generator=g))
    else:
        net = TokenClassifier()
        data = TensorDataset(torch.randint(1000, (samples, 32), generator=g), torch.randint(10, (samples,), generator=g))
    return WarmedUp(net), data


def run_launch(args) -> None:
    p = args.child_devices
    rows = []
    for repeat in range(args.repeats):
        for model in args.models:
            steps = STEPS[model] if args.steps is None else args.steps
            for mode, path in MODES:
                if not chosen(mode, path, args.modes):
                    continue
                seed_everything(args.seed, verbose=False)
                module, data = build(model)
                loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
                k = k_of(mode, p) if mode != "ddp" else None
                row = time_fit(mode, k, path, module, loader, steps, args, batch=BATCH, label=model)
                if row is not None:
                    rows.append(dict(row, repeat=repeat))
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(STEPS), choices=list(STEPS))
    add_run_arguments(parser, repeats=3)
    launched = run_per_device_count(parser, __file__, "architectures", run_launch)
    if launched is None:
        return
    args, out, rows, total = launched
    summary = [{**row, "model": row.pop("size")} for row in summarise(rows)]
    for row in summary:
        row.pop("target")
    print(table(summary, ["devices", "model", "parameters", "mode", "k", "path", "ms_per_update",
                          "samples_per_s", "vs_ddp", "per_repeat"]))
    print(f"total {total:.0f} s")
    paths = write_results(out, "architectures", summary, {"runs": rows, "repeats": args.repeats,
                                                          "threads": args.threads, "total_wall_s": total})
    print("results:", *map(str, paths))
    if any(math.isnan(row["vs_ddp"]) for row in summary if row["mode"] != "ddp"):
        print("(no ddp run in a repeat: vs_ddp is nan)")


if __name__ == "__main__":
    main()
