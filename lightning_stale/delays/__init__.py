"""Straggler models: how long each learner's mini-batch takes (`models`), and recorded delays
(`traces`). Every model is reachable as ``lightning_stale.delays.<Name>``, the name configs use."""

from lightning_stale.delays.models import (Constant, DelayModel, Exponential, NoDelay, Pareto,
                                           ShiftedExponential, SlowLearners)
from lightning_stale.delays.traces import (TRACE_FILE_NAME, TRACE_HEADER, RecordingDelay, Trace,
                                           TraceExhaustedError, TraceRecorder)

__all__ = ["Constant", "DelayModel", "Exponential", "NoDelay", "Pareto", "RecordingDelay",
           "ShiftedExponential", "SlowLearners", "TRACE_FILE_NAME", "TRACE_HEADER", "Trace",
           "TraceExhaustedError", "TraceRecorder"]
