"""What a benchmark pool process reports about its memory when it receives ``SIGUSR2``.

Installed by :mod:`benchmarks.benchapp` in every pool process when ``CAPS_BENCH_MEMORY_PROBE``
names a directory; each signal writes ``<directory>/<pid>-<n>.json``, read by
:mod:`benchmarks.memory`.  A report holds the process's memory as the kernel counts it
(``/proc/self/smaps_rollup``), as glibc's allocator holds it (``mallinfo2``: bytes in use and
bytes free inside the heap, which the kernel still counts as resident), Python's allocated
blocks, the live objects by type, and the sizes of what celery-caps keeps per process.  With
``CAPS_BENCH_TRACEMALLOC`` set, the first signal starts :mod:`tracemalloc` and every later one
lists the lines that allocated what is still alive since then, largest first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

#: Frames kept per traced allocation (more show who called; each costs memory and time).
TRACE_FRAMES = 12
#: Lines of each list in a report.
TOP = 30


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Resident (``rss``), proportional (``pss``) and private (``uss``) kilobytes of a process."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
        for line in rollup:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0])
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields.get("Pss", 0),
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "anonymous": fields.get("Anonymous", 0),
    }


def malloc_info() -> dict[str, int] | None:
    """glibc's heap: ``arena`` (bytes from brk), ``mmap`` (large blocks), ``in_use`` and ``free``
    (bytes inside the heap not returned to the kernel); None without glibc's ``mallinfo2``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    info = function()
    return {"arena": info.arena, "mmap": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks}


def caps_state() -> dict[str, Any]:
    """The sizes of what celery-caps keeps in this process (its runtime of the current app)."""
    from celery import current_app

    from celery_caps.runtime import existing_runtime

    runtime = existing_runtime(current_app)
    if runtime is None:
        return {}
    state: dict[str, Any] = {
        "held_runs": len(runtime.held_runs()),
        "failed_calls": len(runtime._failed_calls),
        "history_pending": runtime.history.pending() if runtime.history is not None else None,
    }
    store = runtime._store
    engine = getattr(store, "engine", None) or getattr(store, "_engine", None)
    if engine is not None:
        cache = getattr(engine, "_compiled_cache", None)
        state["sqlalchemy_compiled_cache"] = len(cache) if cache is not None else None
        state["sqlalchemy_pool"] = engine.pool.status()
    return state


def pymalloc_stats() -> str:
    """The summary lines of ``sys._debugmallocstats()`` (Python's own allocator: arenas, pools,
    blocks per size class), which it writes to the C ``stderr``."""
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(2)
        try:
            os.dup2(capture.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        return capture.read().decode(errors="replace")


def report(directory: Path, number: int) -> None:
    traced: dict[str, Any] = {}
    if os.environ.get("CAPS_BENCH_TRACEMALLOC"):
        if not tracemalloc.is_tracing():
            tracemalloc.start(TRACE_FRAMES)
        else:
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
            )
            stats = snapshot.statistics("traceback")
            traced = {
                "total_kb": sum(stat.size for stat in stats) // 1024,
                "top": [
                    {"kb": stat.size // 1024, "count": stat.count, "traceback": stat.traceback.format()}
                    for stat in stats[:TOP]
                ],
                "by_file": [
                    {"kb": stat.size // 1024, "count": stat.count, "where": str(stat.traceback[0])}
                    for stat in snapshot.statistics("lineno")[:TOP]
                ],
            }
    types = Counter(type(item).__qualname__ for item in gc.get_objects())
    data = {
        "pid": os.getpid(),
        "time": time.time(),
        "memory_kb": smaps_rollup(),
        "malloc": malloc_info(),
        "python_blocks": sys.getallocatedblocks(),
        "pymalloc": pymalloc_stats(),
        "gc_objects": sum(types.values()),
        "gc_types": types.most_common(TOP),
        "modules": len(sys.modules),
        "caps": caps_state(),
        "tracemalloc": traced,
    }
    (directory / f"{os.getpid()}-{number}.json").write_text(json.dumps(data, indent=1))


def install(directory: str) -> None:
    """Write a report on every ``SIGUSR2`` to this process."""
    path = Path(directory)
    count = 0

    def on_signal(*_: Any) -> None:
        nonlocal count
        count += 1
        report(path, count)

    signal.signal(signal.SIGUSR2, on_signal)
