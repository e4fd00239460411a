"""lightning_stale: slow and stale gradients for PyTorch Lightning.

A parameter-server strategy running the six distributed-SGD variants of Dutta et al.,
"Slow and Stale Gradients Can Win the Race" (AISTATS 2018), straggler models, the paper's
theory, and a virtual-clock twin of the engine for sweeps.
"""

from lightning_stale.method.variants import VARIANT_NAMES, Variant
from lightning_stale.strategies import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.strategies.timing import MiniBatchTimer

__all__ = [
           "VARIANT_NAMES",
           "MiniBatchTimer",
           "SimulatedStaleStrategy",
           "StaleStrategy",
           "Variant",
           "WallClockLogger",
]
__version__ = "0.1.0"
