"""Whole-or-absent file writes, for every file the suite writes."""
import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """Call write(f) on a temporary file beside `path`, then rename it over `path`: a reader, a crash or a
    Ctrl-C sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
