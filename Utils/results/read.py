"""Reading the results files back as pandas frames, with the columns of Utils.results.schema: the numeric
ones as floats (a blank cell is NaN), the others as text ('' when blank). A damaged file is refused with a
one-line error naming the file, the line and the fix; nothing is guessed or dropped silently. A run that is not
whole (step rows without their run row, or an ok run row without its steps: an append of an earlier version cut
between the two files) is named, a line a run, and left out of the frames; the files are never changed."""
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import pandas as pd

from Utils.results.files import loop_error, split_bom
from Utils.results.schema import (PEAK_COLUMNS, PEAK_FILE, PEAK_NUMERIC, RUN_COLUMNS, RUN_DEFAULTS, RUN_NUMERIC, RUNS_FILE,
                                  STEP_COLUMNS, STEP_NUMERIC, STEPS_FILE)
from Utils.results.store import ResultsError, check_file, reading


def read_table(path: str | os.PathLike, columns: Sequence[str], numeric: Sequence[str]) -> pd.DataFrame:
    """The CSV at `path` as a frame in file order (index 0..n-1) with every one of `columns`, after
    check_file(path, columns): a file of an earlier schema version has the columns added since blank.

    Raises ResultsError when the file is foreign or cut off, or holds a cell in a `numeric` column that is
    neither blank nor a number (check_file, which a run's own check shares), or is unreadable."""
    check_file(path, columns, numeric)
    try:
        # utf-8-sig: a spreadsheet's byte order mark is no part of the first column's name
        df = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False, encoding="utf-8-sig")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path} is not a readable CSV ({str(e).splitlines()[0]}): move it aside")
    df = df.reindex(columns=list(columns), fill_value="")
    if list(columns) == RUN_COLUMNS:
        for col, value in RUN_DEFAULTS.items():   # rows written before the column existed
            df.loc[df[col] == "", col] = value
    for col in numeric:   # check_file has proved every cell blank or a number
        df[col] = df[col].str.strip().replace("", "nan").astype(float)
    return df.reset_index(drop=True)


def _first_run_hint(prefix):
    return f"run a rung first, e.g. make baseline STEPS=20 BATCH_SIZE=8 PREFIX={prefix}"


class Partial(NamedTuple):
    """A run that is not whole in a results folder: its rows in one file, and none in the other that it needs."""
    run_id: str
    optimization: str
    file: str                     # STEPS_FILE (step rows without their run row) or RUNS_FILE (an ok run, no steps)
    rows: int                     # its rows in that file


def partial_runs(steps: pd.DataFrame, runs: pd.DataFrame) -> list[Partial]:
    """The runs of load()'s frames that are not whole, in file order: step rows whose run_id has no row in runs.csv,
    and runs.csv rows of status ok (every step ran) whose run_id has no step rows. A run of another status may have
    no steps (skipped, oom, stopped before its first step) and is whole without them."""
    found = []
    lone = steps[~steps["run_id"].isin(set(runs["run_id"]))]
    for run_id, rows in lone.groupby("run_id", sort=False):
        found.append(Partial(str(run_id), " ".join(dict.fromkeys(rows["optimization"])), STEPS_FILE, len(rows)))
    stepless = runs[(runs["status"] == "ok") & ~runs["run_id"].isin(set(steps["run_id"]))]
    for run_id, rows in stepless.groupby("run_id", sort=False):
        found.append(Partial(str(run_id), " ".join(dict.fromkeys(rows["optimization"])), RUNS_FILE, len(rows)))
    return found


def whole_runs(steps: pd.DataFrame, runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list[Partial]]:
    """(steps, runs) without the rows of the partial_runs, each frame indexed 0..n-1 again, and those runs."""
    partial = partial_runs(steps, runs)
    left_out = {name: {p.run_id for p in partial if p.file == name} for name in (STEPS_FILE, RUNS_FILE)}
    steps = steps[~steps["run_id"].isin(left_out[STEPS_FILE])].reset_index(drop=True)
    runs = runs[~((runs["status"] == "ok") & runs["run_id"].isin(left_out[RUNS_FILE]))].reset_index(drop=True)
    return steps, runs, partial


def partial_line(prefix: str | os.PathLike, p: Partial) -> str:
    """The one line that names a partial run, its rows, and what became of them."""
    run = f"run {p.run_id or '(blank)'} ({p.optimization or 'no name'})"
    if p.file == STEPS_FILE:
        what = (f"{p.rows} step row{'s' * (p.rows != 1)} of {run} have no row in {RUNS_FILE} (an append of an "
                f"earlier version cut between the two files)")
    else:
        what = f"{run} is recorded ok with no step rows in {STEPS_FILE}"
    return (f"warning: {os.path.join(prefix, p.file)}: {what}: left out of the charts, the summary and comparisons; "
            f"the file is left as it is")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _empty(path: str) -> bool:
    """No bytes, or only a spreadsheet's byte order mark (its save of an empty sheet)."""
    with open(path, "rb") as f:
        return not split_bom(f.read(8))[1]


def load(prefix: str | os.PathLike, warn: Callable[[str], None] = _to_stderr) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read PREFIX/results.csv and PREFIX/runs.csv and return (steps_df, runs_df) of the whole runs: each run that
    is not (partial_runs) is named by a line to `warn` (stderr) and left out of both frames.

    steps_df: a row per step with STEP_COLUMNS; run_id and optimization are str, and step, warmup,
    step_ms, tokens_per_s, loss, mfu are floats (a blank cell is NaN).
    runs_df: a row per run with RUN_COLUMNS in file order, oldest first (rows are appended as runs
    end, so the last row is the newest); the columns in RUN_NUMERIC are floats (blank -> NaN), the
    others str ('' when blank). The index is 0..n-1 in that order.

    Raises ResultsError, whose message is one line naming the file and the fix, when PREFIX is a symbolic link loop,
    a file is missing, empty, cut off mid-row, has a foreign header or a row of a version its header is not, or no
    whole run is recorded. Step rows are not judged here: NaN or non-positive step times are the business of the
    report's run selection.
    """
    loop = loop_error(prefix)
    if loop:
        raise ResultsError(loop)
    if os.path.exists(prefix) and not os.path.isdir(prefix):
        raise ResultsError(f"PREFIX={prefix} is a file, not a folder: pass the folder the runs wrote into")
    steps_path, runs_path = os.path.join(prefix, STEPS_FILE), os.path.join(prefix, RUNS_FILE)
    for path in (steps_path, runs_path):
        if os.path.exists(path) and not os.path.isfile(path):
            raise ResultsError(f"{path} is not a file: move it aside or use another PREFIX")
    with reading(prefix) as paths:   # an append cut between its two files is read as if it had not begun
        steps_read, runs_read = paths[STEPS_FILE], paths[RUNS_FILE]
        if steps_read is None or not os.path.isfile(steps_read):
            raise ResultsError(f"{steps_path} not found: {_first_run_hint(prefix)}")
        if _empty(steps_read):
            raise ResultsError(f"{steps_path} is empty: {_first_run_hint(prefix)}")
        steps = read_table(steps_read, STEP_COLUMNS, STEP_NUMERIC)
        if runs_read is None or not os.path.isfile(runs_read):
            raise ResultsError(f"{runs_path} not found: each run records itself there when it ends; "
                               f"{_first_run_hint(prefix)}")
        runs = read_table(runs_read, RUN_COLUMNS, RUN_NUMERIC)
    if runs.empty:
        raise ResultsError(f"{runs_path} records no runs: {_first_run_hint(prefix)}")
    steps, runs, partial = whole_runs(steps, runs)
    for p in partial:
        warn(partial_line(prefix, p))
    if runs.empty:
        raise ResultsError(f"{runs_path} records no whole run (the partial ones are named above): "
                           f"{_first_run_hint(prefix)}")
    return steps, runs


def load_peak(prefix: str | os.PathLike) -> pd.DataFrame | None:
    """PREFIX/peak.csv (make peak's measurements, oldest first), or None where no peak was measured there: MFU
    then has its datasheet denominator only. Raises ResultsError for a foreign or damaged file (read_table)."""
    path = os.path.join(prefix, PEAK_FILE)
    if not os.path.exists(path):
        return None
    return read_table(path, PEAK_COLUMNS, PEAK_NUMERIC)


def measured_peak(peaks: pd.DataFrame | None, gpu_name: str, gpu_uuid: str = "") -> pd.Series | None:
    """The latest measurement for a run's GPU: of the same card (gpu_uuid) where one was measured, since cards
    of one name differ by their cooling, power limit and memory clock; else of a card of the same name; else
    None."""
    if peaks is None or peaks.empty:
        return None
    for column, value in (("gpu_uuid", gpu_uuid), ("gpu_name", gpu_name)):
        same = peaks[peaks[column] == value] if value else None
        if same is not None and not same.empty:
            return same.iloc[-1]
    return None


def _recorded_config(run: Mapping) -> dict:
    """A runs.csv row's config column as a dict; empty where it holds none (a peer's run, a row older than the
    column, a damaged cell)."""
    try:
        config = json.loads(str(run.get("config", "")))
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def recorded_seed(run: Mapping) -> int | None:
    """The seed a runs.csv row recorded in its config column (the model's init and synthetic data); None where
    it recorded none (a peer's run, a row older than the column, a damaged cell)."""
    settings = _recorded_config(run).get("run")
    seed = settings.get("seed") if isinstance(settings, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def recorded_additions(run: Mapping, ran: bool = False) -> list[str] | None:
    """The additions a runs.csv row recorded in its config column; with `ran`, without those that noted what
    ran instead on that machine (fell_back: FP8 in bf16 on a GPU without FP8, TF32 on a CPU). None where it
    recorded none (a peer's run, a row older than the column, a damaged cell)."""
    config = _recorded_config(run)
    additions = config.get("additions")
    if not isinstance(additions, list):
        return None
    fell_back = set(config.get("fell_back") or ()) if ran else set()
    return [str(a) for a in additions if a not in fell_back]
