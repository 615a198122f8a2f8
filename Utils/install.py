"""What `make install`, `make test`, `make notebook` and `make lock` install, from the locks by default.

Each lock is its requirements files resolved by uv to exact versions with hashes, for every Python from
3.10 and every platform at once (`uv pip compile --universal`), so a fresh install gets the versions that
ran here, not the newest a range admits that day. torch is pinned as it ran: the CUDA build at the version
the figures under results/ were measured with, the CPU build at the version CI tests with.

PyPI's torch for Linux is the CUDA build, which brings several GB of CUDA libraries; the CPU build lives
on PyTorch's own index, whose files are not PyPI's. So a CPU lock leaves torch and the CUDA libraries out,
and torch is installed apart, at the version the lock's header names. UPGRADE=1 installs from the ranges
in requirements*.txt instead, the newest each allows: how a maintainer finds the next breaking release.

Standard library only: it runs before anything is installed.
"""
import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYTHON_FLOOR = "3.10"
# The device image's PyTorch (CUDA 13, cuDNN 9.19) measured results/; CI's disk holds this CPU build.
TORCH = {"cuda": "2.11.0", "cpu": "2.13.0"}
# What PyPI's Linux torch brings for CUDA, and the cuDNN frontend: none of it runs without a GPU.
CUDA_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
PURE_PYTHON = {"nvidia-ml-py"}   # NVML's bindings: its tests run on a CPU


@dataclass(frozen=True)
class Lock:
    path: str                    # the lock, relative to the root
    inputs: tuple[str, ...]      # the requirements files it resolves
    torch: str | None            # "cuda" or "cpu": which build of torch it is for; None: no torch in it
    keep: tuple[str, ...] = ()   # requirements files whose CUDA-only packages a CPU lock still takes

    @property
    def cpu(self) -> bool:
        return self.torch == "cpu"


LOCKS = {
    "cuda": Lock("requirements.lock", ("requirements.txt",), "cuda"),
    "cpu": Lock("requirements-cpu.lock", ("requirements.txt",), "cpu"),
    # The test lock holds requirements.txt too, so that both resolve together; Triton's interpreter and NVRTC
    # run the kernels' tests on a CPU.
    "test": Lock("requirements-test.lock", ("requirements.txt", "requirements-test.txt"), "cpu",
                 keep=("requirements-test.txt",)),
    "notebook": Lock("requirements-notebook.lock", ("requirements-notebook.txt",), None),
}


class InstallError(Exception):
    pass


def _lines(name: str, root: str, seen: tuple[str, ...] = ()) -> list[str]:
    """The requirement lines of a requirements file, comments and blanks dropped, `-r` files inlined."""
    if name in seen:
        raise InstallError(f"{name} includes itself through -r")
    with open(os.path.join(root, name), encoding="utf-8") as f:
        raw = [line.split("#", 1)[0].strip() for line in f]
    out = []
    for line in filter(None, raw):
        if line.startswith(("-r ", "--requirement ")):
            out += _lines(line.split(None, 1)[1], root, seen + (name,))
        else:
            out.append(" ".join(line.split()))
    return out


def names(name: str, root: str = ROOT) -> set[str]:
    """The packages a requirements file names, normalized as PyPI normalizes them."""
    return {_normal(re.split(r"[\s<>=!~;\[@]", line, maxsplit=1)[0]) for line in _lines(name, root)}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def digest(lock: Lock, root: str = ROOT) -> str:
    """What a lock was resolved from: its requirement lines and torch's pin. A comment may change freely."""
    text = "\n".join(f"{name}\n" + "\n".join(_lines(name, root)) for name in lock.inputs)
    text += f"\ntorch {TORCH.get(lock.torch or '', '')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


DIGEST = re.compile(r"^# requirements digest: (\w+)$", re.M)
TORCH_LINE = re.compile(r"^# torch==(\S+) ", re.M)


def stale(root: str = ROOT) -> list[str]:
    """One line for each lock that is missing or older than its requirements files, naming the fix."""
    problems = []
    for lock in LOCKS.values():
        path = os.path.join(root, lock.path)
        if not os.path.isfile(path):
            problems.append(f"{lock.path} is missing: run make lock")
            continue
        with open(path, encoding="utf-8") as f:
            found = DIGEST.search(f.read())
        if not found or found.group(1) != digest(lock, root):
            problems.append(f"{lock.path} is older than {' and '.join(lock.inputs)}: run make lock, and commit "
                            f"both")
    return problems


def locked_torch(root: str = ROOT) -> str:
    """The version of PyTorch's CPU build that the CPU lock was resolved with."""
    with open(os.path.join(root, LOCKS["cpu"].path), encoding="utf-8") as f:
        found = TORCH_LINE.search(f.read())
    if not found:
        raise InstallError(f"{LOCKS['cpu'].path} names no torch version: run make lock")
    return found.group(1)


def _uv(args: list[str]) -> str:
    """Runs uv (installed with pip if missing) and returns what it printed."""
    try:
        import uv   # noqa: F401
    except ImportError:
        print("make lock resolves with uv: pip install uv", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uv"], check=True)
    done = subprocess.run([sys.executable, "-m", "uv", "pip", "compile", *args], capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.strip() and not line.lstrip().startswith("hint")]
        raise InstallError(f"uv pip compile failed: {(errors or ['no message'])[0].strip()}")
    return done.stdout


def lock(which: Lock, root: str = ROOT) -> None:
    """Resolve one lock again from its requirements files, and write it."""
    common = [*(os.path.join(root, n) for n in which.inputs), "--universal", "--python-version", PYTHON_FLOOR,
              "--quiet", "--no-header", "--annotation-style", "line"]
    with tempfile.TemporaryDirectory() as tmp:
        if which.torch:
            pin = os.path.join(tmp, "torch.txt")
            with open(pin, "w") as f:
                f.write(f"torch=={TORCH[which.torch]}\n")
            common += ["--constraint", pin]
        if which.cpu:
            # First without hashes, to learn which CUDA packages this torch brings, then again without them.
            kept = set().union(*(names(n, root) for n in which.keep)) | PURE_PYTHON
            found = set(re.findall(r"^([A-Za-z0-9][\w.-]*)==", _uv(common), re.M))
            excluded = sorted(n for n in map(_normal, found) if CUDA_ONLY.match(n) and n not in kept)
            excludes = os.path.join(tmp, "excludes.txt")
            with open(excludes, "w") as f:
                f.write("\n".join(excluded + ["nvidia-cudnn-frontend"]) + "\n")
            common += ["--excludes", excludes, "--no-emit-package", "torch"]
        body = _uv(common + ["--generate-hashes"])
    inputs = " and ".join(which.inputs)
    head = [f"# {which.path}: {inputs} resolved by `make lock` (uv pip compile --universal --generate-hashes),",
            f"# for Python {PYTHON_FLOOR}+ on every platform. make install, make test and make notebook install from it;",
            "# UPGRADE=1 from the ranges in the requirements files instead.",
            f"# requirements digest: {digest(which, root)}"]
    if which.cpu:
        head.append(f"# torch=={TORCH['cpu']} (PyTorch's CPU build) is installed apart, from its own index; the "
                    "CUDA libraries are left out")
    with open(os.path.join(root, which.path), "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n" + body)
    print(f"wrote {which.path}")


def installed_torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def has_gpu() -> bool:
    """True where an NVIDIA GPU answers nvidia-smi: install PyPI's CUDA build of torch there."""
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def _entries(text: str) -> list[tuple[str, str]]:
    """A lock's requirements as (name, the lines that state it with their hashes)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line[:1].isalnum():
            out.append([_normal(re.split(r"[=\s;]", line, maxsplit=1)[0]), line])
        elif out and not line.startswith("#"):
            out[-1][1] += line
    return [(n, t) for n, t in out]


def without_cuda(text: str) -> str:
    """A lock less its CUDA packages: beside a CUDA build of torch, which brings its own Triton and CUDA."""
    return "".join(t for n, t in _entries(text) if not CUDA_ONLY.match(n) or n in PURE_PYTHON)


def plan(target: str, gpu: bool, upgrade: bool, torch: str | None, python: str, root: str = ROOT,
         cpu_index: str = TORCH_CPU_INDEX) -> list[tuple[str, list[str] | str]]:
    """The steps that install `target` (suite, test or notebook): (what, a command) or (what, a lock's text to
    install with --require-hashes). Pure, so that the tests can read it."""
    pip = [python, "-m", "pip", "install"]
    steps: list = []
    if target == "notebook":
        if upgrade:
            return [("the notebook's packages, newest", pip + ["-U", "-r", os.path.join(root, "requirements-notebook.txt")])]
        return [("the notebook's packages, locked", _read(root, LOCKS["notebook"].path))]
    cuda = gpu and target == "suite"
    if not cuda:
        steps += _cpu_torch(target, upgrade, torch, python, root, cpu_index)
    if upgrade:
        reqs = os.path.join(root, "requirements-test.txt" if target == "test" else "requirements.txt")
        if cuda:
            return steps + [("requirements.txt, newest", pip + ["-U", "-r", reqs])]
        lines = [line for line in _lines("requirements.txt", root)
                 if _normal(re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0]) not in {"torch", "nvidia-cudnn-frontend"}]
        lines = [line for line in lines if not line.startswith("nvidia-") or line.startswith("nvidia-ml-py")]
        if target == "test":
            lines += _lines("requirements-test.txt", root)
        return steps + [(f"{'the tests' if target == 'test' else 'the suite'}' packages, newest, without CUDA's",
                         "\n".join(lines) + "\n")]
    which = LOCKS["cuda" if cuda else ("test" if target == "test" else "cpu")]
    text = _read(root, which.path)
    if target == "test" and torch and "+cpu" not in torch and gpu:
        text = without_cuda(text)   # the CUDA build of torch brought its own Triton and NVRTC
    return steps + [(which.path, text)]


def _cpu_torch(target, upgrade, torch, python, root, cpu_index):
    """PyTorch's CPU build, where it must be installed: none is there, or (locked, for the suite) another
    version is. The tests take whatever torch is there."""
    pip = [python, "-m", "pip", "install"]
    if torch and (upgrade or target == "test"):
        return [(f"torch {torch} is installed: kept", None)]
    if upgrade:
        return [("PyTorch's CPU build", pip + ["torch", "--index-url", cpu_index])]
    want = locked_torch(root)
    if torch and torch.split("+")[0] == want:
        return [(f"torch {torch} is installed: kept", None)]
    return [(f"PyTorch's CPU build {want}" + (f", in place of {torch}" if torch else ""),
             pip + [f"torch=={want}", "--index-url", cpu_index])]


def _read(root: str, name: str) -> str:
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        raise InstallError(f"{name} is missing: run make lock, or UPGRADE=1 to install from the requirements files")
    with open(path, encoding="utf-8") as f:
        return f.read()


def install(target: str, upgrade: bool, python: str = sys.executable) -> int:
    mine = {"suite": ("cuda", "cpu"), "test": ("test",), "notebook": ("notebook",)}[target]
    problems = [] if upgrade else [p for p in stale() if p.split()[0] in {LOCKS[k].path for k in mine}]
    if problems:
        raise InstallError(problems[0])
    steps = plan(target, has_gpu(), upgrade, installed_torch(), python,
                 cpu_index=os.environ.get("TORCH_CPU_INDEX") or TORCH_CPU_INDEX)
    for what, how in steps:
        print(what, flush=True)
        if how is None:
            continue
        if isinstance(how, list):
            code = subprocess.run(how).returncode
        else:
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(how)
            hashes = ["--require-hashes"] if not upgrade else ["-U"]
            try:
                code = subprocess.run([python, "-m", "pip", "install", *hashes, "-r", f.name]).returncode
            finally:
                os.unlink(f.name)
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m Utils.install", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("suite", "test", "notebook", "lock", "check", "torch-version"),
                   help="what to install; lock: resolve every lock again; check: name the stale locks; "
                        "torch-version: the CPU lock's torch")
    p.add_argument("--upgrade", action="store_true", help="the newest versions the requirements files allow")
    a = p.parse_args(argv)
    try:
        if a.what == "lock":
            for which in LOCKS.values():
                lock(which)
            return 0
        if a.what == "check":
            for problem in stale():
                print(f"error: {problem}", file=sys.stderr)
            return 1 if stale() else 0
        if a.what == "torch-version":
            print(locked_torch())
            return 0
        return install(a.what, a.upgrade)
    except (InstallError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
