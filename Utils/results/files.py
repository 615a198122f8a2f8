"""Whole-or-absent file writes, for every file the suite writes; and the byte order mark a spreadsheet's save puts
in front of a file, which no write of the suite does."""
import codecs
import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

TEMPORARY_PREFIX = ".tmp-"   # what a write leaves behind if it is killed (kill -9) before its rename


def stage(path: str | os.PathLike, write: Callable[[BinaryIO], object], mode: int = 0o644) -> str:
    """Call write(f) on a temporary file beside the file `path` names (through a symbolic link, beside its
    target), flushed to disk; returns the temporary file's path, for `os.replace(tmp, real_path(path))`."""
    target = real_path(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=TEMPORARY_PREFIX,
                               suffix=os.path.splitext(target)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def real_path(path: str | os.PathLike) -> str:
    """The file a path names: a results file that is a symbolic link is written through the link, never
    replaced by a plain file."""
    return os.path.realpath(path)


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """Call write(f) on a temporary file beside `path`, then rename it over `path`: a reader, a crash or a
    Ctrl-C sees the old file or the new one, never half of one."""
    tmp = stage(path, write, mode)
    try:
        os.replace(tmp, real_path(path))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# A spreadsheet saving "CSV UTF-8" (Excel, Numbers) puts this mark before the first cell; it is no part of the header.
UTF8_BOM = codecs.BOM_UTF8


def split_bom(raw: bytes) -> tuple[bytes, bytes]:
    """(the UTF-8 byte order mark `raw` begins with, or b""; the bytes after it)."""
    return (UTF8_BOM, raw[len(UTF8_BOM):]) if raw.startswith(UTF8_BOM) else (b"", raw)

