"""Where a run's figures come from: the commit, the software's versions and the GPU itself, for runs.csv.

A step time on another machine differs by the card, its driver and its libraries as much as by the code;
runs.csv keeps each of them so that `make compare` can say which one differs. Versions are read from the
installed distributions (importlib.metadata), never by importing a package the run does not use.
"""
import hashlib
import os
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata

import torch

from Utils.train import nvml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# runs.csv column -> the distribution whose version it records
DISTRIBUTIONS = {"triton_version": "triton", "bitsandbytes_version": "bitsandbytes",
                 "cudnn_frontend_version": "nvidia-cudnn-frontend"}


def git_commit() -> str:
    """The commit the code ran from; with uncommitted changes to tracked files, -dirty- and 8 hex digits of
    the changes' hash, so that runs of one changed tree are known as such (make's REPEAT groups them) and
    runs of two differently changed trees are not. The committed results/ are not the code: a run appending
    to a folder there changes no name. GIT_COMMIT wins for copies of the tree that carry no .git; blank when
    neither says."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        # The diff as git itself writes it: no external diff tool, text conversion or color from the user's
        # configuration, which could give two different changes one text.
        diff = subprocess.run(["git", "diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color",
                               "--", ".", ":(exclude)results"], cwd=REPO, capture_output=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{sha}-dirty-{hashlib.sha1(diff).hexdigest()[:8]}" if sha and diff else sha


def version_of(distribution: str) -> str:
    """The installed version of a distribution, or blank where it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


def cudnn_version() -> str:
    """cuDNN as PyTorch loaded it ("9.19.0"), or blank; torch reports 91900 for 9.19.0."""
    if not torch.backends.cudnn.is_available():
        return ""
    v = torch.backends.cudnn.version()
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v and v >= 10000 else str(v or "")


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID as nvidia-smi prints it (GPU-...), or blank on a CPU."""
    if device.type != "cuda":
        return ""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


@dataclass(frozen=True)
class Provenance:
    """Where a run's figures come from: runs.csv's environment columns, one field each."""
    device: str
    gpu_name: str
    gpu_uuid: str
    torch_version: str
    cuda_version: str
    cudnn_version: str
    driver_version: str
    git_commit: str
    triton_version: str
    bitsandbytes_version: str
    cudnn_frontend_version: str

    def columns(self) -> dict[str, str]:
        return asdict(self)


def provenance(device: torch.device) -> Provenance:
    """The provenance of a run on `device`."""
    cuda = device.type == "cuda"
    return Provenance(
        device=device.type,
        gpu_name=torch.cuda.get_device_name(device) if cuda else "cpu",
        gpu_uuid=gpu_uuid(device),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if cuda else "",
        cudnn_version=cudnn_version() if cuda else "",
        driver_version=nvml.driver_version() if cuda else "",
        git_commit=git_commit(),
        **{column: version_of(name) for column, name in DISTRIBUTIONS.items()})
