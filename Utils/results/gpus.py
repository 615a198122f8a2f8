"""The one table of GPU peaks: dense bf16, tf32, fp32 and FP8 rates and memory bandwidth, with their source.

MFU (results), the compute / memory / overhead split (report.breakdown) and the notebook's roofline all
read it. Rates are dense (no structured sparsity): NVIDIA's datasheets for Ampere and later list the
tensor-core rates with 2:4 sparsity, and dense is half of those. GeForce rates are those with fp32
accumulation (what PyTorch's bf16 matmuls use), from NVIDIA's Ampere (GA102) and Ada architecture
whitepapers. A figure nobody has published for that part is None, never a guess.
"""
import re
from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class GPU:
    fragment: str              # found as whole words in torch.cuda.get_device_name(); the first row wins
    bf16: float | None         # dense bf16 tensor-core FLOP/s
    tf32: float | None         # dense tf32 tensor-core FLOP/s
    fp32: float | None         # fp32 FLOP/s on the ordinary units
    bandwidth: float | None    # device memory bytes/s
    source: str
    fp8: float | None = None   # dense FP8 tensor-core FLOP/s, fp32 accumulation; None: no FP8 units (before Ada)


_H100_SXM = "NVIDIA H100 Tensor Core GPU datasheet (SXM)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"

# Order matters: a name is matched against each fragment in turn, and "NVIDIA H100 PCIe" names the H100 too
# ("H100 PCIe" must win over "H100").
GPUS = [
    # GH200's bandwidth depends on the memory fitted (HBM3 4 TB/s or HBM3e 4.9 TB/s), which its name
    # does not say: nothing is claimed.
    GPU("GH200", 989.4 * TERA, 494.7 * TERA, 67 * TERA, None, "NVIDIA GH200 Grace Hopper Superchip datasheet",
        fp8=1979 * TERA),
    GPU("H200 NVL", 835.5 * TERA, 417.5 * TERA, 60 * TERA, 4.8 * TERA, _H200 + " (NVL)", fp8=1670.5 * TERA),
    GPU("H200", 989.4 * TERA, 494.7 * TERA, 67 * TERA, 4.8 * TERA, _H200 + " (SXM)", fp8=1979 * TERA),
    GPU("H100 PCIe", 756.5 * TERA, 378 * TERA, 51 * TERA, 2.0 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)",
        fp8=1513 * TERA),
    GPU("H100 NVL", 835.5 * TERA, 417.5 * TERA, 60 * TERA, 3.9 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (NVL)",
        fp8=1670.5 * TERA),
    GPU("H100", 989.4 * TERA, 494.7 * TERA, 67 * TERA, 3.35 * TERA, _H100_SXM, fp8=1979 * TERA),
    GPU("B200", 2250 * TERA, None, None, 8.0 * TERA, "NVIDIA HGX B200 datasheet", fp8=4500 * TERA),
    GPU("A100-SXM4-80GB", 312 * TERA, 156 * TERA, 19.5 * TERA, 2.039 * TERA, "NVIDIA A100 datasheet (80 GB SXM)"),
    GPU("A100 80GB PCIe", 312 * TERA, 156 * TERA, 19.5 * TERA, 1.935 * TERA, "NVIDIA A100 datasheet (80 GB PCIe)"),
    GPU("A100", 312 * TERA, 156 * TERA, 19.5 * TERA, 1.555 * TERA, "NVIDIA A100 datasheet (40 GB)"),
    GPU("A800", 312 * TERA, 156 * TERA, 19.5 * TERA, None, "NVIDIA A800 datasheet"),
    GPU("L40S", 362.05 * TERA, 183 * TERA, 91.6 * TERA, 0.864 * TERA, "NVIDIA L40S datasheet", fp8=733 * TERA),
    GPU("L40", 181.05 * TERA, 90.5 * TERA, 90.5 * TERA, 0.864 * TERA, "NVIDIA L40 datasheet", fp8=362 * TERA),
    GPU("L4", 121 * TERA, 60 * TERA, 30.3 * TERA, 0.300 * TERA, "NVIDIA L4 datasheet", fp8=242.5 * TERA),
    GPU("A10G", 70 * TERA, None, 31.2 * TERA, 0.600 * TERA, "AWS EC2 G5 (A10G) specifications"),
    GPU("A10", 125 * TERA, 62.5 * TERA, 31.2 * TERA, 0.600 * TERA, "NVIDIA A10 datasheet"),
    GPU("A6000", 154.8 * TERA, 77.4 * TERA, 38.7 * TERA, 0.768 * TERA, "NVIDIA RTX A6000 datasheet"),
    GPU("RTX 4090", 165.2 * TERA, 82.6 * TERA, 82.6 * TERA, 1.008 * TERA, "NVIDIA Ada Lovelace architecture whitepaper",
        fp8=330.3 * TERA),
    GPU("RTX 4080", 97.5 * TERA, 48.7 * TERA, 48.7 * TERA, 0.717 * TERA, "NVIDIA Ada Lovelace architecture whitepaper",
        fp8=194.9 * TERA),
    GPU("RTX 3090", 71 * TERA, 35.6 * TERA, 35.6 * TERA, 0.936 * TERA, "NVIDIA Ampere GA102 architecture whitepaper"),
    GPU("RTX 3080", 59.5 * TERA, 29.8 * TERA, 29.8 * TERA, 0.760 * TERA, "NVIDIA Ampere GA102 architecture whitepaper"),
    # Laptop parts run at the clock their maker sets; the rate is at the top of NVIDIA's boost range.
    GPU("RTX 3050 Ti Laptop", 21.2 * TERA, None, None, 0.192 * TERA, "NVIDIA GeForce RTX 3050 Ti Laptop specifications"),
    GPU("MI300X", 1307.4 * TERA, 653.7 * TERA, 163.4 * TERA, 5.3 * TERA, "AMD Instinct MI300X datasheet",
        fp8=2614.9 * TERA),
]


# A word after a model number that makes it another part, with other figures: an RTX 3080 Ti is not an
# RTX 3080, nor an RTX 4090 Laptop GPU (or the RTX 4090 D, with fewer SMs) an RTX 4090.
VARIANTS = ("ti", "super", "laptop", "mobile", "max-q", "d")   # compared in lower case


def _names(fragment: str, gpu_name: str) -> bool:
    """Whether gpu_name names the part `fragment` names: the fragment as whole words ("H200" is not in
    "GH200", nor "L40" in "L40S"), not followed by a variant's word."""
    found = re.search(rf"(?<![\w-]){re.escape(fragment)}(?!\w)", gpu_name)
    if not found:
        return False
    rest = gpu_name[found.end():].split()
    return not (rest and rest[0].lower() in VARIANTS)


def gpu_spec(gpu_name: str | None) -> GPU | None:
    """The table's row for a GPU by its name (as torch.cuda.get_device_name gives it), or None."""
    for gpu in GPUS:
        if _names(gpu.fragment, gpu_name or ""):
            return gpu
    return None


def peak_bf16_flops(gpu_name: str | None) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s, the one MFU denominator for every rung; None when unknown."""
    spec = gpu_spec(gpu_name)
    return spec.bf16 if spec else None


def peak_bandwidth(gpu_name: str | None) -> float | None:
    """The GPU's peak device-memory bandwidth in bytes/s; None when unknown."""
    spec = gpu_spec(gpu_name)
    return spec.bandwidth if spec else None
