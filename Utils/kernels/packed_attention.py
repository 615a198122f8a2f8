"""Causal self-attention on the QKV projection's packed output, with cuDNN writing one packed gradient.

The model's QKV projection writes q, k and v side by side in one [B, T, 3C] tensor, and its backward
wants their gradient as one [B, T, 3C] tensor too. SDPA reads q, k and v in place, as strided views, but
returns dq, dk and dv as three new tensors, which the compiled backward then copies into the packed
gradient: 75 MB read and 75 MB written per layer at batch 16, 0.3 GB each way at 64. Called through cuDNN's graph API
(nvidia-cudnn-frontend), cuDNN's attention kernels, the same ones SDPA's cuDNN backend runs, read q, k, v
at their offsets in the packed tensor and write dq, dk, dv at theirs in the packed gradient: no copy.

gpt_suite::packed_attention and ::packed_attention_backward are PyTorch operators, so torch.compile and
CUDA graphs see them as opaque calls. On a GPU that cuDNN's frontend can drive they run cuDNN; elsewhere,
the same mathematics in PyTorch operations (the backward from the saved output and log-sum-exp, as a
FlashAttention backward computes it). `reference` is causal attention as the model writes it out.
"""
import functools
import math
import warnings

import torch
from torch import Tensor

DTYPES = (torch.bfloat16, torch.float16)   # what cuDNN's fused attention takes
MAX_HEAD_DIM = 128                          # the largest head its fused kernels take, in multiples of 8


def layout(batch: int, seq_len: int, n_head: int, head_dim: int) -> dict:
    """cuDNN's [B, H, T, D] dims and strides for the packed q, k, v (and their gradients), for the output
    and its gradient ([B, T, C] in memory), and for the [B, H, T, 1] log-sum-exp; and the offsets of q, k
    and v in the packed tensor, in elements."""
    C = n_head * head_dim
    return {
        "dims": [batch, n_head, seq_len, head_dim],
        "packed": [seq_len * 3 * C, head_dim, 3 * C, 1],
        "flat": [seq_len * C, head_dim, C, 1],
        "stats_dims": [batch, n_head, seq_len, 1],
        "stats": [n_head * seq_len, seq_len, 1, 1],
        "offsets": (0, C, 2 * C),
    }


def _acc(dtype):
    """The reference's arithmetic and lse dtype: fp32, or the input's if wider (float64 in the tests)."""
    return torch.promote_types(dtype, torch.float32)


def _split(qkv, n_head):
    """q, k, v as [B, H, T, D] tensors in the reference's dtype."""
    B, T, C3 = qkv.shape
    return qkv.to(_acc(qkv.dtype)).view(B, T, 3, n_head, C3 // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)


def _scores(q, k):
    """q k^T / sqrt(D), the future masked out with -inf."""
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return ((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))).masked_fill(future, float("-inf"))


def _reference_forward(qkv, n_head):
    q, k, v = _split(qkv, n_head)
    scores = _scores(q, k)
    lse = torch.logsumexp(scores, dim=-1)
    y = torch.exp(scores - lse[..., None]) @ v
    B, T, C3 = qkv.shape
    return y.transpose(1, 2).reshape(B, T, C3 // 3).to(qkv.dtype), lse


def _reference_backward(grad, qkv, y, lse, n_head):
    q, k, v = _split(qkv, n_head)
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    dy = grad.to(q.dtype).view(B, T, n_head, D).transpose(1, 2)
    out = y.to(q.dtype).view(B, T, n_head, D).transpose(1, 2)
    p = torch.exp(_scores(q, k) - lse[..., None])   # the softmax, rebuilt from its log-sum-exp
    dv = p.transpose(-2, -1) @ dy
    dp = dy @ v.transpose(-2, -1)
    # Softmax's backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dy * out).
    ds = p * (dp - (dy * out).sum(-1, keepdim=True)) / math.sqrt(D)
    dq, dk = ds @ k, ds.transpose(-2, -1) @ q
    return torch.stack([dq, dk, dv], dim=2).permute(0, 3, 2, 1, 4).reshape(B, T, C3).to(qkv.dtype)


@torch.library.custom_op("gpt_suite::packed_attention", mutates_args=())
def packed_attention_fwd(qkv: Tensor, n_head: int) -> tuple[Tensor, Tensor]:
    """(y, lse) of causal attention over qkv [B, T, 3C] (q, k, v side by side): y [B, T, C] in qkv's dtype,
    lse [B, H, T] in fp32 (float64 for float64 qkv), each query's log-sum-exp of its scaled scores, which the
    backward needs."""
    return _reference_forward(qkv, n_head)


@packed_attention_fwd.register_fake
def _(qkv, n_head):
    B, T, C3 = qkv.shape
    return qkv.new_empty(B, T, C3 // 3), qkv.new_empty(B, n_head, T, dtype=_acc(qkv.dtype))


@torch.library.custom_op("gpt_suite::packed_attention_backward", mutates_args=())
def packed_attention_backward(grad: Tensor, qkv: Tensor, y: Tensor, lse: Tensor, n_head: int) -> Tensor:
    """The gradient with respect to qkv [B, T, 3C], packed as qkv is, given grad = dloss/dy [B, T, C]."""
    return _reference_backward(grad, qkv, y, lse, n_head)


@packed_attention_backward.register_fake
def _(grad, qkv, y, lse, n_head):
    return torch.empty_like(qkv)


def _setup_context(ctx, inputs, output):
    qkv, n_head = inputs
    y, lse = output
    ctx.save_for_backward(qkv, y, lse)
    ctx.mark_non_differentiable(lse)   # saved for the backward; the loss does not depend on it
    ctx.n_head = n_head


def _backward(ctx, grad_y, grad_lse):
    qkv, y, lse = ctx.saved_tensors
    return packed_attention_backward(grad_y.contiguous(), qkv, y, lse, ctx.n_head), None


packed_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def packed_attention(qkv: Tensor, n_head: int) -> Tensor:
    """Causal attention of the heads packed in qkv [B, T, 3C]: y [B, T, C], differentiable in qkv."""
    return packed_attention_fwd(qkv.contiguous(), n_head)[0]


def reference(qkv: Tensor, n_head: int) -> Tensor:
    """What packed_attention computes: causal attention with the T x T scores written out, autograd's
    gradient, in qkv's dtype (computed in fp32 at least)."""
    q, k, v = _split(qkv, n_head)
    y = torch.softmax(_scores(q, k), dim=-1) @ v
    B, T, C3 = qkv.shape
    return y.transpose(1, 2).reshape(B, T, C3 // 3).to(qkv.dtype)


# --- cuDNN's fused attention, through its frontend: reads q, k and v at their offsets in the packed QKV
# tensor and writes dq, dk and dv at theirs in one packed gradient, so that no copy gathers the three
# gradients into the tensor the QKV projection's backward reads.

@functools.cache
def _frontend():
    try:
        import cudnn
        return cudnn
    except Exception:   # not installed, or its library will not load
        return None


_failure = None   # why cuDNN could not run a small graph here (prepare), if it could not


def unavailable(device: torch.device, head_dim: int) -> str | None:
    """None where cuDNN runs the packed operators on this device, else why not."""
    if _available(device, head_dim):
        return None
    return _failure or "packed attention needs cuDNN 9 and its frontend on an Ampere or newer GPU"


def cudnn_unavailable(device: torch.device) -> str | None:
    """None where cuDNN's fused attention (SDPA's cuDNN backend) runs on this device, else why not."""
    return None if _cudnn_fused_attention(device) else "cuDNN attention is not available here"


def _cudnn_fused_attention(device):
    """Whether cuDNN has its fused attention kernels here: on Ampere and newer GPUs, from cuDNN 9 on."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 8 and torch.backends.cudnn.version() >= 90000)


def _available(device, head_dim):
    """Whether cuDNN runs these operators here: its fused attention and its frontend, a head size that the
    fused attention takes, and no failure seen by prepare()."""
    return (_failure is None and _cudnn_fused_attention(device) and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and _frontend() is not None)


def _probe(device, head_dim):
    qkv = torch.randn(1, 64, 3 * 2 * head_dim, device=device, dtype=torch.bfloat16)
    y, lse = packed_attention_fwd(qkv, 2)
    packed_attention_backward(y, qkv, y, lse, 2)
    torch.cuda.synchronize(device)


def prepare(device: torch.device, head_dim: int) -> str | None:
    """Build and run a small forward and backward graph now, before any CUDA graph is captured. Returns None,
    or a note saying why cuDNN cannot run them here (its library older than its frontend needs, a GPU its
    kernels do not cover), after which unavailable() says so and the ladder runs SDPA instead."""
    global _failure
    if device.type != "cuda" or not _available(device, head_dim):
        return None
    try:
        _probe(device, head_dim)
    except Exception as e:   # cuDNN refuses the graph, or cannot build or run its kernels
        _failure = f"cuDNN could not run the packed attention here ({type(e).__name__}: {str(e)[:200]})"
        _cudnn_ok.cache_clear()
        return _failure
    return None


@functools.cache
def _cudnn_ok(index, head_dim):
    # Asked on every call: the answer cannot change within a run, and asking costs several driver queries.
    return _available(torch.device("cuda", index), head_dim)


def _takes(qkv, n_head):
    return qkv.dtype in DTYPES and qkv.is_contiguous() and _cudnn_ok(qkv.device.index, qkv.size(-1) // (3 * n_head))


def _slow_path(qkv):
    warnings.warn(f"packed attention on {qkv.device} with {qkv.dtype} {tuple(qkv.shape)} input: cuDNN cannot take "
                  f"it, so the PyTorch reference runs, which holds every T x T score in memory; use bf16 autocast")


@functools.cache
def _handle(index):
    with torch.cuda.device(index):
        return _frontend().create_handle()


@functools.cache
def _graph(index, backward, batch, seq_len, n_head, head_dim, dtype):
    """(graph, its tensors by name), built once per shape: cuDNN's heuristics choose the kernels."""
    cudnn = _frontend()
    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
    f32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=_handle(index))
    lay = layout(batch, seq_len, n_head, head_dim)
    t = {name: g.tensor(name=name, dim=lay["dims"], stride=lay["packed"], data_type=io) for name in "qkv"}
    scale = 1.0 / math.sqrt(head_dim)
    if not backward:
        o, lse = g.sdpa(name="attention", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=scale,
                        use_causal_mask=True)
        o.set_output(True).set_dim(lay["dims"]).set_stride(lay["flat"]).set_data_type(io)
        lse.set_output(True).set_dim(lay["stats_dims"]).set_stride(lay["stats"]).set_data_type(f32)
        t.update(o=o, lse=lse)
    else:
        t["o"] = g.tensor(name="o", dim=lay["dims"], stride=lay["flat"], data_type=io)
        t["do"] = g.tensor(name="do", dim=lay["dims"], stride=lay["flat"], data_type=io)
        t["lse"] = g.tensor(name="lse", dim=lay["stats_dims"], stride=lay["stats"], data_type=f32)
        grads = g.sdpa_backward(name="attention_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"],
                                stats=t["lse"], attn_scale=scale, use_causal_mask=True)
        for name, tensor in zip(("dq", "dk", "dv"), grads):
            tensor.set_output(True).set_dim(lay["dims"]).set_stride(lay["packed"]).set_data_type(io)
            t[name] = tensor
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t


def _execute(index, backward, shape, dtype, pointers):
    # The tensors' device made current: a custom operator's kernel gets no device guard of its own.
    with torch.cuda.device(index):
        g, tensors = _graph(index, backward, *shape, dtype)
        workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=f"cuda:{index}")
        cudnn = _frontend()
        # The current stream, which is the capturing one inside a CUDA graph: cuDNN's kernels join it.
        cudnn.set_stream(handle=_handle(index), stream=torch.cuda.current_stream(index).cuda_stream)
        g.execute({tensors[name]: pointer for name, pointer in pointers.items()}, workspace, handle=_handle(index))


def _packed_pointers(qkv, names):
    step = qkv.element_size()
    return {name: qkv.data_ptr() + offset * step
            for name, offset in zip(names, layout(1, 1, 1, qkv.size(-1) // 3)["offsets"])}


@packed_attention_fwd.register_kernel("cuda")
def _(qkv, n_head):
    if not _takes(qkv, n_head):
        _slow_path(qkv)
        return _reference_forward(qkv, n_head)
    B, T, C3 = qkv.shape
    y = qkv.new_empty(B, T, C3 // 3)
    lse = qkv.new_empty(B, n_head, T, dtype=torch.float32)
    _execute(qkv.device.index, False, (B, T, n_head, C3 // (3 * n_head)), qkv.dtype,
             {**_packed_pointers(qkv, "qkv"), "o": y.data_ptr(), "lse": lse.data_ptr()})
    return y, lse


@packed_attention_backward.register_kernel("cuda")
def _(grad, qkv, y, lse, n_head):
    if not (_takes(qkv, n_head) and grad.is_contiguous() and y.is_contiguous() and lse.is_contiguous()):
        _slow_path(qkv)
        return _reference_backward(grad, qkv, y, lse, n_head)
    B, T, C3 = qkv.shape
    dqkv = torch.empty_like(qkv)
    _execute(qkv.device.index, True, (B, T, n_head, C3 // (3 * n_head)), qkv.dtype,
             {**_packed_pointers(qkv, "qkv"), **_packed_pointers(dqkv, ("dq", "dk", "dv")),
              "o": y.data_ptr(), "do": grad.data_ptr(), "lse": lse.data_ptr()})
    return dqkv
