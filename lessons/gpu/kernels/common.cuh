// common.cuh - what every kernel of the series shares.
//
// The whole series is one fold over key tiles of a running state per query row:
//
//     m      running maximum of the scores        (-inf while nothing is visible)
//     l      running sum of exp(s - m)
//     o      running sum of exp(s - m) * v         (unnormalised output)
//
//     absorb a tile:  m_new = max(m, max_j s_j);   alpha = exp(m - m_new)
//                     l = alpha * l + sum_j exp(s_j - m_new)
//                     o = alpha * o + sum_j exp(s_j - m_new) * v_j
//     finalize:       out = o / l  (0 when l == 0);   lse = m + log(l)  (-inf when l == 0)
//                     (the test is l != 0, so NaN from NaN input stays NaN: bad data is never
//                     reported as an empty row, as in the NumPy core, lessons/state.py)
//                     A row's output never depends on a key it cannot see: keys past the end
//                     (n_k, seq_len) load as zeros, and a key with p = 0 (every key hidden by
//                     the causal mask in the diagonal tile) adds nothing, never 0 * v
//                     (0 * NaN = NaN). NaN or inf in a key a row sees, or in a value it gives
//                     p > 0, still reaches that row, as in the NumPy reference's P V.
//                     fmaxf skips NaN, so a traced m stays finite (or -inf) where NumPy's m is NaN.
//
// (Milakov & Gimelshein 2018; Dao et al. 2022, Alg. 1; Dao 2023, FA-2 Alg. 1.)
//
// This file is included textually by the Python loader (lessons/gpu/source.py),
// so the kernels need no include path and no CUDA headers: NVRTC alone compiles them.
//
// Compile-time switches (passed as -D options by the launcher):
//   FA_DTYPE   0 = float32, 1 = float16, 2 = bfloat16 storage of inputs and outputs.
//              Arithmetic is always float32 ("fp16 inputs, fp32 accumulation").
//   FA_TRACE   defined: the kernel also writes (m, alpha, l) after every absorbed tile
//              for a few chosen rows into a trace buffer, so a notebook can replay what
//              the GPU did beside the NumPy trace.
#pragma once

#ifndef FA_DTYPE
#define FA_DTYPE 0
#endif

// -inf without <math.h>: the bit pattern of negative infinity.
#define NEG_INF __int_as_float(0xff800000)

// ---------------------------------------------------------------------------
// Storage types. 16-bit floats are carried as raw bits (unsigned short) and
// converted with one PTX instruction (fp16) or a bit shift (bf16), so no
// cuda_fp16.h / cuda_bf16.h header is needed.
// ---------------------------------------------------------------------------
#if FA_DTYPE == 0
typedef float scalar_t;
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float from_float(float x) { return x; }
#elif FA_DTYPE == 1 && defined(FA_CPU_EMULATION)
typedef unsigned short scalar_t;  // (CPU emulation: the host compiler's _Float16 converts)
inline float to_float(unsigned short h) { _Float16 f; __builtin_memcpy(&f, &h, 2); return (float)f; }
inline unsigned short from_float(float x) { _Float16 f = (_Float16)x; unsigned short h; __builtin_memcpy(&h, &f, 2); return h; }
#elif FA_DTYPE == 1
typedef unsigned short scalar_t;  // IEEE binary16 bits
__device__ __forceinline__ float to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short from_float(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));  // round to nearest even
    return h;
}
#elif FA_DTYPE == 2
typedef unsigned short scalar_t;  // bfloat16 bits: the top half of a float32
__device__ __forceinline__ float to_float(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short from_float(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);                     // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}
#else
#error "FA_DTYPE must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

// ---------------------------------------------------------------------------
// The two numbers of the fold that need care with -inf.
// ---------------------------------------------------------------------------

// m with -inf replaced by 0, so that "s - m" never computes (-inf) - (-inf) = NaN.
// A row that has seen no visible key keeps m = -inf; then every p = exp(-inf - 0) = 0.
__device__ __forceinline__ float safe_max(float m) { return m == NEG_INF ? 0.f : m; }

// alpha = exp(m_old - m_new): how much the old (l, o) shrink when the max moves up.
// Both -inf (still empty) gives exp(-inf - 0) = 0, not exp(NaN).
__device__ __forceinline__ float correction_factor(float m_old, float m_new) {
    return expf(m_old - safe_max(m_new));
}

// ---------------------------------------------------------------------------
// Warp reductions. __shfl_xor_sync with offsets WIDTH/2, ..., 1 is a butterfly:
// afterwards every lane of each aligned group of WIDTH lanes holds the group's
// result, and every lane computed it in the same order (bitwise reproducible).
// All 32 lanes must call these (full mask), WIDTH a power of two <= 32.
// ---------------------------------------------------------------------------
template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// How many key tiles of block_k keys a block of query rows q_start .. q_start + block_q - 1
// visits. Without causal masking: all of them. With it (bottom-right aligned), the block's
// last real row sees keys up to last_key; tiles starting past it are wholly above the
// diagonal for every row of the block and are skipped (FlashAttention-2, Sec. 3.1).
// The count depends only on the block, so every thread of it runs the same number of
// iterations and reaches every __syncthreads() inside the loop.
__device__ __forceinline__ int tiles_to_visit(int q_start, int block_q, int n_q, int n_k, int block_k, int causal) {
    const int n_tiles = (n_k + block_k - 1) / block_k;
    if (!causal) return n_tiles;
    const int last_row = min(q_start + block_q, n_q) - 1;
    const int last_key = last_row + n_k - n_q;
    return min(n_tiles, last_key < 0 ? 0 : last_key / block_k + 1);
}

// Trace record layout, shared by every kernel: float trace[n_rows][n_tiles][3]
// holding (m, alpha, l) after each absorbed tile. The launcher fills the buffer
// with NaN first, so a tile that was never absorbed (skipped by causality, past
// seq_len, another split's) stays NaN.
#define TRACE_FIELDS 3
