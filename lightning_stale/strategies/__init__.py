"""Lightning strategies: the real parameter server and its virtual-clock twin."""

from lightning_stale.strategies.simulated import SimulatedStaleStrategy
from lightning_stale.strategies.stale import StaleStrategy

__all__ = ["SimulatedStaleStrategy", "StaleStrategy"]
