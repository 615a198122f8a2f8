"""FLOPs per token, the GPUs' dense bf16 peaks, MFU, step-time statistics and memory readings."""
import numpy as np
import torch

GIB = 1024 ** 3

# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from each vendor datasheet. One denominator
# for every rung, fp32 ones included, so that MFU ranks rungs the way their step times do.
# Checked in order: the first name fragment found in the GPU's name wins.
PEAK_BF16_FLOPS = [
    ("GH200", 989.4e12),
    ("H200 NVL", 835.5e12),
    ("H200", 989.4e12),           # H200 SXM
    ("H100 PCIe", 756.5e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),           # H100 SXM
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362.05e12),
    ("L40", 181.05e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("A6000", 154.8e12),          # RTX A6000
    ("RTX 4090", 165.2e12),
    ("RTX 4080", 97.5e12),
    ("RTX 3090", 71e12),
    ("RTX 3080", 59.5e12),
    ("RTX 3050 Ti Laptop", 21.2e12),
]


def peak_bf16_flops(gpu_name):
    """The dense bf16 peak of a GPU by its name, or None when the GPU is not in the table."""
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment in gpu_name:
            return flops
    return None


def flops_per_token(n_params, n_layer, n_head, head_dim, seq_len):
    """6N for the matmuls with weights (2 forward, 4 backward), plus 12 L H d T for attention's
    QK^T and AV (PaLM, Chowdhery et al. 2022, appendix B). N excludes the position embedding."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


def mfu(flops_token, tokens_per_s, peak):
    return None if not peak else flops_token * tokens_per_s / peak


def median_iqr(values):
    values = np.asarray(values, dtype=float)
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return float(med), float(q3 - q1)


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device):
    """(max allocated, max reserved) in GiB since the last reset; None on a CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB
