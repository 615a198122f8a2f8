"""The notebook's walk up the ladder (notebooks/Optimizing_GPU_Utilization.ipynb): the measured table, each
rung's change and its measured effect, the floors of Utils.report.roofline set against them, and the
companion result sets (batch 64, the 300-step loss runs, the ablation).

A `Study` holds one results folder's report and floors; each of its methods returns what a notebook cell
shows, as a list of items for `show`: a str is a paragraph (wrapped), a Verbatim is printed as it is, a
DataFrame is displayed as a table and a Figure as a PNG. Nothing here imports torch: the code the rungs run
is shown from its source files.
"""
from __future__ import annotations

import ast
import glob
import io
import json
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from Utils.ladder.registry import ADDITIONS, LADDER, RUNGS, rung_order
from Utils.report import roofline
from Utils.report.ablation import ablation_table
from Utils.report.breakdown import load_breakdown, plot_breakdown
from Utils.report.charts import CHARTS, plot_loss, rung_colors
from Utils.report.stats import Report, build_report, short_commit, summarize
from Utils.results.read import load, recorded_additions
from Utils.results.schema import BREAKDOWN_FILE, STEPS_FILE

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = os.path.join("results", "h200-b16")
# Addition `name`'s apply function, registered in Utils.ladder.apply's APPLY, is named apply_<name> there (the
# ladder's tests check it); the notebook reads its source by that name, without importing apply.py's torch.
APPLY_SOURCE = "Utils/ladder/apply.py"
WIDTH = 110
CHART_DPI = 90
# Step-time IQRs of the ablation's runs are 0.3-1.5 ms on a 37 ms step: under about 1.3% a difference is noise.
ABLATION_NOISE = 0.013
LOSS_TAIL_STEPS = 50
LOSS_TRACKING_STEPS = 10


class Verbatim(str):
    """Text `show` prints as it is, line by line (listings, aligned columns); a plain str is a paragraph."""


Item = str | pd.DataFrame | Figure


def wrap(text: str) -> str:
    """A paragraph with its whitespace collapsed, wrapped to WIDTH columns."""
    return textwrap.fill(" ".join(str(text).split()), width=WIDTH)


def png(fig: Figure, dpi: int = CHART_DPI) -> bytes:
    """The figure as PNG bytes. The Software tag (matplotlib's version) is left out, so that the same figure
    drawn by another matplotlib release of the same output makes the same bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def show(*items: Item | None) -> None:
    """Show each item as a notebook cell's output (see the module's docstring); None is skipped. Outside
    IPython, tables are printed and figures are described by their title."""
    try:
        from IPython.display import Image, display
    except ImportError:   # a plain interpreter: text only
        Image = display = None
    for item in items:
        if item is None:
            continue
        if isinstance(item, Verbatim):
            print(item)
        elif isinstance(item, str):
            print(wrap(item))
        elif isinstance(item, pd.DataFrame) and display is not None:
            display(item)
        elif isinstance(item, pd.DataFrame):
            print(item.to_string())
        elif isinstance(item, Figure) and display is not None:
            display(Image(png(item)))
        elif isinstance(item, Figure):
            print(f"[figure: {item.get_suptitle() or 'chart'}]")
        else:
            raise TypeError(f"show() takes text, DataFrames and Figures, not {type(item).__name__}")


def rel(path: str | os.PathLike) -> str:
    """A path inside the repository as seen from its root, any other in full."""
    path = os.path.abspath(path)
    inside = os.path.commonpath([path, str(REPO)]) == str(REPO)
    return os.path.relpath(path, REPO) if inside else path


def results_folder(value: str | None = None, repo: str | os.PathLike = REPO) -> str:
    """The absolute path of the results folder `value` names (DEFAULT_RESULTS when None or empty): relative
    to the current folder, or else to the repository root. Raises FileNotFoundError when it is no folder."""
    value = value or DEFAULT_RESULTS
    path = value if os.path.isabs(value) or os.path.isdir(value) else os.path.join(repo, value)
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"RESULTS={value} is not a folder: point RESULTS at a folder holding results.csv "
                                f"and runs.csv")
    return path


def companions(results: str) -> dict[str, str]:
    """The result sets named like `results` that the notebook reads when they exist, by role: for
    results/h200-b16, results/h200-b64 (batch), results/h200-loss (loss), results/h200-ablation-b16
    (ablation), results/h200-ablation-max-b16 and -b64 (leave_one_out, leave_one_out_b64); the same at gpt2-xl
    batch 8, results/h200-ablation-max-xl-b8, or where this card has none, another card's beside it
    (leave_one_out_xl: what each addition buys at 1.5B parameters, which no 124M set shows); breakdown.csv
    inside it (breakdown); and results/small-cards beside it, a folder of sets each measured under one
    GPU_MEMORY_GIB (small_cards)."""
    folder = os.path.dirname(results)
    tag = re.match(r"(.+)-b\d+$", os.path.basename(results))
    stem = os.path.join(folder, tag.group(1) if tag else os.path.basename(results))
    xl = stem + "-ablation-max-xl-b8"
    # Another card's set only where it holds results (not a run's folder still empty) and is not `results` itself.
    sets = [p for p in [xl] + sorted(glob.glob(os.path.join(glob.escape(folder), "*-ablation-max-xl-b8")))
            if os.path.isfile(os.path.join(p, STEPS_FILE)) and os.path.realpath(p) != os.path.realpath(results)]
    return {"batch": stem + "-b64", "loss": stem + "-loss", "ablation": stem + "-ablation-b16",
            "leave_one_out": stem + "-ablation-max-b16", "leave_one_out_b64": stem + "-ablation-max-b64",
            "leave_one_out_xl": sets[0] if sets else xl,
            "breakdown": os.path.join(results, BREAKDOWN_FILE),
            "small_cards": os.path.join(folder, "small-cards")}


def rounded(value: float | None, digits: int) -> float | None:
    """value rounded to `digits`, or None for a missing or infinite number (JSON has no NaN)."""
    return round(float(value), digits) if value is not None and np.isfinite(value) else None


def figures(table: pd.DataFrame) -> dict[str, dict]:
    """The summary table's figures per rung, rounded as summary.md rounds them: the notebook prints them as
    one JSON line, and the tests compare it with summary.md."""
    return {rung: {"median_step_ms": rounded(r["median_step_ms"], 1), "iqr_step_ms": rounded(r["iqr_step_ms"], 1),
                   "speedup": rounded(r["speedup"], 2), "tokens_per_s": rounded(r["tokens_per_s"], 0),
                   "mfu_pct": rounded(100 * r["mfu"], 1),
                   "peak_mem_allocated_gib": rounded(r["peak_mem_allocated_gib"], 1),
                   "peak_mem_reserved_gib": rounded(r["peak_mem_reserved_gib"], 1),
                   "compile_s": rounded(r["compile_s"], 1), "final_loss": rounded(r["final_loss"], 3),
                   "status": r["status"]}
            for rung, r in table.iterrows()}


def measurements(table: pd.DataFrame) -> pd.DataFrame:
    """The summary table as the notebook shows it: units in the headers, rounded as summary.md rounds."""
    return pd.DataFrame({
        "median ms": table["median_step_ms"].round(1),
        "IQR ms": table["iqr_step_ms"].round(1),
        "speedup": table["speedup"].round(2),
        "tokens/s": table["tokens_per_s"].map(lambda v: f"{v:,.0f}" if np.isfinite(v) else "-"),
        "MFU %": (100 * table["mfu"]).round(1),
        "peak alloc GiB": table["peak_mem_allocated_gib"].round(1),
        "peak reserved GiB": table["peak_mem_reserved_gib"].round(1),
        "compile s": table["compile_s"].round(1),
        "final loss": table["final_loss"].round(3),
        "status": table["status"],
    })


# --- the code a rung runs, from its source ------------------------------------------------------------------


def _definition(tree: ast.AST, qualname: str) -> ast.AST | None:
    node = tree
    for part in qualname.split("."):
        node = next((n for n in getattr(node, "body", [])
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
    return node


def source(path: str, qualname: str, words: tuple[str, ...] = ()) -> Verbatim:
    """The numbered source lines of the function or class `qualname` ("apply_tf32", "Build.autocast") in the
    repository file `path`, or only its lines holding one of `words`; read from the file, not imported.
    Raises LookupError when the file defines no such name."""
    text = (REPO / path).read_text(encoding="utf-8")
    node = _definition(ast.parse(text, path), qualname)
    if node is None:
        raise LookupError(f"{path} defines no {qualname}")
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    lines = text.splitlines()[first - 1:node.end_lineno]
    out = [f"# {path}, {qualname}" + (f": the lines with {', '.join(map(repr, words))}" if words else "")]
    out += [f"{n:4d}  {line.rstrip()}" for n, line in enumerate(lines, first)
            if not words or any(w in line for w in words)]
    return Verbatim("\n".join(out) + "\n")


def parent(rung: str) -> str | None:
    """The rung a ladder rung builds on: the earliest earlier rung whose additions differ from its own in the
    fewest (8bit builds on flash, not on fused before it); None for the first and for names off the ladder."""
    if rung not in LADDER or LADDER.index(rung) == 0:
        return None
    mine = set(RUNGS[rung].additions)
    return min(LADDER[:LADDER.index(rung)], key=lambda p: len(mine ^ set(RUNGS[p].additions)))


def added(rung: str) -> list[str]:
    """The additions a ladder rung has that its parent has not, in the registry's order."""
    p = parent(rung)
    before = set(RUNGS[p].additions) if p else set()
    return [a for a in RUNGS[rung].additions if a not in before]


def change(rung: str) -> Verbatim:
    """What a ladder rung changes: its parent plus (or minus) additions, each with the registry's one line."""
    p = parent(rung)
    if p is None:
        mine = RUNGS[rung].additions
        return Verbatim(f"{rung}: " + (f"additions {', '.join(mine)}" if mine else
                                       "no additions: the model, its training loop and AdamW as PyTorch ships them"))
    mine, theirs = RUNGS[rung].additions, RUNGS[p].additions
    previous = LADDER[LADDER.index(rung) - 1]
    lines = [f"{rung} = {p} + {', '.join(added(rung))}" + (f" (it branches off {p}, not {previous})"
                                                            if p != previous else "")]
    lines += [f"  + {a} ({ADDITIONS[a].pillar}): {ADDITIONS[a].changes}" for a in mine if a not in theirs]
    lines += [f"  - {a} ({ADDITIONS[a].pillar}): {ADDITIONS[a].changes}" for a in theirs if a not in mine]
    return Verbatim("\n".join(lines))


def apply_sources(rung: str) -> list[Verbatim]:
    """The apply function of each addition a ladder rung adds, from Utils/ladder/apply.py."""
    return [source(APPLY_SOURCE, f"apply_{a}") for a in added(rung)]


# --- one results folder --------------------------------------------------------------------------------------


def report_of(results: str) -> Report:
    """The ladder report of a results folder (Utils.report.stats.build_report)."""
    return build_report(*load(results))


def compared_run(report: Report, rung: str) -> pd.Series | None:
    """The runs.csv row of a rung's compared run (the latest of its repeats), or None where it has none."""
    if rung not in report.table.index:
        return None
    runs = report.runs.set_index("run_id", drop=False)
    run_id = report.table.at[rung, "run_id"]
    return runs.loc[run_id] if run_id in runs.index else None


@dataclass
class Study:
    """One results folder: its report, the floors of its configuration, and the sets beside it."""
    results: str
    report: Report
    roofline: roofline.Roofline | None
    floors: pd.DataFrame

    @classmethod
    def load(cls, results: str) -> Study:
        """Read `results` (a folder make all wrote into) and compute its floors."""
        report = report_of(results)
        ref = report.reference
        roof = roofline.Roofline.from_run(ref) if ref is not None else None
        # Each run's floors from the additions that ran in it, which may differ from its rung's today.
        runs = {r: compared_run(report, r) for r in report.table.index}
        recorded = {r: found for r, run in runs.items()
                    if run is not None and (found := recorded_additions(run, ran=True))}
        floors = (roof.floors(report.table["median_step_ms"].to_dict(), recorded) if roof is not None
                  else pd.DataFrame(columns=roofline.FLOOR_COLUMNS))
        return cls(results=os.path.abspath(results), report=report, roofline=roof, floors=floors)

    # --- reading the table ---

    @property
    def table(self) -> pd.DataFrame:
        return self.report.table

    @property
    def ok(self) -> list[str]:
        """The rungs with a usable run (ok, with a median step time), in table order."""
        t = self.table
        return [r for r in t.index if t.at[r, "status"] == "ok" and np.isfinite(t.at[r, "median_step_ms"])]

    @property
    def gpu_name(self) -> str:
        ref = self.report.reference
        return str(ref["gpu_name"]) if ref is not None else "unknown"

    @property
    def bounds(self) -> dict[str, str]:
        """The floor each run sits against, where both floors are known."""
        found = {r: roofline.bound(self.floors.loc[r]) for r in self.floors.index}
        return {r: b for r, b in found.items() if b}

    def measured(self, rung: str) -> bool:
        return rung in self.ok

    def value(self, rung: str, column: str) -> float:
        """A cell of the summary table; NaN for a rung it lacks."""
        return self.table.at[rung, column] if rung in self.table.index else np.nan

    def companion(self, role: str) -> str | None:
        """The companion path of `role` (see companions) when it exists and is not the results folder itself."""
        path = companions(self.results)[role]
        return path if os.path.exists(path) and os.path.realpath(path) != os.path.realpath(self.results) else None

    def then_and_now(self, rung: str) -> list[str]:
        """A line where a ladder rung's measured run had other additions than the registry gives the rung
        today (a folder measured before the rung changed): the figures belong to the run, not to today's code."""
        run = compared_run(self.report, rung)
        then = recorded_additions(run) if run is not None else None
        if rung not in RUNGS or then is None or set(then) == set(RUNGS[rung].additions):
            return []
        commit = short_commit(run["git_commit"])
        added = [a for a in RUNGS[rung].additions if a not in then]
        dropped = [a for a in then if a not in RUNGS[rung].additions]
        return [f"measured at commit {commit or 'unknown'}, when {rung} had other additions than today's: since "
                f"then {', '.join(added) or 'none'} added, {', '.join(dropped) or 'none'} left out "
                f"(BENCHMARKS.md says why); the figures below are that run's"]

    def loss_tracking(self, rung: str, last: int = LOSS_TRACKING_STEPS) -> tuple[float, float]:
        """(mean |rung's loss - baseline's| over the last steps both have, the baseline's loss std there): how
        closely a rung follows the baseline's loss on the same batches, next to how much that loss moves from
        batch to batch."""
        steps = self.report.steps
        a = steps[steps.optimization == rung].set_index("step")["loss"]
        b = steps[steps.optimization == "baseline"].set_index("step")["loss"]
        common = a.index.intersection(b.index)[-last:]
        return float(np.mean(np.abs(a[common] - b[common]))), float(np.std(b[common]))

    # --- what the cells show ---

    def overview(self) -> list[Item]:
        """Which folder, which runs, and which companion sets were found."""
        runs = self.report.runs
        torch_versions = ", ".join(sorted(set(runs["torch_version"]))) if len(runs) else "unknown"
        lines = [f"RESULTS = {rel(self.results)}", f"compared runs: {self.report.context}",
                 f"torch {torch_versions} on the measuring machine",
                 f"rungs with a usable run: {', '.join(self.ok) or 'none'}"]
        for role, name in (("batch", "batch-64 set"), ("loss", "300-step loss set"),
                           ("breakdown", "compute/memory/overhead breakdown")):
            found = self.companion(role) is not None
            lines.append(f"{name}: {rel(companions(self.results)[role])} "
                         f"{'found' if found else 'absent: its section says so and moves on'}")
        return [Verbatim("\n".join(lines))]

    def measurement_table(self) -> list[Item]:
        """The summary table, and its figures as one NOTEBOOK_FIGURES JSON line."""
        return [measurements(self.table), Verbatim("NOTEBOOK_FIGURES " + json.dumps(figures(self.table)))]

    def machine(self) -> list[Item]:
        """The GPU's rates and bandwidth the floors use, and which are unknown."""
        missing = roofline.missing_figures(self.gpu_name)
        items: list[Item] = [Verbatim("\n".join(roofline.machine_lines(self.gpu_name)))]
        if missing:
            items.append(f"{self.gpu_name}: {', '.join(missing)} unknown, so the floors that need "
                         f"{'it' if len(missing) == 1 else 'them'} are left out below. Adding the GPU's datasheet "
                         f"figures to Utils/results/gpus.py fills them in.")
        return items

    def compute(self) -> list[Item]:
        """FLOPs per token and per step, and the compute floor at each matmul precision."""
        roof = self.roofline
        if roof is None:
            return [f"The compared runs' model ({self._model()}) is not one of Utils.model_config's presets: no floors."]
        s, ref = roof.shape, self.report.reference
        n, n_all = s.n_params(), s.n_params(exclude_position_embedding=False)
        recorded = f"{int(ref['n_params']):,}" if np.isfinite(ref["n_params"]) else "none"
        attention = roof.flops_per_token - 6 * n
        lines = [f"model {ref['model']}: {s.n_layer} layers, {s.n_head} heads, width {s.n_embd}, "
                 f"vocabulary {s.vocab_size}",
                 f"N = {n:,} parameters without the position embedding ({n_all:,} with it; "
                 f"runs.csv records {recorded})",
                 f"FLOPs per token = 6N + 12·L·H·d·T = {6 * n / 1e6:,.1f}M + {attention / 1e6:,.1f}M "
                 f"= {roof.flops_per_token / 1e6:,.1f}M",
                 f"tokens per step = batch × seq_len = {roof.batch_size} × {roof.seq_len} = {roof.tokens:,}",
                 f"FLOPs per step = {roof.flops_per_step / 1e12:.2f} TFLOP"]
        for p in roofline.PRECISIONS:
            ms = roof.compute_floor_ms(p)
            lines.append(f"compute floor with {p} matmuls: " + (f"{ms:.1f} ms" if ms else "unknown"))
        return [Verbatim("\n".join(lines))]

    def _model(self) -> str:
        ref = self.report.reference
        return str(ref["model"]) if ref is not None else "none"

    def activations(self) -> list[Item]:
        """The activations backward keeps, and the size of one layer's attention scores."""
        roof = self.roofline
        if roof is None:
            return []
        per = sum(roofline.ACTIVATIONS.values())
        return [Verbatim(f"activations kept per layer and token: {per}·C = {roof.activations_per_token_layer:,} values\n"
                         f"one layer's attention scores: B·H·T·T = {roof.scores:,} values = "
                         f"{roof.scores * 4 / 1e9:.2f} GB in FP32")]

    def score_passes(self) -> list[Item]:
        """The written-out attention's operations that touch the scores, and the passes they add up to."""
        ops = pd.DataFrame(roofline.EAGER_SCORE_OPS, columns=["op", "read", "written"])
        return [Verbatim("operations of one written-out attention layer (forward, then backward) that touch the "
                         "scores,\nin whole score tensors read and written:\n" + ops.to_string(index=False) + "\n\n"
                         f"eager written-out attention: {roofline.EAGER_SCORE_PASSES} passes over the B·H·T·T scores "
                         f"per layer and step\nF.scaled_dot_product_attention: 0 passes: the scores never exist in "
                         f"memory")]

    def optimizer_traffic(self) -> list[Item]:
        """Bytes per parameter of the gradient clip and of each optimizer."""
        roof = self.roofline
        if roof is None:
            return []
        ops = roofline.foreach_adamw_ops(True) + roofline.foreach_adamw_ops(False)
        share = roof.params_in_8bit_tensors() / roof.shape.n_params(exclude_position_embedding=False)
        return [Verbatim(
            f"gradient clipping: {roofline.CLIP_BYTES} bytes per parameter per step\n"
            f"foreach AdamW: {roof.foreach_adamw_bytes_per_param():.0f} bytes per parameter per step, in {len(ops)} "
            f"multi-tensor operations over its two parameter groups:\n   " + ", ".join(ops) + "\n"
            f"fused AdamW: {roofline.FUSED_ADAMW_BYTES} bytes per parameter per step, in one kernel per parameter group\n"
            f"8-bit AdamW: {roof.eight_bit_bytes_per_param():.1f} bytes per parameter per step "
            f"({share:.1%} of the parameters are in tensors large enough for 8-bit states)")]

    def floor_table(self) -> list[Item]:
        """Each run's traffic by part, its two floors and its measured median."""
        if self.floors.empty:
            return ["No run of a known model and known additions: no floors."]
        return [self.floors.round(1)]

    def overhead(self) -> list[Item]:
        """The operations of one eager step, and whether issuing them could bound the eager rungs."""
        roof = self.roofline
        if roof is None:
            return []
        L = roof.shape.n_layer
        lines = [f"eager forward + backward with {name} attention: {roofline.eager_ops_per_step(L, flash)} operations "
                 f"on tensors" for name, flash in (("written-out", False), ("flash", True))]
        lines.append(f"gradient clip and foreach AdamW: {roofline.optimizer_ops_per_step()} operations")
        ok = {r: self.value(r, "median_step_ms") for r in self.ok}
        launches = roofline.eager_launches(roof, ok)
        return [Verbatim("\n".join(lines)), launches.round(0) if not launches.empty else None,
                roofline.overhead_verdict(launches)]

    def verdict(self, rung: str) -> str | None:
        """The roofline's sentence on a run, where it has floors."""
        if rung not in self.floors.index:
            return None
        status = self.table.at[rung, "status"] if rung in self.table.index else ""
        return roofline.verdict(rung, self.floors.loc[rung], self.gpu_name, status)

    def bound_chart(self) -> list[Item]:
        """Every run's verdict, and the chart of measured steps against the floors."""
        items: list[Item] = [self.verdict(r) for r in self.floors.index]
        fig = roofline.plot_floors(self.floors, rung_colors(self.table.index),
                                   f"Measured step time against the two floors\n{self.report.context}")
        return items + [fig]

    def breakdown(self) -> list[Item]:
        """The profiled compute / memory / overhead split beside the floors, when breakdown.csv exists."""
        path = self.companion("breakdown")
        if path is None:
            return [f"No breakdown.csv in {rel(self.results)}: run `make profile` on the GPU to measure the compute, "
                    "memory and overhead split per rung; this notebook shows it here when the file exists."]
        split = load_breakdown(self.results)   # the latest profiled run of each rung
        return [f"{rel(path)}: ms per profiled step by class, and each floor over the time of its class: near 1, "
                f"that class of kernels runs near the rate the floor assumes. Rough: the floors count all of a step's "
                f"FLOPs or bytes, and a class's time is when its kernels run.",
                roofline.against_breakdown(self.floors, split).round(2),
                plot_breakdown(split, self.report.context, self.report.provenance)]

    def effect(self, rung: str) -> list[Item]:
        """A rung's measured step time, speedups, throughput, memory, compile time and loss, and its verdict."""
        if not self.measured(rung):
            status = self.value(rung, "status") if rung in self.table.index else "not recorded"
            message = self.table.at[rung, "message"] if rung in self.table.index else ""
            return [f"{rung} has no usable run in {rel(self.results)} ({status}{': ' + message if message else ''}): "
                    "nothing measured to show."]
        v = self.value
        ms = v(rung, "median_step_ms")
        lines = self.then_and_now(rung) + [f"step time: {ms:.1f} ms median (IQR {v(rung, 'iqr_step_ms'):.1f} ms)"]
        if self.measured("baseline") and rung != "baseline":
            lines.append(f"speedup over the baseline: {v(rung, 'speedup'):.2f}x")
        p = parent(rung)
        before = LADDER[LADDER.index(rung) - 1] if rung in LADDER[1:] else None
        for other, label in ((p, "its predecessor"), (before if before != p else None, "the rung before it")):
            if other and self.measured(other):
                lines.append(f"against {label}, {other}: {v(other, 'median_step_ms') / ms:.2f}x "
                             f"({v(other, 'median_step_ms') - ms:+.1f} ms saved per step)")
        lines.append(f"throughput: {v(rung, 'tokens_per_s'):,.0f} tokens/s"
                     + (f", MFU {100 * v(rung, 'mfu'):.1f}%" if np.isfinite(v(rung, "mfu")) else ""))
        alloc, reserved = v(rung, "peak_mem_allocated_gib"), v(rung, "peak_mem_reserved_gib")
        if np.isfinite(alloc):
            mem = f"peak memory: {alloc:.1f} GiB allocated, {reserved:.1f} GiB reserved"
            if p and self.measured(p) and np.isfinite(v(p, "peak_mem_allocated_gib")):
                mem += f" ({alloc - v(p, 'peak_mem_allocated_gib'):+.1f} GiB allocated against {p})"
            lines.append(mem)
        if np.isfinite(v(rung, "compile_s")):
            lines.append(f"compile time: {v(rung, 'compile_s'):.1f} s, paid once, before the first step")
        loss = f"final loss: {v(rung, 'final_loss'):.3f}"
        if self.measured("baseline") and rung != "baseline":
            gap, spread = self.loss_tracking(rung)
            loss += (f" ({v(rung, 'final_loss') - v('baseline', 'final_loss'):+.3f} against the baseline; over the last "
                     f"{LOSS_TRACKING_STEPS} steps it differs from the baseline's by {gap:.3f} on average, while the "
                     f"baseline's own loss varies by {spread:.3f} (std) from batch to batch)")
        lines.append(loss)
        return [Verbatim("\n".join("  " + line for line in lines)), self.verdict(rung)]

    # --- each rung's own reading of its numbers ---

    def tf32_share(self) -> list[Item]:
        """By Amdahl's law, the share of the baseline's step that TF32 sped up, from the two compute floors."""
        roof = self.roofline
        fp32, tf32 = (roof.compute_floor_ms(p) if roof else None for p in ("fp32", "tf32"))
        if not (self.measured("tf32") and self.measured("baseline") and fp32 and tf32):
            return []
        s_mm = fp32 / tf32
        s = self.value("baseline", "median_step_ms") / self.value("tf32", "median_step_ms")
        if not 1 < s < s_mm:
            return []
        share = (1 - 1 / s) / (1 - 1 / s_mm)
        after = (1 - share) / ((1 - share) + share / s_mm)
        return [f"If the whole step were matrix multiplications at peak rate, TF32 would make it {s_mm:.1f}x faster; "
                f"it made it {s:.2f}x faster. By Amdahl's law (matmuls {s_mm:.1f}x faster, the rest untouched), about "
                f"{share:.0%} of the baseline step was matmul time. The untouched rest, memory-bound kernels with the "
                f"attention scores' passes first among them, is now {after:.0%} of the tf32 step: that is where the "
                f"next rungs find their time."]

    def bf16_gain(self) -> list[Item]:
        """How much BF16 autocast gained over TF32, and why so little in eager mode."""
        if not (self.measured("bf16") and self.measured("tf32")):
            return []
        s = self.value("tf32", "median_step_ms") / self.value("bf16", "median_step_ms")
        if s < 1.5:
            return [f"The compute floor halved from TF32 to BF16 and the activation bytes with it, yet the step got only "
                    f"{s:.2f}x faster. In eager mode the written-out attention's softmax, which autocast keeps in FP32, "
                    f"still writes its T×T output at 4 bytes per value and casts it back to BF16 for AV, so the score "
                    f"passes, the largest traffic of this rung, shrink by much less than half. The next two rungs attack "
                    f"exactly those passes."]
        return [f"Halving the compute floor and the activation bytes made the step {s:.2f}x faster."]

    def compile_break_even(self) -> list[Item]:
        """After how many steps torch.compile's compile time is repaid, and the score passes it leaves."""
        items: list[Item] = []
        p = parent("torch_compile")
        if self.measured("torch_compile") and self.measured(p) and np.isfinite(self.value("torch_compile", "compile_s")):
            saved = self.value(p, "median_step_ms") - self.value("torch_compile", "median_step_ms")
            if saved > 0:
                compile_s = self.value("torch_compile", "compile_s")
                cache = {"warm": " with Inductor's cache warm (a fresh machine compiles longer: COLD=1 shows how "
                                 "long)", "cold": " from a cold cache",
                         "partial": " with part of Inductor's cache warm"}.get(self.value("torch_compile", "compile_cache"), "")
                items.append(f"Compiling took {compile_s:.1f} s{cache} and saves {saved:.1f} ms per step: it pays for "
                             f"itself after about {compile_s * 1e3 / saved:,.0f} steps. For a short experiment it does "
                             f"not; for a training run of thousands of steps it is noise.")
        items.append(f"The memory model above assumes the score passes drop from {roofline.EAGER_SCORE_PASSES} (counted, "
                     f"eager) to {roofline.COMPILED_SCORE_PASSES} (assumed, fused); the attention still writes its "
                     f"scores out, and that traffic is what the next rung removes.")
        return items

    def flash_memory(self) -> list[Item]:
        """The peak memory flash attention freed, in T×T tensors, and the traffic it removed."""
        items: list[Item] = []
        p, roof, v = parent("flash"), self.roofline, self.value
        if (roof is not None and self.measured("flash") and self.measured(p)
                and np.isfinite(v("flash", "peak_mem_allocated_gib")) and np.isfinite(v(p, "peak_mem_allocated_gib"))):
            drop = v(p, "peak_mem_allocated_gib") - v("flash", "peak_mem_allocated_gib")
            bf16 = roofline.matmul_precision(RUNGS["flash"].additions) == "bf16"   # the scores' format
            one = roof.scores * roof.shape.n_layer * (2 if bf16 else 4) / 2**30
            items.append(f"Peak memory fell by {drop:.1f} GiB. One {'BF16' if bf16 else 'FP32'} T×T tensor per layer, "
                         f"kept for backward, is {one:.1f} GiB over the {roof.shape.n_layer} layers: the drop is what "
                         f"about {drop / one:.1f} of them take.")
        if "flash" in self.floors.index and p in self.floors.index:
            against = self.bounds.get("flash")
            items.append(f"By the memory model, the traffic falls from {self.floors.at[p, 'total GB']:.0f} GB to "
                         f"{self.floors.at['flash', 'total GB']:.0f} GB per step"
                         + (f"; the rung sits against the {against} floor." if against else "."))
        return items

    def fused_bytes(self) -> list[Item]:
        """The fused update's saving predicted from its bytes, against the measured one; the compile cache."""
        items: list[Item] = []
        p, roof, v = parent("fused"), self.roofline, self.value
        gpu = roof.gpu if roof is not None else None
        if self.measured("fused") and self.measured(p) and gpu is not None and gpu.bandwidth:
            n_all = roof.shape.n_params(exclude_position_embedding=False)
            foreach = roof.foreach_adamw_bytes_per_param()
            predicted = (foreach - roofline.FUSED_ADAMW_BYTES) * n_all / gpu.bandwidth * 1e3
            saved = v(p, "median_step_ms") - v("fused", "median_step_ms")
            items.append(f"The fused update moves {roofline.FUSED_ADAMW_BYTES} bytes per parameter instead of "
                         f"{foreach:.0f}: over {n_all / 1e6:.0f}M parameters at {gpu.bandwidth / 1e12:.1f} TB/s that "
                         f"is {predicted:.2f} ms per step predicted from bytes alone; measured, {saved:.2f} ms. The "
                         f"optimizer is a small part of a {v(p, 'median_step_ms'):.0f} ms step at this batch size; its "
                         f"share grows as the batch shrinks.")
        if self.measured("fused") and self.measured(p) and v("fused", "compile_s") < 0.5 * v(p, "compile_s"):
            items.append(f"The fused run compiled in {v('fused', 'compile_s'):.1f} s against {v(p, 'compile_s'):.1f} s "
                         f"for {p}, although it compiles the same model (the optimizer is not compiled): a run that "
                         f"follows another with the same graphs finds them in Inductor's on-disk cache. Compile times "
                         f"depend on that cache as much as on the model.")
        return items

    def eight_bit(self) -> list[Item]:
        """The memory AdamW8bit saved against its prediction, and the time it cost."""
        items: list[Item] = []
        p, roof, v = parent("8bit"), self.roofline, self.value
        if roof is None or not (self.measured("8bit") and self.measured(p)):
            return items
        n_8bit, n_all = roof.params_in_8bit_tensors(), roof.shape.n_params(exclude_position_embedding=False)
        if np.isfinite(v("8bit", "peak_mem_allocated_gib")):
            drop = v(p, "peak_mem_allocated_gib") - v("8bit", "peak_mem_allocated_gib")
            items.append(f"Storing m and v in one byte each instead of four saves 6 bytes for each of the "
                         f"{n_8bit / 1e6:.0f}M parameters in large tensors: {n_8bit * (8 - 2) / 2**30:.2f} GiB "
                         f"predicted. Peak allocated memory fell by {drop:.2f} GiB against {p}.")
        extra = v("8bit", "median_step_ms") - v(p, "median_step_ms")
        n_tensors = len(roof.shape.param_sizes())
        if extra > 0:
            jitter = (f" The wider spread of its step times (IQR {v('8bit', 'iqr_step_ms'):.1f} ms against "
                      f"{v(p, 'iqr_step_ms'):.1f} ms) fits the same reading: CPU-side work jitters."
                      if v("8bit", "iqr_step_ms") > 2 * v(p, "iqr_step_ms") else "")
            theirs = roof.optimizer_bytes_per_param(RUNGS[p].additions)
            items.append(f"Yet the step is {extra:.1f} ms slower than {p}'s, although the 8-bit update moves fewer "
                         f"bytes ({roof.eight_bit_bytes_per_param():.0f} per parameter against {theirs:.0f}). Spread "
                         f"over the model's {n_tensors} parameter tensors that is {1e3 * extra / n_tensors:.0f} µs each, "
                         f"the order of the Python work and launch of one update per tensor, which is how bitsandbytes' "
                         f"optimizers step (a profile would confirm it).{jitter} At {n_all / 1e6:.0f}M parameters the "
                         f"states are small, and the trade does not pay in speed; it pays in memory, when memory is the "
                         f"constraint.")
        else:
            items.append(f"The step is {-extra:.1f} ms faster than {p}'s: the fewer optimizer bytes outweigh the "
                         f"per-tensor updates here.")
        return items

    def ablation(self) -> list[Item]:
        """Each addition alone on the fused rung, against the fused runs of the same commit and GPU (the ablation set)."""
        path = self.companion("ablation")
        if path is None:
            return [f"{rel(companions(self.results)['ablation'])} is absent: `make ablation` recorded there shows "
                    f"each addition alone (and `make ablation FROM=max` into "
                    f"{rel(companions(self.results)['leave_one_out'])}, max without each)."]
        frame = ablation_table(*load(path))
        if frame.empty:
            return [f"{rel(path)} holds no ok fused run to compare the additions with."]
        slower = [r for r in frame.index if r != "fused" and frame.at[r, "vs fused"] > ABLATION_NOISE]
        return [Verbatim(f"{rel(path)}: each addition alone on the fused rung, against the median of the fused runs made "
                         f"by the same commit on the same GPU:"), frame.round(3),
                f"Slower than the fused rung on their own, beyond the runs' spread: {', '.join(slower)}."
                if slower else None]

    def leave_one_out(self) -> list[Item]:
        """The max rung without each of its additions in turn, against max runs of the same commit and GPU, at batch 16
        and at 64, and at gpt2-xl (each set where it was recorded: `make ablation FROM=max`); nothing where none
        was, which the ablation's section already points to."""
        items = []
        for role in ("leave_one_out", "leave_one_out_b64", "leave_one_out_xl"):
            path = self.companion(role)
            if path is None:
                continue
            steps, runs = load(path)
            frame = ablation_table(steps, runs, base="max")
            if frame.empty:
                items.append(f"{rel(path)} holds no ok max run to compare with.")
                continue
            # max's additions are those of the commit that ran the set, which may since have changed.
            commits = sorted(runs.loc[(runs["optimization"] == "max") & (runs["status"] == "ok"), "git_commit"]
                             .astype(str).str[:7].unique())
            others = frame.index.drop("max")
            idle = [r.split("-", 1)[1] for r in others if abs(frame.at[r, "vs max"]) <= ABLATION_NOISE]
            hurt = [r.split("-", 1)[1] for r in others if frame.at[r, "vs max"] < -ABLATION_NOISE]
            ok = runs[runs["status"] == "ok"]
            what = ", ".join(filter(None, (" / ".join(dict.fromkeys(v for v in values if v)) for values in (
                ok["model"].astype(str), (f"batch {b:.0f}" for b in ok["batch_size"] if b == b),
                ok["gpu_name"].astype(str)))))
            # max's runs of one commit against each other: how far apart two runs of one program land
            maxes = ok[ok["optimization"] == "max"]
            spreads = [(len(m), (m.max() - m.min()) / m.median()) for _, m in
                       maxes["median_step_ms"].astype(float).groupby(maxes["git_commit"]) if len(m) > 1]
            n, spread = max(spreads, default=(0, 0.0))
            items += [Verbatim(f"{rel(path)} ({what}): max as of commit {', '.join(commits)}, without each addition "
                               f"below, against the median of the max runs made by the same commit on the same GPU "
                               f"(positive: slower without it, so the addition pays):"),
                      frame.round(3),
                      f"max ran {n} times from one commit here, its medians {spread:.1%} apart; a difference under "
                      f"{ABLATION_NOISE:.1%} is read as noise." if n else None,
                      f"Within the runs' spread without them: {', '.join(idle)}." if idle else None,
                      f"Faster without them: {', '.join(hurt)}." if hurt else None]
        return items

    def loss_drift(self) -> list[Item]:
        """Each rung's final loss and how closely it follows the baseline's over the last steps."""
        if not self.measured("baseline"):
            return ["No usable baseline run: no loss comparison."]
        rows = {}
        for rung in self.ok:
            gap, spread = self.loss_tracking(rung)
            rows[rung] = {"final loss": self.value(rung, "final_loss"),
                          "vs baseline": self.value(rung, "final_loss") - self.value("baseline", "final_loss"),
                          f"mean |Δ| last {LOSS_TRACKING_STEPS} steps": gap,
                          f"baseline std last {LOSS_TRACKING_STEPS} steps": spread}
        drift = pd.DataFrame.from_dict(rows, orient="index")
        wide = [r for r, row in rows.items() if row[f"mean |Δ| last {LOSS_TRACKING_STEPS} steps"]
                > row[f"baseline std last {LOSS_TRACKING_STEPS} steps"]]
        return [drift.round(3),
                "Every rung follows the baseline's loss more closely than the loss itself varies from batch to batch."
                if not wide else f"{', '.join(wide)} differ from the baseline by more than its batch-to-batch "
                                 f"variation: look at their loss curves below before trusting their speedups."]

    def loss_set(self) -> list[Item]:
        """The longer runs' mean loss over their last steps, and their loss chart, when the loss set exists."""
        path = self.companion("loss")
        if path is None:
            return [f"{rel(companions(self.results)['loss'])} is absent: the comparison above rests on the last steps "
                    f"of the short runs. A 300-step run of every rung, recorded there, would show whether the small "
                    f"differences grow."]
        report = report_of(path)
        return [Verbatim(f"{rel(path)}: {report.context}; mean loss over each run's last {LOSS_TAIL_STEPS} steps:"),
                loss_tail(report).round(4), plot_loss(report)]

    def batch64(self) -> list[Item]:
        """Speedups, throughput and memory at this batch and at batch 64, when the batch-64 set exists."""
        path = self.companion("batch")
        if path is None:
            return [f"{rel(companions(self.results)['batch'])} is absent: no batch-64 comparison. Recording "
                    f"`make all BATCH_SIZE=64` into that folder adds it here."]
        other = summarize(*load(path))
        b = int(self.report.reference["batch_size"])
        both = batch_comparison(self.table, other, b)
        items: list[Item] = [Verbatim(f"{rel(path)}:"),
                             both.round({c: (0 if c.startswith("tokens") else 2) for c in both.columns})]
        for rung in both.index:
            mine, theirs = both.at[rung, f"tokens/s, batch {b}"], both.at[rung, "tokens/s, batch 64"]
            if np.isfinite(mine) and np.isfinite(theirs):
                items.append(f"{rung}: batch 64 runs {theirs / mine:.2f}x the tokens per second of batch {b}.")
            elif rung in other.index and not np.isfinite(theirs):
                message = other.at[rung, "message"]
                items.append(f"{rung} at batch 64: {other.at[rung, 'status']}" + (f" ({message})" if message else ""))
        return items

    def small_cards(self) -> list[Item]:
        """Each rung's micro-batch and step time in every set of results/small-cards (each under one
        GPU_MEMORY_GIB, or the whole card), the sets of one batch and sequence length side by side, the smallest
        memory first."""
        path = self.companion("small_cards")
        names = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))) if path else []
        if not names:
            return [f"{rel(companions(self.results)['small_cards'])} holds no results: no small-card comparison. "
                    f"Recording `make all GPU_MEMORY_GIB=3.5 PREFIX=results/small-cards/3.5gib` (a 4 GB card: "
                    f"its CUDA context takes about half a GiB) adds it here."]
        shapes: dict[tuple, list] = {}
        for name in names:
            if not os.path.exists(os.path.join(path, name, STEPS_FILE)):   # a folder of something else: no set
                continue
            report = build_report(*load(os.path.join(path, name)))
            if len(report.table):
                caps = report.table["gpu_memory_gib"].dropna()
                shape = (int(report.reference["batch_size"]), int(report.reference["seq_len"]))
                shapes.setdefault(shape, []).append((caps.iloc[0] if len(caps) else np.inf, name, report.table))
        items: list[Item] = []
        for (batch, seq_len), sets in shapes.items():
            sets.sort(key=lambda s: s[0])
            rungs = rung_order(set().union(*(t.index for _, _, t in sets)))
            columns = {}
            for _, name, t in sets:
                ok = [r in t.index and t.at[r, "status"] == "ok" for r in rungs]
                # named by the folder: two sets of one cap stay two columns
                columns[f"{name}: micro-batch"] = [
                    f"{t.at[r, 'micro_batch']:.0f} × {t.at[r, 'accumulation_steps']:.0f}" if good
                    else (t.at[r, "status"] if r in t.index else "-") for r, good in zip(rungs, ok)]
                columns[f"{name}: ms"] = [round(float(t.at[r, "median_step_ms"]), 1) if good else None
                                           for r, good in zip(rungs, ok)]
            folders = ", ".join(rel(os.path.join(path, name)) for _, name, _ in sets)
            items += [Verbatim(f"batch {batch} × {seq_len} tokens a step ({folders}):"),
                      pd.DataFrame(columns, index=rungs)]
        return items

    def charts(self) -> list[Item]:
        """The charts plot_results.py writes next to the results, drawn from the same report."""
        return [plot(self.report) for plot in CHARTS.values()]

    def ladder_lines(self) -> list[Item]:
        """One line per measured rung: its median, its gain over its parent, the floor it sits against; and the
        largest single step up the ladder."""
        lines, gains, bounds = [], {}, self.bounds
        for rung in self.ok:
            ms, p = self.value(rung, "median_step_ms"), parent(rung)
            if p is None:
                step = "the reference"
            elif self.measured(p):
                gains[rung] = self.value(p, "median_step_ms") / ms
                step = f"{gains[rung]:.2f}x over {p}"
            else:
                step = f"(its predecessor, {p}, not measured)"
            against = f", against the {bounds[rung]} floor" if rung in bounds else ""
            lines.append(f"{rung:14s} {ms:8.1f} ms  {step}{against}")
        items: list[Item] = [Verbatim("\n".join(lines))]
        if gains:
            best = max(gains, key=gains.get)
            items.append(f"On {self.gpu_name}, the single largest step up the ladder was {best} ({gains[best]:.2f}x over "
                         f"{parent(best)}).")
        return items


# --- the companion sets ---------------------------------------------------------------------------------------


def loss_tail(report: Report, last: int = LOSS_TAIL_STEPS) -> pd.DataFrame:
    """Each compared run's mean loss over its last `last` steps, in ladder order, and its difference from the
    baseline's where there is one."""
    tail = pd.Series({rung: g.sort_values("step")["loss"].tail(last).mean()
                      for rung, g in report.steps.groupby("optimization")}, dtype=float)
    tail = tail.reindex(rung_order(tail.index))
    frame = pd.DataFrame({f"mean loss, last {last} steps": tail})
    if "baseline" in tail.index:
        frame["vs baseline"] = tail - tail["baseline"]
    return frame


def batch_comparison(table: pd.DataFrame, other: pd.DataFrame, b: int) -> pd.DataFrame:
    """Speedup, tokens/s and peak allocated memory per rung at batch `b` (table) and at batch 64 (other), in
    ladder order."""
    both = pd.DataFrame({
        f"speedup, batch {b}": table["speedup"],
        "speedup, batch 64": other["speedup"],
        f"tokens/s, batch {b}": table["tokens_per_s"],
        "tokens/s, batch 64": other["tokens_per_s"],
        f"peak alloc GiB, batch {b}": table["peak_mem_allocated_gib"],
        "peak alloc GiB, batch 64": other["peak_mem_allocated_gib"],
    })
    return both.reindex(rung_order(both.index))
