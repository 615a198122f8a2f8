"""The results contract: schema, whole-or-absent appends under a lock, refusal of foreign or cut files, and
the committed results, which must stay readable and appendable as they are."""
import csv
import multiprocessing
import os
import subprocess
import sys

import pytest

from Utils.results import schema, store
from Utils.results.schema import RUN_COLUMNS, STEP_COLUMNS
from Utils.results.schema import RUNS_FILE, STEPS_FILE
from Utils.results.store import ResultsError, append_run, check_prefix, init_files


def _run(run_id, status="ok", **extra):
    return {"run_id": run_id, "optimization": "baseline", "status": status, "message": "", **extra}


def _steps(run_id, n):
    return [{"run_id": run_id, "optimization": "baseline", "step": i, "warmup": i == 0, "step_ms": 10.0 + i,
             "tokens_per_s": 100.0, "loss": 5.0, "mfu": None} for i in range(n)]


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_design_columns_are_present():
    for col in ["run_id", "optimization", "step", "warmup", "step_ms", "tokens_per_s", "loss", "mfu"]:
        assert col in STEP_COLUMNS
    for col in ["run_id", "optimization", "status", "message", "started_at", "steps", "batch_size", "seq_len",
                "model", "n_params", "data", "device", "gpu_name", "torch_version", "cuda_version", "compile_s",
                "peak_mem_allocated_gib", "peak_mem_reserved_gib", "median_step_ms", "iqr_step_ms",
                "median_tokens_per_s", "mfu", "final_loss"]:
        assert col in RUN_COLUMNS


def test_append_writes_header_once_and_keeps_old_bytes(tmp_path):
    append_run(tmp_path, _run("a"), _steps("a", 3))
    before = (tmp_path / "results.csv").read_bytes()
    append_run(tmp_path, _run("b"), _steps("b", 2))
    after = (tmp_path / "results.csv").read_bytes()
    assert after.startswith(before)
    rows = _read(tmp_path / "results.csv")
    assert [r["run_id"] for r in rows] == ["a"] * 3 + ["b"] * 2
    assert [r["warmup"] for r in rows[:3]] == ["1", "0", "0"]
    assert rows[0]["mfu"] == ""
    assert after.count(b"run_id,optimization,step") == 1
    assert [r["run_id"] for r in _read(tmp_path / "runs.csv")] == ["a", "b"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_unknown_status_is_refused(tmp_path):
    with pytest.raises(ValueError):
        append_run(tmp_path, _run("a", status="great"), [])
    assert not (tmp_path / "runs.csv").exists()


@pytest.mark.parametrize("content,why", [
    (b"a,b,c\n1,2,3\n", "header"),
    (",".join(STEP_COLUMNS).encode() + b"\nx,baseline,0,1,10", "middle of a row"),
    (",".join(STEP_COLUMNS).encode() + b"\nx,baseline,0\n", "fields"),
])
def test_damaged_results_file_is_refused_and_left_alone(tmp_path, content, why):
    (tmp_path / "results.csv").write_bytes(content)
    with pytest.raises(ResultsError, match=why):
        check_prefix(tmp_path)
    with pytest.raises(ResultsError, match=why):
        append_run(tmp_path, _run("a"), _steps("a", 2))
    assert (tmp_path / "results.csv").read_bytes() == content
    assert not (tmp_path / "runs.csv").exists()


def test_unwritable_prefix_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ResultsError, match="cannot be written"):
        check_prefix(blocker / "out")


def test_init_files_writes_headers_and_never_touches_existing(tmp_path):
    init_files(tmp_path)
    assert (tmp_path / "results.csv").read_text().strip().split(",") == STEP_COLUMNS
    append_run(tmp_path, _run("a"), _steps("a", 1))
    before = (tmp_path / "runs.csv").read_bytes()
    init_files(tmp_path)
    assert (tmp_path / "runs.csv").read_bytes() == before


def _append_many(prefix, tag, n):
    for i in range(n):
        append_run(prefix, _run(f"{tag}{i}"), _steps(f"{tag}{i}", 20))


def test_concurrent_appends_keep_every_row(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), tag, 15)) for tag in "xyz"]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    check_prefix(tmp_path)
    runs = _read(tmp_path / "runs.csv")
    steps = _read(tmp_path / "results.csv")
    assert sorted(r["run_id"] for r in runs) == sorted(f"{t}{i}" for t in "xyz" for i in range(15))
    assert len(steps) == 3 * 15 * 20
    assert {r["run_id"] for r in steps} == {r["run_id"] for r in runs}


# ---------------------------------------------------------------------------------------------
# The schema, and the committed results it must keep reading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = sorted(os.path.join(REPO, "results", d) for d in os.listdir(os.path.join(REPO, "results"))
                   if os.path.isfile(os.path.join(REPO, "results", d, schema.RUNS_FILE)))
FILES = [(schema.STEPS_FILE, schema.STEP_COLUMNS, schema.STEP_NUMERIC),
         (schema.RUNS_FILE, schema.RUN_COLUMNS, schema.RUN_NUMERIC),
         (schema.BREAKDOWN_FILE, schema.BREAKDOWN_COLUMNS, schema.BREAKDOWN_NUMERIC),
         (schema.KERNELS_FILE, schema.KERNEL_COLUMNS, schema.KERNEL_NUMERIC)]


def test_schema_is_consistent():
    for _, columns, numeric in FILES:
        assert len(set(columns)) == len(columns)
        assert set(numeric) <= set(columns)
    assert set(schema.MATCH_KEYS) <= set(schema.RUN_COLUMNS)
    assert all(c.meaning for table in (schema.STEP_SCHEMA, schema.RUN_SCHEMA, schema.BREAKDOWN_SCHEMA,
                                       schema.KERNEL_SCHEMA) for c in table)


def test_there_are_committed_results_to_check():
    assert len(COMMITTED) >= 3


@pytest.mark.parametrize("folder", COMMITTED, ids=os.path.basename)
def test_committed_results_are_read_with_the_schema(folder):
    from Utils.results.read import load, read_table
    for name, columns, numeric in FILES:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            assert f.readline().rstrip("\n").split(",") in schema.known_headers(columns).values(), path
        frame = read_table(path, columns, numeric)
        assert list(frame.columns) == columns
        assert len(frame) > 0 and all(frame[c].dtype == float for c in numeric)
    steps, runs = load(folder)
    assert len(steps) > 0 and len(runs) > 0
    assert set(runs["status"]) <= set(schema.STATUSES)


@pytest.mark.parametrize("folder", COMMITTED[:2], ids=os.path.basename)
def test_committed_results_are_appended_to_as_they_are(folder, tmp_path):
    """A file of an earlier schema version keeps every row and cell; its header widens to today's."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in (schema.STEPS_FILE, schema.RUNS_FILE):
        (copy / name).write_bytes(open(os.path.join(folder, name), "rb").read())
    before = {name: _csv_rows(copy / name) for name in (schema.STEPS_FILE, schema.RUNS_FILE)}
    append_run(copy, _run("new"), _steps("new", 2))
    for name, columns in ((schema.STEPS_FILE, STEP_COLUMNS), (schema.RUNS_FILE, RUN_COLUMNS)):
        old, after = before[name], _csv_rows(copy / name)
        assert after[0] == columns
        assert len(after) > len(old)
        for old_row, new_row in zip(old[1:], after[1:]):
            assert new_row[:len(old_row)] == old_row and not any(new_row[len(old_row):])
        assert after[-1][columns.index("schema_version")] == str(schema.SCHEMA_VERSION)


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_schema_versions_only_add_columns_at_the_end():
    for table in (schema.STEP_SCHEMA, schema.RUN_SCHEMA, schema.BREAKDOWN_SCHEMA, schema.KERNEL_SCHEMA,
                  schema.PEAK_SCHEMA):
        since = [c.since for c in table]
        assert since == sorted(since) and max(since) <= schema.SCHEMA_VERSION
        versions = list(schema.headers(table).values())
        assert all(later[:len(earlier)] == earlier for earlier, later in zip(versions, versions[1:]))
    # today's header is today's version, also for a file the latest version left alone (kernels.csv came in 6)
    assert schema.header_version(RUN_COLUMNS, RUN_COLUMNS) == schema.SCHEMA_VERSION


@pytest.mark.parametrize("change", ["a renamed column", "a dropped column", "an extra column"])
def test_a_header_of_no_version_is_refused(tmp_path, change):
    v1 = schema.headers(schema.RUN_SCHEMA)[1]
    header = {"a renamed column": ["id"] + v1[1:], "a dropped column": v1[:-1],
              "an extra column": v1 + ["my_column"]}[change]
    raw = (",".join(header) + "\n").encode()
    (tmp_path / "runs.csv").write_bytes(raw)
    with pytest.raises(ResultsError, match="header"):
        append_run(tmp_path, _run("new"), _steps("new", 2))
    assert (tmp_path / "runs.csv").read_bytes() == raw


def test_store_command_line(tmp_path, capsys):
    assert store.main(["init", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "runs.csv").read_text().strip().split(",") == RUN_COLUMNS
    assert store.main(["init"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: python -m Utils.results.store init: the one command is "
                                                    "init PREFIX, e.g. python -m Utils.results.store init ./out"]
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "runs.csv").write_text("a,b\n")
    assert store.main(["init", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("config,additions", [
    ('{"run": {}, "additions": ["tf32", "bf16"]}', ["tf32", "bf16"]),
    ('{"run": {}, "peer": "llmc"}', None),             # a peer records no additions
    ('{"run": {}, "recipe": "fused"}', None),          # an older row's config
    ("", None), ("{not json", None), ("[1, 2]", None),
])
def test_the_additions_a_run_recorded(config, additions):
    from Utils.results.read import recorded_additions
    assert recorded_additions({"config": config}) == additions


@pytest.mark.parametrize("name", ["results.csv", "runs.csv"])
def test_a_folder_where_a_results_file_goes_is_one_error(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(ResultsError) as err:
        append_run(tmp_path, _run("new"), _steps("new", 2))
    assert str(err.value) == f"{tmp_path / name} is not a file: move it aside or use another PREFIX"
    assert store.main(["init", str(tmp_path)]) == 2
    from Utils.results.read import load
    with pytest.raises(ResultsError) as err:   # what the report reads: not "not found", which names no fix
        load(tmp_path)
    assert str(err.value) == f"{tmp_path / name} is not a file: move it aside or use another PREFIX"


def test_a_file_with_windows_line_endings_is_appended_to_in_its_own(tmp_path):
    # A spreadsheet or an editor may save the files with CRLF endings: its bytes are kept, the new rows end alike.
    init_files(tmp_path)
    append_run(tmp_path, _run("old"), _steps("old", 2))
    before = {}
    for name in ("results.csv", "runs.csv"):
        path = tmp_path / name
        before[name] = path.read_bytes().replace(b"\n", b"\r\n")
        path.write_bytes(before[name])
    append_run(tmp_path, _run("new"), _steps("new", 2))
    for name in ("results.csv", "runs.csv"):
        raw = (tmp_path / name).read_bytes()
        assert raw.startswith(before[name]) and raw.count(b"\n") == raw.count(b"\r\n")
    assert [r[0] for r in _csv_rows(tmp_path / "runs.csv")[1:]] == ["old", "new"]


@pytest.mark.parametrize("name", ["results.csv", "runs.csv"])
def test_a_cell_the_report_cannot_read_is_refused_before_a_run(tmp_path, name):
    # Right number of fields, but a number column holds text: a run appended to it would end with charts that
    # cannot be drawn, so it is refused before training, as the report would refuse it after.
    init_files(tmp_path)
    append_run(tmp_path, _run("old"), _steps("old", 2))
    rows = _csv_rows(tmp_path / name)
    column = "warmup" if name == "results.csv" else "median_step_ms"
    rows[1][rows[0].index(column)] = "abc"
    with open(tmp_path / name, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    raw = {n: (tmp_path / n).read_bytes() for n in ("results.csv", "runs.csv")}
    with pytest.raises(ResultsError) as err:
        check_prefix(tmp_path)
    assert str(err.value) == (f"{tmp_path / name} line 2: {column}='abc' is not a number: the file is damaged; "
                              f"move it aside or repair that line")
    assert {n: (tmp_path / n).read_bytes() for n in raw} == raw


def test_the_signals_that_stop_a_run_are_held_back_while_its_rows_are_appended(tmp_path, monkeypatch):
    import signal

    from Utils.results import store
    masks, write = [], store._append_all

    def spy(appends):
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return write(appends)
    monkeypatch.setattr(store, "_append_all", spy)
    append_run(tmp_path, _run("a"), _steps("a", 2))
    assert store.STOPPING <= masks[0]   # SIGINT, SIGTERM, SIGHUP and SIGQUIT wait until both files are written
    assert not store.STOPPING & signal.pthread_sigmask(signal.SIG_BLOCK, [])   # and arrive once they are


def _bytes(folder) -> dict:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if not name.startswith(".res")}


def test_a_run_whose_second_file_cannot_be_renamed_leaves_both_files_as_they_were(tmp_path, monkeypatch):
    # runs.csv made append-only or locked: results.csv's rename has happened, runs.csv's fails. The steps must go
    # back, and nothing of the write may stay behind.
    from Utils.results import store
    append_run(tmp_path, _run("a"), _steps("a", 3))
    before = _bytes(tmp_path)
    replace, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if os.path.basename(dst) == RUNS_FILE and os.path.basename(src).startswith(store.TEMPORARY_PREFIX):
            raise PermissionError(1, "Operation not permitted", dst)
        return replace(src, dst)
    monkeypatch.setattr(store.os, "replace", second_fails)
    with pytest.raises(PermissionError):
        append_run(tmp_path, _run("b"), _steps("b", 2))
    assert _bytes(tmp_path) == before
    assert [n for n in os.listdir(tmp_path) if n.startswith(".") and n != ".results.lock"] == []


@pytest.mark.parametrize("kill_after", ["first_rename", "second_rename"])
def test_an_append_killed_between_its_renames_is_finished_by_the_next(tmp_path, kill_after):
    # kill -9 inside the append: a child process stops dead right after one of the two renames.
    append_run(tmp_path, _run("a"), _steps("a", 3))
    before = _bytes(tmp_path)
    code = f"""
import os, sys
from Utils.results import store
replace, n = os.replace, [0]
def dies(src, dst):
    replace(src, dst)
    n[0] += 1
    if n[0] == {1 if kill_after == "first_rename" else 2}:
        os._exit(9)
store.os.replace = dies
sys.path.insert(0, {repr(os.path.dirname(__file__))})
from test_results import _run, _steps
store.append_run({str(tmp_path)!r}, _run("b"), _steps("b", 2))
"""
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert child.returncode == 9, child.stderr
    append_run(tmp_path, _run("c"), _steps("c", 1))   # finishes the killed append first, under the lock
    runs = [r["run_id"] for r in _read(tmp_path / RUNS_FILE)]
    steps = sorted({r["run_id"] for r in _read(tmp_path / STEPS_FILE)})
    whole = ["a", "b", "c"] if kill_after == "second_rename" else ["a", "c"]
    assert runs == whole and steps == whole   # no run without its steps, no steps without their run
    assert [n for n in os.listdir(tmp_path) if n.startswith(".") and n != ".results.lock"] == []
    assert set(before) <= set(_bytes(tmp_path))
