"""Utils.kernels.triton_update: TritonUpdate, the gradient clip and AdamW as two Triton kernels, against its
reference (clip_grad_norm_, then torch's AdamW) run in float64 on float64 copies of the parameters. The
kernels run on the CPU under Triton's interpreter, in one subprocess; on a GPU in the gpu tests. The
kernels take fp32 parameters only: float64, bf16 and fp16 ones are refused."""
import pytest
import torch
import torch.nn as nn

from conftest import run_interpreted
from Utils.kernels import triton_update

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Everything that needs the kernels, in one subprocess: the interpreter starts slowly and runs slowly.

CHECKS = """
    import json

    import torch
    from Utils.kernels import triton_update as K

    CPU = torch.device("cpu")
    out = {"unavailable": K.unavailable(CPU)}

    def max_diff(a, b):
        return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))

    # --- Against the reference (clip_grad_norm_, then torch's AdamW) on float64 copies of the parameters,
    # fed the same fp32 gradients: its norm, and so its clip factor min(1, c / (norm + 1e-6)), in float64.
    LR, BETAS, EPS, MAX_NORM = 1e-2, (0.9, 0.95), 1e-8, 1.0

    def reference(params, decays, max_norm=MAX_NORM):
        \"\"\"(parameters, optimizer, update): K.reference on float64 copies of params, weight decay decays[i].\"\"\"
        params64 = [p.detach().double().clone().requires_grad_() for p in params]
        groups = {}
        for p, d in zip(params64, decays):
            groups.setdefault(d, []).append(p)
        opt64, update64 = K.reference([dict(params=ps, weight_decay=d) for d, ps in groups.items()], lr=LR,
                                      betas=BETAS, eps=EPS, max_norm=max_norm)
        return params64, opt64, update64

    def reference_step(params64, opt64, update64, grads, scale_up=False):
        \"\"\"One reference update with these gradients; scale_up: every step's gradients scaled to the clip's
        norm, those below it too (a wrong clip, which the tests must tell apart).\"\"\"
        present = [x.double() for x in grads if x is not None]
        norm = torch.sqrt(sum((x * x).sum() for x in present))
        factor = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        up = MAX_NORM / (norm + 1e-6) if scale_up else 1.0
        for p, x in zip(params64, grads):
            p.grad = None if x is None else x.double() * up
        update64()
        return norm.item(), factor.item()

    def moments_err(opt, params, opt64, params64, key):
        return max(((opt.state[p][key].double() - opt64.state[q][key]).abs().max()
                    / opt64.state[q][key].abs().max()).item() for p, q in zip(params, params64))

    def random_grads(params, norm, gen, skip=()):
        grads = [None if i in skip else torch.randn(p.shape, generator=gen) for i, p in enumerate(params)]
        total = torch.sqrt(sum((x.double() ** 2).sum() for x in grads if x is not None)).item()
        return [None if x is None else x * (norm / total) for x in grads]

    def compare(params, decays, norms, gen, grad_buffers=None, none_at=None, none_step=None):
        \"\"\"Steps TritonUpdate and the references through `norms`; step `none_step` leaves parameter `none_at`
        without a gradient. grad_buffers[i], where given, is a larger tensor whose head is parameter i's
        gradient (its tail is garbage the kernels must not read).\"\"\"
        groups = {}
        for p, d in zip(params, decays):
            groups.setdefault(d, []).append(p)
        opt = K.TritonUpdate([dict(params=ps, weight_decay=d) for d, ps in groups.items()], lr=LR, betas=BETAS,
                             eps=EPS, max_norm=MAX_NORM)
        ref = reference(params, decays)
        wrong = {"unclipped": reference(params, decays, max_norm=float("inf")),
                 "no_decay": reference(params, [0.0] * len(params)),
                 "scaled_up": reference(params, decays, max_norm=float("inf"))}
        steps = []
        for s, norm in enumerate(norms):
            skip = (none_at,) if s == none_step else ()
            grads = random_grads(params, norm, gen, skip)
            for i, (p, x) in enumerate(zip(params, grads)):
                if x is not None and grad_buffers and i in grad_buffers:
                    grad_buffers[i][:x.numel()] = x.flatten()
                    x = grad_buffers[i][:x.numel()].view_as(p)
                p.grad = x
            kept = [None if p.grad is None else (p.grad.clone(), p.grad.data_ptr()) for p in params]
            before = [p.detach().clone() for p in params]
            before_moments = [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in params]
            opt.step()
            kernel_norm = opt._partials.sum().sqrt().item()   # the norm the clip factor came from
            norm64, factor = reference_step(*ref, grads)
            for name, w in wrong.items():
                reference_step(*w, grads, scale_up=name == "scaled_up")
            rec = dict(norm=norm64, kernel_norm=kernel_norm, factor=factor,
                       err=max_diff(params, ref[0]) / LR,
                       moved=max_diff(params, before) / LR,
                       grads_untouched=all(k is None or (torch.equal(p.grad, k[0]) and p.grad.data_ptr() == k[1])
                                           for p, k in zip(params, kept)),
                       exp_avg=moments_err(opt, params, ref[1], ref[0], "exp_avg"),
                       exp_avg_sq=moments_err(opt, params, ref[1], ref[0], "exp_avg_sq"),
                       wrong={name: max_diff(params, w[0]) / LR for name, w in wrong.items()})
            if skip:
                i = none_at
                rec["none_param_unchanged"] = torch.equal(params[i], before[i])
                state = opt.state[params[i]]
                rec["none_moments_unchanged"] = (torch.equal(state["exp_avg"], before_moments[i][0])
                                                 and torch.equal(state["exp_avg_sq"], before_moments[i][1]))
                rec["none_param_exp_avg_max"] = opt.state[params[i]]["exp_avg"].abs().max().item()
                rec["none_param_ref_grad_is_none"] = ref[0][i].grad is None
            steps.append(rec)
        counted = [int(opt.state[p]["step"]) for p in params]
        return dict(steps=steps, steps_counted=counted,
                    reference_steps_counted=[int(ref[1].state[p]["step"]) for p in ref[0]])

    gen = torch.Generator().manual_seed(2)

    # At the kernels' own BLOCK: a parameter of 4,100 elements spans two blocks, the second almost empty.
    big = [torch.nn.Parameter(torch.randn(41, 100, generator=gen) * 0.5),
           torch.nn.Parameter(torch.randn(50, generator=gen) * 0.5)]
    out["default_block_case"] = compare(big, [0.1, 0.0], [30.0, 0.1, 6.0], gen)
    out["default_block_case"]["blocks"] = [-(-p.numel() // K.BLOCK) for p in big]

    # BLOCK is read at construction and at each step: 64 makes the small tensors span several blocks.
    K.BLOCK = 64
    # A matrix of 1,776 elements (28 blocks, the last partly masked), a matrix of exactly one block, a bias of
    # two blocks and a single-element gain; weight decay 0.1 on the matrices, none on the others. The bias
    # is the head of a larger buffer (its tail must not be written) and so is its gradient (its tail holds
    # large values that neither kernel may read).
    bias_buffer = torch.full((164,), 7.0)
    bias_buffer[:100] = torch.randn(100, generator=gen) * 0.5
    params = [torch.nn.Parameter(torch.randn(48, 37, generator=gen) * 0.5),
              torch.nn.Parameter(torch.randn(8, 8, generator=gen) * 0.5),
              torch.nn.Parameter(bias_buffer[:100]),
              torch.nn.Parameter(torch.ones(1))]
    out["bias_shares_buffer"] = params[2].data_ptr() == bias_buffer.data_ptr()
    grad_buffer = torch.full((164,), 1e3)
    # Norms above the clip (40, 8, 25, 12) and below it (0.05, 0.3), changing from step to step: Adam is
    # blind to a constant gradient scale, so a clip shows only where it rescales some steps against others.
    out["small_block_case"] = compare(params, [0.1, 0.1, 0.0, 0.0], [40.0, 0.05, 8.0, 0.3, 25.0, 12.0], gen,
                                      grad_buffers={2: grad_buffer}, none_at=2, none_step=4)
    out["small_block_case"]["blocks"] = [-(-p.numel() // K.BLOCK) for p in params]
    out["bias_tail_untouched"] = bool((bias_buffer[100:] == 7.0).all())
    out["grad_tail_untouched"] = bool((grad_buffer[100:] == 1e3).all())

    # --- Refusals, each as (exception type, message); where a step refuses, the parameters must not move.
    def error(fn):
        try:
            fn()
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None

    def make(params, **kw):
        return K.TritonUpdate(params, **{**dict(lr=LR, betas=BETAS, eps=EPS), **kw})

    p = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    opt = make([p])
    p.grad = torch.randn(8, 8, generator=gen)
    before = p.detach().clone()
    errors = {"closure": error(lambda: opt.step(lambda: 0.0))}
    errors["closure_left_params"] = torch.equal(p, before)
    errors["add_param_group"] = error(lambda: opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(8))])))
    q = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    opt_q = make([q])
    q.grad = torch.randn(8, 8, generator=gen).t()   # the right shape and dtype, not contiguous
    before = q.detach().clone()
    errors["strided_grad"] = error(opt_q.step)
    errors["strided_grad_left_params"] = torch.equal(q, before)
    # A gradient 4 bytes into its buffer: the kernels load four values per instruction from 16-byte boundaries.
    r = torch.nn.Parameter(torch.randn(8, generator=gen))
    opt_r = make([r])
    r.grad = torch.randn(9, generator=gen)[1:]
    before = r.detach().clone()
    errors["misaligned_grad"] = error(opt_r.step)
    errors["misaligned_grad_left_params"] = torch.equal(r, before)
    errors["misaligned_param"] = error(lambda: make([torch.nn.Parameter(torch.randn(9)[1:])]))
    errors["float64_param"] = error(lambda: make([torch.nn.Parameter(torch.randn(8, dtype=torch.float64))]))
    errors["bfloat16_param"] = error(lambda: make([torch.nn.Parameter(torch.randn(8).bfloat16())]))
    errors["float16_in_one_group"] = error(lambda: make([dict(params=[torch.nn.Parameter(torch.randn(8))]),
                                                        dict(params=[torch.nn.Parameter(torch.randn(8).half())])]))
    errors["strided_param"] = error(lambda: make([torch.nn.Parameter(torch.randn(8, 4).t())]))
    errors["two_devices"] = error(lambda: make([torch.nn.Parameter(torch.randn(8)),
                                                torch.nn.Parameter(torch.randn(8, device="meta"))]))
    errors["mixed_betas"] = error(lambda: make([dict(params=[torch.nn.Parameter(torch.randn(8))]),
                                                dict(params=[torch.nn.Parameter(torch.randn(8))], betas=(0.8, 0.95))]))
    errors["mixed_eps"] = error(lambda: make([dict(params=[torch.nn.Parameter(torch.randn(8))]),
                                              dict(params=[torch.nn.Parameter(torch.randn(8))], eps=1e-6)]))
    errors["zero_max_norm"] = error(lambda: make([torch.nn.Parameter(torch.randn(8))], max_norm=0.0))
    errors["beta_one"] = error(lambda: make([torch.nn.Parameter(torch.randn(8))], betas=(0.9, 1.0)))

    # --- What changes between steps: a parameter's storage replaced, the learning rate lowered, and a
    # state_dict moved between optimizers (torch's AdamW's into TritonUpdate, and TritonUpdate's own).
    def pair(n=300, decay=0.1):
        a = [torch.nn.Parameter(torch.randn(n, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
        return a, [d for d in (decay, 0.0)]

    def grads_for(params, norm):
        return random_grads(params, norm, gen)

    params, decays = pair()
    opt = K.TritonUpdate([dict(params=[params[0]], weight_decay=0.1), dict(params=[params[1]], weight_decay=0.0)],
                         lr=LR, betas=BETAS, eps=EPS, max_norm=MAX_NORM)
    ref = reference(params, decays)
    errs = []
    for s, norm in enumerate([5.0, 0.2, 3.0, 0.5]):
        if s == 1:   # a new storage for the first parameter, as `p.data = ...` or a move would make
            old = params[0].data
            params[0].data = old.clone()
            old_before = old.clone()
        if s == 2:
            for group in opt.param_groups + ref[1].param_groups:
                group["lr"] = LR / 4
        grads = grads_for(params, norm)
        for p, x in zip(params, grads):
            p.grad = x
        opt.step()
        reference_step(*ref, grads)
        errs.append(max_diff(params, ref[0]) / LR)
    out["moved_storage"] = dict(errs=errs, old_untouched=torch.equal(old, old_before))

    # torch's AdamW, two steps, then its state_dict into a TritonUpdate on copies of its parameters; both
    # step twice more with the same clipped gradients.
    torch_params, decays = pair()
    torch_opt = torch.optim.AdamW([dict(params=[torch_params[0]], weight_decay=0.1),
                                   dict(params=[torch_params[1]], weight_decay=0.0)], lr=LR, betas=BETAS, eps=EPS,
                                  foreach=False)

    def torch_step(grads):
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in grads))
        for p, x in zip(torch_params, grads):
            p.grad = (x.double() * torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)).float()
        torch_opt.step()

    for norm in (4.0, 0.3):
        torch_step(grads_for(torch_params, norm))
    loaded = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    opt = K.TritonUpdate([dict(params=[loaded[0]], weight_decay=0.1), dict(params=[loaded[1]], weight_decay=0.0)],
                         lr=1.0, betas=(0.5, 0.5), eps=EPS, max_norm=MAX_NORM)   # the state_dict sets lr and betas
    opt.load_state_dict(torch_opt.state_dict())
    again = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    for norm in (2.0, 0.1):
        grads = grads_for(torch_params, norm)
        torch_step(grads)
        for p, x in zip(loaded, grads):
            p.grad = x.clone()
        opt.step()
    from_torch = max_diff(loaded, torch_params) / LR
    # TritonUpdate's own state_dict into a fresh one: the next step is the same.
    fresh = K.TritonUpdate([dict(params=[again[0]], weight_decay=0.1), dict(params=[again[1]], weight_decay=0.0)],
                           lr=LR, betas=BETAS, eps=EPS, max_norm=MAX_NORM)
    for p, q in zip(again, loaded):
        p.data.copy_(q.detach())
    fresh.load_state_dict(opt.state_dict())
    grads = grads_for(loaded, 1.5)
    for ps, o in ((loaded, opt), (again, fresh)):
        for p, x in zip(ps, grads):
            p.grad = x.clone()
        o.step()
    out["state_dict"] = dict(from_torch=from_torch,
                             steps=[int(opt.state[p]["step"]) for p in loaded],
                             own=max_diff(loaded, again) / LR, lr=opt.param_groups[0]["lr"])
    out["errors"] = errors
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(repo_root):
    return run_interpreted(CHECKS, repo_root)


def test_the_interpreter_makes_the_kernels_available_on_a_cpu(results):
    assert results["unavailable"] is None


CASES = ["default_block_case", "small_block_case"]


@pytest.mark.parametrize("case", CASES)
def test_parameters_match_a_float64_clip_and_adamw(results, case):
    r = results[case]
    # Tensors that span several blocks, the last partly masked, and one exactly a block (BLOCK 64).
    assert r["blocks"] == ([2, 1] if case == "default_block_case" else [28, 1, 2, 1])
    factors = [s["factor"] for s in r["steps"]]
    assert any(f < 0.5 for f in factors) and any(f == 1.0 for f in factors), factors   # clipped and not
    for i, s in enumerate(r["steps"]):
        # fp32 against float64: each step moves every parameter by about one lr, and may miss by rounding only.
        assert s["err"] < 1e-3, (i, s)
        assert s["moved"] > 0.5, (i, s)   # the comparison is between parameters that moved
    # The same bound tells wrong updates apart: no clip, no weight decay, or a clip that also scales
    # gradients below the threshold up to it.
    last = r["steps"][-1]
    for name, diff in last["wrong"].items():
        assert diff > 1e-2, (name, last)


@pytest.mark.parametrize("case", CASES)
def test_gradients_are_left_untouched_and_moments_match(results, case):
    r = results[case]
    for i, s in enumerate(r["steps"]):
        assert s["grads_untouched"], (i, s)   # bitwise, and the same tensors
        assert s["exp_avg"] < 1e-5 and s["exp_avg_sq"] < 1e-5, (i, s)   # relative to each moment's largest
    # Counted per parameter, as torch's AdamW counts: a step without a gradient does not count.
    assert r["steps_counted"] == r["reference_steps_counted"]
    assert max(r["steps_counted"]) == len(r["steps"])


def test_masked_tails_are_neither_read_nor_written(results):
    # The bias is the head of a 164-element buffer whose tail the AdamW kernel must not write; its gradient
    # is the head of one whose tail (1e3 per element) would blow up the norm if it were read.
    assert results["bias_shares_buffer"]
    assert results["bias_tail_untouched"] and results["grad_tail_untouched"]
    # A norm that counted the gradient's tail (64 values of 1e3: about 8,000 against 0.05 to 40) would clip
    # every step, the unclipped ones too, and rescale the steps against each other.
    steps = results["small_block_case"]["steps"]
    assert steps[0]["kernel_norm"] == pytest.approx(40.0, rel=1e-5)
    for s in steps:
        assert s["kernel_norm"] == pytest.approx(s["norm"], rel=1e-5) and s["err"] < 1e-3, s


def test_a_parameter_without_a_gradient_is_left_alone(results):
    s = results["small_block_case"]["steps"][4]   # the bias's .grad is None in this step
    assert s["none_param_ref_grad_is_none"]
    assert s["none_param_unchanged"] and s["none_moments_unchanged"], s
    # Its first moment is not zero: a step that took the missing gradient as zero would have moved it.
    assert s["none_param_exp_avg_max"] > 1e-4, s
    # The other parameters took their step, clipped by the norm of the gradients present only.
    assert s["factor"] < 0.5 and s["err"] < 1e-3 and s["moved"] > 0.5, s


@pytest.mark.parametrize("case, kind, words", [
    ("closure", "ValueError", ["closure"]),
    ("add_param_group", "NotImplementedError", ["fixed at construction"]),
    ("strided_grad", "ValueError", ["contiguous", "gradients"]),
    ("misaligned_grad", "ValueError", ["aligned", "gradients"]),
    ("float64_param", "ValueError", ["fp32 parameters"]),
    ("bfloat16_param", "ValueError", ["fp32 parameters"]),
    ("float16_in_one_group", "ValueError", ["fp32 parameters"]),
    ("strided_param", "ValueError", ["contiguous", "parameters"]),
    ("misaligned_param", "ValueError", ["aligned", "parameters"]),
    ("two_devices", "ValueError", ["one device"]),
    ("mixed_betas", "ValueError", ["same betas and eps", "every parameter group"]),
    ("mixed_eps", "ValueError", ["same betas and eps", "every parameter group"]),
    ("zero_max_norm", "ValueError", ["max_norm must be positive"]),
    ("beta_one", "ValueError", ["betas in [0, 1)"]),
])
def test_what_the_kernels_cannot_do_is_refused_clearly(results, case, kind, words):
    err = results["errors"][case]
    assert err is not None, f"{case} was accepted"
    assert err[0] == kind and all(w in err[1] for w in words), err
    assert "\n" not in err[1] and ("TritonUpdate" in err[1] or case == "zero_max_norm"), err
    if case in ("closure", "strided_grad", "misaligned_grad"):
        assert results["errors"][f"{case}_left_params"]   # refused before any kernel ran


def test_a_parameter_moved_to_new_storage_and_a_lower_learning_rate_are_followed(results):
    r = results["moved_storage"]
    # Step 2 updates the parameter's new storage, not the old one it had when the optimizer was built;
    # steps 3 and 4 run at a quarter of the learning rate, as the reference does.
    assert r["old_untouched"]
    assert all(e < 1e-3 for e in r["errs"]), r


def test_state_dicts_load_from_torchs_adamw_and_from_itself(results):
    r = results["state_dict"]
    # Loaded from torch's AdamW after two steps, then two more steps each: the same parameters, the
    # step counts carried over (2 + 2, then one more), and the groups' lr taken from the state_dict.
    assert r["steps"] == [5, 5] and r["lr"] == pytest.approx(1e-2)
    assert r["from_torch"] < 1e-3, r
    assert r["own"] < 1e-6, r


# ---------------------------------------------------------------------------------------------
# Without the interpreter, and the reference itself

def test_without_the_interpreter_a_cpu_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(triton_update, "INTERPRETED", False)
    assert triton_update.unavailable(CPU) == "the Triton clip-and-AdamW kernels need a GPU and Triton"
    with pytest.raises(RuntimeError, match="kernels need a CUDA GPU with Triton"):
        triton_update.TritonUpdate([nn.Parameter(torch.zeros(8))], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_reference_is_clip_grad_norm_then_adamw(dtype):
    g = torch.Generator().manual_seed(0)
    a = [nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype)) for shape in ((8, 4), (4,))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    _, update = triton_update.reference([dict(params=[a[0]], weight_decay=0.1), dict(params=[a[1]], weight_decay=0.0)],
                                        lr=1e-2, betas=(0.9, 0.95), max_norm=1.0)
    torch_opt = torch.optim.AdamW([dict(params=[b[0]], weight_decay=0.1), dict(params=[b[1]], weight_decay=0.0)],
                                  lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for scale in (10.0, 1e-3):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * scale
            q.grad = p.grad.clone()
        update()
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        torch_opt.step()
        assert torch.nn.utils.get_total_norm([p.grad for p in a]) <= 1.0 + 1e-5
    for p, q in zip(a, b):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------------
# On a GPU: GPT-2-sized parameters, against the reference, and no host-device synchronization

@pytest.mark.gpu
def test_on_a_gpu_the_update_matches_the_reference_without_synchronizing():
    cuda = torch.device("cuda")
    assert triton_update.unavailable(cuda) is None
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(50304, 768), (768, 2304), (2304,), (768,), (1,)]
    ours = [nn.Parameter(torch.randn(s, device=cuda, generator=g) * 0.02) for s in shapes]
    theirs = [nn.Parameter(p.detach().double().clone()) for p in ours]
    groups = lambda ps: [dict(params=ps[:2], weight_decay=0.1), dict(params=ps[2:], weight_decay=0.0)]  # noqa: E731
    kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, max_norm=1.0)
    opt = triton_update.TritonUpdate(groups(ours), **kw)
    _, update = triton_update.reference(groups(theirs), **kw)
    for step in range(4):
        scale = 1e-2 if step % 2 else 1e-5   # above the clip on odd steps, below on even ones
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, device=cuda, generator=g) * scale
            q.grad = p.grad.double()
        kept = [p.grad.clone() for p in ours]
        opt.step()
        update()
        assert all(torch.equal(p.grad, k) for p, k in zip(ours, kept))   # the gradients are not written
        # In learning-rate steps: AdamW moves each parameter by about lr per step.
        assert max((p.double() - q).abs().max().item() for p, q in zip(ours, theirs)) / 6e-4 < 1e-3
    # Once the gradients stay where they are, a step queues its kernels and returns.
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
