"""summary.md's "The loss with each addition and without it" (Utils/report/loss.py) on small results files written
here: each addition's runs against its base's at the same seed, over the last 50 steps, and the seeds' gap."""
import json

import pytest

from conftest import run_main, summary_text
from test_plots import add_run, section_rows
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
    return section_rows(prefix, HEADING, key=("run", "seed"))


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


def _fused_pair(p: str, with_loss: float) -> dict:
    """The loss row of fused+loss_kernel at seed 1 (its last steps at with_loss) against fused at seeds 1 and 2
    (5.0 and 5.2: a seeds' gap of 0.2)."""
    add_loss_run(p, "fused", 1, 5.0, "fused-s1")
    add_loss_run(p, "fused", 2, 5.2, "fused-s2")
    add_loss_run(p, "fused+loss_kernel", 1, with_loss, "loss-s1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    return loss_rows(p)["fused+loss_kernel", "1"]


def test_a_gap_wider_than_the_seeds_gap_is_not_kept_and_fused_runs_are_the_runs_without(tmp_path):
    p = str(tmp_path)
    row = _fused_pair(p, 5.3)
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


def test_a_gap_below_the_seeds_gap_on_the_low_side_is_not_kept_either(tmp_path):
    # the verdict is on |gap|: an addition that lowers the loss by more than a change of seed moves it too
    row = _fused_pair(str(tmp_path), 4.7)
    assert (row["gap"], row["seeds' gap without"], row["kept"]) == ("-0.300", "0.200", "no")


def test_a_run_named_with_two_additions_is_held_against_max_itself(tmp_path):
    p = str(tmp_path)
    add_loss_run(p, "max", 1, 5.00, "max-s1")
    add_loss_run(p, "max-fp8_head", 1, 5.40, "nohead-s1")            # max-<a>: not the run with max-<a>-<b>'s additions
    add_loss_run(p, "max-fp8_head-prefetch", 1, 5.10, "nohp-s1")     # without both: seeds 5.10 and 5.16
    add_loss_run(p, "max-fp8_head-prefetch", 2, 5.16, "nohp-s2")
    rc, _, err = run_main(p)
    assert rc == 0, err
    row = loss_rows(p)["max-fp8_head-prefetch", "1"]
    assert (row["with"], row["without"], row["gap"], row["seeds' gap without"], row["kept"]) == (
        "5.000", "5.100", "-0.100", "0.060", "no")


def test_runs_not_ok_and_runs_of_other_settings_at_the_seed_are_left_out_of_the_means(tmp_path):
    p = str(tmp_path)
    add_loss_run(p, "max", 1, 6.0, "max-bs8", batch_size=8)          # other settings than the compared runs'
    add_loss_run(p, "max", 1, 5.0, "max-s1")
    add_loss_run(p, "max", 1, 7.0, "max-interrupted", status="interrupted")
    add_loss_run(p, "max-fp8_head", 1, 5.1, "nohead-s1")
    add_loss_run(p, "max-fp8_head", 1, 8.0, "nohead-oom", status="oom")
    rc, _, err = run_main(p)
    assert rc == 0, err
    row = loss_rows(p)["max-fp8_head", "1"]
    assert (row["runs with / without"], row["with"], row["without"]) == ("1 / 1", "5.000", "5.100")


def test_a_run_recorded_twice_under_one_run_id_counts_once_over_its_own_last_50_steps(tmp_path):
    # a folder merged from two copies holds the run's rows twice: its last 50 steps are still steps 50..99, not
    # the last 25 twice, and it is one run
    p = str(tmp_path)
    tail = [5.0] * (LOSS_WINDOW // 2) + [5.2] * (LOSS_WINDOW // 2)   # mean 5.1; its last 25 steps' 5.2
    add_loss_run(p, "max", 1, tail, "max-s1")
    add_loss_run(p, "max", 1, tail, "max-s1")
    add_loss_run(p, "max-fp8_head", 1, 5.05, "nohead-s1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    row = loss_rows(p)["max-fp8_head", "1"]
    assert (row["runs with / without"], row["with"], row["gap"]) == ("1 / 1", "5.100", "+0.050")


H100 = "NVIDIA H100 80GB HBM3"   # test_plots' CONFIG records the others on an NVIDIA H200


def test_runs_on_another_gpu_are_paired_as_the_section_says(tmp_path):
    # "Runs of any commit are paired (the loss follows the code's numerics, not the card)"
    p = str(tmp_path)
    add_loss_run(p, "max", 2, 5.10, "max-s2", gpu_name=H100)
    add_loss_run(p, "max-fp8_head", 2, 5.08, "nohead-s2", gpu_name=H100)
    add_loss_run(p, "max", 1, 5.00, "max-s1")
    add_loss_run(p, "max-fp8_head", 1, 5.02, "nohead-s1")
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = loss_rows(p)
    assert rows["max-fp8_head", "2"]["gap"] == "+0.020"
    assert rows["max-fp8_head", "1"]["seeds' gap without"] == rows["max-fp8_head", "2"]["seeds' gap without"] == "0.060"


def test_an_addition_whose_every_run_the_step_time_table_leaves_out_still_has_its_loss_rows(tmp_path):
    # the baseline's step times came from another card: the step-time table compares no max run, the loss can
    p = str(tmp_path)
    add_run(p, "baseline", [1.0] * 20, run_id="baseline")
    add_loss_run(p, "max", 1, 5.00, "max-s1", gpu_name=H100)
    add_loss_run(p, "max", 2, 5.10, "max-s2", gpu_name=H100)
    add_loss_run(p, "max-fp8_head", 1, 5.02, "nohead-s1", gpu_name=H100)
    add_loss_run(p, "max-fp8_head", 2, 5.08, "nohead-s2", gpu_name=H100)
    rc, _, err = run_main(p)
    assert rc == 0, err
    rows = loss_rows(p)
    assert (rows["max-fp8_head", "1"]["gap"], rows["max-fp8_head", "1"]["kept"]) == ("-0.020", "yes")
    assert (rows["max-fp8_head", "2"]["gap"], rows["max-fp8_head", "2"]["kept"]) == ("+0.020", "yes")


def test_a_long_run_that_did_not_end_ok_is_named_and_each_row_says_its_steps(tmp_path):
    # a loss that went to NaN stops a run: the plainest case of an addition that does not keep the loss
    p = str(tmp_path)
    add_loss_run(p, "max", 1, 5.0, "max-s1")
    add_loss_run(p, "max", 2, 5.0, "max-diverged", status="failed")
    add_loss_run(p, "max-fp8_head", 1, 5.0001, "nohead-s1")   # a gap of -0.0001, which rounds to no "-0.000"
    add_loss_run(p, "max-fp8_head", 1, 5.0, "nohead-s1-long", steps=LOSS_MIN_STEPS + 50)
    add_loss_run(p, "max", 1, 5.0, "max-s1-long", steps=LOSS_MIN_STEPS + 50)
    rc, _, err = run_main(p)
    assert rc == 0, err
    text = summary_text(p)
    assert "Left out, not ended ok: max-diverged (max, failed)." in text
    section = text.split(HEADING)[1]
    steps = [ln.split("|")[2].strip() for ln in section.splitlines() if ln.startswith("| max-fp8_head ")]
    assert steps == [str(LOSS_MIN_STEPS), str(LOSS_MIN_STEPS + 50)]
    assert "-0.000" not in section and "+0.000" in section
