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
    for rows, cols, transposed in ((48, 300, False), (40, 1040, False), (33, 64, True)):
        # Rows of sizes orders of magnitude apart, one with a spike, one of zeros.
        x = torch.randn(rows, cols) * 10 ** torch.empty(rows, 1).uniform_(-7, 2)
        x[1, 7], x[2] = 1e5, 0.0
        x = x.bfloat16()
        if transposed:
            x = x.t().contiguous().t()   # the same values, a column-major view
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
            scaled_equal=torch.equal(scaled, expected), spike=scaled[1, 7].item() if rows == 48 else None)
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(repo_root):
    return run_interpreted(CHECKS, repo_root)


@pytest.mark.parametrize("shape", ["48x300", "40x1040", "33x64"], ids=["narrow", "over_1024", "column_major"])
def test_the_kernel_scales_each_row_as_the_reference_does(results, shape):
    r = results[shape]
    rows, cols = map(int, shape.split("x"))
    assert r["takes"] and r["dtype"] == "torch.float8_e4m3fn" and r["shape"] == [rows, cols] and r["contiguous"]
    assert r["inv_shape"] == [rows, 1] and r["inv_equal"] and r["scaled_equal"]


def test_a_spike_is_scaled_into_the_top_binade_below_448(results):
    assert 224 < results["48x300"]["spike"] <= 448


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
    for cols in (4800, 6400, 100):
        x = (torch.randn(1024, cols, device="cuda") * 10 ** torch.empty(1024, 1, device="cuda").uniform_(-7, 2))
        x = x.bfloat16()
        x8, inv = fp8_rows.rows_to_e4m3(x)
        ref8, ref_inv = fp8.rows_to_fp8(x, fp8.E4M3)
        assert torch.equal(inv, ref_inv) and torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
        compiled8, compiled_inv = torch.compile(fp8_rows.rows_to_e4m3)(x)
        assert torch.equal(compiled8.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(compiled_inv, inv)
