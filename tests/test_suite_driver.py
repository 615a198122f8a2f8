"""The driver (python -m Utils.suite) in-process: how it reads its variables, the command lines it builds, its
refusals, and what it removes. The targets end to end, through make, are tests/test_suite.py's and
test_make_input.py's."""
import sys

import pytest

from Utils.ladder.registry import LADDER, RUNGS
from Utils.suite import checks, commands, folders
from Utils.suite.__main__ import main
from Utils.suite.given import Given, parse
from Utils.suite.process import Runner
from Utils.train.usage import UsageError

BASICS = {"STEPS": "3", "BATCH_SIZE": "2", "PREFIX": "runs $5 it's"}


def given(**values: str) -> Given:
    return Given({**BASICS, **values}, ("py",))


def test_words_name_variables_and_the_environment_fills_in_the_rest():
    g = parse(["STEPS=3", "PREFIX=a b", "FROM=", "PYTHON=python3 -X dev"], {"STEPS": "9", "DATA_DIR": "d", "HOME": "h"})
    assert g.values == {"STEPS": "3", "PREFIX": "a b", "FROM": "", "DATA_DIR": "d"}
    assert g.python == ("python3", "-X", "dev") and not g.dry_run
    assert g.is_set("FROM") and not g.is_set("WITH")
    assert parse(["--dry-run"], {}).dry_run


@pytest.mark.parametrize("word", ["STEPS", "--steps=3", "TYPO=1", "-h"])
def test_a_word_that_is_not_a_known_variable_is_refused(word):
    with pytest.raises(UsageError, match="is not NAME=value"):
        parse([word], {})


def test_run_arguments_keep_the_order_a_run_records():
    g = given(GPU_MEMORY_GIB="3.5", MODEL="tiny", WARMUP="", DATA="synthetic", PROFILE="yes", COLD="0")
    assert commands.run_args(g) == ["--steps=3", "--batch-size=2", "--prefix=runs $5 it's", "--model=tiny",
                                    "--data=synthetic", "--warmup=", "--gpu-memory-gib=3.5", "--profile"]


@pytest.mark.parametrize("values, distributed", [({}, False), ({"NPROC": "1"}, False), ({"NPROC": "1 1"}, False),
                                                  ({"NPROC": "2"}, True), ({"PARALLEL": "fsdp"}, True),
                                                  ({"PARALLEL": "  "}, False)])
def test_a_run_is_distributed_where_nproc_or_parallel_says_so(values, distributed):
    g = given(**values)
    assert g.distributed() is distributed
    argv = commands.launch(g, [RUNGS["fused"].script])
    if distributed:
        assert argv[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            values.get("NPROC", "1")]
        assert argv[6:9] == [RUNGS["fused"].script, "--parallel", values.get("PARALLEL", "ddp")]
    else:
        assert argv[:2] == ["py", RUNGS["fused"].script]


@pytest.mark.parametrize("value", ["0", "x", "100", "-1", "2.5", "", " 2", "02"])
def test_repeat_is_a_count_from_1_to_99_as_typed(value):
    with pytest.raises(UsageError, match=f"^REPEAT must be a number of runs from 1 to 99, not '{value}' "):
        checks.repeat(given(REPEAT=value))
    assert checks.repeat(given()) == 1 and checks.repeat(given(REPEAT="42")) == 42


def test_the_basics_are_checked_in_order():
    with pytest.raises(UsageError, match=r"^STEPS is required \(e\.g\. make fused"):
        checks.run_basics(Given({"BATCH_SIZE": ""}))
    with pytest.raises(UsageError, match="^BATCH_SIZE is required"):
        checks.run_basics(Given({"STEPS": "1", "BATCH_SIZE": " "}))
    with pytest.raises(UsageError, match=r"^COLD must be 1 \(compile with an empty cache\) or 0, not 'on'$"):
        checks.run_basics(given(COLD="on", PROFILE="on"))
    checks.run_basics(given(COLD="false", PROFILE="1"))


def test_a_variable_given_empty_is_refused_not_read_as_its_default():
    checks.not_empty(given(), "FROM")
    with pytest.raises(UsageError, match=r"^FROM is empty: use FROM=fused or FROM=max, or leave it out \(fused\)$"):
        checks.not_empty(given(FROM=" "), "FROM")


@pytest.mark.parametrize("values, error", [
    ({"PEERS": ""}, "PEERS is empty: name some of llmc hf"),
    ({"PEERS": "hf nope"}, "PEERS names nope: use some of llmc hf"),
    ({"PEERS": "hf hf"}, "PEERS names hf twice: name each peer once (REPEAT=n runs rounds)"),
    ({"NPROC": ""}, "make peers runs each peer as one process, unprofiled: leave out NPROC, PARALLEL and PROFILE"),
    ({"PROFILE": "1"}, "make peers runs each peer as one process, unprofiled: leave out NPROC, PARALLEL and PROFILE"),
])
def test_peers_are_checked_before_any_runs(values, error):
    with pytest.raises(UsageError) as e:
        checks.peers(given(**values))
    assert str(e.value) == error
    assert checks.peers(given()) == ["llmc", "hf"] and checks.peers(given(NPROC="1")) == ["llmc", "hf"]


@pytest.mark.parametrize("rung", ["", "turbo", "max fused"])
def test_rung_must_name_one_rung(rung):
    with pytest.raises(UsageError, match=r"^RUNG must name one rung \(baseline "):
        checks.one_rung(given(RUNG=rung), "")


def test_a_dry_run_prints_every_command_in_order_and_runs_none(tmp_path, capsys):
    prefix = tmp_path / "out"
    rc = main(["ablation", f"PYTHON={sys.executable}", "STEPS=2", "BATCH_SIZE=1", f"PREFIX={prefix}", "FROM=max",
               "ADDITIONS=prefetch", "REPEAT=2", "DEVICE=cpu", "--dry-run"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and not prefix.exists()
    runs = [line.split(" --steps")[0].split(" ", 1)[1] for line in out if "--steps" in line]
    assert runs == [RUNGS["max"].script, "ablation.py --drop prefetch"] * 2
    assert out.count("--- round 2 of 2 ---") == 1 and out[-1].endswith(f"plot_results.py --prefix={prefix}")


def test_unknown_targets_and_commands_are_refused_naming_the_rungs(capsys):
    assert main(["unknown", "fuse"]) == 2 and main(["run", "fuse"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: no target 'fuse': the rungs are {' '.join(LADDER)}; make help lists the other targets"] * 2
    assert main(["bogus"]) == 2 and main(["fused"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: python -m Utils.suite: no command 'bogus' (python -m Utils.suite --help)",
        "error: python -m Utils.suite: no command 'fused' (python -m Utils.suite run fused)"]


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "leading_dash"])
def test_reset_removes_the_suites_files_only_and_clean_keeps_the_results(tmp_path, capsys, monkeypatch, relative):
    # A PREFIX that begins with a dash (-name, relative to the folder make runs in) is a folder like any other.
    folder = tmp_path / "-name"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    # .tmp-1: another program's temporary file, which the suite leaves alone
    names = ["results.csv", "runs.csv", "summary.md", "speedup.png", ".tmp-gpt-suite-1", ".tmp-1", ".results.lock",
             "trace_a.json.gz", "12-peer-llmc.log", ".before-append-runs.csv", "notes.txt", "data.csv"]
    for name in names:
        (folder / name).write_text("x")
    g = Given({"PREFIX": "-name" if relative else str(folder)}, dry_run=False)
    tmp_path = folder
    runner = Runner()
    assert folders.clean(g, runner) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {"summary.md", "speedup.png",
                                                                               ".tmp-gpt-suite-1"})
    assert folders.reset(g, runner) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-1", "data.csv", "notes.txt"]
    assert folders.reset(Given({"PREFIX": str(tmp_path / "nowhere")}), runner) == 0
    assert "does not exist: nothing to remove" in capsys.readouterr().out
