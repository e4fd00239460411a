"""What a checkpoint written on global rank 0 holds of the real engine's server, on each path.

A checkpoint holds the model as the server has it, in Lightning's own slots (``state_dict``,
``optimizer_states``), and the server's books under ``"stale_server"`` (version, updates, epoch,
samples, the LR schedulers' states): the same format on every path, so a run resumes on any
path. Where the model is:

* central: the server's `ServerState` on rank 0;
* collective: every learner holds it, rank 0's learner too (its version is the checkpoint's);
* sharded: spread over the owners, gathered to rank 0 once per checkpoint (in the order of the
  server's updates, so every slice is of the same version).

After fit the module and the optimizer on rank 0 hold the server's final state on every path
(`ServerCheckpoint.finish`), so Lightning's own slots need nothing from the server.

After a failure on the sharded path (an ``OnExceptionCheckpoint``, say) the owners' slices can no
longer be gathered: the checkpoint then holds rank 0's learner's parameters (the last version it
received) without optimizer or scheduler state, and says so in a warning, rather than raising
inside Lightning's exception handling, which would skip the strategy's teardown.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from lightning_stale.engine.distributed.sharded import FINAL, assemble_optimizer_state
from lightning_stale.engine.state import named_state

log = logging.getLogger(__name__)


class ServerCheckpoint:
    """Args:
        strategy: the `StaleStrategy` on rank 0 (its server, learner and path)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        # One instant of the server's state for the parts of one checkpoint, which Lightning reads
        # one after the other while the server steps on: sharded (vector, optimizer state,
        # schedulers, version); central (parameters by name, optimizer state, books).
        self._gathered: tuple | None = None
        self._requests = FINAL
        self._warned = False  # about a checkpoint after a failure on the sharded path

    @property
    def _live(self) -> bool:
        s = self.strategy
        return s._server is not None and s._final_stats is None

    @property
    def _lost(self) -> bool:
        """The run failed on the sharded path: what the owners held cannot be gathered."""
        s = self.strategy
        return self._live and s.path == "sharded" and s._server.error is not None

    def module_state(self, state_dict: dict) -> dict:
        """``state_dict`` (the module's own) with the server's parameters and buffers."""
        s = self.strategy
        if self._lost:  # (Lightning asks for the module's state first: the warning goes here)
            self._warn_lost()
            return state_dict
        if not self._live or s.path == "collective":
            return state_dict
        self._gathered = None  # a checkpoint begins here: its instant is now
        if s.path == "sharded":
            vector, *_ = self._gather()
            state_dict.update(named_state(s.lightning_module, vector))
        else:
            state_dict.update(self._held()[0])
        return state_dict

    def _warn_lost(self) -> None:
        if not self._warned:
            self._warned = True
            s = self.strategy
            log.warning("StaleStrategy: the run failed, so this checkpoint holds rank 0's learner's "
                        "parameters (version %d) without optimizer or scheduler state: the shard "
                        "owners' state was lost with the failure", s._learner.version if s._learner else -1)

    def optimizer_state(self, own: dict) -> dict:
        s = self.strategy
        if not self._live or s.path == "collective" or self._lost:
            return own
        if s.path == "sharded":
            _, optimizer_state, *_ = self._gather()
            return optimizer_state
        return self._held()[1]

    def engine_state(self) -> dict:
        """The server's books, matching the parameters saved beside them."""
        s = self.strategy
        saved = self._held()[2] if self._live and s.path == "central" else s._server.state_dict()
        if self._lost:
            version = s._learner.version if s._learner is not None else saved["version"]
            saved.update(version=version, updates=version, schedulers=[])
        elif s.path == "collective" and s._learner is not None:
            saved.update(version=s._learner.version, updates=s._learner.version,
                         schedulers=s._learner.exchange.schedules.states())
        elif s.path == "sharded" and self._live:
            _, _, schedulers, version = self._gather()
            saved.update(version=version, updates=version, schedulers=schedulers)
        self._gathered = None  # the next checkpoint gathers anew
        return saved

    def finish(self) -> None:
        """After the stop: rank 0's optimizer takes the server's final state (central: the
        server's optimizer; sharded: the state gathered from the owners)."""
        s = self.strategy
        optimizer = s.optimizers[0]
        if s.path == "central":
            with s._server.reading():
                optimizer.load_state_dict(s._server.core.state.optimizer.state_dict())
        elif s.path == "sharded":
            _, saved, _ = s._server.payloads.gathered(FINAL, s.check_server)
            optimizer.load_state_dict(assemble_optimizer_state(
                optimizer, s.shard_layout, s.shard_params, saved))

    def _held(self) -> tuple:
        """The central server's parameters, optimizer state and books at one instant, copied (the
        server steps in place once its lock is released)."""
        if self._gathered is None:
            s = self.strategy
            with s._server.reading():
                state = s._server.core.state
                self._gathered = (state.named_state(s.lightning_module),
                                  copy.deepcopy(state.optimizer.state_dict()),
                                  copy.deepcopy(s._server.core.state_dict()))
        return self._gathered

    def _gather(self) -> tuple:
        if self._gathered is None:
            s = self.strategy
            if s._server.core.stopped:  # the owners have retired: the state gathered at the stop
                states, saved, version = s._server.payloads.gathered(FINAL, s.check_server, keep=True)
            else:
                self._requests += 1
                s._server.gather(self._requests)
                states, saved, version = s._server.payloads.gathered(self._requests, s.check_server)
            layout = s.shard_layout
            self._gathered = (layout.join(states),
                              assemble_optimizer_state(s.optimizers[0], layout, s.shard_params, saved),
                              saved[0]["schedulers"], version)
        return self._gathered
