"""A gradient's cast to e4m3 with a power-of-two scale for each row (fp8.rows_to_fp8) as one Triton kernel.

fp8_dgrad casts c_attn's and c_fc's output gradients so, 4,800 and 6,400 values a row at gpt2-xl. Inductor's code
for the same operations keeps a row in registers only up to 1,024 values (its persistent-reduction threshold,
torch/_inductor/choices.py), so above that it loops over each row twice, for the amax and for the cast: in
gpt2-xl's step those two kernels moved their 3 bytes a value at 1.65 and 1.8 TB/s (BENCHMARKS.md). Here a
program holds a whole row: it reads the row once and writes it once.

The scale is the largest power of two that keeps the row's amax within e4m3's 448, taken from the exponent bits
of 448 / amax, as fp8.rows_to_fp8 takes it, so that the two agree bit for bit. The op is a
`torch.library.triton_op`: torch.compile sees the kernel and launches it inside the compiled backward and its CUDA
graph.

Reference: fp8.rows_to_fp8 (tests/test_fp8_rows.py, on a CPU through Triton's interpreter).
"""
import os

import torch
from torch import Tensor

from Utils.kernels import fp8

try:
    import triton
    import triton.language as tl
except Exception:   # absent, or broken: Inductor's code for fp8.rows_to_fp8 instead
    triton = None

# The widest row a program holds: 16,384 values are 32 fp32 registers a thread at 16 warps.
MAX_ROW = 16384
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device) -> str | None:
    """None where the kernel runs on this device (a CUDA GPU with Triton, or any device under Triton's
    interpreter), else why not."""
    if triton is None:
        return "the FP8 row cast needs Triton"
    if device.type != "cuda" and not INTERPRETED:
        return "the FP8 row cast needs a GPU (or Triton's interpreter, TRITON_INTERPRET=1)"
    return None


def takes(x: Tensor) -> bool:
    """Whether the kernel takes x: a 2-d tensor of contiguous rows it can hold, on a device where it runs. (A
    column-major x would make each program's reads strided: Inductor's code takes it instead.)"""
    return x.dim() == 2 and 0 < x.size(1) <= MAX_ROW and x.stride(1) == 1 and unavailable(x.device) is None


if triton is not None:
    @triton.jit
    def _max_keeping_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _rows_to_e4m3(x_ptr, out_ptr, inv_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
        # NaN propagates as in torch's amax and clamp (Triton's max and clamp skip it by default), so that a row
        # with a NaN comes out as the reference's does, not as a finite row.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.reduce(tl.abs(x), 0, _max_keeping_nan), 1e-12, propagate_nan=tl.PropagateNan.ALL)
        # fp8.power_of_two_below(448 / amax) as torch computes 448 / amax (Tensor.__rtruediv__): the reciprocal,
        # rounded to nearest, times 448
        q = tl.math.div_rn(1.0, amax) * 448.0
        scale = (q.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        y = tl.clamp(x * scale, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(inv_ptr + row, 1.0 / scale)

    @torch.library.triton_op("gpt_suite::rows_to_e4m3", mutates_args=())
    def rows_to_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
        """(x [rows, cols] with each row scaled by a power of two and cast to e4m3, contiguous; the scales'
        inverses [rows, 1] fp32): fp8.rows_to_fp8(x, E4M3), in one read of x. Needs `takes(x)`."""
        out = torch.empty(x.shape, dtype=fp8.E4M3, device=x.device)
        inv = torch.empty((x.size(0), 1), dtype=torch.float32, device=x.device)
        _launch(x, out, inv)
        return out, inv


def _launch(x: Tensor, out: Tensor, inv: Tensor) -> None:
    """The kernel over x's rows into out (e4m3; fp32 in the tests, whose interpreter rounds to e4m3 its own way)
    and inv."""
    # int() specializes the width where it is symbolic (a compile with dynamic shapes): BLOCK is a constexpr, so each
    # width is its own kernel anyway, and a symbolic next_power_of_2 would land in the launch as code Inductor
    # cannot run
    block = triton.next_power_of_2(int(x.size(1)))
    torch.library.wrap_triton(_rows_to_e4m3)[(x.size(0),)](x, out, inv, x.size(1), x.stride(0), BLOCK=block,
                                                           num_warps=min(max(block // 512, 4), 16))
