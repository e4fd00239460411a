"""A clock for tests where time is the subject: it moves only when told to, so what a test
reads off it is exact whatever the machine's load (no wall-clock bounds in unit tests)."""


class FakeTime:
    """Stands in for the ``time`` module (``monotonic``, ``perf_counter``, ``sleep``) or for one
    of its functions imported by name, patched into the module under test."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds
