// tensor_core.cuh - the plumbing the tensor-core kernels share.
//
// flash_attention_mma.cu, flash_attention_mma_async.cu, flash_attention_mma_fa2.cu,
// flash_attention_wgmma.cu and flash_attention_backward_mma.cu include it after common.cuh. It holds
// only how data gets into and out of the tensor cores: 16-bit packing (two floats in one
// cvt.rn instruction too), exp2 in one ex2.approx, the inf/NaN test of a 16-byte chunk, the
// mma.sync instruction, fragment loads, cp.async (async_copy.cuh) and ldmatrix. The fold itself (scores,
// masking, m, l, alpha, o, P V) stays written out in each kernel, next to FA-2 Alg. 1.
//
// Every helper is __forceinline__, and each is the code one of those kernels carried as its own
// copy before: the PTX NVRTC makes of every kernel is the same, instruction for instruction.
// Those that are single PTX instructions (mma.sync, cvta.to.shared, cp.async, ldmatrix) have a
// CPU-emulation twin (FA_CPU_EMULATION, kernels/cpu_emulation.h) that does the same thing by
// its definition, so the emulator still checks every lane's index arithmetic.
//
// Sources: PTX ISA, "Warp-level matrix instructions: mma" (fragment layouts of m16n8k16),
// "ldmatrix", "cp.async"; Dao 2023 (FlashAttention-2), Sec. 3.3. Needs sm_80 or newer.
#pragma once

#include "async_copy.cuh"

#if FA_DTYPE != 1 && FA_DTYPE != 2
#error "tensor_core.cuh: tensor cores take float16 (FA_DTYPE 1) or bfloat16 (FA_DTYPE 2) inputs"
#endif

// ---------------------------------------------------------------------------
// 16-bit values in 32-bit registers
// ---------------------------------------------------------------------------

// Two 16-bit values in one 32-bit register, the lower-indexed element in the low half
// (the order of every mma fragment register).
__device__ __forceinline__ unsigned pack2(scalar_t lo, scalar_t hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// Two float32 values, each rounded to the storage type by from_float (common.cuh), packed as pack2.
__device__ __forceinline__ unsigned pack2f(float lo, float hi) { return pack2(from_float(lo), from_float(hi)); }

// Two floats rounded (to nearest even) to 16 bits and packed, lo in the low half: one
// cvt.rn.{f16x2,bf16x2}.f32 instruction on sm_80+ (the operand order puts hi first).
__device__ __forceinline__ unsigned pack_float2(float lo, float hi) {
#ifdef FA_CPU_EMULATION
    return pack2f(lo, hi);
#else
    unsigned r;
#if FA_DTYPE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
#endif
}

// 2^x: one ex2.approx on the GPU (ex2.approx(-inf) = +0).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef FA_CPU_EMULATION
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// ---------------------------------------------------------------------------
// inf and NaN in 16-bit data (the guard that keeps a hidden key's NaN/inf V out of P V)
// ---------------------------------------------------------------------------

// All exponent bits set means inf or NaN: 5 bits of float16, 8 of bfloat16.
#if FA_DTYPE == 1
#define EXPONENT_BITS 0x7c00u
#else
#define EXPONENT_BITS 0x7f80u
#endif

// Is a 16-bit float inf or NaN?
__device__ __forceinline__ bool non_finite(scalar_t x) { return (x & EXPONENT_BITS) == EXPONENT_BITS; }

// Does a 16-byte chunk (8 16-bit values) hold an inf or NaN? 8 masked compares, no conversions.
__device__ __forceinline__ bool chunk_non_finite(uint4 w) {
    const unsigned lo = EXPONENT_BITS, hi = EXPONENT_BITS << 16;
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) bad = bad || (u[i] & lo) == lo || (u[i] & hi) == hi;
    return bad;
}

// A 16-byte chunk (8 16-bit values) with every inf or NaN replaced by 0; *bad is set when
// there was one (and left as it was otherwise).
__device__ __forceinline__ uint4 finite_part(uint4 w, bool* bad) {
    unsigned* u = reinterpret_cast<unsigned*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const scalar_t lo = (scalar_t)(u[i] & 0xffffu), hi = (scalar_t)(u[i] >> 16);
        const bool bad_lo = non_finite(lo), bad_hi = non_finite(hi);
        *bad = *bad || bad_lo || bad_hi;
        u[i] = pack2(bad_lo ? (scalar_t)0 : lo, bad_hi ? (scalar_t)0 : hi);
    }
    return w;
}

// The same, for a chunk already known to hold one (chunk_non_finite): no flag to keep.
// (Written out, not a call of the one above with a dummy flag: the compiler then orders the
// instructions differently, and the kernel that uses it, flash_attention_mma_fa2.cu, should
// compile to exactly the code it was measured with.)
__device__ __forceinline__ uint4 finite_part(uint4 w) {
    unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const scalar_t lo = (scalar_t)(u[i] & 0xffffu), hi = (scalar_t)(u[i] >> 16);
        u[i] = pack2(non_finite(lo) ? (scalar_t)0 : lo, non_finite(hi) ? (scalar_t)0 : hi);
    }
    return make_uint4(u[0], u[1], u[2], u[3]);
}

// ---------------------------------------------------------------------------
// The tensor-core product and its A fragment
// ---------------------------------------------------------------------------

// c += a * b for one 16x16 (a) times 16x8 (b) tile: one tensor-core instruction per warp.
// Fragments (g = lane / 4, t = lane % 4; each register holds two neighbouring 16-bit values):
//   a[0] = A[g][2t, 2t+1]  a[1] = A[g+8][2t, 2t+1]  a[2] = A[g][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]  b[1] = B[2t+8, 2t+9][g]
//   c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]   (float32)
__device__ __forceinline__ void mma_16x8x16(float c[4], const unsigned a[4], const unsigned b[2]) {
#ifdef FA_CPU_EMULATION
    emu::mma_m16n8k16(c, a, b, to_float);          // the same layout, computed on the CPU
#else
#if FA_DTYPE == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The A fragment of rows (row_lo, row_lo + 8), columns col .. col + 15 of a row-major
// matrix with `pitch` values per row (global or shared memory), by 16-bit loads and pack2;
// rows at or past n_rows read as zeros.
__device__ __forceinline__ void load_a_fragment(unsigned a[4], const scalar_t* m, long long pitch,
                                                int row_lo, int n_rows, int col, int t) {
    const int c = col + 2 * t;
    const scalar_t zero = 0;
    const scalar_t* lo = m + (long long)row_lo * pitch;
    const scalar_t* hi = lo + 8 * pitch;
    const bool has_lo = row_lo < n_rows, has_hi = row_lo + 8 < n_rows;
    a[0] = has_lo ? pack2(lo[c], lo[c + 1]) : pack2(zero, zero);
    a[1] = has_hi ? pack2(hi[c], hi[c + 1]) : pack2(zero, zero);
    a[2] = has_lo ? pack2(lo[c + 8], lo[c + 9]) : pack2(zero, zero);
    a[3] = has_hi ? pack2(hi[c + 8], hi[c + 9]) : pack2(zero, zero);
}

// ---------------------------------------------------------------------------
// Shared-memory addresses, cp.async and ldmatrix (PTX ISA 7.0+, sm_80+)
// ---------------------------------------------------------------------------
// saddr_t, saddr and cp.async: async_copy.cuh. sadd(a, e) is the shared-memory address e 16-bit
// values past a (a plain integer add, so a kernel can convert once and add offsets).
//
// ldmatrix_x2 / ldmatrix_x4(r, row, trans): the warp loads 2 or 4 8x8 matrices of 16-bit
// values. Lane 8i + j names (row) the address of row j of matrix i; lane L receives, of
// matrix i, row L/4 elements 2(L%4), 2(L%4)+1 in r[i] (.trans: column L/4 of rows 2(L%4),
// 2(L%4)+1). Lanes whose rows are not read (16..31 for .x2) must still name valid rows.
#ifdef FA_CPU_EMULATION
inline saddr_t sadd(saddr_t a, int elems) { return a + elems; }
inline const unsigned short* ldm_rows[1024];
// ldmatrix by its definition: every lane publishes its row address, then picks its elements
// out of the other lanes' rows, between two warp barriers (as the emulated mma)
template <int MATRICES>
inline void ldmatrix(unsigned r[MATRICES], saddr_t row, bool trans) {
    const unsigned tid = threadIdx.x, first = tid & ~31u, lane = tid & 31u;
    ldm_rows[tid] = row;
    __syncwarp();                                  // every lane has published its row address
    for (int i = 0; i < MATRICES; ++i) {
        unsigned short lo, hi;
        if (!trans) {
            const unsigned short* p = ldm_rows[first + 8 * i + lane / 4];
            lo = p[2 * (lane % 4)]; hi = p[2 * (lane % 4) + 1];
        } else {
            lo = ldm_rows[first + 8 * i + 2 * (lane % 4)][lane / 4];
            hi = ldm_rows[first + 8 * i + 2 * (lane % 4) + 1][lane / 4];
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
    __syncwarp();                                  // every lane has read before the next load
}
inline void ldmatrix_x2(unsigned r[2], saddr_t row, bool trans) { ldmatrix<2>(r, row, trans); }
inline void ldmatrix_x4(unsigned r[4], saddr_t row, bool trans) { ldmatrix<4>(r, row, trans); }
#else
__device__ __forceinline__ saddr_t sadd(saddr_t a, int elems) { return a + 2u * (unsigned)elems; }
__device__ __forceinline__ void ldmatrix_x2(unsigned r[2], saddr_t row, bool trans) {
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(row));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(row));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], saddr_t row, bool trans) {
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row));
}
#endif
