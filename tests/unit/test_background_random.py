"""The library's background threads leave the process's global random generator alone: a
thread drawing from it changes the sequence a seeded program sees (and made hypothesis's park
model test fail as "inconsistent data generation" when a worker's recovery thread of an earlier
test was still running)."""

from __future__ import annotations

import random
import time
from typing import Any

from celery_caps.worker import Recovery


def test_the_recovery_thread_draws_its_jitter_from_a_generator_of_its_own() -> None:
    random.seed(1234)
    before = random.getstate()
    runtime: Any = object()  # run() draws its first wait's jitter before it uses the runtime
    recovery = Recovery(runtime)
    recovery.start()
    try:
        time.sleep(0.2)
    finally:
        recovery.stop()
        recovery.join(5)
    assert not recovery.is_alive()
    assert random.getstate() == before
