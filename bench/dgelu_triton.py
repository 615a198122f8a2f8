"""Times a Triton GEMM with GELU's derivative in its epilogue against cuBLASLt's DGELU GEMM
(Utils.kernels.cublaslt.linear_dgelu, which `max` runs) at GPT-2 124M's MLP shape, for batch 16 and 64
(16,384 and 65,536 tokens): grad_h = (grad @ c_proj.weight) * gelu'(h), [M, 768] @ [768, 3072].

The question it answers: in `max`'s profile at batch 64 the DGELU GEMM runs on an older `xmma` kernel at
590 us a layer, where a plain GEMM of its size takes about 410 (BENCHMARKS.md, "Where the `max` rung's time
goes"). A Hopper GEMM of our own (TMA loads, wgmma through tl.dot, persistent over the tiles, optionally
warp-specialized, the epilogue in two halves to hold fewer registers) could take the epilogue for less.
Every configuration is checked against the fp32 reference before it is timed.

With --fp8, the same kernel on FP8 operands, as Hopper's FP8 GEMMs read them (both along the summed
dimension): the gradient in e5m2 (or e4m3) [M, 768], c_proj's weight transposed in e4m3 [3072, 768], their
scales applied in the epilogue; cuBLASLt runs its FP8 DGELU 2.5 times slower than bf16 (BENCHMARKS.md,
`fp8_mlp_grad`). The gradient's cast (amax, scale, e5m2), compiled, is timed too: a step would pay it.

    python3 bench/dgelu_triton.py          # the configurations that came out best on an H200
    python3 bench/dgelu_triton.py --sweep  # every configuration tried (about 90 s of compiling)
    python3 bench/dgelu_triton.py --fp8    # FP8 operands
"""
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gelu_epilogue import bench  # noqa: E402
from Utils.kernels import cublaslt as L  # noqa: E402
from Utils.kernels.fp8 import to_e4m3, to_fp8  # noqa: E402
from Utils.kernels.recompute_logits import tile_order  # noqa: E402   (GROUP_M row tiles walked together)

K, N = 768, 3072


@triton.jit
def _tanh(u):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _times_gelu_grad(acc, h):
    # d/dh of GELU's tanh approximation, 0.5 h (1 + tanh(k0 (h + k1 h^3))), as GPT-2's.
    k0: tl.constexpr = 0.7978845608028654
    k1: tl.constexpr = 0.044715
    h2 = h * h
    t = _tanh(k0 * h * (1 + k1 * h2))
    return acc * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * k0 * (1 + 3 * k1 * h2))


@triton.jit
def _store(acc, h_desc, c_desc, q_desc, s_ptr, om, on, M, BM: tl.constexpr):
    # grad_h in bf16; with q_desc (bench/dgelu_fp8_blocks.py), also in e4m3: each row of this 128-column block scaled
    # by the largest power of two that keeps its amax within 448 (fp8_rows' rule), the inverse scale stored
    # column-major in s_ptr, as cuBLASLt reads 1 x 128 block scales.
    g = _times_gelu_grad(acc, h_desc.load([om, on]).to(tl.float32))
    c_desc.store([om, on], g.to(tl.bfloat16))
    if q_desc is not None:
        amax = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-12)
        scale = ((tl.math.div_rn(1.0, amax) * 448.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32,
                                                                                                   bitcast=True)
        q_desc.store([om, on], tl.clamp(g * scale[:, None], -448.0, 448.0).to(tl.float8e4nv))
        rows = om + tl.arange(0, BM)
        tl.store(s_ptr + (on // 128) * M + rows, 1.0 / scale, mask=rows < M)


@triton.jit
def _dgelu_kernel(a_desc, b_desc, h_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, HALVES: tl.constexpr, WS: tl.constexpr,
                  scale_ptr=None, B_T: tl.constexpr = False, q_desc=None, s_ptr=None):
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
        pid_m, pid_n = tile_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om, on = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            if B_T:   # b [N, K], K-major, as FP8 wgmma reads it
                acc = tl.dot(a_desc.load([om, ki * BK]), b_desc.load([on, ki * BK]).T, acc)
            else:
                acc = tl.dot(a_desc.load([om, ki * BK]), b_desc.load([ki * BK, on]), acc)
        if scale_ptr is not None:
            acc = acc * tl.load(scale_ptr)
        if HALVES:   # two halves of the tile's columns: fewer registers live in the epilogue
            a0, a1 = tl.split(tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1))
            _store(a0, h_desc, c_desc, q_desc, s_ptr, om, on, M, BM)
            _store(a1, h_desc, c_desc, q_desc, s_ptr, om, on + BN // 2, M, BM)
        else:
            _store(acc, h_desc, c_desc, q_desc, s_ptr, om, on, M, BM)


def launcher(grad, weight, h, out, BM, BN, BK, stages, warps, halves, ws, persistent=True, group_m=8, scale=None,
             q=None, q_scales=None):
    """With `scale` (the product of the operands' inverse scales), weight is [N, K], K-major (FP8). With q (e4m3, h's
    shape) and q_scales ([N / 128, M] fp32), grad_h is written in 1 x 128 blocks too: each half tile (or tile,
    without halves) 128 columns wide."""
    (M, K), N = grad.shape, h.size(1)
    part = [BM, BN // 2] if halves else [BM, BN]
    b_t = scale is not None
    descs = (TensorDescriptor.from_tensor(grad, [BM, BK]),
             TensorDescriptor.from_tensor(weight, [BN, BK] if b_t else [BK, BN]),
             TensorDescriptor.from_tensor(h, part), TensorDescriptor.from_tensor(out, part))
    q_desc = None if q is None else TensorDescriptor.from_tensor(q, part)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(torch.cuda.get_device_properties(grad.device).multi_processor_count if persistent else tiles, tiles)
    return lambda: _dgelu_kernel[(programs,)](*descs, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=group_m,
                                              PROGRAMS=programs, HALVES=halves, WS=ws, num_stages=stages,
                                              num_warps=warps, scale_ptr=scale, B_T=b_t, q_desc=q_desc, s_ptr=q_scales)


BEST = [dict(BM=128, BN=256, BK=64, stages=3, warps=8, halves=True, ws=True),
        dict(BM=256, BN=128, BK=64, stages=3, warps=8, halves=True, ws=False),
        dict(BM=128, BN=256, BK=32, stages=5, warps=8, halves=True, ws=False),
        dict(BM=256, BN=128, BK=64, stages=3, warps=8, halves=True, ws=True)]
BEST += [dict(c, group_m=g) for c in BEST[:2] for g in (4, 16)]


def sweep():
    shapes = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8),
              (128, 128, 64, 5, 4), (256, 128, 64, 3, 8), (64, 256, 64, 4, 4), (128, 256, 32, 5, 8)]
    for BM, BN, BK, stages, warps in shapes:
        for halves in (False, True):
            for ws, persistent in ((False, True), (False, False), (True, True)):
                yield dict(BM=BM, BN=BN, BK=BK, stages=stages, warps=warps, halves=halves, ws=ws, persistent=persistent)


FP8 = [dict(BM=BM, BN=BN, BK=128, stages=st, warps=8, halves=True, ws=ws)
       for BM, BN, st in ((128, 256, 3), (256, 128, 3), (128, 128, 4), (128, 256, 4)) for ws in (True, False)]


def operands(M):
    """(grad [M, K], c_proj's weight [K, N], the GELU's input h [M, N]) in bf16, the same draws for every run."""
    torch.manual_seed(0)
    return ((torch.randn(M, K, device="cuda") * 1e-3).bfloat16(), (torch.randn(K, N, device="cuda") * 0.02).bfloat16(),
            torch.randn(M, N, device="cuda").bfloat16())


def time_configs(configs, grad, weight, h, ref, indent, scale=None):
    """Check each configuration's output against ref (fp32), then time it; a configuration that does not fit
    (shared memory) or does not compile is reported and skipped."""
    out = torch.empty_like(h)
    for cfg in configs:
        try:
            out.zero_()
            run = launcher(grad, weight, h, out, **cfg, scale=scale)
            run()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{indent}{bench(run, reps=30):7.1f} us  error {err:.1e}  {cfg}", flush=True)
        except Exception as e:
            print(f"{indent}failed {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")


def main_fp8():
    print(torch.__version__, "Triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    cast = torch.compile(to_fp8)
    for M in (65536, 16384):
        grad, weight, h = operands(M)
        w8t, w_inv = to_e4m3(weight.t().contiguous())   # [N, K]
        print(f"tokens {M}: cuBLASLt bf16 DGELU {bench(lambda: L.linear_dgelu(grad, weight, h)):.1f} us", flush=True)
        for dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
            g8, g_inv = cast(grad, dtype)
            cast_us = bench(lambda: cast(grad, dtype))
            plain_us = bench(lambda: torch._scaled_mm(g8, w8t.t(), scale_a=g_inv, scale_b=w_inv,
                                                      out_dtype=torch.bfloat16))
            print(f"  {dtype}: the gradient's cast (amax, scale, cast; compiled) {cast_us:.1f} us, "
                  f"_scaled_mm without epilogue {plain_us:.1f} us", flush=True)
            # The reference on the same FP8 operands, dequantized, in fp32.
            ref = torch.ops.aten.gelu_backward((g8.float() * g_inv) @ (w8t.float() * w_inv).t(), h.float(),
                                               approximate="tanh")
            time_configs(FP8, g8, w8t, h, ref, "    ", scale=(g_inv * w_inv).reshape(1))


def main():
    print(torch.__version__, "Triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    configs = list(sweep()) if "--sweep" in sys.argv else BEST
    for M in (65536, 16384):
        grad, weight, h = operands(M)
        ref = L.reference_linear_dgelu(grad, weight, h).float()
        for _ in range(2):   # twice: the clock settles under the first
            print(f"tokens {M}: cuBLASLt DGELU {bench(lambda: L.linear_dgelu(grad, weight, h)):.1f} us, "
                  f"plain GEMM {bench(lambda: grad @ weight):.1f} us", flush=True)
        time_configs(configs, grad, weight, h, ref, "  ")


if __name__ == "__main__":
    main_fp8() if "--fp8" in sys.argv else main()
