"""`make plots`, `make init_results` and the breakdown report where torch cannot be imported: Utils/results and
Utils/report need only numpy, pandas and matplotlib. Each runs in a fresh interpreter in which `import torch`
fails."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

from Utils.results.schema import RUN_COLUMNS, STEP_COLUMNS
from Utils.results.store import append_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHARTS = ["speedup.png", "step_time.png", "throughput.png", "memory.png", "loss.png"]
CONFIG = dict(batch_size=4, seq_len=128, model="tiny", data="synthetic", device="cpu", gpu_name="cpu",
              torch_version="2.11.0", git_commit="0123456789ab", started_at="2026-01-01T00:00:00+00:00")


def without_torch(code):
    """Run `code` in a fresh interpreter, in the repository, with torch unimportable (a None entry in
    sys.modules makes `import torch` raise ImportError). The code's SystemExit code is its exit status; the
    last line printed says which torch modules were imported (none may be)."""
    program = textwrap.dedent("""
        import json, runpy, sys
        sys.modules["torch"] = None
        try:
        {code}
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        print(json.dumps([m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None]))
        sys.exit(status)
    """).format(code=textwrap.indent(textwrap.dedent(code).strip(), "    "))
    return subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300)


def _ladder(prefix):
    for rung, ms in (("baseline", 40.0), ("tf32", 20.0), ("fused+loss", 10.0)):
        steps = [dict(run_id=f"{rung}-1", optimization=rung, step=i, warmup=i == 0, step_ms=ms * (1 + 0.01 * (i % 2)),
                      tokens_per_s=4 * 128 / (ms / 1000), loss=5.0 - 0.1 * i, mfu=None) for i in range(6)]
        append_run(prefix, dict(run_id=f"{rung}-1", optimization=rung, status="ok", message="", steps=6,
                                warmup_steps=1, n_params=1e6, **CONFIG), steps)


def test_plot_results_runs_without_torch(tmp_path):
    _ladder(tmp_path)
    done = without_torch(f"""
        sys.argv = ["plot_results.py", "--prefix", {str(tmp_path)!r}]
        runpy.run_path("plot_results.py", run_name="__main__")
    """)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert "wrote speedup.png" in done.stdout
    for name in CHARTS:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
    summary = (tmp_path / "summary.md").read_text()
    assert "| fused+loss" in summary and "4.00x" in summary


def test_init_results_runs_without_torch(tmp_path):
    prefix = tmp_path / "new"
    done = without_torch(f"""
        sys.argv = ["store", "init", {str(prefix)!r}]
        runpy.run_module("Utils.results.store", run_name="__main__", alter_sys=True)
    """)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert (prefix / "results.csv").read_text() == ",".join(STEP_COLUMNS) + "\n"
    assert (prefix / "runs.csv").read_text() == ",".join(RUN_COLUMNS) + "\n"


def test_the_breakdown_report_is_written_without_torch(tmp_path):
    shutil.copy(os.path.join(REPO, "tests", "data", "trace_h200_fused_1step.json.gz"), tmp_path / "trace_fused.json.gz")
    done = without_torch(f"""
        from Utils.report import breakdown
        prefix = {str(tmp_path)!r}
        bd = breakdown.split(breakdown.load_trace(breakdown.trace_path(prefix, "fused")))
        breakdown.append_breakdown_csv(prefix, "fused", "fused-1", bd, median_step_ms=bd.step_ms)
        breakdown.write_report(prefix)
    """)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert (tmp_path / "breakdown.md").read_text().startswith("# Step-time breakdown: NVIDIA H200")
    assert (tmp_path / "breakdown.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
