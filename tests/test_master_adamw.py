"""Utils.kernels.master_adamw: AdamW for bf16 parameters from fp32 master weights, against its reference,
torch.optim.AdamW on fp32 parameters fed the same bf16 gradients: the master weights follow it to fp32
rounding, and each bf16 parameter is its master rounded to nearest, over param groups of their own weight decay,
with a folded clip's grad_scale; compiled on a GPU as well."""
import os

import pytest
import torch

from Utils.kernels.master_adamw import MasterAdamW

HYPER = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
SHAPES = [(48, 32), (32,), (7, 5), (48, 100)]   # the last over two of the kernel's 2,048-element blocks
DECAYS = [0.1, 0.0, 0.1, 0.1]


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


def _assert_follows(pair, reference, rtol=1e-6, atol=1e-7, exact_params=True):
    """MasterAdamW's masters, m and v are the reference's parameters and states; its parameters the masters
    rounded (to nearest, or within one step of the parameter's dtype where not exact_params)."""
    (params, opt), (copies, ref) = pair, reference
    for p, c in zip(params, copies):
        for mine, theirs in ((opt.state[p]["master"], c), (opt.state[p]["exp_avg"], ref.state[c]["exp_avg"]),
                             (opt.state[p]["exp_avg_sq"], ref.state[c]["exp_avg_sq"])):
            torch.testing.assert_close(mine.cpu(), theirs.detach(), rtol=rtol, atol=atol)
        master = opt.state[p]["master"]
        if exact_params:
            assert torch.equal(p.detach(), master.to(p.dtype))
        else:
            torch.testing.assert_close(p.detach().float(), master, rtol=2 ** -7, atol=0)


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
    assert opt.steps == 4
    _assert_follows(pair, reference)


def test_a_parameter_without_a_gradient_is_left_alone():
    (params, opt), _ = _pair()
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert all(torch.equal(p, b) for p, b in zip(params[1:], before[1:]))
    assert all(not opt.state[p][k].any() for p in params[1:] for k in ("exp_avg", "exp_avg_sq"))


def test_groups_that_differ_in_more_than_weight_decay_are_refused():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="weight_decay only"):
        MasterAdamW([{"params": [a]}, {"params": [b], "lr": 1e-3}], **HYPER)


def test_stochastic_rounding_picks_a_neighbour_with_the_probability_of_the_remainder():
    from Utils.kernels.master_adamw import _random_bits, round_stochastically
    n = 200_000
    below, above = 1.0, 1.0 + 2 ** -7                     # neighbouring bf16 values
    for fraction in (0.25, 0.8):
        x = torch.full((n,), below + fraction * (above - below))
        for sign in (1, -1):
            r = round_stochastically(sign * x, _random_bits(torch.arange(n), seed=12345)).float()
            assert set(r.abs().unique().tolist()) == {below, above}
            assert (r.abs() == above).float().mean().item() == pytest.approx(fraction, abs=0.01)
    exact = torch.tensor([1.0, -3.5, 0.0])                # already bf16: unchanged whatever the bits
    assert torch.equal(round_stochastically(exact, torch.full((3,), 0xFFFF)).float(), exact)


@pytest.mark.parametrize("seed", [0, 12345, 0x7FFFFFFF])
def test_the_random_bits_are_murmur3s_finalizer_of_the_index_modulo_2_to_the_32(seed):
    """The CPU path's int32 arithmetic against the hash written out on Python's integers, for indices past 2**31
    and 2**32 too (gpt2-xl's buckets pass 2**30 elements)."""
    from Utils.kernels.master_adamw import _random_bits

    def murmur(i: int) -> int:
        x = (i * 0x9E3779B1 + seed) % 2**32
        x = ((x ^ (x >> 16)) * 0x85EBCA6B) % 2**32
        x = ((x ^ (x >> 13)) * 0xC2B2AE35) % 2**32
        return (x ^ (x >> 16)) >> 16

    index = torch.tensor([0, 1, 2, 1000, 2**31 - 1, 2**31, 2**31 + 7, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**32 + 11])
    assert _random_bits(index, seed).tolist() == [murmur(i) for i in index.tolist()]


def test_the_cpu_path_rounds_a_slice_at_a_time_as_it_would_all_at_once(monkeypatch):
    """Each slice's random bits continue the tensor's and the bucket's element index: slicing changes nothing."""
    from Utils.kernels import master_adamw

    def one_step(slice_: int) -> list[torch.Tensor]:
        monkeypatch.setattr(master_adamw, "_CPU_SLICE", slice_)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (40, 64)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        MasterAdamW(params, **HYPER, masters=False).step()
        return [p.detach().clone() for p in params]

    whole, sliced = one_step(2**17), one_step(7)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))


def test_without_masters_updates_under_half_a_bf16_step_still_move_the_parameters():
    """Each update is about a tenth of a bf16 step: rounded to nearest the parameters would never move; rounded
    stochastically they follow fp32 AdamW on average, each element within a bf16 step or so of it."""
    n, steps, lr = 4096, 40, 1e-4
    start = torch.full((n,), 1.0)
    p, ref = torch.nn.Parameter(start.to(torch.bfloat16)), torch.nn.Parameter(start.clone())
    opt = MasterAdamW([p], lr=lr, betas=(0.9, 0.95), eps=1e-8, masters=False)
    reference = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grad = 1 + 0.1 * torch.randn(n, generator=g)
        p.grad, ref.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
        opt.step()
        reference.step()
    assert "master" not in opt.state[p] and opt.state[p]["exp_avg"].dtype == torch.bfloat16
    moved, expected = (start - p.detach().float()).mean().item(), (start - ref.detach()).mean().item()
    assert expected == pytest.approx(steps * lr, rel=0.05) and moved == pytest.approx(expected, rel=0.1)
    assert (p.detach().float() - ref.detach()).abs().mean().item() <= 2 ** -8   # a random walk about it


def test_a_nan_stays_nan_where_its_bits_would_carry_into_the_sign():
    from Utils.kernels.master_adamw import round_stochastically
    x = torch.tensor([0x7FFFFFFF, -1, 0x3F800000], dtype=torch.int32).view(torch.float32)   # two NaNs, then 1.0
    r = round_stochastically(x, torch.tensor([1, 1, 1]))
    assert r[:2].isnan().all() and r[2].item() == 1.0


def test_a_bucket_without_any_gradient_is_left_alone_on_the_cpu():
    w, ln = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(3))
    opt = MasterAdamW([w, ln], **HYPER)
    w.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert (opt.state[w]["master"] < 1).all() and torch.equal(ln.detach(), torch.ones(3))


def test_groups_are_added_before_the_first_step():
    (params, opt), _ = _pair()
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    with pytest.raises(ValueError, match="before it"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_fp16_parameters_need_masters():
    with pytest.raises(ValueError, match="bf16 only"):
        MasterAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], **HYPER, masters=False)


def _padding_is_zero(opt):
    """m and v between the tensors of each bucket (each starts at a multiple of BLOCK) are never written."""
    for bucket in opt._buckets:
        used = torch.zeros(bucket.exp_avgs.numel(), dtype=torch.bool)
        for p, start in zip(bucket.params, bucket.start_list):
            used[start:start + p.numel()] = True
        unused = ~used.to(bucket.exp_avgs.device)
        if bucket.exp_avgs[unused].any() or bucket.exp_avg_sqs[unused].any():
            return False
    return True


def _rounded_alike(device_of_kernel):
    """(the kernel's, the foreach path's) parameters and v after one step without masters over three tensors of one
    bucket, the kernel's on device_of_kernel: the same 16 random bits an element, each from its place. Every size a
    multiple of 8: the kernel's ALIGNED form, 16 bytes a load (the masters' tests above run the other)."""
    from Utils.kernels import master_adamw
    kernel, out = master_adamw._kernel, []
    for device, master_adamw._kernel in ((device_of_kernel, kernel), ("cpu", None)):
        g = torch.Generator().manual_seed(3)
        ws = [torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16).to(device)) for n in (5000, 3000, 72)]
        o = MasterAdamW([{"params": ws, "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, masters=False)
        for w in ws:
            w.grad = torch.randn(w.shape, generator=g).to(torch.bfloat16).to(device)
        o.step()
        assert o._buckets[0].aligned
        out.append((torch.cat([w.detach().float().cpu() for w in ws]),
                    torch.cat([o.state[w]["exp_avg_sq"].float().cpu() for w in ws])))
    master_adamw._kernel = kernel
    return out


# The Triton kernel under Triton's interpreter, in a fresh process: the same steps as above, with fp32 parameters
# beside (a second bucket, a second launch), one of them never given a gradient. The interpreter rounds fp32 to
# bf16 toward zero, so the parameters are checked against their masters to one bf16 step there; without masters,
# after one step only, since its truncated bf16 m and v would part it from the foreach path afterwards.
KERNEL_CHECK = """
import json, torch
import test_master_adamw as t
from Utils.kernels import master_adamw
pair, reference = t._pair()
params, opt = pair
g = torch.Generator().manual_seed(5)
fp32, idle = torch.nn.Parameter(torch.randn(3000, generator=g)), torch.nn.Parameter(torch.randn(10))
fp32_copy = torch.nn.Parameter(fp32.detach().clone())
opt.add_param_group({"params": [fp32, idle], "weight_decay": 0.0})
ref32 = torch.optim.AdamW([fp32_copy], **t.HYPER, weight_decay=0.0, foreach=False)
scales = [1.0, 4.0, 0.5, 2.0, 8.0, 1.0]
for i, scale in enumerate(scales):
    fp32_copy.grad = torch.randn(3000, generator=g)
    fp32.grad = fp32_copy.grad * scale
    t._steps(pair, reference, n=1, scales=[scale], seed=10 + i)
    ref32.step()
t._assert_follows(pair, reference, exact_params=False)
fp32_follows = bool(torch.allclose(fp32.detach(), fp32_copy.detach(), rtol=1e-6, atol=1e-7))
ran = master_adamw._kernel is not None and master_adamw.INTERPRETED and len(opt._buckets) == 2
(kw, kv), (ew, ev) = t._rounded_alike("cpu")
nan = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
o = t.MasterAdamW([nan], **t.HYPER, masters=False)
nan.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=torch.bfloat16)
o.step()
print(json.dumps(dict(ran=ran and not any(b.aligned for b in opt._buckets), fp32_follows=fp32_follows,
                      idle=bool(not opt.state[idle]["exp_avg"].any()),
                      padding=t._padding_is_zero(opt), same=bool(torch.equal(kw, ew)),
                      v=bool(torch.allclose(kv, ev, rtol=2 ** -7, atol=0)),
                      nan=[bool(x) for x in nan.detach().isnan()])))
"""


def test_the_triton_kernel_follows_fp32_adamw_under_the_interpreter(repo_root):
    from conftest import run_interpreted
    tests = os.path.join(repo_root, "tests")
    r = run_interpreted(f"import sys; sys.path.insert(0, {tests!r})\n" + KERNEL_CHECK, repo_root)
    assert r == {"ran": True, "fp32_follows": True, "idle": True, "padding": True, "same": True, "v": True,
                 "nan": [False, True, False, False]}


@pytest.mark.parametrize("masters", [True, False])
def test_the_kernel_compiled_for_hopper_moves_16_bytes_a_load_where_aligned(masters):
    """Compiled ahead of time for an H100 (sm_90), no GPU needed: with ALIGNED every access to a tensor is a 16-byte
    vector load or store, and only the tables' entries are read singly. Without the hints the kernel read and
    wrote each bf16 element alone."""
    import re
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from Utils.kernels import master_adamw
    state = "fp32" if masters else "bf16"
    pointers = dict(grad_addrs="i64", param_addrs="i64", tensor_of_block="i32", starts="i64", numels="i64",
                    keeps="fp32", masters="fp32" if masters else state, exp_avgs=state, exp_avg_sqs=state,
                    grad_scale="fp32")
    scalars = dict(step_size="fp32", bias_correction2_sqrt="fp32", beta1="fp32", one_minus_beta1="fp32",
                   beta2="fp32", one_minus_beta2="fp32", eps="fp32", seed="i32")
    constants = dict(GRAD=tl.bfloat16, PARAM=tl.bfloat16, MASTERS=masters, STOCHASTIC=not masters, ALIGNED=True,
                     BLOCK=master_adamw.BLOCK)
    signature = {**{k: "*" + v for k, v in pointers.items()}, **scalars, **{k: "constexpr" for k in constants}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}   # as the launch specializes them
    compiled = triton.compile(ASTSource(master_adamw._kernel, signature, constants, aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": master_adamw.NUM_WARPS})
    accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= accesses and not {"ld.global.b16", "st.global.b16"} & accesses


@pytest.mark.gpu
def test_compiled_on_a_gpu_follows_fp32_adamw_too():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    on_gpu, reference = _pair(device="cuda")
    _steps(on_gpu, reference, scales=[1.0, 4.0, 0.5, 2.0, 8.0, 1.0])
    _assert_follows(on_gpu, reference, rtol=1e-5, atol=1e-6)
    assert _padding_is_zero(on_gpu[1])


@pytest.mark.gpu
def test_without_masters_the_gpu_kernel_rounds_as_the_foreach_path():
    """The same random bits an element on the GPU as on the CPU: the parameters agree but where the two fp32
    results differ in their last bits near a rounding boundary (a few in 8,072 at most)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (kw, kv), (ew, ev) = _rounded_alike("cuda")
    assert (kw != ew).sum().item() <= 4 and torch.allclose(kv, ev, rtol=2 ** -8, atol=0)
