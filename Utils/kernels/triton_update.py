"""Gradient clipping and AdamW as two Triton kernels over every parameter: TritonUpdate.

torch's clip_grad_norm_ followed by fused AdamW passes over the gradients three times: the norm reads
them, the clip multiplies them in place (a read and a write), and AdamW reads them again. Here the first
kernel reads them for the norm, and the second applies the clip factor as it reads each gradient for the
update, so the clip's read-and-write pass is gone and no gradient is written. The arithmetic is torch's:
the same clip factor, min(1, max_norm / (norm + 1e-6)), and AdamW with decoupled weight decay, in fp32.

Each kernel is one launch for all parameters. Parameters and gradients stay where torch put them: each
program handles BLOCK elements of one tensor, and finds the tensor's address in a table. The optimizer's
moments are two flat buffers, BLOCK slots per program, owned here. `reference` is the same update as
torch ships it: clip_grad_norm_, then AdamW.

Triton is optional: `unavailable()` says why the kernels cannot run here. With TRITON_INTERPRET=1 set
before this module is imported, Triton's interpreter runs them on CPU tensors (the tests do).
"""
import math
import os
from collections.abc import Callable, Iterable

import torch

try:
    import triton
    import triton.language as tl
except Exception:   # absent, or broken: Utils.ladder.apply.apply_triton_update then keeps torch's fused AdamW
    triton = None

# Elements per program, and warps: within 2% of the fastest pair tried (BENCHMARKS.md).
BLOCK = 4096
NUM_WARPS = 8

# Read once, as @triton.jit reads it when the kernels are defined below.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device) -> str | None:
    """None where the kernels run on this device (a CUDA GPU with Triton, or any device under the
    interpreter), else why not."""
    return None if _available(device) else "the Triton clip-and-AdamW kernels need a GPU and Triton"


def _available(device):
    return _kernels is not None and (device.type == "cuda" or INTERPRETED)


if triton is not None:
    @triton.jit
    def _block(block_param_ptr, numel_ptr, first_block_ptr, BLOCK: tl.constexpr):
        """(parameter index, this program's offset in it, elements of it left from there)."""
        pid = tl.program_id(0)
        i = tl.load(block_param_ptr + pid)
        start = (pid - tl.load(first_block_ptr + i)).to(tl.int64) * BLOCK
        return i, start, tl.load(numel_ptr + i) - start

    @triton.jit
    def _address(table_ptr, i):
        # Addresses from a table carry no alignment the compiler can see; the step checks that they are
        # 16-byte aligned, which lets it load four values per instruction.
        return tl.multiple_of(tl.load(table_ptr + i).to(tl.pointer_type(tl.float32)), 16)

    @triton.jit
    def _square_sum(grad, left, BLOCK: tl.constexpr, FULL: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        # A mask against the constant BLOCK is known to be all true in runs of four: vector loads again.
        g = tl.load(grad + offsets, mask=offsets < (BLOCK if FULL else left), other=0.0)
        return tl.sum(g * g, 0)

    # --- Gradient norm, first half: each program's sum of squared gradients over BLOCK elements of one
    # parameter, read in place through the address table (no flattening copy); also counts each
    # parameter's step, so that the second kernel needs no host-side bookkeeping.
    @triton.jit
    def _square_sum_kernel(block_param_ptr, numel_ptr, first_block_ptr, grad_ptrs, partial_ptr, steps_ptr,
                           BLOCK: tl.constexpr):
        """Each block's sum of squared gradients; the first block of a parameter with a gradient also
        counts its step, which AdamW's bias corrections read (per parameter, as torch's AdamW counts)."""
        i, start, left = _block(block_param_ptr, numel_ptr, first_block_ptr, BLOCK)
        total = 0.0
        if tl.load(grad_ptrs + i) != 0:   # 0: the parameter has no gradient this step
            grad = _address(grad_ptrs, i) + start
            if left >= BLOCK:
                total = _square_sum(grad, left, BLOCK, True)
            else:
                total = _square_sum(grad, left, BLOCK, False)
            if start == 0:
                tl.store(steps_ptr + i, tl.load(steps_ptr + i) + 1)
        tl.store(partial_ptr + tl.program_id(0), total)

    @triton.jit
    def _adamw(param, grad, exp_avg, exp_avg_sq, left, clip, lr, decay, beta1, beta2, eps, bias_correction1,
               bias_correction2_sqrt, BLOCK: tl.constexpr, FULL: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < (BLOCK if FULL else left)
        g = tl.load(grad + offsets, mask=mask) * clip
        p = tl.load(param + offsets, mask=mask)
        m = tl.load(exp_avg + offsets, mask=mask)
        v = tl.load(exp_avg_sq + offsets, mask=mask)
        p = p * (1.0 - lr * decay)
        m = m + (1.0 - beta1) * (g - m)   # torch: exp_avg.lerp_(grad, 1 - beta1)
        v = v * beta2 + (1.0 - beta2) * g * g
        p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
        tl.store(param + offsets, p, mask=mask)
        tl.store(exp_avg + offsets, m, mask=mask)
        tl.store(exp_avg_sq + offsets, v, mask=mask)

    # --- AdamW with the clip applied: fuses clip_grad_norm_'s scaling of the gradients into the AdamW
    # update, which multiplies each gradient by the clip factor as it reads it, so that the clip's
    # read-and-write pass over the gradients is gone and no gradient is written.
    @triton.jit
    def _adamw_kernel(block_param_ptr, numel_ptr, first_block_ptr, grad_ptrs, param_ptrs, lr_ptr, decay_ptr,
                      exp_avg_ptr, exp_avg_sq_ptr, clip_ptr, steps_ptr, beta1, beta2, log2_beta1, log2_beta2,
                      eps, BLOCK: tl.constexpr):
        i, start, left = _block(block_param_ptr, numel_ptr, first_block_ptr, BLOCK)
        if tl.load(grad_ptrs + i) != 0:
            grad = _address(grad_ptrs, i) + start
            param = _address(param_ptrs, i) + start
            state = tl.program_id(0).to(tl.int64) * BLOCK
            step = tl.load(steps_ptr + i).to(tl.float32)
            bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)   # 1 - beta1^step
            bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
            args = (tl.load(clip_ptr), tl.load(lr_ptr + i), tl.load(decay_ptr + i), beta1, beta2, eps,
                    bias_correction1, bias_correction2_sqrt)
            if left >= BLOCK:
                _adamw(param, grad, exp_avg_ptr + state, exp_avg_sq_ptr + state, left, *args, BLOCK, True)
            else:
                _adamw(param, grad, exp_avg_ptr + state, exp_avg_sq_ptr + state, left, *args, BLOCK, False)


_kernels = (_square_sum_kernel, _adamw_kernel) if triton is not None else None


def _log2(beta):
    return math.log2(beta) if beta > 0 else -math.inf   # beta^step = 2^(step * log2(beta)), 0 for beta = 0


class TritonUpdate(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay, no amsgrad) whose step first clips the gradients' global
    2-norm to max_norm, as torch.nn.utils.clip_grad_norm_ does, without writing the gradients. As torch's,
    a parameter without a gradient is left alone and its step is not counted. Parameters must be fp32,
    contiguous and on one device, and every group must share betas and eps; the parameters are fixed at
    construction (no add_param_group). `step()` never synchronizes the host with the device."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, max_norm: float = 1.0):
        if _kernels is None:
            raise RuntimeError("TritonUpdate needs Triton, which is not usable here: use torch's fused AdamW")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        self._built = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_norm = float(max_norm)
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._check_hyperparameters()
        device = self._params[0].device
        self._check_params()
        if not _available(device):
            raise RuntimeError(f"TritonUpdate's kernels need a CUDA GPU with Triton (or TRITON_INTERPRET=1), "
                               f"not {device.type}")
        self.block = BLOCK
        # One block at least, so that an empty parameter's steps are counted too.
        blocks = [max(1, math.ceil(p.numel() / BLOCK)) for p in self._params]
        first = [sum(blocks[:i]) for i in range(len(blocks))]

        def table(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)
        self._block_param = table([i for i, n in enumerate(blocks) for _ in range(n)], torch.int32)
        self._numel = table([p.numel() for p in self._params], torch.int64)
        self._shapes = [p.shape for p in self._params]
        self._first_block = table(first, torch.int32)
        self._exp_avg = torch.zeros(sum(blocks) * BLOCK, device=device)
        self._exp_avg_sq = torch.zeros_like(self._exp_avg)
        self._partials = torch.empty(sum(blocks), device=device)
        self._steps = torch.zeros(len(self._params), dtype=torch.int32, device=device)
        for i, (p, f) in enumerate(zip(self._params, first)):
            span = slice(f * BLOCK, f * BLOCK + p.numel())
            self.state[p].update(step=self._steps[i], exp_avg=self._exp_avg[span].view_as(p),
                                 exp_avg_sq=self._exp_avg_sq[span].view_as(p))
        self._params_key = self._grads_key = self._hyper_key = None
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        if self._built:
            raise NotImplementedError("TritonUpdate's parameters are fixed at construction: build a new one")
        super().add_param_group(param_group)

    def _check_hyperparameters(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            if not (g["lr"] >= 0 and g["eps"] >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1 and g["weight_decay"] >= 0):
                raise ValueError(f"TritonUpdate needs lr, eps and weight_decay >= 0 and betas in [0, 1), got "
                                 f"lr={g['lr']}, betas={g['betas']}, eps={g['eps']}, weight_decay={g['weight_decay']}")
        if len({(tuple(g["betas"]), g["eps"]) for g in self.param_groups}) != 1:
            raise ValueError("TritonUpdate needs the same betas and eps in every parameter group")

    def _check_params(self):
        if len({p.device for p in self._params}) != 1 or any(
                p.dtype != torch.float32 or not p.is_contiguous() or p.data_ptr() % 16 for p in self._params):
            raise ValueError("TritonUpdate needs contiguous, 16-byte aligned fp32 parameters, all on one device")

    def _upload(self, values, dtype):
        # Through pinned memory, so that the copy is asynchronous; kept alive by the caller's attribute.
        host = torch.tensor(values, dtype=dtype)
        if self._steps.is_cuda:
            host = host.pin_memory()
        return host, host.to(self._steps.device, non_blocking=True)

    @staticmethod
    def _grad_address(p):
        """The gradient's address, 0 for none; checked every step, since a new gradient may sit at an old
        address in another layout."""
        g = p.grad
        if g is None:
            return 0
        if (g.dtype != torch.float32 or g.shape != p.shape or not g.is_contiguous() or g.device != p.device
                or g.data_ptr() % 16):
            raise ValueError("TritonUpdate needs contiguous, 16-byte aligned fp32 gradients shaped like their "
                             "parameters")
        return g.data_ptr()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("TritonUpdate.step takes no closure")
        # The tables of addresses are uploaded again whenever a parameter or a gradient has moved (a
        # parameter's .data replaced, a gradient allocated elsewhere): normally never after the first steps.
        params_key = tuple(p.data_ptr() for p in self._params)
        if params_key != self._params_key:
            self._check_params()
            if [p.shape for p in self._params] != self._shapes or self._params[0].device != self._steps.device:
                raise ValueError("TritonUpdate's parameters changed shape or device since it was built")
            self._params_host, self._param_ptrs = self._upload(params_key, torch.int64)
            self._params_key = params_key
        grads_key = tuple(self._grad_address(p) for p in self._params)
        if grads_key != self._grads_key:
            self._grads_host, self._grad_ptrs = self._upload(grads_key, torch.int64)
            self._grads_key = grads_key
        hyper = tuple((g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"])
                      for g in self.param_groups for _ in g["params"])
        if hyper != self._hyper_key:
            self._check_hyperparameters()
            self._lr_host, self._lr = self._upload([h[0] for h in hyper], torch.float32)
            self._decay_host, self._decay = self._upload([h[1] for h in hyper], torch.float32)
            self._hyper_key = hyper
        square_sum, adamw = _kernels
        grid = (self._partials.numel(),)
        tables = (self._block_param, self._numel, self._first_block, self._grad_ptrs)
        square_sum[grid](*tables, self._partials, self._steps, BLOCK=self.block, num_warps=NUM_WARPS)
        norm = self._partials.sum().sqrt()
        clip = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)   # clip_grad_norm_'s factor
        beta1, beta2 = self.param_groups[0]["betas"]
        adamw[grid](*tables, self._param_ptrs, self._lr, self._decay, self._exp_avg, self._exp_avg_sq, clip,
                    self._steps, beta1, beta2, _log2(beta1), _log2(beta2), self.param_groups[0]["eps"],
                    BLOCK=self.block, num_warps=NUM_WARPS)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """Copies a state_dict of this class or of torch.optim.AdamW (same parameters, same groups, no
        amsgrad) into this optimizer's buffers and groups."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state_dict's parameter groups do not match this optimizer's")
        for p, i in zip(self._params, [i for g in groups for i in g["params"]]):
            saved, state = state_dict["state"].get(i, {}), self.state[p]
            for k in ("step", "exp_avg", "exp_avg_sq"):
                if k in saved:
                    state[k].copy_(saved[k])
                else:
                    state[k].zero_()
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k in ("lr", "betas", "eps", "weight_decay")})
        self._check_hyperparameters()


def reference(params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 1e-2,
              max_norm: float = 1.0) -> tuple[torch.optim.AdamW, Callable[[], None]]:
    """What TritonUpdate computes, as torch ships it: (optimizer, update), where update() clips the gradients'
    global 2-norm with clip_grad_norm_ (which writes them), then steps the torch.optim.AdamW optimizer.
    Takes TritonUpdate's arguments, parameter groups included."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    tensors = [p for group in optimizer.param_groups for p in group["params"]]

    def update():
        torch.nn.utils.clip_grad_norm_(tensors, max_norm)
        optimizer.step()
    return optimizer, update
