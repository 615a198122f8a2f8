"""Which attention kernel a run ran, and SDPA_BACKEND, the pin a user may put on PyTorch's choice.

F.scaled_dot_product_attention picks a kernel at each call from the inputs and the GPU: on Hopper with cuDNN
newer than 9.15, PyTorch 2.11 prefers cuDNN's fused attention to FlashAttention-2. So the run records what a
warm-up step dispatched (Utils.train.loop picks which), read off a host-side profile of that step: each backend
runs under an operator of its own, which compiled code calls as eager code does. Operators that torch.compile
ran while tracing (inside its `dynamo_timed` ranges) are not what the step ran, and are left out: Inductor may
replace the traced attention with another kernel, or with its own.
"""
import contextlib
import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F

# The operator each SDPA backend runs under, and ours (Utils.kernels.packed_attention), by the name runs.csv uses.
KERNELS = {
    "aten::_scaled_dot_product_flash_attention": "flash2",
    "aten::_flash_attention_forward": "flash2",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_cudnn_attention_forward": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_efficient_attention_forward": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "gpt_suite::packed_attention": "packed",
}
WRITTEN_OUT = "written_out"   # no SDPA: the scores, mask and softmax as the model writes them (the first rungs)

# SDPA_BACKEND's values; auto leaves the choice to PyTorch.
BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def kernel_of(operators: Iterable[str]) -> str:
    """The attention kernel(s) among the operators a step ran, '+'-joined if several; written_out if none."""
    found = sorted({KERNELS[name] for name in operators if name in KERNELS})
    return "+".join(found) or WRITTEN_OUT


class Watch:
    """Profiles what runs inside `with watch:` (the host's operators only, with the autograd profiler's own event
    list: Kineto's first start costs over a second a process, this a few milliseconds); kernel() then names the
    attention kernel among them. Reading the profile is left for after the timed steps: done between two steps,
    it would land in the next one."""

    def __init__(self, device: torch.device):
        self.profile = None

    def __enter__(self) -> "Watch":
        from torch.autograd.profiler import profile
        self.profile = profile(use_kineto=False)
        self.profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.profile.__exit__(*exc)

    def kernel(self) -> str | None:
        """The attention kernel of what ran inside, or None if nothing was watched. Read off the profiler's raw
        events rather than its FunctionEvents: under CUDA graphs the watched step is the one that compiled, with over
        100,000 operators recorded while tracing, and parsing them into FunctionEvents took 5.9 s after a 124M step
        on a CPU, this 0.3 s (BENCHMARKS.md, "Reading the watched step")."""
        results = self.profile.kineto_results if self.profile is not None else None
        if results is None:   # nothing watched, or a profile that never started
            return None
        events = [(e.name(), e.start_ns(), e.end_ns(), e.start_thread_id()) for e in results.events()]
        compiling = {}   # thread -> the (start, end) of each range in which torch.compile traced or compiled
        for name, start, end, thread in events:
            if name.endswith("(dynamo_timed)"):
                compiling.setdefault(thread, []).append((start, end))
        # An operator inside such a range, on its thread, ran while tracing: not what the step ran.
        return kernel_of(name for name, start, _, thread in events
                         if name in KERNELS and not any(a <= start <= b for a, b in compiling.get(thread, ())))


def _backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def pinned(name: str) -> contextlib.AbstractContextManager:
    """SDPA held to one backend (PyTorch's sdpa_kernel); auto: PyTorch's own choice."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(_backend(name))


def cannot_run(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why SDPA held to backend `name` cannot run causal attention of this head size and dtype, forward and
    backward, on this device (PyTorch's own warnings say which condition failed); None when it can."""
    if name == "auto":
        return None
    q, k, v = (torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with pinned(name):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            return None
        except RuntimeError as e:
            reasons = [str(w.message).split("\n")[0] for w in said] or [str(e).split("\n")[0]]
            return "; ".join(dict.fromkeys(reasons))
