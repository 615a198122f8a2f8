"""The peers (`make peers`: peer-llmc, peer-hf) against the suite's fastest rung among the runs compared,
`max` where it ran: each peer's median divided by that rung's runs from the same commit
on the same GPU (Utils.report.comparison), so that summary.md states the ratio that `make peers RUNG=max REPEAT=n` measures."""
import pandas as pd

from Utils.ladder.registry import RUNGS
from Utils.report.comparison import Comparison, compare_runs
from Utils.report.stats import Report
from Utils.results.schema import is_peer


def peer_comparison(report: Report, steps: pd.DataFrame, runs: pd.DataFrame) -> Comparison | None:
    """compare_runs() of every peer against the rung with the shortest median step among the rungs compared; None
    where the runs compared have no peer or no rung."""
    timed = report.rungs_with_steps()
    peers = sorted(r for r in timed if is_peer(r))
    rungs = [r for r in timed if r in RUNGS]
    if not peers or not rungs:
        return None
    fastest = min(rungs, key=lambda r: report.table.at[r, "median_step_ms"])
    return compare_runs(report, steps, runs, fastest, peers)
