"""The numbers a ladder report shows, from the compared runs' measured steps: median and IQR of the step
time, speedup over the baseline with a bootstrap interval, tokens/s, MFU; and the notes and captions that
go with them.

Median and IQR are recomputed here from the measured (non-warm-up) step times in results.csv, so that the
table and the charts rest on the same numbers; runs.csv supplies status, memory, compile time and the
environment. A rung run several times from one commit (`make max REPEAT=3`) is shown by the median of its
runs' medians, since runs differ more than steps within one (a card at its power cap moves a whole run), with
the trimmed mean of all their steps and the spread of the runs' medians beside it; a run whose IQR is over
NOISY_IQR of its median is flagged as noisy, and a step whose loss stands far above its neighbours' is noted.

MFU is shown two ways: against the datasheet's dense bf16 peak (Utils.results.gpus) and, where
`make peak` measured this machine, against the rate it reached on a large bf16 matmul.
"""
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from Utils.ladder.registry import ADDITIONS, rung_order
from Utils.report.selection import BASELINE, Excluded, Selection, measured, norm, select, steps_by_run
from Utils.results.gpus import peak_bf16_flops
from Utils.results.read import recorded_additions

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
NO_BASELINE_NOTE = "no ok baseline run: speedups left out"
NOISY_IQR = 0.05       # a run whose steps' IQR is over 5% of their median is flagged as noisy
TRIM = 0.10            # the trimmed mean drops this share of the steps at each end
# A loss spike: a step's loss over LOSS_SPIKE nats above the median of the SPIKE_WINDOW steps around it, after
# SPIKE_AFTER (before it the loss falls too fast for its neighbours to describe it). Over the 267 runs in results/
# the largest such excess is 0.46 nats but for two trainers' steps: llm.c's step 23 at 124M batch 64 (1.3 to 1.6
# nats, in every run of it) and max's step 28 at gpt2-medium seed 42 (0.9 to 2.4, in five of its six runs;
# BENCHMARKS.md, gpt2-medium at seed 42).
LOSS_SPIKE = 0.8
SPIKE_WINDOW = 9
SPIKE_AFTER = 15

SUMMARY_COLUMNS = ["run_id", "status", "message", "runs", "median_step_ms", "iqr_step_ms", "trimmed_mean_ms",
                   "spread", "noisy", "speedup", "speedup_lo", "speedup_hi", "tokens_per_s", "mfu", "mfu_measured",
                   "peak_mem_allocated_gib", "peak_mem_reserved_gib", "compile_s", "compile_cache", "final_loss",
                   "measured_steps", "attention_kernel", "micro_batch", "accumulation_steps", "gpu_memory_gib"]
TEXT_COLUMNS = ("run_id", "status", "message", "compile_cache", "attention_kernel")


def _number(value: object, default: float) -> float:
    """A number cell of runs.csv, or `default` where it is blank (a column an older schema lacked)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    return default if np.isnan(v) else v


def trimmed_mean(values: np.ndarray, trim: float = TRIM) -> float:
    """The mean of `values` without the lowest and highest `trim` share of them (as scipy.stats.trim_mean)."""
    v = np.sort(np.asarray(values, dtype=float))
    cut = int(trim * v.size)
    return float(v[cut:v.size - cut].mean())


def noisy(ms: np.ndarray) -> bool:
    """A run whose measured steps' IQR is over NOISY_IQR of their median."""
    q25, median, q75 = np.percentile(np.asarray(ms, dtype=float), [25, 50, 75])
    return bool(q75 - q25 > NOISY_IQR * median)


def loss_spikes(steps: pd.DataFrame) -> list[tuple[int, float, float]]:
    """(step, loss, the median of the SPIKE_WINDOW steps centred on it) for each step of one run's rows, warm-up
    included, after SPIKE_AFTER, whose loss is over LOSS_SPIKE above that median: a spike which the steps around
    it do not share (an update that overshot once, or a fault of that step). Losses that are not finite are left
    out, as steps without a loss are."""
    loss = steps.set_index("step")["loss"].replace([np.inf, -np.inf], np.nan).dropna().sort_index()
    # At a run's last steps the window holds fewer steps: at least the step and the 4 before it.
    around = loss.rolling(SPIKE_WINDOW, center=True, min_periods=SPIKE_WINDOW // 2 + 1).median()
    over = ((loss - around) > LOSS_SPIKE).to_numpy() & (loss.index.to_numpy() > SPIKE_AFTER)
    # By position, not by step: a results.csv merged by hand may hold a step number twice.
    return [(int(step), float(value), float(median)) for step, value, median in
            zip(loss.index[over], loss.to_numpy()[over], around.to_numpy()[over])]


def bootstrap_speedup(base_ms: np.ndarray, rung_ms: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """95% bootstrap interval (2.5th, 97.5th percentile) of median(base_ms) / median(rung_ms)."""
    rng = np.random.default_rng(seed)
    base = np.asarray(base_ms, dtype=float)
    rung = np.asarray(rung_ms, dtype=float)
    base_medians = np.median(rng.choice(base, size=(resamples, base.size)), axis=1)
    rung_medians = np.median(rng.choice(rung, size=(resamples, rung.size)), axis=1)
    lo, hi = np.percentile(base_medians / rung_medians, [2.5, 97.5])
    return float(lo), float(hi)


@dataclass
class Report:
    """Everything the summary and the charts show; build it with build_report(steps_df, runs_df)."""
    table: pd.DataFrame          # summarize()'s frame
    steps: pd.DataFrame          # step rows of the compared runs, sorted by rung then step
    runs: pd.DataFrame           # runs.csv rows of the compared runs, in ladder order
    reference: "pd.Series | None"   # the run whose configuration the compared runs share
    has_baseline: bool
    excluded: list[Excluded]
    notes: list[str]             # lines for the notes section
    context: str                 # GPU, model, batch, seq_len, data: the title of every chart
    provenance: str = ""         # torch, commits, dates of the compared runs: the foot of every chart
    peak: "pd.Series | None" = None   # the measured peak (peak.csv's row) that mfu_measured divides by
    measured_ms: dict = field(default_factory=dict)   # rung -> the measured step times of all the runs its
                                                      # row stands for (several where it was repeated)

    def rungs_with_steps(self) -> list[str]:
        """The rungs that have a median step time, in table order."""
        return [r for r in self.table.index if np.isfinite(self.table.at[r, "median_step_ms"])]


def build_report(steps_df: pd.DataFrame, runs_df: pd.DataFrame, peaks: "pd.DataFrame | None" = None) -> Report:
    """Select the runs (selection.select) and compute the table, notes and captions from load()'s frames;
    `peaks` (read.load_peak's frame) gives the measured peak for the second MFU."""
    sel = select(runs_df, steps_df)
    by_run = steps_by_run(steps_df)
    base_runs = _rung_steps(sel, by_run, BASELINE) if sel.has_baseline else None
    base = (np.concatenate(base_runs), float(np.median([np.median(ms) for ms in base_runs]))) if base_runs else None
    peak = _measured_peak(peaks, sel.reference)

    rows, step_frames, notes, measured_ms = {}, [], [], {}
    for rung in rung_order(runs_df["optimization"]):
        if sel.chosen.get(rung) is not None:
            rows[rung], measured_ms[rung], frame, rung_notes = _measured_row(rung, sel, by_run, base, peak)
            step_frames.append(frame)
            notes += rung_notes
        else:
            rows[rung] = _status_row(rung, sel)
            notes.append(f"{rung} ({rows[rung]['status']}): {one_line(rows[rung]['message']) or 'no message recorded'}")
    notes += _selection_notes(sel, by_run)

    table = _table(rows)
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else steps_df.iloc[0:0]
    compared = pd.DataFrame([sel.chosen[r] for r in table.index if r in sel.chosen], columns=runs_df.columns)
    # every run behind a row, a repeated rung's runs included: they may come from several cards
    behind = [run for r in table.index if r in sel.chosen for run in sel.repeats.get(r, [sel.chosen[r]])]
    notes += mixed_sources(pd.DataFrame(behind, columns=runs_df.columns))
    return Report(table=table, steps=steps, runs=compared, reference=sel.reference, has_baseline=sel.has_baseline,
                  excluded=sel.excluded, notes=notes, context=context(sel.reference),
                  provenance=provenance(compared), peak=peak, measured_ms=measured_ms)


def _rung_steps(sel: Selection, by_run: dict, rung: str) -> list[np.ndarray]:
    """The measured step times of the rung's chosen run, or of all its repeated runs, one array each."""
    runs = sel.repeats.get(rung) or [sel.chosen[rung]]
    return [measured(by_run[r["run_id"]])["step_ms"].to_numpy() for r in runs]


def _measured_row(rung: str, sel: Selection, by_run: dict, base: "tuple[np.ndarray, float] | None",
                  peak: "pd.Series | None") -> tuple[dict, np.ndarray, pd.DataFrame, list[str]]:
    """(table row, measured step times, step rows, notes) of a rung with a chosen run: its figures over the
    measured steps of that run or of its repeats, and its speedup over `base` (the baseline's steps and median)."""
    run = sel.chosen[rung]
    run_steps = by_run[run["run_id"]]
    each = _rung_steps(sel, by_run, rung)
    ms = np.concatenate(each)
    medians = [float(np.median(m)) for m in each]
    median = float(np.median(medians))
    q25, q75 = np.percentile(each[-1], [25, 75])
    row = dict.fromkeys(SUMMARY_COLUMNS, np.nan)
    row.update(run_id=run["run_id"], status=run["status"], message=run["message"], runs=len(each),
               median_step_ms=median, iqr_step_ms=q75 - q25, trimmed_mean_ms=trimmed_mean(ms),
               spread=(max(medians) - min(medians)) / median if len(each) > 1 else np.nan,
               noisy=float(any(noisy(m) for m in each)), measured_steps=ms.size,
               tokens_per_s=nproc_of(run) * run["batch_size"] * run["seq_len"] / (median / 1000.0),
               peak_mem_allocated_gib=run["peak_mem_allocated_gib"],
               peak_mem_reserved_gib=run["peak_mem_reserved_gib"], compile_s=run["compile_s"],
               compile_cache=norm(run.get("compile_cache", "")),
               attention_kernel=norm(run.get("attention_kernel", "")),
               # before schema version 4 a step was one micro-batch: the whole batch
               micro_batch=_number(run.get("micro_batch"), run["batch_size"]),
               accumulation_steps=_number(run.get("accumulation_steps"), 1.0),
               gpu_memory_gib=_number(run.get("gpu_memory_gib"), np.nan))
    runs = sel.repeats.get(rung) or [run]
    all_steps = pd.concat([measured(by_run[r["run_id"]]) for r in runs])
    row["mfu"], row["mfu_measured"] = _mfus(runs, all_steps, row["tokens_per_s"], peak)
    losses = run_steps["loss"].dropna()
    row["final_loss"] = float(losses.iloc[-1]) if len(losses) else run["final_loss"]
    if base is not None:
        row["speedup"] = base[1] / median
        row["speedup_lo"], row["speedup_hi"] = bootstrap_speedup(base[0], ms)
    notes = [f"{rung}: {one_line(run['notes'])}"] if run["notes"].strip() else []
    notes += [f"{rung}: run {r['run_id']} is noisy: its steps' IQR is {q:.1%} of their median "
              f"(over {NOISY_IQR:.0%})" for r, q in _noisy_runs(runs, each)]
    notes += [f"{rung}: run {r['run_id']}'s loss at step {step} is {loss:.2f}, {loss - around:.2f} over the median "
              f"of the {SPIKE_WINDOW} steps centred on it: a spike which the steps around it do not share"
              for r in runs for step, loss, around in loss_spikes(by_run[r["run_id"]])]
    return row, ms, run_steps.assign(optimization=rung), notes


def _status_row(rung: str, sel: Selection) -> dict:
    """The table row of a rung without a compared run: the status and message of its latest run, or
    "excluded" with why its runs were left out."""
    row = dict.fromkeys(SUMMARY_COLUMNS, np.nan)
    shown = sel.status_rows.get(rung)
    if shown is None:
        row.update(run_id="", status="excluded", message="no run with the compared configuration (see excluded runs)")
        return row
    left_out = next((e.reason for e in sel.excluded if e.run_id == shown["run_id"]), "")
    if shown["status"] == "ok":
        row.update(run_id=shown["run_id"], status="excluded", message=left_out)
    else:
        message = one_line(shown["message"]) + (f" ({left_out})" if left_out else "")
        row.update(run_id=shown["run_id"], status=shown["status"], message=message.strip())
    return row


def _selection_notes(sel: Selection, by_run: dict) -> list[str]:
    """The notes on the selection as a whole: later runs that did not end ok, superseded runs, repeated rungs,
    FP8 GEMMs and synthetic data."""
    notes = []
    for run in sel.newer_not_ok:
        notes.append(f"{run['optimization']}: a later run, {run['run_id']}, ended {run['status']}"
                     f"{': ' + one_line(run['message']) if run['message'].strip() else ''}; "
                     f"the table shows the earlier ok run")
    superseded = sel.superseded - sum(len(runs) - 1 for runs in sel.repeats.values())   # repeats are shown
    if superseded:
        notes.append(f"{superseded} older ok run(s) of the same configuration were superseded "
                     f"by a later run of their rung")
    return notes + _repeat_notes(sel.repeats, by_run) + _fp8_note(sel.chosen) + _synthetic_note(sel.reference)


def _table(rows: dict[str, dict]) -> pd.DataFrame:
    """The summary table of the rows, one a rung: numbers as floats, the text columns as text."""
    table = pd.DataFrame.from_dict(rows, orient="index", columns=SUMMARY_COLUMNS)
    table.index.name = "optimization"
    for col in SUMMARY_COLUMNS:
        if col not in TEXT_COLUMNS:
            table[col] = table[col].astype(float)
    for col in ("compile_cache", "attention_kernel"):
        table[col] = table[col].fillna("").astype(str)
    return table


def summarize(steps_df: pd.DataFrame, runs_df: pd.DataFrame) -> pd.DataFrame:
    """The summary table as a DataFrame: a row per rung present in runs_df, in ladder order.

    Index: rung id ("optimization"). Columns: run_id, status, message (str); median_step_ms and
    iqr_step_ms (75th minus 25th percentile, numpy's linear interpolation) over the chosen run's
    measured steps in results.csv; speedup (baseline median / this median; NaN without an ok
    baseline) with speedup_lo/speedup_hi (95% bootstrap interval); tokens_per_s (batch_size *
    seq_len / median step seconds); mfu (fraction, median of the measured steps; NaN when unknown);
    peak_mem_allocated_gib, peak_mem_reserved_gib, compile_s (from runs.csv); final_loss (last
    step's loss); measured_steps. A rung with no comparable run has NaN numbers and the status of
    its latest run ("excluded" when its runs were left out). Takes the frames load() returns.
    """
    return build_report(steps_df, runs_df).table


def fp8_additions(run: pd.Series) -> list[str]:
    """The additions that ran GEMMs in FP8 in a GPU run (none that noted it fell back to bf16)."""
    if str(run.get("device", "")) != "cuda":
        return []
    return [a for a in recorded_additions(run, ran=True) or [] if a in ADDITIONS and ADDITIONS[a].fp8]


def _fp8_note(runs: Mapping[str, pd.Series]) -> list[str]:
    """One line naming the rungs whose runs ran GEMMs in FP8: their MFU, against the bf16 peak like every
    run's, is not comparable with an all-bf16 run's."""
    found = {rung: fp8_additions(run) for rung, run in runs.items()}
    rungs = [rung for rung, fp8 in found.items() if fp8]
    if not rungs:
        return []
    names = sorted({a for fp8 in found.values() for a in fp8})
    return [f"{', '.join(rungs)}: MFU is against the bf16 peak, as every run's, but {', '.join(names)} ran some "
            f"GEMMs in FP8, whose peak is twice bf16's: an MFU not comparable with an all-bf16 run's"]


def _synthetic_note(reference: "pd.Series | None") -> list[str]:
    """One line where the compared runs trained on synthetic tokens (one configuration, so all or none did):
    DATA=auto falls back to them, warning once on stderr, where tiny shakespeare cannot be downloaded, and a
    reader of the table alone would take its losses for a text's."""
    if reference is None or norm(reference["data"]) != "synthetic":
        return []
    return ["data: synthetic tokens, drawn uniformly from the vocabulary, not text: the losses cannot fall below "
            "ln(vocabulary size) and show no learning (DATA=auto uses them where tiny shakespeare could not be "
            "downloaded; DATA=shakespeare stops instead)"]


def _repeat_notes(repeats, by_run):
    """One line per rung run several times from one commit: each run's median step time, oldest first, their
    median (the table's figure) and the spread between them."""
    notes = []
    for rung, runs in repeats.items():
        each = [float(np.median(measured(by_run[r["run_id"]])["step_ms"])) for r in runs]
        middle = float(np.median(each))
        notes.append(f"{rung}: {len(runs)} ok runs of this configuration from commit "
                     f"{str(runs[-1]['git_commit']).strip()}, median step times "
                     f"{', '.join(f'{m:.1f}' for m in each)} ms, oldest first; the table shows their median "
                     f"{middle:.1f} ms (spread {(max(each) - min(each)) / middle:.1%})")
    return notes


def _noisy_runs(runs, each):
    """(run, IQR / median) of the runs whose steps are noisy."""
    out = []
    for run, ms in zip(runs, each):
        q25, median, q75 = np.percentile(ms, [25, 50, 75])
        if noisy(ms):
            out.append((run, (q75 - q25) / median))
    return out


def _measured_peak(peaks, reference):
    """peak.csv's row for the compared runs' GPU (read.measured_peak), or None."""
    if peaks is None or reference is None or norm(reference["device"]) != "cuda":
        return None
    from Utils.results.read import measured_peak
    return measured_peak(peaks, norm(reference["gpu_name"]), norm(reference.get("gpu_uuid", "")))


def _mfus(runs, steps, tokens_per_s, peak) -> tuple[float, float]:
    """(MFU against the datasheet's bf16 peak, MFU against the measured peak), per GPU, for a rung's runs
    (runs.csv rows) at the global `tokens_per_s`, and their measured step rows: one run's median step MFU, or for
    repeated runs the MFU at the table's tokens/s. Model FLOPs per token come from runs.csv (schema version 2),
    or from a step's MFU and tokens/s in older files."""
    run = runs[-1]
    spec = peak_bf16_flops(norm(run["gpu_name"])) if norm(run["device"]) == "cuda" else None
    ratio = (steps["mfu"] / steps["tokens_per_s"]).dropna()   # FLOPs per token / the spec's peak
    if len(runs) == 1:
        mfu = float(steps["mfu"].median()) if steps["mfu"].notna().any() else np.nan
    else:
        mfu = float(ratio.median()) * tokens_per_s if len(ratio) else np.nan
    if peak is None:
        return mfu, np.nan
    measured_flops = peak["matmul_tflops"] * 1e12
    if spec and np.isfinite(mfu):
        return mfu, mfu * spec / measured_flops
    return mfu, float(run.get("flops_per_token", np.nan)) * tokens_per_s / nproc_of(run) / measured_flops


def one_line(text: object) -> str:
    """`text` with every run of whitespace, newlines included, as one space."""
    return " ".join(str(text).split())


def nproc_of(run: "pd.Series") -> int:
    """The processes a run spread over (runs.csv's nproc; 1 where it is blank or absent, as before schema 3)."""
    n = run.get("nproc", 1)
    return int(n) if isinstance(n, (int, float)) and np.isfinite(n) and n >= 1 else 1


def context(ref: "pd.Series | None") -> str:
    """What the compared runs measured: "GPU · model (N params) · batch B × seq_len T · data D", the batch
    written "n × B" for a run over n processes (BATCH_SIZE is per process)."""
    if ref is None:
        return ""
    gpu = "CPU" if norm(ref["device"]) == "cpu" else (norm(ref["gpu_name"]) or "unknown GPU")
    model = norm(ref["model"]) or "unknown model"
    if np.isfinite(ref["n_params"]):
        model += f" ({ref['n_params'] / 1e6:.0f}M params)"
    n, batch = nproc_of(ref), norm(ref["batch_size"]) or "?"
    if n > 1:
        batch = f"{n} × {batch} ({n} processes, {norm(ref.get('parallel', '')) or 'parallel'})"
    return (f"{gpu} · {model} · batch {batch} × seq_len "
            f"{norm(ref['seq_len']) or '?'} · data {norm(ref['data']) or '?'}")


def mixed_sources(runs: pd.DataFrame) -> list[str]:
    """A note for each of commit and GPU (UUID) over which the compared runs.csv rows (a repeated rung's runs
    included) differ, naming the rungs of each: a speedup divides two runs of one commit on one GPU (a commit may have changed a rung, and two
    cards of one model differ by a few percent under their power cap)."""
    notes = []
    for column, what in (("git_commit", "commits"), ("gpu_uuid", "GPUs")):
        if column not in runs or not any(norm(v) for v in runs[column]):
            continue
        groups: dict[str, list[str]] = {}
        for _, run in runs.iterrows():
            key = (short_commit(run[column]) if column == "git_commit" else norm(run[column])) or "unknown"
            rungs = groups.setdefault(key, [])
            if str(run["optimization"]) not in rungs:
                rungs.append(str(run["optimization"]))
        if len(groups) > 1:
            each = "; ".join(f"{key}: {', '.join(rungs)}" for key, rungs in groups.items())
            notes.append(f"the compared runs come from {len(groups)} {what} ({each}): a speedup between two of "
                         f"them measures that difference too; run the rungs again from one commit on one GPU "
                         f"(make all) to compare like with like")
    return notes


def short_commit(commit: object) -> str:
    """A commit as 12 hex digits (`git rev-parse --short=12`), keeping its "-dirty" mark and the changes'
    hash after it: a tree with uncommitted changes is not the commit's tree."""
    sha, dirty, changes = norm(commit).partition("-dirty")
    return sha[:12] + dirty + changes


def distinct(values: Iterable[object], width: "int | None" = None) -> list[str]:
    """The values as text, each cut to `width` characters, repeats dropped, first seen first; a blank one is
    "unknown", unless every one is blank (then the list is empty)."""
    texts = [norm(v)[:width] for v in values]
    if not any(texts):
        return []
    return list(dict.fromkeys(t or "unknown" for t in texts))


def provenance(runs: pd.DataFrame) -> str:
    """Where the figures come from: "torch V · commit C · ran D" for these runs.csv rows (or any frame with
    their torch_version, git_commit and started_at columns): every distinct torch version and commit
    (short_commit) and the span of their start dates (UTC)."""
    torch_versions = distinct(runs["torch_version"])
    commits = distinct(short_commit(c) for c in runs["git_commit"])
    days = sorted(d for d in distinct(runs["started_at"], 10) if d != "unknown")
    text = (f"torch {', '.join(torch_versions) or 'unknown'}"
            f" · commit{'s' if len(commits) > 1 else ''} {', '.join(commits) or 'unknown'}")
    if days:
        text += f" · ran {days[0]}" + (f" to {days[-1]}" if days[-1] != days[0] else "")
    return text
