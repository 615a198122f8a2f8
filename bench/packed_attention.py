"""Checks and times Utils.kernels.packed_attention on a GPU against SDPA held to cuDNN (the `cudnn_attention`
addition), for one GPT-2 layer's attention (12 heads of 64, T = 1,024, bf16): forward and backward, from
the packed [B, T, 3C] QKV tensor to its packed gradient. SDPA's path includes the copy of dq, dk and dv
into that gradient, which autograd makes as the compiled model's backward does (one gather kernel).
Each is timed replayed from a CUDA graph, as the `max` rung runs it (GPU time), and called eagerly, which
adds the host's time per call where that is the longer (as in rungs without CUDA graphs).

    python3 bench/packed_attention.py
"""
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import packed_attention as pa  # noqa: E402

T, H, D = 1024, 12, 64
C = H * D


def sdpa(qkv):
    B = qkv.size(0)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)


def packed(qkv):
    return pa.packed_attention(qkv, H)


def forward_backward(attention, qkv, dy):
    return torch.autograd.grad(attention(qkv), qkv, dy)[0]


def graphed(fn):
    """fn captured in a CUDA graph (after three warm-up calls on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_us(fn, n=50):
    """Microseconds the host spends per call, enqueueing n calls before waiting for any."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main():
    cuda = torch.device("cuda")
    why = (pa.unavailable(cuda, D) or pa.prepare(cuda, D)) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a CUDA GPU with cuDNN 9 and nvidia-cudnn-frontend ({why})")
    cudnn = pa._frontend()
    print(f"cuDNN {torch.backends.cudnn.version()}, frontend {cudnn.__version__}")
    failed = False
    for B in (4, 16, 64):
        torch.manual_seed(0)
        qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
        if B == 4:   # the fp32 reference holds B x H x T x T scores: checked at the smallest batch
            y, lse = pa.packed_attention_fwd(qkv, H)
            grad = pa.packed_attention_backward(dy, qkv, y, lse, H)
            with torch.no_grad():
                want_y, want_lse = pa._reference_forward(qkv, H)
                want_grad = pa._reference_backward(dy, qkv, want_y, want_lse, H)
            errors = {"y": ((y.float() - want_y.float()).abs().max() / want_y.float().abs().max()).item(),
                      "lse": (lse - want_lse).abs().max().item(),
                      "dqkv": ((grad.float() - want_grad.float()).abs().max() / want_grad.float().abs().max()).item()}
            sdpa_grad = forward_backward(sdpa, qkv, dy)
            errors["dqkv vs SDPA"] = ((grad.float() - sdpa_grad.float()).abs().max()
                                      / sdpa_grad.float().abs().max()).item()
            print("check against the fp32 reference (largest |error|, relative to the largest value but lse's): "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + " (bounds: 1e-2, 1e-3, 2e-2, 2e-2)")
            failed |= not (errors["y"] < 1e-2 and errors["lse"] < 1e-3 and errors["dqkv"] < 2e-2
                           and errors["dqkv vs SDPA"] < 2e-2)
            continue
        base = None
        for name, fn in (("SDPA (cuDNN) + gather", sdpa), ("packed (cuDNN frontend)", packed)):
            step = functools.partial(forward_backward, fn, qkv, dy)
            gpu = do_bench(graphed(step), warmup=50, rep=300) * 1e3
            eager = do_bench(step, warmup=50, rep=300) * 1e3
            host = host_us(step)
            base = gpu if base is None else base
            print(f"batch {B:2d}  {name:24s} graph-replayed {gpu:7.1f} us per layer, forward and backward "
                  f"(x12 layers {12 * gpu / 1e3:6.2f} ms, {12 * (gpu - base) / 1e3:+.2f}); eager {eager:7.1f} us, "
                  f"with the host busy {host:6.1f} us per call")
    if failed:
        sys.exit("error: the packed attention's results are outside those bounds")


if __name__ == "__main__":
    main()
