"""kombu's filesystem transport, with files that appear whole.

The demo runs its broker on plain files (``filesystem://``) so that it needs no
server.  kombu's transport creates a message file empty, then writes it: another
worker listing the folder in between takes the empty file, fails to decode it,
crashes and loses the message.  It creates an exchange's binding file the same
way, so workers starting together can read it empty (kombu issue #1551 shows the
same error).  Several worker processes share one folder here, so this subclass
writes each message to a hidden name and renames it into place (a rename is
atomic), and creates a binding file whole before updating it under kombu's lock.

Everything else, including how messages are taken (an atomic rename into the
processed folder, so only one worker gets each message), is kombu's own.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


def _write_whole(path: Path, data: bytes, *, replace: bool) -> None:
    """Make ``path`` appear with ``data`` in one step; with ``replace=False`` keep an existing file."""
    partial = path.with_name(f".partial-{uuid.uuid4()}")  # never matches a queue's "*.<queue>.msg"
    partial.write_bytes(data)
    try:
        if replace:
            os.replace(partial, path)
        else:
            os.link(partial, path)
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # The same name kombu gives a message (consumers take them in name order).
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        try:
            _write_whole(Path(self.data_folder_out) / name, str_to_bytes(dumps(payload)), replace=True)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(parents=True, exist_ok=True)
        if not file.exists():
            _write_whole(file, b"[]", replace=False)
        # The file exists now: kombu updates it under an exclusive lock.
        super()._queue_bind(exchange, routing_key, pattern, queue)


class Transport(filesystem.Transport):
    Channel = Channel
