"""The chunked loss's softmax-gradient pass as one hand-written kernel: CUDA on a GPU, Triton elsewhere.

For each row of a chunk's logits the kernel finds the log-sum-exp, writes the row's loss, and overwrites
the row with its gradient, softmax minus one-hot, in place.

On a GPU of compute capability 8.0 or newer it is Utils/kernels/loss_kernel.cu, compiled at first use by
NVRTC (Utils.kernels.nvrtc): it copies each row into shared memory, so the logits are read once and written
once. On an H200 it takes 215 us for 4,096 rows of 50,304 columns, against 197 for a plain copy of them
and 328 for the Triton kernel (results/logs/loss-kernel-cuda.log).

The Triton kernel below is the fallback (no NVRTC, or a row that the CUDA kernel cannot take) and what
the tests run on a CPU, through Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported). It finds the log-sum-exp in one read (a running maximum and a running sum rescaled to it,
"online softmax"), then reads the row again to write the gradient: two reads and one write. It takes 328
us for the same chunk, against 370 for its first form (results/logs/loss-kernel-variants.log): one
exponential per element in the first pass instead of two (364 us at 4 warps), 8 warps instead of 4
(334), and the second pass walking the row backwards, so that it starts with the columns the first pass
read last, the likeliest still to be in L2 (328). Inductor's fusion of the same expression
(Utils.kernels.chunked_loss.softmax_grad) reads each row three times.
"""
import ctypes
import os

import torch

from Utils.kernels import nvrtc

try:
    import triton
    import triton.language as tl
except Exception:   # absent, or broken: apply_loss then runs the plain chunked loss instead
    triton = None

BLOCK = 2048   # columns per load; with 8 warps, the fastest of six pairs tried (1024..4096 x 4..16 warps)
NUM_WARPS = 8
CUDA_THREADS = 256   # 8 warps per block; 128 threads took 273 us per chunk against 216. Whole warps only, and
                     # at most the 256 of the kernel's __launch_bounds__
USE_CUDA = True      # False: the Triton kernel on a GPU too, to compare the two
_CUDA = nvrtc.Kernel(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_kernel.cu")).read(),
                     "cross_entropy_grad_rows")


# Read once, as @triton.jit reads it when the kernel is defined below.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device):
    """None where the kernel runs on this device, else why not."""
    return None if available(device) else "the loss kernel needs a GPU with NVRTC or Triton"


def available(device):
    """Whether the kernel runs on this device: a CUDA GPU where the CUDA kernel can be built, or with Triton,
    or any device under Triton's interpreter."""
    if device.type == "cuda":
        return _cuda_usable(device) or _triton_kernel is not None
    return _triton_kernel is not None and INTERPRETED


# Why the CUDA kernel cannot be built here, once compiling or loading it has failed (an NVRTC too old for
# the GPU, a driver too old for the NVRTC): the Triton kernel then runs instead.
_cuda_failure = None


def _cuda_usable(device):
    # cp.async and the bf16x2 conversion need compute capability 8.0 (Ampere) or newer.
    return (USE_CUDA and _cuda_failure is None and device.type == "cuda" and nvrtc.available(device)
            and torch.cuda.get_device_capability(device) >= (8, 0))


def _shared_fits(device, n_cols):
    # the row, and 1 KiB for the kernel's own scratch and what the hardware reserves per block
    return 2 * n_cols + 1024 <= torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def prepare(device, n_cols):
    """Compile and load the CUDA kernel for rows of n_cols now, not on its first call, which may fall inside
    a CUDA graph's capture. Returns a note if it cannot be built here (and the Triton kernel will run)."""
    global _cuda_failure
    if not (_cuda_usable(device) and _shared_fits(device, n_cols)):
        return None
    try:
        _CUDA.prepare(device, shared_bytes=2 * n_cols)
    except RuntimeError as e:
        _cuda_failure = str(e).splitlines()[0]
        return f"the CUDA loss kernel could not be built here ({_cuda_failure}): the Triton kernel instead"
    return None


def _cuda_takes(logits, targets):
    """Whether the CUDA kernel can take these logits: 16-byte vectors, int64 targets, a row that fits in shared
    memory, and sizes that fit the kernel's 32-bit arguments."""
    if not (logits.is_cuda and _cuda_usable(logits.device)):
        return False
    rows, cols = logits.shape
    return (logits.dtype == torch.bfloat16 and targets.dtype == torch.int64 and cols % 8 == 0
            and logits.stride(0) % 8 == 0 and logits.data_ptr() % 16 == 0 and 0 < rows < 2 ** 31
            and logits.stride(0) < 2 ** 31 and _shared_fits(logits.device, cols))


def _define_triton():
    """The Triton kernel; raises where this Triton cannot define it."""
    @triton.jit
    def _cross_entropy_grad_kernel(logits_ptr, targets_ptr, row_loss_ptr, n_cols, vocab_size, row_stride,
                                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        offsets = tl.arange(0, BLOCK)
        # Read before the barrier below orders it before any warp's in-place writes.
        target = tl.load(targets_ptr + row)
        target_logit = tl.load(base + target).to(tl.float32)
        # Per-lane running maximum m and sum s of exp(x - m). -1e30 rather than -inf, so that a lane that
        # has seen only masked columns never computes inf - inf. Of the two exponentials of the textbook
        # update, s * exp(m - m') + exp(x - m'), one is always exp(0): exp(-|x - m|) is the other.
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
            d = x - m
            e = tl.exp(-tl.abs(d))
            up = d > 0
            s = tl.where(up, s * e + 1.0, s + e)
            m = tl.where(up, x, m)
        m_row = tl.max(m, 0)
        lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
        tl.store(row_loss_ptr + row, lse - target_logit)
        # The reductions above synchronize the warps too, but only as Triton happens to build them.
        tl.debug_barrier()
        n_blocks = tl.cdiv(n_cols, BLOCK)
        for i in range(0, n_blocks):
            cols = (n_blocks - 1 - i) * BLOCK + offsets   # backwards: the last-read columns first
            x = tl.load(base + cols, mask=cols < vocab_size, other=0.0).to(tl.float32)
            p = tl.where(cols < vocab_size, tl.exp(x - lse), 0.0)   # padded columns: exactly zero gradient
            g = p - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)

    return _cross_entropy_grad_kernel


_triton_kernel = None
if triton is not None:
    try:
        _triton_kernel = _define_triton()
    except Exception:   # a broken Triton: as if it were absent
        pass


# An operator, so that torch.compile and CUDA graphs see one opaque call that overwrites the logits.
@torch.library.custom_op("gpt_suite::cross_entropy_grad_", mutates_args={"logits"})
def _cross_entropy_grad_op(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    rows, cols = logits.shape
    row_loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return row_loss
    if _cuda_takes(logits, targets):
        _CUDA.launch((rows, 1, 1), (CUDA_THREADS, 1, 1),
                     [logits, targets, row_loss, ctypes.c_int(cols), ctypes.c_int(vocab_size),
                      ctypes.c_int(logits.stride(0))], logits.device, shared_bytes=2 * cols)
    elif _triton_kernel is not None:
        _triton_kernel[(rows,)](logits, targets, row_loss, cols, vocab_size, logits.stride(0), BLOCK=BLOCK,
                                num_warps=NUM_WARPS)
    else:
        raise RuntimeError(f"the cross-entropy kernel cannot take these logits here (shape {tuple(logits.shape)}, "
                           f"{logits.dtype}) and Triton, its fallback, is absent: use loss='chunked'")
    return row_loss


@_cross_entropy_grad_op.register_fake
def _(logits, targets, vocab_size):
    return logits.new_empty(logits.size(0), dtype=torch.float32)


_op = torch.ops.gpt_suite.cross_entropy_grad_


def cross_entropy_grad(logits, targets, vocab_size):
    """Overwrite logits (rows x padded vocabulary, each row contiguous) with softmax(logits[:, :vocab_size])
    minus one-hot(targets), zero in the padded columns, and return each row's loss, lse - logit[target],
    in fp32. Targets must lie in [0, vocab_size): there is no ignore index, and checking the range would
    cost a device-to-host read per chunk."""
    if not torch.compiler.is_compiling() and not available(logits.device):
        raise RuntimeError(f"the cross-entropy kernel needs a CUDA GPU with NVRTC or Triton (or Triton with "
                           f"TRITON_INTERPRET=1), not {logits.device.type}: use loss='chunked'")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"the cross-entropy kernel needs 2-D logits with contiguous rows, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}")
    if targets.shape != (logits.size(0),) or targets.device != logits.device:
        raise ValueError(f"targets must be one per row of logits ({logits.size(0)}) on {logits.device}, got "
                         f"shape {tuple(targets.shape)} on {targets.device}")
    if not 0 < vocab_size <= logits.size(1):
        raise ValueError(f"vocab_size={vocab_size} must be between 1 and the logits' width {logits.size(1)}")
    return _op(logits, targets.contiguous(), vocab_size)
