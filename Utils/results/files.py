"""Whole-or-absent file writes, for every file the suite writes; and what a path or a file's first bytes can hold
that no write of the suite put there (a symbolic link loop, a spreadsheet's byte order mark)."""
import codecs
import contextlib
import errno
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

# What a write leaves behind if it is killed (kill -9) before its rename: named for the suite, so that removing
# what the suite left (the next write under the folder's lock, make clean) never takes another program's file.
TEMPORARY_PREFIX = ".tmp-gpt-suite-"


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


def symlink_loop(path: str | os.PathLike) -> str | None:
    """The leading part of `path` that is a symbolic link loop (ln -s a b; ln -s b a), or None where `path` passes
    through none. The system names only the whole path ("too many levels of symbolic links"), and a write into it
    fails as if the folder existed ("File exists"), so the part that loops is found here, to be named."""
    path = os.fspath(path)
    try:
        os.stat(path)
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            return None
    parts = path.split(os.sep)
    for i in range(1, len(parts) + 1):
        part = os.sep.join(parts[:i])
        if not part.strip(os.sep):   # the root ("/") or an empty part ("a//b") cannot loop
            continue
        try:
            os.stat(part)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return part
    return path


def loop_error(path: str | os.PathLike, subject: str = "") -> str | None:
    """The one-line refusal of a folder (PREFIX, OUT, a word of PREFIXES) whose path is or passes through a symbolic
    link loop, None where it is neither; `subject` begins the sentence (default: PREFIX=path)."""
    loop = symlink_loop(path)
    if loop is None:
        return None
    path = os.fspath(path)
    whole = loop == (path.rstrip(os.sep) or os.sep)
    where = "is a symbolic link loop" if whole else f"passes through {loop}, a symbolic link loop"
    return (f"{subject or f'PREFIX={path}'} {where} (links that lead back to each other; ls -l shows where each "
            f"points): remove or repoint the links, or choose another folder")
