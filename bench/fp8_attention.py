"""Times cuDNN's FP8 attention forward against its bf16 one, for one GPT-2 layer's attention (12 heads of 64,
T = 1,024, causal), q, k and v read in place from the packed [B, T, 3C] tensor as the `max` rung reads them
(Utils.kernels.packed_attention); and asks cuDNN whether it builds the FP8 backward at this head size.

Attention is about 17 ms of `max`'s 92 ms step at batch 64 (results/h200-fold-norm-profile), running at 230-300
TFLOP/s: the largest kernel family left in bf16. Hopper's FP8 rate is twice bf16's, but its FP8 attention
backward takes a head size of 128 only (cudnn-frontend's sdpa_fp8_bwd.h), so for GPT-2 only the forward
could move, and this says what that would be worth before any of it is built. The FP8 inputs get one scale
per tensor from their amax (what fp8_head does); the softmax's probabilities are scaled by 448 into e4m3.

    python3 bench/fp8_attention.py
"""
import math
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import packed_attention as pa  # noqa: E402

T, H, D = 1024, 12, 64
C = H * D
E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max   # 448


def attention_tflop(batch: int, passes: float) -> float:
    """Causal attention's matmul FLOPs (two GEMMs of 2·T·T·D a head, half of them masked) times passes."""
    return passes * 2 * 2 * batch * H * T * T * D / 2 / 1e12


def fp8_forward_graph(cudnn, handle, batch, out_dtype):
    """(graph, tensors) for cuDNN's FP8 forward on the packed layout, its output in out_dtype."""
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    lay = pa.layout(batch, T, H, D)
    t = {name: g.tensor(name=name, dim=lay["dims"], stride=lay["packed"], data_type=e4m3) for name in "qkv"}
    for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        t[name] = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"],
                                          descale_k=t["descale_k"], descale_v=t["descale_v"],
                                          descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"],
                                          generate_stats=True, attn_scale=1 / math.sqrt(D), use_causal_mask=True)
    o.set_output(True).set_dim(lay["dims"]).set_stride(lay["flat"]).set_data_type(out_dtype)
    stats.set_output(True).set_dim(lay["stats_dims"]).set_stride(lay["stats"]).set_data_type(f32)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    t.update(o=o, stats=stats, amax_s=amax_s, amax_o=amax_o)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t


def fp8_backward_refusal(cudnn, handle, batch) -> str:
    """What cuDNN says when asked to build the FP8 backward at head size D ('built' if it does)."""
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    try:
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        lay = pa.layout(batch, T, H, D)
        t = {n: g.tensor(name=n, dim=lay["dims"], stride=lay["packed"], data_type=e4m3) for n in "qkv"}
        for n in ("o", "do"):
            t[n] = g.tensor(name=n, dim=lay["dims"], stride=lay["flat"], data_type=e4m3)
        t["stats"] = g.tensor(name="stats", dim=lay["stats_dims"], stride=lay["stats"], data_type=f32)
        s = [g.tensor(name=f"s{i}", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for i in range(12)]
        grads = g.sdpa_fp8_backward(t["q"], t["k"], t["v"], t["o"], t["do"], t["stats"], *s,
                                    attn_scale=1 / math.sqrt(D), use_causal_mask=True)
        for x in grads[:3]:
            x.set_output(True).set_dim(lay["dims"]).set_stride(lay["packed"]).set_data_type(e4m3)
        for x in grads[3:]:
            x.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return "built"
    except Exception as e:   # cuDNN's refusal is the answer
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def main() -> None:
    cuda = torch.device("cuda")
    why = (pa.unavailable(cuda, D) or pa.prepare(cuda, D)) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a CUDA GPU with cuDNN 9 and nvidia-cudnn-frontend ({why})")
    cudnn = pa._frontend()
    handle = pa._handle(0)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(f"{torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}, frontend {cudnn.__version__}")
    print(f"FP8 backward at head size {D}: {fp8_backward_refusal(cudnn, handle, 4)}")
    for B in (16, 64):
        torch.manual_seed(0)
        qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16)
        y, lse = pa.packed_attention_fwd(qkv, H)
        dy = torch.randn_like(y)
        bf16_fwd = do_bench(lambda: pa.packed_attention_fwd(qkv, H), return_mode="median")
        bf16_bwd = do_bench(lambda: pa.packed_attention_backward(dy, qkv, y, lse, H), return_mode="median")
        amax = qkv.abs().amax().float()
        scale = FP8_MAX / amax
        cast = lambda: (qkv.float() * scale).to(E4M3)   # noqa: E731  (one scale for q, k and v)
        cast_ms = do_bench(cast, return_mode="median")
        qkv8 = cast()
        one = lambda v: torch.full((1, 1, 1, 1), v, dtype=torch.float32, device="cuda")   # noqa: E731
        scalars = {"descale_q": one(1 / scale), "descale_k": one(1 / scale), "descale_v": one(1 / scale),
                   "descale_s": one(1 / FP8_MAX), "scale_s": one(FP8_MAX), "scale_o": one(1.0)}
        fwd_rate, bwd_rate = attention_tflop(B, 1) / bf16_fwd * 1e3, attention_tflop(B, 2.5) / bf16_bwd * 1e3
        print(f"B={B:3d}  bf16 forward {bf16_fwd * 1e3:7.1f} us ({fwd_rate:4.0f} TFLOP/s)  backward "
              f"{bf16_bwd * 1e3:7.1f} us ({bwd_rate:4.0f})  cast of qkv to e4m3 {cast_ms * 1e3:6.1f} us")
        for name, out_dtype, torch_dtype in (("e4m3 out", cudnn.data_type.FP8_E4M3, E4M3),
                                             ("bf16 out", cudnn.data_type.BFLOAT16, torch.bfloat16)):
            try:
                g, t = fp8_forward_graph(cudnn, handle, B, out_dtype)
            except Exception as e:   # cuDNN refuses this form: say so and go on
                print(f"        FP8 forward, {name}: not built ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
                continue
            o = torch.empty(B, T, C, device="cuda", dtype=torch_dtype)
            stats = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
            amax_s, amax_o = one(0.0), one(0.0)
            workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
            ptr = {t[n]: v.data_ptr() for n, v in scalars.items()}
            ptr.update({t[n]: qkv8.data_ptr() + off for n, off in zip("qkv", pa.layout(1, 1, 1, C)["offsets"])})
            ptr.update({t["o"]: o.data_ptr(), t["stats"]: stats.data_ptr(), t["amax_s"]: amax_s.data_ptr(),
                        t["amax_o"]: amax_o.data_ptr()})
            run = lambda: g.execute(ptr, workspace, handle=handle)   # noqa: E731
            run()
            torch.cuda.synchronize()
            ms = do_bench(run, return_mode="median")
            err = ((o.float() - y.float()).norm() / y.float().norm()).item()
            lse_err = (stats - lse).abs().max().item()
            print(f"        FP8 forward, {name}: {ms * 1e3:7.1f} us ({attention_tflop(B, 1) / ms * 1e3:4.0f} TFLOP/s), "
                  f"{bf16_fwd / ms:.2f}x bf16's; output's error against bf16 {err:.4f} (relative norm), "
                  f"log-sum-exp's {lse_err:.4f} (largest)")


if __name__ == "__main__":
    main()
