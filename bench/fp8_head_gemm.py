"""Times the output layer's forward GEMM in FP8, logits = h8 @ w8.T for one chunk of the loss (4,096 tokens x
768 features against GPT-2's 50,304 words, bf16 logits out), as `max` runs it (torch._scaled_mm with one scale
per tensor and fast accumulation, Utils.kernels.fp8_loss) against cuBLASLt's other candidates for the same
GEMM and a persistent Triton GEMM of our own.

The question it answers: in `max`'s profile at batch 64 this GEMM takes 282 us a chunk (4.51 ms a step over 16
chunks, results/logs/kernels-b64-dfeed133f596.txt), 1,120 TFLOP/s, where the weight gradient's FP8 GEMM of the
same FLOPs runs at 1,650. Its sum is short (768 features: six 128-deep steps a tile) and each 128 x 256 tile
then stores 64 KB of logits: a kernel that stores one tile while it multiplies the next (a persistent,
warp-specialized loop with TMA stores) could hide most of the store. Every configuration is checked against
_scaled_mm's output before it is timed.

    python3 bench/fp8_head_gemm.py
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
from Utils.kernels.fp8 import to_e4m3  # noqa: E402
from Utils.kernels.recompute_logits import logits_tile  # noqa: E402   (the logits' GEMM tile)

ROWS, WIDTH, VOCAB = 4096, 768, 50304


@triton.jit
def _gemm_kernel(a_desc, b_desc, c_desc, scale_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, HALVES: tl.constexpr, WS: tl.constexpr):
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    scale = tl.load(scale_ptr)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
        acc, om, on = logits_tile(a_desc, b_desc, tile_id, num_pid_m, num_pid_n, K, BM, BN, BK, GROUP_M)
        acc = acc * scale
        if HALVES:   # the store in two halves: fewer registers held at once
            a0, a1 = tl.split(tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1))
            c_desc.store([om, on], a0.to(tl.bfloat16))
            c_desc.store([om, on + BN // 2], a1.to(tl.bfloat16))
        else:
            c_desc.store([om, on], acc.to(tl.bfloat16))


def launcher(a, b, out, scale, BM, BN, BK, stages, warps, halves, ws, group_m=8):
    M, K = a.shape
    N = b.size(0)
    descs = (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BN, BK]),
             TensorDescriptor.from_tensor(out, [BM, BN // 2] if halves else [BM, BN]))
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(torch.cuda.get_device_properties(a.device).multi_processor_count, tiles)
    return lambda: _gemm_kernel[(programs,)](*descs, scale, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=group_m,
                                             PROGRAMS=programs, HALVES=halves, WS=ws, num_stages=stages,
                                             num_warps=warps)


CONFIGS = [dict(BM=BM, BN=BN, BK=128, stages=st, warps=8, halves=h, ws=ws)
           for BM, BN, st in ((128, 256, 3), (128, 256, 4), (256, 128, 3), (128, 128, 4), (128, 128, 6))
           for ws in (True, False) for h in (True, False)]
CONFIGS += [dict(BM=128, BN=256, BK=128, stages=3, warps=8, halves=True, ws=True, group_m=g) for g in (1, 4, 16, 32)]
CONFIGS += [dict(BM=128, BN=256, BK=64, stages=s, warps=8, halves=True, ws=True) for s in (4, 6)]


def main():
    print(torch.__version__, "Triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    h8, h_inv = to_e4m3(torch.randn(ROWS, WIDTH, device="cuda"))
    w8, w_inv = to_e4m3(torch.randn(VOCAB, WIDTH, device="cuda") * 0.02)
    out = torch.empty(ROWS, VOCAB, dtype=torch.bfloat16, device="cuda")
    flops = 2 * ROWS * WIDTH * VOCAB

    def scaled_mm():
        torch._scaled_mm(h8, w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=torch.bfloat16, use_fast_accum=True,
                         out=out)

    scaled_mm()
    ref = out.float().clone()
    for _ in range(2):   # twice: the clock settles under the first
        us = bench(scaled_mm, reps=50)
        print(f"_scaled_mm (max's): {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s", flush=True)
    times = []
    for i in range(L.CANDIDATES):
        try:
            times.append(bench(lambda: L._matmul(L.CUBLASLT_EPILOGUE_DEFAULT, h8, w8, out, None, None, y_t=True,
                                                 algo=i, scales=(h_inv, w_inv)), reps=50))
        except IndexError:   # the heuristic offered fewer
            break
    print("cuBLASLt candidates (no fast accumulation): " + ", ".join(f"{t:.1f}" for t in times) + " us", flush=True)
    scale = (h_inv * w_inv).reshape(1)
    for cfg in CONFIGS:
        try:
            out.zero_()
            run = launcher(h8, w8, out, scale, **cfg)
            run()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            us = bench(run, reps=50)
            print(f"  {us:7.1f} us {flops / us / 1e6:5.0f} TFLOP/s  error {err:.1e}  {cfg}", flush=True)
        except Exception as e:
            print(f"  failed {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
    us = bench(scaled_mm, reps=50)
    print(f"_scaled_mm again: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
