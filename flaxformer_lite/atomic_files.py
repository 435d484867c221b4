"""Writing files so that a reader, or a crash, never sees a partial one."""

from __future__ import annotations

import os
import tempfile


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` through a temporary sibling that then replaces it.

    The bytes are flushed and fsynced before the rename, so after a crash
    `path` holds either its old content or all of the new one. The temporary
    file is removed when writing fails.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
