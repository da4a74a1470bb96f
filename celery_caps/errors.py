"""The one exception tree of celery-caps.

Every error the library raises derives from :class:`CapsError`.  Configuration
mistakes (a bad ``Cap``, an unknown store URL, a missing ``caps_url``) are
:class:`ConfigurationError`; a key function misbehaving is :class:`CapKeyError`;
anything the store's driver raises is wrapped in :class:`StoreError` with the
driver error chained as ``__cause__``; an input no store can keep is
:class:`StoreInputError`.
"""

from __future__ import annotations


class CapsError(Exception):
    """Root of every celery-caps error."""


class ConfigurationError(CapsError, ValueError):
    """A cap, a setting or a store URL is invalid; the message names the value."""


class MissingDependencyError(ConfigurationError, ImportError):
    """An optional extra is needed for the configured store; the message names it."""


class CapKeyError(CapsError, ValueError):
    """A cap's key or limit function raised, or returned something that is not a usable key or
    limit (a positive int)."""


class StoreInputError(CapsError, ValueError):
    """A store was asked something it cannot keep (an empty or over-long name, a control
    character or a lone surrogate, a limit below 1, a lease that is not a finite positive
    number); the message names the value.  Never a reason to try again: admission fails the
    task rather than put it back."""


class StoreError(CapsError):
    """The slot store could not be reached or failed an operation: try again later.

    The driver's own exception is chained (``raise StoreError(...) from exc``);
    the message never contains store credentials.
    """


class LeaseLost(CapsError):
    """A running task's slot lease expired or was deleted under it (``caps_on_lease_lost="stop"``).

    Raised in the task's own thread: by :meth:`~celery_caps.CappedTask.caps_still_held`
    when it finds the lease gone, or injected by the lease keeper at the task's next
    Python instruction.  The task fails with it; its room may already belong to another task.
    """


class CapWaitExceeded(CapsError):
    """A task waited longer than ``caps_max_wait_seconds`` for its caps and gave up."""

    def __init__(self, task_name: str, task_id: str, waited_seconds: float, slots: list[str]) -> None:
        self.task_name = task_name
        self.task_id = task_id
        self.waited_seconds = waited_seconds
        self.slots = list(slots)
        # The constructor's arguments, as ``args``: Celery's JSON result serializer
        # stores ``args`` and rebuilds the error with ``cls(*args)``.
        super().__init__(task_name, task_id, waited_seconds, self.slots)

    def __str__(self) -> str:
        return (
            f"task {self.task_name}[{self.task_id}] waited {self.waited_seconds:.1f} s for caps "
            f"{', '.join(self.slots)} and gave up (caps_max_wait_seconds)"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, float, list[str]]]:
        # Celery pickles exceptions into the result backend; keep them rebuildable.
        return (type(self), (self.task_name, self.task_id, self.waited_seconds, self.slots))


class UnpublishableTask(CapsError):
    """A parked task whose message could not be published again: it failed, alone, with this.

    Stored as the task's ``FAILURE`` result (a deploy changed the task's signature so that its
    arguments no longer fit, its serializer is not installed, its payload cannot be read).
    """

    def __init__(self, task_name: str, task_id: str, reason: str) -> None:
        self.task_name = task_name
        self.task_id = task_id
        self.reason = reason
        super().__init__(task_name, task_id, reason)

    def __str__(self) -> str:
        return (
            f"waiting task {self.task_name}[{self.task_id}] could not be handed its slot: its message cannot be "
            f"published again ({self.reason}); it is failed and its slot given to the next waiter"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return (type(self), (self.task_name, self.task_id, self.reason))


class TaskIdInUse(CapsError):
    """A task was sent with the id of another task that waits for its caps (a reused task id).

    The waiting task keeps its place; this copy fails with this error rather than be taken for
    a copy of it and dropped.  Give every task an id of its own.
    """

    def __init__(self, task_name: str, task_id: str, slots: list[str]) -> None:
        self.task_name = task_name
        self.task_id = task_id
        self.slots = list(slots)
        super().__init__(task_name, task_id, self.slots)

    def __str__(self) -> str:
        return (
            f"task {self.task_name}[{self.task_id}] (caps {', '.join(self.slots)}) was not run: another task with "
            "the same task id waits for its caps; send each task with an id of its own"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, list[str]]]:
        return (type(self), (self.task_name, self.task_id, self.slots))
