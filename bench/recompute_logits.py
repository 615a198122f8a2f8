"""Times the FP8 output layer's logits without the logits: Utils.kernels.recompute_logits (two Triton GEMMs, neither
writing a logit) against what `max` runs for one chunk of the loss (Utils.kernels.fp8_loss), the question being
whether recomputing the logits' GEMM beats storing them and reading them back.

`max` today, a chunk of 16,384 tokens at 124M (results/h100-profile-b64/logs/kernels.txt, µs): the logits' GEMM
writing bf16 logits (1,142), the loss kernel's CUDA pass reading them once and writing the e5m2 gradient row-major
(817), the transpose of that gradient (608). The recomputed form is timed for each tile shape in CONFIGS (the
module's TILE first). Each form is checked against the float64 reference (loss, gradient) and the transposed gradient
against the row-major one, byte for byte. Times are of each form replayed as a CUDA graph.

    python3 bench/recompute_logits.py            # 124M b64, gpt2-medium b16, gpt2-xl b8
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.dgelu_fp8_blocks import relative  # noqa: E402
from bench.gelu_epilogue import bench  # noqa: E402
from bench.packed_attention import graphed  # noqa: E402
from Utils.kernels import fp8, fp8_loss, loss_kernel, recompute_logits  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402

VOCAB = 50257
# (model, rows of one chunk, chunks a step): fp8_loss.CHUNK_ROWS tokens a chunk, or the whole step where it is less
SIZES = [("gpt2", 16384, 4), ("gpt2-medium", 16384, 1), ("gpt2-xl", 8192, 1)]
# Tile shapes (recompute_logits.TILE's keys): the module's first, then the others.
CONFIGS = [dict(recompute_logits.TILE)]
CONFIGS += [dict(BM=128, BN=256, BK=128, num_stages=3, num_warps=8, WS=ws, GROUP_M=g)
            for ws, g in ((True, 128), (False, 32), (False, 128))]
CONFIGS += [dict(BM=128, BN=128, BK=128, num_stages=4, num_warps=8, WS=ws, GROUP_M=128) for ws in (True, False)]


def one_chunk(rows: int, width: int) -> tuple[dict, dict]:
    """(µs of each form for one chunk, the errors)."""
    torch.manual_seed(0)
    n_cols = loss_kernel.kernel_logits_width(VOCAB)
    h8, h_inv = fp8.to_e4m3(torch.randn(rows, width, device="cuda"))
    w8, w_inv = fp8.to_e4m3(torch.nn.functional.pad(torch.randn(VOCAB, width, device="cuda") * 0.02,
                                                    (0, 0, 0, n_cols - VOCAB)))
    targets = torch.randint(0, VOCAB, (rows,), device="cuda")
    ref_loss, ref_grad = recompute_logits.reference(h8, h_inv, w8, w_inv, targets, VOCAB)   # float64, padded
    ref_grad = ref_grad.float()
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
    errors["max: gradient"] = relative(grad.float() / fp8_loss.GRAD_SCALE, ref_grad)
    times["max"] = bench(graphed(stored))

    best = None
    for cfg in CONFIGS:
        grad.zero_()
        grad_t.zero_()
        loss = torch.empty(rows, device="cuda")

        def run():
            recompute_logits.loss_and_grad(h8, h_inv, w8, w_inv, targets, VOCAB, fp8_loss.GRAD_SCALE, loss, grad,
                                           grad_t, tile=cfg)
        try:
            run()
            us = bench(graphed(run))
        except Exception as e:   # a configuration that does not fit or compile
            print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            continue
        err = (relative(loss, ref_loss), relative(grad.float() / fp8_loss.GRAD_SCALE, ref_grad),
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
    why = recompute_logits.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: {why}")
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
