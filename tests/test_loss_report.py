"""summary.md's "The loss with each addition and without it" (Utils/report/loss.py) on small results files written
here: each addition's runs against its base's at the same seed, over the last 50 steps, and the seeds' gap."""
import json

import pytest

from conftest import run_main, summary_text
from test_plots import add_run
from Utils.report.loss import LOSS_MIN_STEPS, LOSS_WINDOW

HEADING = "## The loss with each addition and without it"


def add_loss_run(prefix, rung, seed, last, run_id, steps=LOSS_MIN_STEPS, **kwargs):
    """A run of `steps` steps at `seed` whose last LOSS_WINDOW losses are `last` (a number, or one a step) and
    whose earlier ones are 9.0, so that a mean over the wrong steps shows."""
    tail = [last] * LOSS_WINDOW if isinstance(last, float) else list(last)
    losses = [9.0] * (steps - LOSS_WINDOW) + tail
    config = json.dumps({"additions": [], "fell_back": [], "run": {"seed": seed}}) if seed is not None else ""
    add_run(prefix, rung, [1.0] * steps, losses=losses, run_id=run_id, config=config, **kwargs)


def loss_rows(prefix):
    """The section's tables as {(run, seed): {column header: cell text}}."""
    text = summary_text(prefix)
    assert HEADING in text
    section = text.split(HEADING)[1].split("\n## ")[0]
    rows, header = {}, None
    for ln in (ln for ln in section.splitlines() if ln.startswith("|")):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0] == "run":
            header = cells
        elif not set(cells[0]) <= set("-:"):
            rows[cells[0], cells[1]] = dict(zip(header, cells))
    return rows


def test_each_addition_is_held_against_its_base_at_each_seed_and_the_seeds_gap_without_it(tmp_path):
    p = str(tmp_path)
    add_loss_run(p, "max", 1, 5.00, "max-s1")
    add_loss_run(p, "max", 2, 5.10, "max-s2")
    add_loss_run(p, "max-fp8_head", 1, 5.02, "nohead-s1")    # without it: seeds 5.02 and 5.08, a gap of 0.06
    add_loss_run(p, "max-fp8_head", 2, 5.08, "nohead-s2")
    add_loss_run(p, "max-prefetch", 1, 4.80, "noprefetch-s1")   # one seed without: no gap to hold it to
    rc, out, err = run_main(p)
    assert rc == 0, err
    rows = loss_rows(p)
    head1, head2 = rows["max-fp8_head", "1"], rows["max-fp8_head", "2"]
    # FROM=max: max is the run with the addition, max-<a> the run without
    assert (head1["with"], head1["without"], head1["gap"]) == ("5.000", "5.020", "-0.020")
    assert (head2["with"], head2["without"], head2["gap"]) == ("5.100", "5.080", "+0.020")
    assert head1["seeds' gap without"] == head2["seeds' gap without"] == "0.060"
    assert head1["kept"] == head2["kept"] == "yes"
    prefetch = rows["max-prefetch", "1"]
    assert (prefetch["gap"], prefetch["seeds' gap without"], prefetch["kept"]) == ("+0.200", "-", "-")
    assert ("max-prefetch", "2") not in rows      # no run without it at seed 2
    assert HEADING in out and "With: `max`; without: the run named." in out


def test_a_gap_wider_than_the_seeds_gap_is_not_kept_and_fused_runs_are_the_runs_without(tmp_path):
    p = str(tmp_path)
    add_loss_run(p, "fused", 1, 5.0, "fused-s1")
    add_loss_run(p, "fused", 2, 5.2, "fused-s2")
    add_loss_run(p, "fused+loss_kernel", 1, 5.3, "loss-s1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    row = loss_rows(p)["fused+loss_kernel", "1"]
    assert (row["with"], row["without"], row["gap"], row["seeds' gap without"], row["kept"]) == (
        "5.300", "5.000", "+0.300", "0.200", "no")
    assert "With: the run named; without: `fused`." in summary_text(p)


def test_a_seed_run_several_times_shows_the_mean_of_its_runs_means_and_their_commits(tmp_path):
    p = str(tmp_path)
    add_loss_run(p, "max", 42, 5.3, "max-a", git_commit="aaaaaaa1")
    add_loss_run(p, "max", 42, 5.1, "max-b", git_commit="bbbbbbb2")
    add_loss_run(p, "max-fp8_head", 42, [5.0, 5.2] * (LOSS_WINDOW // 2), "nohead", git_commit="ccccccc3")
    rc, _, err = run_main(p)
    assert rc == 0, err
    row = loss_rows(p)["max-fp8_head", "42"]
    assert row["runs with / without"] == "2 / 1" and row["with"] == "5.200" and row["without"] == "5.100"
    assert row["commits"] == "aaaaaaa, bbbbbbb, ccccccc"


@pytest.mark.parametrize("case", ["short runs", "other step counts", "no seed recorded", "not finite"])
def test_runs_that_cannot_be_paired_leave_no_section(tmp_path, case):
    p = str(tmp_path)
    steps = {"short runs": (LOSS_MIN_STEPS - 1,) * 2, "other step counts": (LOSS_MIN_STEPS, LOSS_MIN_STEPS + 50)}.get(
        case, (LOSS_MIN_STEPS,) * 2)
    seed = None if case == "no seed recorded" else 1
    tail = [float("nan")] * LOSS_WINDOW if case == "not finite" else 5.0
    add_loss_run(p, "max", seed, tail, "max", steps=steps[0])
    add_loss_run(p, "max-fp8_head", seed, 5.1, "nohead", steps=steps[1])
    rc, _, err = run_main(p)
    assert rc == 0, err
    assert HEADING not in summary_text(p)
    assert "`max` without each of its additions" in summary_text(p)   # the step times are still compared
