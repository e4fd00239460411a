"""Plain networks, each built as ``Net(input_shape, num_classes, ...)`` from a data module's
``input_shape`` and ``num_classes``, and returning outputs of shape (batch, num_classes)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def flat_size(input_shape: Sequence[int]) -> int:
    return int(math.prod(input_shape))


def image_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """(C, H, W) for a conv net: (C, H, W) as is, (H, W) as one channel, and a flat square
    vector such as the 64 pixels of the 8x8 digits as one channel of side sqrt(length)."""
    shape = tuple(int(size) for size in input_shape)
    if len(shape) == 3:
        return shape
    if len(shape) == 2:
        return (1, *shape)
    if len(shape) == 1 and math.isqrt(shape[0]) ** 2 == shape[0]:
        side = math.isqrt(shape[0])
        return (1, side, side)
    raise ValueError(f"cannot read input_shape {shape} as an image: need (C, H, W), (H, W) "
                     "or a flat square length")


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: flatten, then one linear layer to the class logits."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.linear = nn.Linear(flat_size(input_shape), self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Fully connected network: flatten, then Linear + ReLU per entry of ``hidden_sizes``."""

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 hidden_sizes: Sequence[int] = (64,)) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        layers: list[nn.Module] = [nn.Flatten()]
        width = flat_size(input_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, int(hidden)), nn.ReLU()]
            width = int(hidden)
        layers.append(nn.Linear(width, self.num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class LeNet(nn.Module):
    """LeNet-5 style CNN (LeCun et al. 1998): two 5x5 conv + max-pool stages (6 and 16
    channels), then fully connected layers of 120 and 84 units, with ReLU instead of tanh.

    The first conv pads by 2, so a 28x28 MNIST image is treated like the 32x32 input of the
    original (16x5x5 features before the classifier); 3x32x32 CIFAR images give 16x6x6. For
    small images (the 8x8 digits) the second conv pads too, so the feature map does not vanish.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.input_image = image_shape(input_shape)
        channels, height, width = self.input_image
        second_padding = 2 if min(height, width) // 2 < 10 else 0
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=second_padding), nn.ReLU(), nn.MaxPool2d(2),
        )
        with torch.no_grad():
            num_features = self.features(torch.zeros(1, *self.input_image)).numel()
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(num_features, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, self.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(len(x), *self.input_image)))


class LinearRegression(nn.Module):
    """x -> x . w (+ b): the model of the convex least-squares problem.

    ``bias=False`` by default because ``ConvexDataModule`` generates data without an intercept
    and its closed-form optimum w* has no bias entry; with ``bias=True`` the weights no longer
    match ``optimum``. Output shape (batch, num_classes), num_classes 1 for scalar targets.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 1, bias: bool = False) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.linear = nn.Linear(flat_size(input_shape), self.num_classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))
