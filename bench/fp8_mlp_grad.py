"""Checks and times the MLP's hidden-layer gradient GEMM in FP8 (the `fp8_mlp_grad` addition) on a GPU, at GPT-2
124M's shapes for batch 16 and 64 (16,384 and 65,536 tokens): (grad @ W_proj) * gelu'(h) with cuBLASLt's DGELU
epilogue, the residual gradient in e5m2 and W_proj.T in e4m3, against its fp32 reference on the same FP8
operands and against the bf16 GEMM it replaces in `max`, with every cuBLASLt candidate timed. The casts are
timed alone too (eager here; in `max` Inductor compiles them): the gradient's amax and cast, the weight's.

    python3 bench/fp8_mlp_grad.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gelu_epilogue import bench, candidates  # noqa: E402
from Utils.kernels import cublaslt as L  # noqa: E402
from Utils.kernels import fp8_linear  # noqa: E402

C = 768


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    why = fp8_linear.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a GPU that runs FP8 GEMMs ({why})")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    ok = True
    for M in (16384, 65536):
        grad = (torch.randn(M, C, device="cuda") * 1e-3).bfloat16()
        w = (torch.randn(C, 4 * C, device="cuda") * 0.02).bfloat16()   # c_proj's weight [C, 4C]
        h = torch.randn(M, 4 * C, device="cuda").bfloat16()
        g8, g_inv = fp8_linear.grad_to_e5m2(grad)
        w8t, w_inv = fp8_linear.weight_t_to_e4m3(w)
        got = fp8_linear.linear_dgelu(g8, g_inv, w8t, w_inv, h)
        errors = (rel(got, fp8_linear.reference_dgelu(g8, g_inv, w8t, w_inv, h)),
                  rel(got, L.reference_linear_dgelu(grad.float(), w.float(), h.float())))
        good = errors[0] < 1e-2 and errors[1] < 0.1
        ok &= good
        print(f"\ntokens {M}")
        bf16 = bench(lambda: L.linear_dgelu(grad, w, h))
        gemm = bench(lambda: fp8_linear.linear_dgelu(g8, g_inv, w8t, w_inv, h))
        whole = bench(lambda: fp8_linear.grad_dgelu(grad, w, h))
        cast_g = bench(lambda: fp8_linear.grad_to_e5m2(grad))
        cast_w = bench(lambda: fp8_linear.weight_t_to_e4m3(w))
        candidates("FP8 DGELU", L.CUBLASLT_EPILOGUE_DGELU, g8, w8t, torch.empty_like(h), None, h, y_t=True,
                   scales=(g_inv, w_inv))
        candidates("bf16 DGELU", L.CUBLASLT_EPILOGUE_DGELU, grad, w, torch.empty_like(h), None, h)
        print(f"  bf16 {bf16:7.1f} µs   FP8 GEMM {gemm:7.1f} µs ({gemm / bf16:.2f})   with eager casts {whole:7.1f}   "
              f"gradient cast {cast_g:6.1f}   weight cast {cast_w:5.1f}   rel. error vs reference {errors[0]:.1e}, "
              f"vs bf16 operands {errors[1]:.1e} {'ok' if good else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
