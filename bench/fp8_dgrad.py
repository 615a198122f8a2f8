"""Times `fp8_dgrad`'s input-gradient GEMMs against `max`'s bf16 ones on a GPU, one layer at a time, at the sizes
issue 55 measures (gpt2-xl batch 8, gpt2-medium batch 16, GPT-2 124M batch 64): c_attn's (its output gradient
[tokens, 3C] times its weight [3C, C]) and c_fc's ([tokens, 4C] times [4C, C]). Each is compiled and replayed as a
CUDA graph, as the training step runs it, so no host time is in the figures:
- bf16: grad @ weight;
- FP8: Utils.kernels.fp8_linear.input_grad, the casts and the GEMM together;
- its parts: the casts alone (the gradient's amax and e5m2 cast, the weight's transposed e4m3 cast), and the FP8
  GEMM alone, with and without fast accumulation (FP8 products summed at reduced precision; `input_grad` runs
  without it);
- delayed scaling, which `fp8_dgrad` does not do: the gradient cast with a scale known before its pass (the
  previous step's amax; here this step's), this step's amax taken in the same pass, so that the gradient is read
  once, not twice; the whole of it (cast, weight cast, GEMM), and that cast alone.
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


def delayed_cast(grad: torch.Tensor, scale: torch.Tensor):
    """grad times a scale fixed before the pass, cast to e5m2, and grad's amax, for the next step's scale."""
    largest = torch.finfo(fp8.E5M2).max
    g = grad.float()
    return (g * scale).clamp(-largest, largest).to(fp8.E5M2), g.abs().amax()


def delayed_input_grad(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor):
    """fp8_linear.input_grad with the gradient's cast delayed_cast's."""
    g8, amax = delayed_cast(grad, scale)
    wt8, w_inv = fp8.to_e4m3(weight.t().contiguous())
    return torch._scaled_mm(g8, wt8.t(), scale_a=scale.reciprocal(), scale_b=w_inv, out_dtype=grad.dtype), amax


def one_layer(tokens: int, n_out: int, width: int) -> tuple[dict, float]:
    """Times in µs of one layer's input-gradient GEMM, output gradient [tokens, n_out], weight [n_out, width]; and
    the FP8 result's error against its dequantized operands' product."""
    grad = (torch.randn(tokens, n_out, device="cuda") * 1e-4).bfloat16()   # a gradient's size
    weight = (torch.randn(n_out, width, device="cuda") * 0.02).bfloat16()
    bf16, _ = replayed(lambda g, w: g @ w, grad, weight)
    whole, out = replayed(fp8_linear.input_grad, grad, weight)
    cast, ((g8, g_inv), (wt8, w_inv)) = replayed(casts, grad, weight)
    scale = torch.finfo(fp8.E5M2).max / grad.float().abs().amax()   # as if the previous step's amax were this one's
    delayed, (out_delayed, _) = replayed(delayed_input_grad, grad, weight, scale)
    delayed_one, _ = replayed(delayed_cast, grad, scale)
    times = {"bf16": bench(bf16), "fp8": bench(whole), "casts": bench(cast), "fp8, delayed": bench(delayed),
             "cast, delayed": bench(delayed_one)}
    for fast in (False, True):
        gemm, _ = replayed(lambda g, w, gi, wi: torch._scaled_mm(g, w.t(), scale_a=gi, scale_b=wi,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=fast),
                           g8, wt8, g_inv, w_inv)
        times["gemm, fast" if fast else "gemm"] = bench(gemm)
    whole()
    dequantized = (g8.float() * g_inv) @ (wt8.float() * w_inv).t()
    delayed()
    error = max((out.float() - dequantized).norm() / dequantized.norm(),
                (out_delayed.float() - dequantized).norm() / dequantized.norm())
    return times, error.item()


def main() -> int:
    why = fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a GPU that runs FP8 GEMMs ({why})")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    columns = ("bf16", "fp8", "casts", "gemm", "gemm, fast", "fp8, delayed", "cast, delayed")
    print(f"{'size, layer':26}" + "".join(f"{c + ' µs':>17}" for c in columns) + f"{'error':>9}"
          + f"{'saved, step':>14}{'delayed':>11}")
    failed = False
    for model, batch in SIZES:
        config = PRESETS[model]
        C, tokens = config.n_embd, batch * SEQ_LEN
        step = [0.0, 0.0]   # ms a step saves: fp8_dgrad, and with the cast delayed
        for layer, n_out in (("c_attn", 3 * C), ("c_fc", 4 * C)):
            times, error = one_layer(tokens, n_out, C)
            saved = [(times["bf16"] - times[k]) * config.n_layer / 1000 for k in ("fp8", "fp8, delayed")]
            step = [a + b for a, b in zip(step, saved)]
            failed |= not error < 1e-2
            print(f"{f'{model} b{batch}, {layer}':26}" + "".join(f"{times[c]:17.1f}" for c in columns)
                  + f"{error:9.4f}{saved[0]:11.2f} ms{saved[1]:8.2f} ms")
        print(f"{f'{model} b{batch}, both':26}{'':{17 * len(columns) + 9}}{step[0]:11.2f} ms{step[1]:8.2f} ms")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
