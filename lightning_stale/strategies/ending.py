"""How a fit on the real engine ends, for `StaleStrategy`: the last epoch's schedulers, every
learner's goodbye, the server's final state on rank 0 and its counters."""

from __future__ import annotations

from lightning_stale.engine.distributed.learner import Learner, RunInterrupted, ServerFailed


class RunEnding:
    """Mixin for `StaleStrategy` (which sets ``_learner``, ``_server``, ``_side``,
    ``_checkpoint``, ``_channels``, ``path`` and ``shutdown_timeout``)."""

    _learner: Learner | None

    def on_train_end(self) -> None:
        self._step_last_epoch_schedulers()
        self._shut_down()
        super().on_train_end()  # (Lightning's, joined at import: `strategies.namespaces`)

    def _step_last_epoch_schedulers(self) -> None:
        """Lightning steps the epoch-interval schedulers after every epoch's validation, the
        last epoch's too; the server steps them when the next epoch begins, so when the fit
        ended with an epoch (not with ``max_steps`` inside one) that epoch's are stepped here."""
        server = self._server
        if server is None or self._learner is None:
            return
        with server.lock:
            epochs_ended = server.core.epoch
        if epochs_ended > self._epoch:
            trainer = self.lightning_module.trainer
            server.resume({k: float(v) for k, v in trainer.callback_metrics.items()})

    def _shut_down(self) -> None:
        learner, self._learner = self._learner, None
        if learner is None:
            return
        self.stop_watching()
        learner.close(self.shutdown_timeout)
        if self._server is not None:
            self._finish_server()
        stuck = learner.exchange.close(self.shutdown_timeout)
        self.overlapped_updates = learner.exchange.overlapped_updates
        if stuck:
            raise ServerFailed(f"threads still running after shutdown: {stuck}")
        if learner.interrupted:  # a signal stopped training: everyone left, the run did not finish
            self._failure_raised = True
            raise RunInterrupted(f"{learner.interrupted}: training stopped before its end (every "
                                 "learner left through the shutdown protocol)")

    def _finish_server(self) -> None:
        if not self._server.join(self.shutdown_timeout):
            raise ServerFailed(f"the parameter server did not finish within {self.shutdown_timeout} s")
        stuck = self._server.endpoint.join(self.shutdown_timeout)
        if stuck:
            raise ServerFailed(f"server threads still running after shutdown: {stuck}")
        self.check_server()
        if self._checkpoint is not None:
            self._checkpoint.finish()
        self._collect_stats()

    def _collect_stats(self, unannounced: Learner | None = None) -> None:
        """The final counters, and the trace of the delays drawn (written atomically). After a
        normal end the trace holds every learner's delays (from their goodbyes); after a failure
        (``unannounced``: rank 0's learner, which said no goodbye) it holds rank 0's delays and
        those of learners that had said goodbye, not the others'."""
        stats, recorder = self._server.final_report(
            None if unannounced is None else (unannounced.rank, unannounced.delays, unannounced.cancelled))
        stats["server_path"] = self.path
        stats["shared_memory_learners"] = self._server.endpoint.lane_learners
        stats["payload_channels"] = self._channels
        stats["payloads_on_channels"] = (self._server.endpoint.payloads_on_channels  # rank 0's
                                         + (self._side.payloads_on_channels if self._side is not None else 0))
        path = self.write_trace(recorder)
        if path is not None:
            stats["trace_path"] = path
        self._final_stats = stats
