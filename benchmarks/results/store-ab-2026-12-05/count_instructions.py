"""CPU instructions per acquire+release pair in this process, counted by valgrind (callgrind).

Instruction counts repeat for the same code and inputs whatever else the machine does, where
wall-clock figures on a shared machine move by ±30 %.  Run it twice, with 50 and 250 pairs:
the difference over 200 is one pair's count, without the start-up and the schema.

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/results/store-ab-2026-12-05/count_instructions.py 50
    (the same with 250; "Collected" is the count)

A second argument names another store (a ``caps_url``; give a database of its own, dropped
afterwards): the count is then this process's share, the server's work not included.  Put
another tree's ``celery_caps`` first on ``PYTHONPATH`` to count it instead.
"""

from __future__ import annotations

import sys
import tempfile

try:
    from celery_caps.stores import store_from_url
except ImportError:  # the tree before the store rework
    from celery_caps.stores.base import store_from_url

pairs = int(sys.argv[1])
with tempfile.TemporaryDirectory() as directory:
    store = store_from_url(sys.argv[2] if len(sys.argv) > 2 else f"sqlite:///{directory}/caps.db")
    slots = {"bench": 4}
    for i in range(50):  # warm: the schema, the statement caches
        run = f"warm-{i:06d}"
        store.acquire(slots, run, run, "h", 60.0, "t")
        store.release(run)
    for i in range(pairs):
        run = f"run-{i:06d}-0123456789abcdef"
        store.acquire(slots, run, run, "h", 60.0, "t")
        store.release(run)
    store.close()
