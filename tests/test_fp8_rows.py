"""Utils.kernels.fp8_rows: the gradient's row cast to e4m3 as one Triton kernel, against its reference
fp8.rows_to_fp8, run on a CPU through Triton's interpreter (in a subprocess: the variable must be set before
triton is imported); and fp8.power_of_two_below, the scale both take."""
import pytest
import torch

from conftest import run_interpreted
from Utils.kernels import fp8, fp8_linear, fp8_rows

CHECKS = """
    import json
    import torch
    from Utils.kernels import fp8, fp8_rows

    torch.manual_seed(0)
    out = {}
    for rows, cols in ((48, 300), (40, 1040)):
        # Rows of sizes orders of magnitude apart, one with a spike, one of zeros, one with a NaN, one with an inf.
        x = torch.randn(rows, cols) * 10 ** torch.empty(rows, 1).uniform_(-7, 2)
        x[1, 7], x[2], x[3, 5], x[4, 9] = 1e5, 0.0, float("nan"), float("inf")
        x = x.bfloat16()
        x8, inv = fp8_rows.rows_to_e4m3(x)
        ref8, ref_inv = fp8.rows_to_fp8(x, fp8.E4M3)
        # The values the kernel casts, stored in fp32: the interpreter's own conversion to e4m3 rounds ties away
        # from zero and carries a mantissa's overflow wrongly (127 to 64), where the GPU's rounds to nearest even.
        scaled, inv32 = torch.empty(rows, cols), torch.empty(rows, 1)
        fp8_rows._launch(x, scaled, inv32)
        expected = (x.float() / ref_inv).clamp(-448, 448)
        out[f"{rows}x{cols}"] = dict(
            takes=fp8_rows.takes(x), dtype=str(x8.dtype), shape=list(x8.shape), contiguous=x8.is_contiguous(),
            inv_shape=list(inv.shape), inv_equal=torch.equal(inv, ref_inv) and torch.equal(inv32, ref_inv),
            scaled_equal=bool(((scaled == expected) | (scaled.isnan() & expected.isnan())).all()),
            nan_row=[scaled[3].isnan().sum().item(), inv32[3].item()],
            inf_row=[scaled[4].isnan().sum().item(), inv32[4].item()],
            spike=scaled[1, 7].item())
    out["column_major_taken"] = fp8_rows.takes(torch.zeros(64, 32).t())
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(repo_root):
    return run_interpreted(CHECKS, repo_root)


@pytest.mark.parametrize("shape", ["48x300", "40x1040"], ids=["narrow", "over_1024"])
def test_the_kernel_scales_each_row_as_the_reference_does(results, shape):
    r = results[shape]
    rows, cols = map(int, shape.split("x"))
    assert r["takes"] and r["dtype"] == "torch.float8_e4m3fn" and r["shape"] == [rows, cols] and r["contiguous"]
    assert r["inv_shape"] == [rows, 1] and r["inv_equal"] and r["scaled_equal"]
    assert 224 < r["spike"] <= 448   # the largest power of two: the row's amax lands in the top binade


@pytest.mark.parametrize("shape", ["48x300", "40x1040"], ids=["narrow", "over_1024"])
def test_a_nan_or_an_inf_in_a_row_is_not_cast_to_finite_values(results, shape):
    # NaN: the amax is NaN and the scale's exponent bits all ones (inf): the NaN stays NaN, the row's other values
    # go to ±448, and the inverse scale is 0, so the GEMM's row is NaN. inf: the scale is 0, so the inf becomes NaN,
    # the row's other values 0 and the inverse scale inf. As torch's operations do (the reference).
    r = results[shape]
    assert r["nan_row"] == [1, 0.0] and r["inf_row"] == [1, float("inf")]


def test_a_column_major_tensor_is_left_to_inductor(results):
    assert results["column_major_taken"] is False


def test_the_input_gradient_casts_its_rows_through_the_kernel_where_it_takes_them(monkeypatch):
    calls = []

    def kernel(x):
        calls.append(tuple(x.shape))
        return fp8.rows_to_fp8(x, fp8.E4M3)
    torch.manual_seed(3)
    grad, weight = (torch.randn(48, 192) * 1e-4).bfloat16(), (torch.randn(192, 64) * 0.02).bfloat16()
    without = fp8_linear.input_grad(grad, weight)
    monkeypatch.setattr(fp8_rows, "takes", lambda x: True)
    monkeypatch.setattr(fp8_rows, "rows_to_e4m3", kernel, raising=False)
    assert torch.equal(fp8_linear.input_grad(grad, weight), without) and calls == [(48, 192)]


def test_without_triton_or_a_gpu_the_kernel_is_refused_and_says_why():
    if fp8_rows.triton is None:
        assert fp8_rows.unavailable(torch.device("cpu")) == "the FP8 row cast needs Triton"
    elif not fp8_rows.INTERPRETED:
        assert "needs a GPU" in fp8_rows.unavailable(torch.device("cpu"))
        assert not fp8_rows.takes(torch.zeros(4, 32))
    assert not fp8_rows.takes(torch.zeros(2, fp8_rows.MAX_ROW + 1, device="meta"))


@pytest.mark.parametrize("q", [1.0, 3.0, 448.0, 2.0**20 * (1 - 2**-24), 1e-30, 7e37])
def test_the_scale_is_the_largest_power_of_two_not_above_q(q):
    s = fp8.power_of_two_below(torch.tensor([q], dtype=torch.float32)).item()
    assert s <= q < 2 * s and s == 2.0 ** torch.tensor(s).log2().round().item()


@pytest.mark.gpu
def test_the_kernel_is_the_reference_bit_for_bit_on_the_gpu():
    if not torch.cuda.is_available() or fp8_rows.unavailable(torch.device("cuda")):
        pytest.skip("no CUDA GPU with Triton")
    torch.manual_seed(1)
    compiled = torch.compile(fp8_rows.rows_to_e4m3)
    for cols in (4800, 6400, 100):
        x = (torch.randn(1024, cols, device="cuda") * 10 ** torch.empty(1024, 1, device="cuda").uniform_(-7, 2))
        # Rows whose amax makes 448 / amax exact (7 and 0.4375: 64 and 1024), where an approximate division can
        # land below the power of two and halve the scale.
        x[0, :2], x[1, :2] = 7.0, 0.4375
        x[0, 2:], x[1, 2:] = x[0, 2:].clamp(-6, 6), x[1, 2:].clamp(-0.4, 0.4)
        x[2, 3] = float("nan")   # Triton's clamp drops a NaN unless told to keep it (the interpreter's keeps it)
        x = x.bfloat16()
        x8, inv = fp8_rows.rows_to_e4m3(x)
        ref8, ref_inv = fp8.rows_to_fp8(x, fp8.E4M3)
        assert inv[0].item() == 1 / 64 and inv[1].item() == 1 / 1024
        assert torch.equal(inv, ref_inv) and torch.equal(x8.float().isnan(), ref8.float().isnan())
        assert x8.float()[2].isnan().sum().item() == 1
        finite = ~ref8.float().isnan()
        assert torch.equal(x8.view(torch.uint8)[finite], ref8.view(torch.uint8)[finite])
        # One compiled function over the three widths: from the second on, Dynamo compiles with a symbolic width,
        # which the launch must make concrete (a symbolic BLOCK became code Inductor could not run)
        compiled8, compiled_inv = compiled(x)
        assert torch.equal(compiled8.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(compiled_inv, inv)


@pytest.mark.gpu
def test_the_input_gradient_runs_the_kernel_inside_a_cuda_graph_as_it_runs_eagerly():
    if not torch.cuda.is_available() or fp8_rows.unavailable(torch.device("cuda")) or fp8.unavailable(
            torch.device("cuda")):
        pytest.skip("no CUDA GPU with Triton and FP8")
    torch.manual_seed(2)
    grad = (torch.randn(4096, 4800, device="cuda") * 1e-4).bfloat16()
    weight = (torch.randn(4800, 1600, device="cuda") * 0.02).bfloat16()
    eager = fp8_linear.input_grad(grad, weight)
    graphed = torch.compile(fp8_linear.input_grad, mode="reduce-overhead")
    for _ in range(3):   # warm-up, capture, replay
        out = graphed(grad, weight).clone()
    assert torch.equal(out, eager)
