"""Utils.report.walkthrough: the notebook's tables, listings and sentences, on the committed H200 measurements
and on small result sets written here through the suite's own writer (no torch, no GPU)."""
import os
import re

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from Utils.ladder.registry import LADDER, MAX_ADDITIONS
from Utils.report import walkthrough
from Utils.report.walkthrough import Study, Verbatim
from Utils.results.read import load
from Utils.results.store import append_run

from conftest import REPO_ROOT, summary_table

H200 = os.path.join(REPO_ROOT, "results", "h200-b16")
SEQ = 256


def add_run(prefix, rung, step_ms, status="ok", batch=4, gpu="NVIDIA L4", commit="abc123", message="", config="",
            model="gpt2", **extra):
    """Append one run of `rung` with these step times (the first two are warm-up) through the suite's writer."""
    os.makedirs(prefix, exist_ok=True)
    run_id = f"{rung}-{len(os.listdir(prefix))}-{len(step_ms)}"
    steps = [dict(run_id=run_id, optimization=rung, step=i, warmup=i < 2, step_ms=ms,
                  tokens_per_s=batch * SEQ / (ms / 1e3), loss=10.0 - 0.1 * i, mfu=0.2) for i, ms in enumerate(step_ms)]
    append_run(prefix, dict(run_id=run_id, optimization=rung, status=status, message=message,
                            started_at="2026-01-01T00:00:00", steps=len(step_ms), warmup_steps=2, batch_size=batch,
                            seq_len=SEQ, model=model, n_params=124439808, data="synthetic", device="cuda",
                            gpu_name=gpu, torch_version="2.9.0", cuda_version="12.8", compile_s=None,
                            peak_mem_allocated_gib=6.0, peak_mem_reserved_gib=7.0, notes="", git_commit=commit,
                            config=config, **extra,
                            median_step_ms=float(np.median(step_ms[2:])) if step_ms else None), steps)
    return run_id


@pytest.fixture(scope="module")
def h200():
    return Study.load(H200)


@pytest.fixture(scope="module")
def unknown_gpu(tmp_path_factory):
    """A ladder measured on a GPU missing from the GPU table, with an oom rung, and no companion sets."""
    prefix = str(tmp_path_factory.mktemp("results") / "t4-b4")
    for rung, ms in (("baseline", 300.0), ("tf32", 140.0), ("flash", 45.0)):
        add_run(prefix, rung, [5 * ms] + [ms * (1 + 0.01 * i) for i in range(9)], gpu="Tesla T4")
    add_run(prefix, "bf16", [], status="oom", gpu="Tesla T4", message="CUDA out of memory")
    return Study.load(prefix)


# ---------------------------------------------------------------------------------------------
# Paths and tables


def test_results_folder_is_found_from_here_or_from_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert walkthrough.results_folder(None, REPO_ROOT) == H200
    assert walkthrough.results_folder("results/h200-b64", REPO_ROOT) == os.path.join(REPO_ROOT, "results", "h200-b64")
    (tmp_path / "results" / "h200-b64").mkdir(parents=True)
    assert walkthrough.results_folder("results/h200-b64", REPO_ROOT) == str(tmp_path / "results" / "h200-b64")
    with pytest.raises(FileNotFoundError, match="RESULTS=nowhere is not a folder"):
        walkthrough.results_folder("nowhere", REPO_ROOT)


def test_companions_are_named_after_the_results_folder():
    assert walkthrough.companions("/r/h200-b16") == {"batch": "/r/h200-b64", "loss": "/r/h200-loss",
                                                      "ablation": "/r/h200-ablation-b16",
                                                      "leave_one_out": "/r/h200-ablation-max-b16",
                                                      "leave_one_out_b64": "/r/h200-ablation-max-b64",
                                                      "leave_one_out_xl": "/r/h200-ablation-max-xl-b8",
                                                      "breakdown": "/r/h200-b16/breakdown.csv",
                                                      "small_cards": "/r/small-cards"}
    assert walkthrough.companions("/r/mine")["loss"] == "/r/mine-loss"


def test_figures_round_as_the_summary_and_turn_missing_numbers_into_none():
    table = pd.DataFrame({"median_step_ms": [36.94, np.nan], "iqr_step_ms": [0.66, np.nan], "speedup": [10.012, np.nan],
                          "tokens_per_s": [444137.4, np.nan], "mfu": [0.38412, np.nan],
                          "peak_mem_allocated_gib": [14.51, np.nan], "peak_mem_reserved_gib": [15.34, np.nan],
                          "compile_s": [np.nan, np.nan], "final_loss": [5.8372, np.nan], "status": ["ok", "oom"]},
                         index=["fused", "8bit"])
    figures = walkthrough.figures(table)
    assert figures["fused"] == {"median_step_ms": 36.9, "iqr_step_ms": 0.7, "speedup": 10.01, "tokens_per_s": 444137.0,
                                "mfu_pct": 38.4, "peak_mem_allocated_gib": 14.5, "peak_mem_reserved_gib": 15.3,
                                "compile_s": None, "final_loss": 5.837, "status": "ok"}
    assert figures["8bit"]["median_step_ms"] is None and figures["8bit"]["status"] == "oom"
    shown = walkthrough.measurements(table)
    assert shown.at["fused", "tokens/s"] == "444,137" and shown.at["8bit", "tokens/s"] == "-"


def test_the_committed_figures_are_summary_mds(h200):
    figures = walkthrough.figures(h200.table)
    for rung, row in summary_table(H200).items():
        assert figures[rung]["median_step_ms"] == float(row["median ms"]), rung
        assert figures[rung]["speedup"] == float(row["speedup"].rstrip("x")), rung


# ---------------------------------------------------------------------------------------------
# The code a rung runs


def test_source_prints_a_definition_from_its_file():
    text = walkthrough.source("Utils/ladder/apply.py", "apply_tf32")
    assert isinstance(text, Verbatim)
    assert text.startswith("# Utils/ladder/apply.py, apply_tf32\n")
    assert re.search(r"^\s*\d+  def apply_tf32\(", text, re.M) and "allow_tf32" in text
    lines = walkthrough.source("Utils/train/loop.py", "train", ("backward",)).splitlines()
    assert lines[0].endswith(": the lines with 'backward'") and all("backward" in ln for ln in lines[1:])
    assert "torch.autocast" in walkthrough.source("Utils/ladder/apply.py", "Build.autocast")
    assert "scaled_dot_product_attention" in walkthrough.source("Utils/model.py", "CausalSelfAttention.forward")
    with pytest.raises(LookupError, match="defines no apply_warp_drive"):
        walkthrough.source("Utils/ladder/apply.py", "apply_warp_drive")


def test_each_rung_builds_on_the_rung_it_differs_least_from():
    assert walkthrough.parent("baseline") is None and walkthrough.parent("fused+loss") is None
    assert [walkthrough.parent(r) for r in LADDER[1:]] == ["baseline", "tf32", "bf16", "torch_compile", "flash",
                                                          "flash", "fused"]
    assert walkthrough.added("8bit") == ["8bit"]
    assert walkthrough.added("max") == list(MAX_ADDITIONS)
    text = walkthrough.change("8bit")
    assert text.splitlines()[0] == "8bit = flash + 8bit (it branches off flash, not fused)"
    assert "  + 8bit (memory): bitsandbytes' AdamW8bit" in text
    assert walkthrough.change("baseline").startswith("baseline: no additions")


@pytest.mark.parametrize("rung", LADDER)
def test_every_rung_shows_the_apply_function_of_each_addition_it_adds(rung):
    listings = walkthrough.apply_sources(rung)
    assert [ln.splitlines()[0] for ln in listings] == [f"# Utils/ladder/apply.py, apply_{a}"
                                                       for a in walkthrough.added(rung)]


# ---------------------------------------------------------------------------------------------
# A study of the committed measurements


def text_of(items):
    return "\n".join(i for i in items if isinstance(i, str))


def test_h200_study_overview_and_floors(h200):
    overview = text_of(h200.overview())
    assert "RESULTS = results/h200-b16" in overview and "batch-64 set: results/h200-b64 found" in overview
    assert h200.ok == LADDER
    assert list(h200.floors.index) == LADDER
    assert h200.bounds["baseline"] == "compute" and h200.bounds["bf16"] == "memory"
    assert "NVIDIA H200 bf16        989.4 TFLOP/s dense (NVIDIA H200 Tensor Core GPU datasheet (SXM))" \
           in text_of(h200.machine())
    assert "runs.csv records 124,439,808" in text_of(h200.compute())


def test_h200_effects_and_readings(h200):
    """The readings quote the committed table's own numbers."""
    t = h200.table
    ms = t["median_step_ms"]
    effect = text_of(h200.effect("8bit"))
    assert f"step time: {ms['8bit']:.1f} ms median" in effect
    assert f"against its predecessor, flash: {ms['flash'] / ms['8bit']:.2f}x" in effect
    assert "against the rung before it, fused" in effect
    assert effect.splitlines()[-1].startswith(f"8bit: {ms['8bit']:.1f} ms measured; compute floor ")
    assert re.search(r"about \d+% of the baseline step was matmul time", text_of(h200.tf32_share()))
    saved = ms[walkthrough.parent("torch_compile")] - ms["torch_compile"]
    steps = t.at["torch_compile", "compile_s"] * 1e3 / saved
    assert f"it pays for itself after about {steps:,.0f} steps" in text_of(h200.compile_break_even())
    drop = t.at[walkthrough.parent("flash"), "peak_mem_allocated_gib"] - t.at["flash", "peak_mem_allocated_gib"]
    assert f"Peak memory fell by {drop:.1f} GiB" in text_of(h200.flash_memory())
    assert "instead of 84" in text_of(h200.fused_bytes())
    assert "0.69 GiB predicted" in text_of(h200.eight_bit())
    lines = text_of(h200.ladder_lines())
    biggest = max(LADDER[1:], key=lambda r: ms[LADDER[LADDER.index(r) - 1]] / ms[r])
    assert f"the single largest step up the ladder was {biggest}" in lines


def test_h200_ablation_against_the_fused_runs_of_the_same_commit(h200):
    items = h200.ablation()
    table = next(i for i in items if isinstance(i, pd.DataFrame))
    assert "fused" in table.index and np.isnan(table.at["fused", "vs fused"])
    for name in table.index.drop("fused"):
        assert table.at[name, "in max"] == (name.removeprefix("fused+") in MAX_ADDITIONS), name
    # The committed set's runs with today's step timing are commit 5887797's, from two calls with a fused run
    # each: one mean of the two is every row's reference. Its fp8 run was skipped (no torchao), so it has no row.
    assert set(table["fused ms, same commit and GPU"].dropna()) == {table.at["fused", "median ms"]}
    assert "fused+fp8" not in table.index and table.at["fused+fp8_head", "vs fused"] < -walkthrough.ABLATION_NOISE
    slower = [n for n in table.index if table.at[n, "vs fused"] > walkthrough.ABLATION_NOISE]
    assert set(slower) == {"fused+gelu_epilogue", "fused+loss", "fused+vocab_multiple"}
    assert text_of(items).endswith(f"Slower than the fused rung on their own, beyond the runs' spread: "
                                   f"{', '.join(slower)}.")


def test_h200_loss_and_batch_sections(h200):
    drift = h200.loss_drift()
    assert list(drift[0].index) == LADDER and "Every rung follows the baseline's loss" in drift[1]
    loss = h200.loss_set()
    assert isinstance(loss[-1], Figure) and list(loss[1].index) == LADDER
    assert loss[1].at["baseline", "vs baseline"] == 0
    batch = h200.batch64()
    assert list(batch[1].columns)[0] == "speedup, batch 16"
    assert re.search(r"8bit: batch 64 runs \d\.\d\dx the tokens per second of batch 16\.", text_of(batch))
    assert all(isinstance(f, Figure) for f in h200.charts())


# ---------------------------------------------------------------------------------------------
# A GPU missing from the table, a rung that ran out of memory, no companion sets


def test_a_gpu_missing_from_the_table_gets_no_floors_and_says_so(unknown_gpu):
    assert "Tesla T4 fp32      unknown" in text_of(unknown_gpu.machine())
    assert "fp32, tf32, bf16, bandwidth unknown" in text_of(unknown_gpu.machine())
    assert unknown_gpu.floors[["compute floor ms", "memory floor ms"]].isna().all().all()
    assert unknown_gpu.bounds == {}
    assert unknown_gpu.verdict("flash") == "flash: 47.0 ms measured; no floor known for Tesla T4."
    assert unknown_gpu.tf32_share() == [] and unknown_gpu.fused_bytes() == []
    assert "compute floor with bf16 matmuls: unknown" in text_of(unknown_gpu.compute())


def test_missing_rungs_and_sets_are_reported_not_invented(unknown_gpu):
    assert unknown_gpu.ok == ["baseline", "tf32", "flash"]
    assert text_of(unknown_gpu.effect("bf16")).startswith("bf16 has no usable run in ")
    assert "(oom: CUDA out of memory)" in text_of(unknown_gpu.effect("bf16"))
    assert "bf16: no measured step time (oom)." in text_of(unknown_gpu.bound_chart())
    assert "(its predecessor, bf16, not measured)" not in text_of(unknown_gpu.ladder_lines())   # bf16 is not ok
    assert unknown_gpu.leave_one_out() == []   # optional: the ablation's section names it
    for section, absent in ((unknown_gpu.ablation, "is absent"), (unknown_gpu.loss_set, "is absent"),
                            (unknown_gpu.batch64, "is absent"), (unknown_gpu.breakdown, "No breakdown.csv"),
                            (unknown_gpu.small_cards, "holds no results")):
        assert absent in text_of(section())
    assert unknown_gpu.bf16_gain() == []


def test_ablation_table_needs_a_fused_run_of_the_same_commit(tmp_path):
    prefix = str(tmp_path / "abl")
    add_run(prefix, "fused", [40.0] * 6, commit="c1")
    add_run(prefix, "fused", [42.0] * 6, commit="c1")
    add_run(prefix, "fused+loss", [39.0] * 6, commit="c1")
    add_run(prefix, "fused+prefetch", [30.0] * 6, commit="c2")    # no fused run of its commit: left out
    table = walkthrough.ablation_table(*load(prefix))
    assert list(table.index) == ["fused", "fused+loss"]
    assert table.at["fused+loss", "fused ms, same commit and GPU"] == 41.0
    assert table.at["fused+loss", "vs fused"] == pytest.approx(39 / 41 - 1)
    assert table.at["fused+loss", "in max"] == ("loss" in MAX_ADDITIONS)
    only = str(tmp_path / "none")
    add_run(only, "fused+loss", [39.0] * 6)
    assert walkthrough.ablation_table(*load(only)).empty


def test_leave_one_out_table_divides_by_the_max_runs_of_the_same_commit(tmp_path):
    prefix = str(tmp_path / "loo")
    add_run(prefix, "max", [30.0] * 6, commit="c1")
    add_run(prefix, "max", [32.0] * 6, commit="c1")
    add_run(prefix, "max-prefetch", [31.5] * 6, commit="c1")
    add_run(prefix, "max-fp8_head", [34.0] * 6, commit="c1")
    add_run(prefix, "max-sync_every", [40.0] * 6, commit="c2")   # no max run of its commit: left out
    add_run(prefix, "fused+loss", [39.0] * 6, commit="c1")       # another set's run: left out
    table = walkthrough.ablation_table(*load(prefix), base="max")
    assert set(table.index) == {"max", "max-prefetch", "max-fp8_head"} and "in max" not in table.columns
    assert table.at["max-fp8_head", "vs max"] == pytest.approx(34 / 31 - 1)
    assert table.at["max-prefetch", "max ms, same commit and GPU"] == 31.0


def test_leave_one_out_section_names_what_pays_and_what_does_not(tmp_path):
    add_run(str(tmp_path / "h200-b16"), "baseline", [300.0] * 6)
    prefix = str(tmp_path / "h200-ablation-max-b16")   # the companion set's name for results h200-b16
    add_run(prefix, "max", [30.0] * 6, commit="c1")
    add_run(prefix, "max-prefetch", [30.1] * 6, commit="c1")   # +0.3%: within the noise line
    add_run(prefix, "max-fp8_head", [33.0] * 6, commit="c1")   # +10%: it pays
    add_run(prefix, "max-vocab_multiple", [29.0] * 6, commit="c1")   # -3.3%: faster without
    text = text_of(Study.load(str(tmp_path / "h200-b16")).leave_one_out())
    assert "Within the runs' spread without them: prefetch." in text
    assert "Faster without them: vocab_multiple." in text and "fp8_head." not in text
    assert "h200-ablation-max-b64" not in text
    assert "max as of commit c1, without each" in text   # the set's max, whose additions may have changed since
    # The batch-64 set, where it exists, follows with its own verdicts.
    prefix64 = str(tmp_path / "h200-ablation-max-b64")
    add_run(prefix64, "max", [100.0] * 6, commit="c1")
    add_run(prefix64, "max-prefetch", [99.0] * 6, commit="c1")   # -1%: within the noise line
    text = text_of(Study.load(str(tmp_path / "h200-b16")).leave_one_out())
    assert text.index("h200-ablation-max-b16") < text.index("h200-ablation-max-b64")
    assert text.count("Within the runs' spread without them: prefetch.") == 2
    assert "ablation-max-xl" not in text


def test_the_gpt2_xl_set_comes_from_this_card_or_else_another_cards_beside_it(tmp_path):
    add_run(str(tmp_path / "h200-b16"), "baseline", [300.0] * 6)
    other = str(tmp_path / "h100-ablation-max-xl-b8")
    add_run(other, "max", [156.0] * 6, commit="c1", model="gpt2-xl", batch=8)
    add_run(other, "max-stochastic_rounding", [171.0] * 6, commit="c1", model="gpt2-xl", batch=8)
    text = text_of(Study.load(str(tmp_path / "h200-b16")).leave_one_out())
    assert "h100-ablation-max-xl-b8 (gpt2-xl, batch 8, " in text and "Within the runs' spread" not in text
    own = str(tmp_path / "h200-ablation-max-xl-b8")   # this card's own set, where it has one, comes first
    add_run(own, "max", [150.0] * 6, commit="c2", model="gpt2-xl", batch=8)
    add_run(own, "max-prefetch", [150.1] * 6, commit="c2", model="gpt2-xl", batch=8)
    text = text_of(Study.load(str(tmp_path / "h200-b16")).leave_one_out())
    assert "h200-ablation-max-xl-b8" in text and "h100-ablation-max-xl-b8" not in text
    assert "Within the runs' spread without them: prefetch." in text


def test_another_cards_xl_set_is_one_that_holds_results_and_is_not_the_folder_read(tmp_path):
    (tmp_path / "a100-ablation-max-xl-b8" / "logs").mkdir(parents=True)   # a run's folder, nothing in it yet
    for card in ("h100", "l40"):
        add_run(str(tmp_path / f"{card}-ablation-max-xl-b8"), "max", [156.0] * 6, model="gpt2-xl", batch=8)
    assert walkthrough.companions(str(tmp_path / "h200-b16"))["leave_one_out_xl"] == str(
        tmp_path / "h100-ablation-max-xl-b8")   # the first, by name, of those with results
    assert walkthrough.companions(str(tmp_path / "h100-ablation-max-xl-b8"))["leave_one_out_xl"] == str(
        tmp_path / "l40-ablation-max-xl-b8")   # read as the results folder, the set is not its own companion


def test_a_rung_measured_with_other_additions_than_today_says_which(tmp_path):
    import json
    from Utils.ladder.registry import RUNGS
    prefix = str(tmp_path / "h200-b16")
    add_run(prefix, "baseline", [300.0] * 6)
    then = [a for a in RUNGS["max"].additions if a != "fold_clip"] + ["an_addition_since_removed"]
    add_run(prefix, "max", [30.0] * 6, commit="c0ffee", config=json.dumps({"additions": then}))
    add_run(prefix, "fused", [40.0] * 6, config=json.dumps({"additions": list(RUNGS["fused"].additions)}))
    study = Study.load(prefix)
    assert text_of(study.effect("max")).lstrip().startswith(
        "measured at commit c0ffee, when max had other additions than today's: since then fold_clip added, "
        "an_addition_since_removed left out")
    assert "other additions" not in text_of(study.effect("fused"))      # the same additions in another order
    assert "other additions" not in text_of(study.effect("baseline"))   # recorded no config: nothing claimed


def test_loss_tail_and_batch_comparison_keep_ladder_order():
    table = pd.DataFrame({"speedup": [1.0, 2.0], "tokens_per_s": [100.0, 200.0],
                          "peak_mem_allocated_gib": [9.0, 5.0]}, index=["tf32", "baseline"])
    other = pd.DataFrame({"speedup": [1.0], "tokens_per_s": [120.0], "peak_mem_allocated_gib": [30.0]},
                         index=["baseline"])
    both = walkthrough.batch_comparison(table, other, 8)
    assert list(both.index) == ["baseline", "tf32"] and np.isnan(both.at["tf32", "tokens/s, batch 64"])
    assert list(both.columns)[::2] == ["speedup, batch 8", "tokens/s, batch 8", "peak alloc GiB, batch 8"]


# ---------------------------------------------------------------------------------------------
# Showing


def test_show_wraps_paragraphs_and_keeps_verbatim_text(capsys):
    walkthrough.show("word " * 60, None, Verbatim("a    b\n  c"))
    out = capsys.readouterr().out
    paragraph, verbatim = out.split("a    b")
    assert all(len(line) <= walkthrough.WIDTH for line in paragraph.splitlines())
    assert len(paragraph.splitlines()) == 3 and verbatim == "\n  c\n"
    with pytest.raises(TypeError, match="not int"):
        walkthrough.show(3)


def test_png_is_the_same_bytes_each_time_and_names_no_software_version():
    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [1, 0])
    first, second = walkthrough.png(fig), walkthrough.png(fig)
    assert first == second and first.startswith(b"\x89PNG")
    assert b"Software" not in first and b"atplotlib" not in first


def test_small_card_sets_are_compared_side_by_side_smallest_memory_first(tmp_path):
    cards = tmp_path / "small-cards"
    for folder, cap, runs in (("whole", None, (("baseline", 4, 300.0), ("max", 4, 40.0))),
                              ("3.5gib", 3.5, (("baseline", 1, 600.0), ("max", 2, 60.0))),
                              ("8gib", 8.0, (("baseline", 2, 400.0), ("max", 4, 45.0)))):
        for rung, micro, ms in runs:
            add_run(str(cards / folder), rung, [ms] * 6, micro_batch=micro, accumulation_steps=4 // micro,
                    gpu_memory_gib=cap)
    add_run(str(cards / "3.5gib"), "flash", [], status="oom", micro_batch=None, gpu_memory_gib=3.5)
    add_run(str(cards / "3.5gib-again"), "max", [61.0] * 6, micro_batch=2, accumulation_steps=2, gpu_memory_gib=3.5)
    (cards / ".ipynb_checkpoints").mkdir()   # no results in it: not a set
    add_run(str(tmp_path / "l4-b4"), "baseline", [300.0] * 6)
    items = Study.load(str(tmp_path / "l4-b4")).small_cards()
    assert text_of(items[:1]).startswith("batch 4 × 256 tokens a step (")
    table = items[1]
    # two sets of one cap stay two columns, each named by its folder
    assert list(table.columns) == ["3.5gib: micro-batch", "3.5gib: ms", "3.5gib-again: micro-batch",
                                   "3.5gib-again: ms", "8gib: micro-batch", "8gib: ms", "whole: micro-batch",
                                   "whole: ms"]
    assert list(table.index) == ["baseline", "flash", "max"]
    assert list(table["3.5gib: micro-batch"]) == ["1 × 4", "oom", "2 × 2"]
    assert list(table["8gib: micro-batch"]) == ["2 × 2", "-", "4 × 1"]
    assert table.at["max", "3.5gib: ms"] == 60.0 and table.at["max", "3.5gib-again: ms"] == 61.0
    assert table.at["baseline", "whole: ms"] == 300.0
