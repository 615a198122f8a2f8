"""AdamW for parameters stored in bf16: fp32 master weights, m and v, updated in one compiled pass that also
writes the bf16 parameters (llm.c's layout).

Under bf16 autocast the parameters stay fp32, and a step moves 48 bytes a parameter outside the GEMMs:
the forward casts each weight to bf16 (4 read, 2 written), backward's bf16 weight gradient is cast to the
parameter's fp32 (2 + 4), the clip's norm reads it (4), and fused AdamW reads p, g, m and v and writes p, m, v
and, with a folded clip, g (32). Stored in bf16, the parameters are what the GEMMs read, and their gradients
stay as the GEMMs wrote them; the update reads the bf16 gradient (2), the fp32 master weight, m and v (12),
writes those three (12) and the parameter (2), and the clip's norm reads the gradient (2): 30 bytes. (Counted
outside the GEMMs' own reads of the weights and writes of their gradients; the roofline, Utils.report.roofline,
counts those instead of the casts, and goes from 48 to 36.) At
GPT-2 1.5B that is 28 GB a step less, some 8 ms at an H100's 3.35 TB/s (BENCHMARKS.md, "Parameters in bf16").

Nothing is lost to bf16's 8-bit mantissa: the update is added to the fp32 master weight, and the parameter
is the master rounded to nearest, the bf16 weight that autocast's cast of an fp32 parameter would have made.
The gradients are bf16, as the GEMMs made them before the cast, and so is what is done with them before the
update: they add up in bf16 across micro-batches, DDP averages them in bf16 over the ranks, and the clip's norm
is a norm of bf16 tensors, each tensor's rounded to bf16 (about 0.2% off the fp32 norm of the same values).

On a GPU the update is one torch.compile'd function of foreach operations, which Inductor fuses into kernels
that each take many tensors; elsewhere the same function runs eagerly. Every operation must be one Inductor
lowers: one it does not runs as an ATen kernel of its own and writes its output whole (tests/test_master_adamw.py
checks the compiled update for such fallbacks).
"""
from collections.abc import Iterable

import torch
from torch import Tensor


def _update(params: list[Tensor], grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor],
            exp_avg_sqs: list[Tensor], decays: list[float], step: Tensor, grad_scale: Tensor, lr: float,
            beta1: float, beta2: float, eps: float) -> None:
    """One AdamW step (torch.optim.AdamW's arithmetic) on the fp32 masters from the bf16 grads divided by
    grad_scale, then params = masters rounded to bf16. decays[i] = lr × weight decay of tensor i; step is the
    step's number (1 on the first), a 0-d fp32 tensor, so that a compiled update is not compiled again each step."""
    g = torch._foreach_div([grad.float() for grad in grads], grad_scale)
    torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2 ** step).sqrt())
    torch._foreach_add_(denom, eps)
    # One Scalar multiply per decay: Inductor has no lowering for _foreach_mul's ScalarList form, and its ATen
    # fallback, an unfused pass that writes a copy of every master weight, cost 0.5 ms a step at 124M on an H100.
    for decay in sorted(set(decays)):
        if decay:
            torch._foreach_mul_([w for w, d in zip(masters, decays) if d == decay], 1 - decay)
    change = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(change, lr / (1 - beta1 ** step))
    torch._foreach_sub_(masters, change)
    torch._foreach_copy_(params, masters)


_compiled_update = torch.compile(_update, dynamic=False)


class MasterAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update for bf16 (or fp16) parameters, from fp32 master weights that it keeps with m
    and v. It divides each gradient by `grad_scale` where that is set (a 0-d tensor: the folded clip,
    Utils.ladder.apply's fold_clip), as fused AdamW does, but leaves the gradient as it was. Its parameter groups
    may differ in weight decay only; a changed learning rate compiles the update again. One step count serves
    every parameter (every parameter of the suite's models gets a gradient every step; torch's AdamW counts each
    parameter's own). Its state is not one to save and load: load_state_dict would cast the fp32 masters to the
    parameters' dtype, and the step count is not in it."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        shared = {(g["lr"], tuple(g["betas"]), g["eps"]) for g in self.param_groups}
        if len(shared) > 1:
            raise ValueError("MasterAdamW's parameter groups may differ in weight_decay only")
        self.grad_scale: Tensor | None = None
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        # Made here and advanced in place: a step traced by torch.compile (compiled_update) keeps in-place changes
        # to an attribute's tensor, not an attribute set to a new tensor.
        self._step = torch.zeros((), dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("MasterAdamW takes no closure")
        # Every group in one call: one compiled update, whose kernels each take tensors of both groups.
        params, decays = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    decays.append(group["lr"] * group["weight_decay"])
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["master"] = p.detach().to(torch.float32, copy=True)
                state["exp_avg"] = torch.zeros_like(state["master"])
                state["exp_avg_sq"] = torch.zeros_like(state["master"])
        self._step.add_(1)
        group = self.param_groups[0]
        update = _compiled_update if params[0].device.type == "cuda" else _update
        update(params, [p.grad for p in params], *([self.state[p][k] for p in params]
                                                 for k in ("master", "exp_avg", "exp_avg_sq")),
               decays, self._step, self.grad_scale if self.grad_scale is not None else self._one,
               group["lr"], *group["betas"], group["eps"])
