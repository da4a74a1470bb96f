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
)
from .runtime import warm_up
from .task import CappedTask

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
    "warm_up",
]
__version__ = "0.1.0"
