"""The results contract: schema, whole-or-absent appends under a lock, refusal of foreign or cut files."""
import csv
import multiprocessing
import os

import pytest

from Utils import results
from Utils.results import RUN_COLUMNS, STEP_COLUMNS, ResultsError, append_run, check_prefix, init_files


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
    results.check_prefix(tmp_path)
    runs = _read(tmp_path / "runs.csv")
    steps = _read(tmp_path / "results.csv")
    assert sorted(r["run_id"] for r in runs) == sorted(f"{t}{i}" for t in "xyz" for i in range(15))
    assert len(steps) == 3 * 15 * 20
    assert {r["run_id"] for r in steps} == {r["run_id"] for r in runs}
