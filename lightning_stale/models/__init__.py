"""Networks (plain nn.Modules built as ``Net(input_shape, num_classes, ...)``) and the
LightningModules that train them: ``Classifier``, ``LeastSquares`` for the convex problem, and
``GPT``, a small causal language model."""

from lightning_stale.models.classifier import Classifier, build_net, make_optimizer
from lightning_stale.models.gpt import GPT
from lightning_stale.models.least_squares import LeastSquares
from lightning_stale.models.nets import MLP, LeNet, LinearRegression, LogisticRegression
from lightning_stale.models.resnet import ResNet

__all__ = [
    "GPT",
    "MLP",
    "Classifier",
    "LeNet",
    "LeastSquares",
    "LinearRegression",
    "LogisticRegression",
    "ResNet",
    "build_net",
    "make_optimizer",
]
