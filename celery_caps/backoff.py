"""Backoff: put a task back to the broker with a countdown (``caps_strategy = "backoff"``).

A task whose caps are full is *put back*: the same message (id, arguments, headers,
routing, priority, links, chord membership) is published again with a countdown
(exponential backoff with jitter), then the running copy ends with ``Ignore`` so that
nothing is stored and no retry is used up.  The copy is published before the
original is acknowledged: a worker dying in between causes a duplicate, never a loss.

The put-back itself (:func:`celery_caps.messages.put_back`) is shared with park, which
falls back to it when it cannot park (a full waiting list, a store error under
``caps_on_store_error = "defer"``), and uses for the message of a task parked without it (over
``caps_park_max_payload_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .caps import Needs
from .errors import StoreError
from .messages import deferrals_of, on_store_error, put_back, seconds_waited

if TYPE_CHECKING:
    from .runtime import CapsRuntime
    from .task import CappedTask


def admit(
    task: CappedTask,
    runtime: CapsRuntime,
    request: Any,
    needs: Needs,
    holder: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str | None:
    """Backoff's admission: the run id holding the slots the task ``needs``; or put the task back
    (``Ignore``).  None: the task runs uncapped (``caps_on_store_error = "run"``)."""
    slots = needs.slots
    try:
        admission, run_id = runtime.acquire(
            slots, request.id, holder, task_name=task.name, deferrals=deferrals_of(request), weights=needs.weights
        )
    except StoreError as exc:
        on_store_error(task, runtime, request, slots, args, kwargs, exc)
        return None
    runtime.health.answered()
    if not admission.granted:
        put_back(task, runtime, request, slots, list(admission.full_slots), args, kwargs)
    runtime.metrics.admitted(slots, seconds_waited(request))
    return run_id
