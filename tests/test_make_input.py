"""Values a user types into make reach the shell quoted: a list (ADDITIONS, PEERS, NPROC) or a setting (DEVICE,
PARALLEL, FROM, WITH) that holds shell syntax is refused by its check in one line, and runs nothing: no command
of its own, no rung, no results folder. And the targets that run several rungs check REPEAT once, first."""
import pytest

from conftest import clean_env, make

RUN = ["STEPS=2", "BATCH_SIZE=1", "DATA=synthetic", "MODEL=tiny"]


def canary_cases():
    """(target and its other variables, the variable that carries the command, its first word) for each way in."""
    return [
        (["ablation"], "ADDITIONS", "prefetch"),
        (["ablation", "FROM=max"], "ADDITIONS", "prefetch"),
        (["ablation"], "FROM", "max"),
        (["peers"], "PEERS", "hf"),
        (["peers"], "NPROC", "1"),
        (["scaling", "RUNG=baseline"], "NPROC", "1"),
        (["scaling", "RUNG=baseline", "NPROC=1"], "PARALLEL", "ddp"),
        (["fused", "NPROC=2"], "DEVICE", "cpu"),
        (["fused"], "PARALLEL", "ddp"),
        (["all", "NPROC=2"], "DEVICE", "cpu"),
        (["custom"], "WITH", "bf16"),
        (["fused"], "REPEAT", "2"),
        (["fused"], "COLD", "1"),
        (["fused"], "PROFILE", "1"),
    ]


@pytest.mark.parametrize("syntax", ["; touch {canary}", " `touch {canary}`", "'; touch {canary}; '",
                                    "$$(touch {canary})"],
                         ids=["semicolon", "backticks", "quote", "dollar"])
@pytest.mark.parametrize("target,variable,first", canary_cases(),
                         ids=[f"{c[0][0]}-{c[1]}" for c in canary_cases()])
def test_shell_syntax_in_a_variable_is_refused_and_runs_nothing(tmp_path, target, variable, first, syntax):
    canary = tmp_path / "ran"
    prefix = tmp_path / "out"
    value = first + syntax.format(canary=canary)
    done = make([*target, f"PREFIX={prefix}", *RUN, f"{variable}={value}"], clean_env(), timeout=120)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(errors) == 1, done.stderr
    assert "Syntax error" not in done.stderr and "Permission denied" not in done.stderr
    assert not canary.exists(), f"{variable}={value!r} ran its command"
    assert not prefix.exists(), "a run started before the bad value was refused"


@pytest.mark.parametrize("target", [["all"], ["profile"], ["scaling", "RUNG=baseline", "NPROC=1"]])
def test_the_targets_that_run_several_rungs_check_repeat_once_before_any(tmp_path, target):
    prefix = tmp_path / "out"
    done = make([*target, f"PREFIX={prefix}", *RUN, "REPEAT=0"], clean_env(), timeout=120)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2
    assert errors == ["error: REPEAT must be a number of runs from 1 to 99, not '0' "
                      "(e.g. make max STEPS=60 BATCH_SIZE=16 PREFIX=./out REPEAT=3)"]
    assert not prefix.exists()


def test_make_profile_checks_nproc_once_before_any_rung(tmp_path):
    prefix = tmp_path / "out"
    done = make(["profile", f"PREFIX={prefix}", *RUN, "NPROC=0"], clean_env(), timeout=120)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: NPROC='0' is not a number")
    assert not prefix.exists()


def test_make_peers_refuses_a_peer_named_twice(tmp_path):
    # Named twice it would run twice a round; REPEAT is the way to measure a peer more than once.
    prefix = tmp_path / "out"
    done = make(["peers", f"PREFIX={prefix}", *RUN, "PEERS=hf hf"], clean_env(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == "error: PEERS names hf twice: name each peer once (REPEAT=n runs rounds)"
    assert not prefix.exists()


def test_a_target_name_with_shell_syntax_is_named_and_runs_nothing(tmp_path):
    canary = tmp_path / "ran"
    done = make([f"x`touch {canary}`"], clean_env(), timeout=60)
    assert done.returncode == 2 and not canary.exists()
    assert done.stderr.splitlines()[0].startswith(f"error: no target 'x`touch {canary}`': the rungs are ")


@pytest.mark.parametrize("args,says", [
    (["ablation", "FROM="], "error: FROM is empty: use FROM=fused or FROM=max, or leave it out (fused)"),
    (["ablation", "ADDITIONS="], "error: ADDITIONS is empty: name the additions to try"),
    (["fused", "NPROC="], "error: NPROC is empty: use NPROC=1 (one process) or more, or leave it out"),
    (["fused", "PARALLEL="], "error: PARALLEL is empty: use PARALLEL=ddp or fsdp, or leave it out (ddp)"),
    (["fused", "DATA_DIR="], "error: DATA_DIR is empty: name the folder that holds tiny shakespeare"),
])
def test_a_variable_set_to_nothing_is_refused_not_read_as_its_default(tmp_path, args, says):
    # FROM= would otherwise run the whole ablation, twenty runs.
    prefix = tmp_path / "out"
    done = make([*args, f"PREFIX={prefix}", *RUN], clean_env(), timeout=120)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith(says), done.stderr
    assert not prefix.exists()


def test_a_value_that_starts_with_a_dash_is_a_value_not_an_option(tmp_path):
    # Passed as --device=VALUE, it is checked as a device, not read by argparse as a missing argument.
    prefix = tmp_path / "out"
    done = make(["fused", f"PREFIX={prefix}", *RUN, "DEVICE=-h"], clean_env(), timeout=120)
    assert done.returncode == 2
    assert [ln for ln in done.stderr.splitlines() if ln.startswith("error:")] == [
        "error: DEVICE='-h' is not one of auto, cuda, cpu"]
    assert not prefix.exists()


def test_make_compare_reads_every_word_of_prefixes_as_a_folder(tmp_path):
    done = make(["compare", f"PREFIXES=-h {tmp_path}"], clean_env(), timeout=120)
    assert done.returncode == 2 and "usage" not in done.stdout
    assert done.stderr.splitlines()[0].startswith("error: -h/results.csv not found")


@pytest.mark.parametrize("target,variable", [("fused", "PREFIX"), ("fused", "STEPS"), ("ablation", "ADDITIONS"),
                                             ("plots", "PREFIX")])
def test_a_line_break_in_a_variable_is_named(tmp_path, target, variable):
    # Unrefused, it ends the recipe line that holds it: the shell reports half a command, naming nothing.
    canary = tmp_path / "ran"
    values = {"PREFIX": str(tmp_path / "out"), "STEPS": "2", "BATCH_SIZE": "1"}
    values[variable] = f"{values.get(variable, 'prefetch')}\ntouch {canary}"
    done = make([target, *[f"{k}={v}" for k, v in values.items()], "DATA=synthetic", "MODEL=tiny"], clean_env(),
                timeout=60)
    assert done.returncode == 2 and "Syntax error" not in done.stderr
    assert done.stderr.splitlines()[0] == f"error: {variable} holds a line break: give it on one line"
    assert not canary.exists() and not (tmp_path / "out").exists()
