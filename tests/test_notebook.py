"""The notebook: it runs top to bottom on a CPU with a plain kernel and without torch, and the figures it
computes are the ones summary.md holds, for the committed H200 measurements and for a small set written here
(with a skipped rung, a GPU whose fp32 rate the GPU table lacks, and the optional companion files present).
Built twice against the same results it is the same bytes, and the kernel prints no transport warning. The
committed .ipynb must hold build_notebook.py's cells, executed."""
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys

import nbformat
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO, "notebooks")
if NOTEBOOKS not in sys.path:
    sys.path.insert(0, NOTEBOOKS)

import build_notebook  # noqa: E402
import plot_results  # noqa: E402
from Utils.ladder.registry import ADDITIONS  # noqa: E402
from Utils.results.schema import BREAKDOWN_COLUMNS, BREAKDOWN_FILE  # noqa: E402
from Utils.results.store import append_run  # noqa: E402
from conftest import clean_env, summary_table  # noqa: E402

H200 = os.path.join(REPO, "results", "h200-b16")
FIGURES_TAG = "NOTEBOOK_FIGURES "
REBUILD = "make notebook"

# summary.md's column -> the notebook's key; the notebook rounds as summary.md does.
COLUMNS = {"median ms": "median_step_ms", "IQR ms": "iqr_step_ms", "speedup": "speedup",
           "tokens/s": "tokens_per_s", "MFU": "mfu_pct", "peak alloc GiB": "peak_mem_allocated_gib",
           "peak reserved GiB": "peak_mem_reserved_gib", "compile s": "compile_s", "final loss": "final_loss"}


def cell_number(text):
    return None if text == "-" else float(text.rstrip("x%").replace(",", ""))


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def outputs_text(nb):
    return "".join(o.get("text", "") for c in code_cells(nb) for o in c.get("outputs", []) if o.output_type == "stream")


def notebook_figures(nb):
    lines = [ln for ln in outputs_text(nb).splitlines() if ln.startswith(FIGURES_TAG)]
    assert len(lines) == 1, f"expected one {FIGURES_TAG.strip()} line in the outputs, found {len(lines)}"
    return json.loads(lines[0][len(FIGURES_TAG):])


def assert_figures_match_summary(nb, prefix):
    expected = summary_table(prefix)
    figures = notebook_figures(nb)
    assert list(figures) == list(expected), "the notebook and summary.md list different rungs"
    for rung, row in expected.items():
        for header, key in COLUMNS.items():
            assert figures[rung][key] == cell_number(row[header]), \
                f"{rung} {header}: notebook {figures[rung][key]}, summary.md {row[header]} ({prefix})"
        assert figures[rung]["status"] == row["status"], rung


def assert_normalized(nb):
    """What makes a saved notebook depend on its cells and results only (build_notebook.normalize)."""
    assert nb.metadata["language_info"] == build_notebook.LANGUAGE_INFO
    assert [c["id"] for c in nb.cells] == [f"cell-{i:02d}" for i in range(len(nb.cells))]
    for cell in code_cells(nb):
        assert "execution" not in cell.metadata, "execution timing is recorded"
        streams = [o for o in cell.outputs if o.output_type == "stream"]
        assert all(o.name == "stdout" for o in streams), "stderr is saved"
        assert not any(a.output_type == b.output_type == "stream" for a, b in zip(cell.outputs, cell.outputs[1:]))


def no_torch_path(tmp_path):
    """A folder that, put first on PYTHONPATH, makes `import torch` fail as where torch is not installed."""
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed here (test)')\n")
    return str(blocker.parent)


def execute(tmp_path, results=None, without_torch=False):
    """Execute the committed notebook's cells (a copy in memory) in notebooks/ with RESULTS set, or unset when
    None; the executed copy is kept in tmp_path for a look when something fails."""
    nb = nbformat.read(build_notebook.NOTEBOOK, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "RESULTS"}
    if results is not None:
        env["RESULTS"] = results
    if without_torch:
        env["PYTHONPATH"] = os.pathsep.join([no_torch_path(tmp_path), REPO])
    build_notebook.execute(nb, cwd=NOTEBOOKS, env=env)
    nbformat.write(nb, str(tmp_path / "executed.ipynb"))
    errors = [o for c in code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    return nb


# ---------------------------------------------------------------------------------------------
# The committed notebook


def test_committed_notebook_holds_the_built_cells():
    committed = nbformat.read(build_notebook.NOTEBOOK, as_version=4)
    nbformat.validate(committed)
    built = build_notebook.build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], \
        f"notebooks/Optimizing_GPU_Utilization.ipynb differs from build_notebook.py: run {REBUILD}"


def test_committed_notebook_is_executed_without_errors():
    nb = nbformat.read(build_notebook.NOTEBOOK, as_version=4)
    code = code_cells(nb)
    assert all(c.execution_count for c in code), f"the committed notebook is not executed: run {REBUILD}"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), "no chart in the outputs"
    assert_normalized(nb)


def test_committed_outputs_match_the_committed_summary():
    nb = nbformat.read(build_notebook.NOTEBOOK, as_version=4)
    assert_figures_match_summary(nb, H200)


@pytest.mark.parametrize("name", ADDITIONS)
def test_the_notebook_shows_each_additions_text_from_the_registry(name):
    # Its own section where a rung is named after it, else its phrase in the max rung's list, and its reason.
    a = ADDITIONS[name]
    text = " ".join(" ".join(c.source.split()) for c in build_notebook.build().cells if c.cell_type == "markdown")
    for part in (f"### {name}: {a.title}" if a.title else "", *a.notebook, a.phrase, a.why):
        assert " ".join(part.split()) in text, part


def test_code_cells_are_short_calls():
    # The computations live in Utils.report (tested there); a cell only loads, computes and shows.
    for cell in code_cells(build_notebook.build()):
        assert not re.search(r"^\s*(def|class|for|while|with) ", cell.source, re.M), cell.source
        assert len(cell.source.splitlines()) <= 25, cell.source


# ---------------------------------------------------------------------------------------------
# Building it as make notebook does


@pytest.fixture(scope="module")
def built_twice(tmp_path_factory):
    """build_notebook.py run twice as `make notebook` runs it, at once, into two copies: (paths, [(returncode,
    stdout, stderr)])."""
    folder = tmp_path_factory.mktemp("built")
    paths = [str(folder / name) for name in ("first.ipynb", "second.ipynb")]
    procs = [subprocess.Popen([sys.executable, os.path.join(NOTEBOOKS, "build_notebook.py"), "--output", path],
                              cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for path in paths]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        runs.append((proc.returncode, out, err))
    return paths, runs


def test_building_twice_against_the_same_results_makes_the_same_bytes(built_twice):
    paths, runs = built_twice
    for returncode, out, err in runs:
        assert returncode == 0, out + err
        # ipykernel's warning over TCP; and the kernel's own, when it outlives the builder that started it.
        assert "TCP" not in err and "encryption" not in err and "Parent appears to have exited" not in err, err
    assert filecmp.cmp(*paths, shallow=False), "two builds against the same results differ"
    assert_normalized(nbformat.read(paths[0], as_version=4))


def test_the_committed_notebook_is_what_a_build_writes_today(built_twice):
    # Its outputs show source files and results: a change to either leaves the cells alone but the outputs stale. The
    # charts' bytes are left out: they may differ with the machine's fonts and libraries, not with what they show.
    def without_charts(path):
        nb = nbformat.read(path, as_version=4)
        for cell in code_cells(nb):
            for output in cell.outputs:
                output.get("data", {}).pop("image/png", None)
        return nb
    returncode, out, err = built_twice[1][0]
    assert returncode == 0, out + err
    built, committed = without_charts(built_twice[0][0]), without_charts(build_notebook.NOTEBOOK)
    stale = [i for i, (b, c) in enumerate(zip(built.cells, committed.cells)) if b != c]
    assert built == committed, (f"notebooks/Optimizing_GPU_Utilization.ipynb's outputs are stale (cells {stale}): "
                                f"run {REBUILD}")


def test_runs_on_the_h200_results_by_default(built_twice):
    nb = nbformat.read(built_twice[0][0], as_version=4)
    text = " ".join(outputs_text(nb).split())
    assert "RESULTS = results/h200-b16" in text
    assert_figures_match_summary(nb, H200)
    # The conclusions are computed: every measured rung gets a verdict naming the floor it sits against.
    for rung, row in summary_table(H200).items():
        if row["status"] == "ok":
            assert re.search(rf"\b{re.escape(rung)}: {re.escape(row['median ms'])} ms measured; compute floor .*? "
                             rf"sits against the (compute|memory) floor", text), rung
    # Every section found its companion set, and every rung's section printed its additions' code.
    assert "is absent" not in text and "No breakdown.csv" not in text
    for rung in ("tf32", "flash", "max"):
        assert f"# Utils/ladder/apply.py, apply_{rung if rung != 'max' else 'fp8_head'}" in text


BATCH, SEQ, GPU = 4, 256, "NVIDIA B200"     # B200: the GPU table has its bf16 rate, not its fp32 one


def add_run(prefix, rung, step_ms, status="ok", warmup=2, batch=BATCH, loss0=10.9, message="", compile_s=None,
            mem=(6.0, 7.0)):
    """Append one run through the suite's own writer."""
    os.makedirs(prefix, exist_ok=True)
    run_id = f"{rung}-{batch}-{len(step_ms)}-{status}-{len(os.listdir(prefix))}"
    steps = [dict(run_id=run_id, optimization=rung, step=i, warmup=i < warmup, step_ms=ms,
                  tokens_per_s=batch * SEQ / (ms / 1e3), loss=loss0 - 0.05 * i + 0.01 * np.sin(i), mfu=0.2)
             for i, ms in enumerate(step_ms)]
    run = dict(run_id=run_id, optimization=rung, status=status, message=message, started_at="2026-01-01T00:00:00",
               steps=len(step_ms), warmup_steps=warmup, batch_size=batch, seq_len=SEQ, model="gpt2",
               n_params=124439808, data="synthetic", device="cuda", gpu_name=GPU, torch_version="2.9.0",
               cuda_version="12.8", compile_s=compile_s, peak_mem_allocated_gib=mem[0],
               peak_mem_reserved_gib=mem[1], notes="", git_commit="abc123")
    append_run(prefix, run, steps)


def ladder(prefix, batch, steps=24, scale=1.0):
    rng = np.random.default_rng(batch)
    base = {"baseline": 300.0, "tf32": 140.0, "bf16": 120.0, "flash": 45.0, "fused": 43.0, "8bit": 50.0}
    for rung, ms in base.items():
        times = list(rng.normal(ms * scale, ms * scale * 0.02, steps).round(3))
        add_run(prefix, rung, [5 * times[0]] + times[1:], batch=batch,
                compile_s=20.0 if rung in ("flash", "fused", "8bit") else None,
                mem=(9.0, 10.0) if rung in ("baseline", "tf32", "bf16") else (5.0, 6.0))
    add_run(prefix, "torch_compile", [], status="skipped", batch=batch,
            message="torch.compile needs Triton for this GPU, and Triton is not installed")


@pytest.fixture(scope="module")
def small_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    prefix = str(root / "b200-b4")
    ladder(prefix, BATCH)
    add_run(prefix, "tf32", [100.0] * 6, batch=8)     # another batch size: excluded from the comparison
    with open(os.path.join(prefix, BREAKDOWN_FILE), "w") as f:
        f.write(",".join(BREAKDOWN_COLUMNS) + "\n")
        for rung, ms in (("baseline", 300.0), ("flash", 45.0), ("flash", 46.0)):   # flash profiled twice
            for cls, share in (("compute", 0.5), ("memory", 0.3), ("unknown", 0.0), ("overhead", 0.2)):
                row = dict(run_id=f"{rung}-{ms}", rung=rung, ms_per_step=ms * share, share=share,
                           profiled_step_ms=ms, median_step_ms=ms, profiled_steps=5, compute_tflops="",
                           peak_tflops="", **{"class": cls})
                f.write(",".join(str(row[c]) for c in BREAKDOWN_COLUMNS) + "\n")
    ladder(str(root / "b200-b64"), 64, scale=3.5)
    ladder(str(root / "b200-loss"), BATCH, steps=80)
    for folder in ("b200-b4", "b200-b64", "b200-loss"):
        assert plot_results.main(["--prefix", str(root / folder)]) == 0
    return prefix


def test_runs_without_torch_on_a_small_results_set_with_every_optional_part(small_results, tmp_path):
    nb = execute(tmp_path, results=small_results, without_torch=True)
    assert_figures_match_summary(nb, small_results)
    assert_normalized(nb)
    figures = notebook_figures(nb)
    assert figures["torch_compile"]["status"] == "skipped" and figures["torch_compile"]["median_step_ms"] is None
    text = outputs_text(nb)
    assert "NVIDIA B200 fp32      unknown" in text                      # the figure the GPU table lacks
    assert "fp32, tf32 unknown" in " ".join(text.split())
    assert "compute floor with bf16 matmuls: 0.4 ms" in text           # the one it has: 0.79 TFLOP / 2.25 PFLOP/s
    assert "breakdown.csv: ms per profiled step by class" in text       # the optional files are read when present
    assert "b200-b64:" in text and "mean loss over each run's last 50 steps" in text
    assert "torch_compile has no usable run" in text


def test_another_results_folder_gets_its_own_notebook_and_the_committed_one_is_left_alone(small_results):
    committed = open(build_notebook.NOTEBOOK, "rb").read()
    assert build_notebook.main(["--results", small_results]) == 0
    written = nbformat.read(os.path.join(small_results, os.path.basename(build_notebook.NOTEBOOK)), as_version=4)
    assert "b200-b4" in outputs_text(written)
    assert open(build_notebook.NOTEBOOK, "rb").read() == committed


def test_a_missing_notebook_package_is_one_error_line(tmp_path):
    blocker = tmp_path / "nbformat"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('not installed here (test)', name='nbformat')\n")
    r = subprocess.run([sys.executable, os.path.join(NOTEBOOKS, "build_notebook.py"), "--no-execute",
                        "--output", str(tmp_path / "nb.ipynb")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0 and not (tmp_path / "nb.ipynb").exists()
    assert r.stderr.splitlines() == ["error: building the notebook needs nbformat: run make notebook, which installs "
                                     "requirements-notebook.txt, or pip install -r requirements-notebook.txt"]


def test_a_damaged_results_file_is_one_error_line_and_writes_nothing(small_results, tmp_path, capsys):
    folder = tmp_path / "damaged"
    # without a notebook that another test of this module may have written into the shared folder first
    shutil.copytree(small_results, folder, ignore=shutil.ignore_patterns("*.ipynb"))
    with open(folder / "results.csv", "a") as f:
        f.write('garbage,"unclosed\n')
    before = (folder / "results.csv").read_bytes()
    capsys.readouterr()
    assert build_notebook.main(["--results", str(folder)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the notebook stopped at cell ")
    assert "results.csv line" in err[0] and "the file is damaged" in err[0] and "was not written" in err[0]
    assert not (folder / os.path.basename(build_notebook.NOTEBOOK)).exists()
    assert (folder / "results.csv").read_bytes() == before


def test_a_notebook_that_cannot_be_written_is_one_error_line(small_results, tmp_path, capsys):
    target = tmp_path / "in-the-way"
    target.mkdir()   # a folder where the file goes: refused whoever runs it, root too
    capsys.readouterr()
    assert build_notebook.main(["--results", small_results, "--output", str(target)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: cannot write {target}: Is a directory"]
