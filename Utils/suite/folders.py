"""The targets that read or tidy a results folder: charts, comparison, an empty folder, the machine's peaks, and
removing what the suite wrote (by name: anything else in PREFIX is left alone)."""
import glob
import os

from Utils.results.files import TEMPORARY_PREFIX
from Utils.suite import checks, commands
from Utils.suite.given import Given
from Utils.suite.process import Runner
from Utils.train.usage import UsageError, fail

# The charts and reports the suite draws into PREFIX; reset removes the results as well.
CHARTS = ("speedup.png", "step_time.png", "throughput.png", "memory.png", "loss.png", "summary.md", "breakdown.md",
          "breakdown.png", "compare.md", "compare.png", "scaling.png")
CLEAN = CHARTS + (TEMPORARY_PREFIX + "*",)
# .before-append-*: an append killed midway (Utils.results.store)
RESET = CHARTS + ("results.csv", "runs.csv", "breakdown.csv", "kernels.csv", "peak.csv", "trace_*.json.gz",
                  "*.error.log", "[0-9]*-peer-*.log", "Optimizing_GPU_Utilization.ipynb", ".results.lock",
                  TEMPORARY_PREFIX + "*", ".rank-failure-*", ".before-append-*")


def plots(g: Given, runner: Runner) -> int:
    checks.prefix(g)
    return runner.run(commands.plot(g), show=True)


def compare(g: Given, runner: Runner) -> int:
    """One table and one chart across results folders (each word of PREFIXES), into OUT (default: the first)."""
    if not g.stripped("PREFIXES"):
        raise UsageError('PREFIXES is required: two or more results folders, e.g. make compare '
                         'PREFIXES="results/h200-b16 results/h100-b16" [OUT=dir]')
    checks.folder(g, "PREFIXES")
    checks.folder(g, "OUT")
    out = [f"--out={g.text('OUT')}"] if g.is_set("OUT") else []
    return runner.run([*g.python, "-m", "Utils.report.compare", *out, "--", *g.words("PREFIXES")], show=True)


def init_results(g: Given, runner: Runner) -> int:
    checks.prefix(g)
    return runner.run([*g.python, "-m", "Utils.results.store", "init", g.text("PREFIX")], show=True)


def peak(g: Given, runner: Runner) -> int:
    """This machine's bf16 matmul rate and copy bandwidth, a row of PREFIX/peak.csv: MFU's second denominator."""
    checks.prefix(g)
    given = [f"{flag}={g.text(name)}" for name, flag in
             (("DEVICE", "--device"), ("MATMUL_N", "--matmul-n"), ("COPY_GIB", "--copy-gib")) if g.is_set(name)]
    return runner.run([*g.python, "-m", "Utils.peak", f"--prefix={g.text('PREFIX')}", *given], show=True)


def clean(g: Given, runner: Runner) -> int:
    return _remove(g, runner, CLEAN)


def reset(g: Given, runner: Runner) -> int:
    return _remove(g, runner, RESET)


def _remove(g: Given, runner: Runner, names: tuple[str, ...]) -> int:
    """rm -fv of `names` in PREFIX (a pattern: what it matches there); a PREFIX that does not exist has nothing
    to remove; one that is not a folder, or whose files cannot be removed, is an error naming it."""
    checks.prefix(g)
    prefix = g.text("PREFIX")
    if not os.path.lexists(prefix):
        print(f"PREFIX={prefix} does not exist: nothing to remove", flush=True)
        return 0
    if not os.path.isdir(prefix):
        return fail(f"PREFIX={prefix} is not a folder")
    found = [m for name in names for m in (sorted(glob.glob(name, root_dir=prefix)) if set(name) & set("*?[")
                                           else [name])]
    rc = runner.run(["rm", "-fv", "--", *found], cwd=prefix)
    return fail(f"cannot remove the suite's files in PREFIX={prefix} (see above)", 1) if rc else 0
