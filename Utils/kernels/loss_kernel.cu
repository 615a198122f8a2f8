// --- Softmax gradient of one bf16 row per block (Utils/kernels/loss_kernel.py launches it).
// Fuses the log-sum-exp, the row's loss and softmax minus one-hot into one read and one write of the
// row, the least such a pass can move: the row is copied into shared memory (cp.async, 16 bytes per
// copy), reduced there twice (maximum, then the sum of exponentials), and its gradient written out. The
// Triton kernel, which cannot stage a row in shared memory, reads it twice. A 50,304-column row takes
// 98 KiB, so two blocks share an SM and one computes while the other waits on memory.
//
// Two kernels share the body: cross_entropy_grad_rows writes the gradient over the row, in bf16 (the bf16
// loss); cross_entropy_grad_rows_e5m2 writes it times `scale`, in e5m2 (1 byte a logit), into a row of its
// own (the FP8 loss, Utils/kernels/fp8_loss.py, whose gradient GEMMs read it).
//
// Columns from vocab_size on are left out of the softmax and get a zero gradient. Needs n_cols and
// row_stride multiples of 8 and a 16-byte aligned row start (loss_kernel.py checks).
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

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

template <bool TO_E5M2>
__device__ __forceinline__ void grad_row(unsigned short* logits, const long long* targets, float* row_loss,
                                         uint2* grad, float scale, int n_cols, int vocab_size, int row_stride) {
    extern __shared__ uint4 row_buf[];
    __shared__ float scratch[32];
    const int tid = threadIdx.x;
    unsigned short* base = logits + (long long)blockIdx.x * row_stride;
    uint4* row_vec = reinterpret_cast<uint4*>(base);
    const int n_vec = n_cols >> 3;
    for (int i = tid; i < n_vec; i += blockDim.x) {
        unsigned dst = (unsigned)__cvta_generic_to_shared(row_buf + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(row_vec + i) : "memory");
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
    const int target = (int)targets[blockIdx.x];

    // Each pass unpacks its vectors in line: a shared unpack-to-8-floats helper compiled to slower code
    // (BENCHMARKS.md, kernel tuning history).
    float m = NEG_INF;
    for (int i = tid; i < n_vec; i += blockDim.x) {
        const uint4 v = row_buf[i];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        const int c = i * 8;
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            if (c + 2 * k < vocab_size) m = fmaxf(m, __uint_as_float(w[k] << 16));
            if (c + 2 * k + 1 < vocab_size) m = fmaxf(m, __uint_as_float(w[k] & 0xffff0000u));
        }
    }
    m = block_reduce(m, true, scratch);
    const float m2 = m * LOG2E;
    float s = 0.f;
    for (int i = tid; i < n_vec; i += blockDim.x) {
        const uint4 v = row_buf[i];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        const int c = i * 8;
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            if (c + 2 * k < vocab_size) s += exp2f(fmaf(__uint_as_float(w[k] << 16), LOG2E, -m2));
            if (c + 2 * k + 1 < vocab_size) s += exp2f(fmaf(__uint_as_float(w[k] & 0xffff0000u), LOG2E, -m2));
        }
    }
    s = block_reduce(s, false, scratch);
    const float lse = m + logf(s), lse2 = lse * LOG2E;
    if (tid == 0) {
        const unsigned short t = reinterpret_cast<const unsigned short*>(row_buf)[target];
        row_loss[blockIdx.x] = lse - __uint_as_float(((unsigned)t) << 16);
    }
    for (int i = tid; i < n_vec; i += blockDim.x) {
        const uint4 v = row_buf[i];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        unsigned out[4];
        const int c = i * 8;
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const int c0 = c + 2 * k;
            float lo = c0 < vocab_size ? exp2f(fmaf(__uint_as_float(w[k] << 16), LOG2E, -lse2)) : 0.f;
            float hi = c0 + 1 < vocab_size ? exp2f(fmaf(__uint_as_float(w[k] & 0xffff0000u), LOG2E, -lse2)) : 0.f;
            if (c0 == target) lo -= 1.f;
            if (c0 + 1 == target) hi -= 1.f;
            if (TO_E5M2) out[k] = to_e5m2x2(lo * scale, hi * scale);
            else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out[k]) : "f"(hi), "f"(lo));
        }
        if (TO_E5M2) grad[(long long)blockIdx.x * n_vec + i] = make_uint2(out[0] | (out[1] << 16), out[2] | (out[3] << 16));
        else row_vec[i] = make_uint4(out[0], out[1], out[2], out[3]);
    }
}

extern "C" __global__ void __launch_bounds__(256, 2)
cross_entropy_grad_rows(unsigned short* logits, const long long* targets, float* row_loss,
                        int n_cols, int vocab_size, int row_stride) {
    grad_row<false>(logits, targets, row_loss, nullptr, 1.f, n_cols, vocab_size, row_stride);
}

// grad: [rows, n_cols] e5m2, contiguous.
extern "C" __global__ void __launch_bounds__(256, 2)
cross_entropy_grad_rows_e5m2(unsigned short* logits, const long long* targets, float* row_loss, uint2* grad,
                             float scale, int n_cols, int vocab_size, int row_stride) {
    grad_row<true>(logits, targets, row_loss, grad, scale, n_cols, vocab_size, row_stride);
}
