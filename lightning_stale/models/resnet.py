"""CIFAR-style residual network (He et al., "Deep Residual Learning for Image Recognition",
CVPR 2016, Section 4.2): ResNet-8/-14/-20/... of depth 6n + 2."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from lightning_stale.models.nets import image_shape


class BasicBlock(nn.Module):
    """Two 3x3 conv + batch-norm layers with an identity shortcut, or a 1x1 conv projection
    (the paper's option B) where the block changes width or resolution."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet for small images: a 3x3 stem conv of ``width`` channels, three stages of n basic
    blocks with width, 2 width and 4 width channels (stride 2 into stages 2 and 3), global
    average pooling and a linear classifier. ``depth`` = 6n + 2 (8, 14, 20, 32, ...); depth 20
    and width 16 is the paper's ResNet-20 (0.27M parameters).

    Global average pooling makes it independent of the resolution: 3x32x32, 1x28x28 and even the
    flat 8x8 digits (read as 1x8x8) all work.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, depth: int = 20,
                 width: int = 16) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"ResNet depth must be 6n + 2 with n >= 1 (8, 14, 20, ...), got {depth}")
        self.num_classes = int(num_classes)
        self.input_image = image_shape(input_shape)
        blocks_per_stage = (depth - 2) // 6
        self.stem = nn.Sequential(
            nn.Conv2d(self.input_image[0], width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU())
        stages: list[nn.Module] = []
        in_channels = width
        for stage, out_channels in enumerate((width, 2 * width, 4 * width)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, self.num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x.reshape(len(x), *self.input_image)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
