# Probes: (A) cuDNN attention plans/knobs at 124M b64 and xl b8; (B) cuBLASLt FP8 DGELU; (C) FP8 vs bf16 GEMM rates
import ctypes, math, statistics, sys, traceback
import torch
from Utils.kernels import cublaslt as L, native, packed_attention as P

def timeit(fn, n=20):
    for _ in range(3): fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for e in ev[1:]:
        fn(); e.record()
    ev[-1].synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:])) * 1e3  # us

SHAPES = {"124M b64": (64, 1024, 12, 64), "xl b8": (8, 1024, 25, 64)}

def attention():
    import cudnn
    for label, (B, T, H, D) in SHAPES.items():
        C = H * D
        qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16)
        y, lse = P.packed_attention_fwd(qkv, H)
        do = torch.randn_like(y); dqkv = torch.empty_like(qkv)
        ptr = {**P._packed_pointers(qkv, "qkv"), **P._packed_pointers(dqkv, ("dq", "dk", "dv")), "o": y.data_ptr(), "do": do.data_ptr(), "lse": lse.data_ptr()}
        fptr = {**P._packed_pointers(qkv, "qkv"), "o": y.data_ptr(), "lse": lse.data_ptr()}
        base_b = timeit(lambda: P.packed_attention_backward(do, qkv, y, lse, H))
        base_f = timeit(lambda: P.packed_attention_fwd(qkv, H))
        print(f"[attn {label}] default fwd {base_f:.1f} us, bwd {base_b:.1f} us", flush=True)
        for backward in (False, True):
            for modes in ([cudnn.heur_mode.A], [cudnn.heur_mode.B], [cudnn.heur_mode.FALLBACK]):
                try:
                    g, t = _graph(cudnn, backward, B, T, H, D, modes)
                    n = g.get_execution_plan_count()
                    res = []
                    for i in range(n):
                        try:
                            ws = torch.empty(max(g.get_workspace_size_plan_at_index(i), 1), dtype=torch.uint8, device="cuda")
                            vp = {t[k]: v for k, v in (ptr if backward else fptr).items()}
                            res.append(f"{i}:{timeit(lambda: g.execute_plan_at_index(vp, ws, i, handle=P._handle(0))):.1f}")
                        except Exception as e:
                            res.append(f"{i}:ERR {str(e)[:80]}")
                    print(f"  {'bwd' if backward else 'fwd'} {modes}: {n} plans: {' '.join(res)}", flush=True)
                except Exception as e:
                    print(f"  {'bwd' if backward else 'fwd'} {modes}: ERR {type(e).__name__} {str(e)[:200]}", flush=True)
            try:
                g, t = _graph(cudnn, backward, B, T, H, D, [cudnn.heur_mode.A], build=False)
                ne = g.get_engine_count()
                print(f"  engines: {ne}", flush=True)
                for eid in range(ne):
                    try:
                        print(f"   engine {eid} knobs: {g.get_knobs_for_engine(eid)}", flush=True)
                    except Exception as e:
                        print(f"   engine {eid}: ERR {str(e)[:120]}")
            except Exception as e:
                print(f"  engine query ERR {type(e).__name__} {str(e)[:200]}")

def _graph(cudnn, backward, batch, seq_len, n_head, head_dim, modes, build=True):
    io, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=P._handle(0))
    lay = P.layout(batch, seq_len, n_head, head_dim)
    t = {name: g.tensor(name=name, dim=lay["dims"], stride=lay["packed"], data_type=io) for name in "qkv"}
    scale = 1.0 / math.sqrt(head_dim)
    if not backward:
        o, lse = g.sdpa(name="attention", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=scale, use_causal_mask=True)
        o.set_output(True).set_dim(lay["dims"]).set_stride(lay["flat"]).set_data_type(io)
        lse.set_output(True).set_dim(lay["stats_dims"]).set_stride(lay["stats"]).set_data_type(f32)
        t.update(o=o, lse=lse)
    else:
        t["o"] = g.tensor(name="o", dim=lay["dims"], stride=lay["flat"], data_type=io)
        t["do"] = g.tensor(name="do", dim=lay["dims"], stride=lay["flat"], data_type=io)
        t["lse"] = g.tensor(name="lse", dim=lay["stats_dims"], stride=lay["stats"], data_type=f32)
        grads = g.sdpa_backward(name="attention_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["lse"], attn_scale=scale, use_causal_mask=True)
        for name, tensor in zip(("dq", "dk", "dv"), grads):
            tensor.set_output(True).set_dim(lay["dims"]).set_stride(lay["packed"]).set_data_type(io)
            t[name] = tensor
    g.validate(); g.build_operation_graph()
    if build:
        g.create_execution_plans(modes); g.check_support(); g.build_plans(cudnn.build_plan_policy.ALL)
    return g, t

E5M2 = 29
def lt_plan(epi, m, n, k, a_t, b_t, d_t, aux_t=None):
    lib = L._library()
    desc = ctypes.c_void_p()
    native.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), L.CUBLAS_COMPUTE_32F, L.CUDA_R_32F), "desc")
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(1))
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(0))
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_EPILOGUE, ctypes.c_int32(epi))
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ctypes.c_int64(m))
    if aux_t is not None:
        L._set(lib, desc, 22, ctypes.c_int32(aux_t))   # CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_FAST_ACCUM, ctypes.c_int8(1))
    a = L._layout(lib, a_t, k, m, k); b = L._layout(lib, b_t, k, n, k); d = L._layout(lib, d_t, m, n, m)
    pref = ctypes.c_void_p(); native.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    lim = ctypes.c_uint64(L.WORKSPACE_BYTES)
    lib.cublasLtMatmulPreferenceSetAttribute(pref, L.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(lim), ctypes.sizeof(lim))
    res, cnt = (L._HeuristicResult * 8)(), ctypes.c_int()
    st = lib.cublasLtMatmulAlgoGetHeuristic(L._handle(0)[0], desc, a, b, d, d, pref, 8, res, ctypes.byref(cnt))
    return st, cnt.value, desc, a, b, d, res

def fp8_dgelu():
    lib = L._library(); handle, ws = L._handle(0)
    for label, (B, T, H, D) in SHAPES.items():
        M, C = B * T, H * D
        dy = torch.randn(M, C, device="cuda", dtype=torch.bfloat16) * 1e-2
        wp = torch.randn(C, 4 * C, device="cuda", dtype=torch.bfloat16) * 0.02
        h = torch.randn(M, 4 * C, device="cuda", dtype=torch.bfloat16)
        t_bf = timeit(lambda: L.linear_dgelu(dy, wp, h))
        ref = L.reference_linear_dgelu(dy.float(), wp.float(), h.float())
        s_dy = 57344.0 / dy.abs().amax().float(); s_w = 448.0 / wp.abs().amax().float()
        dy8 = (dy.float() * s_dy).to(torch.float8_e5m2); wt8 = (wp.t().contiguous().float() * s_w).to(torch.float8_e4m3fn)
        inv_dy, inv_w = (1 / s_dy).reshape(()).contiguous(), (1 / s_w).reshape(()).contiguous()
        out = torch.empty_like(h)
        for epi, name in ((L.CUBLASLT_EPILOGUE_DGELU, "DGELU"), (L.CUBLASLT_EPILOGUE_DEFAULT, "DEFAULT")):
            st, cnt, desc, a, b, d, res = lt_plan(epi, 4 * C, M, C, L.CUDA_R_8F_E4M3, E5M2, L.CUDA_R_16BF)
            if st or not cnt:
                print(f"[fp8 {name} {label}] heuristic status {st} count {cnt}", flush=True); continue
            L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ctypes.c_void_p(h.data_ptr()))
            L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ctypes.c_void_p(inv_w.data_ptr()))
            L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ctypes.c_void_p(inv_dy.data_ptr()))
            alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
            stream = torch.cuda.current_stream().cuda_stream
            def launch(i):
                native.check(lib.cublasLtMatmul(handle, desc, ctypes.byref(alpha), ctypes.c_void_p(wt8.data_ptr()), a, ctypes.c_void_p(dy8.data_ptr()), b, ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), d, ctypes.c_void_p(out.data_ptr()), d, ctypes.byref(res[i].algo), ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(L.WORKSPACE_BYTES), ctypes.c_void_p(stream)), "matmul")
            times = []
            for i in range(cnt):
                try:
                    times.append(timeit(lambda: launch(i)))
                except Exception as e:
                    times.append(float("nan")); print("   err", i, e)
            best = min(range(cnt), key=lambda i: times[i] if times[i] == times[i] else 1e9); launch(best); torch.cuda.synchronize()
            err = ((out.float() - (ref if name == "DGELU" else (dy.float() @ wp.float()))).norm() / (ref if name == "DGELU" else dy.float() @ wp.float()).norm()).item()
            print(f"[fp8 {name} {label}] bf16 DGELU {t_bf:.1f} us; fp8 candidates {cnt}: {' '.join(f'{x:.1f}' for x in times)}; rel err {err:.4f}", flush=True)
        # casts: amax + e5m2 cast of dy, as torch ops (uncompiled upper bound) and compiled
        f = torch.compile(lambda x: (x.float() * (57344.0 / x.abs().amax().float())).to(torch.float8_e5m2))
        print(f"[cast {label}] dy amax+cast compiled {timeit(lambda: f(dy)):.1f} us", flush=True)

def rates():
    for label, (B, T, H, D) in SHAPES.items():
        M, C = B * T, H * D
        for name, K, N in (("c_attn dgrad", 3 * C, C), ("c_fc dgrad", 4 * C, C), ("mlp proj dgrad", C, 4 * C), ("attn proj dgrad", C, C)):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
            tb = timeit(lambda: x @ w)
            x8 = x.to(torch.float8_e5m2); w8 = w.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            tf = timeit(lambda: torch._scaled_mm(x8, w8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True))
            fl = 2 * M * K * N
            print(f"[rate {label}] {name}: bf16 {tb:.1f} us ({fl/tb/1e6:.0f} TF/s), fp8 {tf:.1f} us ({fl/tf/1e6:.0f} TF/s)", flush=True)

for part in sys.argv[1:]:
    try:
        globals()[part]()
    except Exception:
        traceback.print_exc()
