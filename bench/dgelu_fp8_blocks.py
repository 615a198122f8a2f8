"""Times the lever that "What 1.30x at 124M would take" (BENCHMARKS.md) counts largest: c_proj's DGELU GEMM writing
the MLP's gradient grad_h in FP8 as well as in bf16, so that c_fc's input-gradient GEMM reads it in FP8 with no
cast pass. cuBLASLt offers no DGELU GEMM with an FP8 output (bench/cublaslt_fp8_out.py), so the GEMM is Triton's
(bench/dgelu_triton.py's kernel), and the scale is one per 128 columns of a row: a tile of 128 columns holds each
block whole, so the epilogue finds the block's amax and casts it with no state across steps and no pass over a whole
row. `torch._scaled_mm` takes such an operand with the weight in 128 x 128 blocks (cuBLASLt's block scaling, CUDA
12.9 or newer on Hopper); the weight's blocks here all carry its one scale.

At each of issue 55's sizes, one layer's MLP backward through grad_h, µs, each replayed as a CUDA graph:
- cuBLASLt's bf16 DGELU GEMM (what `max` runs) and Triton's, bf16 only and with the FP8 blocks;
- c_fc's input-gradient GEMM: bf16; on the FP8 blocks; the same GEMM with one scale an operand (the fastest FP8
  form); and `fp8_dgrad`'s row cast and GEMM (Utils.kernels.fp8_linear.input_grad, in `max` at gpt2-xl);
- the lever a layer: cuBLASLt DGELU + the GEMM `max` runs at that size, less Triton's DGELU with blocks + the block
  GEMM; and a step (times the layers).
Each output is checked: Triton's grad_h against the fp32 reference, its FP8 blocks against its bf16 grad_h, the
block GEMM against the product of its dequantized operands. The exit status is 1 where one is off.

    python3 bench/dgelu_fp8_blocks.py          # the three configurations below
    python3 bench/dgelu_fp8_blocks.py --sweep  # Triton's DGELU with the blocks over SWEEP, at 124M and medium only
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.dgelu_triton import launcher  # noqa: E402
from bench.fp8_dgrad import SEQ_LEN, SIZES, replayed  # noqa: E402
from bench.gelu_epilogue import bench  # noqa: E402
from bench.packed_attention import graphed  # noqa: E402
from Utils.kernels import cublaslt, fp8, fp8_linear  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402

BLOCK = 128   # columns a scale covers: cuBLASLt's 1 x 128 blocks
BLOCK_GEMM_ERROR = 1e-2   # the block GEMM's relative distance from its dequantized operands' product, at most


# Each stores blocks of 128 columns: BN 256 in halves, or 128 whole. The first two are dgelu_triton.BEST's first
# and third, the fastest on an H200 at 124M.
CONFIGS = [dict(BM=128, BN=256, BK=64, stages=3, warps=8, halves=True, ws=True),
           dict(BM=128, BN=256, BK=32, stages=5, warps=8, halves=True, ws=False),
           dict(BM=256, BN=128, BK=64, stages=3, warps=8, halves=False, ws=False)]


# Tiles 128 rows by 128 or 256 columns (a block's width or two), each depth with the two pipeline lengths that fit in
# an H100's 227 KB of shared memory beside the epilogue; 256 columns with 8 warps, warp-specialized or not.
_DEPTHS = ((32, (4, 5)), (64, (3, 4)), (128, (2, 3)))
SWEEP = ([dict(BM=128, BN=256, BK=BK, stages=st, warps=8, halves=True, ws=ws)
          for BK, stages in _DEPTHS for st in stages for ws in (False, True)]
         + [dict(BM=128, BN=128, BK=BK, stages=st, warps=warps, halves=False, ws=False)
            for BK, stages in _DEPTHS[1:] for st in stages for warps in (4, 8)])


def block_scales_of_weight(w_inv: torch.Tensor, k: int, n: int, padded: bool) -> torch.Tensor:
    """The weight's one inverse scale as cuBLASLt's 128 x 128 blocks of B [k, n]: [k / 128, n / 128], the k blocks
    contiguous, in a buffer of exactly k / 128 of them, or of a multiple of 4 with `padded`. PyTorch's releases have
    checked one layout or the other; they differ only where k / 128 is not a multiple of 4 (gpt2-xl's 50)."""
    kb, nb = triton.cdiv(k, BLOCK), triton.cdiv(n, BLOCK)
    return w_inv.reshape(1, 1).expand(nb, 4 * triton.cdiv(kb, 4) if padded else kb).contiguous().t()[:kb]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def one_layer(tokens: int, C: int, configs: list[dict] = CONFIGS, bf16_out: bool = True) -> tuple[dict, dict]:
    """(µs of each form at this shape, the errors) for one MLP: grad [tokens, C], c_proj's weight [C, 4C], h and
    grad_h [tokens, 4C], c_fc's weight [4C, C]."""
    N = 4 * C
    grad = (torch.randn(tokens, C, device="cuda") * 1e-3).bfloat16()
    w_proj = (torch.randn(C, N, device="cuda") * 0.02).bfloat16()
    h = torch.randn(tokens, N, device="cuda").bfloat16()
    w_fc = (torch.randn(N, C, device="cuda") * 0.02).bfloat16()
    times, errors = {}, {}
    times["cuBLASLt DGELU"] = bench(graphed(lambda: cublaslt.linear_dgelu(grad, w_proj, h)))
    ref = cublaslt.reference_linear_dgelu(grad.float(), w_proj.float(), h.float())
    out, q = torch.empty_like(h), torch.empty(h.shape, dtype=fp8.E4M3, device="cuda")
    scales = torch.empty(triton.cdiv(N, BLOCK), tokens, device="cuda")
    for fp8_out, name in ((False, "Triton DGELU"), (True, "Triton DGELU, blocks"))[0 if bf16_out else 1:]:
        best = None
        for cfg in configs:
            try:
                run = launcher(grad, w_proj, h, out, **cfg, q=q if fp8_out else None,
                               q_scales=scales if fp8_out else None)
                run()
                us = bench(graphed(run))
            except Exception as e:   # a configuration that does not fit (shared memory) or compile
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
                continue
            best = min(best or (us, cfg), (us, cfg), key=lambda t: t[0])
            errors[name] = max(errors.get(name, 0.0), relative(out, ref))
            if fp8_out:
                errors["blocks against bf16"] = max(errors.get("blocks against bf16", 0.0), relative(
                    q.float() * scales.t().repeat_interleave(BLOCK, dim=1)[:, :N], out))
        times[name] = best[0] if best else float("nan")
        print(f"  {name}: best {best}", flush=True)
    a_scales = scales.t()   # [tokens, N / 128], column-major: cuBLASLt's layout for 1 x 128 blocks
    w8, w_inv = fp8.to_e4m3(w_fc)
    b8 = w8.t().contiguous().t()   # [N, C] column-major, as _scaled_mm reads its second operand
    grad_h = out.clone()
    times["c_fc bf16"] = bench(graphed(lambda: grad_h @ w_fc))
    times["c_fc blocks"] = float("nan")
    # Each layout of the weight's scales in turn, until one is taken and computes the product: at gpt2-xl
    # (19a345e, H100) the unpadded one was taken and came out 14% wrong.
    dequantized = (q.float() * a_scales.repeat_interleave(BLOCK, dim=1)[:, :N]) @ (w8.float() * w_inv)
    for padded in (False, True):
        layout = "padded" if padded else "unpadded"
        b_scales = block_scales_of_weight(w_inv, N, C, padded)
        try:
            blocks = torch._scaled_mm(q, b8, scale_a=a_scales, scale_b=b_scales, out_dtype=torch.bfloat16)
        except RuntimeError as e:   # refused: reported whole; NaN in the table if no layout is taken and right
            print(f"  block GEMM refused ({layout} weight scales): {' '.join(str(e).split())}")
            continue
        errors["block GEMM"] = relative(blocks, dequantized)
        if not errors["block GEMM"] < BLOCK_GEMM_ERROR:
            print(f"  block GEMM wrong ({layout} weight scales): {errors['block GEMM']:.4f} from the product")
            continue
        times["c_fc blocks"] = bench(graphed(lambda: torch._scaled_mm(q, b8, scale_a=a_scales, scale_b=b_scales,
                                                                      out_dtype=torch.bfloat16)))
        break
    one = w_inv.new_ones(())
    times["c_fc one scale"] = bench(graphed(lambda: torch._scaled_mm(q, b8, scale_a=one, scale_b=w_inv,
                                                                     out_dtype=torch.bfloat16)))
    times["c_fc rows (fp8_dgrad)"] = bench(replayed(fp8_linear.input_grad, grad_h, w_fc)[0])
    return times, errors


COLUMNS = ("cuBLASLt DGELU", "Triton DGELU", "Triton DGELU, blocks", "c_fc bf16", "c_fc blocks", "c_fc one scale",
           "c_fc rows (fp8_dgrad)")


def main() -> int:
    why = fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why or torch.cuda.get_device_capability() != (9, 0):
        sys.exit(f"error: this benchmark needs a Hopper GPU, whose cuBLASLt scales FP8 in 128-wide blocks "
                 f"({why or torch.cuda.get_device_name()})")
    torch.manual_seed(0)
    print(torch.__version__, "Triton", triton.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    failed = False
    print(f"{'µs a layer':18}" + "".join(f"{c:>23}" for c in COLUMNS) + f"{'lever a layer':>15}{'ms a step':>11}")
    sweep = "--sweep" in sys.argv
    for model, batch in SIZES:
        config = PRESETS[model]
        if sweep and config.n_embd > 1024:   # xl's block GEMM: wrong with one layout, untimed with the other
            continue
        print(f"{model} b{batch}:", flush=True)
        times, errors = (one_layer(batch * SEQ_LEN, config.n_embd, SWEEP, bf16_out=False) if sweep
                         else one_layer(batch * SEQ_LEN, config.n_embd))
        times.setdefault("Triton DGELU", float("nan"))
        # `max` runs the row recipe where fp8_dgrad's width filter admits the layer (above width 1,024)
        now = times["cuBLASLt DGELU"] + times["c_fc rows (fp8_dgrad)" if config.n_embd > 1024 else "c_fc bf16"]
        lever = now - times["Triton DGELU, blocks"] - times["c_fc blocks"]
        print(f"{f'{model} b{batch}':18}" + "".join(f"{times[c]:23.1f}" for c in COLUMNS)
              + f"{lever:15.1f}{lever * config.n_layer / 1000:11.2f}")
        print("  errors: " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()), flush=True)
        limits = {"Triton DGELU, blocks": 1e-2, "blocks against bf16": 0.05, "block GEMM": BLOCK_GEMM_ERROR}
        if not sweep:
            limits["Triton DGELU"] = 1e-2
        if times["c_fc blocks"] != times["c_fc blocks"] and "block GEMM" not in errors:   # refused: nothing to check
            limits.pop("block GEMM")
        failed |= any(not errors.get(k, float("inf")) < v for k, v in limits.items())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
