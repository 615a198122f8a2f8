"""FLOPs per token, MFU and step-time statistics: the figures a run's rows carry (no torch)."""
from collections.abc import Sequence

import numpy as np


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """6N for the matmuls with weights (2 forward, 4 backward), plus 12 L H d T for attention's
    QK^T and AV (PaLM, Chowdhery et al. 2022, appendix B). N excludes the position embedding."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


def mfu(flops_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilization against `peak` FLOP/s; None when the peak is unknown."""
    return None if not peak else flops_token * tokens_per_s / peak


def median_iqr(values: Sequence[float]) -> tuple[float, float]:
    """(median, interquartile range) of the values."""
    values = np.asarray(values, dtype=float)
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return float(med), float(q3 - q1)
