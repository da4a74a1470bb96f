"""Loaded (via ``PYTHONPATH``) only by workers that run under libfaketime in the clock-skew test.

libfaketime 0.9.10 breaks Python's ``time.sleep`` when it leaves the monotonic clock
alone (``clock_nanosleep`` fails with EINVAL), and ``threading`` timeouts when it
fakes it (they wait for the offset).  A real skewed machine has neither problem: its
monotonic clock is fine.  So the test fakes only wall-clock time, and ``time.sleep``
waits on a lock timeout instead, which uses the untouched monotonic clock.
"""

import threading
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


time.sleep = _sleep
