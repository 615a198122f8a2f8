"""summary.md: the ladder table in ladder order, how its numbers were made, the runs left out, the notes; the
fastest rung against the peers; each addition against its base; and, where a rung was run at several GPU counts,
its scaling table."""
import os

import numpy as np
import pandas as pd

from Utils.report import markdown
from Utils.report.comparison import CLOCK_HIGH, CLOCK_LOW, SAME, Comparison
from Utils.report.loss import LOSS_MIN_STEPS, LOSS_WINDOW, LossSet
from Utils.report.scaling import GOALS, Scaling
from Utils.report.stats import BOOTSTRAP_RESAMPLES, NO_BASELINE_NOTE, NOISY_IQR, TRIM, Report
from Utils.results.files import write_atomic
from Utils.results.gpus import gpu_spec
from Utils.results.schema import step_timing

SUMMARY_FILE = "summary.md"
TABLE_HEADER = ["rung", "runs", "micro-batch", "median ms", "IQR ms", "trimmed mean ms", "spread", "noisy", "speedup", "tokens/s",
                "MFU", "MFU of measured peak", "peak alloc GiB", "peak reserved GiB", "compile s", "cache",
                "attention", "final loss", "status"]
SCALING_HEADER = ["rung", "GPUs", "parallel", "median ms", "global tokens/s", "tokens/s per GPU", "efficiency"]
ABLATION_WORDS = {   # base -> what its runs are, and which sign means the addition pays
    "fused": "The fused rung with each addition alone (`make ablation`): negative is faster with the addition.",
    "max": "`max` without each of its additions (`make ablation FROM=max`): positive is slower without it, so the "
           "addition pays.",
}


def table_rows(table: pd.DataFrame) -> list[list[str]]:
    """summarize()'s frame as the text cells of summary.md's table, header first."""
    rows = [TABLE_HEADER]
    for rung, r in table.iterrows():
        micro = (f"{r['micro_batch']:.0f} × {r['accumulation_steps']:.0f}" if np.isfinite(r["micro_batch"]) else "-")
        rows.append([rung, markdown.cell(r["runs"], ".0f"), micro, markdown.cell(r["median_step_ms"], ".1f"),
                     markdown.cell(r["iqr_step_ms"], ".1f"), markdown.cell(r["trimmed_mean_ms"], ".1f"),
                     markdown.cell(100 * r["spread"], ".1f", "%"), "yes" if r["noisy"] == 1 else "-",
                     markdown.cell(r["speedup"], ".2f", "x"), markdown.cell(r["tokens_per_s"], ",.0f"),
                     markdown.cell(100 * r["mfu"], ".1f", "%"), markdown.cell(100 * r["mfu_measured"], ".1f", "%"),
                     markdown.cell(r["peak_mem_allocated_gib"], ".1f"), markdown.cell(r["peak_mem_reserved_gib"], ".1f"),
                     markdown.cell(r["compile_s"], ".1f"), r["compile_cache"] or "-", r["attention_kernel"] or "-",
                     markdown.cell(r["final_loss"], ".3f"), r["status"]])
    return rows


def mfu_text(report: Report) -> str:
    """What the two MFU columns divide by."""
    ref = report.reference
    spec = gpu_spec(str(ref["gpu_name"])) if ref is not None else None
    text = (f"MFU divides the model's FLOPs (6N + attention, per token) at the median step time by the "
            f"datasheet's dense bf16 peak ({spec.bf16 / 1e12:,.0f} TFLOP/s, {spec.source})" if spec else
            "MFU divides the model's FLOPs (6N + attention, per token) at the median step time by the GPU's "
            "datasheet dense bf16 peak (none known for this device)")
    if report.peak is not None:
        p = report.peak
        text += (f"; MFU of measured peak by the {p['matmul_tflops']:,.0f} TFLOP/s that a "
                 f"{p['matmul_n']:.0f}-square bf16 matmul reached on this machine (make peak, "
                 f"{str(p['measured_at'])[:10]})")
    else:
        text += "; MFU of measured peak needs `make peak PREFIX=...` on this machine"
    return text + "."


def scaling_rows(table: pd.DataFrame) -> list[list[str]]:
    """scaling_table's frame as the text cells of summary.md's scaling table, header first."""
    rows = [SCALING_HEADER]
    for _, r in table.iterrows():
        rows.append([r["rung"], f"{r['nproc']:d}", r["parallel"] or "-", markdown.cell(r["median_step_ms"], ".1f"),
                     markdown.cell(r["global_tokens_per_s"], ",.0f"), markdown.cell(r["tokens_per_s_per_gpu"], ",.0f"),
                     markdown.cell(100 * r["efficiency"], ".1f", "%")])
    return rows


def scaling_section(scaling: "Scaling | None") -> list[str]:
    """The lines of the "## Scaling" section: the rungs measured at two or more GPU counts, how the numbers
    were made, and the notes; none where no rung was."""
    table = scaling.scaled() if scaling is not None else None
    if table is None or table.empty:
        return []
    goals = ", ".join(f"{100 * g:.0f}% on {n} GPUs" for n, g in GOALS.items())
    lines = ["", "## Scaling", "", markdown.table(scaling_rows(table), left=(0, 2)), ""]
    lines.append("Each rung's latest ok run at each GPU count with the work of its latest ok 1-GPU run (batch "
                 "per GPU, seq_len, model, data, GPU) and one parallel strategy. median ms: the median measured "
                 "step time, each step timed as its slowest rank's; global tokens/s = GPUs × batch per GPU × "
                 "seq_len / median step time; efficiency = global tokens/s / (GPUs × the 1-GPU run's), given "
                 f"only for runs of one commit on one kind of GPU (goals: {goals}). scaling.png draws them.")
    if scaling.notes:
        lines += [""] + [f"- {n}" for n in scaling.notes]
    return lines


COMPARISON_HEADER = ["run", "commit", "runs", "median ms", "IQR ms", "SM MHz"]
CLOCK_WORDS = ("SM MHz: the median SM clock over each run's measured steps (NVML), lowest–highest where the row "
               "has several runs; under a power cap it moves from run to run and card to card, and the step time "
               "with it.")


def comparison_cells(run: str, r: pd.Series) -> list[str]:
    """The first cells of a comparison's row (comparison.compare_runs's frame), as COMPARISON_HEADER names them."""
    low, high = r[CLOCK_LOW], r[CLOCK_HIGH]
    clock = "-" if pd.isna(low) else f"{low:,.0f}" if low == high else f"{low:,.0f}–{high:,.0f}"
    return [run, r["commit"], markdown.cell(r["runs"], ".0f"), markdown.cell(r["median ms"], ".1f"),
            markdown.cell(r["IQR ms"], ".1f"), clock]


def ablation_section(sets: "list[Comparison] | None") -> list[str]:
    """The lines of the "## Each addition against its base" section: one table a base (ablation.ablation_sets),
    each run against its base's runs from the same commit, and the runs left out; none where no run is named
    after a base."""
    if not sets:
        return []
    lines = ["", "## Each addition against its base"]
    for found in sets:
        base, frame = found.base, found.table
        lines += ["", ABLATION_WORDS[base]]
        if found.compared:
            rows = [COMPARISON_HEADER + [f"vs {base}", f"{base} ms, {SAME}", "peak alloc GiB"]]
            for run, r in frame.iterrows():
                rows.append(comparison_cells(run, r) + [
                    markdown.cell(round(100 * r[f"vs {base}"], 1) + 0.0, "+.1f", "%"),   # + 0.0: no "-0.0%"
                    markdown.cell(r[f"{base} ms, {SAME}"], ".1f"), markdown.cell(r["peak alloc GiB"], ".1f")])
            lines += ["", markdown.table(rows, left=(0, 1))]
        if found.left_out:
            lines += ["", f"Left out: {', '.join(found.left_out)}."]
    lines += ["", "Each run is divided by the median of the median steps of its base's runs from its own commit on "
                  "its own GPU, among the runs the table above compares; the base's row shows them for the commit "
                  "and GPU most rows were divided by. The "
                  "clock and power state of the GPU move a run's median by a percent or two, so a difference that "
                  "small needs several runs of each: `make ablation REPEAT=n` runs n rounds, alternated. " + CLOCK_WORDS]
    return lines


LOSS_HEADER = ["run", "steps", "seed", "commits", "runs with / without", "with", "without", "gap",
               "seeds' gap without", "kept"]


def loss_section(sets: "list[LossSet] | None") -> list[str]:
    """The lines of the "## The loss with each addition and without it" section: for each base (max, fused) the
    SeedRows of loss.loss_set and the runs left out; none where no base has either."""
    if not sets:
        return []
    lines = ["", "## The loss with each addition and without it"]
    for found in sets:
        with_, without = ("`max`", "the run named") if found.base == "max" else ("the run named", "`fused`")
        lines += ["", f"With: {with_}; without: {without}."]
        if found.rows:
            table = [LOSS_HEADER]
            for r in found.rows:
                kept = "-" if r.kept is None else "yes" if r.kept else "no"
                table.append([r.name, str(r.steps), str(r.seed), ", ".join(r.commits) or "-",
                              f"{r.runs_with} / {r.runs_without}", f"{r.with_mean:.3f}", f"{r.without_mean:.3f}",
                              f"{round(r.gap, 3) + 0.0:+.3f}",   # + 0.0: no "-0.000"
                              markdown.cell(r.seeds_gap, ".3f"), kept])
            lines += ["", markdown.table(table, left=(0, 3, 9))]
        if found.left_out:
            lines += ["", f"Left out, not ended ok: {', '.join(found.left_out)}."]
    lines += ["", f"The mean loss over each run's last {LOSS_WINDOW} steps, in runs of {LOSS_MIN_STEPS} steps or more, "
                  "with the addition and without it at the same seed and number of steps (a seed run several times: "
                  "the mean of its runs' means); a run named with several additions leaves all of them out, and its "
                  "rows judge them together. gap = with − without: positive is a higher loss with the addition. "
                  "seeds' gap without: the largest minus the smallest of those means over every seed the run "
                  "without ran at in this folder, seeds without a row included. kept: |gap| ≤ seeds' gap, so the "
                  "change the addition makes cannot be told from a change of seed (with two seeds, that gap is a "
                  "single measurement); '-' where the run without ran at one seed. A card changes the step "
                  "time, not the loss, so runs of any GPU are paired; runs of any commit too, which the table "
                  "names, since a commit that changes the numerics changes the loss. `make ablation ... STEPS=300 "
                  "SEED=n` at two seeds or more fills the table."]
    return lines


def peers_section(found: "Comparison | None") -> list[str]:
    """The lines of the "## <rung> against the peers" section (peers.peer_comparison): how many times faster
    the fastest rung is than each peer, from the same commit; none where no peer was compared or left out."""
    if found is None or not (found.compared or found.left_out):
        return []
    base = found.base
    lines = ["", f"## `{base}` against the peers"]
    if found.compared:
        rows = [COMPARISON_HEADER + [f"{base} is", f"{base} ms, {SAME}"]]
        for run, r in found.table.iterrows():
            ratio = 1 + r[f"vs {base}"]   # the peer's median over the rung's
            rows.append(comparison_cells(run, r) + [
                "-" if run == base else f"{ratio:.3f}x faster" if ratio >= 1 else f"{1 / ratio:.3f}x slower",
                markdown.cell(r[f"{base} ms, {SAME}"], ".1f")])
        lines += ["", markdown.table(rows, left=(0, 1, 6))]
    if found.left_out:
        lines += ["", f"Left out: {', '.join(found.left_out)}."]
    lines += ["", f"Each peer's median step (the median of its runs' medians, where it ran several times) against "
                  f"the median of `{base}`'s runs from the same commit on the same GPU, the fastest rung here. `make peers "
                  f"RUNG={base} REPEAT=n` runs `{base}` and the peers in n alternated rounds, so that both are "
                  "measured across the same stretch of the GPU's clock and power. " + CLOCK_WORDS]
    return lines


def timing_sentence(report: Report) -> str:
    """How the compared runs' steps were timed (their selection matches on it): end to end since schema
    version 2, each step alone before."""
    version = report.reference.get("schema_version") if report.reference is not None else None
    if step_timing(version) == "end to end":
        return ("A step's time runs from the previous step's end to its own end on the device, so that the "
                "measured steps add up to the wall clock.")
    return ("These runs were recorded before schema version 2: each step was timed alone, by CUDA events around "
            "it, so that the measured steps leave out the host's time between them.")


def render_summary(report: Report, scaling: "Scaling | None" = None,
                   ablation: "list[Comparison] | None" = None, peers: "Comparison | None" = None,
                   loss: "list[LossSet] | None" = None) -> str:
    """summary.md's text: heading (what was measured, and where the figures come from), the table in ladder
    order, excluded runs, notes; the fastest rung against the peers where `peers` (peers.peer_comparison)
    compares any; each addition against its base where `ablation` (ablation.ablation_sets) holds a set; the loss
    with each addition and without it where `loss` (loss.loss_sets) holds a set; and the scaling section where
    `scaling` (scaling.build_scaling) holds a rung measured at two or more GPU counts."""
    lines = [f"# Ladder results: {report.context} · {report.provenance}", ""]
    if not report.has_baseline:
        compared = " (each addition against its base: see below)" if any(f.compared for f in ablation or []) else ""
        lines += [f"**{NO_BASELINE_NOTE}**{compared}", ""]
    lines += [markdown.table(table_rows(report.table), left=(0, len(TABLE_HEADER) - 1)), ""]
    lines.append(f"{timing_sentence(report)} Median and IQR (75th minus 25th percentile) of the "
                 "step time over each run's measured steps, warm-up left out; a rung run several times from one "
                 "commit (REPEAT=n) shows the median of its runs' medians (the IQR is the latest run's), the spread between "
                 "those medians "
                 f"((max - min) / median) and the mean of all its steps without the {TRIM:.0%} at each end. "
                 f"noisy: a run's IQR is over {NOISY_IQR:.0%} of its median. "
                 "speedup = baseline median / rung median; tokens/s = global batch (processes × batch) × seq_len / "
                 "median step time; MFU is per GPU; micro-batch: rows one forward/backward held × micro-batches a "
                 "step accumulated (MICRO_BATCH; every rung does the same batch a step, so a memory saving that "
                 "fits a larger micro-batch shows as speed); attention: the kernel a warm-up step of the run ran (flash2: "
                 "FlashAttention-2, cudnn: cuDNN's fused attention, written_out: no SDPA), a rung@backend row a run "
                 "with SDPA_BACKEND pinned. "
                 f"{mfu_text(report)} speedup.png's whiskers: 95% bootstrap interval of the ratio of medians "
                 f"({BOOTSTRAP_RESAMPLES} resamples of the measured step times): the spread within runs, not "
                 f"between them, which the spread column shows.")
    if report.excluded:
        lines += ["", "## Excluded runs", ""]
        lines += [f"- {e.run_id} ({e.rung}): {e.reason}" for e in report.excluded]
    if report.notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in report.notes]
    lines += peers_section(peers)
    lines += ablation_section(ablation)
    lines += loss_section(loss)
    lines += scaling_section(scaling)
    return "\n".join(lines) + "\n"


def write_summary(report: Report, path: str | os.PathLike, scaling: "Scaling | None" = None,
                  ablation: "list[Comparison] | None" = None, peers: "Comparison | None" = None,
                  loss: "list[LossSet] | None" = None) -> str:
    """Write render_summary(report, scaling, ablation, peers, loss) to path through a temporary file; return the
    text."""
    text = render_summary(report, scaling, ablation, peers, loss)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return text
