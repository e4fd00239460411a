"""Data modules: shapes, splits, file formats, missing-file errors, convex-problem constants."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from datafiles import make_cifar, make_mnist
from lightning_stale.data import (CIFAR10DataModule, ConvexDataModule, DigitsDataModule,
                                  MNISTDataModule, read_idx)
from lightning_stale.models import LeastSquares


# --- digits ---------------------------------------------------------------------------------

def test_digits_shapes_range_and_split_sizes():
    dm = DigitsDataModule(batch_size=16)
    assert dm.input_shape == (64,) and dm.num_classes == 10  # before setup
    dm.setup("fit")
    sizes = [len(dm.train_set), len(dm.val_set), len(dm.test_set)]
    assert sum(sizes) == 1797 and sizes[1] == sizes[2] == round(0.2 * 1797)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 64) and x.dtype == torch.float32 and y.dtype == torch.long
    features = dm.train_set.tensors[0]
    assert features.min() == 0.0 and features.max() == 1.0
    # Stratified: every class is in every split.
    for split in (dm.train_set, dm.val_set, dm.test_set):
        assert set(split.tensors[1].tolist()) == set(range(10))
    # The train loader drops the incomplete last batch, eval loaders keep every sample.
    assert len(dm.train_dataloader()) == len(dm.train_set) // 16
    assert sum(len(b[1]) for b in dm.val_dataloader()) == len(dm.val_set)


def test_digits_deterministic_per_seed_and_disjoint():
    def split_labels(seed):
        dm = DigitsDataModule(seed=seed)
        dm.setup()
        return [s.tensors[0].sum(dim=1) for s in (dm.train_set, dm.val_set, dm.test_set)]

    first, again, other = split_labels(0), split_labels(0), split_labels(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[1], other[1])
    batches = [next(iter(DigitsDataModule(seed=3).train_dataloader()))[1] for _ in range(2)]
    assert torch.equal(*batches)


def test_digits_without_test_fraction_reuses_val():
    dm = DigitsDataModule(val_fraction=0.25, test_fraction=0.0)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == 1797
    assert dm.test_set is dm.val_set
    assert len(dm.predict_dataloader().dataset) == len(dm.val_set)


# --- MNIST ----------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_idx_files(tmp_path, gz):
    arrays = make_mnist(tmp_path, gz=gz)
    dm = MNISTDataModule(data_dir=tmp_path, batch_size=4, val_fraction=0.25)
    assert dm.input_shape == (1, 28, 28) and dm.num_classes == 10
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (15, 5, 8)
    x, y = dm.test_set[2]
    expected = (arrays["t10k-images-idx3-ubyte"][2] / 255.0 - 0.1307) / 0.3081
    assert x.shape == (1, 28, 28)
    assert torch.allclose(x[0], torch.as_tensor(expected, dtype=torch.float32), atol=1e-5)
    assert int(y) == 6
    xb, yb = next(iter(dm.test_dataloader()))
    assert xb.shape == (4, 1, 28, 28) and yb.tolist() == [0, 3, 6, 9]
    # Train and val together are exactly the training labels.
    labels = sorted(int(dm.train_set[i][1]) for i in range(15))
    labels += [int(dm.val_set[i][1]) for i in range(5)]
    assert sorted(labels) == sorted(arrays["train-labels-idx1-ubyte"].tolist())


def test_read_idx_rejects_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(ValueError, match="magic"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(struct.pack(">I", 0x0801) + struct.pack(">I", 5) + b"ab")
    with pytest.raises(ValueError, match="5 bytes"):
        read_idx(short)


def test_mnist_missing_folder_fails_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        MNISTDataModule(data_dir=tmp_path / "nowhere")
    message = str(error.value)
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in message
    assert "train-images-idx3-ubyte" in message and "t10k-labels-idx1-ubyte" in message


# --- CIFAR-10 -------------------------------------------------------------------------------

def test_cifar10_reads_pickles(tmp_path):
    batches = make_cifar(tmp_path, rows=4)
    dm = CIFAR10DataModule(data_dir=tmp_path, batch_size=2, val_fraction=0.2)
    assert dm.input_shape == (3, 32, 32) and dm.num_classes == 10
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (16, 4, 4)
    x, y = dm.test_set[1]
    raw = batches["test_batch"][b"data"][1].reshape(3, 32, 32) / 255.0
    mean = np.array(CIFAR10DataModule.mean).reshape(3, 1, 1)
    std = np.array(CIFAR10DataModule.std).reshape(3, 1, 1)
    assert x.shape == (3, 32, 32)
    assert torch.allclose(x, torch.as_tensor((raw - mean) / std, dtype=torch.float32), atol=1e-5)
    assert int(y) == batches["test_batch"][b"labels"][1]
    xb, yb = next(iter(dm.predict_dataloader()))
    assert xb.shape == (2, 3, 32, 32) and yb.dtype == torch.long


def test_cifar10_missing_file_names_folder_and_file(tmp_path):
    make_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError) as error:
        CIFAR10DataModule(data_dir=tmp_path)
    assert str(tmp_path / "cifar-10-batches-py") in str(error.value)
    assert "data_batch_3" in str(error.value)


# --- convex problem -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def convex():
    return ConvexDataModule(num_samples=512, num_features=10, batch_size=32, seed=0)


def test_convex_constants(convex):
    assert convex.input_shape == (10,) and convex.num_classes == 1
    assert convex.smoothness > convex.strong_convexity > convex.l2 > 0
    # Non-isotropic features: a real condition number, not L ~ c.
    assert convex.smoothness / convex.strong_convexity > 3
    w_star = convex.optimum
    assert np.abs(convex.gradient(w_star)).max() < 1e-10
    assert convex.objective(w_star) == pytest.approx(convex.optimal_loss, rel=1e-12)
    rng = np.random.default_rng(0)
    for _ in range(5):
        delta = 1e-2 * rng.standard_normal(w_star.shape)
        excess = convex.objective(w_star + delta) - convex.optimal_loss
        # Quadratic: F(w* + d) - F* = d^T H d / 2, between c|d|^2/2 and L|d|^2/2.
        assert 0.5 * convex.strong_convexity * delta @ delta <= excess * (1 + 1e-6)
        assert excess <= 0.5 * convex.smoothness * delta @ delta * (1 + 1e-6)
    assert convex.gradient_variance() > 0
    assert convex.sync_error_floor(lr=0.1, k=4) == pytest.approx(
        convex.sync_error_floor(lr=0.1, k=1) / 4)


def test_convex_gradient_variance_matches_per_sample_gradients(convex):
    w = torch.zeros(10, dtype=torch.float64, requires_grad=True)
    x = torch.as_tensor(convex.features)
    y = torch.as_tensor(convex.targets)
    grads = torch.stack([torch.autograd.grad(
        0.5 * (x[i] @ w - y[i]) ** 2 + 0.5 * convex.l2 * w @ w, w)[0] for i in range(len(y))])
    expected = ((grads - grads.mean(0)) ** 2).sum(1).mean().item()
    assert convex.gradient_variance(np.zeros(10)) == pytest.approx(expected, rel=1e-9)
    assert np.allclose(grads.mean(0).numpy(), convex.gradient(np.zeros(10)))


def test_least_squares_minibatch_loss_averages_to_optimal_loss(convex):
    model = LeastSquares(l2=convex.l2, input_shape=convex.input_shape, num_classes=1)
    model.load_weights(convex.optimum)
    assert np.allclose(model.weights.numpy(), convex.optimum, atol=1e-6)
    losses = [model.loss(x, y).item() for x, y in convex.train_dataloader()]
    assert len(losses) == 512 // 32
    assert np.mean(losses) == pytest.approx(convex.optimal_loss, rel=1e-5)
    assert np.std(losses) > 0  # the batches really differ: an estimate, not the objective


def test_convex_is_deterministic_per_seed():
    a, b = ConvexDataModule(num_samples=64, seed=5), ConvexDataModule(num_samples=64, seed=5)
    assert np.array_equal(a.features, b.features) and a.optimal_loss == b.optimal_loss
    assert ConvexDataModule(num_samples=64, seed=6).optimal_loss != a.optimal_loss
