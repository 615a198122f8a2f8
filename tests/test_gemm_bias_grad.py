"""Utils.kernels.gemm_bias_grad, in its layer Utils.ladder.linear.linear: a linear layer whose bias gradient comes out of its weight-gradient GEMM,
against its reference, the plain linear layer (autograd's bias gradient is a sum over the tokens): over
float64, float32 and bf16, under bf16 autocast, and compiled, where the kernel that makes the input
writes it straight into the buffer beside its columns of ones."""
import pytest
import torch
import torch.nn as nn

from Utils.kernels import cublaslt, gemm_bias_grad
from Utils.ladder import linear
from Utils.ladder.linear import LinearPlan


def in_gemm(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The layer with its bias gradient from its weight-gradient GEMM."""
    return linear.linear(x, layer, LinearPlan(bias_grad=True))

TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-5),
              torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2)}


def test_one_gemm_gives_the_weight_gradient_and_the_bias_gradient():
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(40, 24, generator=g, dtype=torch.float64), torch.randn(40, 16, generator=g, dtype=torch.float64)
    x_ones = gemm_bias_grad.with_ones(x)
    assert x_ones.shape == (40, 24 + gemm_bias_grad.ONES) and torch.equal(x_ones[:, :24], x)
    assert torch.equal(x_ones[:, 24:], torch.ones(40, gemm_bias_grad.ONES, dtype=torch.float64))
    weight_grad, bias_grad = gemm_bias_grad.weight_and_bias_grad(dy, x_ones)
    torch.testing.assert_close(weight_grad, dy.t() @ x, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(bias_grad, dy.sum(0), rtol=1e-14, atol=1e-14)


def _layer_and_input(dtype, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(24, 16).to(dtype)
    nn.init.normal_(layer.bias)
    x = torch.randn(3, 10, 24, dtype=dtype, requires_grad=True)
    return layer, x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_output_and_gradients_are_the_plain_layers(dtype):
    grads = []
    for op in (in_gemm, gemm_bias_grad.reference):
        layer, x = _layer_and_input(dtype)
        y = op(x, layer)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y))
        grads.append((y, x.grad, layer.weight.grad, layer.bias.grad))
    for got, want in zip(*grads):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_gradcheck_in_float64():
    g = torch.Generator().manual_seed(1)
    x, weight, bias = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                       for shape in ((2, 3, 5), (4, 5), (4,)))

    def of_tensors(x, weight, bias):
        layer = nn.Module()   # gradcheck differentiates the layer's tensors as inputs
        layer.weight, layer.bias = weight, bias
        return in_gemm(x, layer)
    assert torch.autograd.gradcheck(of_tensors, (x, weight, bias))


def test_under_bf16_autocast_it_computes_in_bf16_and_gives_fp32_gradients():
    grads = []
    for op in (in_gemm, gemm_bias_grad.reference):
        layer, x = _layer_and_input(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = op(x, layer)
        y.float().sum().backward()
        grads.append((y, layer.weight.grad, layer.bias.grad))
    (y, weight_grad, bias_grad), (want_y, want_weight_grad, want_bias_grad) = grads
    assert y.dtype == want_y.dtype == torch.bfloat16
    assert bias_grad.dtype == weight_grad.dtype == torch.float32
    # Both are sums of the same bf16 products in fp32, rounded to bf16: equal to that rounding.
    torch.testing.assert_close(bias_grad, want_bias_grad, rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(weight_grad, want_weight_grad, rtol=2 ** -7, atol=1e-6)


class _NormThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 48)

    def forward(self, x):
        return in_gemm(self.ln(x), self.fc)


def test_compiled_the_layernorm_writes_beside_its_ones_and_equals_eager():
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _NormThenLinear(), torch.randn(4, 16, 32)
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)

    def step():
        loss = compiled(x).square().sum()
        loss.backward()
        return loss
    _, code = run_and_get_code(step)
    code = "\n".join(code)
    # One generated kernel both normalizes and fills the concatenated buffer: no copy of X into it.
    kernels = {word for word in code.replace("(", " ").split() if "fused" in word}
    assert any("native_layer_norm" in k and "cat" in k for k in kernels), sorted(kernels)
    for want, p in zip(eager, model.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5)



# ---------------------------------------------------------------------------------------------
# cuBLASLt reads X as the first columns of [X 1] (Utils.kernels.gelu_epilogue's c_fc GEMM)

def _aligned(*shape, device="cpu"):
    """A bf16 tensor whose data starts on a 256-byte boundary, as the GPU allocator's do."""
    n = torch.Size(shape).numel()
    buffer = torch.zeros(n + 128, dtype=torch.bfloat16, device=device)
    skip = (-buffer.data_ptr() % 256) // 2
    return buffer[skip:skip + n].view(shape)


@pytest.mark.parametrize("width, accepted", [(16, True), (12, False)])
def test_cublaslt_takes_x_as_the_first_columns_of_a_wider_matrix_with_aligned_rows(width, accepted):
    x = _aligned(4, width)[:, :8]   # rows 16 elements (32 bytes) apart: aligned; 12 (24 bytes): not
    args = dict(y=_aligned(16, 8), out=_aligned(4, 16), bias=_aligned(16), aux=_aligned(4, 16))
    # Everything else right, a CPU tensor is refused last: "CUDA device" means the layout was accepted.
    with pytest.raises(ValueError, match="CUDA device" if accepted else "contiguous"):
        cublaslt._matmul(cublaslt.CUBLASLT_EPILOGUE_GELU_AUX_BIAS, x, args["y"], args["out"], args["bias"],
                         args["aux"], y_t=True)
    # Transposed, x must be contiguous: the leading dimension given to cuBLASLt is that of x's rows.
    with pytest.raises(ValueError, match="contiguous"):
        cublaslt._matmul(cublaslt.CUBLASLT_EPILOGUE_GELU_AUX_BIAS, _aligned(8, width)[:, :4], args["y"],
                         args["out"], args["bias"], args["aux"], x_t=True, y_t=True)


@pytest.mark.gpu
def test_on_a_gpu_the_epilogue_gemm_reads_x_beside_its_ones_as_it_reads_x_alone():
    assert cublaslt.unavailable(torch.device("cuda")) is None
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16, generator=g)
    view = gemm_bias_grad.with_ones(x)[:, :64]
    assert not view.is_contiguous()
    for got, want in zip(cublaslt.linear_gelu(view, w, b), cublaslt.linear_gelu(x, w, b)):
        torch.testing.assert_close(got, want)   # to rounding: each layout times its own candidate kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_output_and_gradients_are_the_plain_layers(dtype):
    grads = []
    for op in (in_gemm, gemm_bias_grad.reference):
        torch.manual_seed(0)
        layer = nn.Linear(768, 2304, device="cuda", dtype=dtype)
        x = torch.randn(4, 256, 768, device="cuda", dtype=dtype, requires_grad=True)
        y = op(x, layer)
        y.backward(torch.randn_like(y))
        grads.append((y, x.grad, layer.weight.grad, layer.bias.grad))
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **tol)
