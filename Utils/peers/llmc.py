"""Karpathy's llm.c as a peer: train_gpt2cu (CUDA C++: bf16, cuDNN attention, GELU fused into cuBLASLt's
epilogue, no recompute), built from source at a pinned commit, fed the run's own tokens, and recorded as
peer-llmc from the step lines it prints.

Its source comes from LLMC_SOURCE (an llm.c checkout, or a tar.gz of one: what a machine without network
needs), else GitHub's archive of LLMC_COMMIT, kept under the cache folder. Two changes let that commit build
with CUDA 13 and a current cuDNN frontend: cudaMemAdvise names the host with a cudaMemLocation (CUDA 13
dropped the int cudaCpuDeviceId form), and the link adds NVRTC and the driver (-lnvrtc -lcuda), which the
frontend's objects call, and NVML where the toolkit has nvml.h. The build goes to the cache folder, once per
commit, GPU architecture and nvcc version.

Step times are llm.c's own: CUDA events around each step's work, after which it synchronizes and prints,
so the host's work between steps is left out (the rungs count it: a step runs from one end to the next).
"""
import glob
import importlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from importlib import metadata
from typing import Callable

import numpy as np

from Utils.ladder.apply import Unavailable
from Utils.results.schema import PEER_PREFIX
from Utils.train.cli import RunConfig
from Utils.train.record import Run

NAME = PEER_PREFIX + "llmc"
LLMC_COMMIT = "f1e2ace651495b74ae22d45d1723443fd00ecd3a"   # karpathy/llm.c master, 2025-05-10
ARCHIVE_URL = f"https://github.com/karpathy/llm.c/archive/{LLMC_COMMIT}.tar.gz"
# llm.c's model descriptors (train_gpt2.cu, gpt_build_from_descriptor): GPT-2 by depth, from random weights.
DESCRIPTORS = {"gpt2": "d12", "gpt2-medium": "d24", "gpt2-large": "d36", "gpt2-xl": "d48"}
# llmc/dataloader.h: a header of 256 int32 (magic, version, token count), then the tokens as uint16.
DATA_MAGIC, DATA_VERSION, DATA_HEADER_INTS = 20240520, 1, 256
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\S+) .*\| ([\d.]+) ms \|")
MEMORY_LINE = re.compile(r"^device memory usage: (\d+) MiB / (\d+) MiB")
# The one call the CUDA 13 runtime changed (llmc/cuda_utils.cuh): its host location as a cudaMemLocation.
OLD_ADVISE = "cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)"
NEW_ADVISE = ("cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, "
              "cudaMemLocation{cudaMemLocationTypeHost, 0})")


def cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "gpu-ladder", "llmc")


def source_archive(cache: str) -> tuple[str, str]:
    """(an llm.c tree or tar.gz, what the record says it is): LLMC_SOURCE where set, else the pinned commit's
    archive, downloaded once. Raises Unavailable, saying how to provide the source, where it cannot be had."""
    given = os.environ.get("LLMC_SOURCE")
    if given:
        if not os.path.exists(given):
            raise Unavailable(f"LLMC_SOURCE={given} does not exist: give an llm.c checkout or a tar.gz of one")
        commit = archive_commit(given) if os.path.isfile(given) else ""
        return given, f"llm.c {commit[:12] or 'from ' + given}"
    path = os.path.join(cache, f"llm.c-{LLMC_COMMIT}.tar.gz")
    if not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        try:
            with urllib.request.urlopen(ARCHIVE_URL, timeout=60) as r, open(path + ".part", "wb") as f:
                shutil.copyfileobj(r, f)
            os.replace(path + ".part", path)
        except OSError as e:
            raise Unavailable(f"llm.c's source cannot be downloaded ({e}): fetch {ARCHIVE_URL} on a machine with "
                              f"network and pass LLMC_SOURCE=<that file>") from None
    return path, f"llm.c {LLMC_COMMIT[:12]}"


def archive_commit(path: str) -> str:
    """The commit a git archive (git archive, or GitHub's archive) was made from, or ''."""
    try:
        with tarfile.open(path) as t:
            return str(t.pax_headers.get("comment", ""))
    except (OSError, tarfile.TarError):
        return ""


def unpack(source: str, into: str) -> str:
    """The llm.c tree of `source` (a folder, or a tar.gz with one top folder) copied into `into`, with the CUDA
    13 change made; its path."""
    tree = os.path.join(into, "llm.c")
    if os.path.isdir(source):
        shutil.copytree(source, tree, ignore=shutil.ignore_patterns(".git", "dev"))
    else:
        with tarfile.open(source) as t:
            # The "data" filter refuses links and paths out of `into` (Python 3.10.12+ and 3.11.4+ have it).
            t.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        tops = [d for d in os.listdir(into) if os.path.isdir(os.path.join(into, d))]
        if len(tops) != 1:
            raise Unavailable(f"{source} does not hold one llm.c folder: give a tar.gz of an llm.c checkout")
        os.rename(os.path.join(into, tops[0]), tree)
    utils = os.path.join(tree, "llmc", "cuda_utils.cuh")
    if not os.path.isfile(os.path.join(tree, "train_gpt2.cu")) or not os.path.isfile(utils):
        raise Unavailable(f"{source} has no train_gpt2.cu and llmc/cuda_utils.cuh: it is not llm.c's source")
    text = open(utils, encoding="utf-8").read()
    with open(utils, "w", encoding="utf-8") as f:
        f.write(text.replace(OLD_ADVISE, NEW_ADVISE))
    return tree


def toolchain() -> dict:
    """nvcc, and the headers and libraries of cuBLAS, NVRTC, cuDNN and the cuDNN frontend to build with: the CUDA
    toolkit's where it has them, else those of the pip wheels a CUDA build of torch brings. Raises Unavailable
    naming what is missing and how to provide it."""
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    roots = [r for r in dict.fromkeys([os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))])
             if r and os.path.isdir(r)]
    nvcc = nvcc or next((os.path.join(r, "bin", "nvcc") for r in roots if os.path.isfile(os.path.join(r, "bin", "nvcc"))), None)
    if not nvcc:
        raise Unavailable("no CUDA compiler: install the CUDA toolkit (nvcc), or set NVCC to its path")
    wheels = [d for m in ("nvidia.cu13", "nvidia.cublas", "nvidia.cuda_nvrtc", "nvidia.cudnn") for d in _package_dirs(m)]
    lib_dirs = [os.path.join(r, "lib64") for r in roots] + [os.path.join(d, "lib") for d in wheels]
    include_dirs = [os.path.join(r, "include") for r in roots] + [os.path.join(d, "include") for d in wheels]
    libraries, missing = [], []
    for name, provider in (("cublas", "the CUDA toolkit, or pip install nvidia-cublas"),
                           ("cublasLt", "the CUDA toolkit, or pip install nvidia-cublas"),
                           ("nvrtc", "the CUDA toolkit, or pip install nvidia-cuda-nvrtc"),
                           ("cudnn", "pip install a CUDA build of torch (it brings nvidia-cudnn)")):
        found = _find_library(name, lib_dirs)
        if found:
            libraries.append(found)
        else:
            missing.append(f"lib{name} ({provider})")
    headers = [h for h in ("cublas_v2.h", "nvrtc.h", "cudnn.h") if not _find_file(h, include_dirs)]
    if missing or headers:
        raise Unavailable(f"llm.c cannot be built here: no {', '.join(missing + headers)}")
    frontend = os.environ.get("CUDNN_FRONTEND_PATH") or _frontend_include()
    if not frontend:
        raise Unavailable("no cuDNN frontend headers: pip install nvidia-cudnn-frontend (requirements.txt), or set "
                          "CUDNN_FRONTEND_PATH to a cudnn-frontend/include folder")
    stubs = next((os.path.join(r, "lib64", "stubs") for r in roots
                  if os.path.isfile(os.path.join(r, "lib64", "stubs", "libcuda.so"))), None)
    return {"nvcc": nvcc, "libraries": libraries, "stubs": stubs,
            "includes": [frontend] + [d for d in include_dirs if os.path.isdir(d)]}


def _find_library(name: str, dirs: list[str]) -> str | None:
    """lib<name>.so, or a versioned lib<name>.so.N where a wheel ships only that, in the first folder with one."""
    for d in dirs:
        exact = os.path.join(d, f"lib{name}.so")
        versioned = sorted(glob.glob(os.path.join(d, f"lib{name}.so.[0-9]*")), key=len)
        if os.path.isfile(exact) or versioned:
            return exact if os.path.isfile(exact) else versioned[0]
    return None


def _find_file(name: str, dirs: list[str]) -> str | None:
    return next((os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name))), None)


def _package_dirs(name: str) -> list[str]:
    """The folders of a package (a namespace package, as nvidia.* are, may span several), or none."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    return list(getattr(module, "__path__", []))


def _frontend_include() -> str | None:
    try:
        files = metadata.distribution("nvidia-cudnn-frontend").files or []
    except metadata.PackageNotFoundError:
        return None
    header = next((f for f in files if str(f).endswith("include/cudnn_frontend.h")), None)
    return os.path.dirname(str(header.locate())) if header else None


def build(tree: str, tools: dict, arch: str, out: str) -> str:
    """Compile train_gpt2cu from `tree` for sm_`arch` into `out` (kept: a second run reuses it); its path."""
    binary = os.path.join(out, "train_gpt2cu")
    if os.path.isfile(binary):
        return binary
    os.makedirs(out, exist_ok=True)
    # llm.c's Makefile flags for a cuDNN build in bf16, for this GPU's architecture.
    flags = ["-O3", "-t=0", "--use_fast_math", "-std=c++17", "-DENABLE_BF16", "-DENABLE_CUDNN",
             f"-gencode=arch=compute_{arch},code=[compute_{arch},sm_{arch}]"]
    includes = [f"-I{d}" for d in tools["includes"]]
    obj = os.path.join(out, "cudnn_att.o")
    rpath = ":".join(dict.fromkeys(os.path.dirname(lib) for lib in tools["libraries"]))
    # The driver's libraries from the toolkit's stubs, where there are any: libcuda (cuDNN's frontend calls it),
    # and NVML, which llm.c uses wherever the toolkit has nvml.h (llmc/mfu.h).
    stubs = tools["stubs"]
    driver = [f"-L{stubs}", "-lcuda"] + (["-lnvidia-ml"] if os.path.isfile(os.path.join(stubs, "libnvidia-ml.so")) else []) \
        if stubs else []
    libs = [f for lib in tools["libraries"] for f in (f"-L{os.path.dirname(lib)}", f"-l:{os.path.basename(lib)}")]
    libs += [*driver, f"-Xlinker=-rpath,{rpath}"]
    for cmd in ([tools["nvcc"], *flags, "-c", os.path.join(tree, "llmc", "cudnn_att.cpp"), *includes, "-o", obj],
                [tools["nvcc"], *flags, os.path.join(tree, "train_gpt2.cu"), obj, *includes, *libs,
                 "-o", binary + ".part"]):
        done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise BuildError(f"nvcc failed building llm.c ({tail[0][:200]})", done.stdout + done.stderr)
    os.replace(binary + ".part", binary)
    return binary


class BuildError(Exception):
    """nvcc failed; the message is one line, `log` the compiler's whole output."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def write_tokens(tokens: np.ndarray, path: str) -> None:
    """The tokens as llm.c's data loader reads them (llmc/dataloader.h)."""
    header = np.zeros(DATA_HEADER_INTS, dtype=np.int32)
    header[:3] = DATA_MAGIC, DATA_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def command(binary: str, data: str, descriptor: str, batch: int, seq_len: int, steps: int,
            micro_batch: int | None = None) -> list[str]:
    """train_gpt2cu's arguments: from random weights, GELU and its derivative fused into cuBLASLt's epilogues (-ge 2:
    this commit's default is off), no recompute, no sampling, no checkpoints; validation
    (one micro-batch, which its loop runs before the first step and the last, outside the timed work); the suite's
    learning rate and weight decay (the work per step does not depend on them). `batch` rows a step in
    micro-batches of `micro_batch` (the whole batch by default): llm.c's -b is the micro-batch, -d the step's
    tokens, and it accumulates -d / (-b × -t) micro-batches."""
    micro = micro_batch or batch
    return [binary, "-i", data, "-j", data, "-e", descriptor, "-b", str(micro), "-d", str(batch * seq_len),
            "-t", str(seq_len),
            "-x", str(steps), "-v", str(steps + 1), "-m", "1", "-s", "0", "-n", "0", "-r", "0", "-z", "0",
            "-ge", "2", "-l", "0.0006", "-c", "0.1"]


def parse(output: str) -> tuple[list[tuple[int, float, float]], float | None]:
    """([(step from 0, loss, ms)], the device memory in use after llm.c allocated its state in GiB, or None)."""
    steps, memory = [], None
    for line in output.splitlines():
        m = STEP_LINE.match(line)
        if m:
            steps.append((int(m.group(1)) - 1, float(m.group(3)), float(m.group(4))))
        elif MEMORY_LINE.match(line):
            memory = int(MEMORY_LINE.match(line).group(1)) / 1024
    return steps, memory


def main(argv: list[str], command_line: str) -> int:
    from Utils.peers import record
    return record.run_external(NAME, argv, command_line, train)


def train(cfg: RunConfig, tokens: np.ndarray, run: Run, log: str, start_sampling: Callable[[], None]
          ) -> tuple[list[tuple[int, float, float]], float | None]:
    """Build llm.c and train cfg.steps steps on `tokens`, calling start_sampling() as its warm-up ends;
    ([(step, loss, ms)], memory GiB). Raises Unavailable where it cannot be built or run here, RuntimeError
    where it fails."""
    if cfg.device != "cuda":
        raise Unavailable("llm.c trains on a CUDA GPU only")
    if cfg.model not in DESCRIPTORS:
        raise Unavailable(f"llm.c has no {cfg.model} model: use MODEL={' or '.join(DESCRIPTORS)}")
    import torch
    major, minor = torch.cuda.get_device_capability()
    tools = toolchain()
    cache = cache_dir()
    source, what = source_archive(cache)
    commit = LLMC_COMMIT if source.startswith(cache) else archive_commit(source) if os.path.isfile(source) else ""
    with tempfile.TemporaryDirectory(prefix="llmc-") as work:
        # Built once per commit and architecture; a source of unknown commit (a folder) every time.
        nvcc = _nvcc_version(tools["nvcc"])
        out = os.path.join(cache, f"build-{commit}-sm{major}{minor}-{nvcc.replace(' ', '')}") if commit \
            else os.path.join(work, "build")
        try:
            binary = build(unpack(source, work), tools, f"{major}{minor}", out)
        except BuildError as e:
            with open(log, "w", encoding="utf-8") as f:
                f.write(e.log)
            raise RuntimeError(f"{e} (the whole output: {log})") from None
        data = os.path.join(work, "tokens.bin")
        write_tokens(tokens, data)
        args = command(binary, data, DESCRIPTORS[cfg.model], cfg.batch_size, cfg.seq_len, cfg.steps, cfg.micro_batch)
        shown = " ".join(["train_gpt2cu"] + [a if a != data else "tokens.bin" for a in args[1:]])
        run.attention_kernel = "cudnn"   # built with USE_CUDNN: its attention is cuDNN's, with no choice at run time
        run.notes = (f"{what}, built with {nvcc}; {shown}; step times are llm.c's own "
                        f"(CUDA events around each step's work)"
                        + ("" if shutil.which("stdbuf") else "; no stdbuf: the GPU sampled from the program's start"))
        returncode, output = run_streamed(args, work, cfg.warmup, start_sampling)
    with open(log, "w", encoding="utf-8") as f:
        f.write(output)
    steps, memory = parse(output)
    if returncode or len(steps) != cfg.steps:
        last = output.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"train_gpt2cu exited with status {returncode} after {len(steps)} of {cfg.steps} "
                           f"steps ({last[0][:200]}; the whole output: {log})")
    return steps, memory


def run_streamed(args: list[str], cwd: str, warmup: int, start_sampling: Callable[[], None]) -> tuple[int, str]:
    """Run args, reading its output (stderr with stdout) as it comes, and call start_sampling() once the step
    line that ends the warm-up is printed: the GPU's clocks and power are then those of the measured steps,
    not of llm.c's start-up (model, data and cuDNN set-up take longer than 30 steps). llm.c's printf is
    buffered when its output is a pipe; coreutils' stdbuf makes it flush each line. Without stdbuf the
    sampling starts with the program. Returns (exit status, output)."""
    stdbuf = shutil.which("stdbuf")
    last_warmup_line = warmup if warmup and stdbuf else None   # llm.c numbers its steps from 1
    if last_warmup_line is None:
        start_sampling()
    lines = []
    with subprocess.Popen(([stdbuf, "-oL"] if stdbuf else []) + args, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace") as proc:
        for line in proc.stdout:
            lines.append(line)
            m = STEP_LINE.match(line)
            if m and int(m.group(1)) == last_warmup_line:
                start_sampling()
    return proc.returncode, "".join(lines)


def _nvcc_version(nvcc: str) -> str:
    done = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    m = re.search(r"release ([\d.]+)", done.stdout)
    return f"nvcc {m.group(1)}" if m else "nvcc"
