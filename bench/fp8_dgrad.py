"""Times `fp8_dgrad`'s input-gradient GEMMs against `max`'s bf16 ones on a GPU, one layer at a time, at the sizes
issue 55 measures (gpt2-xl batch 8, gpt2-medium batch 16, GPT-2 124M batch 64): c_attn's (its output gradient
[tokens, 3C] times its weight [3C, C]) and c_fc's ([tokens, 4C] times [4C, C]). Each is compiled and replayed as a
CUDA graph, as the training step runs it, so no host time is in the figures:
- bf16: grad @ weight;
- FP8: Utils.kernels.fp8_linear.input_grad, the casts and the GEMM together;
- its parts: the casts alone (the gradient's amax and e5m2 cast, the weight's transposed e4m3 cast), and the FP8
  GEMM alone, with and without fast accumulation (FP8 products summed at reduced precision; `input_grad` runs
  without it).
Each FP8 result is checked against the product of its dequantized operands; the exit status is 1 where one is off.

    python3 bench/fp8_dgrad.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gelu_epilogue import bench  # noqa: E402
from bench.packed_attention import graphed  # noqa: E402
from Utils.kernels import fp8, fp8_linear  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402

SIZES = (("gpt2-xl", 8), ("gpt2-medium", 16), ("gpt2", 64))   # issue 55's sizes and batches
SEQ_LEN = 1024


def replayed(fn, *args):
    """fn compiled, then captured with these arguments in a CUDA graph (its warm-up calls compile it): (the
    graph's replay, the output the graph writes)."""
    compiled, outputs = torch.compile(fn), []
    replay = graphed(lambda: outputs.append(compiled(*args)))
    return replay, outputs[-1]   # the call made under capture


def casts(grad: torch.Tensor, weight: torch.Tensor):
    return fp8.to_fp8(grad, fp8.E5M2), fp8.to_e4m3(weight.t().contiguous())


def one_layer(tokens: int, n_out: int, width: int) -> tuple[dict, float]:
    """Times in µs of one layer's input-gradient GEMM, output gradient [tokens, n_out], weight [n_out, width]; and
    the FP8 result's error against its dequantized operands' product."""
    grad = (torch.randn(tokens, n_out, device="cuda") * 1e-4).bfloat16()   # a gradient's size
    weight = (torch.randn(n_out, width, device="cuda") * 0.02).bfloat16()
    bf16, _ = replayed(lambda g, w: g @ w, grad, weight)
    whole, out = replayed(fp8_linear.input_grad, grad, weight)
    cast, ((g8, g_inv), (wt8, w_inv)) = replayed(casts, grad, weight)
    times = {"bf16": bench(bf16), "fp8": bench(whole), "casts": bench(cast)}
    for fast in (False, True):
        gemm, _ = replayed(lambda g, w, gi, wi: torch._scaled_mm(g, w.t(), scale_a=gi, scale_b=wi,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=fast),
                           g8, wt8, g_inv, w_inv)
        times["gemm, fast" if fast else "gemm"] = bench(gemm)
    whole()
    dequantized = (g8.float() * g_inv) @ (wt8.float() * w_inv).t()
    return times, ((out.float() - dequantized).norm() / dequantized.norm()).item()


def main() -> int:
    why = fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a GPU that runs FP8 GEMMs ({why})")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    columns = ("bf16", "fp8", "casts", "gemm", "gemm, fast")
    print(f"{'size, layer':26}" + "".join(f"{c + ' µs':>14}" for c in columns) + f"{'error':>9}{'saved, step':>14}")
    failed = False
    for model, batch in SIZES:
        config = PRESETS[model]
        C, tokens = config.n_embd, batch * SEQ_LEN
        step = 0.0
        for layer, n_out in (("c_attn", 3 * C), ("c_fc", 4 * C)):
            times, error = one_layer(tokens, n_out, C)
            saved = (times["bf16"] - times["fp8"]) * config.n_layer / 1000
            step += saved
            failed |= not error < 1e-2
            print(f"{f'{model} b{batch}, {layer}':26}" + "".join(f"{times[c]:14.1f}" for c in columns)
                  + f"{error:9.4f}{saved:11.2f} ms")
        print(f"{f'{model} b{batch}, both':26}{'':70}{'':9}{step:11.2f} ms")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
