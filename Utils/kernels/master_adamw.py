"""AdamW for parameters stored in bf16: fp32 master weights, m and v, updated in one kernel that also writes the
bf16 parameters (llm.c's layout); or, with masters=False, no master weights at all (torchao's bf16 AdamW recipe).

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

On a GPU the update is one Triton kernel for all the tensors of a dtype (apex's multi-tensor apply, with the
tensors' addresses in a table): the fp32 masters, m and v lie in flat buffers, each tensor at a multiple of BLOCK
elements, and a program updates one BLOCK of one tensor, reading its gradient and writing its parameter through
the addresses. torch.compile of foreach operations did the same work at the same rate at 124M, but Inductor took
over five minutes to compile it for GPT-2 1.5B's 580 tensors on a fresh H100 (BENCHMARKS.md); the kernel
compiles once, whatever the model. Elsewhere the same arithmetic runs as foreach operations (_update).

With masters=False the bf16 parameter is the only copy of a weight, and m and v are bf16 too: 8 bytes a parameter
held instead of 16, and the update moves 14 bytes a parameter instead of 28. An update smaller than half a bf16
step would be lost to rounding to nearest, so the parameter is rounded stochastically, up with the probability of
the distance to the value below (Gupta et al. 2015, "Deep learning with limited numerical precision"): in
expectation the parameter follows the fp32 update. The 16 random bits an element come from a hash of its place
and the step (murmur3's 32-bit finalizer), the same in the kernel and in _update, so the two round alike.
"""
import contextlib
import os
from collections.abc import Iterable

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except Exception:   # absent, or broken: foreach operations instead
    triton = None

# Elements a program updates: 8 a thread with 8 warps. Each tensor starts at a multiple of it in the flat
# buffers, so that a program's elements are of one tensor; the padding is under BLOCK elements a tensor.
BLOCK, NUM_WARPS = 2048, 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


_CPU_SLICE = 2**17   # elements the CPU path rounds at a time


def _int32(c: int | Tensor) -> int | Tensor:
    """The int32 whose bits are c's lowest 32 (of each element, for an integer tensor)."""
    return (c + 2**31) % 2**32 - 2**31


def _random_bits(index: Tensor, seed: int) -> Tensor:
    """16 random bits for each element index (int64, or int32 holding its low 32 bits) at a step's seed: murmur3's
    finalizer of index × 0x9E3779B1 + seed, modulo 2**32, as the kernel computes it in uint32. Computed in int32,
    whose products and sums keep the same low 32 bits (4-byte passes, where int64 would need each constant split
    to stay clear of overflow); a right shift then masks off the copies of the sign bit."""
    x = index.clone() if index.dtype == torch.int32 else _int32(index).to(torch.int32)
    x.mul_(_int32(0x9E3779B1)).add_(_int32(seed))
    x ^= (x >> 16) & 0xFFFF
    x.mul_(_int32(0x85EBCA6B))
    x ^= (x >> 13) & 0x7FFFF
    x.mul_(_int32(0xC2B2AE35))
    x ^= (x >> 16) & 0xFFFF
    return (x >> 16) & 0xFFFF


def round_stochastically(x: Tensor, bits: Tensor) -> Tensor:
    """fp32 x rounded to bf16, away from zero where bits (16 random bits an element) are under x's lower 16 bits:
    adding them to the bit pattern carries into the bf16 part with the probability of that remainder. A NaN stays
    NaN (its pattern could carry into the sign and become zero)."""
    rounded = ((x.view(torch.int32) + bits.to(torch.int32)) & -65536).view(torch.float32)
    return torch.where(x.isnan(), x, rounded).to(torch.bfloat16)


def _update(params: list[Tensor], grads: list[Tensor], masters: list[Tensor] | None, exp_avgs: list[Tensor],
            exp_avg_sqs: list[Tensor], keeps: list[float], grad_scale: Tensor, step_size: float,
            bias_correction2_sqrt: float, beta1: float, beta2: float, eps: float,
            starts: list[int] | None = None, seed: int = 0) -> None:
    """One AdamW step (torch.optim.AdamW's arithmetic) in fp32 from the grads divided by grad_scale, on the masters
    (then params = masters rounded to nearest), or without them on the params themselves (bf16 ones rounded
    stochastically, each element's bits from its index in the bucket, starts[i] + its place, and seed).
    keeps[i] = 1 - lr × weight decay of tensor i; m and v are fp32, or bf16 without masters."""
    weights = masters if masters is not None else [p.float() for p in params]
    m, v = [t.float() for t in exp_avgs], [t.float() for t in exp_avg_sqs]   # the same tensors where fp32
    g = torch._foreach_div([grad.float() for grad in grads], grad_scale)
    torch._foreach_lerp_(m, g, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, 1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_mul_(weights, keeps)
    torch._foreach_addcdiv_(weights, m, denom, -step_size)
    for state, work in ((exp_avgs, m), (exp_avg_sqs, v)):
        if state[0] is not work[0]:
            torch._foreach_copy_(state, work)
    if masters is not None or params[0].dtype != torch.bfloat16:
        torch._foreach_copy_(params, weights)
        return
    for p, w, start in zip(params, weights, starts):
        # A slice at a time: the hash's dozen int32 passes stay in the cache (half the time on a CPU)
        for at in range(0, w.numel(), _CPU_SLICE):
            part = w.view(-1)[at:at + _CPU_SLICE]
            index = torch.arange(part.numel(), dtype=torch.int32, device=w.device).add_(_int32(start + at))
            p.view(-1)[at:at + _CPU_SLICE].copy_(round_stochastically(part, _random_bits(index, seed)))


def _define_triton():
    @triton.jit(do_not_specialize=["seed"])
    def _update_kernel(grad_addrs, param_addrs, tensor_of_block, starts, numels, keeps, masters, exp_avgs,
                       exp_avg_sqs, grad_scale, step_size, bias_correction2_sqrt, beta1, one_minus_beta1, beta2,
                       one_minus_beta2, eps, seed, GRAD: tl.constexpr, PARAM: tl.constexpr, MASTERS: tl.constexpr,
                       STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # Block b of the flat buffers belongs to tensor t; the tensor's own element i is the buffers' start + i.
        b = tl.program_id(0)
        t = tl.load(tensor_of_block + b)
        # What the compiler cannot see in values read from the tables: each start is a multiple of BLOCK and, where
        # ALIGNED, each size one of 8 elements and each address one of 16 bytes. Without these it reads and writes
        # an element at a time, not 16 bytes.
        start = tl.multiple_of(tl.load(starts + t), BLOCK)
        numel = tl.load(numels + t)
        grad_addr = tl.load(grad_addrs + t)          # 0: no gradient this step, the tensor is left as it is
        param_addr = tl.load(param_addrs + t)
        # A tensor without a gradient gets no element: its limit is 0. (One comparison makes the mask; a block
        # of bools and'ed with a scalar bool is a mask Triton 3.9's interpreter refuses.)
        limit = tl.where(grad_addr != 0, numel, 0)
        if ALIGNED:
            limit = tl.multiple_of(limit, 8)
        flat = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        local = flat - start
        mask = local < limit
        grad = grad_addr.to(tl.pointer_type(GRAD)) + local
        param = param_addr.to(tl.pointer_type(PARAM)) + local
        if ALIGNED:
            grad = tl.max_contiguous(tl.multiple_of(grad, 16), 8)
            param = tl.max_contiguous(tl.multiple_of(param, 16), 8)
        g = tl.load(grad, mask=mask, other=0.0).to(tl.float32)
        g = g / tl.load(grad_scale)
        m = tl.load(exp_avgs + flat, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sqs + flat, mask=mask).to(tl.float32)
        if MASTERS:
            w = tl.load(masters + flat, mask=mask)
        else:
            w = tl.load(param, mask=mask).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)            # torch's lerp for a weight under 0.5
        v = v * beta2 + one_minus_beta2 * g * g
        w = w * tl.load(keeps + t) - step_size * (m / (tl.sqrt(v) / bias_correction2_sqrt + eps))
        tl.store(exp_avgs + flat, m.to(exp_avgs.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sqs + flat, v.to(exp_avg_sqs.dtype.element_ty), mask=mask)
        if MASTERS:
            tl.store(masters + flat, w, mask=mask)
        if STOCHASTIC:   # _random_bits and round_stochastically: the low 16 bits become zero, the cast exact
            x = flat.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32)
            x = (x ^ (x >> 16)) * 0x85EBCA6B
            x = (x ^ (x >> 13)) * 0xC2B2AE35
            bits = ((x ^ (x >> 16)) >> 16).to(tl.int32)
            rounded = ((w.to(tl.int32, bitcast=True) + bits) & -65536).to(tl.float32, bitcast=True)
            w = tl.where(w == w, rounded, w)         # a NaN stays NaN
        tl.store(param, w.to(PARAM), mask=mask)

    return _update_kernel


_kernel = None
if triton is not None:
    try:
        _kernel = _define_triton()
    except Exception:   # a broken Triton: as if it were absent
        pass


def _addresses(tensors: list[Tensor | None], device: torch.device) -> Tensor:
    """The tensors' addresses (0 for None) in an int64 tensor on device, copied from pinned memory without
    waiting: the caching host allocator keeps the pinned block until the copy has run."""
    table = torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


class _Bucket:
    """The parameters of one dtype: their fp32 masters (for bf16 and fp16 parameters with masters), m and v (fp32,
    or the parameters' bf16 without masters) in flat buffers, each tensor at a multiple of BLOCK, and the tables
    the kernel reads (block -> tensor, each tensor's start, size, decay and address)."""

    def __init__(self, params: list[Tensor], keeps: list[float], masters: bool):
        if not all(p.is_contiguous() for p in params):
            raise ValueError("MasterAdamW writes each parameter through its address: the parameters must be "
                             "contiguous")
        self.params = params
        self.dtype, self.device = params[0].dtype, params[0].device
        self.has_masters = masters and self.dtype != torch.float32
        self.stochastic = not masters and self.dtype == torch.bfloat16
        sizes = [-(-p.numel() // BLOCK) * BLOCK for p in params]
        self.start_list = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        state = dict(dtype=torch.float32 if masters else self.dtype, device=self.device)
        self.exp_avgs, self.exp_avg_sqs = torch.zeros(total, **state), torch.zeros(total, **state)
        self.masters = torch.zeros(total, dtype=torch.float32, device=self.device) if self.has_masters else None
        flats = (self.masters, self.exp_avgs, self.exp_avg_sqs)
        # (masters or None, m, v) of each parameter: views into the flat buffers, the optimizer's state
        self.views = [None if flat is None else [flat[s:s + p.numel()].view_as(p)
                                                 for p, s in zip(params, self.start_list)] for flat in flats]
        for master, p in zip(self.views[0] or [], params):
            master.copy_(p.detach())
        self.keeps = keeps
        long = dict(dtype=torch.int64, device=self.device)
        self.starts = torch.tensor(self.start_list, **long)
        self.numels = torch.tensor([p.numel() for p in params], **long)
        self.keep_table = torch.tensor(keeps, dtype=torch.float32, device=self.device)
        self.tensor_of_block = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                                       torch.tensor(sizes) // BLOCK).to(self.device)
        self.param_addrs = _addresses(params, self.device)
        # The kernel's ALIGNED: every size a multiple of 8 elements and every address of 16 bytes (GPT-2's tensors
        # and the caching allocator's blocks are; a view into a larger gradient bucket need not be).
        self.aligned = all(p.numel() % 8 == 0 and p.data_ptr() % 16 == 0 for p in params)
        self._grads: tuple = ()
        self._grad_addrs: Tensor | None = None
        self._grads_aligned = False

    def grad_addrs(self, grads: list[Tensor | None]) -> tuple[Tensor, bool]:
        """The gradients' address table and whether every address is of 16 bytes, made again only where an
        address changed since the last step."""
        key = tuple(0 if g is None else g.data_ptr() for g in grads)
        if key != self._grads:
            self._grads, self._grad_addrs = key, _addresses(grads, self.device)
            self._grads_aligned = all(a % 16 == 0 for a in key)
        return self._grad_addrs, self._grads_aligned

    def update(self, grad_scale: Tensor, step_size: float, bias_correction2_sqrt: float, beta1: float, beta2: float,
               eps: float, seed: int) -> None:
        grads = [None if p.grad is None else p.grad.contiguous() for p in self.params]
        if _kernel is not None and (self.device.type == "cuda" or INTERPRETED):
            dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[self.dtype]
            grad_addrs, grads_aligned = self.grad_addrs(grads)
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                _kernel[(len(self.tensor_of_block),)](
                    grad_addrs, self.param_addrs, self.tensor_of_block, self.starts, self.numels,
                    self.keep_table, self.masters if self.has_masters else self.exp_avgs, self.exp_avgs,
                    self.exp_avg_sqs, grad_scale, step_size, bias_correction2_sqrt, beta1, 1 - beta1, beta2,
                    1 - beta2, eps, seed, GRAD=dtype, PARAM=dtype, MASTERS=self.has_masters,
                    STOCHASTIC=self.stochastic, ALIGNED=self.aligned and grads_aligned,
                    BLOCK=BLOCK, num_warps=NUM_WARPS)
            return
        have = [i for i, g in enumerate(grads) if g is not None]
        if not have:
            return
        _update([self.params[i] for i in have], [grads[i] for i in have],
                None if self.views[0] is None else [self.views[0][i] for i in have],
                *([views[i] for i in have] for views in self.views[1:]), [self.keeps[i] for i in have],
                grad_scale, step_size, bias_correction2_sqrt, beta1, beta2, eps,
                [self.start_list[i] for i in have], seed)


class MasterAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update for bf16 (or fp16) parameters, from fp32 master weights that it keeps with m
    and v; with masters=False, on the bf16 parameters themselves, rounded stochastically, with bf16 m and v (fp32
    parameters, such as LayerNorm's, keep fp32 m and v and are their own masters either way). It divides each
    gradient by `grad_scale` where that is set (a 0-d tensor: the folded clip, Utils.ladder.apply's fold_clip), as
    fused AdamW does, but leaves the gradient as it was. Its parameter groups
    may differ in weight decay only, read with the learning rate at the first step, which lays out the state of
    every parameter. One step count serves every parameter (every parameter of the suite's models gets a gradient
    every step; torch's AdamW counts each parameter's own). Its state is not one to save and load:
    load_state_dict would cast the fp32 masters to the parameters' dtype, and the step count is not in it."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0, masters: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.masters = masters
        if not masters and any(p.dtype == torch.float16 for g in self.param_groups for p in g["params"]):
            raise ValueError("MasterAdamW rounds stochastically to bf16 only: fp16 parameters need masters=True")
        shared = {(g["lr"], tuple(g["betas"]), g["eps"]) for g in self.param_groups}
        if len(shared) > 1:
            raise ValueError("MasterAdamW's parameter groups may differ in weight_decay only")
        self.grad_scale: Tensor | None = None
        self.steps = 0
        self._buckets: list[_Bucket] = []
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        self._one = torch.ones((), dtype=torch.float32, device=device)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_buckets", None):
            raise ValueError("MasterAdamW lays out its state at the first step: add parameter groups before it")
        super().add_param_group(param_group)

    # The kernel reads the gradients' addresses, which torch.compile cannot trace: under compiled_update the step
    # runs as it is, and the clip before it is compiled.
    @torch._dynamo.disable
    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("MasterAdamW takes no closure")
        if not any(p.grad is not None for group in self.param_groups for p in group["params"]):
            return
        if not self._buckets:
            self._buckets = self._lay_out()
        self.steps += 1
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        step_size = group["lr"] / (1 - beta1 ** self.steps)
        bias_correction2_sqrt = (1 - beta2 ** self.steps) ** 0.5
        grad_scale = self.grad_scale if self.grad_scale is not None else self._one
        for bucket in self._buckets:
            # A seed for each step; the hash spreads consecutive ones.
            bucket.update(grad_scale, step_size, bias_correction2_sqrt, beta1, beta2, group["eps"],
                          (self.steps * 0x632BE5AB) & 0x7FFFFFFF)

    def _lay_out(self) -> list[_Bucket]:
        """A bucket for each dtype of parameter (bf16 weights, fp32 LayerNorms), every group in it: one launch
        updates them all. Their masters, m and v become the optimizer's state."""
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                params, keeps = by_dtype.setdefault(p.dtype, ([], []))
                params.append(p)
                keeps.append(1 - group["lr"] * group["weight_decay"])
        buckets = [_Bucket(params, keeps, self.masters) for params, keeps in by_dtype.values()]
        for bucket in buckets:
            for i, p in enumerate(bucket.params):
                self.state[p] = {k: views[i] for k, views in zip(("master", "exp_avg", "exp_avg_sq"), bucket.views)
                                 if views is not None}
        return buckets
