"""The results contract, written down once: the files in PREFIX, their columns, which columns hold numbers,
and the statuses a run ends with. The writer (Utils.results.store), the readers (Utils.results.read, the
report) and the breakdown all take their names from here.

The columns and their order are the files' format: results committed under results/ are read and appended
to with exactly these headers, so a column is never renamed, dropped or moved here without a schema version
that tells the old files apart.
"""
from typing import NamedTuple

STEPS_FILE = "results.csv"        # a row per step
RUNS_FILE = "runs.csv"            # a row per run
BREAKDOWN_FILE = "breakdown.csv"  # a row per class (compute, memory, ...) per profiled run
LOCK_FILE = ".results.lock"       # held while any of them is appended to


class Column(NamedTuple):
    name: str
    numeric: bool                 # read back as a float (a blank cell is NaN); otherwise text
    meaning: str                  # with its unit


STEP_SCHEMA = (
    Column("run_id", False, "the run the step belongs to (runs.csv's run_id)"),
    Column("optimization", False, "the run's name: a rung (fused) or a combination of additions (fused+loss)"),
    Column("step", True, "step number, from 0"),
    Column("warmup", True, "1 for a warm-up step (left out of every summary), else 0"),
    Column("step_ms", True, "step time in milliseconds: the step whole (batch copy to optimizer step), between CUDA events around it (perf_counter on a CPU)"),
    Column("tokens_per_s", True, "global batch x seq_len / step time"),
    Column("loss", True, "training loss of the step"),
    Column("mfu", True, "model FLOPs utilization, a fraction of the GPU's dense bf16 peak; blank when unknown"),
)

RUN_SCHEMA = (
    Column("run_id", False, "unique id of the run"),
    Column("optimization", False, "the run's name: a rung (fused) or a combination of additions (fused+loss)"),
    Column("status", False, "one of STATUSES"),
    Column("message", False, "why a run that is not ok ended, one line"),
    Column("started_at", False, "UTC start time, ISO 8601"),
    Column("steps", True, "steps run and timed"),
    Column("warmup_steps", True, "first steps left out of the summaries"),
    Column("batch_size", True, "sequences per step per GPU"),
    Column("seq_len", True, "tokens per sequence"),
    Column("model", False, "model preset (gpt2, tiny, ...)"),
    Column("n_params", True, "parameters, position embedding included"),
    Column("data", False, "data set (shakespeare, synthetic, a file)"),
    Column("device", False, "cuda or cpu"),
    Column("gpu_name", False, "the device's name (torch.cuda.get_device_name), or cpu"),
    Column("torch_version", False, "torch.__version__"),
    Column("cuda_version", False, "torch.version.cuda"),
    Column("compile_s", True, "what the first step took beyond a normal one, in seconds"),
    Column("peak_mem_allocated_gib", True, "max memory allocated by tensors, GiB"),
    Column("peak_mem_reserved_gib", True, "max memory reserved by the caching allocator, GiB"),
    Column("median_step_ms", True, "median step time of the measured steps, ms"),
    Column("iqr_step_ms", True, "interquartile range of the measured step times, ms"),
    Column("median_tokens_per_s", True, "tokens/s at the median step time"),
    Column("mfu", True, "median MFU of the measured steps, a fraction"),
    Column("final_loss", True, "loss of the last step"),
    Column("notes", False, "what could not apply on this machine, and what ran instead"),
    Column("git_commit", False, "commit of the code that ran, with -dirty for uncommitted changes"),
    Column("command", False, "the command line"),
    Column("config", False, 'JSON: {"run": settings, "additions": [names]} ({"run", "recipe"} in older runs)'),
)

BREAKDOWN_SCHEMA = (
    Column("run_id", False, "the profiled run"),
    Column("rung", False, "the run's name, as optimization in runs.csv"),
    Column("class", False, "compute, memory, unknown, overhead, or cpu_ops on a CPU"),
    Column("ms_per_step", True, "the class's time in the mean profiled step, ms"),
    Column("share", True, "ms_per_step / profiled_step_ms"),
    Column("profiled_step_ms", True, "mean profiled step window, ms"),
    Column("median_step_ms", True, "median of the run's unprofiled measured steps, ms"),
    Column("profiled_steps", True, "profiled step windows"),
    Column("compute_tflops", True, "model FLOPs per step / compute time, TFLOP/s"),
    Column("peak_tflops", True, "the GPU's dense bf16 peak, TFLOP/s"),
)

STEP_COLUMNS = [c.name for c in STEP_SCHEMA]
RUN_COLUMNS = [c.name for c in RUN_SCHEMA]
BREAKDOWN_COLUMNS = [c.name for c in BREAKDOWN_SCHEMA]
STEP_NUMERIC = [c.name for c in STEP_SCHEMA if c.numeric]
RUN_NUMERIC = [c.name for c in RUN_SCHEMA if c.numeric]
BREAKDOWN_NUMERIC = [c.name for c in BREAKDOWN_SCHEMA if c.numeric]

# ok: every step ran; oom: the batch did not fit; skipped: the run's change cannot run on this machine;
# failed: an unexpected error; interrupted: Ctrl-C or SIGTERM. The steps measured before the end are kept.
STATUSES = ("ok", "oom", "skipped", "failed", "interrupted")

# Two runs are compared (a speedup, a scaling figure) only when these run columns are equal: the same work
# on the same kind of device.
MATCH_KEYS = ("batch_size", "seq_len", "model", "data", "device", "gpu_name")
