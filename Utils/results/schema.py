"""The results contract, written down once: the files in PREFIX, their columns, which columns hold numbers,
and the statuses a run ends with. The writer (Utils.results.store), the readers (Utils.results.read, the
report) and the breakdown all take their names from here.

The columns and their order are the files' format. Each column names the schema version that added it
(`since`): a file written by an earlier version has that version's columns, a prefix of today's, and is read
(the later columns blank) and appended to (its header widened first). A column is added at the end with
a new version and never renamed, dropped or moved: a header that is no version's is foreign and refused.
"""
from typing import NamedTuple

SCHEMA_VERSION = 6   # 2: schema_version, wall-clock steps (window_wall_s), provenance, clocks and power
                     # 3: several GPUs (nproc, parallel, global and per-GPU tokens/s)
                     # 4: the attention kernel that ran, micro-batches, the GPU memory cap
                     # 5: several hosts (nnodes, hosts)
                     # 6: every kernel of each profiled run (kernels.csv)

STEPS_FILE = "results.csv"        # a row per step
RUNS_FILE = "runs.csv"            # a row per run
BREAKDOWN_FILE = "breakdown.csv"  # a row per class (compute, memory, ...) per profiled run
KERNELS_FILE = "kernels.csv"      # a row per kernel per profiled run
LOCK_FILE = ".results.lock"       # held while any of them is appended to


class Column(NamedTuple):
    name: str
    numeric: bool                 # read back as a float (a blank cell is NaN); otherwise text
    meaning: str                  # with its unit
    since: int = 1                # the schema version that added it
    default: str = ""             # its value in rows written before it existed


STEP_SCHEMA = (
    Column("run_id", False, "the run the step belongs to (runs.csv's run_id)"),
    Column("optimization", False, "the run's name: a rung (fused), a combination of additions (fused+loss), or a peer (peer-llmc)"),
    Column("step", True, "step number, from 0"),
    Column("warmup", True, "1 for a warm-up step (left out of every summary), else 0"),
    Column("step_ms", True, "step time in milliseconds: from the previous step's end to this step's end, both marked on the device (a CUDA event on the stream; perf_counter on a CPU), so host time between steps counts. Before version 2: CUDA events around the step alone"),
    Column("tokens_per_s", True, "global batch x seq_len / step time"),
    Column("loss", True, "training loss of the step"),
    Column("mfu", True, "model FLOPs utilization, a fraction of the GPU's dense bf16 peak; blank when unknown"),
    Column("schema_version", True, "the schema version that wrote the row (blank: 1)", since=2),
)

RUN_SCHEMA = (
    Column("run_id", False, "unique id of the run"),
    Column("optimization", False, "the run's name: a rung (fused), a combination of additions (fused+loss), or a peer (peer-llmc)"),
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
    Column("peak_mem_reserved_gib", True, "max memory reserved by the caching allocator, GiB; for a peer in a program of its own (peer-llmc, no allocated figure): the GPU's memory in use after it allocated its state, as it reports it"),
    Column("median_step_ms", True, "median step time of the measured steps, ms"),
    Column("iqr_step_ms", True, "interquartile range of the measured step times, ms"),
    Column("median_tokens_per_s", True, "tokens/s at the median step time"),
    Column("mfu", True, "median MFU of the measured steps, a fraction"),
    Column("final_loss", True, "loss of the last step"),
    Column("notes", False, "what could not apply on this machine, and what ran instead"),
    Column("git_commit", False, "commit of the code that ran, with -dirty- and the changes' hash for uncommitted changes"),
    Column("command", False, "the command line"),
    Column("config", False, 'JSON: {"run": settings, "additions": [names], "fell_back": [the additions that noted '
                            'what ran instead]} ({"run", "recipe"} in older runs)'),
    Column("schema_version", True, "the schema version that wrote the row (blank: 1)", since=2),
    Column("window_wall_s", True, "wall-clock seconds of the measured steps, from the last warm-up step's end "
           "to the last step's end (perf_counter after synchronizing); the measured step_ms add up to it", since=2),
    Column("flops_per_token", True, "model FLOPs per token (6N + attention), the numerator of MFU", since=2),
    Column("compile_cache", False, "warm: every graph torch.compile needed came from Inductor's caches; cold: "
           "none did (COLD=1 runs with an empty cache); partial: some did; blank without torch.compile", since=2),
    Column("gpu_uuid", False, "the GPU's UUID (GPU-...)", since=2),
    Column("driver_version", False, "NVIDIA driver version (NVML)", since=2),
    Column("cudnn_version", False, "cuDNN version PyTorch loaded (torch.backends.cudnn.version())", since=2),
    Column("triton_version", False, "triton's version, where installed", since=2),
    Column("bitsandbytes_version", False, "bitsandbytes' version, where installed", since=2),
    Column("cudnn_frontend_version", False, "nvidia-cudnn-frontend's version, where installed", since=2),
    Column("sm_clock_mhz_median", True, "median SM clock over the measured steps, MHz (NVML samples)", since=2),
    Column("power_w_median", True, "median board power over the measured steps, W (NVML samples)", since=2),
    Column("temp_c_max", True, "highest GPU temperature over the measured steps, deg C (NVML samples)", since=2),
    Column("throttle_reasons", False, "the distinct clock event (throttle) reasons NVML reported over the measured "
           "steps, space-separated (none: none seen)", since=2),
    Column("nproc", True, "processes, one GPU each (torchrun's world size); 1 for a run without torchrun",
           since=3, default="1"),
    Column("parallel", False, "ddp or fsdp (PARALLEL) for a run through torchrun; blank for a single process",
           since=3),
    Column("global_tokens_per_s", True, "tokens/s of all processes together at the median step time", since=3),
    Column("tokens_per_s_per_gpu", True, "global_tokens_per_s / nproc", since=3),
    Column("attention_kernel", False, "the attention kernel a warm-up step ran, read off its operators: flash2 "
           "(FlashAttention-2), cudnn (cuDNN's fused attention), efficient (memory-efficient), math, flash_cpu, packed "
           "(the packed_attention addition), or written_out (no SDPA); '+'-joined if several; llm.c's build runs "
           "cuDNN's", since=4),
    Column("micro_batch", True, "rows one forward/backward held (MICRO_BATCH, or what auto found to fit); "
           "blank before version 4: the whole batch", since=4),
    Column("accumulation_steps", True, "micro-batches a step accumulated: batch_size / micro_batch", since=4),
    Column("gpu_memory_gib", True, "the GPU memory the run was capped to (GPU_MEMORY_GIB), GiB; blank: the card's",
           since=4),
    Column("nnodes", True, "hosts the run's processes spread over (NNODES); nproc counts the processes of all",
           since=5, default="1"),
    Column("hosts", False, "the hosts' names, space-separated, host 0 (NODE_RANK=0) first; blank before version 5",
           since=5),
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

# Each profiled run's kernels, kept where its trace is not: a trace is tens of MB and stays out of a committed folder,
# and without its kernels the time of a class of them (attention, the output layer's GEMMs) cannot be read later.
KERNEL_SCHEMA = tuple(c._replace(since=6) for c in (   # the file is new in version 6
    Column("run_id", False, "the profiled run"),
    Column("rung", False, "the run's name, as optimization in runs.csv"),
    Column("class", False, "compute, memory, or unknown: a kernel Utils.report.breakdown.kernels does not name"),
    Column("kind", False, "what the kernel is, as breakdown.md's kind column names it: GEMM (cuBLAS), memcpy, ...; "
           "blank where unknown"),
    Column("calls_per_step", True, "the kernel's launches in the mean profiled step"),
    Column("ms_per_step", True, "the kernel's summed duration in the mean profiled step (cut at the step's window; "
           "kernels that overlap each count whole), ms"),
    Column("share", True, "ms_per_step / the mean profiled step window (breakdown.csv's profiled_step_ms)"),
    Column("kernel", False, "the kernel's name as the trace records it"),
))

# make peak PREFIX=dir: this machine's measured peaks, the second MFU denominator (a row per measurement).
PEAK_FILE = "peak.csv"
PEAK_SCHEMA = (
    Column("measured_at", False, "UTC time of the measurement, ISO 8601"),
    Column("device", False, "cuda or cpu"),
    Column("gpu_name", False, "the device's name (torch.cuda.get_device_name), or cpu"),
    Column("gpu_uuid", False, "the GPU's UUID (GPU-...)"),
    Column("torch_version", False, "torch.__version__"),
    Column("git_commit", False, "commit of the code that measured"),
    Column("matmul_n", True, "side of the square bf16 matmul timed (n x n by n x n)"),
    Column("matmul_tflops", True, "bf16 matmul rate, TFLOP/s: 2 n^3 per matmul / median time"),
    Column("copy_gib", True, "size of the buffer copied device to device, GiB"),
    Column("copy_gb_s", True, "copy bandwidth, GB/s: bytes read plus bytes written / median time"),
    Column("schema_version", True, "the schema version that wrote the row"),
)
PEAK_SCHEMA = tuple(c._replace(since=2) for c in PEAK_SCHEMA)   # the file is new in version 2

STEP_COLUMNS = [c.name for c in STEP_SCHEMA]
RUN_COLUMNS = [c.name for c in RUN_SCHEMA]
BREAKDOWN_COLUMNS = [c.name for c in BREAKDOWN_SCHEMA]
KERNEL_COLUMNS = [c.name for c in KERNEL_SCHEMA]
STEP_NUMERIC = [c.name for c in STEP_SCHEMA if c.numeric]
RUN_NUMERIC = [c.name for c in RUN_SCHEMA if c.numeric]
RUN_DEFAULTS = {c.name: c.default for c in RUN_SCHEMA if c.default}
BREAKDOWN_NUMERIC = [c.name for c in BREAKDOWN_SCHEMA if c.numeric]
KERNEL_NUMERIC = [c.name for c in KERNEL_SCHEMA if c.numeric]
PEAK_COLUMNS = [c.name for c in PEAK_SCHEMA]
PEAK_NUMERIC = [c.name for c in PEAK_SCHEMA if c.numeric]


def step_timing(version: object) -> str:
    """How a row's step_ms was timed, by the schema version that wrote it (a blank version is 1): steps timed
    apart add up to less than the wall clock, so the two are never divided by each other."""
    try:
        v = float(version)
    except (TypeError, ValueError):
        v = 1.0
    return "around each step" if not v >= 2 else "end to end"


def headers(schema: tuple) -> dict[int, list[str]]:
    """{version: that version's header} for each schema version that changed `schema`'s columns, oldest first;
    an older header is a prefix of every later one."""
    versions = sorted({c.since for c in schema})
    return {v: [c.name for c in schema if c.since <= v] for v in versions}


def known_headers(columns: list[str]) -> dict[int, list[str]]:
    """headers() of the schema whose columns today are `columns`: the headers a file of it may have; a list of
    columns that is no schema's has only itself."""
    for schema in (STEP_SCHEMA, RUN_SCHEMA, BREAKDOWN_SCHEMA, KERNEL_SCHEMA, PEAK_SCHEMA):
        if [c.name for c in schema] == list(columns):
            return headers(schema)
    return {SCHEMA_VERSION: list(columns)}


def header_version(columns: list[str], header: list[str]) -> int:
    """The newest schema version that writes a file of the schema whose columns today are `columns` with `header`
    (one of known_headers(columns)): today's for today's header, else the last version before the next one changed
    the columns. Its rows were written by that version or an earlier one (a widened file keeps its rows' versions);
    a row that names a later one was not written under this header."""
    found = known_headers(columns)
    own = [v for v, h in found.items() if h == list(header)]
    later = [v for v in found if own and v > own[0]]
    return min(later) - 1 if later else SCHEMA_VERSION


def row_version(cell: str) -> int | None:
    """The schema version a row's schema_version cell names (blank: 1, a row written before the column existed), or
    None where the cell names no version (0, 2.5, -1, nan)."""
    text = cell.strip()
    if not text:
        return 1
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and value >= 1 else None


# ok: every step ran; oom: the batch did not fit; skipped: the run's change cannot run on this machine;
# failed: an unexpected error; interrupted: Ctrl-C or SIGTERM. The steps measured before the end are kept.
STATUSES = ("ok", "oom", "skipped", "failed", "interrupted")
PEER_PREFIX = "peer-"   # the run name of a peer, a trainer other than the suite's (Utils.peers): peer-llmc


def is_peer(name: str) -> bool:
    return str(name).startswith(PEER_PREFIX)

# Two runs are compared (a speedup) only when these run columns are equal: the same work on the same kind
# of device with the same memory, spread over the same processes in the same way. A scaling figure compares
# across nproc.
MATCH_KEYS = ("batch_size", "seq_len", "model", "data", "device", "gpu_name", "gpu_memory_gib", "nproc", "parallel",
              "nnodes")
