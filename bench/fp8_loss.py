"""Checks and times Utils.kernels.fp8_loss on a GPU against the chunked loss the max rung runs in bf16 (with
its loss kernel), on GPT-2's output layer (768 wide, 50,304 padded rows) at batch 16 and 64 x 1024 tokens:
the loss and both gradients against the fp32 reference, then the time of forward and backward, each
compiled by torch.compile as the model is. Exits non-zero if a check fails.

    python3 bench/fp8_loss.py [--chunk-rows 1024,4096] [--side-stream 0,16,32]

--chunk-rows times each way at each number of tokens per chunk (chunked_loss.CHUNK_ROWS by default): a
chunk's bf16 logits take 100 KB a token, so that up to a few hundred tokens they fit in the GPU's L2
cache (50 MB on an H100 or H200) between the kernels that write and read them. The bf16 way runs at the
module's own chunk only: torch.compile unrolls its loop over chunks, so that small chunks compile slowly.

--side-stream also times the FP8 loss with its two passes on a side stream (fp8_loss.SIDE_STREAM), once for
each number of SMs given, which the chunks' GEMMs then leave to the passes (fp8_loss.SM_CARVEOUT; 0: none
left). Each must give the same bytes as the same order of work on one stream.
"""
import argparse
import contextlib
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import chunked_loss, fp8_loss, loss_kernel  # noqa: E402

VOCAB, PADDED, WIDTH, SEQ = 50257, 50304, 768, 1024
DEFAULT_CHUNK_ROWS = chunked_loss.CHUNK_ROWS


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


def sm_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give SM counts of 0 or more, comma-separated, e.g. 0,16,32")
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-rows", type=chunk_rows_list, default=[DEFAULT_CHUNK_ROWS],
                        help="tokens per chunk, comma-separated (default %(default)s)")
    parser.add_argument("--side-stream", type=sm_counts, default=[], metavar="SMS",
                        help="also time the passes on a side stream, the GEMMs leaving each number of SMs to them")
    args = parser.parse_args()
    if not torch.cuda.is_available() or fp8_loss.unavailable(torch.device("cuda")):
        sys.exit("error: this benchmark needs an Ada or Hopper GPU")
    print(torch.__version__, torch.cuda.get_device_name())
    loss_kernel.prepare(torch.device("cuda"), PADDED)
    failed = False
    for chunk_rows in args.chunk_rows:
        chunked_loss.CHUNK_ROWS = chunk_rows   # read when a way is traced: compile each way again
        torch._dynamo.reset()
        print(f"{chunk_rows} tokens per chunk")
        failed |= run_batches(with_bf16=chunk_rows == DEFAULT_CHUNK_ROWS, carveouts=args.side_stream)
    sys.exit(1 if failed else 0)


@contextlib.contextmanager
def setting(side_stream: bool, carveout: int, one_stream: bool = False):
    """fp8_loss.SIDE_STREAM and SM_CARVEOUT as given, then as they were; one_stream: the side stream's order
    of work and carveout, all on the current stream (the reference its bytes must equal)."""
    before = fp8_loss.SIDE_STREAM, fp8_loss.SM_CARVEOUT, fp8_loss._side_stream
    fp8_loss.SIDE_STREAM, fp8_loss.SM_CARVEOUT = side_stream, carveout
    if one_stream:
        fp8_loss._side_stream = lambda device: None
    try:
        yield
    finally:
        fp8_loss.SIDE_STREAM, fp8_loss.SM_CARVEOUT, fp8_loss._side_stream = before


def run_batches(with_bf16: bool, carveouts: list[int]) -> bool:
    """Check and time each way at batch 16 and 64; True where a check failed."""
    fp8 = torch.compile(lambda h, w, y: fp8_loss.fp8_cross_entropy(h, w, y, VOCAB))
    ways = {"fp8": (fp8, False, 0)}   # name: (function, side stream, SMs the GEMMs leave)
    ways.update({f"fp8, side stream, {sms} SMs": (fp8, True, sms) for sms in carveouts})
    if with_bf16:
        ways["bf16, loss kernel"] = (torch.compile(
            lambda h, w, y: chunked_loss.chunked_cross_entropy(h, w, y, VOCAB, True)), False, 0)
    failed = False
    for batch in (16, 64):
        h, w, y = inputs(batch)
        ref_h, ref_w = h.float().requires_grad_(), w.clone().requires_grad_()
        ref = chunked_loss.reference(ref_h, ref_w, y, VOCAB)
        ref.backward()
        print(f"batch {batch}: reference loss {ref.item():.4f}")
        for name, (f, side_stream, carveout) in ways.items():
            def once(one_stream=False):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                with setting(side_stream, carveout, one_stream):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = f(hh, ww, y)
                    loss.backward()
                return loss.detach(), hh, ww

            loss, hh, ww = once()
            if side_stream:   # the same kernels in the same order on one stream: the same bytes, unless a wait
                one = once(one_stream=True)   # is missing
                same = all(torch.equal(a, b) for a, b in zip((one[0], one[1].grad, one[2].grad),
                                                            (loss, hh.grad, ww.grad)))
                failed |= not same
                name += "" if same else " (DIFFERS from one stream)"
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
            with setting(side_stream, carveout):
                ms = do_bench(step, warmup=5, rep=40)
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
            print(f"  {name:26s} {ms:7.2f} ms  peak {peak:5.1f} GiB  |loss error| {errors[0]:.1e}  "
                  f"|grad h error| {errors[1]:.3f}  |grad w error| {errors[2]:.3f}  {'ok' if ok else 'FAILED'}")
    return failed


if __name__ == "__main__":
    main()
