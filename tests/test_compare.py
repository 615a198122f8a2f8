"""make compare and Utils/report/compare.py on results folders written here by the real writer: the ratio across
folders and its interval, statuses in place of numbers, what differs between folders, results written before
schema version 2, bad input, and the files."""
import contextlib
import io
import os

import numpy as np
import pytest
from matplotlib.figure import Figure

from conftest import clean_env, make, rewrite_as_version_1, sticks_out
from Utils.report.compare import COMPARE_MD, COMPARE_PNG, compare_folders, folder_labels, main, plot_compare
from Utils.results.read import load
from Utils.results.schema import RUN_SCHEMA, STEP_SCHEMA, headers
from Utils.results.store import append_run

OUTPUTS = (COMPARE_MD, COMPARE_PNG)
CONFIG = dict(batch_size=16, seq_len=1024, model="gpt2", data="shakespeare", device="cuda", gpu_name="NVIDIA H200",
              torch_version="2.11.0", cuda_version="13.0", git_commit="0123456789abcdef")
# Measured step times rounded as results.csv stores them (6 significant digits); folder B's tf32 run takes
# exactly half of each of A's, so that the ratio of their medians is 2.
RNG = np.random.default_rng(3)
BASE_MS = np.round(RNG.normal(100.0, 2.0, 30), 2)
TF32_MS = np.round(RNG.normal(50.0, 1.0, 30), 2)


def add_run(prefix, rung, measured_ms=(), status="ok", message="", **config):
    """Append one run (one warm-up step, then measured_ms) through the real writer."""
    os.makedirs(prefix, exist_ok=True)
    runs = os.path.join(prefix, "runs.csv")
    run_id = f"{rung}-{status}-{sum(1 for _ in open(runs)) if os.path.exists(runs) else 0}"
    ms = [900.0, *measured_ms] if measured_ms is not None and len(measured_ms) else []
    steps = [dict(run_id=run_id, optimization=rung, step=i, warmup=i == 0, step_ms=m, tokens_per_s=1.0,
                  loss=5.0, mfu=0.3) for i, m in enumerate(ms)]
    append_run(prefix, dict(run_id=run_id, optimization=rung, status=status, message=message,
                            started_at="2026-01-01T00:00:00+00:00", steps=len(ms), warmup_steps=1, n_params=124e6,
                            **{**CONFIG, **config}), steps)


def two_folders(root, b_config=None):
    """Folder A (an H200) and folder B (an H100 from another commit, tf32 twice as fast); A's flash run ran out
    of memory, B has no flash run but a fused+loss run A lacks."""
    a, b = os.path.join(root, "machines", "h200"), os.path.join(root, "machines", "h100")
    a_config = dict(gpu_uuid="GPU-1111", driver_version="570.86", sm_clock_mhz_median=1980, power_w_median=699)
    b_config = dict(gpu_name="NVIDIA H100 80GB HBM3", git_commit="fedcba9876543210-dirty", **(b_config or {}))
    add_run(a, "baseline", BASE_MS, **a_config)
    add_run(a, "tf32", TF32_MS, **a_config)
    add_run(a, "flash", [], status="oom", message="CUDA out of memory", **a_config)
    add_run(b, "baseline", BASE_MS, **b_config)
    add_run(b, "tf32", TF32_MS / 2, **b_config)
    add_run(b, "fused+loss", TF32_MS / 3, **b_config)
    return a, b


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def table(text):
    """compare.md's first table as {rung: {column header: cell text}}."""
    lines = text.split("\n\n| ", 1)[1].split("\n\n")[0].splitlines()
    lines[0] = "| " + lines[0]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {r[0]: dict(zip(header, r)) for r in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])}


def section(text, title):
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return two_folders(str(tmp_path_factory.mktemp("compare")))


@pytest.fixture(scope="module")
def comparison(folders):
    return compare_folders(folders)


def test_a_folder_twice_as_fast_gives_a_ratio_of_two_with_an_interval_around_it(comparison):
    assert comparison.labels == ["h200", "h100"]
    tf32 = comparison.cell("tf32", "h100")
    assert tf32["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert tf32["ratio_lo"] < 2.0 < tf32["ratio_hi"]
    assert tf32["median_step_ms"] == pytest.approx(np.median(TF32_MS) / 2, rel=1e-4)
    assert tf32["speedup"] == pytest.approx(np.median(BASE_MS) / np.median(TF32_MS / 2), rel=1e-4)
    assert comparison.cell("tf32", "h200")["speedup"] == pytest.approx(np.median(BASE_MS) / np.median(TF32_MS),
                                                                        rel=1e-4)
    assert comparison.cell("baseline", "h100")["ratio"] == pytest.approx(1.0, rel=1e-4)
    assert comparison.cell("tf32", "h200")["ratio"] == 1.0


def test_a_rung_missing_or_not_ok_in_a_folder_shows_its_status_and_no_number(comparison):
    assert comparison.rungs == ["baseline", "tf32", "flash", "fused+loss"]
    for rung, label, status in (("flash", "h200", "oom"), ("flash", "h100", "not run"),
                                ("fused+loss", "h200", "not run")):
        cell = comparison.cell(rung, label)
        assert cell["status"] == status
        assert np.isnan(cell[["median_step_ms", "speedup", "ratio", "ratio_lo", "ratio_hi"]].astype(float)).all()
    assert np.isnan(comparison.cell("fused+loss", "h100")["ratio"])   # no ok run in the first folder
    assert np.isfinite(comparison.cell("fused+loss", "h100")["median_step_ms"])


def test_the_provenance_says_what_differs_and_what_is_the_same(comparison):
    assert {"gpu_name", "git_commit", "gpu_uuid", "driver_version", "sm_clock_mhz_median",
            "power_w_median"} <= set(comparison.differs)
    assert {"torch_version", "cuda_version", "batch_size", "seq_len", "model", "data"} <= set(comparison.same)
    a, b = comparison.provenance
    assert (a["gpu_name"], b["gpu_name"]) == ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
    assert (a["git_commit"], b["git_commit"]) == ("0123456789ab", "fedcba987654-dirty")
    assert (a["sm_clock_mhz_median"], a["power_w_median"]) == ("1980 MHz", "699 W")
    assert b["gpu_uuid"] == b["sm_clock_mhz_median"] == a["cudnn_version"] == "unknown"
    assert comparison.warnings == []


def test_compare_md_and_png_are_written_and_the_table_printed(folders, tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = run_main(["--out", out, *folders])
    assert rc == 0, err
    text = (out / COMPARE_MD).read_text()
    assert stdout.startswith(text) and "wrote compare.md, compare.png into" in stdout
    assert (out / COMPARE_PNG).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    rows = table(text)
    assert list(rows) == ["baseline", "tf32", "flash", "fused+loss"]
    assert rows["tf32"]["h100 vs h200"].startswith("2.00x [")
    assert rows["flash"]["h200 ms"] == "oom" and rows["flash"]["h100 ms"] == "not run"
    assert rows["flash"]["h100 vs h200"] == "-"
    differs = section(text, "What differs")
    assert "| gpu_name " in differs and "NVIDIA H100 80GB HBM3" in differs
    assert "| git_commit " in differs and "fedcba987654-dirty" in differs
    assert "torch_version 2.11.0" in differs.split("The same in every folder:", 1)[1]
    assert "h200: flash (oom): CUDA out of memory" in section(text, "Notes")
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def test_out_defaults_to_the_first_folder(tmp_path):
    a, b = two_folders(str(tmp_path))
    assert run_main([a, b])[0] == 0
    assert os.path.isfile(os.path.join(a, COMPARE_MD)) and os.path.isfile(os.path.join(a, COMPARE_PNG))
    assert not os.path.exists(os.path.join(b, COMPARE_MD))


def test_different_work_is_compared_under_a_warning(tmp_path):
    a, b = two_folders(str(tmp_path), b_config=dict(batch_size=32, seq_len=512))
    rc, stdout, _ = run_main(["--out", tmp_path / "out", a, b])
    assert rc == 0
    warnings = [ln for ln in stdout.splitlines() if "warning:" in ln]
    assert len(warnings) == 1
    assert "batch_size 16 in h200, 32 in h100" in warnings[0] and "seq_len 1024 in h200, 512 in h100" in warnings[0]
    assert "model" not in warnings[0]
    assert "2.00x" in table(stdout)["tf32"]["h100 vs h200"]


def _drop_new_columns(loaded):
    """load()'s frames as a reader that keeps only a file's own columns gives them for version-1 files."""
    steps, runs = loaded
    return steps[headers(STEP_SCHEMA)[1]], runs[headers(RUN_SCHEMA)[1]]


def test_frames_without_the_version_2_columns_still_compare(tmp_path, monkeypatch):
    a, b = two_folders(str(tmp_path))
    monkeypatch.setattr("Utils.report.compare.load", lambda prefix: _drop_new_columns(load(prefix)))
    c = compare_folders([a, b])
    assert c.cell("tf32", "h100")["ratio"] == pytest.approx(2.0, rel=1e-3)
    for p in c.provenance:
        for key in ("gpu_uuid", "driver_version", "cudnn_version", "sm_clock_mhz_median", "power_w_median"):
            assert p[key] == "unknown"
    assert "gpu_name" in c.differs and "gpu_uuid" in c.same


def test_version_1_files_still_compare(tmp_path):
    a, b = two_folders(str(tmp_path))
    rewrite_as_version_1(b)
    with open(os.path.join(b, "runs.csv")) as f:
        assert f.readline().strip().split(",") == headers(RUN_SCHEMA)[1]
    rc, stdout, err = run_main(["--out", tmp_path / "out", a, b])
    assert rc == 0, err
    assert table(stdout)["tf32"]["h100 vs h200"].startswith("2.00x")
    differs = section(stdout, "What differs")
    assert "| gpu_uuid " in differs and "Recorded in no folder: cudnn_version" in differs
    # Version 1 timed each step alone: the two folders' step times are not the same measurement.
    assert "| step_timing " in differs and "step_timing end to end in h200, around each step in h100" in stdout


BAD_INPUTS = {
    "one folder": (lambda a, b, tmp: [a], "at least two results folders, got 1"),
    "a folder named twice": (lambda a, b, tmp: [a, b, os.path.join(a, ".")], "named twice"),
    "a missing folder": (lambda a, b, tmp: [a, os.path.join(tmp, "nowhere")], "results.csv not found"),
    "a foreign results file": (lambda a, b, tmp: [a, _foreign(tmp)], "header that is not the suite's"),
    "an unwritable OUT": (lambda a, b, tmp: ["--out", _file(tmp) + "/out", a, b], "cannot write into OUT="),
    "an empty OUT": (lambda a, b, tmp: ["--out", " ", a, b], "OUT is empty"),
    "no folder": (lambda a, b, tmp: [], "the following arguments are required"),
}


def _foreign(tmp):
    os.makedirs(os.path.join(tmp, "foreign"))
    with open(os.path.join(tmp, "foreign", "results.csv"), "w") as f:
        f.write("a,b,c\n1,2,3\n")
    return os.path.join(tmp, "foreign")


def _file(tmp):
    path = os.path.join(tmp, "a-file")
    with open(path, "w") as f:
        f.write("x")
    return path


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, case):
    a, b = two_folders(str(tmp_path))
    argv, expected = BAD_INPUTS[case][0](a, b, str(tmp_path)), BAD_INPUTS[case][1]
    rc, out, err = run_main(argv)
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err + out
    written = [os.path.join(root, n) for root, _, names in os.walk(tmp_path) for n in names
               if n in OUTPUTS or n.startswith(".tmp-")]
    assert not written


def test_a_chart_that_cannot_be_written_leaves_the_old_files_whole(tmp_path, monkeypatch):
    a, b = two_folders(str(tmp_path))
    assert run_main([a, b])[0] == 0
    before = {n: open(os.path.join(a, n), "rb").read() for n in OUTPUTS}

    def disk_full(self, fname, **kwargs):
        fname.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    rc, _, err = run_main([a, b])
    assert rc == 2 and err.startswith(f"error: cannot write into OUT={a}") and err.count("\n") == 1
    assert {n: open(os.path.join(a, n), "rb").read() for n in OUTPUTS} == before
    assert not [n for n in os.listdir(a) if n.startswith(".tmp-")]




def test_the_chart_carries_every_folders_provenance_whole(tmp_path):
    root = os.path.join(str(tmp_path), "a-rather-long-folder-name-for-the-results-of-one-machine")
    a, b = two_folders(root)
    c_path = os.path.join(root, "machines", "b200-with-another-driver")
    add_run(c_path, "baseline", BASE_MS / 1.5, gpu_name="NVIDIA B200", driver_version="580.1")
    c = compare_folders([a, b, c_path])
    fig = plot_compare(c)
    foot = fig.get_supxlabel().replace("\n", " ")
    for label, prefix in zip(c.labels, c.prefixes):
        assert f"{label} = {prefix}:" in foot
    assert "GPU NVIDIA H100 80GB HBM3" in foot and "commit fedcba987654-dirty" in foot and "power 699 W" in foot
    assert "95% bootstrap interval" in foot
    assert not sticks_out(fig)
    assert c.cell("baseline", "b200-with-another-driver")["ratio"] == pytest.approx(1.5, rel=1e-3)


def test_labels_are_the_shortest_ends_that_tell_folders_apart():
    assert folder_labels(["r/h200/b16", "r/h100/b16"]) == ["h200/b16", "h100/b16"]
    assert folder_labels(["r/before-b16", "q/after-b16"]) == ["before-b16", "after-b16"]


def _make_env():
    return {k: v for k, v in clean_env().items() if k not in ("PREFIXES", "OUT")}


def test_make_compare_end_to_end(tmp_path):
    a, b = two_folders(str(tmp_path))
    out = tmp_path / "out"
    done = make(["compare", f"PREFIXES={a} {b}", f"OUT={out}"], _make_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2.00x [" in table(done.stdout)["tf32"]["h100 vs h200"]
    assert (out / COMPARE_MD).is_file() and (out / COMPARE_PNG).is_file()


@pytest.mark.parametrize("prefixes", [None, "", "   "])
def test_make_compare_refuses_no_prefixes(prefixes):
    args = ["compare"] + ([] if prefixes is None else [f"PREFIXES={prefixes}"])
    done = make(args, _make_env(), timeout=60)
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: PREFIXES is required")


def test_folders_over_different_process_counts_are_named_and_warned(tmp_path):
    a, b = two_folders(str(tmp_path), b_config=dict(nproc=2, parallel="ddp"))
    rc, stdout, err = run_main(["--out", tmp_path / "out", a, b])
    assert rc == 0, err
    differs = section(stdout, "What differs")
    assert "| nproc " in differs and "| parallel " in differs
    # A blank parallel is a single process: named as none, never as unknown.
    row = [ln for ln in differs.splitlines() if ln.startswith("| parallel ")]
    assert [c.strip() for c in row[0].split("|")[2:4]] == ["none", "ddp"] and "parallel none in h200" in stdout
    assert "warning: the folders ran different work (" in stdout and "nproc 1 in h200, 2 in h100" in stdout


def test_a_signal_while_compare_writes_its_chart_leaves_no_temporary_file_and_ends_128_plus_n(folders, tmp_path,
                                                                                                monkeypatch):
    import os
    import signal
    from matplotlib.figure import Figure
    out = tmp_path / "out"
    real_savefig = Figure.savefig

    def savefig_then_stopped(self, *args, **kwargs):   # the driver's SIGTERM, midway through the chart's bytes
        real_savefig(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Figure, "savefig", savefig_then_stopped)
    before = signal.getsignal(signal.SIGTERM)
    rc, stdout, err = run_main(["--out", out, *folders])
    assert rc == 128 + signal.SIGTERM and err == ""
    assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")] == []
    assert signal.getsignal(signal.SIGTERM) is before   # the handler is put back


def test_a_chart_left_half_written_by_kill_9_is_removed_by_the_next_write_into_the_folder(folders, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tmp-gpt-suite-k9x2.png").write_bytes(b"\x89PNG half")   # what kill -9 inside a chart's write leaves
    rc, stdout, err = run_main(["--out", out, *folders])
    assert rc == 0 and not (out / ".tmp-gpt-suite-k9x2.png").exists()
    assert f"note: removed {out / '.tmp-gpt-suite-k9x2.png'}, left by a write that was killed" in err
