"""Utils.kernels.master_adamw: AdamW for bf16 parameters from fp32 master weights, against its reference,
torch.optim.AdamW on fp32 parameters fed the same bf16 gradients: the master weights follow it to fp32
rounding, and each bf16 parameter is its master rounded to nearest, over param groups of their own weight decay,
with a folded clip's grad_scale; compiled on a GPU as well."""
import pytest
import torch

from Utils.kernels.master_adamw import MasterAdamW

HYPER = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
SHAPES = [(48, 32), (32,), (7, 5)]
DECAYS = [0.1, 0.0, 0.1]


def _pair(dtype=torch.bfloat16, device="cpu", eps=HYPER["eps"]):
    """(MasterAdamW over parameters in dtype, torch's AdamW over fp32 copies of them): three tensors in two
    groups, one decayed and one not, as the suite's parameter groups."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]
    copies = [torch.nn.Parameter(p.detach().float().cpu().clone()) for p in params]

    def groups(ps):
        return [{"params": [p for p, d in zip(ps, DECAYS) if d], "weight_decay": 0.1},
                {"params": [p for p, d in zip(ps, DECAYS) if not d], "weight_decay": 0.0}]
    hyper = {**HYPER, "eps": eps}
    return (params, MasterAdamW(groups(params), **hyper)), (copies, torch.optim.AdamW(groups(copies), **hyper,
                                                                                      foreach=False))


def _steps(pair, reference, n=6, scales=None, seed=1, step=None):
    """n steps of both on the same gradients; with scales, MasterAdamW's gradients are scales[i] times the
    reference's and its grad_scale says so. step: how MasterAdamW's step is called (its own step by default)."""
    (params, opt), (copies, ref) = pair, reference
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        scale = scales[i] if scales else 1.0
        for p, c in zip(params, copies):
            grad = (torch.randn(p.shape, generator=g) * 3).to(p.dtype).to(p.device)
            p.grad, c.grad = grad, grad.float().cpu() / scale
        if scales:
            opt.grad_scale = torch.tensor(scale, device=params[0].device)
        (step or opt.step)()
        ref.step()


def _assert_follows(pair, reference, rtol=1e-6, atol=1e-7):
    """MasterAdamW's masters, m and v are the reference's parameters and states; its parameters the masters
    rounded."""
    (params, opt), (copies, ref) = pair, reference
    for p, c in zip(params, copies):
        for mine, theirs in ((opt.state[p]["master"], c), (opt.state[p]["exp_avg"], ref.state[c]["exp_avg"]),
                             (opt.state[p]["exp_avg_sq"], ref.state[c]["exp_avg_sq"])):
            torch.testing.assert_close(mine.cpu(), theirs.detach(), rtol=rtol, atol=atol)
        assert torch.equal(p.detach(), opt.state[p]["master"].to(p.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-8, 1e-2])   # a large eps tells where it is added (after the bias correction)
def test_masters_follow_fp32_adamw_and_parameters_are_them_rounded(dtype, eps):
    pair, reference = _pair(dtype, eps=eps)
    _steps(pair, reference)
    params, opt = pair
    assert all(opt.state[p]["master"].dtype == torch.float32 and p.dtype == dtype for p in params)
    _assert_follows(pair, reference)


def test_grad_scale_divides_each_gradient_as_the_folded_clip_asks():
    """A scale that changes from step to step (AdamW would not see a constant one, but m and v do)."""
    pair, reference = _pair()
    _steps(pair, reference, scales=[1.0, 4.0, 0.5, 2.0, 8.0, 1.0])
    _assert_follows(pair, reference)


def test_a_step_traced_by_torch_compile_counts_its_steps():
    """compiled_update wraps the update in torch.compile: the step count, kept in a tensor made when the optimizer
    is, still advances (bias corrections of steps 1, 2, 3, ...)."""
    pair, reference = _pair()
    opt = pair[1]
    _steps(pair, reference, n=4, step=torch.compile(lambda: opt.step()))
    assert opt._step.item() == 4
    _assert_follows(pair, reference)


def test_a_parameter_without_a_gradient_is_left_alone():
    (params, opt), _ = _pair()
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert all(torch.equal(p, b) for p, b in zip(params[1:], before[1:])) and len(opt.state) == 1


def test_groups_that_differ_in_more_than_weight_decay_are_refused():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="weight_decay only"):
        MasterAdamW([{"params": [a]}, {"params": [b], "lr": 1e-3}], **HYPER)


def test_compiled_the_update_is_one_fused_kernel_with_no_aten_fallback():
    """Inductor lowers every foreach operation of the update: an operation it cannot lower runs as an ATen kernel
    of its own that writes a full copy of its output (the ScalarList multiply did, 0.5 ms a step at 124M)."""
    import re
    from torch._inductor.utils import run_and_get_code

    from Utils.kernels import master_adamw
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    masters = [p.float() for p in params]
    states = [[torch.zeros(s) for s in SHAPES] for _ in range(2)]
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(master_adamw._update, dynamic=False), params, grads, masters,
                                   *states, [d * HYPER["lr"] for d in DECAYS], torch.ones(()), torch.ones(()),
                                   HYPER["lr"], *HYPER["betas"], HYPER["eps"])
    source = "\n".join(code)
    assert re.findall(r"aten\.\w+", source) == [] and len(set(re.findall(r"def (cpp_fused_\w+)", source))) <= 1
    assert all(torch.equal(p, w.to(torch.bfloat16)) for p, w in zip(params, masters))


@pytest.mark.gpu
def test_compiled_on_a_gpu_follows_fp32_adamw_too():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    on_gpu, reference = _pair(device="cuda")
    _steps(on_gpu, reference, scales=[1.0, 4.0, 0.5, 2.0, 8.0, 1.0])
    _assert_follows(on_gpu, reference, rtol=1e-5, atol=1e-6)
