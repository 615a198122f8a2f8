// --- Softmax gradient of one bf16 row per block (Utils/kernels/loss_kernel.py launches it).
// Fuses the log-sum-exp, the row's loss and softmax minus one-hot into one read and one write of the
// row, the least such a pass can move: the row is copied into shared memory (cp.async, 16 bytes per
// copy), reduced there twice (maximum, then the sum of exponentials), and its gradient written out. The
// Triton kernel, which cannot stage a row in shared memory, reads it twice. A 50,304-column row takes
// 98 KiB, so two blocks share an SM and one computes while the other waits on memory.
//
// Two kernels share the body: cross_entropy_grad_rows writes the gradient over the row, in bf16 (the bf16
// loss); cross_entropy_grad_rows_e5m2 writes it times `scale`, in e5m2 (1 byte a logit), into a row of its
// own (the FP8 loss, Utils/kernels/fp8_loss.py, whose gradient GEMMs read it). The e5m2 kernel keeps the row's
// exponentials, exp(x - max) * 2^EXP_SHIFT, in fp16 over the row in shared memory as it sums them, and writes
// each times scale / sum: one exponential a logit. With two, the pass was bound by the SM's exponential units
// and its instruction issue, not by the HBM (BENCHMARKS.md, kernel tuning history).
// fp16's 11 bits are 8 more than e5m2's, but only 3 more than bf16's, so the bf16 kernel computes each
// exponential again from the logit. The target's gradient, p - 1, is computed again in fp32 from its logit,
// since p - 1 loses to cancellation what fp16 costs p.
//
// Columns from vocab_size on are left out of the softmax and get a zero gradient. Needs n_cols and
// row_stride multiples of 8 and a 16-byte aligned row start (loss_kernel.py checks).
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)
#define LN2 0.6931471805599453f
// exp(x - max) * 2^EXP_SHIFT is at most about 2^15 (fp32 rounding), under fp16's largest value (65,504), and
// fp16's smallest (2^-24) is then 2^-39 of the row's largest term: every gradient e5m2 holds (down to 2^-16 at
// a scale of 2^15) is kept.
#define EXP_SHIFT 15.f

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : (is_max ? NEG_INF : 0.f);
    for (int o = 16; o > 0; o >>= 1) {
        float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    __syncthreads();   // scratch is reused by the next reduction
    return v;
}

// Two gradients (column c0, then c0 + 1) to e5m2, c0's in the low byte: little-endian memory order.
__device__ __forceinline__ unsigned short to_e5m2x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();   // FP8 conversions need compute capability 8.9; fp8_loss.py never launches this below it
    return 0;
#endif
}

__device__ __forceinline__ unsigned to_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ unsigned max_bf16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ unsigned to_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float f16_lo(unsigned h) {
    float r;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, l;\n}" : "=f"(r) : "r"(h));
    return r;
}

__device__ __forceinline__ float f16_hi(unsigned h) {
    float r;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, h;\n}" : "=f"(r) : "r"(h));
    return r;
}

// Starts copying a row into shared memory, 16 bytes a copy: thread t the vectors t, t + blockDim.x, ..., the
// ones it reads later; one cp.async group.
__device__ __forceinline__ void issue_row(uint4* row_buf, const uint4* row_vec, int n_vec) {
    for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
        unsigned dst = (unsigned)__cvta_generic_to_shared(row_buf + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(row_vec + i) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// The sum, in fp32, of the exponentials of one vector of 8 bf16 logits, e = exp2(x * log2(e) + shift), with
// STORE written over the vector in fp16. With CHECK, columns from `valid` (counted in the vector) on are out
// of the softmax and get e = 0; a separate instance for the few vectors that need it, so that the others
// carry no per-column test.
template <bool CHECK, bool STORE>
__device__ __forceinline__ float exp_vector(uint4& v, float shift, int valid) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    unsigned e[4];
    float s = 0.f;
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        float lo = exp2f(fmaf(__uint_as_float(w[k] << 16), LOG2E, shift));
        float hi = exp2f(fmaf(__uint_as_float(w[k] & 0xffff0000u), LOG2E, shift));
        if (CHECK && 2 * k >= valid) lo = 0.f;
        if (CHECK && 2 * k + 1 >= valid) hi = 0.f;
        s += lo + hi;
        e[k] = to_f16x2(lo, hi);
    }
    if (STORE) v = make_uint4(e[0], e[1], e[2], e[3]);
    return s;
}

// Row `row`, its copy into row_buf issued by issue_row and waited for. Each thread reads only the vectors it
// copied in (i = tid, tid + blockDim.x, ...; where a pass is split in two loops, the second goes on from where
// the first stopped): cp.async's wait covers a thread's own copies only, and the passes then need no barrier
// but the reductions'; nor does the next copy into row_buf, which each thread issues after its last read. The
// vectors wholly inside the vocabulary (all but the last few) go without per-column checks.
template <bool TO_E5M2>
__device__ __forceinline__ void grad_row(int row, uint4* row_buf, float* scratch, unsigned short* logits,
                                         const long long* targets, float* row_loss, uint2* grad, float scale,
                                         int n_cols, int vocab_size, int row_stride) {
    const int tid = threadIdx.x;
    unsigned short* base = logits + (long long)row * row_stride;
    uint4* row_vec = reinterpret_cast<uint4*>(base);
    const int n_vec = n_cols >> 3, n_full = min(vocab_size, n_cols) >> 3;
    const int target = (int)targets[row];
    // Read before the first reduction, whose barrier orders it before the bf16 kernel's writes over the row.
    const float x_target = __uint_as_float((unsigned)base[target] << 16);

    // The maximum: bf16 pairs compared as they are, two columns an instruction.
    unsigned pair_max = 0xff80ff80u;   // two bf16 -inf
    int i = tid;
    for (; i < n_full; i += blockDim.x) {
        const uint4 v = row_buf[i];
        pair_max = max_bf16x2(pair_max, max_bf16x2(max_bf16x2(v.x, v.y), max_bf16x2(v.z, v.w)));
    }
    float m = fmaxf(__uint_as_float(pair_max << 16), __uint_as_float(pair_max & 0xffff0000u));
    for (; i < n_vec; i += blockDim.x) {
        const uint4 v = row_buf[i];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            if (i * 8 + 2 * k < vocab_size) m = fmaxf(m, __uint_as_float(w[k] << 16));
            if (i * 8 + 2 * k + 1 < vocab_size) m = fmaxf(m, __uint_as_float(w[k] & 0xffff0000u));
        }
    }
    m = block_reduce(m, true, scratch);

    const float shift = EXP_SHIFT - m * LOG2E;
    float s = 0.f;
    for (i = tid; i < n_full; i += blockDim.x) s += exp_vector<false, TO_E5M2>(row_buf[i], shift, 0);
    for (; i < n_vec; i += blockDim.x) s += exp_vector<true, TO_E5M2>(row_buf[i], shift, vocab_size - i * 8);
    s = block_reduce(s, false, scratch);
    const float lse = m + logf(s) - EXP_SHIFT * LN2;
    if (tid == 0) row_loss[row] = lse - x_target;

    const float r = scale / s, lse2 = lse * LOG2E, g_target = (exp2f((x_target - lse) * LOG2E) - 1.f) * scale;
    for (i = tid; i < n_vec; i += blockDim.x) {
        const uint4 v = row_buf[i];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};   // e in fp16 (e5m2), else the logits
        float g[8];
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            if (TO_E5M2) {
                g[2 * k] = f16_lo(w[k]) * r;
                g[2 * k + 1] = f16_hi(w[k]) * r;
            } else {
                const int c0 = i * 8 + 2 * k;
                g[2 * k] = c0 < vocab_size ? exp2f(fmaf(__uint_as_float(w[k] << 16), LOG2E, -lse2)) : 0.f;
                g[2 * k + 1] = c0 + 1 < vocab_size
                               ? exp2f(fmaf(__uint_as_float(w[k] & 0xffff0000u), LOG2E, -lse2)) : 0.f;
            }
        }
        const unsigned d = (unsigned)(target - i * 8);
        if (d < 8u) {
            #pragma unroll
            for (int k = 0; k < 8; k++) g[k] = d == k ? g_target : g[k];   // constant indices keep g in registers
        }
        if (TO_E5M2)
            grad[(long long)row * n_vec + i] =
                make_uint2(to_e5m2x2(g[0], g[1]) | ((unsigned)to_e5m2x2(g[2], g[3]) << 16),
                           to_e5m2x2(g[4], g[5]) | ((unsigned)to_e5m2x2(g[6], g[7]) << 16));
        else
            row_vec[i] = make_uint4(to_bf16x2(g[0], g[1]), to_bf16x2(g[2], g[3]), to_bf16x2(g[4], g[5]),
                                    to_bf16x2(g[6], g[7]));
    }
}

// One row per block, staged whole before it is worked on: while one block computes, the other on its SM waits
// on memory.
template <bool TO_E5M2>
__device__ __forceinline__ void grad_one_row(unsigned short* logits, const long long* targets, float* row_loss,
                                             uint2* grad, float scale, int n_cols, int vocab_size, int row_stride) {
    extern __shared__ uint4 row_buf[];
    __shared__ float scratch[32];
    issue_row(row_buf, reinterpret_cast<uint4*>(logits + (long long)blockIdx.x * row_stride), n_cols >> 3);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    grad_row<TO_E5M2>(blockIdx.x, row_buf, scratch, logits, targets, row_loss, grad, scale, n_cols, vocab_size,
                      row_stride);
}

extern "C" __global__ void __launch_bounds__(256, 2)
cross_entropy_grad_rows(unsigned short* logits, const long long* targets, float* row_loss,
                        int n_cols, int vocab_size, int row_stride) {
    grad_one_row<false>(logits, targets, row_loss, nullptr, 1.f, n_cols, vocab_size, row_stride);
}

// grad: [rows, n_cols] e5m2, contiguous.
extern "C" __global__ void __launch_bounds__(256, 2)
cross_entropy_grad_rows_e5m2(unsigned short* logits, const long long* targets, float* row_loss, uint2* grad,
                             float scale, int n_cols, int vocab_size, int row_stride) {
    grad_one_row<true>(logits, targets, row_loss, grad, scale, n_cols, vocab_size, row_stride);
}
