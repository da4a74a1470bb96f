"""Time PostgreSQL's admission function alone: 4a775de's against this tree's, interleaved.

Each database (``caps_probe_old``, made by a store of 4a775de; ``caps_probe``, by this tree's)
holds three live leases of slot ``probe`` (limit 10); each call admits a new task id, whose lease
is deleted again before the next.  Prints the median milliseconds of 2,000 calls per round.
"""

from __future__ import annotations

import statistics
import time
import uuid

import psycopg


def median_ms(database: str, new: bool, calls: int = 2000) -> float:
    with psycopg.connect(f"postgresql://postgres@127.0.0.1/{database}", autocommit=True) as connection:
        cursor = connection.cursor()
        arguments = ", NULL, '')" if new else ")"
        statement = "SELECT concurrency_slots_acquire(ARRAY['probe'], ARRAY[10], %s, %s, 'h', 60.0, 'n'" + arguments
        seconds = []
        for number in range(calls):
            run_id = uuid.uuid4().hex
            started = time.perf_counter()
            cursor.execute(statement, (f"x{number}", run_id))  # type: ignore[arg-type]
            cursor.fetchone()
            seconds.append(time.perf_counter() - started)
            cursor.execute("DELETE FROM concurrency_slots WHERE run_id = %s", (run_id,))
        return statistics.median(seconds) * 1000


if __name__ == "__main__":
    for round_number in range(3):
        old = median_ms("caps_probe_old", new=False)
        new = median_ms("caps_probe", new=True)
        print(f"round {round_number}: old {old:.3f} ms, new {new:.3f} ms, ratio {new / old:.2f}")
