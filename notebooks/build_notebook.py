"""Writes notebooks/Optimizing_GPU_Utilization.ipynb from the cells below, and executes it in place.

    python notebooks/build_notebook.py                 build, execute against RESULTS, save with outputs
    python notebooks/build_notebook.py --no-execute    build only (no outputs)
    RESULTS=results/other python notebooks/build_notebook.py    execute against another results folder

The notebook's source lives here so that a change to it is reviewed as Python, not as JSON; the
test suite checks that the committed .ipynb holds exactly these cells. Executing needs no GPU: the
notebook reads recorded measurements and runs only small CPU computations.
"""
import argparse
import os
import sys
import textwrap

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "Optimizing_GPU_Utilization.ipynb")
REPO = os.path.dirname(HERE)
CELL_TIMEOUT_S = 300


def md(text):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text):
    return new_code_cell(textwrap.dedent(text).strip("\n"))


CELLS = [
    md(r"""
    # Optimizing GPU utilization: why each rung of the ladder is faster

    The suite trains GPT-2 (124M parameters) under a cumulative ladder of optimizations and records the
    time of every training step. This notebook explains those measurements. It starts from first
    principles (what bounds the time of a training step at all), then takes one rung at a time: the
    lines of `Utils/` that switch it on, why it is faster, what it costs, and what it did to step time,
    memory and loss. It ends with the charts and a short guide.

    Every number in the text is computed from the recorded files when the notebook runs, so re-measuring
    and re-running it (`python notebooks/build_notebook.py`, or `make notebook`) updates the prose too.
    It needs no GPU and runs in well under a minute. `RESULTS` in the first cell chooses the folder it
    reads (the environment variable of the same name overrides it).
    """),
    code(r"""
    import os
    import sys


    def find_repo(start):
        # The repository root is the nearest folder above holding Utils/, wherever the kernel was started.
        path = os.path.abspath(start)
        while not os.path.isdir(os.path.join(path, "Utils")):
            parent = os.path.dirname(path)
            if parent == path:
                raise RuntimeError(f"no folder holding Utils/ at or above {start}: start the notebook inside the repository")
            path = parent
        return path


    REPO = find_repo(os.getcwd())
    if REPO not in sys.path:
        sys.path.insert(0, REPO)

    # A path relative to the current folder, or else to the repository root.
    RESULTS = os.environ.get("RESULTS", os.path.join("results", "h200-b16"))
    if not os.path.isabs(RESULTS) and not os.path.isdir(RESULTS):
        RESULTS = os.path.join(REPO, RESULTS)
    RESULTS = os.path.abspath(RESULTS)
    if not os.path.isdir(RESULTS):
        raise FileNotFoundError(f"RESULTS={RESULTS} is not a folder: point RESULTS at a folder holding results.csv and runs.csv")
    """),
    code(r"""
    import inspect
    import io
    import json
    import re
    import textwrap
    from dataclasses import asdict, replace

    import numpy as np
    import pandas as pd
    import torch
    from IPython.display import Image, display
    from matplotlib.figure import Figure

    import plot_results
    from Utils import metrics, recipes, runner
    from Utils.model import GPT, PRESETS, CausalSelfAttention
    from Utils.recipes import LADDER, RECIPES

    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)


    def say(text):
        # Conclusions computed below are printed as wrapped paragraphs.
        print(textwrap.fill(" ".join(str(text).split()), width=110))


    def rel(path):
        # Paths inside the repository are shown from its root, others in full.
        inside = os.path.commonpath([os.path.abspath(path), REPO]) == REPO
        return os.path.relpath(path, REPO) if inside else os.path.abspath(path)


    steps_df, runs_df = plot_results.load(RESULTS)
    report = plot_results.build_report(steps_df, runs_df)
    table = report.table
    ref = report.reference
    OK = [r for r in table.index if table.at[r, "status"] == "ok" and np.isfinite(table.at[r, "median_step_ms"])]

    # Companion sets named like RESULTS (h200-b16 -> h200-b64, h200-loss), read when they exist.
    _tag = re.match(r"(.+)-b\d+$", os.path.basename(RESULTS))
    _stem = os.path.join(os.path.dirname(RESULTS), _tag.group(1) if _tag else os.path.basename(RESULTS))
    BATCH64_RESULTS = _stem + "-b64"
    LOSS_RESULTS = _stem + "-loss"
    ABLATION_RESULTS = _stem + "-ablation-b16"
    BREAKDOWN = os.path.join(RESULTS, "breakdown.csv")

    print(f"RESULTS = {rel(RESULTS)}")
    print(f"compared runs: {report.context}")
    print(f"torch {', '.join(sorted(set(report.runs['torch_version'])))} on the measuring machine; "
          f"torch {torch.__version__} here")
    print(f"rungs with a usable run: {', '.join(OK) or 'none'}")
    for name, path in (("batch-64 set", BATCH64_RESULTS), ("300-step loss set", LOSS_RESULTS),
                       ("compute/memory/overhead breakdown", BREAKDOWN)):
        found = os.path.exists(path) and os.path.realpath(path) != os.path.realpath(RESULTS)
        print(f"{name}: {rel(path)} {'found' if found else 'absent: its section says so and moves on'}")
    """),
    md(r"""
    ## The measurements

    `plot_results.summarize` picks one run per rung (the latest successful run with the baseline's batch,
    sequence length, model, data and GPU) and recomputes its median step time over the measured steps,
    warm-up left out. The table below is that frame; the speedup is the baseline's median over the rung's.
    The `NOTEBOOK_FIGURES` line is a machine-readable record of the same figures, rounded as `summary.md`
    rounds them: the tests compare the two.
    """),
    code(r"""
    def rounded(value, digits):
        return round(float(value), digits) if value is not None and np.isfinite(value) else None


    shown = pd.DataFrame({
        "median ms": table["median_step_ms"].round(1),
        "IQR ms": table["iqr_step_ms"].round(1),
        "speedup": table["speedup"].round(2),
        "tokens/s": table["tokens_per_s"].map(lambda v: f"{v:,.0f}" if np.isfinite(v) else "-"),
        "MFU %": (100 * table["mfu"]).round(1),
        "peak alloc GiB": table["peak_mem_allocated_gib"].round(1),
        "peak reserved GiB": table["peak_mem_reserved_gib"].round(1),
        "compile s": table["compile_s"].round(1),
        "final loss": table["final_loss"].round(3),
        "status": table["status"],
    })
    display(shown)

    FIGURES = {rung: {"median_step_ms": rounded(r["median_step_ms"], 1),
                      "iqr_step_ms": rounded(r["iqr_step_ms"], 1),
                      "speedup": rounded(r["speedup"], 2),
                      "tokens_per_s": rounded(r["tokens_per_s"], 0),
                      "mfu_pct": rounded(100 * r["mfu"], 1),
                      "peak_mem_allocated_gib": rounded(r["peak_mem_allocated_gib"], 1),
                      "peak_mem_reserved_gib": rounded(r["peak_mem_reserved_gib"], 1),
                      "compile_s": rounded(r["compile_s"], 1),
                      "final_loss": rounded(r["final_loss"], 3),
                      "status": r["status"]}
               for rung, r in table.iterrows()}
    print("NOTEBOOK_FIGURES " + json.dumps(FIGURES))
    """),
    md(r"""
    ## First principles: compute, memory and overhead

    A training step spends its time in three ways:

    * **compute**: the floating-point operations of the matrix multiplications, at the rate of the units
      that run them (the tensor cores for TF32, BF16 and FP16; the ordinary FP32 units otherwise);
    * **memory**: the bytes that must travel between the GPU's memory (HBM) and its chip, at the memory
      bandwidth: every elementwise operation (a LayerNorm, a GELU, a softmax, an optimizer update) reads
      its inputs and writes its outputs, and does so little arithmetic per byte that bandwidth sets its pace;
    * **overhead**: everything else: the Python interpreter, PyTorch's dispatcher, kernel launches,
      synchronizations. The GPU idles whenever the CPU has not yet told it what to do next.

    Each gives a floor: FLOPs over the peak rate, bytes over the bandwidth. A step can be no faster than
    the larger of the two floors, and what it takes beyond that is kernels running below their peak
    plus overhead. Which floor a rung sits against says which kind of optimization can help it next:
    against compute, only fewer FLOPs or faster units (lower precision) help; against memory, fewer bytes
    (smaller types, fusion, not writing intermediates out); far above both, fewer and larger kernels.
    """),
    md(r"""
    ### The machine

    The floors need the GPU's peak rates and its memory bandwidth, all from the vendor's datasheet. The
    suite already keeps two such tables: the dense BF16 peaks (`Utils.metrics`, the MFU denominator) and
    the HBM bandwidths (`Utils.breakdown`). The FP32 and TF32 rates are in `DATASHEET` below; for a GPU
    missing from it, TF32 is taken as half the BF16 rate (as on NVIDIA's GPUs since Ampere) and the FP32
    floor is left out.
    """),
    code(r"""
    from Utils.breakdown import peak_hbm_bandwidth

    # FP32 (ordinary units) and dense TF32 (tensor cores) rates in FLOP/s, from NVIDIA's H100/H200 SXM
    # datasheet, which lists the tensor-core rates with structured sparsity: dense is half of those.
    DATASHEET = [
        (r"\bH200\b", {"fp32": 67e12, "tf32": 494.7e12}),
        (r"\bH100 80GB HBM3\b", {"fp32": 67e12, "tf32": 494.7e12}),   # H100 SXM
    ]


    def machine(gpu_name):
        spec = {"fp32": None, "tf32": None, "bf16": metrics.peak_bf16_flops(gpu_name),
                "bandwidth": peak_hbm_bandwidth(gpu_name)}
        source = {"bf16": "Utils.metrics", "bandwidth": "Utils.breakdown"}
        for pattern, rates in DATASHEET:
            if re.search(pattern, gpu_name):
                spec.update(rates)
                source.update(dict.fromkeys(rates, "DATASHEET"))
                break
        else:
            if spec["bf16"]:
                spec["tf32"], source["tf32"] = spec["bf16"] / 2, "half the BF16 rate"
        return spec, source


    GPU = str(ref["gpu_name"]) if ref is not None else "unknown"
    SPEC, SPEC_SOURCE = machine(GPU)
    for key, value in SPEC.items():
        unit = "TB/s" if key == "bandwidth" else "TFLOP/s dense"
        print(f"{GPU} {key:9s} " + (f"{value / 1e12:7.1f} {unit} ({SPEC_SOURCE[key]})" if value else "unknown"))
    missing = [k for k, v in SPEC.items() if not v]
    if missing:
        say(f"{GPU}: {', '.join(missing)} unknown, so the floors that need {'it' if len(missing) == 1 else 'them'} "
            f"are left out below. Adding the "
            f"GPU's datasheet figures (DATASHEET here, or the suite's tables) fills them in.")
    """),
    md(r"""
    ### Compute: FLOPs per token × tokens per step ÷ peak rate

    A token costs about 6N FLOPs in the matrix multiplications with weights (2N forward, 4N backward,
    N = parameters without the position embedding), plus the attention's own two matrix products,
    QKᵀ and AV, which grow with the sequence length (`Utils.metrics.flops_per_token`, after the PaLM
    paper). The model is built on PyTorch's meta device: shapes without storage, so it costs no memory.
    """),
    code(r"""
    MODEL = str(ref["model"])
    CONFIG = PRESETS[MODEL]
    with torch.device("meta"):
        meta_model = GPT(CONFIG)
    N = meta_model.num_params()                                     # the FLOPs formula's N
    N_ALL = meta_model.num_params(exclude_position_embedding=False)   # every parameter the optimizer updates
    PARAM_SHAPES = [p.shape for p in meta_model.parameters()]
    B, T = int(ref["batch_size"]), int(ref["seq_len"])
    L, H, C, V = CONFIG.n_layer, CONFIG.n_head, CONFIG.n_embd, CONFIG.vocab_size
    TOKENS = B * T
    FLOPS_TOKEN = metrics.flops_per_token(N, L, H, C // H, T)
    FLOPS_STEP = FLOPS_TOKEN * TOKENS

    print(f"model {MODEL}: {L} layers, {H} heads, width {C}, vocabulary {V}")
    recorded = f"{int(ref['n_params']):,}" if np.isfinite(ref["n_params"]) else "none"
    print(f"N = {N:,} parameters without the position embedding ({N_ALL:,} with it; runs.csv records {recorded})")
    print(f"FLOPs per token = 6N + 12·L·H·d·T = {6 * N / 1e6:,.1f}M + {(FLOPS_TOKEN - 6 * N) / 1e6:,.1f}M "
          f"= {FLOPS_TOKEN / 1e6:,.1f}M")
    print(f"tokens per step = batch × seq_len = {B} × {T} = {TOKENS:,}")
    print(f"FLOPs per step = {FLOPS_STEP / 1e12:.2f} TFLOP")

    COMPUTE_FLOOR_MS = {p: (FLOPS_STEP / SPEC[p] * 1e3 if SPEC[p] else None) for p in ("fp32", "tf32", "bf16")}
    for p, ms in COMPUTE_FLOOR_MS.items():
        print(f"compute floor with {p} matmuls: " + (f"{ms:.1f} ms" if ms else "unknown"))
    """),
    md(r"""
    ### Memory: the bytes a step must move ÷ bandwidth

    This is an estimate of a floor, not a measurement. Its assumptions:

    1. **Weights, gradients, clipping.** Every rung keeps FP32 master weights. Forward reads each weight
       once, backward reads it again and writes its gradient (4 bytes each); gradient clipping reads the
       gradients for their norm, then reads and rewrites them scaled. The optimizer's traffic is counted
       below by running it.
    2. **Activations.** Per layer and token, backward needs the tensors listed in `ACTIVATIONS` below
       (16 values per channel). Each is written once in forward and read once in backward; its gradient is
       written once and read once: 4 accesses, at 4 bytes per value on the FP32 rungs and 2 on the BF16
       ones. That is a floor: autocast keeps LayerNorm, softmax and the loss in FP32.
    3. **Logits.** B·T·vocabulary values, with the same 4 accesses.
    4. **Attention scores**, with the written-out ("manual") attention only: B·H·T·T values per layer,
       accessed as many times as counted below.
    5. Every access goes to HBM: no reuse from the cache, which is tens of MB while one layer's scores
       alone are far larger, and no recomputation.
    """),
    code(r"""
    # Per layer and token, the values backward reads (in units of the width C), and why each is kept.
    ACTIVATIONS = {
        "block input (LayerNorm 1's input)": 1,
        "LayerNorm 1 output (c_attn's input)": 1,
        "q, k, v": 3,
        "attention output (c_proj's input)": 1,
        "residual after attention (LayerNorm 2's input)": 1,
        "LayerNorm 2 output (c_fc's input)": 1,
        "c_fc output (GELU's input)": 4,
        "GELU output (the second c_proj's input)": 4,
    }
    ACT_PER_TOKEN_LAYER = sum(ACTIVATIONS.values()) * C
    SCORES = B * H * T * T   # one layer's attention scores
    print(f"activations kept per layer and token: {sum(ACTIVATIONS.values())}·C = {ACT_PER_TOKEN_LAYER:,} values")
    print(f"one layer's attention scores: B·H·T·T = {SCORES:,} values = {SCORES * 4 / 1e9:.2f} GB in FP32")
    """),
    md(r"""
    How often does the written-out attention touch its scores? Rather than guess, the next cell runs the
    suite's own `CausalSelfAttention` forward and backward on a tiny input under a
    `TorchDispatchMode`, which sees every ATen operation PyTorch executes, the backward ones included, and
    counts the values of T×T shape each one reads and writes (views move no data and are skipped).
    Eager mode on a GPU executes the same operations, one kernel each. The same counter run on the
    `sdpa` attention shows what FlashAttention changes.
    """),
    code(r"""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten


    def tensor_bytes(obj, keep=lambda t: True, size=lambda t: t.numel() * t.element_size()):
        return sum(size(t) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and keep(t))


    class Traffic(TorchDispatchMode):
        # Reads: every tensor an operation is given. Writes: the tensors it returns fresh, and those its
        # schema says it mutates in place. Views and the like move no data and are left out.
        def __init__(self, keep=lambda t: True, size=lambda t: t.numel() * t.element_size()):
            super().__init__()
            self.keep, self.size, self.ops = keep, size, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view or func.__name__.startswith(("_unsafe_view", "_local_scalar_dense", "_record_function")):
                return out
            schema = func._schema
            named = {**dict(zip([a.name for a in schema.arguments], args)), **kwargs}
            measure = lambda x: tensor_bytes(x, self.keep, self.size)   # noqa: E731
            read = measure((args, kwargs))
            written = sum(measure(named.get(a.name)) for a in schema.arguments
                          if a.alias_info is not None and a.alias_info.is_write)
            outs = out if isinstance(out, tuple) else (out,)
            written += sum(measure(o) for o, r in zip(outs, schema.returns) if r.alias_info is None)
            self.ops.append((func.__name__, read, written))
            return out

        def frame(self):
            return pd.DataFrame(self.ops, columns=["op", "read", "written"])


    def score_accesses(attention, b=2, h=2, t=24, c=64):
        # One layer's forward and backward at a tiny size; the count per score value is size-free.
        cfg = replace(CONFIG, block_size=t, n_layer=1, n_head=h, n_embd=c, attention=attention)
        layer = CausalSelfAttention(cfg)
        x = torch.randn(b, t, c, requires_grad=True)
        is_scores = lambda u: u.dim() >= 2 and tuple(u.shape[-2:]) == (t, t) and u.numel() >= b * h * t * t  # noqa: E731
        with Traffic(keep=is_scores, size=lambda u: u.numel()) as counter:
            layer(x).sum().backward()
        ops = counter.frame()
        ops = ops[(ops.read > 0) | (ops.written > 0)].copy()
        ops[["read", "written"]] = ops[["read", "written"]] / (b * h * t * t)
        return ops


    eager_ops = score_accesses("manual")
    EAGER_SCORE_ACCESSES = int(round(eager_ops[["read", "written"]].to_numpy().sum()))
    SDPA_SCORE_ACCESSES = int(round(score_accesses("sdpa")[["read", "written"]].to_numpy().sum()))
    print("operations of one written-out attention layer (forward, then backward) that touch the scores,")
    print("in whole score tensors read and written:")
    print(eager_ops.to_string(index=False))
    print(f"\neager written-out attention: {EAGER_SCORE_ACCESSES} passes over the B·H·T·T scores per layer and step")
    print(f"F.scaled_dot_product_attention: {SDPA_SCORE_ACCESSES} passes: the scores never exist in memory")
    """),
    md(r"""
    With `torch.compile` the written-out attention keeps its matrix products, but Inductor fuses the
    scale, the mask and the softmax into one kernel, and their backward into another. The count for that
    case is an assumption, not a measurement (compiling needs a C++ toolchain and far more time than
    this notebook takes): forward, the QKᵀ product writes the scores, one fused kernel reads them and
    writes the probabilities, AV reads those (4 passes); backward, a product writes the probabilities'
    gradient, the V gradient reads the probabilities, one fused kernel reads both and writes the scores'
    gradient, and the Q and K gradients read that (7 passes).

    The optimizer's traffic is counted by running it, the same way, on the tiny preset (bytes per
    parameter do not depend on the model's size). On a GPU, `torch.optim.AdamW`'s default implementation
    is `foreach` (a few multi-tensor kernels per step, each one pass over every parameter), so the count
    asks for it explicitly: on a CPU the default is a per-tensor loop doing the same arithmetic.
    """),
    code(r"""
    COMPILED_SCORE_ACCESSES = 4 + 7    # the assumption above


    def optimizer_bytes_per_param():
        torch.manual_seed(0)
        tiny = GPT(PRESETS["tiny"])
        n = sum(p.numel() for p in tiny.parameters())
        for p in tiny.parameters():
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(recipes._param_groups(tiny), lr=recipes.LEARNING_RATE, betas=recipes.BETAS,
                                eps=recipes.EPS, foreach=True)
        opt.step()   # the first step creates the states; the second is the one counted
        with Traffic() as clip:
            torch.nn.utils.clip_grad_norm_(tiny.parameters(), recipes.GRAD_CLIP)
        with Traffic() as step:
            opt.step()
        ops = step.frame()
        ops = ops[ops.read + ops.written > 0]
        per_param = lambda f: (f.read.sum() + f.written.sum()) / n   # noqa: E731
        return per_param(clip.frame()), per_param(ops), ops.op.tolist()


    CLIP_BYTES, FOREACH_BYTES, FOREACH_OPS = optimizer_bytes_per_param()
    FUSED_BYTES = 7 * 4    # one pass: read p, g, m, v and write p, m, v, 4 bytes each

    # bitsandbytes' AdamW8bit keeps m and v in one byte each (plus a scale per block of values), but only
    # for tensors of at least min_8bit_size = 4096 values; smaller ones keep 32-bit states.
    BNB_MIN_8BIT_SIZE = 4096
    N_8BIT = sum(s.numel() for s in PARAM_SHAPES if s.numel() >= BNB_MIN_8BIT_SIZE)
    EIGHT_BIT_BYTES = (N_8BIT * (4 + 4 + 1 + 1 + 4 + 1 + 1) + (N_ALL - N_8BIT) * FUSED_BYTES) / N_ALL
    # ClippedAdamW (the max rung's update) is fused AdamW's pass with the clip factor applied as it reads each
    # gradient, so of the clip only the norm's read of the gradients is left.
    OPTIMIZER_BYTES = {"adamw": FOREACH_BYTES, "adamw_fused": FUSED_BYTES, "adamw8bit": EIGHT_BIT_BYTES,
                       "adamw_triton": FUSED_BYTES}
    NORM_ONLY_CLIP_BYTES = 4
    WEIGHT_BYTES = 4 + 4 + 4     # forward read, backward read, gradient written

    print(f"gradient clipping: {CLIP_BYTES:.0f} bytes per parameter per step")
    print(f"foreach AdamW: {FOREACH_BYTES:.0f} bytes per parameter per step, in {len(FOREACH_OPS)} multi-tensor operations:")
    print("   " + ", ".join(FOREACH_OPS))
    print(f"fused AdamW: {FUSED_BYTES} bytes per parameter per step, in one kernel per parameter group")
    print(f"8-bit AdamW: {EIGHT_BIT_BYTES:.1f} bytes per parameter per step "
          f"({N_8BIT / N_ALL:.1%} of the parameters are in tensors large enough for 8-bit states)")
    """),
    md(r"""
    Now the two floors for every rung. The recipe of each rung (`Utils.recipes.RECIPES`) decides its
    inputs: the matmul precision (FP32 units, TF32 or BF16 tensor cores), the bytes per activation, the
    attention (scores or none) and the optimizer.
    """),
    code(r"""
    def precision(recipe):
        return "bf16" if recipe.bf16 else ("tf32" if recipe.tf32 else "fp32")


    def traffic_gb(recipe):
        act = 2 if recipe.bf16 else 4
        if recipe.attention == "sdpa":
            score_passes = SDPA_SCORE_ACCESSES
        else:
            score_passes = COMPILED_SCORE_ACCESSES if recipe.compile else EAGER_SCORE_ACCESSES
        parts = {
            "weights+grads+clip": N_ALL * (WEIGHT_BYTES + (NORM_ONLY_CLIP_BYTES if recipe.optimizer == "adamw_triton"
                                                           else CLIP_BYTES)),
            "optimizer": N_ALL * OPTIMIZER_BYTES[recipe.optimizer],
            "activations": TOKENS * L * ACT_PER_TOKEN_LAYER * 4 * act,
            "logits": TOKENS * V * 4 * act,
            "scores": SCORES * L * score_passes * act,
        }
        return {k: v / 1e9 for k, v in parts.items()}


    rows = {}
    for rung in table.index:
        if rung not in RECIPES:
            continue
        recipe = RECIPES[rung]
        gb = traffic_gb(recipe)
        row = {f"{k} GB": v for k, v in gb.items()}
        row["total GB"] = sum(gb.values())
        row["memory floor ms"] = row["total GB"] * 1e9 / SPEC["bandwidth"] * 1e3 if SPEC["bandwidth"] else np.nan
        row["matmuls"] = precision(recipe)
        row["compute floor ms"] = COMPUTE_FLOOR_MS[precision(recipe)] or np.nan
        row["measured ms"] = table.at[rung, "median_step_ms"]
        rows[rung] = row
    floors = pd.DataFrame.from_dict(rows, orient="index")
    display(floors.round(1))
    """),
    md(r"""
    ### Overhead: how much work each launch carries

    PyTorch's eager mode runs one operation at a time: Python calls it, the dispatcher picks a kernel, the
    CPU launches it. That costs the CPU on the order of ten microseconds per operation, whatever the
    operation's size. While the GPU's kernels take longer than that, the CPU runs ahead and the cost is
    hidden; when they take less, the GPU waits and the step is overhead-bound. Counting the operations of
    one eager step (the count depends on the number of layers, not on the batch or the width, so a
    narrow copy of the model serves) says how much GPU time each launch carries.
    """),
    code(r"""
    # A rule of thumb for eager PyTorch's CPU cost per operation (Python, dispatcher, launch), not a measurement.
    CPU_US_PER_OP = 10


    def eager_ops_per_step(attention):
        cfg = replace(CONFIG, n_embd=8 * CONFIG.n_head, vocab_size=64, block_size=16, attention=attention)
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (1, 16))
        with Traffic() as counter:
            _, loss = model(idx, idx)
            loss.backward()
        ops = counter.frame()
        return int(((ops.read > 0) | (ops.written > 0)).sum())


    EAGER_OPS = {a: eager_ops_per_step(a) for a in ("manual", "sdpa")}
    # The optimizer's multi-tensor operations, plus clipping's: a foreach norm, stack, norm, add, divide,
    # clamp and a foreach multiply.
    OPT_OPS = len(FOREACH_OPS) + 7
    for attention, ops in EAGER_OPS.items():
        print(f"eager forward + backward with {attention} attention: {ops} operations on tensors")

    eager = {}
    for rung in OK:
        recipe = RECIPES.get(rung)
        if recipe is not None and not recipe.compile:
            ops = EAGER_OPS[recipe.attention] + OPT_OPS
            eager[rung] = {"operations": ops, "ms": table.at[rung, "median_step_ms"],
                           "µs of GPU work per operation": 1e3 * table.at[rung, "median_step_ms"] / ops}
    if eager:
        eager = pd.DataFrame.from_dict(eager, orient="index")
        display(eager.round(0))
        per_op = eager["µs of GPU work per operation"]
        issue_ms = eager["operations"].max() * CPU_US_PER_OP / 1e3
        say(f"Each eager operation carries {per_op.min():.0f} to {per_op.max():.0f} µs of GPU work, "
            f"{per_op.min() / CPU_US_PER_OP:.0f}x or more the CPU's cost of issuing it: the CPU keeps ahead, and "
            f"overhead does not bound the eager rungs at this size. It would if the same operations took less "
            f"than about {issue_ms:.0f} ms of GPU time in all, some {eager['ms'].min() / issue_ms:.0f} times less "
            f"work per operation than here: a much smaller model or batch. The compiled rungs launch fewer, larger "
            f"kernels for the model, but the optimizer still steps eagerly.")
    else:
        say("No eager rung was measured: nothing to weigh against the cost of a launch.")
    """),
    md(r"""
    ### Which bound each rung sits against

    The conclusion for each rung, computed from the two floors and its measured median step time. The
    chart shows the same: the bar is the measured step, the marks the floors.
    """),
    code(r"""
    def verdict(rung):
        cf, mf, m = (floors.at[rung, k] for k in ("compute floor ms", "memory floor ms", "measured ms"))
        if not np.isfinite(m):
            return f"{rung}: no measured step time ({table.at[rung, 'status']})."
        known = {name: v for name, v in (("compute", cf), ("memory", mf)) if np.isfinite(v)}
        if not known:
            return f"{rung}: {m:.1f} ms measured; no floor known for {GPU}."
        bound = max(known, key=known.get)
        ms_or_unknown = lambda v: f"{v:.1f} ms" if np.isfinite(v) else "unknown"   # noqa: E731
        text = (f"{rung}: {m:.1f} ms measured; compute floor {ms_or_unknown(cf)} ({floors.at[rung, 'matmuls']}), "
                f"memory floor {ms_or_unknown(mf)}. ")
        if m < known[bound]:
            return text + f"It runs below the {bound} floor: the estimate overcounts this rung."
        text += f"It sits against the {bound} floor, at {m / known[bound]:.1f}× it"
        if len(known) == 2:
            other = "memory" if bound == "compute" else "compute"
            text += f" (and {m / known[other]:.1f}× the {other} floor)"
        return text + (f"; {m - known[bound]:.1f} ms are kernels below their peak rate and overhead."
                       if m > 1.5 * known[bound] else ": close to what this GPU can do for this recipe.")


    BOUND = {}   # the floor each rung sits against, where both floors are known
    for rung in floors.index:
        say(verdict(rung))
        cf, mf = floors.at[rung, "compute floor ms"], floors.at[rung, "memory floor ms"]
        if np.isfinite(cf) and np.isfinite(mf):
            BOUND[rung] = "compute" if cf >= mf else "memory"

    rungs = [r for r in floors.index if np.isfinite(floors.at[r, "measured ms"])]
    if rungs:
        fig = Figure(figsize=(9, 1.4 + 0.5 * len(rungs)), dpi=100, layout="constrained")
        ax = fig.subplots()
        colors = plot_results.rung_colors(table.index)
        y = np.arange(len(rungs))
        ax.barh(y, floors.loc[rungs, "measured ms"], color=[colors[r] for r in rungs], alpha=0.45, height=0.6,
                label="measured median")
        ax.scatter(floors.loc[rungs, "compute floor ms"], y, marker="|", s=500, lw=3, color="black",
                   label="compute floor", zorder=3)
        ax.scatter(floors.loc[rungs, "memory floor ms"], y, marker="D", s=45, color="#1a1a8c",
                   label="memory floor", zorder=3)
        lowest = np.nanmin(floors.loc[rungs, ["compute floor ms", "memory floor ms", "measured ms"]].to_numpy())
        ax.set_xlim(lowest / 1.5, floors.loc[rungs, "measured ms"].max() * 1.3)
        ax.set_yticks(y, rungs)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per step (log scale)")
        ax.set_title(f"Measured step time against the two floors\n{report.context}", fontsize=10)
        ax.grid(axis="x", alpha=0.3, which="both")
        ax.legend(loc="lower right", fontsize=8)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        display(Image(buf.getvalue()))
    """),
    md(r"""
    ### The measured split, where there is one

    The floors are estimates. A profile measures where the time goes: `make profile` writes
    `breakdown.csv` next to the results (`Utils.breakdown`: per rung, the milliseconds per step during
    which matrix-multiply and attention kernels run, only other kernels run, or the GPU idles). Set next
    to the floors, it says how close each class of kernels comes to its peak.
    """),
    code(r"""
    if os.path.exists(BREAKDOWN):
        from Utils.breakdown import load_breakdown, plot_breakdown
        measured_split = load_breakdown(RESULTS)    # the latest profiled run of each rung
        split = measured_split.pivot(index="rung", columns="class", values="ms_per_step")
        split = split.reindex(plot_results.rung_order(split.index))
        for cls, floor in (("compute", "compute floor ms"), ("memory", "memory floor ms")):
            if cls in split.columns:
                split[f"{floor} / {cls} ms"] = floors[floor].reindex(split.index) / split[cls]
        say(f"{rel(BREAKDOWN)}: ms per profiled step by class, and each floor over the time of its class: near 1, "
            f"that class of kernels runs near the rate the floor assumes. Rough: the floors count all of a step's "
            f"FLOPs or bytes, and a class's time is when its kernels run.")
        display(split.round(2))
        buf = io.BytesIO()
        plot_breakdown(measured_split, report.context).savefig(buf, format="png", dpi=90)
        display(Image(buf.getvalue()))
    else:
        say(f"No breakdown.csv in {rel(RESULTS)}: run `make profile` on the GPU to measure the compute, "
            "memory and overhead split per rung; this notebook shows it here when the file exists.")
    """),
    md(r"""
    ## The ladder, one rung at a time

    Each rung is its predecessor plus one change (8-bit AdamW branches off the flash rung, in place of the
    fused optimizer). Every section prints the lines of `Utils/` that make the change, straight from the
    code, and the recipe fields that differ from its predecessor. The helpers below do the printing and
    the measured comparisons.
    """),
    code(r"""
    def show(obj, *words):
        # Print an object's source from its file, or only its lines holding one of `words`.
        lines, start = inspect.getsourcelines(obj)
        where = f"{rel(inspect.getsourcefile(obj))}, {obj.__qualname__}"
        print(f"# {where}" + (f": the lines with {', '.join(map(repr, words))}" if words else ""))
        for number, line in enumerate(lines, start):
            if not words or any(w in line for w in words):
                print(f"{number:4d}  {line.rstrip()}")
        print()


    def differences(a, b):
        a, b = asdict(a), asdict(b)
        return {k: (a[k], b[k]) for k in a if k != "name" and a[k] != b[k]}


    def parent(rung):
        # The earliest earlier rung whose recipe differs from this one's in the fewest fields.
        if rung not in LADDER:
            return None
        earlier = LADDER[:LADDER.index(rung)]
        if not earlier:
            return None
        return min(earlier, key=lambda p: len(differences(RECIPES[p], RECIPES[rung])))


    def recipe_change(rung):
        p = parent(rung)
        if p is None:
            print(f"recipe {rung}: {asdict(RECIPES[rung])}")
            return
        diff = differences(RECIPES[p], RECIPES[rung])
        changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        previous = LADDER[LADDER.index(rung) - 1]
        note = f" (it branches off {p}, not {previous})" if p != previous else ""
        print(f"recipe {rung} = recipe {p} with {changes}{note}")


    def measured(rung):
        return rung in OK


    def value(rung, col):
        return table.at[rung, col] if rung in table.index else np.nan


    def loss_tracking(rung, last=10):
        # How closely the rung's loss follows the baseline's over the last steps (same data order), next to
        # how much the baseline's own loss moves from batch to batch there.
        steps = report.steps
        a = steps[steps.optimization == rung].set_index("step")["loss"]
        b = steps[steps.optimization == "baseline"].set_index("step")["loss"]
        common = a.index.intersection(b.index)[-last:]
        return float(np.mean(np.abs(a[common] - b[common]))), float(np.std(b[common]))


    def measured_effect(rung):
        if not measured(rung):
            status = value(rung, "status") if rung in table.index else "not recorded"
            message = table.at[rung, "message"] if rung in table.index else ""
            say(f"{rung} has no usable run in {rel(RESULTS)} ({status}{': ' + message if message else ''}): "
                "nothing measured to show.")
            return
        ms, iqr = value(rung, "median_step_ms"), value(rung, "iqr_step_ms")
        lines = [f"step time: {ms:.1f} ms median (IQR {iqr:.1f} ms)"]
        if "baseline" in OK and rung != "baseline":
            lines.append(f"speedup over the baseline: {value(rung, 'speedup'):.2f}x")
        p = parent(rung)
        before = LADDER[LADDER.index(rung) - 1] if rung in LADDER[1:] else None
        for other, label in ((p, "its predecessor"), (before if before != p else None, "the rung before it")):
            if other and measured(other):
                lines.append(f"against {label}, {other}: {value(other, 'median_step_ms') / ms:.2f}x "
                             f"({value(other, 'median_step_ms') - ms:+.1f} ms saved per step)")
        lines.append(f"throughput: {value(rung, 'tokens_per_s'):,.0f} tokens/s"
                     + (f", MFU {100 * value(rung, 'mfu'):.1f}%" if np.isfinite(value(rung, "mfu")) else ""))
        alloc, reserved = value(rung, "peak_mem_allocated_gib"), value(rung, "peak_mem_reserved_gib")
        if np.isfinite(alloc):
            mem = f"peak memory: {alloc:.1f} GiB allocated, {reserved:.1f} GiB reserved"
            if p and measured(p) and np.isfinite(value(p, "peak_mem_allocated_gib")):
                mem += f" ({alloc - value(p, 'peak_mem_allocated_gib'):+.1f} GiB allocated against {p})"
            lines.append(mem)
        if np.isfinite(value(rung, "compile_s")):
            lines.append(f"compile time: {value(rung, 'compile_s'):.1f} s, paid once, before the first step")
        loss = f"final loss: {value(rung, 'final_loss'):.3f}"
        if "baseline" in OK and rung != "baseline":
            gap, spread = loss_tracking(rung)
            loss += (f" ({value(rung, 'final_loss') - value('baseline', 'final_loss'):+.3f} against the baseline; "
                     f"over the last 10 steps it differs from the baseline's by {gap:.3f} on average, while the "
                     f"baseline's own loss varies by {spread:.3f} (std) from batch to batch)")
        lines.append(loss)
        for line in lines:
            print("  " + line)
        if rung in floors.index:
            say(verdict(rung))
    """),
    md(r"""
    ### baseline: FP32 everywhere, attention written out, eager, AdamW's default implementation

    **What it is.** The reference: every rung is compared with it. All arithmetic is FP32 and the FP32
    matrix multiplications run on the ordinary FP32 units, not the tensor cores. Attention computes the
    full T×T score matrix, masks it, applies softmax and multiplies by V, each step a separate kernel that
    writes its T×T result to memory. The model runs eagerly, one kernel per operation, and AdamW uses
    PyTorch's default multi-tensor (`foreach`) implementation. The training loop is the same for every rung;
    these are the lines where the recipe enters it.
    """),
    code(r"""
    recipe_change("baseline")
    show(runner.train, "apply_", "autocast", "step_model", "backward", "update")
    measured_effect("baseline")
    """),
    md(r"""
    ### tf32: TensorFloat-32 matrix multiplications

    **What changes.** One flag: FP32 matrix multiplications may run on the tensor cores in TF32.

    **Why it is faster.** TF32 keeps FP32's 8-bit exponent (its range) but rounds the inputs of each
    multiplication to a 10-bit mantissa, accumulating in FP32. The tensor cores multiply such inputs at
    many times the rate of the FP32 units, so the compute floor drops by that factor; nothing else
    changes: tensors stay FP32 in memory, so every memory-bound kernel runs exactly as before.

    **What it costs.** Precision of the products: about three significant decimal digits instead of
    seven. Training is normally insensitive to it, since gradient noise is far larger. No memory change.
    No effect on GPUs older than Ampere.
    """),
    code(r"""
    recipe_change("tf32")
    show(recipes.apply_tf32)
    measured_effect("tf32")
    if measured("tf32") and measured("baseline") and COMPUTE_FLOOR_MS["fp32"]:
        s_mm = COMPUTE_FLOOR_MS["fp32"] / COMPUTE_FLOOR_MS["tf32"]
        s = value("baseline", "median_step_ms") / value("tf32", "median_step_ms")
        if 1 < s < s_mm:
            share = (1 - 1 / s) / (1 - 1 / s_mm)
            after = (1 - share) / ((1 - share) + share / s_mm)
            say(f"If the whole step were matrix multiplications at peak rate, TF32 would make it {s_mm:.1f}x faster; "
                f"it made it {s:.2f}x faster. By Amdahl's law (matmuls {s_mm:.1f}x faster, the rest untouched), about "
                f"{share:.0%} of the baseline step was matmul time. The untouched rest, memory-bound kernels with "
                f"the attention scores' passes first among them, is now {after:.0%} of the tf32 step: that is "
                f"where the next rungs find their time.")
    """),
    md(r"""
    ### bf16: BF16 autocast

    **What changes.** The forward pass runs under `torch.autocast(dtype=torch.bfloat16)`: matrix
    multiplications (and so their outputs, the activations) are BF16; the weights stay FP32 and are cast
    on the fly, and autocast keeps numerically sensitive operations (softmax, LayerNorm, the loss) in FP32.

    **Why it is faster.** Two reasons. The tensor cores multiply BF16 at twice their TF32 rate, halving
    the compute floor again. And an activation in BF16 is 2 bytes instead of 4, so memory-bound kernels
    move half the bytes and the saved activations take half the memory.

    **What it costs.** BF16 has FP32's range but only an 8-bit mantissa; keeping master weights, the
    optimizer and reductions in FP32 is what makes this safe without loss scaling (FP16, with its smaller
    range, needs a gradient scaler). GPUs without BF16 (before Ampere) skip this rung.
    """),
    code(r"""
    recipe_change("bf16")
    show(recipes.autocast_context)
    show(runner.train, "autocast")
    measured_effect("bf16")
    if measured("bf16") and measured("tf32"):
        s = value("tf32", "median_step_ms") / value("bf16", "median_step_ms")
        if s < 1.5:
            say(f"The compute floor halved from TF32 to BF16 and the activation bytes with it, yet the step got only "
                f"{s:.2f}x faster. In eager mode the written-out attention's softmax, which autocast keeps in FP32, "
                f"still writes its T×T output at 4 bytes per value and casts it back to BF16 for AV, so the score "
                f"passes, the largest traffic of this rung, shrink by much less than half. The next two rungs attack "
                f"exactly those passes.")
        else:
            say(f"Halving the compute floor and the activation bytes made the step {s:.2f}x faster.")
    """),
    md(r"""
    ### torch_compile: fusion by Inductor

    **What changes.** The model is wrapped in `torch.compile`. On the first step Dynamo traces the Python
    into a graph, and Inductor generates kernels for it (Triton on a GPU).

    **Why it is faster.** Fusion: a chain of elementwise operations and reductions (scale, mask, softmax;
    bias, GELU; residual add and LayerNorm) becomes one kernel that reads its inputs once, keeps the
    intermediates in registers and writes one result, instead of one kernel per operation each reading
    and writing the whole tensor. For a memory-bound step that removes most of the traffic, and it also
    replaces hundreds of launches with tens.

    **What it costs.** Compile time before the first step, paid again whenever a shape changes; a
    less transparent stack to debug; the backward saves what the fused graph decides, usually less.
    """),
    code(r"""
    recipe_change("torch_compile")
    show(recipes.apply_compile)
    measured_effect("torch_compile")
    p = parent("torch_compile")
    if measured("torch_compile") and measured(p) and np.isfinite(value("torch_compile", "compile_s")):
        saved = value(p, "median_step_ms") - value("torch_compile", "median_step_ms")
        if saved > 0:
            steps = value("torch_compile", "compile_s") * 1e3 / saved
            say(f"Compiling took {value('torch_compile', 'compile_s'):.1f} s and saves {saved:.1f} ms per step: "
                f"it pays for itself after about {steps:,.0f} steps. For a short experiment it does not; for a "
                f"training run of thousands of steps it is noise.")
    say(f"The memory model above assumes the score passes drop from {EAGER_SCORE_ACCESSES} (counted, eager) to "
        f"{COMPILED_SCORE_ACCESSES} (assumed, fused); the attention still writes its scores out, and that "
        f"traffic is what the next rung removes.")
    """),
    md(r"""
    ### flash: `F.scaled_dot_product_attention` (FlashAttention)

    **What changes.** The attention layer calls `F.scaled_dot_product_attention(q, k, v, is_causal=True)`
    instead of writing out the scores; PyTorch dispatches it to a FlashAttention kernel on GPUs that
    support one. The recipe sets it through the model's config, and the model's attention branches on it
    (printed below).

    **Why it is faster.** FlashAttention never materializes the T×T scores. It walks over K and V in tiles
    that fit in the chip's on-chip memory, computing each tile's scores, its part of the softmax (an
    online softmax that rescales the running sum as new maxima appear) and its contribution to the output,
    all in one kernel. Backward recomputes the scores tile by tile from Q, K, V and the per-row softmax
    statistics instead of reading them back. The attention's FLOPs change little (backward recomputes the
    scores; the causal mask lets it skip the tiles above the diagonal), but the passes over B·H·T·T values
    counted above all disappear, and with them the memory those tensors held.

    **What it costs.** Nothing in accuracy (the result is exact up to rounding order). It needs a
    supported GPU, dtype and head size, or PyTorch falls back to a slower kernel.
    """),
    code(r"""
    recipe_change("flash")
    show(recipes.apply_attention)
    show(CausalSelfAttention.forward)
    measured_effect("flash")
    p = parent("flash")
    if measured("flash") and measured(p) and np.isfinite(value("flash", "peak_mem_allocated_gib")) \
            and np.isfinite(value(p, "peak_mem_allocated_gib")):
        drop = value(p, "peak_mem_allocated_gib") - value("flash", "peak_mem_allocated_gib")
        one = SCORES * L * (2 if RECIPES["flash"].bf16 else 4) / 2**30
        say(f"Peak memory fell by {drop:.1f} GiB. One {'BF16' if RECIPES['flash'].bf16 else 'FP32'} T×T tensor "
            f"per layer, kept for backward, is {one:.1f} GiB over the {L} layers: the drop is what about "
            f"{drop / one:.1f} of them take.")
    if "flash" in floors.index and p in floors.index:
        say(f"By the memory model, the traffic falls from {floors.at[p, 'total GB']:.0f} GB to "
            f"{floors.at['flash', 'total GB']:.0f} GB per step"
            + (f"; the rung sits against the {BOUND['flash']} floor." if "flash" in BOUND else "."))
    """),
    md(r"""
    ### fused: AdamW in one kernel

    **What changes.** `torch.optim.AdamW(..., fused=True)`.

    **Why it is faster.** The default `foreach` AdamW is a sequence of multi-tensor operations (decay the
    weights, update m, update v, take the square root, divide, add ε, update the weights); each is a pass
    over every parameter, and the intermediates are written out between them. The fused implementation
    does the whole update per value in one kernel over all parameters: read the parameter, gradient, m
    and v once, write the parameter, m and v once. Fewer bytes and far fewer launches.

    **What it costs.** Nothing: the same arithmetic. It needs the parameters on a supported device (CUDA,
    and recently CPU) in floating-point types.
    """),
    code(r"""
    recipe_change("fused")
    show(recipes.apply_optimizer, "adamw", "AdamW", "fused")
    measured_effect("fused")
    p = parent("fused")
    if measured("fused") and measured(p) and SPEC["bandwidth"]:
        predicted = (FOREACH_BYTES - FUSED_BYTES) * N_ALL / SPEC["bandwidth"] * 1e3
        saved = value(p, "median_step_ms") - value("fused", "median_step_ms")
        say(f"The fused update moves {FUSED_BYTES} bytes per parameter instead of {FOREACH_BYTES:.0f}: over "
            f"{N_ALL / 1e6:.0f}M parameters at {SPEC['bandwidth'] / 1e12:.1f} TB/s that is {predicted:.2f} ms per "
            f"step predicted from bytes alone; measured, {saved:.2f} ms. The optimizer is a small part of a "
            f"{value(p, 'median_step_ms'):.0f} ms step at this batch size; its share grows as the batch shrinks.")
    if measured("fused") and measured(p) and value("fused", "compile_s") < 0.5 * value(p, "compile_s"):
        say(f"The fused run compiled in {value('fused', 'compile_s'):.1f} s against {value(p, 'compile_s'):.1f} s for "
            f"{p}, although it compiles the same model (the optimizer is not compiled): a run that follows another "
            f"with the same graphs finds them in Inductor's on-disk cache. Compile times depend on that cache as "
            f"much as on the model.")
    """),
    md(r"""
    ### 8bit: bitsandbytes' AdamW8bit

    **What changes.** The flash rung's optimizer is replaced by `bitsandbytes.optim.AdamW8bit`.

    **Why it can help.** AdamW keeps two states per parameter, m and v, each 4 bytes in FP32: twice the
    model's own size. AdamW8bit stores them in 8 bits each, quantized block by block with a scale per
    block (dynamic quantization), so the states take four times fewer bytes, in memory and in traffic.
    Tensors smaller than 4096 values keep 32-bit states.

    **What it costs.** Quantization error in the optimizer's statistics (small in practice, visible in the
    loss comparison), a third-party CUDA library, and, in the implementation used here, a separate update
    per parameter tensor driven from Python. It is a memory optimization first: it pays when the optimizer
    states are what does not fit, for models of billions of parameters.
    """),
    code(r"""
    recipe_change("8bit")
    show(recipes.apply_optimizer, "bnb", "8bit")
    measured_effect("8bit")
    p = parent("8bit")
    state_saving = N_8BIT * (8 - 2) / 2**30
    if measured("8bit") and measured(p) and np.isfinite(value("8bit", "peak_mem_allocated_gib")):
        drop = value(p, "peak_mem_allocated_gib") - value("8bit", "peak_mem_allocated_gib")
        say(f"Storing m and v in one byte each instead of four saves 6 bytes for each of the {N_8BIT / 1e6:.0f}M "
            f"parameters in large tensors: {state_saving:.2f} GiB predicted. Peak allocated memory fell by "
            f"{drop:.2f} GiB against {p}.")
    if measured("8bit") and measured(p):
        extra = value("8bit", "median_step_ms") - value(p, "median_step_ms")
        n_tensors = len(PARAM_SHAPES)
        if extra > 0:
            say(f"Yet the step is {extra:.1f} ms slower than {p}'s, although the 8-bit update moves fewer bytes "
                f"({EIGHT_BIT_BYTES:.0f} per parameter against {OPTIMIZER_BYTES[RECIPES[p].optimizer]:.0f}). Spread "
                f"over the model's {n_tensors} parameter tensors that is {1e3 * extra / n_tensors:.0f} µs each, the "
                f"order of the Python work and launch of one update per tensor, which is how bitsandbytes' "
                f"optimizers step (a profile would confirm it)."
                + (f" The wider spread of its step times (IQR {value('8bit', 'iqr_step_ms'):.1f} ms against "
                   f"{value(p, 'iqr_step_ms'):.1f} ms) fits the same reading: CPU-side work jitters."
                   if value("8bit", "iqr_step_ms") > 2 * value(p, "iqr_step_ms") else "")
                + f" At {N_ALL / 1e6:.0f}M parameters the states are small, and the trade does not pay in speed; "
                  f"it pays in memory, when memory is the constraint.")
        else:
            say(f"The step is {-extra:.1f} ms faster than {p}'s: the fewer optimizer bytes outweigh the per-tensor updates here.")
    """),
    md(r"""
    ### max: beyond the seven

    **What changes.** The fused rung plus the further changes that measured faster or lighter on an H200,
    did not slow the others down, and keep the model's mathematics (bf16 rounding aside): the vocabulary padded to 50,304 rows, a
    cross-entropy that never holds the whole B×T×vocab logits and whose softmax gradient is one hand-written
    kernel (CUDA, compiled when first used by NVRTC; Triton where NVRTC is missing), the next batch copied
    on a side stream, losses and timings read back every 10 steps
    instead of every step, CUDA graphs (`torch.compile`'s `reduce-overhead` mode), a residual stream
    kept in bf16, the MLP's bias and GELU applied by cuBLASLt as its GEMMs store their outputs
    (forward, and GELU's derivative backward), the gradient clip and AdamW as two Triton kernels over
    all parameters, attention called through cuDNN's graph API on the packed QKV tensor, and c_attn's and
    c_fc's bias gradients taken from their weight-gradient GEMMs. `make ablation` runs each addition alone on the fused rung, together with the ones that
    were tried and left out: the chunked loss as Inductor compiles it, cuDNN attention, FP8 matmuls, a
    compiled optimizer step and the gradient clip folded into fused AdamW.

    **Why it can help.** Each addition removes a different cost: the padded vocabulary gives the largest
    GEMM aligned tiles; the chunked loss removes the logits' memory footprint (1.6 GB at batch 16), and its
    kernel stages each row of logits in shared memory, so it reads them once where the compiled version
    reads them three times; the bf16 residual
    stream halves the bytes of every residual add and LayerNorm; the GEMM epilogues remove two passes
    over the MLP's tokens × 3072 activations per layer (GELU forward, and its derivative backward); the
    Triton update applies the clip factor as it reads each gradient, so the clip's own read-and-write pass
    over 124M fp32 gradients is gone; cuDNN writes the attention's q, k and v gradients straight into the
    QKV projection's packed gradient, where SDPA's three tensors had to be copied into it; a column of ones
    stored beside c_attn's and c_fc's inputs makes their bias gradients one more column of the
    weight-gradient GEMMs (dY^T [X 1]), so no pass sums the output gradients over the tokens; prefetch,
    deferred read-back and CUDA graphs remove the time the GPU waits on the host.
    """),
    code(r"""
    recipe_change("max")
    show(recipes.apply_loss)
    show(recipes.apply_mlp)
    show(recipes.apply_attention)
    show(recipes.apply_bias_grad)
    show(recipes.make_update)
    measured_effect("max")
    if os.path.exists(ABLATION_RESULTS):
        abl_steps, abl_runs = plot_results.load(ABLATION_RESULTS)
        abl = plot_results.summarize(abl_steps, abl_runs)
        # Each addition against the fused runs made by the same commit, in the same call: GPU speed drifts
        # between calls and machines by about as much as some additions gain.
        commit = abl_runs.set_index("run_id")["git_commit"]
        ok_runs = abl_runs[abl_runs["status"] == "ok"]
        fused_ms = ok_runs[ok_runs["optimization"] == "fused"].groupby("git_commit")["median_step_ms"].mean()
        if len(fused_ms):
            rows = {}
            for r in abl.index:
                ref = fused_ms.get(commit[abl.at[r, "run_id"]]) if r != "fused" else None
                if abl.at[r, "status"] != "ok" or (r != "fused" and ref is None):
                    continue
                rows[r] = {"median ms": abl.at[r, "median_step_ms"],
                           "vs fused": abl.at[r, "median_step_ms"] / ref - 1 if ref else None,
                           "fused ms, same commit": ref,
                           "peak alloc GiB": abl.at[r, "peak_mem_allocated_gib"],
                           "in max": r.split("+", 1)[-1] in recipes.MAX_PICKS if r != "fused" else None}
            print(f"{rel(ABLATION_RESULTS)}: each addition alone on the fused rung, against the mean of the fused "
                  f"runs made by the same commit:")
            display(pd.DataFrame.from_dict(rows, orient="index").round(3))
            # Step-time IQRs of these runs are 0.3-1.5 ms: under about 1.3% a difference is noise.
            slower = [r for r, v in rows.items() if r != "fused" and v["vs fused"] > 0.013]
            if slower:
                say(f"Slower than the fused rung on their own, beyond the runs' spread: {', '.join(slower)}.")
    else:
        say(f"{rel(ABLATION_RESULTS)} is absent: `make ablation` recorded there shows each addition alone.")
    """),
    md(r"""
    ## Did any rung change the learning?

    Every rung trains the same model on the same batches in the same order from the same seed, so the loss
    curves should lie on top of each other, up to rounding differences that grow over the steps. A rung
    whose loss drifts away from the baseline's by more than the batch-to-batch variation would be
    changing what is learned, not just how fast. A longer run says more than the last steps of a short one:
    the 300-step set is used when it exists.
    """),
    code(r"""
    if "baseline" in OK:
        rows = {}
        for rung in OK:
            gap, spread = loss_tracking(rung)
            rows[rung] = {"final loss": value(rung, "final_loss"),
                          "vs baseline": value(rung, "final_loss") - value("baseline", "final_loss"),
                          "mean |Δ| last 10 steps": gap, "baseline std last 10 steps": spread}
        drift = pd.DataFrame.from_dict(rows, orient="index")
        display(drift.round(3))
        wide = [r for r in drift.index if drift.at[r, "mean |Δ| last 10 steps"] > drift.at[r, "baseline std last 10 steps"]]
        say("Every rung follows the baseline's loss more closely than the loss itself varies from batch to batch."
            if not wide else f"{', '.join(wide)} differ from the baseline by more than its batch-to-batch variation: "
            "look at their loss curves below before trusting their speedups.")
    else:
        say("No usable baseline run: no loss comparison.")

    if os.path.exists(LOSS_RESULTS):
        loss_steps, loss_runs = plot_results.load(LOSS_RESULTS)
        loss_report = plot_results.build_report(loss_steps, loss_runs)
        tail = pd.Series({rung: g.sort_values("step")["loss"].tail(50).mean()
                          for rung, g in loss_report.steps.groupby("optimization")})
        tail = tail.reindex(plot_results.rung_order(tail.index))
        print(f"{rel(LOSS_RESULTS)}: {loss_report.context}; mean loss over each run's last 50 steps:")
        frame = pd.DataFrame({"mean loss, last 50 steps": tail})
        if "baseline" in tail.index:
            frame["vs baseline"] = tail - tail["baseline"]
        display(frame.round(4))
        buf = io.BytesIO()
        plot_results.plot_loss(loss_report).savefig(buf, format="png", dpi=90)
        display(Image(buf.getvalue()))
    else:
        say(f"{rel(LOSS_RESULTS)} is absent: the comparison above rests on the last steps of the short runs. "
            "A 300-step run of every rung, recorded there, would show whether the small differences grow.")
    """),
    md(r"""
    ## A larger batch

    Overhead is paid per step and compute and memory per token, so a larger batch dilutes the overhead:
    rungs that removed overhead gain less, rungs that removed traffic or FLOPs keep their gain. The batch-64
    set is compared here when it exists.
    """),
    code(r"""
    if os.path.exists(BATCH64_RESULTS) and os.path.realpath(BATCH64_RESULTS) != os.path.realpath(RESULTS):
        b64_steps, b64_runs = plot_results.load(BATCH64_RESULTS)
        b64 = plot_results.summarize(b64_steps, b64_runs)
        both = pd.DataFrame({
            f"speedup, batch {B}": table["speedup"],
            "speedup, batch 64": b64["speedup"],
            f"tokens/s, batch {B}": table["tokens_per_s"],
            "tokens/s, batch 64": b64["tokens_per_s"],
            f"peak alloc GiB, batch {B}": table["peak_mem_allocated_gib"],
            "peak alloc GiB, batch 64": b64["peak_mem_allocated_gib"],
        })
        both = both.reindex(plot_results.rung_order(both.index))
        print(f"{rel(BATCH64_RESULTS)}:")
        display(both.round({c: (0 if c.startswith("tokens") else 2) for c in both.columns}))
        for rung in both.index:
            a, b = both.at[rung, f"tokens/s, batch {B}"], both.at[rung, "tokens/s, batch 64"]
            if np.isfinite(a) and np.isfinite(b):
                say(f"{rung}: batch 64 runs {b / a:.2f}x the tokens per second of batch {B}.")
            elif rung in b64.index and not np.isfinite(b):
                say(f"{rung} at batch 64: {b64.at[rung, 'status']}"
                    + (f" ({b64.at[rung, 'message']})" if b64.at[rung, "message"] else ""))
    else:
        say(f"{rel(BATCH64_RESULTS)} is absent: no batch-64 comparison. Recording `make all BATCH_SIZE=64` into "
            "that folder adds it here.")
    """),
    md(r"""
    ## The charts

    The figures `plot_results.py` writes next to the results, drawn here from the same report.
    """),
    code(r"""
    for name, plot in plot_results.CHARTS.items():
        buf = io.BytesIO()
        plot(report).savefig(buf, format="png", dpi=90)
        display(Image(buf.getvalue()))
    """),
    md(r"""
    ## A short guide

    **What to try first.**

    * **Any NVIDIA GPU from Ampere on (A100, H100, H200, RTX 30 and 40 series): BF16 autocast**, with TF32
      switched on for whatever stays FP32. It is a few lines, it halves activation memory, and it moves the
      matrix multiplications to the tensor cores at their fastest rate.
    * **Then FlashAttention** through `F.scaled_dot_product_attention`: one call in place of four lines,
      no accuracy cost, and the saving grows with the sequence length (the scores grow with its square).
    * **Then torch.compile**, once the code is stable and runs are long enough to repay the compile time:
      it turns chains of memory-bound operations into single kernels.
    * **Fused AdamW** is free: always switch it on where it is supported.
    * **8-bit AdamW** is for memory, not speed: use it when the optimizer states are what does not fit.

    **When an optimization does not pay.**

    * **Small models or small batches.** When each kernel takes less time than the CPU needs to launch it,
      the GPU waits on Python: faster kernels change nothing. Larger batches, `torch.compile` (fewer, larger
      kernels) and CUDA graphs (`mode="reduce-overhead"`, replaying a whole compiled graph with one launch) help there;
      precision does not.
    * **CPU-bound loops.** Data loading or tokenization in the training loop, `.item()` calls that
      synchronize every step, logging: the GPU idles whatever the kernels do. Profile before optimizing.
    * **GPUs without BF16 or TF32 (before Ampere: V100, T4).** TF32 does nothing there and BF16 is not
      supported; FP16 autocast with a gradient scaler takes BF16's place.
    * **Short runs with torch.compile**: compile time can exceed the time saved (see the break-even above).
    * **Steps that already sit against the compute floor at low precision**: from there only fewer FLOPs
      help (a smaller model, less recomputation), not more fusion.

    The measured ladder on this machine, rung by rung, in one line each:
    """),
    code(r"""
    for rung in OK:
        p = parent(rung)
        if p is None:
            step = "the reference"
        elif measured(p):
            step = f"{value(p, 'median_step_ms') / value(rung, 'median_step_ms'):.2f}x over {p}"
        else:
            step = f"(its predecessor, {p}, not measured)"
        bound = f", against the {BOUND[rung]} floor" if rung in BOUND else ""
        print(f"{rung:14s} {value(rung, 'median_step_ms'):8.1f} ms  {step}{bound}")
    gains = {r: value(parent(r), "median_step_ms") / value(r, "median_step_ms")
             for r in OK if parent(r) and measured(parent(r))}
    if gains:
        best = max(gains, key=gains.get)
        say(f"On {GPU}, the single largest step up the ladder was {best} ({gains[best]:.2f}x over {parent(best)}).")
    """),
]


def build():
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    # Stable cell ids keep the committed file's diffs to what changed.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def execute(nb, cwd=HERE, env=None, timeout=CELL_TIMEOUT_S):
    """Run every cell of `nb` in a fresh python3 kernel started in `cwd`; the outputs are stored in nb.

    `env` is the kernel's whole environment (this process's when None): RESULTS there chooses the
    results folder. Raises nbclient.exceptions.CellExecutionError at the first cell that fails."""
    from nbclient import NotebookClient
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": cwd}})
    client.execute(env=dict(os.environ if env is None else env))
    return nb


def main(argv=None):
    parser = argparse.ArgumentParser(description="Build notebooks/Optimizing_GPU_Utilization.ipynb and "
                                                 "execute it in place (saved with its outputs).")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    parser.add_argument("--results", help="results folder to read (default: $RESULTS, else results/h200-b16)")
    parser.add_argument("--output", default=NOTEBOOK, help="where to write the notebook")
    args = parser.parse_args(argv)
    results = args.results or os.environ.get("RESULTS")
    if results and not args.no_execute:
        candidates = (results, os.path.join(REPO, results))
        found = next((p for p in candidates if os.path.isfile(os.path.join(p, "results.csv"))), None)
        if found is None:
            print(f"error: RESULTS={results} holds no results.csv: point it at a folder that make all wrote into",
                  file=sys.stderr)
            return 2
        args.results = found
    nb = build()
    if not args.no_execute:
        env = {**os.environ, "RESULTS": os.path.abspath(args.results)} if args.results else None
        execute(nb, env=env)
    nbformat.validate(nb)
    nbformat.write(nb, args.output)
    print(f"wrote {args.output}" + ("" if args.no_execute else " with its outputs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
