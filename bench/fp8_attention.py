"""Times cuDNN's FP8 attention forward against its bf16 one, for one GPT-2 layer's attention (12 heads of 64,
T = 1,024, causal), q, k and v read in place from the packed [B, T, 3C] tensor as the `max` rung reads them
(Utils.kernels.packed_attention); and asks cuDNN's frontend whether it builds the FP8 backward at this head size.

Attention is about 17 ms of `max`'s 92 ms step at batch 64 (BENCHMARKS.md, "fold_norm"), running at 230-300
TFLOP/s: the largest kernel family left in bf16. Hopper's FP8 rate is twice bf16's, but the frontend's FP8
attention backward takes a head size of 128 only on Hopper (sdpa_fp8_bwd.h), so for GPT-2 only the forward could
move, and this says what that would be worth before any of it is built. Both forwards run the plan cuDNN's
heuristic picks, called straight through the frontend with every pointer prepared, so that neither time holds
the host's work of a PyTorch operator. q, k and v each get one scale from their amax (what fp8_head does); the
softmax's probabilities are scaled by 448 into e4m3, the output by 448 over its amax.

    python3 bench/fp8_attention.py
"""
import functools
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
SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


def attention_tflop(batch: int, passes: float) -> float:
    """Causal attention's matmul FLOPs (two GEMMs of 2·T·T·D a head, half of them masked) times passes."""
    return passes * 2 * 2 * batch * H * T * T * D / 2 / 1e12


def _finish(cudnn, g) -> None:
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def fp8_forward_graph(cudnn, handle, batch: int, out_dtype) -> tuple:
    """(graph, its tensors by name) for cuDNN's FP8 forward on the packed layout, its output in out_dtype."""
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    lay = pa.layout(batch, T, H, D)
    t = {name: g.tensor(name=name, dim=lay["dims"], stride=lay["packed"], data_type=e4m3) for name in "qkv"}
    for name in SCALARS:
        t[name] = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], **{n: t[n] for n in SCALARS},
                                          generate_stats=True, attn_scale=1 / math.sqrt(D), use_causal_mask=True)
    o.set_output(True).set_dim(lay["dims"]).set_stride(lay["flat"]).set_data_type(out_dtype)
    stats.set_output(True).set_dim(lay["stats_dims"]).set_stride(lay["stats"]).set_data_type(f32)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    t.update(o=o, lse=stats, amax_s=amax_s, amax_o=amax_o)
    _finish(cudnn, g)
    return g, t


def fp8_backward_answer(cudnn, handle, batch: int) -> str:
    """What the frontend says when asked to build the FP8 backward at head size D ('built' if it does)."""
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    try:
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        lay = pa.layout(batch, T, H, D)
        t = {n: g.tensor(name=n, dim=lay["dims"], stride=lay["packed"], data_type=e4m3) for n in "qkv"}
        for n in ("o", "dO"):
            t[n] = g.tensor(name=n, dim=lay["dims"], stride=lay["flat"], data_type=e4m3)
        t["stats"] = g.tensor(name="stats", dim=lay["stats_dims"], stride=lay["stats"], data_type=f32)
        names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                 "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
        scalars = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for n in names}
        grads = g.sdpa_fp8_backward(**t, **scalars, attn_scale=1 / math.sqrt(D), use_causal_mask=True)
        for x in grads[:3]:   # dq, dk, dv; then the amaxes of dq, dk, dv and dP
            x.set_output(True).set_dim(lay["dims"]).set_stride(lay["packed"]).set_data_type(e4m3)
        for x in grads[3:]:
            x.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        _finish(cudnn, g)
        return "built"
    except Exception as e:   # the frontend's refusal is the answer
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def executor(handle, graph, tensors: dict, pointers: dict):
    """A call that runs graph on the given pointers (by tensor name), its workspace allocated once."""
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    bound = {tensors[name]: pointer for name, pointer in pointers.items()}
    return functools.partial(graph.execute, bound, workspace, handle=handle)


def scalar(value: float) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device="cuda")


def main() -> None:
    cuda = torch.device("cuda")
    why = (pa.unavailable(cuda, D) or pa.prepare(cuda, D)) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a CUDA GPU with cuDNN 9 and nvidia-cudnn-frontend ({why})")
    cudnn = pa._frontend()
    handle = pa._handle(0)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(f"{torch.cuda.get_device_name()}, cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}")
    print(f"FP8 backward at head size {D}: {fp8_backward_answer(cudnn, handle, 4)}")
    for B in (16, 64):
        torch.manual_seed(0)
        qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(B, T, C, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
        dy, dqkv = torch.randn_like(y), torch.empty_like(qkv)
        g, t = pa._graph(0, False, B, T, H, D, torch.bfloat16)
        inputs = pa._packed_pointers(qkv, "qkv")
        forward = executor(handle, g, t, {**inputs, "o": y.data_ptr(), "lse": lse.data_ptr()})
        forward()   # y and lse, which the backward reads and the FP8 forward is compared with
        g, t = pa._graph(0, True, B, T, H, D, torch.bfloat16)
        backward = executor(handle, g, t, {**inputs, **pa._packed_pointers(dqkv, ("dq", "dk", "dv")),
                                           "o": y.data_ptr(), "do": dy.data_ptr(), "lse": lse.data_ptr()})
        bf16_fwd, bf16_bwd = (do_bench(f, return_mode="median") for f in (forward, backward))
        print(f"B={B:3d}  bf16 forward {bf16_fwd * 1e3:7.1f} us ({attention_tflop(B, 1) / bf16_fwd * 1e3:4.0f} "
              f"TFLOP/s), backward {bf16_bwd * 1e3:7.1f} us ({attention_tflop(B, 2.5) / bf16_bwd * 1e3:4.0f})")
        amax = qkv.view(B, T, 3, C).abs().amax(dim=(0, 1, 3)).float()   # q's, k's and v's
        qkv8 = (qkv.view(B, T, 3, C).float() * (FP8_MAX / amax)[:, None]).to(E4M3).view(B, T, 3 * C)
        descales = (amax / FP8_MAX).tolist()
        amax_o = y.abs().amax().item()   # the bf16 output's: what a running amax would hold
        values = dict(zip(SCALARS, (*descales, 1 / FP8_MAX, FP8_MAX, FP8_MAX / amax_o)))
        for name, out_dtype, torch_dtype in (("e4m3 out", cudnn.data_type.FP8_E4M3, E4M3),
                                             ("bf16 out", cudnn.data_type.BFLOAT16, torch.bfloat16)):
            try:
                g, t = fp8_forward_graph(cudnn, handle, B, out_dtype)
            except Exception as e:   # the frontend refuses this form: say so and go on
                print(f"        FP8 forward, {name}: not built ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
                continue
            o = torch.empty(B, T, C, device="cuda", dtype=torch_dtype)
            stats = torch.empty_like(lse)
            amaxes = {n: scalar(0.0) for n in ("amax_s", "amax_o")}
            scalars = {n: scalar(v) for n, v in values.items()}   # held, so that their pointers stay valid
            pointers = {**{n: s.data_ptr() for n, s in scalars.items()}, **pa._packed_pointers(qkv8, "qkv"),
                        "o": o.data_ptr(), "lse": stats.data_ptr(), **{n: a.data_ptr() for n, a in amaxes.items()}}
            run = executor(handle, g, t, pointers)
            ms = do_bench(run, return_mode="median")
            out = o.float() * (amax_o / FP8_MAX if torch_dtype == E4M3 else 1.0)
            err = ((out - y.float()).norm() / y.float().norm()).item()
            print(f"        FP8 forward, {name}: {ms * 1e3:7.1f} us ({attention_tflop(B, 1) / ms * 1e3:4.0f} TFLOP/s), "
                  f"{bf16_fwd / ms:.2f}x bf16's speed; output's error against bf16 {err:.4f} (relative norm), "
                  f"log-sum-exp's {(stats - lse).abs().max().item():.4f} (largest)")


if __name__ == "__main__":
    main()
