"""Bad input: one line naming the value and the fix, a non-zero exit, and existing results untouched."""
import os
import subprocess
import sys

import pytest

from Utils.ladder.registry import RUNGS
from Utils.train.cli import parse_args

from Utils.train.run import main

from conftest import clean_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)


def test_defaults_on_a_cpu():
    cfg = parse_args(["--steps", "10", "--batch-size", "2", "--prefix", "out"])
    assert (cfg.model, cfg.device, cfg.seq_len, cfg.data, cfg.warmup) == ("tiny", "cpu", 128, "auto", 5)
    assert parse_args(["--steps", "3", "--batch-size", "2", "--prefix", "o"]).warmup == 2
    assert parse_args(["--steps", "3", "--batch-size", "2", "--prefix", "o", "--model", "gpt2"]).seq_len == 1024


@pytest.fixture
def prefix_with_results(tmp_path):
    prefix = tmp_path / "out"
    prefix.mkdir()
    assert main("baseline", ["--steps", "2", "--batch-size", "1", "--prefix", str(prefix), "--data", "synthetic",
                           "--seq-len", "8"]) == 0
    return prefix


BAD = [
    (["--steps", "0"], "STEPS='0'"),
    (["--steps", "-1"], "STEPS='-1'"),
    (["--steps", "abc"], "STEPS='abc'"),
    (["--steps", ""], "STEPS=''"),
    (["--batch-size", "0"], "BATCH_SIZE='0'"),
    (["--batch-size", "-1"], "BATCH_SIZE='-1'"),
    (["--batch-size", "abc"], "BATCH_SIZE='abc'"),
    (["--batch-size", ""], "BATCH_SIZE=''"),
    (["--warmup", "0"], "WARMUP='0'"),
    (["--warmup", "-1"], "WARMUP='-1'"),
    (["--warmup", "abc"], "WARMUP='abc'"),
    (["--warmup", ""], "WARMUP=''"),
    (["--warmup", "4"], "WARMUP=4 leaves no measured step of STEPS=4"),
    (["--warmup", "9"], "WARMUP=9"),
    (["--model", "gpt5"], "MODEL='gpt5'"),
    (["--device", "tpu"], "DEVICE='tpu'"),
    (["--seq-len", "129"], "SEQ_LEN=129 is above tiny's block size 128"),
    (["--seq-len", "0"], "SEQ_LEN='0'"),
    (["--data", "/no/such/file.txt"], "DATA='/no/such/file.txt'"),
    (["--seed", "-3"], "SEED='-3'"),
    (["--bogus", "1"], "unrecognized arguments"),
]


@pytest.mark.parametrize("override,expected", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_and_leaves_results(prefix_with_results, capsys, override, expected):
    before = {p: (prefix_with_results / p).read_bytes() for p in ("results.csv", "runs.csv")}
    capsys.readouterr()
    args = {"--steps": "4", "--batch-size": "2", "--prefix": str(prefix_with_results), "--data": "synthetic"}
    extra = []
    for i in range(0, len(override), 2):
        if override[i] in args:
            args[override[i]] = override[i + 1]
        else:
            extra += override[i:i + 2]
    argv = [x for kv in args.items() for x in kv] + extra
    assert main("baseline", argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert out == ""
    assert {p: (prefix_with_results / p).read_bytes() for p in before} == before


def test_device_cuda_without_gpu(capsys, tmp_path):
    assert main("baseline", ["--steps", "2", "--batch-size", "1", "--prefix", str(tmp_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "DEVICE=cuda but PyTorch sees no CUDA GPU" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.csv").exists()


def test_unwritable_prefix(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    assert main("baseline", ["--steps", "2", "--batch-size", "1", "--prefix", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert f"PREFIX={blocker / 'out'} cannot be written" in err and len(err.strip().splitlines()) == 1
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("target,missing", [
    ("fused STEPS=5 BATCH_SIZE=2", "PREFIX"),
    ("fused BATCH_SIZE=2 PREFIX=x", "STEPS"),
    ("all STEPS=5 PREFIX=x", "BATCH_SIZE"),
    ("baseline STEPS= BATCH_SIZE=2 PREFIX=x", "STEPS"),
    ("plots", "PREFIX"),
    ("reset", "PREFIX"),
    ("clean", "PREFIX"),
])
def test_make_names_a_missing_variable(target, missing):
    r = subprocess.run(["make", "--no-print-directory", "-s", f"PYTHON={sys.executable}"] + target.split(), cwd=REPO,
                       capture_output=True, text=True, env=clean_env())
    assert r.returncode != 0
    assert f"error: {missing} is required (e.g. make fused STEPS=50 BATCH_SIZE=16 PREFIX=./out)" in r.stderr


@pytest.mark.parametrize("repeat", ["0", "x", "100", "-1", "2.5", ""])
def test_make_refuses_a_repeat_that_is_not_a_number_of_runs(repeat, tmp_path):
    r = subprocess.run(["make", "--no-print-directory", "-s", f"PYTHON={sys.executable}", "fused", "STEPS=3",
                        "BATCH_SIZE=2", f"PREFIX={tmp_path}", f"REPEAT={repeat}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=clean_env())
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (f"error: REPEAT must be a number of runs from 1 to 99, not '{repeat}' "
                                        f"(e.g. make max STEPS=60 BATCH_SIZE=16 PREFIX=./out REPEAT=3)")
    assert not (tmp_path / "results.csv").exists()


@pytest.mark.parametrize("variable,meaning", [("COLD", "compile with an empty cache"), ("PROFILE", "profile the run too")])
def test_make_refuses_a_switch_that_is_not_one_or_zero(variable, meaning, tmp_path):
    # Anything but a yes or a no would otherwise drop the switch silently: PROFILE=on, an ordinary run.
    r = subprocess.run(["make", "--no-print-directory", "-s", f"PYTHON={sys.executable}", "fused", "STEPS=3",
                        "BATCH_SIZE=2", f"PREFIX={tmp_path}", f"{variable}=on"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=clean_env())
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == f"error: {variable} must be 1 ({meaning}) or 0, not 'on'"
    assert not (tmp_path / "results.csv").exists()


def test_make_names_the_rungs_for_an_unknown_target():
    r = subprocess.run(["make", "--no-print-directory", "-s", f"PYTHON={sys.executable}", "fuse"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (f"error: no target 'fuse': the rungs are {' '.join(RUNGS)}; "
                                        f"make help lists the other targets")


def test_steps_must_leave_a_measured_step(capsys, tmp_path):
    assert main("baseline", ["--steps", "1", "--batch-size", "1", "--prefix", str(tmp_path)]) == 2
    assert "STEPS=1 leaves no measured step" in capsys.readouterr().err
    assert not (tmp_path / "results.csv").exists()


def test_a_batch_larger_than_the_data_is_refused_before_anything_is_written(prefix_with_results, capsys, tmp_path,
                                                                              tiktoken_cache):
    before = (prefix_with_results / "runs.csv").read_bytes()
    text = tmp_path / "short.txt"
    text.write_text("To be, or not to be.")
    capsys.readouterr()
    assert main("baseline", ["--steps", "2", "--batch-size", "4", "--prefix", str(prefix_with_results), "--data",
                           str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fewer than one batch needs (BATCH_SIZE=4 x SEQ_LEN=128 + 1)" in err[0]
    assert (prefix_with_results / "runs.csv").read_bytes() == before


def test_make_all_checks_its_arguments_once(tmp_path):
    r = subprocess.run(["make", "--no-print-directory", "all", f"PYTHON={sys.executable}", "STEPS=0", "BATCH_SIZE=2",
                        f"PREFIX={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert errors == ["error: STEPS='0' is not a positive integer: pass the number of steps to time, "
                      "e.g. make fused STEPS=50 BATCH_SIZE=16 PREFIX=./out"]
    assert not (tmp_path / "results.csv").exists()
