"""Appending to the results files: PREFIX/results.csv (a row per step) and PREFIX/runs.csv (a row per run),
with the columns of Utils.results.schema.

Rows are only ever appended. An append is whole or absent: the new rows are written next to the file
with the old bytes in front of them and renamed over it, under an exclusive lock, with the signals that stop a
run held back (STOPPING), so neither a Ctrl-C nor a second run appending at once can tear a row. A file written
by an earlier schema version (Utils.results.schema) is widened to today's header in the same rename, its
rows kept and the new columns blank. A file whose header is no version's, or that ends mid-row, is refused
with a one-line error and left as it is.

    python -m Utils.results.store init PREFIX     (make init_results PREFIX=dir): empty results files
"""
import contextlib
import csv
import fcntl
import io
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from Utils.results.files import TEMPORARY_PREFIX, loop_error, real_path, split_bom, stage
from Utils.results.schema import (LOCK_FILE, PEAK_COLUMNS, PEAK_FILE, PEAK_NUMERIC, RUN_COLUMNS, RUN_NUMERIC, RUNS_FILE,
                                  SCHEMA_VERSION, STATUSES, STEP_COLUMNS, STEP_NUMERIC, STEPS_FILE, header_version,
                                  known_headers, row_version)

# The signals that stop a run: a run handles them (Utils.train.interrupts), the driver passes them on
# (Utils.suite.process), and an append holds them back until a run's rows are written.
STOPPING = frozenset(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                     if hasattr(signal, name))

Row = Mapping[str, object]


class ResultsError(Exception):
    """A results file that cannot be trusted or written; the message is one line and names the fix."""


def check_file(path: str | os.PathLike, columns: Sequence[str], numeric: Sequence[str] = ()) -> list[str] | None:
    """Raise ResultsError unless `path` is absent, empty, or a complete file with the header of some schema
    version of `columns` (schema.known_headers) whose cells in the `numeric` columns are blank or numbers, as the
    report reads them (Utils.results.read.read_table); return that header, or None for an absent or empty file."""
    if not os.path.exists(path):
        return None
    if not os.path.isfile(path):
        raise ResultsError(f"{path} is not a file: move it aside or use another PREFIX")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ResultsError(f"cannot read {path} ({e.strerror}): fix its permissions or use another PREFIX") from None
    if not split_bom(raw)[1]:   # empty, or a spreadsheet's save of nothing
        return None
    name = os.path.basename(path)
    if not raw.endswith(b"\n"):
        raise ResultsError(f"{path} ends in the middle of a row (cut off?): move it aside or repair it; "
                           f"it was not changed")
    try:
        rows = list(csv.reader(io.StringIO(split_bom(raw)[1].decode("utf-8"))))   # a spreadsheet's mark is no cell
    except (UnicodeDecodeError, csv.Error) as e:
        raise ResultsError(f"{path} is not a readable CSV ({e}): move it aside; it was not changed")
    header = rows[0]
    if header not in known_headers(columns).values():
        if len(header) > len(columns) and header[:len(columns)] == list(columns):   # a later schema adds columns
            raise ResultsError(f"{path} was written by a newer version of the suite (more columns than schema "
                               f"version {SCHEMA_VERSION}'s): update this checkout, or use another PREFIX; "
                               f"it was not changed")
        raise ResultsError(f"{path} has a header that is not the suite's {name} header: "
                           f"use another PREFIX or move the file aside; it was not changed")
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ResultsError(f"{path} line {i} has {len(row)} fields, expected {len(header)}: "
                               f"the file is damaged; move it aside; it was not changed")
    for col in (c for c in numeric if c in header):
        at = header.index(col)
        for i, row in enumerate(rows[1:], start=2):
            if not _is_number(row[at]):
                raise ResultsError(f"{path} line {i}: {col}={row[at].strip()!r} is not a number: the file is damaged; "
                                   f"move it aside or repair that line")
    if "schema_version" in header:
        _check_versions(path, header_version(list(columns), header), header.index("schema_version"), rows)
    return header


def _check_versions(path: str | os.PathLike, newest: int, at: int, rows: list[list[str]]) -> None:
    """Each row's schema_version names a version that writes the file's header (`newest` or earlier: a widened
    file keeps its older rows' versions); a later one is a row that was never written under this header."""
    for i, row in enumerate(rows[1:], start=2):
        version = row_version(row[at])
        if version is None:
            raise ResultsError(f"{path} line {i}: schema_version={row[at].strip()!r} is not a schema version (1 to "
                               f"{SCHEMA_VERSION}): the file is damaged; move it aside or repair that line; it was not "
                               f"changed")
        if version > newest:
            fix = ("a newer version of the suite wrote that row: update this checkout, or move the file aside"
                   if version > SCHEMA_VERSION else
                   "that row was not written under this header (files joined or edited by hand): move the file "
                   "aside, or give the row the header's version")
            raise ResultsError(f"{path} line {i}: the row is schema version {version} but the file's header is "
                               f"schema version {newest}'s: {fix}; it was not changed")


def _is_number(cell: str) -> bool:
    """Blank, NaN or a float's text: what the report's reader takes for a number."""
    try:
        float(cell.strip() or "nan")
    except ValueError:
        return False
    return True


def check_prefix(prefix: str | os.PathLike) -> None:
    """Make PREFIX if needed and prove it writable and its files ours, before any training starts."""
    loop = loop_error(prefix)   # else named as "File exists" by makedirs
    if loop:
        raise ResultsError(loop)
    try:
        os.makedirs(prefix, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=prefix, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ResultsError(f"PREFIX={prefix} cannot be written ({e.strerror}): choose a folder you can write to")
    check_files(prefix)


def check_files(prefix: str | os.PathLike) -> None:
    """Raise ResultsError unless PREFIX's results files, and its peak.csv, are absent or whole files of the suite
    that the report can read (check_file): a run then never appends to a file whose charts cannot be drawn."""
    check_file(os.path.join(prefix, STEPS_FILE), STEP_COLUMNS, STEP_NUMERIC)
    check_file(os.path.join(prefix, RUNS_FILE), RUN_COLUMNS, RUN_NUMERIC)
    check_file(os.path.join(prefix, PEAK_FILE), PEAK_COLUMNS, PEAK_NUMERIC)


@contextmanager
def _locked(prefix, hold_signals: bool = True) -> Iterator[None]:
    """PREFIX's lock, exclusive; hold_signals: the stopping signals held back meanwhile (an append's two files)."""
    fd = os.open(os.path.join(prefix, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING) if hold_signals else None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


@contextmanager
def writing(prefix: str | os.PathLike) -> Iterator[None]:
    """While the report writes its files into PREFIX (the charts, summary.md, compare.md, the breakdown): the
    folder's lock, so that no append and no other report writes meanwhile, and first every temporary file that a
    write killed before its rename (kill -9) left there removed. Signals are not held back: a write they stop
    removes its own temporary file (Utils.results.files.write_atomic)."""
    with _locked(prefix, hold_signals=False):
        _remove_stale_temporaries(prefix)
        yield


def _format(rows, columns):
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", extrasaction="raise")
    for row in rows:
        cells = {k: _cell(row.get(k)) for k in columns}
        if "schema_version" in cells:
            cells["schema_version"] = str(SCHEMA_VERSION)
        writer.writerow(cells)
    return buf.getvalue()


def _line_end(old: bytes) -> str:
    """The line ending of a file's header: "\r\n" where a spreadsheet or an editor saved it so, else "\n"."""
    return "\r\n" if old.split(b"\n", 1)[0].endswith(b"\r") else "\n"


def _widened(old: bytes, columns) -> bytes:
    """A file of an earlier schema version (its header a prefix of `columns`) with today's header, each row
    given blank cells for the columns added since, in the file's own line endings."""
    rows = list(csv.reader(io.StringIO(old.decode("utf-8"))))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator=_line_end(old))
    writer.writerow(columns)
    for row in rows[1:]:
        writer.writerow(row + [""] * (len(columns) - len(row)))
    return buf.getvalue().encode("utf-8")


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return "" if value != value else f"{value:.6g}"
    return str(value)


def _stage(path, columns, text):
    """Old bytes + new rows, written beside `path` (Utils.results.files.stage); the temporary file's path. A byte
    order mark a spreadsheet's save put in front stays there, before the header."""
    old = b""
    if os.path.exists(path):
        with open(path, "rb") as f:
            old = f.read()
    bom, old = split_bom(old)
    end = _line_end(old)   # new rows end as the file's own do, so that its bytes are only appended to
    if old and not old.startswith((",".join(columns) + end).encode()):
        old = _widened(old, columns)   # check_file has proved it an earlier version's
    text = text.replace("\n", end) if end != "\n" else text
    header = b"" if old else (",".join(columns) + "\n").encode()
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
    return stage(path, lambda f: f.write(bom + old + header + text.encode()), mode=mode)


# Before the renames of one append, each file's bytes as they were (a hard link, where the file system has them,
# else a copy; an empty .absent file where there was none), so that the append lands whole or not at all.
BACKUP_PREFIX = ".before-append-"


def _backup(path: str) -> str:
    return os.path.join(os.path.dirname(path), BACKUP_PREFIX + os.path.basename(path))


def _keep_before(path: str) -> None:
    """The file at `path` as it is, under its backup name (path's own file, through a symbolic link)."""
    target, backup = real_path(path), _backup(path)
    if not os.path.exists(target):
        open(backup + ".absent", "wb").close()
        return
    try:
        os.link(target, backup)
    except OSError:   # a file system without hard links: a copy, written in full before it is named
        with open(target, "rb") as source:
            os.replace(stage(backup, lambda f: shutil.copyfileobj(source, f)), backup)


def _kept(path: str) -> str | None:
    """Where the file at `path` is as its backup kept it: the backup, None where there was no file, or the file
    itself where it has no backup."""
    backup = _backup(path)
    return None if os.path.exists(backup + ".absent") else backup if os.path.exists(backup) else path


def _cut(paths: Sequence[str]) -> bool:
    """Whether an append of these files left its backups: it was killed between its renames, and the next
    append has not settled it yet (_finish_interrupted_append)."""
    return any(os.path.exists(_backup(p)) or os.path.exists(_backup(p) + ".absent") for p in paths)


def _restore(path: str) -> None:
    """Put the file at `path` back as its backup kept it."""
    target, backup = real_path(path), _backup(path)
    if os.path.exists(backup + ".absent"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        os.unlink(backup + ".absent")
    elif os.path.exists(backup):
        os.replace(backup, target)


def _forget(path: str) -> None:
    for name in (_backup(path), _backup(path) + ".absent"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _landed(path: str) -> bool:
    """Whether the last rename of the append the backups belong to happened: `path` no longer holds its backup's
    bytes (an append only adds rows)."""
    target, backup = real_path(path), _backup(path)
    if os.path.exists(backup + ".absent"):
        return os.path.exists(target)
    return not _same_bytes(target, backup)


def _same_bytes(a: str, b: str) -> bool:
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def _finish_interrupted_append(paths: Sequence[str]) -> None:
    """Under the lock, an append killed between its renames (kill -9, a lost host) left its backups: where its
    last file had landed the append was whole, and the backups go; else every file goes back as it was."""
    if not _cut(paths):
        return
    whole = _landed(paths[-1])
    for path in paths:
        (_forget if whole else _restore)(path)
    print(f"note: {os.path.dirname(paths[0]) or '.'}: an append killed midway was "
          f"{'kept whole' if whole else 'undone'}", file=sys.stderr)


@contextmanager
def reading(prefix: str | os.PathLike) -> Iterator[dict[str, str | None]]:
    """While a reader reads PREFIX's results: a live append finishes first (the lock, shared), and the path to read
    for each of results.csv and runs.csv, or None where the file is to be read as absent. An append killed between
    its renames (kill -9) leaves its backups until the next append settles it; where its last file had not landed,
    the run is not whole, and each file is read as it was kept before the append."""
    paths = [os.path.join(prefix, name) for name in (STEPS_FILE, RUNS_FILE)]
    chosen: dict[str, str | None] = dict(zip((STEPS_FILE, RUNS_FILE), paths))
    try:
        fd = os.open(os.path.join(prefix, LOCK_FILE), os.O_RDONLY)
    except OSError:   # no append ever took the lock here (or the folder is not one): nothing to wait for
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        if _cut(paths) and not _landed(paths[-1]):
            chosen = {name: _kept(path) for name, path in chosen.items()}
        yield chosen
    finally:
        if fd is not None:
            os.close(fd)   # closing the descriptor releases the lock


def _replace_all(staged):
    """Rename each staged temporary file over its file, the files as they were kept first: a rename that fails
    (a file made append-only or immutable, a folder locked) puts back the ones already renamed, and a kill
    between the renames is finished by the next append (_finish_interrupted_append). Every file was written in
    full before the first rename, so a write that fails (a full disk, a file size limit) changes nothing."""
    if len(staged) == 1:   # one rename is whole by itself
        os.replace(staged[0][0], real_path(staged[0][1]))
        return
    paths = [path for _, path in staged]
    for path in paths:
        _keep_before(path)
    try:
        for tmp, path in staged:
            os.replace(tmp, real_path(path))
    except BaseException:
        for path in paths:
            _restore(path)
        raise
    finally:
        for path in paths:
            _forget(path)


def _append_all(appends):
    """[(path, columns, text)] appended whole, all or none."""
    staged = []
    try:
        for path, columns, text in appends:
            staged.append((_stage(path, columns, text), path))
        _replace_all(staged)
    finally:
        for tmp, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _remove_stale_temporaries(prefix):
    """Under the lock no one else is writing into PREFIX (every write there takes it: the appends, the report's
    files): a temporary file there was left by a write killed before its rename (kill -9). Removed, saying so."""
    for name in sorted(os.listdir(prefix)):
        if name.startswith(TEMPORARY_PREFIX):
            os.unlink(os.path.join(prefix, name))
            print(f"note: removed {os.path.join(prefix, name)}, left by a write that was killed", file=sys.stderr)


def append_rows(prefix: str | os.PathLike, name: str, columns: Sequence[str], rows: Iterable[Row]) -> None:
    """Append rows to PREFIX/name (a CSV with `columns`) under the same lock and checks as the results."""
    path = os.path.join(prefix, name)
    with _locked(prefix):
        _remove_stale_temporaries(prefix)
        check_file(path, columns)
        _append_all([(path, columns, _format(rows, columns))])


def append_run(prefix: str | os.PathLike, run: Row, steps: Sequence[Row]) -> None:
    """Append one run's step rows and its run row, both or neither."""
    if run.get("status") not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {run.get('status')!r}")
    steps_path = os.path.join(prefix, STEPS_FILE)
    runs_path = os.path.join(prefix, RUNS_FILE)
    with _locked(prefix):
        _remove_stale_temporaries(prefix)
        _finish_interrupted_append([steps_path, runs_path])
        check_file(steps_path, STEP_COLUMNS)
        check_file(runs_path, RUN_COLUMNS)
        appends = [(steps_path, STEP_COLUMNS, _format(steps, STEP_COLUMNS))] if steps or not os.path.exists(steps_path) else []
        _append_all(appends + [(runs_path, RUN_COLUMNS, _format([run], RUN_COLUMNS))])


def init_files(prefix: str | os.PathLike) -> None:
    """Create PREFIX with empty results files (headers only); existing files are checked, never touched."""
    check_prefix(prefix)
    with _locked(prefix):
        for name, columns in ((STEPS_FILE, STEP_COLUMNS), (RUNS_FILE, RUN_COLUMNS)):
            path = os.path.join(prefix, name)
            if not os.path.exists(path) or os.path.getsize(path) == 0:
                _append_all([(path, columns, "")])


def main(argv: Sequence[str] | None = None) -> int:
    """`init PREFIX`: create PREFIX's empty results files. Returns the exit code (2: bad usage or PREFIX)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 2 or argv[0] != "init":
        print(f"error: python -m Utils.results.store {' '.join(argv)}: the one command is init PREFIX, e.g. "
              f"python -m Utils.results.store init ./out", file=sys.stderr)
        return 2
    try:
        init_files(argv[1])
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{os.path.join(argv[1], STEPS_FILE)} and {RUNS_FILE} are ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
