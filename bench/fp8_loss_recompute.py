"""Times the FP8 output layer's logits without the logits: the two Triton GEMMs below against what `max` runs for one
chunk of the loss (Utils.kernels.fp8_loss), the question being whether recomputing the logits' GEMM beats storing
them and reading them back.

`max` today, a chunk of 16,384 tokens at 124M (results/h100-profile-b64/logs/kernels.txt, µs): the logits' GEMM
writing bf16 logits (1,142), the loss kernel's CUDA pass reading them once and writing the e5m2 gradient row-major
(817), the transpose of that gradient (608). Here instead:
- `_lse_kernel`: the same GEMM, whose epilogue keeps of each 128 x 256 tile only each row's maximum and sum of
  exponentials (and the target's logit, in the tile that holds it): no logits written. A few torch operations
  then make each row's log-sum-exp and loss from the tiles' partial sums.
- `_grad_kernel`: the same GEMM again, whose epilogue writes (softmax - one-hot) * GRAD_SCALE in e5m2 from the fp32
  accumulator, row-major and transposed (the layouts the two gradient GEMMs read), each through a TMA store.
The logits are computed twice in fp32 and never rounded to bf16, so the gradient is, if anything, nearer the exact
one than `max`'s. Each form is checked against the fp32 reference (loss, gradient) and the transposed gradient
against the row-major one, byte for byte. Times are of each form replayed as a CUDA graph.

    python3 bench/fp8_loss_recompute.py            # 124M b64, gpt2-medium b16, gpt2-xl b8
"""
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.dgelu_fp8_blocks import relative  # noqa: E402
from bench.fp8_head_gemm import logits_tile  # noqa: E402   (the logits' GEMM tile, GROUP_M row tiles walked together)
from bench.gelu_epilogue import bench  # noqa: E402
from bench.packed_attention import graphed  # noqa: E402
from Utils.kernels import fp8, fp8_loss, loss_kernel  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402

VOCAB = 50257
# (model, rows of one chunk, chunks a step): fp8_loss.CHUNK_ROWS tokens a chunk, or the whole step where it is less
SIZES = [("gpt2", 16384, 4), ("gpt2-medium", 16384, 1), ("gpt2-xl", 8192, 1)]
CONFIGS = [dict(BM=128, BN=256, BK=128, stages=3, warps=8, ws=ws, group_m=g) for ws in (True, False) for g in (32, 128)]
CONFIGS += [dict(BM=128, BN=128, BK=128, stages=4, warps=8, ws=ws, group_m=128) for ws in (True, False)]


@triton.jit
def _lse_kernel(a_desc, b_desc, scale_ptr, targets_ptr, m_ptr, s_ptr, tgt_ptr, M, N, K, vocab_size,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                WS: tl.constexpr):
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    scale = tl.load(scale_ptr)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
        acc, om, on = logits_tile(a_desc, b_desc, tile_id, num_pid_m, num_pid_n, K, BM, BN, BK, GROUP_M)
        rows, cols = om + tl.arange(0, BM), on + tl.arange(0, BN)
        # Padded columns take no part; every tile holds some real ones (the launcher checks).
        x = tl.where(cols[None, :] < vocab_size, acc * scale, float("-inf"))
        top = tl.max(x, 1)
        in_rows = rows < M
        tl.store(m_ptr + rows * num_pid_n + on // BN, top, mask=in_rows)
        tl.store(s_ptr + rows * num_pid_n + on // BN, tl.sum(tl.exp(x - top[:, None]), 1), mask=in_rows)
        target = tl.load(targets_ptr + rows, mask=in_rows, other=-1)
        hit = tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), 1)
        tl.store(tgt_ptr + rows, hit, mask=in_rows & (target >= on) & (target < on + BN))


@triton.jit
def _grad_kernel(a_desc, b_desc, g_desc, gt_desc, scale_ptr, lse_ptr, targets_ptr, M, N, K, vocab_size, grad_scale,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PROGRAMS: tl.constexpr, WS: tl.constexpr):
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    scale = tl.load(scale_ptr)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
        acc, om, on = logits_tile(a_desc, b_desc, tile_id, num_pid_m, num_pid_n, K, BM, BN, BK, GROUP_M)
        rows, cols = om + tl.arange(0, BM), on + tl.arange(0, BN)
        lse = tl.load(lse_ptr + rows, mask=rows < M, other=0.0)
        target = tl.load(targets_ptr + rows, mask=rows < M, other=-1)
        p = tl.where(cols[None, :] < vocab_size, tl.exp(acc * scale - lse[:, None]), 0.0)   # padded columns: zero
        g = ((p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * grad_scale).to(tl.float8e5)
        g_desc.store([om, on], g)
        gt_desc.store([on, om], tl.trans(g))   # through shared memory: whole rows of the transposed tile


def recompute(h8, h_inv, w8, w_inv, targets, vocab_size, grad, grad_t, BM, BN, BK, stages, warps, ws, group_m):
    """A function running both kernels and the log-sum-exp between them for one chunk, writing grad [M, N] and
    grad_t [N, M] (a view of the buffer for all tokens) and returning each row's loss."""
    M, K = h8.shape
    N = w8.size(0)
    num_pid_n = triton.cdiv(N, BN)
    if (num_pid_n - 1) * BN >= vocab_size:
        raise ValueError(f"a tile of {BN} columns would hold only padding (vocabulary {vocab_size} of {N})")
    a, b = TensorDescriptor.from_tensor(h8, [BM, BK]), TensorDescriptor.from_tensor(w8, [BN, BK])
    g, gt = TensorDescriptor.from_tensor(grad, [BM, BN]), TensorDescriptor.from_tensor(grad_t, [BN, BM])
    scale = (h_inv * w_inv).reshape(1)
    m, s = (torch.empty(M, num_pid_n, device=h8.device) for _ in range(2))
    target_logit, lse = torch.empty(M, device=h8.device), torch.empty(M, device=h8.device)
    programs = min(torch.cuda.get_device_properties(h8.device).multi_processor_count, triton.cdiv(M, BM) * num_pid_n)
    shape = dict(BM=BM, BN=BN, BK=BK, GROUP_M=group_m, PROGRAMS=programs, WS=ws, num_stages=stages, num_warps=warps)
    row_loss = torch.empty(M, device=h8.device)

    def run():
        _lse_kernel[(programs,)](a, b, scale, targets, m, s, target_logit, M, N, K, vocab_size, **shape)
        top = m.amax(1, keepdim=True)
        torch.add(top.squeeze(1), (s * torch.exp(m - top)).sum(1).log(), out=lse)
        torch.sub(lse, target_logit, out=row_loss)
        _grad_kernel[(programs,)](a, b, g, gt, scale, lse, targets, M, N, K, vocab_size, fp8_loss.GRAD_SCALE,
                                  **shape)
    return run, row_loss


def one_chunk(rows: int, width: int) -> tuple[dict, dict]:
    """(µs of each form for one chunk, the errors)."""
    torch.manual_seed(0)
    n_cols = loss_kernel.kernel_logits_width(VOCAB)
    h8, h_inv = fp8.to_e4m3(torch.randn(rows, width, device="cuda"))
    w8, w_inv = fp8.to_e4m3(torch.nn.functional.pad(torch.randn(VOCAB, width, device="cuda") * 0.02,
                                                    (0, 0, 0, n_cols - VOCAB)))
    targets = torch.randint(0, VOCAB, (rows,), device="cuda")
    # The fp32 reference from the same FP8 operands.
    logits = (h8.float() * h_inv) @ (w8.float() * w_inv)[:VOCAB].t()
    ref_loss = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    ref_grad = torch.softmax(logits, 1)
    ref_grad[torch.arange(rows), targets] -= 1
    del logits
    times, errors = {}, {}

    # What max runs: the GEMM writing bf16 logits, then the loss kernel's pass and the transpose.
    out = torch.empty(rows, n_cols, dtype=torch.bfloat16, device="cuda")
    grad = torch.empty(rows, n_cols, dtype=fp8.E5M2, device="cuda")
    grad_t = torch.empty(n_cols, 2 * rows, dtype=fp8.E5M2, device="cuda")[:, rows:]   # a chunk of the whole buffer
    row_loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")

    def stored():
        torch._scaled_mm(h8, w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=torch.bfloat16, use_fast_accum=True,
                         out=out)
        fp8_loss._softmax_grad_fp8(out, targets, VOCAB, row_loss, lse, grad, grad_t)
    stored()
    errors["max: loss"] = relative(row_loss, ref_loss)
    errors["max: gradient"] = relative(grad[:, :VOCAB].float() / fp8_loss.GRAD_SCALE, ref_grad)
    times["max"] = bench(graphed(stored))

    best = None
    for cfg in CONFIGS:
        grad.zero_()
        grad_t.zero_()
        try:
            run, loss = recompute(h8, h_inv, w8, w_inv, targets, VOCAB, grad, grad_t, **cfg)
            run()
            us = bench(graphed(run))
        except Exception as e:   # a configuration that does not fit or compile
            print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            continue
        err = (relative(loss, ref_loss), relative(grad[:, :VOCAB].float() / fp8_loss.GRAD_SCALE, ref_grad),
               int((grad_t.t().view(torch.uint8) != grad.view(torch.uint8)).sum()))
        print(f"  {us:8.1f} µs  loss {err[0]:.1e}  gradient {err[1]:.4f}  transposed bytes off {err[2]}  {cfg}",
              flush=True)
        if best is None or us < best[0]:
            best = (us, cfg, err)
    if best:
        times["recomputed"] = best[0]
        errors["recomputed: loss"], errors["recomputed: gradient"], errors["transposed bytes off"] = best[2]
        print(f"  best {best[1]}", flush=True)
    return times, errors


def main() -> int:
    why = fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why or torch.cuda.get_device_capability() < (9, 0):
        sys.exit(f"error: this benchmark needs a Hopper GPU for its TMA descriptors "
                 f"({why or torch.cuda.get_device_name()})")
    print(torch.__version__, "Triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    failed = False
    for model, rows, chunks in SIZES:
        width = PRESETS[model].n_embd
        print(f"{model}, a chunk of {rows} tokens x {width}:", flush=True)
        times, errors = one_chunk(rows, width)
        lever = times["max"] - times.get("recomputed", float("nan"))
        print(f"{model:12} max {times['max']:8.1f} µs  recomputed {times.get('recomputed', float('nan')):8.1f} µs  "
              f"lever {lever:7.1f} µs a chunk, {lever * chunks / 1000:.2f} ms a step", flush=True)
        print("  errors: " + ", ".join(f"{k} {v:.4g}" for k, v in errors.items()), flush=True)
        # The recomputed form must be no further from the reference than max's, and its two layouts the same bytes.
        failed |= not (errors.get("transposed bytes off", 1) == 0
                       and errors.get("recomputed: gradient", 1) <= errors["max: gradient"] * 1.05 + 1e-4
                       and errors.get("recomputed: loss", 1) <= errors["max: loss"] * 1.05 + 1e-5)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
