"""The MLP's input-gradient GEMM with GELU's derivative, (grad @ W_proj) * gelu'(h), on FP8 operands.

Going backward, c_proj's input-gradient GEMM is the one backward GEMM whose operands already lie along the
summed dimension (the residual gradient's 768 features), which Hopper's FP8 GEMMs need: no transposed copy.
cuBLASLt runs its DGELU epilogue on an older kernel family, slower on FP8 operands than in bf16 (1,550 µs
against 620 at batch 64: BENCHMARKS.md, `fp8_mlp_grad`). This Triton kernel does it on Hopper's FP8 tensor
cores instead (TMA loads, persistent over the output tiles, warp-specialized, the epilogue in two halves to
hold fewer registers): 546 µs where cuBLASLt's bf16 DGELU took 725 on the same card
(`bench/dgelu_triton.py --fp8`).

The gradient is cast to e5m2 (2 mantissa bits, the range gradients need) with one scale per row, from that
row's amax: a reduction over the row's 768 values, the rows the kernel that makes the gradient (Inductor's
LayerNorm backward, which writes the residual gradient) already reduces over, so that compiled, the cast can
be fused into it instead of costing a pass of its own (a per-tensor amax, a reduction over the whole
tensor, could not: 182 µs at batch 64 standalone). W_proj goes to e4m3 per tensor, transposed, every step.

Reference: `reference`, the same product of the dequantized operands in fp32 (tests/test_fp8_dgelu.py).
"""
import os

import torch
from torch import Tensor

from Utils.kernels.fp8_loss import ALIGN, E5M2

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:   # absent, old, or broken: the kernel does not run
    triton = None

E5M2_MAX = torch.finfo(E5M2).max   # 57,344
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The tile (rows, columns, summed columns), pipeline stages and warps: the fastest of the FP8 configurations
# that bench/dgelu_triton.py --fp8 timed on an H200 at batch 64 (within 2% of the best at batch 16).
BM, BN, BK, STAGES, WARPS = 128, 256, 128, 3, 8


# The kernel is defined only where Triton imports (Triton resolves the functions a kernel calls among its
# module's globals, so they are defined at the top level).
if triton is not None:
    if INTERPRETED:   # the interpreter runs no PTX: tanh from an exponential, for the tests
        @triton.jit
        def _tanh(u):
            return 2 * tl.sigmoid(2 * u) - 1
    else:
        @triton.jit
        def _tanh(u):
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32,
                                             is_pure=True, pack=1)

    @triton.jit
    def _times_gelu_grad(acc, h, row_inv, w_inv):
        # acc times the operands' scales, times the derivative at h of GELU's tanh approximation (GPT-2's),
        # 0.5 h (1 + tanh(k0 (h + k1 h^3))).
        k0: tl.constexpr = 0.7978845608028654
        k1: tl.constexpr = 0.044715
        h2 = h * h
        t = _tanh(k0 * h * (1 + k1 * h2))
        return acc * (row_inv[:, None] * w_inv) * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * k0 * (1 + 3 * k1 * h2))

    @triton.jit
    def _dgelu_kernel(g_desc, w_desc, h_desc, out_desc, g_inv_ptr, w_inv_ptr, M, N, K, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, PROGRAMS: tl.constexpr, WS: tl.constexpr):
        num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        group = 8 * num_pid_n   # eight row tiles walked together, so that W's columns stay in L2
        w_inv = tl.load(w_inv_ptr)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
            first_m = (tile // group) * 8
            rows_in_group = min(num_pid_m - first_m, 8)
            om = (first_m + (tile % group) % rows_in_group) * BM
            on = ((tile % group) // rows_in_group) * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(tl.cdiv(K, BK)):
                acc = tl.dot(g_desc.load([om, ki * BK]), w_desc.load([on, ki * BK]).T, acc)
            rows = om + tl.arange(0, BM)
            row_inv = tl.load(g_inv_ptr + rows, mask=rows < M, other=0.0)
            # Two halves of the tile: half the epilogue's registers live at a time.
            a0, a1 = tl.split(tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1))
            h0 = h_desc.load([om, on]).to(tl.float32)
            out_desc.store([om, on], _times_gelu_grad(a0, h0, row_inv, w_inv).to(tl.bfloat16))
            h1 = h_desc.load([om, on + BN // 2]).to(tl.float32)
            out_desc.store([om, on + BN // 2], _times_gelu_grad(a1, h1, row_inv, w_inv).to(tl.bfloat16))


def unavailable(device: torch.device) -> str | None:
    """None on a Hopper or newer GPU with Triton, where the kernel runs; else why not."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "the FP8 DGELU kernel needs a Hopper GPU (compute capability 9.0 or newer: TMA and FP8 wgmma)"
    if triton is None:
        return "the FP8 DGELU kernel needs Triton with tensor descriptors (3.4 or newer)"
    return None


def fits(grad: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes grad [M, K] and weight [K, N]: every dimension a multiple of 16, as TMA's
    16-byte rows of FP8 need."""
    return all(d % ALIGN == 0 for d in (*grad.shape, weight.size(1)))


def grad_to_e5m2(grad: Tensor) -> tuple[Tensor, Tensor]:
    """(grad [M, K] with each row scaled by E5M2_MAX / its amax and cast to e5m2; each row's inverse scale, [M]
    fp32). A row of zeros stays zeros. The clamp keeps a rounding up at the amax from overflowing."""
    amax = grad.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-30)
    scaled = grad.detach().float() * (E5M2_MAX / amax)
    return scaled.clamp(-E5M2_MAX, E5M2_MAX).to(E5M2), (amax / E5M2_MAX).squeeze(1)


@torch.library.custom_op("gpt_suite::fp8_linear_dgelu", mutates_args=())
def linear_dgelu(g8: Tensor, g_inv: Tensor, w8_t: Tensor, w_inv: Tensor, h: Tensor) -> Tensor:
    """(grad @ w) * gelu'(h) in h's dtype, from g8 [M, K] (e5m2) with its rows' inverse scales g_inv [M], and
    w8_t = w.T [N, K] (e4m3, K-major as FP8 GEMMs read it) with its inverse scale w_inv (0-d). On a GPU, the
    Triton kernel; elsewhere `reference`."""
    return reference(g8, g_inv, w8_t, w_inv, h)


@linear_dgelu.register_kernel("cuda")
def _(g8, g_inv, w8_t, w_inv, h):
    return launch(g8, g_inv, w8_t, w_inv, h)


@linear_dgelu.register_fake
def _(g8, g_inv, w8_t, w_inv, h):
    return torch.empty_like(h)


def launch(g8: Tensor, g_inv: Tensor, w8_t: Tensor, w_inv: Tensor, h: Tensor) -> Tensor:
    """linear_dgelu through the Triton kernel (on a GPU, or under Triton's interpreter), for a bf16 h."""
    M, K = g8.shape
    N = w8_t.size(0)
    out = torch.empty_like(h)
    half = [BM, BN // 2]
    descs = (TensorDescriptor.from_tensor(g8, [BM, BK]), TensorDescriptor.from_tensor(w8_t, [BN, BK]),
             TensorDescriptor.from_tensor(h, half), TensorDescriptor.from_tensor(out, half))
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    sms = torch.cuda.get_device_properties(g8.device).multi_processor_count if g8.is_cuda else 4
    programs = min(sms, tiles)
    _dgelu_kernel[(programs,)](*descs, g_inv, w_inv.reshape(1), M, N, K, BM=BM, BN=BN, BK=BK, PROGRAMS=programs,
                         WS=True, num_stages=STAGES, num_warps=WARPS)
    return out


def reference(g8: Tensor, g_inv: Tensor, w8_t: Tensor, w_inv: Tensor, h: Tensor) -> Tensor:
    """What linear_dgelu computes: the product of the dequantized operands in fp32, times GELU's derivative
    at h, in h's dtype."""
    product = (g8.float() * g_inv[:, None]) @ (w8_t.float() * w_inv).t()
    return torch.ops.aten.gelu_backward(product, h.float(), approximate="tanh").to(h.dtype)
