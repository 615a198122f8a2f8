"""Scaling across GPUs in the report: scaling_table's numbers and run matching, scaling.png, and summary.md's
scaling section, from small results folders written through the real writer."""
import csv
import os

import numpy as np
import pytest

from conftest import run_main, sticks_out, summary_text
from Utils.report.scaling import GOALS, build_scaling, plot_scaling, scaling_table
from Utils.results.read import load
from Utils.results.schema import RUN_SCHEMA, STEP_SCHEMA, headers
from Utils.results.store import append_run

BATCH, SEQ = 16, 64
CONFIG = dict(batch_size=BATCH, seq_len=SEQ, model="gpt2", data="tiny", device="cuda", gpu_name="NVIDIA H200")
COMMIT = "0123456789abcdef"
WARMUP_MS = 9000.0     # far off the measured steps: a warm-up step counted by mistake moves every median


def add_run(prefix, rung, nproc, step_ms, run_id, parallel=None, status="ok", git_commit=COMMIT, **config):
    """Append one run through the real writer: a warm-up step, then `step_ms` (the slowest rank's per step)."""
    os.makedirs(prefix, exist_ok=True)
    cfg = {**CONFIG, **config}
    parallel = ("ddp" if nproc > 1 else "") if parallel is None else parallel
    tokens = nproc * cfg["batch_size"] * cfg["seq_len"]
    times = [WARMUP_MS, *step_ms]
    steps = [dict(run_id=run_id, optimization=rung, step=i, warmup=i == 0, step_ms=ms,
                  tokens_per_s=tokens / (ms / 1000) if ms and ms > 0 else None, loss=10.0 - 0.1 * i, mfu=None)
             for i, ms in enumerate(times)]
    median = float(np.median(step_ms)) if len(step_ms) else None
    run = dict(run_id=run_id, optimization=rung, status=status, message="", started_at="2025-03-01T00:00:00",
               steps=len(times), warmup_steps=1, n_params=124e6, torch_version="2.9.0", cuda_version="13.0",
               git_commit=git_commit, nproc=nproc, parallel=parallel,
               global_tokens_per_s=tokens / (median / 1000) if median else None,
               tokens_per_s_per_gpu=tokens / nproc / (median / 1000) if median else None, **cfg)
    append_run(prefix, run, steps)
    return run_id


def scaling_section(prefix):
    """summary.md's scaling table as [{column header: cell}], and the section's whole text."""
    section = summary_text(prefix).split("## Scaling", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return rows, section


def tokens(nproc, ms, batch=BATCH):
    return nproc * batch * SEQ / (ms / 1000)


def by_nproc(table, rung="max"):
    return table[table["rung"] == rung].set_index("nproc")


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """max on 1, 2, 4 and 8 GPUs from one commit, the baseline on one GPU, and plot_results run on them."""
    prefix = str(tmp_path_factory.mktemp("scaling"))
    add_run(prefix, "baseline", 1, [300.0, 301.0, 299.0], "base-1")
    add_run(prefix, "max", 1, [100.0, 99.0, 101.0, 100.0], "max-1")
    add_run(prefix, "max", 2, [104.0, 103.0, 105.0], "max-2")
    add_run(prefix, "max", 4, [110.0, 110.0, 110.0], "max-4")
    add_run(prefix, "max", 8, [125.0, 124.0, 126.0], "max-8")
    return prefix, run_main(prefix)


def test_efficiency_matches_a_hand_computation(scaled):
    prefix = scaled[0]
    table = scaling_table(*load(prefix))
    rows = by_nproc(table)
    assert list(rows.index) == [1, 2, 4, 8]
    for n, ms in ((1, 100.0), (2, 104.0), (4, 110.0), (8, 125.0)):
        r = rows.loc[n]
        assert r["median_step_ms"] == pytest.approx(ms)
        assert r["global_tokens_per_s"] == pytest.approx(tokens(n, ms))
        assert r["tokens_per_s_per_gpu"] == pytest.approx(tokens(1, ms))
        # Same batch per GPU: n x the work in the time of one n-GPU step, against n x the 1-GPU rate.
        assert r["efficiency"] == pytest.approx(100.0 / ms)
        assert r["run_id"] == f"max-{n}" and r["git_commit"] == COMMIT and r["note"] == ""
        assert r["parallel"] == ("ddp" if n > 1 else "")
    assert by_nproc(table, "baseline").loc[1, "efficiency"] == 1.0


def test_plot_results_writes_scaling_png_and_the_summary_section(scaled):
    prefix, (rc, out, err) = scaled
    assert rc == 0, err
    with open(os.path.join(prefix, "scaling.png"), "rb") as f:
        assert f.read().startswith(b"\x89PNG\r\n\x1a\n")
    assert "scaling.png" in out.splitlines()[-1]
    rows, section = scaling_section(prefix)
    assert [(r["rung"], r["GPUs"], r["parallel"]) for r in rows] == [
        ("max", "1", "-"), ("max", "2", "ddp"), ("max", "4", "ddp"), ("max", "8", "ddp")]
    two, eight = rows[1], rows[3]
    assert two["median ms"] == "104.0"
    assert two["global tokens/s"] == f"{tokens(2, 104.0):,.0f}"
    assert two["tokens/s per GPU"] == f"{tokens(1, 104.0):,.0f}"
    assert two["efficiency"] == f"{100 * 100 / 104:.1f}%" == "96.2%"
    assert eight["efficiency"] == "80.0%" and rows[0]["efficiency"] == "100.0%"
    assert "goals: 97% on 2 GPUs, 93% on 8 GPUs" in section
    assert "baseline" not in section, "a rung run on one GPU count is no scaling line"




def test_the_figure_draws_the_ideal_the_goals_and_the_provenance_whole(scaled):
    scaling = build_scaling(*load(scaled[0]))
    fig = plot_scaling(scaling.table, scaling.context, scaling.provenance)
    ax_tok, ax_eff = fig.axes
    for ax in (ax_tok, ax_eff):
        assert list(ax.get_xticks()) == [1, 2, 4, 8]
    ideal = [ln for ln in ax_tok.get_lines() if ln.get_linestyle() == "--"]
    assert len(ideal) == 1
    assert list(ideal[0].get_ydata()) == pytest.approx([n * tokens(1, 100.0) for n in (1, 2, 4, 8)])
    lines = {tuple(np.round(ln.get_ydata(), 4)) for ln in ax_eff.get_lines()}
    assert (100.0, 100.0) in lines                                          # the 100% line
    assert tuple(100 * g for g in GOALS.values()) in lines                  # the goals at 2 and 8 GPUs
    assert tuple(np.round([100.0, 10000 / 104, 10000 / 110, 80.0], 4)) in lines
    assert "NVIDIA H200" in fig.get_suptitle() and f"batch {BATCH}" in fig.get_suptitle()
    foot = fig.get_supxlabel().replace("\n", " ")
    assert "torch 2.9.0" in foot and "commit 0123456789ab" in foot and "ran 2025-03-01" in foot
    assert not sticks_out(fig)


def test_runs_of_a_tree_with_unknown_changes_get_no_efficiency(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", 1, [100.0, 100.0], "one", git_commit="0123456789ab-dirty")     # an older file's mark
    add_run(p, "max", 2, [104.0, 104.0], "two", git_commit="0123456789ab-dirty")
    rows = by_nproc(build_scaling(*load(p)).table)
    assert np.isnan(rows.loc[2, "efficiency"])
    assert rows.loc[2, "note"] == "commit 0123456789ab-dirty: uncommitted changes of unknown content"


def test_a_run_from_another_commit_gets_no_efficiency_and_a_note(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", 1, [100.0, 100.0], "one")
    add_run(p, "max", 2, [104.0, 104.0], "two-other-code", git_commit="fedcba9876543210")
    add_run(p, "max", 4, [110.0, 110.0], "four")
    scaling = build_scaling(*load(p))
    rows = by_nproc(scaling.table)
    assert np.isnan(rows.loc[2, "efficiency"])
    assert rows.loc[2, "global_tokens_per_s"] == pytest.approx(tokens(2, 104.0))   # still measured
    assert rows.loc[2, "note"] == "commit fedcba987654 != 0123456789ab of the 1-GPU run one"
    assert rows.loc[4, "efficiency"] == pytest.approx(100 / 110)
    assert scaling.notes == ["max, 2 GPUs: no efficiency for run two-other-code (commit fedcba987654 != "
                             "0123456789ab of the 1-GPU run one): efficiency compares runs of one commit on "
                             "one kind of GPU"]
    assert run_main(p)[0] == 0
    summary_rows, section = scaling_section(p)
    assert summary_rows[1]["efficiency"] == "-"
    assert "- max, 2 GPUs: no efficiency for run two-other-code" in section


def test_runs_of_other_work_or_parallel_strategy_are_not_mixed_in(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", 1, [50.0, 50.0], "one-batch8", batch_size=8)
    add_run(p, "max", 1, [100.0, 100.0], "one")
    add_run(p, "max", 2, [120.0, 120.0], "two-older")                       # superseded by the next
    add_run(p, "max", 2, [104.0, 104.0], "two")
    add_run(p, "max", 2, [60.0, 60.0], "two-batch8", batch_size=8)          # later, but other work
    add_run(p, "max", 2, [90.0, 90.0], "two-a100", gpu_name="NVIDIA A100")
    add_run(p, "max", 2, [80.0, float("nan")], "two-nan")
    add_run(p, "max", 2, [], "two-oom", status="oom")
    add_run(p, "max", 4, [112.0, 112.0], "four-fsdp", parallel="fsdp")
    add_run(p, "max", 4, [110.0, 110.0], "four")
    scaling = build_scaling(*load(p))
    rows = by_nproc(scaling.table)
    assert dict(rows["run_id"]) == {1: "one", 2: "two", 4: "four"}
    assert rows.loc[2, "efficiency"] == pytest.approx(100 / 104)
    assert scaling.notes == [
        "max: run two-nan (2 GPUs) left out: 1 NaN or missing step_ms",
        "max: run one-batch8 (1 GPU) left out: batch 8 != 16",
        "max: run two-batch8 (2 GPUs) left out: batch 8 != 16",
        "max: run two-a100 (2 GPUs) left out: gpu NVIDIA A100 != NVIDIA H200",
        "max: run four-fsdp (4 GPUs) left out: parallel fsdp != ddp",
    ]


def test_a_one_gpu_run_through_torchrun_sets_the_parallel_strategy(tmp_path):
    # make scaling PARALLEL=fsdp runs NPROC=1 through torchrun too, recording fsdp.
    p = str(tmp_path)
    add_run(p, "max", 1, [100.0, 100.0], "one-fsdp", parallel="fsdp")
    add_run(p, "max", 2, [106.0, 106.0], "two-fsdp", parallel="fsdp")
    add_run(p, "max", 2, [104.0, 104.0], "two-ddp", parallel="ddp")
    scaling = build_scaling(*load(p))
    rows = by_nproc(scaling.table)
    assert dict(rows["run_id"]) == {1: "one-fsdp", 2: "two-fsdp"}
    assert rows.loc[2, "efficiency"] == pytest.approx(100 / 106)
    assert scaling.notes == ["max: run two-ddp (2 GPUs) left out: parallel ddp != fsdp"]
    assert run_main(p)[0] == 0
    assert [r["parallel"] for r in scaling_section(p)[0]] == ["fsdp", "fsdp"]


def test_a_rung_without_a_one_gpu_run_has_no_efficiency(tmp_path):
    p = str(tmp_path)
    add_run(p, "fused", 2, [50.0, 50.0], "two")
    add_run(p, "fused", 4, [55.0, 55.0], "four")
    scaling = build_scaling(*load(p))
    rows = by_nproc(scaling.table, "fused")
    assert rows["efficiency"].isna().all() and set(rows["note"]) == {"no 1-GPU run"}
    assert rows.loc[4, "global_tokens_per_s"] == pytest.approx(tokens(4, 55.0))
    assert scaling.notes == ["fused: no ok 1-GPU run of this work: no scaling efficiency, which divides by the "
                             "1-GPU run's tokens/s"]
    rc, _, err = run_main(p)
    assert rc == 0, err
    assert os.path.exists(os.path.join(p, "scaling.png"))
    assert [r["efficiency"] for r in scaling_section(p)[0]] == ["-", "-"]


def test_one_gpu_count_writes_no_scaling_png_and_no_section(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", 1, [300.0, 300.0], "base")
    add_run(p, "max", 1, [100.0, 100.0], "one")
    add_run(p, "max", 2, [52.0, 52.0], "two-batch8", batch_size=8)     # another GPU count, but not this work
    rc, out, err = run_main(p)
    assert rc == 0, err
    assert not os.path.exists(os.path.join(p, "scaling.png"))
    assert "## Scaling" not in summary_text(p) and "scaling.png" not in out
    add_run(p, "max", 2, [104.0, 104.0], "two")
    rc, out, err = run_main(p)
    assert rc == 0, err
    assert os.path.exists(os.path.join(p, "scaling.png")) and "scaling.png" in out
    assert "- max: run two-batch8 (2 GPUs) left out: batch 8 != 16" in scaling_section(p)[1]


def _as_version_1(path, schema):
    """Rewrite a results file with the columns of schema version 1 only, as a file written back then."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = headers(schema)[1]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def test_a_folder_of_version_1_runs_plots_without_a_scaling_section(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", 1, [300.0, 300.0], "base")
    add_run(p, "max", 1, [100.0, 100.0], "max")
    _as_version_1(os.path.join(p, "runs.csv"), RUN_SCHEMA)
    _as_version_1(os.path.join(p, "results.csv"), STEP_SCHEMA)
    with open(os.path.join(p, "runs.csv")) as f:
        assert "nproc" not in f.readline()
    steps, runs = load(p)
    table = scaling_table(steps, runs)
    assert list(table["nproc"]) == [1, 1] and list(table["efficiency"]) == [1.0, 1.0]
    rc, out, err = run_main(p)
    assert rc == 0, err
    assert "## Scaling" not in summary_text(p) and "| max" in summary_text(p)
    assert not os.path.exists(os.path.join(p, "scaling.png"))
    # A frame built without the columns of version 3 reads as one process each, too.
    old_frame = scaling_table(steps, runs.drop(columns=["nproc", "parallel", "global_tokens_per_s"]))
    assert list(old_frame["nproc"]) == [1, 1]
