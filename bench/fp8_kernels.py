"""Times the pieces of Utils.kernels.fp8_loss on a GPU, one chunk at a time (4,096 tokens x 50,304 logits,
as the max rung makes them): the two Triton kernels at several launch shapes against a copy of the same
bytes; the CUDA pass that replaces them (one read of the logits, the gradient row-major) and the transpose
after it, at several tile shapes; the CUDA loss kernel of the bf16 path; and the three FP8 GEMMs and the
casts at batch 16. Every launch shape's output must equal the module's own (the same arithmetic, in another
order of tiles), and the CUDA pass's the Triton kernels' within one FP8 step; the script exits non-zero
where one does not.

    python3 bench/fp8_kernels.py
"""
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import chunked_loss, fp8, fp8_loss, loss_kernel  # noqa: E402

VOCAB, PADDED, WIDTH, ROWS = 50257, 50304, 768, chunked_loss.CHUNK_ROWS
TOKENS = 16 * 1024   # batch 16: the buffer of transposed gradients spans every token
LSE_SHAPES = [(2048, 8), (4096, 8), (4096, 16), (1024, 4), (1024, 8)]
T_SHAPES = [(128, 128, 8), (128, 128, 4), (64, 128, 4), (128, 64, 4), (64, 64, 4), (256, 128, 8), (128, 256, 8)]
TILE_SHAPES = [(128, 128, 8), (128, 128, 16), (128, 64, 4), (64, 128, 4), (64, 64, 4), (64, 64, 2), (32, 64, 2),
               (64, 32, 2), (32, 32, 1), (32, 128, 4), (128, 32, 4), (16, 128, 2), (32, 256, 8)]


def us(f) -> float:
    return do_bench(f, warmup=10, rep=100) * 1000


def line(name: str, t: float, nbytes: float) -> None:
    print(f"  {name:34s} {t:8.1f} us  {nbytes / t / 1e3:7.0f} GB/s")


def main() -> None:
    if not torch.cuda.is_available() or fp8_loss.unavailable(torch.device("cuda")):
        sys.exit("error: this benchmark needs an Ada or Hopper GPU")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    row_lse, grad_fp8, transpose = fp8_loss._kernels
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(ROWS, PADDED, device="cuda", generator=g) * 2.8).bfloat16()
    targets = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)
    n = logits.numel()
    failed = False

    print(f"one chunk: {ROWS} x {PADDED} bf16 logits ({2 * n / 1e6:.0f} MB)")
    line("copy (read 2 B, write 2 B a logit)", us(lambda: logits.clone()), 4 * n)
    line("sum (read 2 B a logit)", us(lambda: logits.sum(dtype=torch.float32)), 2 * n)
    lse_ref, loss_ref = torch.empty(ROWS, device="cuda"), torch.empty(ROWS, device="cuda")
    lse, loss = torch.empty_like(lse_ref), torch.empty_like(loss_ref)

    def run_lse(out_lse, out_loss, b, w):
        row_lse[(ROWS,)](logits, targets, out_lse, out_loss, VOCAB, logits.stride(0), BLOCK=b, num_warps=w)

    run_lse(lse_ref, loss_ref, fp8_loss.LSE_BLOCK, fp8_loss.LSE_WARPS)
    print("log-sum-exp pass (reads 2 B a logit): columns per load, warps")
    for b, w in LSE_SHAPES:
        run_lse(lse, loss, b, w)
        same = torch.allclose(lse, lse_ref, rtol=0, atol=1e-4) and torch.allclose(loss, loss_ref, rtol=0, atol=1e-4)
        failed |= not same
        line(f"{b:5d}, {w:2d} warps{'' if same else ' DIFFERS'}", us(lambda: run_lse(lse, loss, b, w)), 2 * n)

    grad = torch.empty(ROWS, PADDED, dtype=fp8.E5M2, device="cuda")
    grad_t = torch.empty(PADDED, TOKENS, dtype=fp8.E5M2, device="cuda")
    ref = torch.empty_like(grad)

    def run_grad(out, tr, tc, w):
        grad_fp8[(triton.cdiv(ROWS, tr), triton.cdiv(PADDED, tc))](
            logits, lse_ref, targets, out, grad_t[:, :ROWS], ROWS, PADDED, VOCAB, logits.stride(0),
            grad_t.stride(0), fp8_loss.GRAD_SCALE, TILE_R=tr, TILE_C=tc, num_warps=w)

    run_grad(ref, fp8_loss.TILE_R, fp8_loss.TILE_C, fp8_loss.TILE_WARPS)
    ref_t = grad_t[:, :ROWS].clone()
    print("gradient pass (reads 2 B, writes 1 B row-major and 1 B transposed a logit): tile rows, columns, warps")
    for tr, tc, w in TILE_SHAPES:
        grad_t.zero_()
        run_grad(grad, tr, tc, w)
        same = torch.equal(grad.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(
            grad_t[:, :ROWS].view(torch.uint8), ref_t.view(torch.uint8))
        failed |= not same
        line(f"{tr:3d} x {tc:3d}, {w:2d} warps{'' if same else ' DIFFERS'}", us(lambda: run_grad(grad, tr, tc, w)),
             4 * n)

    if loss_kernel.prepare(torch.device("cuda"), PADDED) is None:   # None: the CUDA kernels are built
        print("one-pass form: the CUDA pass (reads 2 B, writes 1 B a logit), then the transpose (1 B each way)")
        one, loss1 = torch.empty_like(grad), torch.empty_like(loss_ref)
        assert loss_kernel.grad_e5m2(logits, targets, VOCAB, loss1, one, fp8_loss.GRAD_SCALE)
        t_pass = us(lambda: loss_kernel.grad_e5m2(logits, targets, VOCAB, loss1, one, fp8_loss.GRAD_SCALE))
        step = (one.float() - ref.float()).abs() / ref.float().abs().clamp(min=2.0 ** -16)
        differ = (one.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
        same = (loss1 - loss_ref).abs().max().item() < 1e-3 and differ < 3e-3 and step.max().item() <= 0.25
        failed |= not same
        line(f"CUDA pass ({differ:.2e} of bytes one step off){'' if same else ' DIFFERS'}", t_pass, 3 * n)
        best = None
        for tr, tc, w in T_SHAPES:
            grad_t.zero_()
            run = lambda: transpose[(triton.cdiv(ROWS, tr), triton.cdiv(PADDED, tc))](
                one.view(torch.uint8), grad_t[:, :ROWS].view(torch.uint8), ROWS, PADDED, grad_t.stride(0),
                TILE_R=tr, TILE_C=tc, num_warps=w)
            run()
            same = torch.equal(grad_t[:, :ROWS].view(torch.uint8), one.t().view(torch.uint8))
            failed |= not same
            t = us(run)
            best = min(best or (t, tr, tc, w), (t, tr, tc, w))
            line(f"transpose {tr:3d} x {tc:3d}, {w:2d} warps{'' if same else ' DIFFERS'}", t, 2 * n)
        line("transpose by copy_ (PyTorch)", us(lambda: grad_t[:, :ROWS].copy_(one.t())), 2 * n)
        line("one-pass form, module's shape", t_pass + us(lambda: fp8_loss.transpose(one, grad_t[:, :ROWS])), 5 * n)
        print(f"fastest transpose: {best[1]} x {best[2]}, {best[3]} warps, {best[0]:.1f} us")
        work = logits.clone()
        line("bf16 path's CUDA loss kernel (2 B in, 2 B out)",
             us(lambda: loss_kernel.cross_entropy_grad(work.copy_(logits), targets, VOCAB)) - us(
                 lambda: work.copy_(logits)), 4 * n)

    print("batch 16's FP8 GEMMs and casts")
    h = torch.randn(TOKENS, WIDTH, device="cuda", generator=g).bfloat16()
    w = torch.randn(PADDED, WIDTH, device="cuda", generator=g) * 0.1
    h8, h_inv = fp8.to_e4m3(h)
    w8, w_inv = fp8.to_e4m3(w)
    w8_t, h8_t, wb = w8.t().contiguous(), h8.t().contiguous(), w.bfloat16()
    inv = torch.ones((), device="cuda")
    flop = 2 * TOKENS * PADDED * WIDTH
    for name, f in {
        "logits (4 chunks)": lambda: [torch._scaled_mm(h8[i:i + ROWS], w8.t(), scale_a=h_inv, scale_b=w_inv,
                                                       out_dtype=torch.bfloat16, use_fast_accum=True)
                                      for i in range(0, TOKENS, ROWS)],
        "h's gradient (4 chunks)": lambda: [torch._scaled_mm(grad, w8_t.t(), scale_a=inv, scale_b=w_inv,
                                                             out_dtype=torch.bfloat16) for _ in range(0, TOKENS, ROWS)],
        "the weight's gradient": lambda: torch._scaled_mm(grad_t, h8_t.t(), scale_a=inv,
                                                          scale_b=h_inv, out_dtype=torch.float32),
        "bf16 logits GEMM (4 chunks), for scale": lambda: [h[i:i + ROWS] @ wb.t()
                                                           for i in range(0, TOKENS, ROWS)],
    }.items():
        t = us(f)
        print(f"  {name:40s} {t:8.1f} us  {flop / t / 1e6:5.0f} TFLOP/s")
    for name, f in {
        "weight to e4m3": lambda: fp8.to_e4m3(w),
        "weight to e4m3, transposed copy": lambda: w8.t().contiguous(),
        "h to e4m3": lambda: fp8.to_e4m3(h),
    }.items():
        print(f"  {name:40s} {us(f):8.1f} us")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
