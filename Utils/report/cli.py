"""Charts and a summary table for the ladder runs recorded under one PREFIX.

    python plot_results.py --prefix DIR        (or: make plots PREFIX=DIR)

reads DIR/results.csv (a row per step) and DIR/runs.csv (a row per run) and writes into DIR:
speedup.png, step_time.png, throughput.png, memory.png, loss.png and summary.md; the summary is
printed to the terminal too. Where DIR holds ok runs of one rung at two or more GPU counts (make scaling),
scaling.png too, and summary.md gains a scaling section; elsewhere no scaling.png is written (an old one
is left as it is). Which runs are compared is Utils.report.selection's business, the numbers
Utils.report.stats', the charts Utils.report.charts', the scaling across GPUs Utils.report.scaling's, each
addition against its base (make ablation) Utils.report.ablation's, the loss with each addition and without it
Utils.report.loss', the peers against the fastest rung Utils.report.peers', and summary.md
Utils.report.summary's.

Exit codes: 0 when everything was written; 2 for bad arguments, unusable input or an unwritable
PREFIX, with a single "error: ..." line on stderr; 128 + n where signal n stopped it, each file left whole (as it
was, or new) and nothing said (make plots names the signal).
"""
import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from Utils.report.ablation import ablation_sets
from Utils.report.comparison import Comparison
from Utils.report.charts import CHARTS
from Utils.report.figures import save_figure
from Utils.report.loss import LossSet, loss_sets
from Utils.report.peers import peer_comparison
from Utils.report.scaling import SCALING_FILE, Scaling, build_scaling, plot_scaling
from Utils.report.stats import Report, build_report
from Utils.report.stopping import Stopped, stopped_on_the_way_out
from Utils.report.summary import SUMMARY_FILE, write_summary
from Utils.results.read import load, load_peak
from Utils.results.store import ResultsError, writing

OUTPUT_FILES = (*CHARTS, SCALING_FILE, SUMMARY_FILE)   # scaling.png only where a rung ran on several GPU counts


def write_outputs(prefix: str | os.PathLike, report: Report, scaling: "Scaling | None" = None,
                  ablation: "list[Comparison] | None" = None,
                  peers: "Comparison | None" = None,
                  loss: "list[LossSet] | None" = None) -> tuple[str, list[str]]:
    """Write every chart, scaling.png where `scaling` holds a rung measured at two or more GPU counts, and
    summary.md (with `ablation`'s, `peers`' and `loss`' tables, where there are any) into prefix; return (summary
    text, written paths)."""
    written = []
    for name, plot in CHARTS.items():
        path = os.path.join(prefix, name)
        save_figure(plot(report), path)
        written.append(path)
    if scaling is not None and not scaling.scaled().empty:
        path = os.path.join(prefix, SCALING_FILE)
        save_figure(plot_scaling(scaling.table, scaling.context, scaling.provenance), path)
        written.append(path)
    path = os.path.join(prefix, SUMMARY_FILE)
    text = write_summary(report, path, scaling, ablation, peers, loss)
    written.append(path)
    return text, written


class Parser(argparse.ArgumentParser):
    """The report's command lines: a bad argument is one `error: ...` line with the usage, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage().strip().removeprefix("usage: ")
        self.exit(2, f"error: {message} (usage: {usage})\n")

    def parse_or_status(self, argv: "Sequence[str] | None") -> "argparse.Namespace | int":
        """The parsed arguments, or the exit status where parsing ended the command (2 on an error, 0 for
        --help), so that main returns it instead of exiting."""
        try:
            return self.parse_args(argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 2


def _parser():
    p = Parser(prog="plot_results.py",
                description="Draw the ladder's charts and summary.md from PREFIX/results.csv and PREFIX/runs.csv.")
    p.add_argument("--prefix", required=True, help="folder holding results.csv and runs.csv; outputs go there too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code (0 written, 2 bad arguments or input, 128 + n where
    signal n stopped it: every file then is whole, the old one or the new)."""
    args = _parser().parse_or_status(argv)
    if isinstance(args, int):
        return args
    prefix = args.prefix
    try:
        with stopped_on_the_way_out():
            steps, runs = load(prefix)
            report = build_report(steps, runs, load_peak(prefix))
            with writing(prefix):
                text, written = write_outputs(prefix, report, build_scaling(steps, runs), ablation_sets(
                    report, steps, runs), peer_comparison(report, steps, runs), loss_sets(report, steps, runs))
    except Stopped as e:
        return e.exit_status
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write into PREFIX={prefix} ({e.strerror or e}): "
              f"choose a folder you can write to", file=sys.stderr)
        return 2
    print(text, end="")
    print("wrote " + ", ".join(os.path.basename(p) for p in written) + f" into {prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
