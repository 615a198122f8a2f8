"""Checks and times the GELU-epilogue GEMMs of Utils.kernels.cublaslt (Utils.kernels.gelu_epilogue's) on a
GPU, at GPT-2 124M's MLP shapes for batch 16 and 64 (16,384 and 65,536 tokens): results against their fp32
references, a CUDA-graph replay against eager calls, and each heuristic candidate's time against the
compiled unfused operations it replaces.

    python3 bench/gelu_epilogue.py
"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import cublaslt as L  # noqa: E402

K, N = 768, 3072


def bench(fn, reps=40):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def candidates(name, epilogue, *args, **kw):
    times = []
    for i in range(L.CANDIDATES):
        try:
            times.append(bench(lambda: L._matmul(epilogue, *args, algo=i, **kw)))
        except IndexError:   # the heuristic offered fewer
            break
    print(f"  {name:24s}" + "".join(f"{t:8.1f}" for t in times) + f"   best {min(times):.1f} us")
    return min(times)


def main():
    why = L.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a CUDA GPU with cuBLASLt ({why})")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    for M in (16384, 65536):
        x = torch.randn(M, K, device="cuda").bfloat16()
        w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
        b = (torch.randn(N, device="cuda") * 0.1).bfloat16()
        w2 = (torch.randn(K, N, device="cuda") * 0.02).bfloat16()
        g = (torch.randn(M, K, device="cuda") * 1e-3).bfloat16()
        a, h = L.linear_gelu(x, w, b)
        _, h_ref = L.reference_linear_gelu(x.float(), w.float(), b.float())
        print(f"M={M}: pre-activation max error {(h.float() - h_ref).abs().max().item():.2e} "
              f"(largest |h| {h_ref.abs().max().item():.2f})")
        for approx in ("tanh", "none"):
            mismatches = (a != F.gelu(h_ref, approximate=approx).bfloat16()).sum().item()
            print(f"  GELU output differs from gelu(approximate={approx!r}) of the fp32 pre-activation in "
                  f"{mismatches} of {a.numel()} elements")
        gh = L.linear_dgelu(g, w2, h)
        gh_ref = L.reference_linear_dgelu(g.float(), w2.float(), h.float())
        print(f"  GELU-derivative output: max error {(gh.float() - gh_ref).abs().max().item() / gh_ref.abs().max().item():.2e}"
              f" of the largest")

        xs, gs = x.clone(), g.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            L.linear_gelu(xs, w, b), L.linear_dgelu(gs, w2, h)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ag, hg = L.linear_gelu(xs, w, b)
            ghg = L.linear_dgelu(gs, w2, hg)
        xs.copy_(torch.randn_like(x))
        gs.copy_(torch.randn_like(g) * 1e-3)
        graph.replay()
        a2, h2 = L.linear_gelu(xs, w, b)
        print(f"  CUDA graph replay equals eager calls: "
              f"{torch.equal(ag, a2) and torch.equal(hg, h2) and torch.equal(ghg, L.linear_dgelu(gs, w2, h2))}")

        plain_forward = torch.compile(lambda x, w, b: (lambda h: (F.gelu(h, approximate="tanh"), h))(F.linear(x, w, b)))
        plain_backward = torch.compile(lambda g, w2, h: torch.ops.aten.gelu_backward(g @ w2, h, approximate="tanh"))
        plain_sum = torch.compile(lambda gh: gh.sum(0))
        print("  PyTorch (us):")
        t = {"GEMM x @ w.T": bench(lambda: x @ w.t()),
             "GEMM+bias, GELU (compiled)": bench(lambda: plain_forward(x, w, b)),
             "GEMM g @ w2": bench(lambda: g @ w2),
             "GEMM, GELU' (compiled)": bench(lambda: plain_backward(g, w2, h)),
             "bias-gradient sum": bench(lambda: plain_sum(gh)),
             "weight gradient GEMM": bench(lambda: gh.t() @ x)}
        for name, value in t.items():
            print(f"  {name:28s}{value:8.1f}")
        print("  cuBLASLt, each heuristic candidate (us):")
        out, aux = torch.empty_like(h), torch.empty_like(h)
        grad_bias, grad_w = torch.empty(N, device="cuda", dtype=torch.bfloat16), torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
        forward = candidates("GELU_AUX_BIAS", L.CUBLASLT_EPILOGUE_GELU_AUX_BIAS, x, w, out, b, aux, y_t=True)
        backward = candidates("DGELU", L.CUBLASLT_EPILOGUE_DGELU, g, w2, out, None, h)
        # the same product with the weight stored transposed: both operands then run along the summed
        # dimension (cuBLAS's "TN"), the layout for which Hopper's newer GEMM kernels are offered
        w2_t, aux2 = w2.t().contiguous(), torch.empty_like(h)
        transposed = candidates("DGELU, weight transposed", L.CUBLASLT_EPILOGUE_DGELU, g, w2_t, aux2, None, h, y_t=True)
        L._matmul(L.CUBLASLT_EPILOGUE_DGELU, g, w2, out, None, h)
        L._matmul(L.CUBLASLT_EPILOGUE_DGELU, g, w2_t, aux2, None, h, y_t=True)
        print(f"  DGELU, weight transposed: max difference {(aux2.float() - out.float()).abs().max().item():.2e} "
              f"(largest {out.float().abs().max().item():.2e}); {backward - transposed:+.1f} us faster")
        print(f"  GEMM g @ w2, weight transposed (PyTorch): {bench(lambda: g @ w2_t.t()):8.1f}")
        # the bias as a column of the weight, against a column of ones beside x (as gemm_bias_grad stores x):
        # the GELU epilogue without its bias
        x1 = torch.cat([x, torch.ones(M, 1, device="cuda", dtype=x.dtype), torch.zeros(M, 7, device="cuda", dtype=x.dtype)], 1)
        w1 = torch.cat([w, b[:, None], torch.zeros(N, 7, device="cuda", dtype=w.dtype)], 1)
        candidates("GELU_AUX, bias as a column", L.CUBLASLT_EPILOGUE_GELU_AUX, x1, w1, out, None, aux, y_t=True)
        # timed for comparison only: the bias gradient summed by the epilogue, and no epilogue at all
        candidates("DGELU_BGRAD", L.CUBLASLT_EPILOGUE_DGELU_BGRAD, g, w2, out, grad_bias, h)
        candidates("weight gradient", L.CUBLASLT_EPILOGUE_DEFAULT, gh, x, grad_w, None, None, x_t=True)
        saved_forward = t["GEMM+bias, GELU (compiled)"] - forward
        saved_backward = t["GEMM, GELU' (compiled)"] - backward
        print(f"  per layer, epilogue against compiled: {saved_forward:.1f} us saved forward, "
              f"{saved_backward:.1f} us backward")


if __name__ == "__main__":
    main()
