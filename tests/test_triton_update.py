"""ClippedAdamW (Utils.adamw_kernel): the gradient clip and AdamW as two Triton kernels, run on the CPU by
Triton's interpreter in one subprocess and checked against a float64 reference; and optimizer="adamw_triton"
(the "triton_update" addition) in the recipes, with and without the interpreter."""
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from conftest import run_interpreted
from Utils import adamw_kernel
from Utils.recipes import (ADDITIONS, FUSED, GRAD_CLIP, LEARNING_RATE, OPTIMIZERS, WEIGHT_DECAY, Recipe,
                           apply_optimizer, make_update)

CPU = torch.device("cpu")
TRITON_UPDATE = replace(FUSED, name="fused+triton_update", **ADDITIONS["triton_update"])


# ---------------------------------------------------------------------------------------------
# Everything that needs the kernels, in one subprocess: the interpreter starts slowly and runs slowly.

CHECKS = """
    import copy
    import json
    from dataclasses import replace

    import torch
    from Utils import adamw_kernel as K, recipes
    from Utils.model import GPT, PRESETS

    CPU = torch.device("cpu")
    out = {"available": K.available(CPU)}

    def max_diff(a, b):
        return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))

    # --- The recipe: the tiny GPT's update at the kernels' own BLOCK, against the repository's plain
    # clip_grad_norm_ + fused AdamW update (FUSED), two updates on two batches.
    recipe = replace(recipes.FUSED, name="fused+triton_update", **recipes.ADDITIONS["triton_update"])
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    ref_model = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt = recipes.apply_optimizer(model, recipe, CPU)
    update, note = recipes.make_update(model, opt, recipe, CPU)
    ref_opt = recipes.apply_optimizer(ref_model, recipes.FUSED, CPU)
    ref_update, ref_note = recipes.make_update(ref_model, ref_opt, recipes.FUSED, CPU)
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(2):
        idx = torch.randint(0, 50257, (2, 32), generator=g)
        for m in (model, ref_model):
            m(idx, idx)[1].backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        update()
        ref_update()
        for m in (model, ref_model):
            for p in m.parameters():
                p.grad = None
    out["recipe"] = dict(
        type=type(opt).__name__, note=note, ref_type=type(ref_opt).__name__, ref_note=ref_note,
        update_is_step=update == opt.step, weight_decays=[gr["weight_decay"] for gr in opt.param_groups],
        lrs=[gr["lr"] for gr in opt.param_groups], max_norm=opt.max_norm, norms=norms,
        err=max_diff(model.parameters(), ref_model.parameters()) / recipes.LEARNING_RATE,
        moved=max_diff(model.parameters(), start) / recipes.LEARNING_RATE)

    # --- Against a float64 reference: torch's AdamW on float64 copies of the parameters, fed the same
    # fp32 gradients clipped with a float64 global norm (clip_grad_norm_'s factor, min(1, c / (norm + 1e-6))).
    LR, BETAS, EPS, MAX_NORM = 1e-2, (0.9, 0.95), 1e-8, 1.0

    def reference(params, decays):
        \"\"\"(parameters, optimizer): torch's AdamW on float64 copies of params, weight decay decays[i].\"\"\"
        params64 = [p.detach().double().clone().requires_grad_() for p in params]
        groups = {}
        for p, d in zip(params64, decays):
            groups.setdefault(d, []).append(p)
        opt64 = torch.optim.AdamW([dict(params=ps, weight_decay=d) for d, ps in groups.items()], lr=LR,
                                  betas=BETAS, eps=EPS, foreach=False)
        return params64, opt64

    def reference_step(params64, opt64, grads, clip=True, scale_up=False):
        present = [x.double() for x in grads if x is not None]
        norm = torch.sqrt(sum((x * x).sum() for x in present))
        factor = MAX_NORM / (norm + 1e-6)
        if clip and not scale_up:
            factor = torch.clamp(factor, max=1.0)
        elif not clip:
            factor = torch.ones((), dtype=torch.float64)
        for p, x in zip(params64, grads):
            p.grad = None if x is None else x.double() * factor
        opt64.step()
        return norm.item(), factor.item()

    def moments_err(opt, params, opt64, params64, key):
        return max(((opt.state[p][key].double() - opt64.state[q][key]).abs().max()
                    / opt64.state[q][key].abs().max()).item() for p, q in zip(params, params64))

    def random_grads(params, norm, gen, skip=()):
        grads = [None if i in skip else torch.randn(p.shape, generator=gen) for i, p in enumerate(params)]
        total = torch.sqrt(sum((x.double() ** 2).sum() for x in grads if x is not None)).item()
        return [None if x is None else x * (norm / total) for x in grads]

    def compare(params, decays, norms, gen, grad_buffers=None, none_at=None, none_step=None):
        \"\"\"Steps ClippedAdamW and the references through `norms`; step `none_step` leaves parameter `none_at`
        without a gradient. grad_buffers[i], where given, is a larger tensor whose head is parameter i's
        gradient (its tail is garbage the kernels must not read).\"\"\"
        groups = {}
        for p, d in zip(params, decays):
            groups.setdefault(d, []).append(p)
        opt = K.ClippedAdamW([dict(params=ps, weight_decay=d) for d, ps in groups.items()], lr=LR, betas=BETAS,
                             eps=EPS, max_norm=MAX_NORM)
        ref = reference(params, decays)
        wrong = {"unclipped": reference(params, decays), "no_decay": reference(params, [0.0] * len(params)),
                 "scaled_up": reference(params, decays)}
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
            for name, (ps, o) in wrong.items():
                reference_step(ps, o, grads, clip=name != "unclipped", scale_up=name == "scaled_up")
            rec = dict(norm=norm64, kernel_norm=kernel_norm, factor=factor,
                       err=max_diff(params, ref[0]) / LR,
                       moved=max_diff(params, before) / LR,
                       grads_untouched=all(k is None or (torch.equal(p.grad, k[0]) and p.grad.data_ptr() == k[1])
                                           for p, k in zip(params, kept)),
                       exp_avg=moments_err(opt, params, ref[1], ref[0], "exp_avg"),
                       exp_avg_sq=moments_err(opt, params, ref[1], ref[0], "exp_avg_sq"),
                       wrong={name: max_diff(params, ps) / LR for name, (ps, o) in wrong.items()})
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
        return K.ClippedAdamW(params, **{**dict(lr=LR, betas=BETAS, eps=EPS), **kw})

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
    # state_dict moved between optimizers (torch's AdamW's into ClippedAdamW, and ClippedAdamW's own).
    def pair(n=300, decay=0.1):
        a = [torch.nn.Parameter(torch.randn(n, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
        return a, [d for d in (decay, 0.0)]

    def grads_for(params, norm):
        return random_grads(params, norm, gen)

    params, decays = pair()
    opt = K.ClippedAdamW([dict(params=[params[0]], weight_decay=0.1), dict(params=[params[1]], weight_decay=0.0)],
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

    # torch's AdamW, two steps, then its state_dict into a ClippedAdamW on copies of its parameters; both
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
    opt = K.ClippedAdamW([dict(params=[loaded[0]], weight_decay=0.1), dict(params=[loaded[1]], weight_decay=0.0)],
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
    # ClippedAdamW's own state_dict into a fresh one: the next step is the same.
    fresh = K.ClippedAdamW([dict(params=[again[0]], weight_decay=0.1), dict(params=[again[1]], weight_decay=0.0)],
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
    assert results["available"] is True


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
    assert "\n" not in err[1] and ("ClippedAdamW" in err[1] or case == "zero_max_norm"), err
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
# optimizer="adamw_triton" in the recipes

def test_the_triton_update_recipe_is_clipped_adamw_stepping_the_tiny_gpt(results):
    r = results["recipe"]
    assert r["type"] == "ClippedAdamW" and r["note"] is None and r["update_is_step"], r
    assert r["weight_decays"] == [WEIGHT_DECAY, 0.0] and r["lrs"] == [LEARNING_RATE] * 2 and r["max_norm"] == GRAD_CLIP
    assert r["ref_type"] == "AdamW" and r["ref_note"] is None
    assert all(n > GRAD_CLIP for n in r["norms"]), r   # both updates clipped
    # Against clip_grad_norm_ + fused AdamW (the FUSED rung's update), after two updates: torch's CPU norm
    # is itself off by ~1e-4 relative, hence the loose bound.
    assert r["moved"] > 1.0 and r["err"] < 1e-2, r


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.bias = nn.Parameter(torch.zeros(32))


def test_without_the_interpreter_the_triton_update_is_fused_adamw_with_a_note(monkeypatch):
    # The module decided at import whether the interpreter runs its kernels: make sure it did not here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(adamw_kernel, "INTERPRETED", False)
    assert adamw_kernel.available(CPU) is False
    torch.manual_seed(0)
    model, ref = Layer(), Layer()
    ref.load_state_dict(model.state_dict())
    opt = apply_optimizer(model, TRITON_UPDATE, CPU)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [WEIGHT_DECAY, 0.0]
    update, note = make_update(model, opt, TRITON_UPDATE, CPU)
    assert "need a GPU and Triton" in note and "fused AdamW" in note
    # The update is clip_grad_norm_ then the fused step, exactly.
    ref_opt = apply_optimizer(ref, FUSED, CPU)
    ref_update, _ = make_update(ref, ref_opt, FUSED, CPU)
    g = torch.Generator().manual_seed(1)
    for scale in (10.0, 1e-3, 5.0):
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g) * scale
            q.grad = p.grad.clone()
        update()
        ref_update()
        assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) <= GRAD_CLIP * (1 + 1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(model.bias, torch.zeros(32))


def test_clipped_adamw_refuses_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(adamw_kernel, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="kernels need a CUDA GPU with Triton"):
        adamw_kernel.ClippedAdamW([nn.Parameter(torch.zeros(8))], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def test_the_triton_update_is_an_optimizer_choice_that_refuses_compile_update():
    assert "adamw_triton" in OPTIMIZERS and ADDITIONS["triton_update"] == {"optimizer": "adamw_triton"}
    assert TRITON_UPDATE.optimizer == "adamw_triton" and not TRITON_UPDATE.compile_update
    with pytest.raises(ValueError, match="adamw_triton"):
        Recipe("r", optimizer="adamw_triton", compile_update=True)
    with pytest.raises(ValueError, match="adamw_triton"):
        replace(TRITON_UPDATE, compile_update=True)
    with pytest.raises(ValueError, match="fold_clip"):
        replace(TRITON_UPDATE, fold_clip=True)
