"""The chunked loss's softmax-gradient pass as one hand-written kernel: CUDA on a GPU, Triton elsewhere.

For each row of a chunk's logits the kernel finds the log-sum-exp, writes the row's loss, and overwrites
the row with its gradient, softmax minus one-hot, in place (`cross_entropy_grad`; `reference` is the same
mathematics in PyTorch operations, out of place).

On a GPU of compute capability 8.0 or newer it is loss_kernel.cu, compiled at first use by NVRTC
(Utils.kernels.native), which reads the logits once and writes them once. Its twin in the same source
(`grad_e5m2`, Ada or Hopper) writes the gradient scaled, in FP8, into a buffer of its own: the FP8 loss's
pass (Utils.kernels.fp8_loss). The Triton kernel below is the fallback (no NVRTC, or a row that the CUDA kernel
cannot take) and what the tests run on a CPU, through Triton's interpreter (TRITON_INTERPRET=1, set before this
module is imported); it reads each row twice.
Their times, and those of the variants tried, are in BENCHMARKS.md (kernel tuning history).
"""
import ctypes
import os

import torch
from torch import Tensor

from Utils.kernels import fp8, native

try:
    import triton
    import triton.language as tl
except Exception:   # absent, or broken: the ladder then runs the plain chunked loss instead
    triton = None

# Columns per load, and warps, of the Triton kernel: the fastest pair tried (BENCHMARKS.md).
BLOCK = 2048
NUM_WARPS = 8
# Threads per block of the CUDA kernel: whole warps only, at most the 256 of its __launch_bounds__; 256 was
# the fastest tried (BENCHMARKS.md).
CUDA_THREADS = 256
# The kernel's logits rows are a multiple of this wide (kernel_logits_width): the GEMMs that write and read
# them stay evenly tiled.
KERNEL_ROW_MULTIPLE = 128
USE_CUDA = True      # False: the Triton kernels on a GPU too (the FP8 loss's two passes among them), to compare
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_kernel.cu"), encoding="utf-8") as _file:
    _source = _file.read()
_CUDA = native.Kernel(_source, "cross_entropy_grad_rows")
_CUDA_E5M2 = native.Kernel(_source, "cross_entropy_grad_rows_e5m2")   # the FP8 loss's pass (Utils.kernels.fp8_loss)

# Read once, as @triton.jit reads it when the kernel is defined below.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_logits_width(n_rows: int) -> int:
    """The width of the logits that the loss kernel gets for an output layer of n_rows: a multiple of 128."""
    return -(-n_rows // KERNEL_ROW_MULTIPLE) * KERNEL_ROW_MULTIPLE


def unavailable(device: torch.device) -> str | None:
    """None where the kernel runs on this device (a CUDA GPU where the CUDA kernel can be built or Triton
    runs, or any device under Triton's interpreter), else why not."""
    if device.type == "cuda":
        return None if _cuda_usable(device) or _triton_kernel is not None else \
            "the loss kernel needs a GPU with NVRTC or Triton"
    if _triton_kernel is not None and INTERPRETED:
        return None
    return "the loss kernel needs a GPU with NVRTC or Triton (or Triton's interpreter, TRITON_INTERPRET=1)"


# Why the CUDA kernel cannot be built here, once compiling or loading it has failed (an NVRTC too old for
# the GPU, a driver too old for the NVRTC): the Triton kernel then runs instead.
_cuda_failure = None


def _cuda_usable(device: torch.device) -> bool:
    # cp.async and the bf16x2 conversion need compute capability 8.0 (Ampere) or newer.
    return (USE_CUDA and _cuda_failure is None and device.type == "cuda" and native.nvrtc_unavailable(device) is None
            and torch.cuda.get_device_capability(device) >= (8, 0))


def _shared_fits(device: torch.device, n_cols: int) -> bool:
    # the row, and 1 KiB for the kernel's own scratch and what the hardware reserves per block
    return 2 * n_cols + 1024 <= torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def prepare(device: torch.device, n_cols: int) -> str | None:
    """Compile and load the CUDA kernel for rows of n_cols now, not on its first call, which may fall inside
    a CUDA graph's capture. Returns a note if it cannot be built here (and the Triton kernel will run)."""
    global _cuda_failure
    if not (_cuda_usable(device) and _shared_fits(device, n_cols)):
        return None
    try:
        _CUDA.prepare(device, shared_bytes=2 * n_cols)
        if fp8.unavailable(device) is None:   # conversions to FP8 need Ada or newer
            _CUDA_E5M2.prepare(device, shared_bytes=2 * n_cols)
    except RuntimeError as e:
        _cuda_failure = str(e).splitlines()[0]
        return f"the CUDA loss kernel could not be built here ({_cuda_failure}): the Triton kernel instead"
    return None


def _cuda_takes(logits: Tensor, targets: Tensor) -> bool:
    """Whether the CUDA kernel can take these logits: 16-byte vectors, int64 targets, rows that do not overlap
    (the bf16 kernel writes over them), a row that fits in shared memory, and sizes that fit the kernel's 32-bit
    arguments."""
    if not (logits.is_cuda and _cuda_usable(logits.device)):
        return False
    rows, cols = logits.shape
    return (logits.dtype == torch.bfloat16 and targets.dtype == torch.int64 and cols % 8 == 0
            and logits.stride(0) % 8 == 0 and cols <= logits.stride(0) < 2 ** 31 and logits.data_ptr() % 16 == 0
            and 0 < rows < 2 ** 31 and _shared_fits(logits.device, cols))


def grad_e5m2(logits: Tensor, targets: Tensor, vocab_size: int, row_loss: Tensor, grad: Tensor, scale: float) -> bool:
    """Where the CUDA kernel can take these logits on an Ada or Hopper GPU: write each row's loss into row_loss
    and (softmax - one-hot) * scale, in e5m2, into grad (contiguous, the logits' shape), reading the logits
    once, and return True. Else return False, having written nothing."""
    if not (_cuda_takes(logits, targets) and fp8.unavailable(logits.device) is None
            and 0 < vocab_size <= logits.size(1) and grad.is_contiguous() and grad.shape == logits.shape
            and grad.dtype == torch.float8_e5m2
            and grad.data_ptr() % 8 == 0 and row_loss.is_contiguous() and row_loss.shape == (logits.size(0),)
            and row_loss.dtype == torch.float32):
        return False
    rows, cols = logits.shape
    args = [logits, targets, row_loss, grad, ctypes.c_float(scale), ctypes.c_int(cols), ctypes.c_int(vocab_size),
            ctypes.c_int(logits.stride(0))]
    _CUDA_E5M2.launch((rows, 1, 1), (CUDA_THREADS, 1, 1), args, logits.device, shared_bytes=2 * cols)
    return True


def _define_triton():
    """The Triton kernel, and its log-sum-exp pass as a function other kernels call (Utils.kernels.fp8_loss);
    raises where this Triton cannot define them."""
    # --- A row's log-sum-exp over its first vocab_size columns, BLOCK columns a load: per lane a running
    # maximum m and sum s of exp(x - m) ("online softmax"). -1e30 rather than -inf, so that a lane that has
    # seen only masked columns never computes inf - inf. Of the two exponentials of the textbook update,
    # s * exp(m - m') + exp(x - m'), one is always exp(0): exp(-|x - m|) is the other (with two a logit, the
    # FP8 loss's pass was bound by the exponential units, not the HBM: BENCHMARKS.md).
    @triton.jit
    def row_logsumexp(row_ptr, vocab_size, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + offsets
            x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
            d = x - m
            e = tl.exp(-tl.abs(d))
            up = d > 0
            s = tl.where(up, s * e + 1.0, s + e)
            m = tl.where(up, x, m)
        m_row = tl.max(m, 0)
        return m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))

    # --- Softmax gradient of one row per program, in place: fuses the log-sum-exp, the row's loss and
    # softmax minus one-hot into two reads and one write of the row, where Inductor's fusion of the same
    # expressions reads it three times. The first pass keeps a running maximum and a sum rescaled to it
    # ("online softmax"); the second walks the row backwards, starting with the columns the first pass
    # read last, the likeliest still to be in L2.
    @triton.jit
    def _cross_entropy_grad_kernel(logits_ptr, targets_ptr, row_loss_ptr, n_cols, vocab_size, row_stride,
                                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        offsets = tl.arange(0, BLOCK)
        # Read before the barrier below orders it before any warp's in-place writes.
        target = tl.load(targets_ptr + row)
        target_logit = tl.load(base + target).to(tl.float32)
        lse = row_logsumexp(base, vocab_size, BLOCK)
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

    return _cross_entropy_grad_kernel, row_logsumexp


_triton_kernel = row_logsumexp = None
if triton is not None:
    try:
        _triton_kernel, row_logsumexp = _define_triton()
    except Exception:   # a broken Triton: as if it were absent
        pass


# An operator, so that torch.compile and CUDA graphs see one opaque call that overwrites the logits.
@torch.library.custom_op("gpt_suite::cross_entropy_grad_", mutates_args={"logits"})
def _cross_entropy_grad_op(logits: Tensor, targets: Tensor, vocab_size: int) -> Tensor:
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
                           f"{logits.dtype}) and Triton, its fallback, is absent: use the plain chunked loss")
    return row_loss


@_cross_entropy_grad_op.register_fake
def _(logits, targets, vocab_size):
    return logits.new_empty(logits.size(0), dtype=torch.float32)


_op = torch.ops.gpt_suite.cross_entropy_grad_


def cross_entropy_grad(logits: Tensor, targets: Tensor, vocab_size: int) -> Tensor:
    """Overwrite logits (rows x padded vocabulary, each row contiguous) with softmax(logits[:, :vocab_size])
    minus one-hot(targets), zero in the padded columns, and return each row's loss, lse - logit[target],
    in fp32. The kernel computes in fp32 whatever the logits' dtype. Targets must lie in [0, vocab_size):
    there is no ignore index, and checking the range would cost a device-to-host read per chunk."""
    if not torch.compiler.is_compiling():
        why = unavailable(logits.device)
        if why:
            raise RuntimeError(f"{why}, not {logits.device.type}: use the plain chunked loss")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"the cross-entropy kernel needs 2-D logits with contiguous rows, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}")
    check_targets(targets, logits, "logits", vocab_size, logits.size(1), "the logits' width")
    return _op(logits, targets.contiguous(), vocab_size)


def check_targets(targets: Tensor, rows: Tensor, rows_name: str, vocab_size: int, columns: int,
                  columns_name: str) -> None:
    """Raise ValueError unless targets are one per row of `rows` on its device and vocab_size lies in
    [1, columns]: the checks a loss over padded logits makes before its kernels read a target unchecked."""
    if targets.shape != (rows.size(0),) or targets.device != rows.device:
        raise ValueError(f"targets must be one per row of {rows_name} ({rows.size(0)}) on {rows.device}, got "
                         f"shape {tuple(targets.shape)} on {targets.device}")
    if not 0 < vocab_size <= columns:
        raise ValueError(f"vocab_size={vocab_size} must be between 1 and {columns_name} {columns}")


def reference(logits: Tensor, targets: Tensor, vocab_size: int,
              acc: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(each row's loss in `acc`, softmax minus one-hot in logits' dtype) over the first vocab_size columns,
    later columns with a zero gradient: what cross_entropy_grad computes, out of place. Written as
    reductions and elementwise maps of the logits, which Inductor fuses into one kernel over them that
    writes no `acc` copy of the logits (the plain chunked loss compiles exactly this)."""
    columns = torch.arange(logits.size(1), device=logits.device)
    x = logits.to(acc).masked_fill(columns >= vocab_size, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    row_loss = lse - x.gather(1, targets[:, None]).squeeze(1)
    one_hot = (columns == targets[:, None]).to(acc)
    return row_loss, (torch.exp(x - lse[:, None]) - one_hot).to(logits.dtype)
