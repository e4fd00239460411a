"""A small GPT-style causal language model, in the shape of Karpathy's nanoGPT (model.py):
token and position embeddings, pre-LayerNorm transformer blocks with causal self-attention, a
final LayerNorm and a head tied to the token embedding (Press and Wolf, 2017), trained with
AdamW under a linear warm-up then a cosine decay, as nanoGPT's train.py does."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pytorch_lightning import LightningModule
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = (part.view(batch, time, self.n_head, -1).transpose(1, 2)
                   for part in self.qkv(x).split(channels, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x)) with a 4x GELU MLP."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The learning-rate factor of nanoGPT's ``get_lr``: linear from 1/warmup_steps up to 1 over
    the first ``warmup_steps`` steps, then cosine down to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


class GPT(LightningModule):
    """Next-token cross-entropy on windows of tokens ``(x, y)`` with ``y`` the next tokens.

    Args:
        vocab_size: tokens in the vocabulary; by default ``num_classes`` (the app passes the data
            module's).
        block_size: longest context; by default ``input_shape[0]``.
        n_layer, n_head, n_embd: blocks, attention heads, embedding width (``n_embd`` divisible
            by ``n_head``).
        dropout: in attention, after the MLP and on the embeddings; 0 by default.
        lr: AdamW's peak learning rate; ``betas`` and ``weight_decay`` as nanoGPT's, with the
            decay on parameters of two or more dimensions only (not on biases and LayerNorms).
        warmup_steps: linear warm-up length, in optimizer steps.
        schedule_length: where the cosine ends (at ``lr * min_lr_ratio``); by default the
            trainer's ``estimated_stepping_batches``. The schedule steps every optimizer step.
        input_shape, num_classes: the data's ``(block_size,)`` and vocabulary size.

    Logs ``train/loss`` every step, unsynchronised, and ``val/loss``, ``test/loss`` per epoch,
    synchronised, as `Classifier` does.
    """

    def __init__(self, vocab_size: int | None = None, block_size: int | None = None,
                 n_layer: int = 2, n_head: int = 4, n_embd: int = 64, dropout: float = 0.0,
                 lr: float = 3e-3, weight_decay: float = 0.1,
                 betas: Sequence[float] = (0.9, 0.95), warmup_steps: int = 50,
                 min_lr_ratio: float = 0.1, schedule_length: int | None = None,
                 input_shape: Sequence[int] | None = None, num_classes: int | None = None) -> None:
        super().__init__()
        vocab_size = vocab_size if vocab_size is not None else num_classes
        block_size = block_size if block_size is not None else (
            input_shape[0] if input_shape else None)
        if vocab_size is None or block_size is None:
            raise ValueError("GPT needs vocab_size and block_size: pass them, or the data "
                             "module's num_classes and input_shape")
        if int(n_embd) % int(n_head):
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        if int(warmup_steps) < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.save_hyperparameters(ignore=["input_shape", "num_classes"])
        self.hparams.update(vocab_size=int(vocab_size), block_size=int(block_size),
                            betas=tuple(float(beta) for beta in betas))
        self.token_embedding = nn.Embedding(int(vocab_size), n_embd)
        self.position_embedding = nn.Embedding(int(block_size), n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, int(vocab_size), bias=False)
        self.head.weight = self.token_embedding.weight  # tied input and output embeddings
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # nanoGPT's initialisation: N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, time, vocab_size) for tokens of shape (batch, time)."""
        time = tokens.shape[1]
        if time > self.hparams["block_size"]:
            raise ValueError(f"a sequence of {time} tokens is longer than block_size="
                             f"{self.hparams['block_size']}")
        positions = torch.arange(time, device=tokens.device)
        x = self.drop(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True,
                 batch_size=len(batch[0]))
        return loss

    def _evaluate(self, batch, stage: str) -> torch.Tensor:
        loss = self._loss(batch)
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(batch[0]), prog_bar=stage == "val")
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test")

    def _schedule_length(self) -> int:
        if self.hparams["schedule_length"] is not None:
            return int(self.hparams["schedule_length"])
        length = self.trainer.estimated_stepping_batches
        if not math.isfinite(length):
            raise ValueError("the cosine schedule needs a finite length: set max_steps or "
                             "max_epochs on the Trainer, or schedule_length")
        return max(1, int(length))

    def configure_optimizers(self):
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": hp["weight_decay"]},
             {"params": others, "weight_decay": 0.0}], lr=hp["lr"], betas=hp["betas"])
        total, warmup, floor = self._schedule_length(), hp["warmup_steps"], hp["min_lr_ratio"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, total, floor))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}
