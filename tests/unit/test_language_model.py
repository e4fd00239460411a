"""The small language model of the local-updates race: the characters of Python's help texts
(`PythonDocsDataModule`), the nanoGPT-shaped `GPT`, and the recipe that races them."""

from __future__ import annotations

import itertools
import socket

import pytest
import torch
from torch.nn import functional as F

from lightning_stale.config import ConfigError, compose_config, contestant_configs
from lightning_stale.data import PythonDocsDataModule
from lightning_stale.data.python_docs import python_docs_topics
from lightning_stale.models import GPT
from lightning_stale.models.gpt import warmup_cosine
from lightning_stale.train import train

DILOCO = {"class_path": "torch.optim.SGD",
          "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}


@pytest.fixture(scope="module")
def docs() -> PythonDocsDataModule:
    module = PythonDocsDataModule(block_size=16, batch_size=4, train_windows=64, val_windows=8)
    module.setup()
    return module


# ------------------------------------------------------------------ data
def test_windows_have_the_data_shape_and_next_character_targets(docs):
    assert docs.input_shape == (16,) and docs.num_classes == len(docs.chars) > 50
    x, y = next(iter(docs.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert int(x.max()) < docs.num_classes and int(x.min()) >= 0
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the inputs shifted by one
    split = docs.train_set
    for index in (0, len(split) - 1):
        start = int(split.offsets[index])
        window_x, window_y = split[index]
        assert torch.equal(window_y, split.tokens[start + 1:start + 17])
        assert torch.equal(window_x, split.tokens[start:start + 16])
    assert len(docs.train_set) == 64 and len(docs.val_set) == 8
    assert docs.test_dataloader().dataset is docs.val_set


def test_vocabulary_round_trips_the_text(docs):
    text = python_docs_topics()["if"]
    assert docs.decode(docs.encode(text)) == text


def test_split_is_by_topic_and_deterministic_per_seed():
    first, again = PythonDocsDataModule(seed=3), PythonDocsDataModule(seed=3)
    other = PythonDocsDataModule(seed=4)
    train, val = first.split_topics()
    assert (train, val) == again.split_topics() and val != other.split_topics()[1]
    assert not set(train) & set(val) and sorted(train + val) == sorted(python_docs_topics())
    assert len(val) == round(0.1 * len(python_docs_topics()))
    for module in (first, again, other):
        module.setup()
    assert torch.equal(first.train_set.offsets, again.train_set.offsets)
    assert not torch.equal(first.train_set.offsets, other.train_set.offsets)


def test_nothing_is_downloaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the data module opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    module = PythonDocsDataModule(train_windows=8, val_windows=8)
    module.setup()
    assert len(module.train_set.tokens) > 300_000  # most of the ~465,000 characters


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 0}, r"block_size must be >= 1, got 0"),
    ({"val_fraction": 1.0}, r"val_fraction must lie in \(0, 1\), got 1.0"),
    ({"train_windows": 0}, r"train_windows must be >= 1"),
    ({"batch_size": 0}, r"batch_size must be >= 1"),
])
def test_bad_data_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PythonDocsDataModule(**kwargs)


# ------------------------------------------------------------------ model
def tiny_gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 30, "block_size": 12, "n_layer": 2, "n_head": 2, "n_embd": 16,
                  **kwargs})


def test_logits_at_a_position_do_not_see_later_tokens():
    model = tiny_gpt().eval()
    tokens = torch.randint(0, 30, (3, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 30
    before, after = model(tokens), model(changed)
    assert before.shape == (3, 12, 30)
    assert torch.allclose(before[:, :7], after[:, :7], atol=1e-6)
    assert not torch.allclose(before[:, 7:], after[:, 7:])  # later positions do see them
    with pytest.raises(ValueError, match=r"13 tokens is longer than block_size=12"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_input_and_output_embeddings_are_tied():
    model = tiny_gpt()
    assert model.head.weight is model.token_embedding.weight
    assert sum(p is model.head.weight for p in model.parameters()) == 1
    # a step moves the one matrix through both of its uses
    loss = model(torch.randint(0, 30, (2, 12))).sum()
    loss.backward()
    assert model.token_embedding.weight.grad is not None


def test_sizes_come_from_the_data_and_bad_sizes_are_refused():
    model = GPT(input_shape=(8,), num_classes=20, n_embd=16, n_head=4)
    assert (model.hparams["vocab_size"], model.hparams["block_size"]) == (20, 8)
    assert model.head.out_features == 20 and model.position_embedding.num_embeddings == 8
    with pytest.raises(ValueError, match=r"n_embd=10 must be divisible by n_head=4"):
        GPT(vocab_size=20, block_size=8, n_embd=10, n_head=4)
    with pytest.raises(ValueError, match=r"needs vocab_size and block_size"):
        GPT(block_size=8)
    with pytest.raises(ValueError, match=r"warmup_steps must be >= 1"):
        GPT(vocab_size=20, block_size=8, warmup_steps=0)


def test_loss_falls_on_a_tiny_batch():
    model = tiny_gpt(schedule_length=30, warmup_steps=3, lr=1e-2)
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    tokens = torch.randint(0, 30, (4, 13), generator=torch.Generator().manual_seed(2))
    batch = (tokens[:, :-1], tokens[:, 1:])
    losses = []
    for _ in range(30):
        loss = model._loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(float(torch.log(torch.tensor(30.0))), rel=0.05)
    assert losses[-1] < 0.7 * losses[0]


def test_schedule_warms_up_then_decays_to_the_floor():
    model = tiny_gpt(lr=1e-3, warmup_steps=4, schedule_length=20, min_lr_ratio=0.1)
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    assert isinstance(optimizer, torch.optim.AdamW)
    decays = sorted(group["weight_decay"] for group in optimizer.param_groups)
    assert decays == [0.0, 0.1]  # no decay on biases and LayerNorms
    rates = []
    for _ in range(20):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear warm-up
    assert all(a >= b for a, b in itertools.pairwise(rates[4:])) and rates[19] > 1e-4
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(12, 4, 20, 0.1) == pytest.approx(0.55)  # half-way down the cosine


def test_loss_matches_cross_entropy_over_every_position():
    model = tiny_gpt()
    tokens = torch.randint(0, 30, (2, 13))
    x, y = tokens[:, :-1], tokens[:, 1:]
    expected = F.cross_entropy(model(x).transpose(1, 2), y)
    assert model._loss((x, y)).item() == pytest.approx(expected.item(), rel=1e-6)


# ------------------------------------------------------------------ the recipe
def test_recipe_races_sync_against_diloco_under_k_of_p():
    cfg = compose_config("local_updates_lm")
    assert cfg.engine.name == "simulated" and cfg.engine.strategy.num_learners == 4
    assert cfg.delay._target_ == "lightning_stale.delays.ShiftedExponential"
    assert cfg.model._target_ == "lightning_stale.models.GPT"
    assert cfg.data._target_ == "lightning_stale.data.PythonDocsDataModule"
    found = [(c.variant, c.k, run.variant.local_steps, run.variant.outer_optimizer)
             for c, run in contestant_configs(cfg)]
    assert [entry[:3] for entry in found] == [("sync", None, 1), ("sync", None, 8),
                                              ("k_sync", 3, 8), ("k_batch_async", 2, 8)]
    assert found[0][3] is None  # fully sync every step: what DDP computes
    assert found[1][3] == found[2][3] == DILOCO
    assert found[3][3] is None  # plain averaging: Nesterov on stale pseudo-gradients diverges
    with pytest.raises(ConfigError, match=r"engine 'ddp' cannot race"):
        compose_config("local_updates_lm", ["race.contestants=[sync@ddp,sync]"])


@pytest.mark.slow  # four fits in one process: about 10 s alone, more on busy cores
def test_recipe_runs_end_to_end_with_few_steps(tmp_path):
    cfg = compose_config("local_updates_lm", [
        "trainer.max_steps=16", "trainer.num_sanity_val_steps=0", "validate=false",
        "data.train_windows=256", "data.val_windows=16", f"output_dir={tmp_path}"])
    result = train(cfg)
    updates = [summary["updates"] for summary in result["contestants"]]
    assert updates == [16, 2, 2, 2]  # max_steps counts inner steps: 16 / H updates at H = 8
    rows = result["rows"]
    assert [row["H"] for row in rows] == [1, 8, 8, 8]
    assert [row["K of P"] for row in rows] == ["4 of 4", "4 of 4", "3 of 4", "2 of 4"]
    assert all(0 < row["final loss"] < 6 for row in rows)
    assert (tmp_path / "race.png").is_file() and (tmp_path / "race_tradeoff.png").is_file()
