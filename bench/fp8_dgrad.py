"""Times `fp8_dgrad`'s input-gradient GEMMs against `max`'s bf16 ones on a GPU, one layer at a time, at the sizes
issue 55 measures (gpt2-xl batch 8, gpt2-medium batch 16, GPT-2 124M batch 64): c_attn's (its output gradient
[tokens, 3C] times its weight [3C, C]) and c_fc's ([tokens, 4C] times [4C, C]). Each is compiled and replayed as a
CUDA graph, as the training step runs it, so no host time is in the figures:
- bf16: grad @ weight;
- rows: Utils.kernels.fp8_linear.input_grad, what `fp8_dgrad` runs: each row of the gradient cast to e4m3 with
  its own scale in one pass (Utils.kernels.fp8_rows's Triton kernel), the weight transposed with one scale, the GEMM
  with one scale an operand, and each row's scale applied to its output row after it; its casts alone and its
  GEMM alone (with the rows' scaling); and the gradient's row cast alone, by the kernel and by Inductor's code;
- tensor: one scale for the whole gradient, from its amax, in e5m2 (two passes over the gradient: the amax, then
  the cast), the weight's the same in e4m3, and the GEMM with two scalar scales; its GEMM alone, with and without
  fast accumulation (FP8 products summed at reduced precision): the GEMM that `rows` runs too;
- delayed: the tensor recipe with the gradient's scale known before its pass (the previous step's amax; here this
  step's) and this step's amax taken in the same pass: the state across steps that rows avoids.
Each FP8 result is checked against the product of its dequantized operands; the exit status is 1 where one is off.

    python3 bench/fp8_dgrad.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gelu_epilogue import bench  # noqa: E402
from bench.packed_attention import graphed  # noqa: E402
from Utils.kernels import fp8, fp8_linear, fp8_rows  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402

SIZES = (("gpt2-xl", 8), ("gpt2-medium", 16), ("gpt2", 64))   # issue 55's sizes and batches
SEQ_LEN = 1024


def replayed(fn, *args):
    """fn compiled, then captured with these arguments in a CUDA graph (its warm-up calls compile it): (the
    graph's replay, the output the graph writes)."""
    compiled, outputs = torch.compile(fn), []
    replay = graphed(lambda: outputs.append(compiled(*args)))
    return replay, outputs[-1]   # the call made under capture


def tensor_casts(grad: torch.Tensor, weight: torch.Tensor):
    return fp8.to_fp8(grad, fp8.E5M2), fp8.to_e4m3(weight.t().contiguous())


def tensor_input_grad(grad: torch.Tensor, weight: torch.Tensor):
    """grad @ weight in FP8 with one scale a tensor, the gradient's from its amax."""
    (g8, g_inv), (wt8, w_inv) = tensor_casts(grad, weight)
    return torch._scaled_mm(g8, wt8.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)


def delayed_cast(grad: torch.Tensor, scale: torch.Tensor):
    """grad times a scale fixed before the pass, cast to e5m2, and grad's amax, for the next step's scale."""
    largest = torch.finfo(fp8.E5M2).max
    g = grad.float()
    return (g * scale).clamp(-largest, largest).to(fp8.E5M2), g.abs().amax()


def delayed_input_grad(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor):
    """tensor_input_grad with the gradient cast by delayed_cast, and its amax for the next step."""
    g8, amax = delayed_cast(grad, scale)
    wt8, w_inv = fp8.to_e4m3(weight.t().contiguous())
    return torch._scaled_mm(g8, wt8.t(), scale_a=scale.reciprocal(), scale_b=w_inv, out_dtype=grad.dtype), amax


def error(out: torch.Tensor, a8, a_inv, b8, b_inv) -> float:
    """out's relative distance from the fp32 product of the dequantized operands a8 [M, K] and b8 [N, K]."""
    dequantized = (a8.float() * a_inv) @ (b8.float() * b_inv).t()
    return ((out.float() - dequantized).norm() / dequantized.norm()).item()


def one_layer(tokens: int, n_out: int, width: int) -> tuple[dict, float]:
    """Times in µs of one layer's input-gradient GEMM, output gradient [tokens, n_out], weight [n_out, width]; and
    the largest error of the FP8 results against their dequantized operands' product."""
    grad = (torch.randn(tokens, n_out, device="cuda") * 1e-4).bfloat16()   # a gradient's size
    weight = (torch.randn(n_out, width, device="cuda") * 0.02).bfloat16()
    bf16, _ = replayed(lambda g, w: g @ w, grad, weight)
    rows, out_rows = replayed(fp8_linear.input_grad, grad, weight)
    rows_cast, (r8, r_inv, rw8, rw_inv) = replayed(fp8_linear.input_grad_casts, grad, weight)
    gemm_of_rows, _ = replayed(fp8_linear.input_grad_gemm, r8, r_inv, rw8, rw_inv, torch.bfloat16)
    cast_kernel, _ = replayed(fp8_rows.rows_to_e4m3, grad)
    cast_inductor, _ = replayed(lambda g: fp8.rows_to_fp8(g, fp8.E4M3), grad)
    tensor, out_tensor = replayed(tensor_input_grad, grad, weight)
    tensor_cast, ((t8, t_inv), (tw8, tw_inv)) = replayed(tensor_casts, grad, weight)
    scale = torch.finfo(fp8.E5M2).max / grad.float().abs().amax()   # as if the previous step's amax were this one's
    delayed, (out_delayed, _) = replayed(delayed_input_grad, grad, weight, scale)
    times = {"bf16": bench(bf16), "rows": bench(rows), "rows: casts": bench(rows_cast),
             "rows: gemm": bench(gemm_of_rows), "row cast: kernel": bench(cast_kernel),
             "row cast: Inductor": bench(cast_inductor), "tensor": bench(tensor), "delayed": bench(delayed)}
    for fast in (False, True):
        gemm, _ = replayed(lambda g, w, gi, wi: torch._scaled_mm(g, w.t(), scale_a=gi, scale_b=wi,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=fast),
                           t8, tw8, t_inv, tw_inv)
        times["tensor: gemm, fast" if fast else "tensor: gemm"] = bench(gemm)
    # A graph's outputs hold its last replay's values, and nothing before it: capture launches no kernel.
    for replay in (rows, rows_cast, tensor, tensor_cast, delayed):
        replay()
    return times, max(error(out_rows, r8, r_inv, rw8.t(), rw_inv), error(out_tensor, t8, t_inv, tw8, tw_inv),
                      error(out_delayed, delayed_cast(grad, scale)[0], scale.reciprocal(), tw8, tw_inv))


def main() -> int:
    why = fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a GPU that runs FP8 GEMMs ({why})")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    if not fp8_rows.takes(torch.zeros(8, 8, device="cuda")):
        sys.exit(f"error: this benchmark times the Triton row cast ({fp8_rows.unavailable(torch.device('cuda'))})")
    columns = ("bf16", "rows", "rows: casts", "rows: gemm", "row cast: kernel", "row cast: Inductor", "tensor",
               "tensor: gemm", "tensor: gemm, fast", "delayed")
    recipes = ("rows", "tensor", "delayed")
    print(f"{'µs a layer':26}" + "".join(f"{c:>19}" for c in columns) + f"{'error':>9}  ms a step saved: "
          + ", ".join(recipes))
    failed = False
    for model, batch in SIZES:
        config = PRESETS[model]
        C, tokens = config.n_embd, batch * SEQ_LEN
        step = [0.0] * len(recipes)
        for layer, n_out in (("c_attn", 3 * C), ("c_fc", 4 * C)):
            times, error = one_layer(tokens, n_out, C)
            saved = [(times["bf16"] - times[k]) * config.n_layer / 1000 for k in recipes]
            step = [a + b for a, b in zip(step, saved)]
            failed |= not error < 1e-2
            print(f"{f'{model} b{batch}, {layer}':26}" + "".join(f"{times[c]:19.1f}" for c in columns)
                  + f"{error:9.4f}  " + "".join(f"{x:9.2f}" for x in saved))
        print(f"{f'{model} b{batch}, both':26}{'':{19 * len(columns) + 11}}" + "".join(f"{x:9.2f}" for x in step))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
