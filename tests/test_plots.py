"""plot_results.py and Utils/report on small results files written here: the numbers, the files, run matching,
bad input, and charts whose every text fits on them."""
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from matplotlib.figure import Figure  # noqa: E402

from conftest import rewrite_as_version_1, run_main, sticks_out, summary_table, summary_text  # noqa: E402
from Utils.report.charts import CHARTS as CHART_PLOTS, plot_step_time  # noqa: E402
from Utils.report.cli import main  # noqa: E402
from Utils.report.selection import select  # noqa: E402
from Utils.report.stats import (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_speedup, build_report,  # noqa: E402
                                loss_spikes, summarize, trimmed_mean)
from Utils.results.read import load  # noqa: E402
from Utils.results.schema import RUN_COLUMNS, STEP_COLUMNS  # noqa: E402
from Utils.results.store import append_run  # noqa: E402

CHARTS = ["speedup.png", "step_time.png", "throughput.png", "memory.png", "loss.png"]
OUTPUTS = CHARTS + ["summary.md"]
BATCH, SEQ = 16, 64
CONFIG = dict(batch_size=BATCH, seq_len=SEQ, model="gpt2", data="tiny", device="cuda", gpu_name="NVIDIA H200")


def add_run(prefix, rung, step_ms=(), warmup=1, status="ok", run_id=None, mfu=None, message="", notes="",
            mem=(10.0, 12.0), compile_s=None, git_commit="0123456789abcdef", losses=None, **config):
    """Append one run through the real writer; the first `warmup` entries of step_ms are warm-up; each step's
    loss from `losses`, else 10.9 falling by 0.1 a step."""
    run_id = run_id or f"{rung}-{len(os.listdir(prefix)) if os.path.isdir(prefix) else 0}-{len(step_ms)}-{status}"
    os.makedirs(prefix, exist_ok=True)
    cfg = {**CONFIG, **config}
    mfu = list(mfu) if mfu is not None else [0.4] * len(step_ms)
    steps = [dict(run_id=run_id, optimization=rung, step=i, warmup=i < warmup, step_ms=ms,
                  tokens_per_s=BATCH * SEQ / (ms / 1000) if ms and ms > 0 else None,
                  loss=10.9 - 0.1 * i if losses is None else losses[i], mfu=mfu[i]) for i, ms in enumerate(step_ms)]
    run = dict(run_id=run_id, optimization=rung, status=status, message=message,
               started_at="2025-01-01T00:00:00", steps=len(step_ms), warmup_steps=warmup, n_params=124e6,
               torch_version="2.5.1", cuda_version="12.4", compile_s=compile_s,
               peak_mem_allocated_gib=mem[0], peak_mem_reserved_gib=mem[1],
               median_step_ms=1.0, iqr_step_ms=99.0, notes=notes, git_commit=git_commit, **cfg)
    append_run(prefix, run, steps)
    return run_id


# Step times with warm-up steps far off the measured ones, so that a warm-up step counted by mistake
# moves the median and the IQR. Rounded as results.csv stores them (6 significant digits), so that
# the hand computation sees the same numbers as the script.
RNG = np.random.default_rng(7)
MEASURED = {rung: np.array([float(f"{x:.6g}") for x in ms]) for rung, ms in {
    "baseline": RNG.normal(300, 12, 21),
    "tf32": RNG.normal(150, 6, 16),
    "bf16": np.append(RNG.normal(100, 3, 24), 400.0),
}.items()}
MFU = {rung: np.round(RNG.uniform(0.2, 0.5, 2 + len(ms)), 4) for rung, ms in MEASURED.items()}
MEM = {"baseline": (28.8, 30.1), "tf32": (28.8, 30.1), "bf16": (13.0, 14.2)}


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("ladder"))
    for rung, ms in MEASURED.items():
        add_run(prefix, rung, [9000.0, 700.0, *ms], warmup=2, mfu=MFU[rung], mem=MEM[rung],
                compile_s=12.5 if rung == "bf16" else None,
                notes="TF32 has no effect on a CPU" if rung == "tf32" else "")
    rc, out, err = run_main(prefix)
    return prefix, rc, out, err


def test_summary_numbers_match_a_hand_computation(ladder):
    prefix, rc, _, err = ladder
    assert rc == 0, err
    rows = summary_table(prefix)
    assert list(rows) == ["baseline", "tf32", "bf16"]
    base_median = np.median(MEASURED["baseline"])
    for rung, ms in MEASURED.items():
        median = np.median(ms)
        iqr = np.percentile(ms, 75) - np.percentile(ms, 25)
        row = rows[rung]
        assert row["median ms"] == f"{median:.1f}"
        assert row["IQR ms"] == f"{iqr:.1f}"
        assert row["speedup"] == f"{base_median / median:.2f}x"
        assert row["tokens/s"] == f"{BATCH * SEQ / (median / 1000):,.0f}"
        assert row["MFU"] == f"{100 * np.median(MFU[rung][2:]):.1f}%"
        assert row["peak alloc GiB"] == f"{MEM[rung][0]:.1f}"
        assert row["peak reserved GiB"] == f"{MEM[rung][1]:.1f}"
        assert row["final loss"] == f"{10.9 - 0.1 * (len(ms) + 1):.3f}"
        assert row["status"] == "ok"
    assert rows["bf16"]["compile s"] == "12.5"
    assert rows["baseline"]["compile s"] == "-"
    assert "- tf32: TF32 has no effect on a CPU" in summary_text(prefix)


def test_the_trimmed_mean_drops_a_tenth_of_the_values_at_each_end():
    # 10 values, TRIM = 0.1: one cut at each end, so both outliers go and the mean is that of 10..17.
    values = np.array([1000.0, 12, 10, 0.5, 15, 11, 17, 13, 16, 14])
    assert trimmed_mean(values) == pytest.approx((10 + 11 + 12 + 13 + 14 + 15 + 16 + 17) / 8)
    # 20 values: two cut at each end.
    assert trimmed_mean(np.array([-9.0, -8, *range(1, 17), 90, 99])) == pytest.approx(np.mean(range(1, 17)))


def test_the_bootstrap_interval_is_the_2_5th_and_97_5th_percentile_of_resampled_median_ratios():
    base = np.array([100.0, 104, 97, 110, 99, 103, 120, 98, 101, 95, 102, 107])
    rung = np.array([50.0, 55, 49, 61, 52, 48, 53, 70, 51, 54])
    # The same resampling by hand: one generator, the baseline's resamples drawn first, then the rung's.
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    base_medians = np.median(rng.choice(base, size=(BOOTSTRAP_RESAMPLES, base.size)), axis=1)
    rung_medians = np.median(rng.choice(rung, size=(BOOTSTRAP_RESAMPLES, rung.size)), axis=1)
    ratios = base_medians / rung_medians
    lo, hi = bootstrap_speedup(base, rung)
    assert (lo, hi) == pytest.approx(tuple(np.percentile(ratios, [2.5, 97.5])), rel=1e-12)
    # A 95% interval is wider than the middle half of the ratios (so a narrower percentile pair is caught).
    q25, q75 = np.percentile(ratios, [25, 75])
    assert lo < q25 and q75 < hi
    assert lo < np.median(base) / np.median(rung) < hi


def test_summarize_frame_holds_the_unrounded_numbers(ladder):
    prefix = ladder[0]
    steps, runs = load(prefix)
    frame = summarize(steps, runs)
    assert list(frame.index) == ["baseline", "tf32", "bf16"]
    for rung, ms in MEASURED.items():
        r = frame.loc[rung]
        assert r["median_step_ms"] == pytest.approx(np.median(ms))
        assert r["iqr_step_ms"] == pytest.approx(np.percentile(ms, 75) - np.percentile(ms, 25))
        assert r["speedup"] == pytest.approx(np.median(MEASURED["baseline"]) / np.median(ms))
        assert r["speedup_lo"] < r["speedup"] < r["speedup_hi"]
        assert r["measured_steps"] == len(ms)
    again = summarize(steps, runs)
    assert again.loc["tf32", "speedup_lo"] == frame.loc["tf32", "speedup_lo"], "bootstrap must be seeded"


def test_every_chart_and_the_summary_are_written_whole(ladder):
    prefix, rc, out, _ = ladder
    assert rc == 0
    for name in CHARTS:
        with open(os.path.join(prefix, name), "rb") as f:
            data = f.read()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name
    assert os.path.getsize(os.path.join(prefix, "summary.md")) > 0
    assert not [n for n in os.listdir(prefix) if n.startswith(".tmp-")]
    assert "| baseline" in out and f"{np.median(MEASURED['tf32']):.1f}" in out


def test_every_chart_names_what_it_measured(ladder):
    report = build_report(*load(ladder[0]))
    for name, plot in CHART_PLOTS.items():
        title = plot(report).get_suptitle()
        for part in ("NVIDIA H200", "gpt2", f"batch {BATCH}", f"seq_len {SEQ}", "data tiny"):
            assert part in title, (name, part)


def test_step_time_axis_turns_logarithmic_past_a_tenfold_spread(tmp_path):
    add_run(tmp_path, "baseline", [500.0, *[400.0] * 5])
    add_run(tmp_path, "tf32", [500.0, *[100.0] * 5])
    linear = build_report(*load(tmp_path))
    assert plot_step_time(linear).axes[0].get_yscale() == "linear"
    add_run(tmp_path, "bf16", [500.0, *[30.0] * 5])
    spread = build_report(*load(tmp_path))
    assert plot_step_time(spread).axes[0].get_yscale() == "log"


def test_run_matching(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 101, 99], run_id="base-old", git_commit="older0000000")   # other code
    add_run(p, "baseline", [1, 200, 201, 199], run_id="base-new")
    add_run(p, "tf32", [1, 50, 50, 50], run_id="tf32-match")
    add_run(p, "tf32", [1, 40, 40, 40], run_id="tf32-batch8", batch_size=8)
    add_run(p, "bf16", [1, 25, 25, 25], run_id="bf16-a100", gpu_name="NVIDIA A100")
    add_run(p, "torch_compile", [1, 20, 20, 20], run_id="tc-other", seq_len=128, data="owt")
    add_run(p, "flash", [], status="oom", run_id="flash-oom", message="CUDA out of memory")
    add_run(p, "8bit", [], status="skipped", run_id="8bit-skip", message="bitsandbytes missing")
    add_run(p, "max", [1, 10, 10, 10], run_id="max-1")
    add_run(p, "max", [1, 10, 10, 10], run_id="max-2")
    add_run(p, "max", [], status="failed", run_id="max-3", message="NaN loss")

    steps, runs = load(p)
    sel = select(runs, steps)
    chosen, excluded = sel.chosen, sel.excluded
    assert {r: row["run_id"] for r, row in chosen.items()} == {
        "baseline": "base-new", "tf32": "tf32-match", "max": "max-2"}
    reasons = {e.run_id: e.reason for e in excluded}
    assert reasons == {"tf32-batch8": "batch 8 != 16",
                       "bf16-a100": "gpu NVIDIA A100 != NVIDIA H200",
                       "tc-other": "seq_len 128 != 64; data owt != tiny"}

    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = summary_table(p)
    assert list(rows) == ["baseline", "tf32", "bf16", "torch_compile", "flash", "8bit", "max"]
    assert rows["baseline"]["median ms"] == "200.0"
    assert rows["tf32"]["speedup"] == "4.00x"
    assert rows["max"]["speedup"] == "20.00x"
    for rung, status in (("bf16", "excluded"), ("torch_compile", "excluded"), ("flash", "oom"),
                         ("8bit", "skipped")):
        assert rows[rung]["status"] == status
        assert rows[rung]["speedup"] == rows[rung]["median ms"] == "-"
    text = summary_text(p)
    assert "- tf32-batch8 (tf32): batch 8 != 16" in text
    assert "- bf16-a100 (bf16): gpu NVIDIA A100 != NVIDIA H200" in text
    assert "flash (oom): CUDA out of memory" in text
    assert "8bit (skipped): bitsandbytes missing" in text
    assert "max-3, ended failed: NaN loss" in text
    assert "base-new" not in text.split("## Excluded runs")[1].split("## Notes")[0]


def test_runs_repeated_from_one_commit_are_listed_with_the_median_of_their_medians(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100], run_id="base")
    add_run(p, "max", [1, 5, 5, 5], run_id="max-old-code", git_commit="aaaaaaa")
    for i, ms in enumerate((12, 10)):
        add_run(p, "max", [1, ms, ms, ms], run_id=f"max-{i}", git_commit="bbbbbbb")
    add_run(p, "max", [1, 99, 99, 99], run_id="max-batch8", git_commit="bbbbbbb", batch_size=8)
    add_run(p, "max", [1, float("nan"), 30, 30], run_id="max-nan-steps", git_commit="bbbbbbb")
    add_run(p, "max", [1, 13, 13, 13], run_id="max-3", git_commit="bbbbbbb")
    add_run(p, "tf32", [1, 50, 50, 50], run_id="tf32-once", git_commit="bbbbbbb")
    # Neither a tree with uncommitted changes of unknown hash, nor two differently changed trees, nor an unknown
    # commit names one tree; one changed tree (the same changes' hash) does.
    for i in range(2):
        add_run(p, "bf16", [1, 40, 40, 40], run_id=f"bf16-dirty-{i}", git_commit="bbbbbbb-dirty")
        add_run(p, "flash", [1, 30, 30, 30], run_id=f"flash-unknown-{i}", git_commit="")
        add_run(p, "torch_compile", [1, 60, 60, 60], run_id=f"compile-{i}", git_commit=f"bbbbbbb-dirty-0000000{i}")
        add_run(p, "fused", [1, 20 + i, 20 + i, 20 + i], run_id=f"fused-{i}", git_commit="bbbbbbb-dirty-1a2b3c4d")

    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = summary_table(p)
    # The median of the three runs' medians, and the spread between them: (13 - 10) / 12.
    assert rows["max"]["median ms"] == "12.0" and rows["max"]["speedup"] == "8.33x"
    assert rows["max"]["runs"] == "3" and rows["max"]["spread"] == "25.0%"
    assert rows["tf32"]["runs"] == "1" and rows["tf32"]["spread"] == "-"
    notes = summary_text(p).split("## Notes")[1]
    # The other commit's run, the other batch size's and the one with NaN step times are not repeats.
    assert ("- max: 3 ok runs of this configuration from commit bbbbbbb, median step times 12.0, 10.0, "
            "13.0 ms, oldest first; the table shows their median 12.0 ms (spread 25.0%)") in notes
    assert ("- fused: 2 ok runs of this configuration from commit bbbbbbb-dirty-1a2b3c4d, median step times 20.0, "
            "21.0 ms") in notes
    for rung in ("tf32", "bf16", "flash", "torch_compile", "baseline"):
        assert f"- {rung}:" not in notes
    frame = summarize(*load(p))
    assert frame.at["max", "trimmed_mean_ms"] == pytest.approx((12 * 3 + 10 * 3 + 13 * 3) / 9)


def test_runs_of_several_commits_or_gpus_are_named_in_a_note(tmp_path):
    one, mixed = str(tmp_path / "one"), str(tmp_path / "mixed")
    for p in (one, mixed):
        add_run(p, "baseline", [1, 100, 100, 100], git_commit="aaaaaaaaaaaa1111", gpu_uuid="GPU-1")
        add_run(p, "tf32", [1, 50, 50, 50], git_commit="aaaaaaaaaaaa1111", gpu_uuid="GPU-1")
    add_run(one, "bf16", [1, 40, 40, 40], git_commit="aaaaaaaaaaaa1111", gpu_uuid="GPU-1")
    add_run(mixed, "bf16", [1, 40, 40, 40], git_commit="bbbbbbbbbbbb-dirty", gpu_uuid="GPU-2")
    for p in (one, mixed):
        assert run_main(p)[0] == 0
    assert "the compared runs come from" not in summary_text(one)
    notes = summary_text(mixed).split("## Notes")[1]
    assert ("- the compared runs come from 2 commits (aaaaaaaaaaaa: baseline, tf32; bbbbbbbbbbbb-dirty: bf16): "
            "a speedup between two of them measures that difference too") in notes
    assert "- the compared runs come from 2 GPUs (GPU-1: baseline, tf32; GPU-2: bf16)" in notes


def test_a_rung_repeated_on_two_gpus_is_named_under_both(tmp_path):
    # make ablation FROM=max in two calls that landed on two cards: the row of max is the median of both runs
    p = str(tmp_path)
    add_run(p, "max", [1, 30, 30, 30], git_commit="aaaaaaaaaaaa1111", gpu_uuid="GPU-1", run_id="max-1")
    add_run(p, "max-prefetch", [1, 31, 31, 31], git_commit="aaaaaaaaaaaa1111", gpu_uuid="GPU-1")
    add_run(p, "max", [1, 33, 33, 33], git_commit="aaaaaaaaaaaa1111", gpu_uuid="GPU-2", run_id="max-2")
    assert run_main(p)[0] == 0
    notes = summary_text(p).split("## Notes")[1]
    assert "- the compared runs come from 2 GPUs (GPU-1: max, max-prefetch; GPU-2: max)" in notes


@pytest.mark.parametrize("data", ["synthetic", "shakespeare"])
def test_losses_on_synthetic_tokens_are_named_as_such(tmp_path, data):
    # DATA=auto falls back to random tokens offline, with one warning line that scrolls away
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100], data=data)
    add_run(p, "tf32", [1, 50, 50, 50], data=data)
    assert run_main(p)[0] == 0
    said = "- data: synthetic tokens, drawn uniformly from the vocabulary, not text" in summary_text(p)
    assert said == (data == "synthetic")


def test_the_summary_says_how_the_compared_steps_were_timed(tmp_path):
    now, then = str(tmp_path / "now"), str(tmp_path / "then")
    for p in (now, then):
        add_run(p, "baseline", [1, 100, 100, 100])
        add_run(p, "tf32", [1, 50, 50, 50])
    rewrite_as_version_1(then)
    for p in (now, then):
        assert run_main(p)[0] == 0
    assert "from the previous step's end to its own end on the device" in summary_text(now)
    assert "before schema version 2: each step was timed alone" not in summary_text(now)
    assert "before schema version 2: each step was timed alone, by CUDA events around it" in summary_text(then)
    assert "from the previous step's end" not in summary_text(then)


def test_a_repeated_baseline_divides_by_the_median_of_its_runs(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100], run_id="base-1", git_commit="ccccccc")
    add_run(p, "baseline", [1, 60, 60, 60], run_id="base-2", git_commit="ccccccc")
    add_run(p, "baseline", [1, 50, 50, 50], run_id="base-3", git_commit="ccccccc")
    add_run(p, "max", [1, 12, 12, 12], run_id="max-1", git_commit="ccccccc")
    add_run(p, "max", [1, 10, 10, 10], run_id="max-2", git_commit="ccccccc")

    rc, out, err = run_main(p)
    assert rc == 0, err
    assert summary_table(p)["max"]["speedup"] == "5.45x"   # 60 / 11, not the latest baseline's 50 / 10
    notes = summary_text(p).split("## Notes")[1]
    assert "- baseline: 3 ok runs of this configuration from commit ccccccc, median step times 100.0, 60.0, 50.0 ms" in notes


def test_a_noisy_run_is_flagged(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100, 100], run_id="base")
    add_run(p, "tf32", [1, 50, 45, 55, 50, 60, 40], run_id="tf32-noisy")    # IQR 7.5 of 50: 15%
    add_run(p, "bf16", [1, 40, 40.5, 39.5, 40], run_id="bf16-steady")       # IQR 0.25 of 40: 0.6%
    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = summary_table(p)
    assert rows["tf32"]["noisy"] == "yes" and rows["bf16"]["noisy"] == "-"
    assert rows["tf32"]["status"] == rows["bf16"]["status"] == "ok"
    notes = summary_text(p).split("## Notes")[1]
    assert "- tf32: run tf32-noisy is noisy: its steps' IQR is 15.0% of their median (over 5%)" in notes
    assert "bf16-steady" not in notes


def test_a_one_step_loss_spike_is_noted_and_a_trend_or_an_early_jump_is_not(tmp_path):
    p = str(tmp_path)
    steps = 60
    trend = 7.0 * np.exp(-np.arange(steps) / 20) + 4.0 + np.random.default_rng(3).normal(0, 0.05, steps)

    def losses(**jumps):
        out = trend.copy()
        for step, size in jumps.items():
            out[int(step[1:])] += size
        return [float(f"{x:.6g}") for x in out]
    add_run(p, "baseline", [1] + [100] * (steps - 1), run_id="base", losses=losses(s28=2.4))
    add_run(p, "tf32", [1] + [50] * (steps - 1), run_id="tf32-bumps", losses=losses(s10=2.4, s40=0.5))
    add_run(p, "bf16", [1] + [40] * (steps - 1), run_id="bf16-steady", losses=losses())
    rc, out, err = run_main(p)
    assert rc == 0, err
    notes = summary_text(p).split("## Notes")[1]
    spike, = [line for line in notes.splitlines() if "a spike which" in line]
    around = float(np.median(losses(s28=2.4)[24:33]))   # the 9 steps centred on step 28, the spike among them
    assert spike.startswith(f"- baseline: run base's loss at step 28 is {losses(s28=2.4)[28]:.2f}, ")
    assert f", {losses(s28=2.4)[28] - around:.2f} over the median of the 9 steps centred on it" in spike
    assert "tf32-bumps" not in notes and "bf16-steady" not in notes   # step 10 is too early; 0.5 nats too small


def test_loss_spikes_reaches_the_last_step_and_takes_repeated_steps_and_infinite_losses():
    trend = [5.0] * 30
    at_end = trend[:-1] + [7.0]
    assert loss_spikes(pd.DataFrame(dict(step=range(30), loss=at_end))) == [(29, 7.0, 5.0)]
    repeated = pd.DataFrame(dict(step=list(range(30)) + [20], loss=trend[:20] + [8.0] + trend[21:] + [5.0]))
    assert loss_spikes(repeated) == [(20, 8.0, 5.0)]
    infinite = pd.DataFrame(dict(step=range(30), loss=trend[:20] + [np.inf] + trend[21:25] + [8.0] + trend[26:]))
    assert loss_spikes(infinite) == [(25, 8.0, 5.0)]


def test_a_run_with_fp8_gemms_says_its_mfu_is_against_the_bf16_peak(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100], config=json.dumps({"additions": []}))
    add_run(p, "max", [1, 10, 10, 10], config=json.dumps({"additions": ["bf16", "fp8_head", "fused"]}))
    add_run(p, "fused", [1, 20, 20, 20], config=json.dumps({"additions": ["bf16", "fused"]}))
    rc, out, err = run_main(p)
    assert rc == 0, err
    notes = summary_text(p).split("## Notes")[1]
    assert ("- max: MFU is against the bf16 peak, as every run's, but fp8_head ran some GEMMs in FP8, whose peak is "
            "twice bf16's") in notes
    assert "- fused:" not in notes and "- baseline:" not in notes
    # A run whose FP8 addition noted it ran in bf16 instead (a GPU without FP8 units) gets no such line.
    add_run(p, "max", [1, 10, 10, 10], config=json.dumps({"additions": ["bf16", "fp8_head"], "fell_back": ["fp8_head"]}))
    assert run_main(p)[0] == 0
    assert "MFU is against the bf16 peak" not in summary_text(p)


def test_no_baseline_leaves_speedups_out_and_still_draws(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [], status="failed", message="killed")
    add_run(p, "tf32", [1, 50, 52, 51])
    add_run(p, "bf16", [1, 30, 31, 29])
    rc, out, err = run_main(p)
    assert rc == 0, err
    assert "no ok baseline run: speedups left out" in summary_text(p)
    assert "no ok baseline run: speedups left out" in out
    rows = summary_table(p)
    assert rows["baseline"]["status"] == "failed"
    assert rows["tf32"]["median ms"] == "51.0" and rows["tf32"]["speedup"] == "-"
    for name in CHARTS:
        assert os.path.getsize(os.path.join(p, name)) > 0


def test_nan_and_non_positive_step_times_exclude_the_run(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100])
    add_run(p, "tf32", [1, 50, 50, 50], run_id="tf32-good")
    add_run(p, "tf32", [1, 40, float("nan"), 40], run_id="tf32-nan")
    add_run(p, "bf16", [1, 30, -5.0, 0.0], run_id="bf16-neg")
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = summary_table(p)
    assert rows["tf32"]["median ms"] == "50.0" and rows["tf32"]["speedup"] == "2.00x"
    assert rows["bf16"]["status"] == "excluded" and rows["bf16"]["speedup"] == "-"
    text = summary_text(p)
    assert "- tf32-nan (tf32): 1 NaN or missing step_ms" in text
    assert "- bf16-neg (bf16): 2 non-positive step_ms" in text


def _valid(prefix):
    add_run(prefix, "baseline", [1, 100, 100])


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _truncate(prefix):
    _valid(prefix)
    path = os.path.join(prefix, "results.csv")
    with open(path, "rb") as f:
        data = f.read()
    _write(path, data[:-7])


BAD_INPUTS = {
    "prefix missing": (lambda p: None, "results.csv not found: run a rung first, e.g. make baseline"),
    "no results": (lambda p: os.makedirs(p), "results.csv not found"),
    "empty results": (lambda p: (os.makedirs(p), _write(os.path.join(p, "results.csv"), b"")),
                      "results.csv is empty"),
    "truncated results": (lambda p: (os.makedirs(p), _truncate(p)), "results.csv ends in the middle of a row"),
    "foreign header": (lambda p: (os.makedirs(p), _write(os.path.join(p, "results.csv"), b"a,b,c\n1,2,3\n")),
                       "results.csv has a header that is not the suite's"),
    "runs.csv missing": (lambda p: (os.makedirs(p), _valid(p), os.remove(os.path.join(p, "runs.csv"))),
                         "runs.csv not found"),
    "no runs recorded": (lambda p: (os.makedirs(p),
                                    _write(os.path.join(p, "results.csv"), (",".join(STEP_COLUMNS) + "\n").encode()),
                                    _write(os.path.join(p, "runs.csv"), (",".join(RUN_COLUMNS) + "\n").encode())),
                         "runs.csv records no runs"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line_and_no_output(tmp_path, case):
    prefix = str(tmp_path / "out")
    make, expected = BAD_INPUTS[case]
    make(prefix)
    rc, out, err = run_main(prefix)
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and prefix in err
    assert "Traceback" not in err + out
    for name in OUTPUTS:
        assert not os.path.exists(os.path.join(prefix, name))


@pytest.mark.parametrize("argv", [[], ["--prefix"], ["--prefix", "x", "--bogus"]])
def test_bad_arguments_are_one_error_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100])
    assert run_main(p)[0] == 0
    with open(os.path.join(p, "speedup.png"), "rb") as f:
        before = f.read()

    def disk_full(self, fname, **kwargs):
        fname.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    rc, _, err = run_main(p)
    assert rc == 2 and err.startswith("error: cannot write into") and err.count("\n") == 1
    with open(os.path.join(p, "speedup.png"), "rb") as f:
        assert f.read() == before
    assert not [n for n in os.listdir(p) if n.startswith(".tmp-")]


def test_command_line(tmp_path):
    add_run(tmp_path, "baseline", [1, 100, 100, 100])
    add_run(tmp_path, "tf32", [1, 25, 25, 25])
    done = subprocess.run([sys.executable, "plot_results.py", "--prefix", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4.00x" in done.stdout and "wrote speedup.png" in done.stdout
    assert summary_table(tmp_path)["tf32"]["speedup"] == "4.00x"


def test_a_damaged_number_is_named_not_dropped(tmp_path, capsys):
    steps = [{"run_id": "r1", "optimization": "baseline", "step": i, "warmup": i == 0, "step_ms": 10.0 + i,
              "tokens_per_s": 1.0, "loss": 5.0, "mfu": None} for i in range(4)]
    append_run(tmp_path, {"run_id": "r1", "optimization": "baseline", "status": "ok", "batch_size": 2,
                          "seq_len": 8, "model": "tiny", "data": "synthetic", "device": "cpu", "gpu_name": "cpu"},
               steps)
    path = tmp_path / "results.csv"
    path.write_text(path.read_text().replace(",12,", ",abc,", 1))
    assert main(["--prefix", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 4: step_ms='abc' is not a number" in err[0]
    assert not (tmp_path / "summary.md").exists()


def test_the_newest_ok_baseline_sets_the_configuration(tmp_path):
    p = str(tmp_path)
    add_run(p, "baseline", [1, 100, 100, 100], run_id="base-b8", batch_size=8)
    add_run(p, "baseline", [1, 200, 200, 200], run_id="base-b16")
    add_run(p, "tf32", [1, 50, 50, 50], run_id="tf32-b16")
    add_run(p, "bf16", [1, 25, 25, 25], run_id="bf16-medium", model="gpt2-medium")
    add_run(p, "torch_compile", [1, 20, 20, 20], run_id="tc-cpu", device="cpu")
    add_run(p, "fused", [1, 30, 30, 30], run_id="fused-capped", gpu_memory_gib=3.5)   # a smaller card's run
    add_run(p, "flash", [], status="oom", run_id="flash-oom", message="out of memory")
    add_run(p, "flash", [], status="skipped", run_id="flash-skip", message="no bf16")
    steps, runs = load(p)
    sel = select(runs, steps)
    chosen, excluded = sel.chosen, sel.excluded
    assert {r: row["run_id"] for r, row in chosen.items()} == {"baseline": "base-b16", "tf32": "tf32-b16"}
    reasons = {e.run_id: e.reason for e in excluded}
    assert reasons["base-b8"] == "batch 8 != 16"
    assert reasons["bf16-medium"] == "model gpt2-medium != gpt2"
    assert reasons["tc-cpu"] == "device cpu != cuda"
    assert reasons["fused-capped"] == "GPU_MEMORY_GIB 3.5 != (blank)"
    assert run_main(p)[0] == 0
    assert summary_table(p)["flash"]["status"] == "skipped"      # the newest run of the rung speaks for it
    assert summary_table(p)["tf32"]["speedup"] == "4.00x"


# ---------------------------------------------------------------------------------------------
# Every chart carries what was measured and where the figures come from, whole




def test_every_chart_carries_its_provenance_whole(ladder):
    report = build_report(*load(ladder[0]))
    for name, plot in CHART_PLOTS.items():
        fig = plot(report)
        foot = fig.get_supxlabel().replace("\n", " ")
        for part in ("torch 2.5.1", "commit 0123456789ab", "ran 2025-01-01"):
            assert part in foot, (name, part)
        assert not sticks_out(fig), name
    speedup_foot = CHART_PLOTS["speedup.png"](report).get_supxlabel()
    assert "95% bootstrap interval" in speedup_foot
    assert summary_text(ladder[0]).splitlines()[0].endswith(
        "data tiny · torch 2.5.1 · commit 0123456789ab · ran 2025-01-01")


def test_long_provenance_and_custom_runs_still_fit(tmp_path):
    """Many commits over several days, a long data path and runs named by their additions: every title and
    footnote is wrapped to its chart's width."""
    p = str(tmp_path)
    data = "/datasets/corpora/english/a-rather-long-folder-name/and-a-longer-file-name-for-good-measure.txt"
    add_run(p, "baseline", [1, 100, 100, 100], git_commit="1111111111111111", data=data)
    names = ["tf32", "bf16", "fused", "fused+loss", "bf16+flash+loss_kernel+torch_compile",
             "fused+gelu_epilogue+packed_attention+gemm_bias_grad+fold_clip", "max"]
    for i, name in enumerate(names):
        add_run(p, name, [1, 50 - i, 50 - i, 50 - i], git_commit=f"{i}abcdef{i}" * 2 + "-dirty", data=data)
    steps, runs = load(p)
    runs["started_at"] = [f"2025-01-{d:02d}T00:00:00" for d in range(1, len(runs) + 1)]
    runs["torch_version"] = [f"2.{d}.0+cu130" for d in range(len(runs))]
    report = build_report(steps, runs)
    assert len(report.provenance) > 250 and "ran 2025-01-01 to 2025-01-08" in report.provenance
    for name, plot in CHART_PLOTS.items():
        fig = plot(report)
        assert data[-20:] in fig.get_suptitle().replace("\n", ""), name
        assert not sticks_out(fig), name


def test_a_run_over_two_processes_reports_global_tokens_and_per_gpu_mfu(tmp_path):
    p = str(tmp_path)
    for rung, ms in (("baseline", 200.0), ("tf32", 100.0)):
        add_run(p, rung, [1, ms, ms, ms], mfu=[0.2] * 4, nproc=2, parallel="ddp", gpu_name="NVIDIA H200",
                device="cuda")
    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = summary_table(p)
    assert rows["tf32"]["tokens/s"] == f"{2 * BATCH * SEQ / 0.1:,.0f}"   # both processes' tokens
    assert rows["tf32"]["MFU"] == "20.0%"                                 # per GPU, as each step recorded it
    assert f"batch 2 × {BATCH} (2 processes, ddp) × seq_len" in summary_text(p).splitlines()[0]


def section_rows(prefix, heading, key=("run",)):
    """The tables of summary.md's section `heading` (up to the next section) as {run: {column header: cell text}};
    with several `key` columns, keyed by the tuple of their cells."""
    text = summary_text(prefix)
    assert heading in text
    section = text.split(heading)[1].split("\n## ")[0]
    rows, header = {}, None
    for ln in (ln for ln in section.splitlines() if ln.startswith("|")):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0] == "run":
            header = cells
        elif not set(cells[0]) <= set("-:"):
            row = dict(zip(header, cells))
            rows[tuple(row[k] for k in key) if len(key) > 1 else row[key[0]]] = row
    return rows


def ablation_rows(prefix):
    """summary.md's "Each addition against its base" tables."""
    return section_rows(prefix, "## Each addition against its base")


def test_the_summary_divides_each_leave_one_out_run_by_the_max_runs_of_its_commit(tmp_path):
    p = str(tmp_path)
    for i, ms in enumerate((30, 31, 35)):   # median 31, mean 32: the median of medians, as a repeated row has
        add_run(p, "max", [1, ms, ms, ms], git_commit="c1", run_id=f"max-{i}")
    add_run(p, "max-vocab_multiple", [1, 31, 31, 31], git_commit="c1")   # first in the registry, last by name
    add_run(p, "max-fp8_head", [1, 34, 34, 34], git_commit="c1")
    add_run(p, "max-prefetch", [1, 30.99, 30.99, 30.99], git_commit="c1")   # -0.03%: rounds to zero
    add_run(p, "max-sync_every", [1, 40, 40, 40], git_commit="c2")   # no max run of its commit
    add_run(p, "max-vocab_multiple-fp8_head", [1, 37.2, 37.2, 37.2], git_commit="c1")   # two left out together
    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = ablation_rows(p)
    assert rows["max-fp8_head"]["vs max"] == f"+{100 * (34 / 31 - 1):.1f}%"
    assert rows["max-fp8_head"]["max ms, same commit and GPU"] == "31.0"
    assert rows["max-prefetch"]["vs max"] == "+0.0%"     # not "-0.0%"
    assert rows["max"]["vs max"] == "-" and rows["max"]["median ms"] == "31.0"   # what its rows divide by
    assert rows["max"]["runs"] == "3" and rows["max-fp8_head"]["runs"] == "1" and rows["max"]["commit"] == "c1"
    assert "max-sync_every" not in rows and "max-sync_every" in summary_table(p)
    assert "Left out: max-sync_every (no max run of its commit)." in summary_text(p)
    # the registry's order, then the rows of two additions
    assert list(rows) == ["max", "max-vocab_multiple", "max-fp8_head", "max-prefetch", "max-vocab_multiple-fp8_head"]
    assert rows["max-vocab_multiple-fp8_head"]["vs max"] == "+20.0%"
    assert "positive is slower without it" in summary_text(p) and "## Each addition against its base" in out
    assert "no ok baseline run: speedups left out** (each addition against its base: see below)" in out


def test_each_run_is_divided_by_the_base_runs_of_its_own_gpu(tmp_path):
    # One commit measured in two calls that landed on two cards, each call with its own max run: a row divided
    # by the other card's max would show the cards' difference (here 10%) as the addition's.
    p = str(tmp_path)
    a, b, c = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"
    add_run(p, "max", [1, 30, 30, 30], git_commit="c1", gpu_uuid=a, run_id="max-a")
    add_run(p, "max-fp8_head", [1, 36, 36, 36], git_commit="c1", gpu_uuid=a)
    add_run(p, "max-prefetch", [1, 33, 33, 33], git_commit="c1", gpu_uuid=b)
    add_run(p, "max", [1, 33, 33, 33], git_commit="c1", gpu_uuid=b, run_id="max-b")
    add_run(p, "max-sync_every", [1, 34, 34, 34], git_commit="c1", gpu_uuid=b)
    add_run(p, "max-cudagraphs", [1, 30, 30, 30], git_commit="c1", gpu_uuid=c)   # no max run on its card
    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = ablation_rows(p)
    assert rows["max-fp8_head"]["vs max"] == "+20.0%" and rows["max-fp8_head"]["max ms, same commit and GPU"] == "30.0"
    assert rows["max-prefetch"]["vs max"] == "+0.0%" and rows["max-prefetch"]["max ms, same commit and GPU"] == "33.0"
    assert rows["max-sync_every"]["vs max"] == f"+{100 * (34 / 33 - 1):.1f}%"
    # the base's row: the card most rows were divided by, its one run
    assert rows["max"]["median ms"] == "33.0" and rows["max"]["runs"] == "1"
    assert "max-cudagraphs" not in rows
    assert "Left out: max-cudagraphs (no max run of its commit on its GPU)." in summary_text(p)


def test_rounds_of_pairs_that_do_not_differ_show_no_difference(tmp_path):
    # make ablation REPEAT=3: one slow round moves the base and the row alike, and the medians see through it.
    p = str(tmp_path)
    for i, ms in enumerate((30, 30, 45)):
        add_run(p, "max", [1, ms, ms, ms], run_id=f"max-{i}")
        add_run(p, "max-prefetch", [1, ms, ms, ms], run_id=f"max-prefetch-{i}")
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = ablation_rows(p)
    assert rows["max-prefetch"]["vs max"] == "+0.0%" and rows["max-prefetch"]["runs"] == "3"


def test_the_base_row_shows_the_runs_its_rows_were_divided_by(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", [1, 30, 30, 30], git_commit="c1", run_id="max-a")
    add_run(p, "max", [1, 30, 30, 30], git_commit="c1", run_id="max-b")
    add_run(p, "max-prefetch", [1, 33, 33, 33], git_commit="c1")
    add_run(p, "max", [1, 20, 20, 20], git_commit="c2")   # the latest max, but no row of its commit
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = ablation_rows(p)
    assert rows["max"]["commit"] == "c1" and rows["max"]["runs"] == "2" and rows["max"]["median ms"] == "30.0"
    assert rows["max-prefetch"]["vs max"] == "+10.0%"


def test_the_summary_divides_each_added_run_by_the_fused_runs_of_its_commit(tmp_path):
    p = str(tmp_path)
    add_run(p, "fused", [1, 40, 40, 40], git_commit="c1")
    add_run(p, "fused+loss_kernel", [1, 38, 38, 38], git_commit="c1")
    add_run(p, "fused+8bit", [], status="skipped", message="no bitsandbytes", git_commit="c1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = ablation_rows(p)
    assert rows["fused+loss_kernel"]["vs fused"] == "-5.0%"
    assert set(rows) == {"fused", "fused+loss_kernel"}   # a skipped run has no time to divide
    assert "negative is faster with the addition" in summary_text(p)


def test_a_ladder_without_ablation_runs_has_no_ablation_section(tmp_path):
    p = str(tmp_path)
    add_run(p, "fused", [1, 40, 40, 40])
    add_run(p, "max", [1, 30, 30, 30])
    rc, _, err = run_main(p)
    assert rc == 0, err
    assert "Each addition against its base" not in summary_text(p) and "see below" not in summary_text(p)


def test_a_base_run_of_another_configuration_is_not_divided_by(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", [1, 10, 10, 10], git_commit="c1", batch_size=4)   # another batch: the table leaves it out
    add_run(p, "max", [1, 30, 30, 30], git_commit="c1")
    add_run(p, "max-fp8_head", [1, 33, 33, 33], git_commit="c1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    assert ablation_rows(p)["max-fp8_head"]["vs max"] == "+10.0%"


def test_runs_whose_commit_is_unknown_are_not_paired(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", [1, 30, 30, 30], git_commit="")
    add_run(p, "max-fp8_head", [1, 33, 33, 33], git_commit="")
    rc, _, err = run_main(p)
    assert rc == 0, err
    assert "Left out: max-fp8_head (its commit is not recorded)." in summary_text(p)
    assert "vs max" not in summary_text(p) and "see below" not in summary_text(p)   # nothing was paired


def test_a_folder_with_both_ablations_shows_each_against_its_own_base(tmp_path):
    p = str(tmp_path)
    add_run(p, "fused", [1, 40, 40, 40], git_commit="c1")
    add_run(p, "fused+loss_kernel", [1, 36, 36, 36], git_commit="c1")
    add_run(p, "max", [1, 30, 30, 30], git_commit="c1")
    add_run(p, "max-prefetch", [1, 33, 33, 33], git_commit="c1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    text = summary_text(p)
    assert text.index("The fused rung with each addition alone") < text.index("`max` without each of its additions")
    rows = ablation_rows(p)
    assert rows["fused+loss_kernel"]["vs fused"] == "-10.0%" and rows["max-prefetch"]["vs max"] == "+10.0%"


def peer_rows(prefix):
    """summary.md's "against the peers" table."""
    return section_rows(prefix, "against the peers")


def test_the_summary_divides_each_peer_by_the_fastest_rung_of_its_commit(tmp_path):
    p = str(tmp_path)
    add_run(p, "fused", [1, 40, 40, 40], git_commit="c1")
    for i, ms in enumerate((30, 31, 35)):   # median of medians 31, as a REPEAT's rows
        add_run(p, "max", [1, ms, ms, ms], git_commit="c1", run_id=f"max-{i}")
    for i, ms in enumerate((36, 37.2, 40)):   # 37.2 / 31 = 1.2
        add_run(p, "peer-llmc", [1, ms, ms, ms], git_commit="c1", run_id=f"llmc-{i}")
    add_run(p, "peer-hf", [1, 24.8, 24.8, 24.8], git_commit="c1")   # faster than max: 31 / 24.8 = 1.25
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = peer_rows(p)
    assert list(rows) == ["max", "peer-hf", "peer-llmc"]   # the fastest rung first: max, not fused
    assert rows["peer-llmc"]["max is"] == "1.200x faster" and rows["peer-llmc"]["runs"] == "3"
    assert rows["peer-hf"]["max is"] == "1.250x slower" and rows["peer-hf"]["max ms, same commit and GPU"] == "31.0"
    assert rows["max"]["median ms"] == "31.0" and rows["max"]["runs"] == "3"


def test_each_compared_row_shows_the_clock_range_of_its_own_runs(tmp_path):
    # Under a power cap two runs of one trainer differ by their clocks: the reader sees whether max and a peer
    # ran at the same clock, over each row's runs from the compared commit and card only.
    p = str(tmp_path)
    for i, mhz in enumerate((1620, 1605, 1620)):
        add_run(p, "max", [1, 30, 30, 30], git_commit="c1", gpu_uuid="GPU-a", run_id=f"max-{i}",
                sm_clock_mhz_median=mhz)
    add_run(p, "max", [1, 29, 29, 29], git_commit="c1", gpu_uuid="GPU-b", run_id="max-b", sm_clock_mhz_median=1980)
    for i, mhz in enumerate((1650, 1635)):
        add_run(p, "peer-llmc", [1, 36, 36, 36], git_commit="c1", gpu_uuid="GPU-a", run_id=f"llmc-{i}",
                sm_clock_mhz_median=mhz)
    add_run(p, "peer-hf", [1, 45, 45, 45], git_commit="c1", gpu_uuid="GPU-a")   # no clock recorded
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = peer_rows(p)
    assert rows["max"]["SM MHz"] == "1,605–1,620"   # GPU-b's run at 1,980 is another card's
    assert rows["peer-llmc"]["SM MHz"] == "1,635–1,650" and rows["peer-hf"]["SM MHz"] == "-"


def test_a_peer_of_another_commit_is_named_not_divided(tmp_path):
    p = str(tmp_path)
    add_run(p, "max", [1, 30, 30, 30], git_commit="c1")
    add_run(p, "peer-llmc", [1, 36, 36, 36], git_commit="c2")
    rc, _, err = run_main(p)
    assert rc == 0, err
    assert "Left out: peer-llmc (no max run of its commit)." in summary_text(p)
    assert "max is" not in summary_text(p)


def test_a_folder_without_peers_or_without_rungs_has_no_peers_section(tmp_path):
    rungs, peers = str(tmp_path / "rungs"), str(tmp_path / "peers")
    add_run(rungs, "max", [1, 30, 30, 30])
    add_run(peers, "peer-llmc", [1, 36, 36, 36])
    for p in (rungs, peers):
        rc, _, err = run_main(p)
        assert rc == 0, err
        assert "against the peers" not in summary_text(p)


def test_under_a_memory_cap_the_memory_chart_shows_the_cap_and_each_rungs_micro_batch(tmp_path):
    # Every rung fills the same cap; what a memory saving bought is the micro-batch beside its bar.
    p = str(tmp_path)
    for rung, micro, mem in (("baseline", 2, (3.2, 3.5)), ("max", 16, (2.4, 3.3))):
        add_run(p, rung, [1, 100, 100, 100], mem=mem, micro_batch=micro, accumulation_steps=BATCH // micro,
                gpu_memory_gib=3.5)
    fig = CHART_PLOTS["memory.png"](build_report(*load(p)))
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert " 3.2, micro-batch 2" in texts and " 2.4, micro-batch 16" in texts
    assert "GPU_MEMORY_GIB=3.5" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert [line.get_xdata()[0] for line in ax.lines] == [3.5] and not sticks_out(fig)
