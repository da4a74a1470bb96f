"""The sweep: a Celery task, ``celery_caps.sweep``, on the beat schedule by default.

It deletes expired leases (a crashed worker's slots) and old tombstones of the
waiting list, and keeps every sentinel.  It is housekeeping only: what keeps
waiting tasks moving runs in the workers (:class:`celery_caps.worker.Recovery`).
Running it from several beats at once is safe: each run deletes only rows that
are already expired, and deleting a row twice is a no-op.  It also warns when a
cap's number of keys passes ``caps_key_warning_threshold``: keys must come from
a bounded set, and each one keeps a permanent sentinel row.
"""

from __future__ import annotations

import logging

from .stores.base import SlotStore

logger = logging.getLogger(__name__)

SWEEP_TASK_NAME = "celery_caps.sweep"
SWEEP_SCHEDULE_NAME = "celery-caps sweep"


def sweep_store(store: SlotStore, key_warning_threshold: int) -> int:
    """Delete expired leases; warn about caps with too many keys.  Returns leases deleted."""
    deleted = store.sweep()
    if deleted:
        logger.info("celery-caps sweep: deleted %d expired lease(s)", deleted)
    # The store's count of keys per cap reads no lease and holds up no admission (never status()),
    # and stops past the threshold: its cost does not grow with the keys.
    for cap_name, keys in sorted(store.keys_per_cap(key_warning_threshold + 1).items()):
        if keys > key_warning_threshold:
            logger.warning(
                "cap %r has more than %d distinct keys (caps_key_warning_threshold): keys must come from a "
                "bounded set; each key keeps a row. Prune retired keys with `celery caps prune-keys`.",
                cap_name,
                key_warning_threshold,
            )
    return deleted
