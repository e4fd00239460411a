"""Event logs of runs, and their replay in one process (docs/replay.md)."""

from lightning_stale.replay.events import EVENTS_FILE_NAME, FORMAT_VERSION, EventLog, EventLogError, read_events
from lightning_stale.replay.recorder import EventRecorder

__all__ = ["EVENTS_FILE_NAME", "FORMAT_VERSION", "EventLog", "EventLogError", "EventRecorder",
           "read_events"]
