"""Shared fixtures. Local copies of the tokenizer files and of tiny shakespeare are found only through
settings a user could set too: TEST_TIKTOKEN_CACHE_DIR and TEST_SHAKESPEARE, else ../shared beside the
repository."""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

# The tests check what compiled code does, not how fast it runs. Inductor's C++ kernels without explicit SIMD
# (TORCHINDUCTOR_VEC_ISA_OK=0) compile in 60% of the time: a cold tiny `flash` run took 16 s against 27 s on two
# cores. Set before torch is imported, which reads it once; every make and script a test starts inherits it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch  # noqa: E402

from Utils.model import GPT
from Utils.model_config import PRESETS
from Utils.results.schema import RUN_SCHEMA, STEP_SCHEMA, headers
from Utils.results.store import append_run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared"))

# A background job (`make test &`) starts with SIGINT and SIGQUIT ignored, and every make a test starts would inherit
# that and outlive a terminal's signal; the tests send the signals a terminal's make gets.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _restore_tf32():
    """A run built in this process (the tf32 addition) switches TF32 on for the whole process; each test
    starts from the flags it found, so that an fp32 tolerance elsewhere is not met or missed by test order."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


def _downloads(config, name):
    """A folder under pytest's cache (.pytest_cache in the repository) that keeps a download between runs."""
    return str(config.cache.mkdir(f"downloads-{name}"))


@pytest.fixture(scope="session")
def tiktoken_cache(request):
    """Points TIKTOKEN_CACHE_DIR at tiktoken's gpt2 files for the session; their folder. A local copy
    (TEST_TIKTOKEN_CACHE_DIR, else ../shared/tiktoken_cache) wins; else tiktoken downloads them once into
    pytest's cache, and the tests that need them are skipped, saying why, where that download fails."""
    path = os.path.abspath(os.environ.get("TEST_TIKTOKEN_CACHE_DIR") or os.path.join(SHARED, "tiktoken_cache"))
    if not os.path.isdir(path) or not os.listdir(path):
        path = _downloads(request.config, "tiktoken")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TIKTOKEN_CACHE_DIR", path)
            try:
                import tiktoken
                tiktoken.get_encoding("gpt2").encode("hello")
            except OSError as e:   # offline: requests' errors and the OS's are OSErrors; anything else fails
                pytest.skip(f"tiktoken's gpt2 files could not be downloaded ({type(e).__name__}); set "
                            f"TEST_TIKTOKEN_CACHE_DIR to a local copy to run this offline")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", path)
        yield path


@pytest.fixture(scope="session")
def shakespeare_path(request):
    """Absolute path of tiny shakespeare (read it, never write to it): a local copy (TEST_SHAKESPEARE, else
    ../shared/data), else downloaded once into pytest's cache; skipped, saying why, where that fails."""
    path = os.path.abspath(os.environ.get("TEST_SHAKESPEARE") or os.path.join(SHARED, "data", "tinyshakespeare.txt"))
    if os.path.isfile(path):
        return path
    from Utils.train.data import DataError, fetch_shakespeare
    try:
        return fetch_shakespeare(_downloads(request.config, "shakespeare"))
    except DataError as e:
        pytest.skip(f"tiny shakespeare could not be downloaded ({str(e).split(' (')[0]}); set TEST_SHAKESPEARE "
                    f"to a local copy to run this offline")


def summary_text(prefix):
    with open(os.path.join(prefix, "summary.md")) as f:
        return f.read()


def run_main(prefix):
    """plot_results.py's main on PREFIX in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from Utils.report.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--prefix", str(prefix)])
    return rc, out.getvalue(), err.getvalue()


def summary_table(prefix):
    """summary.md's first table (the ladder's) as {rung: {column header: cell text}}, in table order."""
    with open(os.path.join(prefix, "summary.md")) as f:
        text = f.read().split("\n## ")[0]
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return {r[0]: dict(zip(header, r)) for r in rows}


def sticks_out(fig):
    """Whether any text or artist of fig reaches past its edges once rendered (it would be cut off)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())    # inches
    width, height = fig.get_size_inches()
    return box.x0 < -0.01 or box.y0 < -0.01 or box.x1 > width + 0.01 or box.y1 > height + 0.01


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="session")
def suite_env(tmp_path_factory, tiktoken_cache, shakespeare_path):
    data_dir = tmp_path_factory.mktemp("data")
    shutil.copy(shakespeare_path, data_dir / "tinyshakespeare.txt")
    return dict(clean_env(), DATA_DIR=str(data_dir), TIKTOKEN_CACHE_DIR=tiktoken_cache, PYTHONUNBUFFERED="1")


def _user_variables() -> tuple[str, ...]:
    """The Makefile's USER_VARIABLES, read from it: the list cannot fall behind a variable the Makefile adds."""
    with open(os.path.join(REPO_ROOT, "Makefile")) as f:
        found = re.search(r"^USER_VARIABLES :=((?:.*\\\n)*.*)$", f.read(), re.M)
    return tuple(found.group(1).replace("\\\n", " ").split())


# make reads its variables from the environment too: a PREFIX or STEPS exported in the shell that runs
# the tests must not reach the suite (a test's `make reset` would then delete that PREFIX's results).
MAKE_VARIABLES = _user_variables() + ("PYTHON", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")


def clean_env():
    return {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}


def cuda_graph(fn):
    """(fn captured in a CUDA graph after a warm-up call on a side stream, as torch.cuda.graph asks; what the
    captured call returned, whose memory each replay writes again)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


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


def _swap_in_cpu_paths():
    """Addition -> a function swapping its module into a Build's model, for the additions whose apply function
    keeps the plain module on a CPU because their kernel needs a GPU: the module they would swap in runs
    the same mathematics in PyTorch operations on a CPU, which is what a test compares with the plain model.
    (cudnn_attention's module asks SDPA for cuDNN's backend, which a CPU lacks: a test patches
    Utils.ladder.modules.sdpa_kernel to run it.)"""
    from Utils.ladder import modules

    def swap(attribute, module):
        def apply(b):
            for block in modules.blocks(b.model):
                setattr(block, attribute, module(getattr(block, attribute)))
        return apply
    return {"gelu_epilogue": swap("mlp", modules.EpilogueMLP),
            "cudnn_attention": swap("attn", modules.CudnnAttention),
            "packed_attention": swap("attn", modules.PackedAttention)}


def model_pair(additions, dtype=None, batch=3, common=(), **fields):
    """(plain, changed, inputs, targets): two tiny GPTs (vocabulary 97, and the GPTConfig `fields`) with the
    same weights in dtype (float64 by default), both with the additions in `common`, the second with those
    in `additions` too; and a batch of 24-token sequences whose targets are the inputs shifted by one.

    Additions apply as Utils.ladder.apply.build applies them, in the registry's order: the settings ones
    change the config, the model ones swap modules in (see _swap_in_cpu_paths for those whose kernel needs
    a GPU). Only those two stages build a model; tf32 is refused too, since it sets process-wide flags."""
    from Utils.ladder import apply
    from Utils.ladder.registry import ADDITIONS

    additions, common = ((names,) if isinstance(names, str) else tuple(names) for names in (additions, common))
    order = list(ADDITIONS)
    refused = [a for a in (*additions, *common) if a == "tf32" or ADDITIONS[a].stage not in ("settings", "model")]
    if refused:
        raise ValueError(f"model_pair builds models only: {', '.join(refused)} changes no module")
    cpu_paths = _swap_in_cpu_paths()

    def make(names):
        names = sorted(set(names), key=order.index)
        b = apply.Build(device=torch.device("cpu"), config=replace(PRESETS["tiny"], vocab_size=97, **fields),
                        additions=tuple(names))
        for name in names:
            if ADDITIONS[name].stage == "settings":
                apply.APPLY[name](b)
        # The same draws for both: the same weights (a padded vocabulary pads after the init).
        torch.manual_seed(0)
        b.model = GPT(b.config).to(dtype or torch.float64)
        for name in names:
            if ADDITIONS[name].stage == "model":
                (cpu_paths.get(name) or apply.APPLY[name])(b)
        return b.model

    plain, changed = make(common), make((*common, *additions))
    idx = torch.randint(0, plain.config.vocab_size, (batch, 24))
    return plain, changed, idx, torch.roll(idx, -1, 1)


def rewrite_as_version_1(prefix):
    """Rewrite prefix's results.csv and runs.csv with schema version 1's columns, as the suite wrote them then."""
    for name, schema in (("results.csv", STEP_SCHEMA), ("runs.csv", RUN_SCHEMA)):
        path = os.path.join(prefix, name)
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=headers(schema)[1], extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)


# --- a results folder written through the suite's writer, without training -----------------------------------

RUN_CONFIG = dict(batch_size=4, seq_len=32, model="tiny", data="synthetic", device="cpu", gpu_name="cpu",
                  started_at="2026-01-01T00:00:00+00:00", warmup_steps=1, git_commit="0123456789abcdef")


def step_rows(run_id, rung, ms):
    """Step rows of one run: a warm-up step, then ms."""
    return [dict(run_id=run_id, optimization=rung, step=i, warmup=i == 0, step_ms=m, tokens_per_s=128 / m * 1000,
                 loss=5.0 - 0.1 * i, mfu=None) for i, m in enumerate([900.0, *ms])]


def add_run(prefix, rung, ms=(100.0, 101.0, 99.0), status="ok", run_id=None):
    """Append one whole run through the suite's writer; its run_id."""
    run_id = run_id or f"{rung}-{status}"
    os.makedirs(prefix, exist_ok=True)
    append_run(prefix, dict(run_id=run_id, optimization=rung, status=status, steps=len(ms) + 1, **RUN_CONFIG),
               step_rows(run_id, rung, ms) if ms else [])
    return run_id


def two_runs(prefix):
    """baseline and tf32 (twice as fast), whole."""
    add_run(prefix, "baseline")
    add_run(prefix, "tf32", (50.0, 50.5, 49.5))
    return prefix
