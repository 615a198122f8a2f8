"""Checks and times the FP8 forward GEMMs of Utils.kernels.fp8_linear (the `fp8_qkv_fc` addition) on a GPU, at
GPT-2 124M's shapes for batch 16 and 64 (16,384 and 65,536 tokens): each against its fp32 reference on the
same FP8 operands and against the bf16 GEMM it replaces in `max` (c_fc: cuBLASLt's GELU_AUX_BIAS epilogue on
the input beside its columns of ones; c_attn: addmm on the same view), with every cuBLASLt candidate timed.
The casts are timed too: the input's alone (in `max` Inductor writes it from the LayerNorm's kernel) and
the weight's (amax and cast, every step).

    python3 bench/fp8_qkv_fc.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gelu_epilogue import bench, candidates  # noqa: E402
from Utils.kernels import cublaslt as L  # noqa: E402
from Utils.kernels import fp8, fp8_linear, gemm_bias_grad  # noqa: E402
from Utils.kernels.fp8 import to_e4m3  # noqa: E402

C = 768


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    why = fp8_linear.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a GPU that runs FP8 GEMMs ({why})")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    norm = torch.nn.LayerNorm(C, device="cuda")
    ok = True
    for M in (16384, 65536):
        y = norm(torch.randn(M, C, device="cuda") * 2 + 0.5).detach().bfloat16()
        y_ones = gemm_bias_grad.with_ones(y)
        x8, x_inv = fp8.normed_to_e4m3(y, norm.weight, norm.bias)
        print(f"\ntokens {M}: |y| max {y.abs().max().item():.2f}, bound {fp8.norm_bound(norm.weight, norm.bias).item():.2f}")
        for name, n in (("c_attn", 3 * C), ("c_fc", 4 * C)):
            w = (torch.randn(n, C, device="cuda") * 0.02).bfloat16()
            b = (torch.randn(n, device="cuda") * 0.1).bfloat16()
            w8, w_inv = to_e4m3(w)
            exact = y.float() @ w.float().t() + b.float()
            if name == "c_fc":
                a, h = fp8_linear.linear_gelu(x8, x_inv, w8, w_inv, b)
                a_ref, h_ref = fp8_linear.reference_gelu(x8, x_inv, w8, w_inv, b)
                errors = rel(h, h_ref), rel(a, a_ref), rel(h, exact)
                fp8_us = bench(lambda: fp8_linear.linear_gelu(x8, x_inv, w8, w_inv, b))
                bf16_us = bench(lambda: L.linear_gelu(y_ones[:, :C], w, b))
                out, aux = torch.empty_like(a), torch.empty_like(h)
                candidates("c_fc FP8 GELU_AUX_BIAS", L.CUBLASLT_EPILOGUE_GELU_AUX_BIAS, x8, w8, out, b, aux,
                           y_t=True, scales=(x_inv, w_inv))
            else:
                h = fp8_linear.linear(x8, x_inv, w8, w_inv, b)
                errors = rel(h, fp8_linear.reference(x8, x_inv, w8, w_inv, b)), 0.0, rel(h, exact)
                fp8_us = bench(lambda: fp8_linear.linear(x8, x_inv, w8, w_inv, b))
                bf16_us = bench(lambda: torch.addmm(b, y_ones[:, :C], w.t()))
            cast_x = bench(lambda: fp8.normed_to_e4m3(y, norm.weight, norm.bias))
            cast_w = bench(lambda: to_e4m3(w))
            good = errors[0] < 1e-2 and errors[1] < 1e-2 and errors[2] < 0.1
            ok &= good
            print(f"  {name:7s} bf16 {bf16_us:7.1f} µs   FP8 {fp8_us:7.1f} µs ({fp8_us / bf16_us:.2f})   "
                  f"input cast alone "
                  f"{cast_x:6.1f}   weight cast {cast_w:5.1f}   rel. error vs reference {errors[0]:.1e} "
                  f"(GELU {errors[1]:.1e}), vs bf16 operands {errors[2]:.1e} {'ok' if good else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
