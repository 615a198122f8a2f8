"""Checks and times Utils.kernels.fp8_loss on a GPU against the chunked loss the max rung runs in bf16 (with
its loss kernel), on GPT-2's output layer (768 wide, 50,304 padded rows) at batch 16 and 64 x 1024 tokens:
the loss and both gradients against the fp32 reference, then the time of forward and backward, each
compiled by torch.compile as the model is. Exits non-zero if a check fails.

    python3 bench/fp8_loss.py [--chunk-rows 1024,4096]

--chunk-rows times the FP8 way at each number of tokens per chunk (fp8_loss.CHUNK_ROWS by default): a
chunk's bf16 logits take 100 KB a token, so that up to a few hundred tokens they fit in the GPU's L2
cache (50 MB on an H100 or H200) between the kernels that write and read them. The bf16 way runs once, at
its module's own chunk (chunked_loss.CHUNK_ROWS): torch.compile unrolls its loop over chunks, so that small
chunks compile slowly.
"""
import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import chunked_loss, fp8_loss, loss_kernel  # noqa: E402

VOCAB, PADDED, WIDTH, SEQ = 50257, 50304, 768, 1024
DEFAULT_CHUNK_ROWS = fp8_loss.CHUNK_ROWS


def inputs(batch: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    # h as the final LayerNorm leaves it; the weight 5x GPT-2's initial std of 0.02, so that the logits
    # spread (std 2.8) as a model's do after some training rather than all near zero.
    h = torch.randn(batch * SEQ, WIDTH, device="cuda", generator=g).bfloat16()
    w = torch.randn(PADDED, WIDTH, device="cuda", generator=g) * 0.1
    y = torch.randint(0, VOCAB, (batch * SEQ,), device="cuda", generator=g)
    return h, w, y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def chunk_rows_list(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",")]
    except ValueError:
        rows = []
    if not rows or any(r < 16 or r % 16 for r in rows):
        raise argparse.ArgumentTypeError(f"{text!r}: give multiples of 16 tokens, comma-separated, e.g. 1024,4096")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-rows", type=chunk_rows_list, default=[DEFAULT_CHUNK_ROWS],
                        help="tokens per chunk, comma-separated (default %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or fp8_loss.unavailable(torch.device("cuda")):
        sys.exit("error: this benchmark needs an Ada or Hopper GPU")
    print(torch.__version__, torch.cuda.get_device_name())
    loss_kernel.prepare(torch.device("cuda"), PADDED)
    failed = False
    for i, chunk_rows in enumerate(args.chunk_rows):
        fp8_loss.CHUNK_ROWS = chunk_rows   # read when the FP8 way is traced: compile it again
        torch._dynamo.reset()
        print(f"{chunk_rows} tokens per chunk (FP8)")
        failed |= run_batches(with_bf16=i == 0)
    sys.exit(1 if failed else 0)


def run_batches(with_bf16: bool) -> bool:
    """Check and time each way at batch 16 and 64; True where a check failed."""
    ways = {"fp8": torch.compile(lambda h, w, y: fp8_loss.fp8_cross_entropy(h, w, y, VOCAB))}
    if with_bf16:
        ways["bf16, loss kernel"] = torch.compile(
            lambda h, w, y: chunked_loss.chunked_cross_entropy(h, w, y, VOCAB, True))
    failed = False
    for batch in (16, 64):
        h, w, y = inputs(batch)
        ref_h, ref_w = h.float().requires_grad_(), w.clone().requires_grad_()
        ref = fp8_loss.reference(ref_h, ref_w, y, VOCAB)
        ref.backward()
        print(f"batch {batch}: reference loss {ref.item():.4f}")
        for name, f in ways.items():
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(hh, ww, y)
            loss.backward()
            errors = (abs(loss.item() - ref.item()), rel(hh.grad, ref_h.grad), rel(ww.grad, ref_w.grad))
            # FP8's rounding: e4m3 keeps 3 mantissa bits (off by at most 1/16 of a value), e5m2 2 (1/8); over
            # sums of hundreds of terms the errors mostly cancel. Bounds: 0.1% of the loss, 10% of a gradient's
            # norm (the 300-step loss in BENCHMARKS.md is the test that matters).
            ok = errors[0] < 1e-3 * ref.item() and errors[1] < 0.1 and errors[2] < 0.1
            failed |= not ok

            def step():
                hh.grad = ww.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    f(hh, ww, y).backward()

            torch.cuda.reset_peak_memory_stats()
            ms = do_bench(step, warmup=5, rep=40)
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
            print(f"  {name:18s} {ms:7.2f} ms  peak {peak:5.1f} GiB  |loss error| {errors[0]:.1e}  "
                  f"|grad h error| {errors[1]:.3f}  |grad w error| {errors[2]:.3f}  {'ok' if ok else 'FAILED'}")
    return failed


if __name__ == "__main__":
    main()
