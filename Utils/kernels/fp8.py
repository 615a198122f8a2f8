"""The FP8 helpers that the FP8 kernels share: the dtypes, the casts with their scales, and where FP8 runs.

Hopper's and Ada's tensor cores multiply e4m3 and e5m2 at twice bf16's rate; torch._scaled_mm takes them with
one inverse scale per operand, a 0-d fp32 tensor, and needs every dimension a multiple of 16 bytes.
"""
import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max            # 448
ALIGN = 16                                   # FP8 GEMMs need every dimension a multiple of 16 bytes


def unavailable(device: torch.device) -> str | None:
    """None on an Ada or Hopper GPU (compute capability 8.9 or newer), whose tensor cores multiply FP8 and
    which converts to it; else why not."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 GEMMs need an Ada or Hopper GPU (compute capability 8.9 or newer)"
    return None


def width_problem(width: int) -> str | None:
    """None where an output layer of `width` features can run in FP8, else why not."""
    return None if width % ALIGN == 0 else f"FP8 GEMMs need the model's width ({width}) to be a multiple of {ALIGN}"


def fits(x: Tensor) -> bool:
    """Whether FP8 GEMMs take x [M, K] as their input: M and K multiples of 16. Where they do not (a step's
    tokens not a multiple of 16), the layers run in bf16."""
    return x.size(0) % ALIGN == 0 and x.size(1) % ALIGN == 0


def to_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x scaled by 448 / amax(x) and cast to e4m3, the scale's inverse as a 0-d fp32 tensor): the value
    that _scaled_mm multiplies the product by."""
    return to_fp8(x, E4M3)


def to_fp8(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """to_e4m3 for either FP8 dtype: x scaled by dtype's largest value over amax(x). The clamp keeps a rounding
    up at the amax from overflowing."""
    largest = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = largest / amax
    return (x.detach().float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


def rows_to_fp8(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(x [rows, cols] with each row scaled by a power of two and cast to dtype, contiguous; the scales' inverses
    [rows, 1] fp32): each row's scale is the largest power of two that keeps its amax within dtype's largest value,
    as torchao's rowwise recipe rounds them, so that scaling is exact and only the cast rounds. One pass over x
    where its kernel holds a row: the amax needs no reduction over the whole tensor first."""
    largest = torch.finfo(dtype).max
    amax = x.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = power_of_two_below(largest / amax)
    return (x.detach().float() * scale).clamp(-largest, largest).to(dtype).contiguous(), scale.reciprocal()


def power_of_two_below(q: Tensor) -> Tensor:
    """2^floor(log2(q)) for positive normal fp32 q, exactly: q with its mantissa bits cleared (a log2 in fp32 can
    round up to the next integer just below a power of two)."""
    return (q.view(torch.int32) & 0x7F800000).view(torch.float32)


def norm_bound(norm_weight: Tensor, norm_bias: Tensor | None) -> Tensor:
    """The largest |y| a LayerNorm with these weights can output over rows of norm_weight.numel() features, as
    a 0-d fp32 tensor: max|γ| sqrt(C - 1) + max|β| (Utils.kernels.fp8_linear says why)."""
    bound = norm_weight.detach().float().abs().amax() * (norm_weight.numel() - 1) ** 0.5
    return bound + norm_bias.detach().float().abs().amax() if norm_bias is not None else bound


def normed_to_e4m3(y: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y, a LayerNorm's output, scaled by 448 / norm_bound and cast to e4m3; the scale's inverse, 0-d fp32).
    Without norm_weight, y is the normalized x̂ alone (a LayerNorm folded into its reader, Utils.kernels.norm_fold),
    bounded by sqrt(C - 1). The clamp keeps rounding at the bound (y rounded to bf16 may exceed it by half a
    step) from overflowing."""
    if norm_weight is None:
        inv = torch.full((), (y.size(-1) - 1) ** 0.5 / E4M3_MAX, dtype=torch.float32, device=y.device)
    else:
        inv = norm_bound(norm_weight, norm_bias).clamp(min=1e-12) / E4M3_MAX
    return (y.detach().float() / inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), inv
