"""Times the FP8 loss's CUDA pass (Utils.kernels.loss_kernel.grad_e5m2) on one chunk of 4,096 rows x 50,304
bf16 logits, as the max rung makes them: a block a row (the module's default), against one block an SM that
copies the next row in while it works on this one (loss_kernel.PIPELINED), at several thread counts. At the
block-a-row form's thread count its loss and gradient must equal that form's byte for byte (the same
arithmetic a row); at another count a row's exponentials are summed in another order, so the loss must agree
within 1e-5 of itself and a gradient byte differ by one e5m2 step at most, for under 0.1% of them. The
script exits non-zero where one does not.

    python3 bench/fp8_pass.py
"""
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import chunked_loss, fp8_loss, loss_kernel  # noqa: E402

VOCAB, PADDED, ROWS = 50257, 50304, chunked_loss.CHUNK_ROWS
THREADS = (256, 512, 1024)


def main() -> None:
    device = torch.device("cuda")
    if not torch.cuda.is_available() or fp8_loss.unavailable(device):
        sys.exit("error: this benchmark needs an Ada or Hopper GPU")
    print(torch.__version__, torch.cuda.get_device_name())
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(ROWS, PADDED, device="cuda", generator=g) * 2.8).bfloat16()
    targets = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)
    moved = 3 * logits.numel()   # 2 B read and 1 B written a logit

    def run(loss, grad):
        assert loss_kernel.grad_e5m2(logits, targets, VOCAB, loss, grad, fp8_loss.GRAD_SCALE)

    def time(loss, grad) -> float:
        return do_bench(lambda: run(loss, grad), warmup=10, rep=200) * 1000

    loss_kernel.PIPELINED = False
    if loss_kernel.prepare(device, PADDED) is not None:
        sys.exit("error: the CUDA loss kernel could not be built here")
    ref_loss, ref = torch.empty(ROWS, device="cuda"), torch.empty(ROWS, PADDED, dtype=fp8_loss.E5M2, device="cuda")
    run(ref_loss, ref)
    t = time(ref_loss, ref)
    print(f"one chunk, {ROWS} x {PADDED}; {moved / 1e6:.0f} MB moved")
    name = f"a block a row, {loss_kernel.CUDA_THREADS} threads"
    print(f"  {name:40s} {t:7.1f} us  {moved / t / 1e3:5.0f} GB/s")
    loss_kernel.PIPELINED = True
    if not loss_kernel._pipelined(device, PADDED):
        sys.exit("error: two rows do not fit in a block's shared memory here")
    failed = False
    for threads in THREADS:
        loss_kernel.PIPELINED_THREADS = threads
        loss, grad = torch.full_like(ref_loss, -1.0), torch.zeros_like(ref)
        run(loss, grad)
        if threads == loss_kernel.CUDA_THREADS:
            same = torch.equal(loss, ref_loss) and torch.equal(grad.view(torch.uint8), ref.view(torch.uint8))
        else:
            step = (grad.float() - ref.float()).abs() / ref.float().abs().clamp(min=2.0 ** -16)
            differ = (grad.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
            same = ((loss - ref_loss).abs() / ref_loss.abs()).max().item() < 1e-5 and differ < 1e-3 \
                and step.max().item() <= 0.25
        failed |= not same
        t = time(loss, grad)
        name = f"pipelined, {threads} threads{'' if same else ' DIFFERS'}"
        print(f"  {name:40s} {t:7.1f} us  {moved / t / 1e3:5.0f} GB/s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
