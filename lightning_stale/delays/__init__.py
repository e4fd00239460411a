"""Straggler models: how long each learner's mini-batch takes (`models`), recorded delays
(`traces`), and models fitted to recorded times (`fit`). Every model is reachable as
``lightning_stale.delays.<Name>``, the name configs use."""

from lightning_stale.delays.fit import Candidate, FitResult, fit
from lightning_stale.delays.models import (
                                           Constant,
                                           DelayModel,
                                           Exponential,
                                           NoDelay,
                                           Pareto,
                                           ShiftedExponential,
                                           SlowLearners,
)
from lightning_stale.delays.traces import (
                                           TRACE_FILE_NAME,
                                           TRACE_HEADER,
                                           Empirical,
                                           RecordingDelay,
                                           Trace,
                                           TraceExhaustedError,
                                           TraceRecorder,
                                           read_trace,
)

__all__ = [
                                           "TRACE_FILE_NAME",
                                           "TRACE_HEADER",
                                           "Candidate",
                                           "Constant",
                                           "DelayModel",
                                           "Empirical",
                                           "Exponential",
                                           "FitResult",
                                           "NoDelay",
                                           "Pareto",
                                           "RecordingDelay",
                                           "ShiftedExponential",
                                           "SlowLearners",
                                           "Trace",
                                           "TraceExhaustedError",
                                           "TraceRecorder",
                                           "fit",
                                           "read_trace",
]
