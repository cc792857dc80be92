"""kombu's filesystem transport with atomic message writes (the embedded Celery broker).

kombu's filesystem channel creates a message file, then locks and writes it, while a reader
moves away any file of its queue without taking the lock. A worker polling between the two
reads an empty message, fails to decode it and stops ("Unrecoverable error: JSONDecodeError"),
and the message is lost. That happens when beat or the API publishes while the embedded worker
polls. This channel writes each message under a hidden name and renames it into place, so a
reader only ever sees complete messages. Selected by `make_celery` for `filesystem://`.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from time import monotonic
from typing import Any

from kombu.transport import filesystem
from kombu.utils.json import dumps


class AtomicChannel(filesystem.Channel):
    # `_put` is how kombu's virtual transports enqueue (kombu 5 has no public hook for how the
    # filesystem transport writes a file); tests/test_library_seams.py fails if it moves
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        # A leading dot: kombu's reader takes only names whose text after the first dot is
        # "<queue>.msg", which a hidden name's text never is.
        fd, tmp = tempfile.mkstemp(dir=self.data_folder_out, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(tmp, os.path.join(self.data_folder_out, name))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


class AtomicFilesystemTransport(filesystem.Transport):
    Channel = AtomicChannel
