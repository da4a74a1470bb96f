"""Fleet-wide concurrency caps for Celery tasks, backed by slot leases in SQL or Redis."""

from .caps import Cap
from .errors import (
    CapKeyError,
    CapsError,
    CapWaitExceeded,
    ConfigurationError,
    LeaseLost,
    MissingDependencyError,
    StoreError,
    StoreInputError,
    TaskIdInUse,
    UnpublishableTask,
)
from .limits import set_limit
from .runtime import warm_up
from .task import CappedTask

# Connects the worker's signal handlers (its start checks and steps, releases on shutdown and
# revoke) for every process that imports the package, as it did before the runtime moved out.
from . import worker as _worker  # noqa: F401  # isort: skip

__all__ = [
    "Cap",
    "CapKeyError",
    "CapWaitExceeded",
    "CappedTask",
    "CapsError",
    "ConfigurationError",
    "LeaseLost",
    "MissingDependencyError",
    "StoreError",
    "StoreInputError",
    "TaskIdInUse",
    "UnpublishableTask",
    "set_limit",
    "warm_up",
]
__version__ = "0.1.0"
