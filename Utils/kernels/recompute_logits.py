"""The FP8 output layer's logits recomputed, not stored: each chunk of Utils.kernels.fp8_loss as two persistent
Triton GEMMs over the same FP8 operands, neither of which writes a logit.

fp8_loss's stored form moves 7 bytes a logit for each chunk: the logits' GEMM writes them in bf16 (2), the loss
kernel's pass reads them (2) and writes the e5m2 gradient row-major (1), and a transpose copies that (1 + 1). In
the 124M batch-64 profile (results/h100-profile-b64/logs/kernels.txt) that is 1,142 + 817 + 608 µs for a chunk of 16,384
tokens. Here instead:
- `_lse_kernel`: the logits' GEMM, whose epilogue keeps of each BM x BN tile only each row's maximum and sum of
  exponentials, and the target's logit in the tile that holds it; a few torch operations then make each row's
  log-sum-exp and loss from the tiles' partial sums.
- `_grad_kernel`: the same GEMM again, whose epilogue writes (softmax - one-hot) * GRAD_SCALE in e5m2 from the
  fp32 accumulator, row-major and transposed (the layouts the two gradient GEMMs read), through TMA stores.
Two GEMMs instead of one, for 5 bytes a logit fewer and no logits buffer (1.6 GB at 16,384 tokens). The GEMMs'
cost grows with the model's width and the bytes do not, so it can pay only in narrow models.

The logits are never rounded to bf16, so the gradient is, if anything, nearer the exact one than the stored
form's. TMA descriptors need a Hopper GPU; Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on a CPU,
for their tests only.
"""
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:   # absent, broken, or too old for tensor descriptors: the stored form instead
    triton = None

# Each program's tile (rows, columns, summed depth), the row tiles walked together (so that a chunk's weight is
# read once from memory: 365 -> 303 µs for the logits' GEMM alone as the group grew from 1 to 32 row tiles,
# bench/fp8_head_gemm.py, BENCHMARKS.md), warp specialization, pipeline stages and warps. The first shape
# bench/recompute_logits.py tries; the gradient kernel needs 213 KB of shared memory with it (sm_90).
TILE = dict(BM=128, BN=256, BK=128, GROUP_M=32, WS=True, num_stages=3, num_warps=8)


def unavailable(device: torch.device) -> str | None:
    """None on a Hopper GPU with a Triton that has tensor descriptors; else why not. Hopper only: TILE's gradient
    kernel needs 213 KB of shared memory (compiled for sm_90 by Triton 3.6), more than an sm_120 card has, and
    nothing else was compiled."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "recomputing the logits needs a Hopper GPU (TMA descriptors, compute capability 9.x)"
    if triton is None:
        return "recomputing the logits needs Triton with tensor descriptors (3.4 or newer)"
    return None


if triton is not None:
    @triton.jit
    def tile_order(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of a persistent GEMM's tile_id: GROUP_M row tiles walked together, so that
        the columns of the second operand they share stay in L2."""
        group = GROUP_M * num_pid_n
        first_m = (tile_id // group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        return first_m + (tile_id % group) % size_m, (tile_id % group) // size_m

    @triton.jit
    def logits_tile(a_desc, b_desc, tile_id, num_pid_m, num_pid_n, K, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP_M: tl.constexpr):
        """(the fp32 product of tile tile_id of a [M, K] and b [N, K], both K-major as FP8 wgmma reads them,
        unscaled; its first row; its first column)."""
        pid_m, pid_n = tile_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om, on = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([om, ki * BK]), b_desc.load([on, ki * BK]).T, acc)
        return acc, om, on

    @triton.jit
    def _lse_kernel(a_desc, b_desc, scale_ptr, targets_ptr, m_ptr, s_ptr, tgt_ptr, M, N, K, vocab_size,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    PROGRAMS: tl.constexpr, WS: tl.constexpr):
        num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        scale = tl.load(scale_ptr)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
            acc, om, on = logits_tile(a_desc, b_desc, tile_id, num_pid_m, num_pid_n, K, BM, BN, BK, GROUP_M)
            rows, cols = om + tl.arange(0, BM), on + tl.arange(0, BN)
            x = tl.where(cols[None, :] < vocab_size, acc * scale, float("-inf"))   # padded columns take no part
            top = tl.max(x, 1)
            # A tile of padding alone keeps a maximum of -inf and a sum of 0, which the reduction weighs at 0.
            top_or_0 = tl.where(top == float("-inf"), 0.0, top)
            in_rows = rows < M
            # [column tiles, M]: a tile's rows are contiguous
            tl.store(m_ptr + (on // BN) * M + rows, top, mask=in_rows)
            tl.store(s_ptr + (on // BN) * M + rows, tl.sum(tl.exp(x - top_or_0[:, None]), 1), mask=in_rows)
            target = tl.load(targets_ptr + rows, mask=in_rows, other=-1)
            hit = tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), 1)
            tl.store(tgt_ptr + rows, hit, mask=in_rows & (target >= on) & (target < on + BN))

    @triton.jit
    def _grad_kernel(a_desc, b_desc, g_desc, gt_desc, scale_ptr, lse_ptr, targets_ptr, M, N, K, vocab_size,
                     grad_scale, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     PROGRAMS: tl.constexpr, WS: tl.constexpr):
        num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        scale = tl.load(scale_ptr)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True, warp_specialize=WS):
            acc, om, on = logits_tile(a_desc, b_desc, tile_id, num_pid_m, num_pid_n, K, BM, BN, BK, GROUP_M)
            rows, cols = om + tl.arange(0, BM), on + tl.arange(0, BN)
            lse = tl.load(lse_ptr + rows, mask=rows < M, other=0.0)
            target = tl.load(targets_ptr + rows, mask=rows < M, other=-1)
            p = tl.where(cols[None, :] < vocab_size, tl.exp(acc * scale - lse[:, None]), 0.0)   # padded columns: 0
            g = ((p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * grad_scale).to(tl.float8e5)
            # The TMA stores clip at the descriptors' bounds: rows past M, and grad_t's columns past this chunk's.
            g_desc.store([om, on], g)
            gt_desc.store([on, om], tl.trans(g))   # through shared memory: whole rows of the transposed tile


def loss_and_grad(h8: Tensor, h_inv: Tensor, w8: Tensor, w_inv: Tensor, targets: Tensor, vocab_size: int,
                  grad_scale: float, row_loss: Tensor, grad: Tensor, grad_t: Tensor, lse: Tensor | None = None,
                  tile: dict | None = None) -> None:
    """For the tokens h8 [M, K] (e4m3, inverse scale h_inv) against the padded output layer w8 [N, K] (e4m3,
    w_inv): write each row's cross-entropy over the first vocab_size columns into row_loss [M], and
    (softmax - one-hot) * grad_scale in e5m2 into grad [M, N] and grad_t [N, M] (its rows may be strided: a
    chunk's columns of a buffer for all tokens). lse: room for each row's log-sum-exp [M], fp32. tile: TILE's
    keys, to try other shapes. M, K, N and grad_t's row stride must be multiples of 16 bytes, as TMA needs."""
    shape = {**TILE, **(tile or {})}
    BM, BN, BK = shape["BM"], shape["BN"], shape["BK"]
    M, K = h8.shape
    N = w8.size(0)
    num_pid_n = triton.cdiv(N, BN)
    a, b = TensorDescriptor.from_tensor(h8, [BM, BK]), TensorDescriptor.from_tensor(w8, [BN, BK])
    g, gt = TensorDescriptor.from_tensor(grad, [BM, BN]), TensorDescriptor.from_tensor(grad_t, [BN, BM])
    scale = (h_inv * w_inv).reshape(1)
    tiles = triton.cdiv(M, BM) * num_pid_n
    # A persistent program for each SM; under Triton's interpreter (tensors on the CPU), a few
    programs = min(tiles, torch.cuda.get_device_properties(h8.device).multi_processor_count if h8.is_cuda else 4)
    launch = dict(shape, PROGRAMS=programs)
    m, s = (torch.empty(num_pid_n, M, dtype=torch.float32, device=h8.device) for _ in range(2))
    target_logit = torch.empty(M, dtype=torch.float32, device=h8.device)
    lse = torch.empty(M, dtype=torch.float32, device=h8.device) if lse is None else lse
    _lse_kernel[(programs,)](a, b, scale, targets, m, s, target_logit, M, N, K, vocab_size, **launch)
    top = m.amax(0)
    torch.add(top, (s * torch.exp(m - top)).sum(0).log(), out=lse)
    torch.sub(lse, target_logit, out=row_loss)
    _grad_kernel[(programs,)](a, b, g, gt, scale, lse, targets, M, N, K, vocab_size, grad_scale, **launch)


def reference(h8: Tensor, h_inv: Tensor, w8: Tensor, w_inv: Tensor, targets: Tensor,
              vocab_size: int) -> tuple[Tensor, Tensor]:
    """What loss_and_grad computes, in float64 from the same FP8 operands: (each row's loss [M], softmax - one-hot
    [M, N] unscaled, zero in the padded columns)."""
    logits = (h8.double() * h_inv.double()) @ (w8.double() * w_inv.double())[:vocab_size].t()
    grad = torch.zeros(h8.size(0), w8.size(0), dtype=torch.float64, device=h8.device)
    grad[:, :vocab_size] = torch.softmax(logits, 1)
    grad[torch.arange(h8.size(0), device=h8.device), targets] -= 1
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none"), grad
