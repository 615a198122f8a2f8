"""Shared fixtures. Local copies of the tokenizer files and of tiny shakespeare are found only through
settings a user could set too: TEST_TIKTOKEN_CACHE_DIR and TEST_SHAKESPEARE, else ../shared beside the
repository."""
import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from Utils.model import GPT, PRESETS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared"))


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiktoken_cache():
    """Points TIKTOKEN_CACHE_DIR at a local copy of tiktoken's gpt2 files for the session; their folder."""
    path = os.environ.get("TEST_TIKTOKEN_CACHE_DIR") or os.path.join(SHARED, "tiktoken_cache")
    path = os.path.abspath(path)
    if not os.path.isdir(path) or not os.listdir(path):
        pytest.fail(f"tiktoken's gpt2 files not found at {path}: set TEST_TIKTOKEN_CACHE_DIR to a folder "
                    f"holding them (as tiktoken caches them)", pytrace=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", path)
        yield path


@pytest.fixture(scope="session")
def shakespeare_path():
    """Absolute path of a local copy of tiny shakespeare (read it, never write to it)."""
    path = os.path.abspath(os.environ.get("TEST_SHAKESPEARE") or os.path.join(SHARED, "data", "tinyshakespeare.txt"))
    if not os.path.isfile(path):
        pytest.fail(f"tiny shakespeare not found at {path}: set TEST_SHAKESPEARE to a local copy of it",
                    pytrace=False)
    return path


def summary_table(prefix):
    """summary.md's table as {rung: {column header: cell text}}, in table order."""
    with open(os.path.join(prefix, "summary.md")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return {r[0]: dict(zip(header, r)) for r in rows}


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="session")
def suite_env(tmp_path_factory, tiktoken_cache, shakespeare_path):
    data_dir = tmp_path_factory.mktemp("data")
    shutil.copy(shakespeare_path, data_dir / "tinyshakespeare.txt")
    return dict(clean_env(), DATA_DIR=str(data_dir), TIKTOKEN_CACHE_DIR=tiktoken_cache, PYTHONUNBUFFERED="1")


# make reads its variables from the environment too: a PREFIX or STEPS exported in the shell that runs
# the tests must not reach the suite (a test's `make reset` would then delete that PREFIX's results).
MAKE_VARIABLES = ("STEPS", "BATCH_SIZE", "PREFIX", "MODEL", "SEQ_LEN", "DEVICE", "DATA", "WARMUP", "SEED",
                  "DATA_DIR", "PROFILE", "PYTHON", "RESULTS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")


def clean_env():
    return {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}


def make(args, env, **kw):
    return subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}"] + args, cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, **kw)


def run_interpreted(code, repo_root):
    """Run code in a fresh interpreter with TRITON_INTERPRET=1 and return the JSON it prints last. The
    variable must be set before triton is imported (@triton.jit decides then), so never in this process."""
    if sys.platform != "linux":
        pytest.skip("Triton, and with it its interpreter, is published for Linux only")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": repo_root}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def model_pair(variant, dtype=None, batch=3, **common):
    """(plain, changed, inputs, targets): two tiny GPTs (vocabulary 97) with the same weights in dtype
    (float64 by default), the second with the config fields in `variant`, both with those in `common`; and
    a batch of 24-token sequences whose targets are the inputs shifted by one."""
    config = replace(PRESETS["tiny"], vocab_size=97, **common)
    torch.manual_seed(0)
    plain = GPT(config).to(dtype or torch.float64)
    changed = GPT(replace(config, **variant)).to(dtype or torch.float64)
    changed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, config.vocab_size, (batch, 24))
    return plain, changed, idx, torch.roll(idx, -1, 1)

