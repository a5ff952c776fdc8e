// flash_attention_regtile.cu - FlashAttention-2 forward on CUDA cores, register-tiled.
//
// The same fold as flash_attention.cu (Dao 2023, FA-2 Alg. 1: one query block per thread
// block, key tiles in order, m, l, o per row, one division at the end), with one change:
// how a thread reaches the numbers it multiplies.
//
// In flash_attention.cu a thread owns one query row and a few keys, so each FMA of
// S = Q K^T needs one fresh shared-memory load (k_s[j][c]); ncu on an H200 showed the
// shared-memory pipe 94% busy, the arithmetic waiting on it. Here each thread owns a small
// block of the score tile, TM rows x TN keys, and of the output, TM rows x 4*NC columns:
//
//   S:  for each 4 columns c..c+3 of the head dim:
//           TM 16-byte loads of q_s (its rows),  TN 16-byte loads of k_s (its keys)
//           -> TM * TN * 4 FMAs                  (at d=64: 8 loads feed 64 FMAs, not 64)
//   PV: for each key j of the tile:
//           TM loads of p_s (one per row, broadcast),  NC 16-byte loads of v_s
//           -> TM * NC * 4 FMAs
//
// Thread layout: 128 threads = 16 row groups (ty) x 8 lanes (tx). Thread (ty, tx) owns rows
// ty*TM .. ty*TM+TM-1 of the block; of the tile's keys, tx, tx+8, ..., tx+8*(TN-1); of the
// head dim, the 4-column chunks tx, tx+8, ... (NC of them, those below HEAD_DIM/4).
// The 8 lanes of a row group are consecutive lanes of one warp: they agree on the row max
// and row sum with the same butterfly shuffle as the other kernels (group_max/sum<8>).
//
// Shared memory (float32, rows padded by 4 floats: 16-byte aligned, and the 8 lanes of a
// row group reading 8 different rows at one column hit 8 different groups of 4 banks):
//   q_s [BLOCK_Q][HEAD_DIM + 4]   the query block, loaded once
//   kv_s[BLOCK_K][HEAD_DIM + 4]   the key tile, then (after S is done) the value tile
//   p_s [BLOCK_Q][BLOCK_K + 4]    the tile's probabilities P
// K and V take turns in one buffer so that larger tiles fit in 48 KiB of static shared
// memory (lessons/gpu/source.py: flash_attention_regtile_config picks the tiles). Larger tiles
// (up to 99 KiB, for the tuning sweep) are compiled with REGTILE_DYNAMIC_SMEM=1: the same three
// arrays, one after the other in dynamic shared memory asked for at launch.
//
// Two smaller changes keep instructions off the FMA pipe (both from the FA-2 rung):
//   * exp2 with log2(e) folded into the scale: scores are kept in log2 units, s2 = s * scale * log2(e),
//     and p = 2^(s2 - m2) is one exp2f (expf is exp2 plus a multiply and range handling); m and lse leave
//     the kernel in natural units (m = m2 ln 2, lse = (m2 + log2 l) ln 2).
//   * A plain P V loop where it is safe: p = 0 must add nothing, even where v is inf or NaN (a hidden key's
//     v may be NaN), and a product 0 * v is 0 only for a finite v. So the thread that copies V tests each
//     16-byte piece for inf/NaN, one barrier tells the block (__syncthreads_or), and a tile whose V is all
//     finite (nearly every tile) runs the FMAs unguarded; only a tile with inf or NaN in V selects per row.
//
// One switch, REGTILE_WIDE = 1, makes the next rung (entry point flash_attention_regtile_wide):
//   * 16 lanes per row group instead of 8 (8 row groups x 16 lanes): a thread's share of an output row
//     halves (4*NC columns with NC = ceil(HEAD_DIM/64)), so it can own 8 rows (TM = 8) and 4 keys (TN = 4)
//     of S at d = 128 (the plain build: 2 x 4 there) in 208 registers (plain: 118-124; NVRTC 12.9 and 13.0);
//   * P read 4 keys at a time: one 16-byte load of p_s per row feeds 4 keys of P V (the plain build reads
//     p one key at a time, a 4-byte load per row and key);
//   * a thread's rows interleaved (ty, ty + 8, ..., not 8 consecutive rows), so the two row groups of a warp
//     read rows that start in different banks (ROW below).
//   * the S and P V loops run two passes per branch back (#pragma unroll 2): half the loops' own instructions
//     (address steps, compare, branch) per FMA.
// Per 4 columns of S: TM + TN = 12 loads feed TM * TN * 4 = 128 FMAs (the plain build at d = 128: 6 feed 32);
// per 4 keys of P V: TM + 4 * NC = 16 loads feed TM * NC * 16 = 256 FMAs (plain: 24 feed 128).
//
// Storage is float32 only (the rung is about CUDA-core FMAs; the tensor-core rungs take
// 16-bit inputs); HEAD_DIM must be a multiple of 4 so that every row starts 16-byte aligned.
// Launch: grid = (ceil(n_q / BLOCK_Q), batch * heads), block = (128). Defines: HEAD_DIM,
// BLOCK_Q (16, 32, 64 or 128; wide: 8, 16, 32 or 64), BLOCK_K (8, 16, 32 or 64; wide: 16, 32, 64 or 128),
// FA_TRACE, REGTILE_DYNAMIC_SMEM (0 or 1), REGTILE_WIDE (0 or 1).
#include "common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_Q
#define BLOCK_Q 64
#endif
#ifndef BLOCK_K
#define BLOCK_K 32
#endif
#ifndef REGTILE_DYNAMIC_SMEM
#define REGTILE_DYNAMIC_SMEM 0
#endif
#ifndef REGTILE_WIDE
#define REGTILE_WIDE 0
#endif
#define NUM_THREADS 128
#if REGTILE_WIDE
#define LANES 16                                  // lanes per row group (tx)
#else
#define LANES 8
#endif
#define GROUPS (NUM_THREADS / LANES)              // row groups (ty)
#define TM (BLOCK_Q / GROUPS)                     // rows per thread
#define TN (BLOCK_K / LANES)                      // keys per thread
#define D4 (HEAD_DIM / 4)                         // 16-byte chunks per row
#define NC ((D4 + LANES - 1) / LANES)             // output chunks per thread
// The block row of a thread's i-th row. Plain: a row group's rows are consecutive. Wide: interleaved, so the two
// row groups of a warp own adjacent rows (r and r + 1), which start 4 banks apart in q_s and p_s: their 16-byte
// broadcast loads share one shared-memory wavefront (consecutive rows, 8 apart, would hit the same banks).
#if REGTILE_WIDE
#define ROW(ty, i) ((ty) + GROUPS * (i))
#else
#define ROW(ty, i) ((ty) * TM + (i))
#endif
#define D_PAD (HEAD_DIM + 4)
#define K_PAD (BLOCK_K + 4)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#if FA_DTYPE != 0
#error "the register-tiled kernel stores float32 only"
#endif
static_assert(HEAD_DIM >= 4 && HEAD_DIM <= 256 && HEAD_DIM % 4 == 0, "HEAD_DIM must be a multiple of 4 in 4..256");
static_assert(BLOCK_Q % GROUPS == 0 && TM >= 1 && TM <= 8,
              "BLOCK_Q must be 16, 32, 64 or 128 (REGTILE_WIDE: 8, 16, 32 or 64)");
static_assert(BLOCK_K % LANES == 0 && TN >= 1 && TN <= 8,
              "BLOCK_K must be 8, 16, 32 or 64 (REGTILE_WIDE: 16, 32, 64 or 128)");

// Four floats moved as one 16-byte access (ld.global.v4.f32 / ld.shared.v4.f32).
struct __align__(16) vec4 { float x, y, z, w; };

__device__ __forceinline__ vec4 load4(const float* p) { return *reinterpret_cast<const vec4*>(p); }
__device__ __forceinline__ void store4(float* p, vec4 v) { *reinterpret_cast<vec4*>(p) = v; }
__device__ __forceinline__ float dot4(vec4 a, vec4 b, float acc) {
    acc = fmaf(a.x, b.x, acc); acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc); return fmaf(a.w, b.w, acc);
}

// Copy `rows` rows of HEAD_DIM floats, starting at global row `first`, into a padded shared
// tile, 16 bytes per thread per step (coalesced); rows at or past `limit` become zeros.
__device__ __forceinline__ void load_tile(float* dst, const float* __restrict__ src, int first, int limit,
                                          int rows, int tid) {
    for (int idx = tid; idx < rows * D4; idx += NUM_THREADS) {
        const int rr = idx / D4, c4 = idx % D4;
        const int g = first + rr;
        const vec4 zero = {0.f, 0.f, 0.f, 0.f};
        store4(dst + rr * D_PAD + 4 * c4, g < limit ? load4(src + (long long)g * HEAD_DIM + 4 * c4) : zero);
    }
}

// The same for the V tile, and whether any value this thread copied is inf or NaN (exponent bits all ones).
__device__ __forceinline__ bool load_tile_non_finite(float* dst, const float* __restrict__ src, int first, int limit,
                                                     int rows, int tid) {
    bool bad = false;
    for (int idx = tid; idx < rows * D4; idx += NUM_THREADS) {
        const int rr = idx / D4, c4 = idx % D4;
        const int g = first + rr;
        const vec4 zero = {0.f, 0.f, 0.f, 0.f};
        const vec4 x = g < limit ? load4(src + (long long)g * HEAD_DIM + 4 * c4) : zero;
        bad |= !isfinite(x.x) || !isfinite(x.y) || !isfinite(x.z) || !isfinite(x.w);
        store4(dst + rr * D_PAD + 4 * c4, x);
    }
    return bad;
}

// o += p v for one key j: this thread's TM rows (p[i] their probabilities for key j) and NC 4-column chunks
// (NC 16-byte loads of v). GUARD: p == 0 adds nothing whatever v holds (select, not multiply), for a tile
// whose V has inf or NaN; without it, the FMAs alone (0 * v is 0 for every finite v).
template <bool GUARD>
__device__ __forceinline__ void absorb_key(float (&o)[TM][NC][4], const float (&p)[TM], const float* kv_s, int j,
                                           int tx) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int c4 = tx + LANES * c;
        if (c4 < D4) {
            const vec4 b = load4(kv_s + j * D_PAD + 4 * c4);
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                if (!GUARD || p[i] != 0.f) {
                    o[i][c][0] = fmaf(p[i], b.x, o[i][c][0]);
                    o[i][c][1] = fmaf(p[i], b.y, o[i][c][1]);
                    o[i][c][2] = fmaf(p[i], b.z, o[i][c][2]);
                    o[i][c][3] = fmaf(p[i], b.w, o[i][c][3]);
                }
            }
        }
    }
}

// o += P V_j, keys in order. The plain build reads p one key at a time (TM broadcast 4-byte loads per key);
// the wide one 4 keys at a time (TM broadcast 16-byte loads per 4 keys). Either way each o element adds
// the keys in the same order, 0 .. BLOCK_K - 1.
template <bool GUARD>
__device__ __forceinline__ void accumulate_pv(float (&o)[TM][NC][4], const float* p_s, const float* kv_s, int ty,
                                              int tx) {
#if REGTILE_WIDE
#pragma unroll 2                                        // two passes per branch back, as the S loop
    for (int j0 = 0; j0 < BLOCK_K; j0 += 4) {           // runtime loop; the block inside unrolls
        vec4 p4[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) p4[i] = load4(p_s + ROW(ty, i) * K_PAD + j0);
        float p[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) p[i] = p4[i].x;
        absorb_key<GUARD>(o, p, kv_s, j0, tx);
#pragma unroll
        for (int i = 0; i < TM; ++i) p[i] = p4[i].y;
        absorb_key<GUARD>(o, p, kv_s, j0 + 1, tx);
#pragma unroll
        for (int i = 0; i < TM; ++i) p[i] = p4[i].z;
        absorb_key<GUARD>(o, p, kv_s, j0 + 2, tx);
#pragma unroll
        for (int i = 0; i < TM; ++i) p[i] = p4[i].w;
        absorb_key<GUARD>(o, p, kv_s, j0 + 3, tx);
    }
#else
    for (int j = 0; j < BLOCK_K; ++j) {                 // runtime loop; the block inside unrolls
        float p[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) p[i] = p_s[ROW(ty, i) * K_PAD + j];
        absorb_key<GUARD>(o, p, kv_s, j, tx);
    }
#endif
}

// q, k, v: (batch*heads, n, HEAD_DIM) float32, C-contiguous, 16-byte aligned; out like q;
// lse (batch*heads, n_q). causal != 0: query i sees key j iff j <= i + n_k - n_q.
// Trace: as flash_attention.cu, (m, alpha, l) after each tile for the rows in trace_rows.
// (One body, two names: the entry point is flash_attention_regtile_wide when REGTILE_WIDE is 1.)
#if REGTILE_WIDE
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2)
flash_attention_regtile_wide(const float* __restrict__ q, const float* __restrict__ k,
                             const float* __restrict__ v, float* __restrict__ out,
                             float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                             const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                             float* __restrict__ trace) {
#else
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2)
flash_attention_regtile(const float* __restrict__ q, const float* __restrict__ k,
                        const float* __restrict__ v, float* __restrict__ out,
                        float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                        const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                        float* __restrict__ trace) {
#endif
#if REGTILE_DYNAMIC_SMEM && !defined(FA_CPU_EMULATION)
    extern __shared__ __align__(16) float regtile_smem[];   // q_s | kv_s | p_s, asked for at launch
    float* q_s = regtile_smem;
    float* kv_s = q_s + BLOCK_Q * D_PAD;
    float* p_s = kv_s + BLOCK_K * D_PAD;
#else
    __shared__ __align__(16) float q_s[BLOCK_Q * D_PAD];
    __shared__ __align__(16) float kv_s[BLOCK_K * D_PAD];
    __shared__ __align__(16) float p_s[BLOCK_Q * K_PAD];
#endif

    const int tid = threadIdx.x;
    const int ty = tid / LANES, tx = tid % LANES;
    const int q_start = blockIdx.x * BLOCK_Q;
    const long long bh = blockIdx.y;
    const float* q_bh = q + bh * n_q * HEAD_DIM;
    const float* k_bh = k + bh * n_k * HEAD_DIM;
    const float* v_bh = v + bh * n_k * HEAD_DIM;
    const float scale_log2 = scale * LOG2E;                 // scores in log2 units: 2^(s2 - m2) = e^(s - m)

    load_tile(q_s, q_bh, q_start, n_q, BLOCK_Q, tid);   // read after the first barrier below

    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);

    // ---- the running state of this thread's TM rows (m in log2 units) -----------------
    float m[TM], l[TM];
    float o[TM][NC][4];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        m[i] = NEG_INF; l[i] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c) o[i][c][0] = o[i][c][1] = o[i][c][2] = o[i][c][3] = 0.f;
    }

#ifdef FA_TRACE
    int trace_slot[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        trace_slot[i] = -1;
        const int row = q_start + ROW(ty, i);
        if (row < n_q)
            for (int t = 0; t < n_trace_rows; ++t)
                if (trace_rows[t] == row) trace_slot[i] = t;
    }
#endif

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;

        // 1. K_j into kv_s (zeros past n_k)
        load_tile(kv_s, k_bh, k_start, n_k, BLOCK_K, tid);
        __syncthreads();                                    // K_j (and Q the first time) ready

        // 2. S for my TM x TN block: per 4 columns, TM + TN 16-byte loads, TM * TN * 4 FMAs
        float s[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#if REGTILE_WIDE
#pragma unroll 2                                            // two passes per branch back: half the loop's own instructions
#endif
        for (int c4 = 0; c4 < D4; ++c4) {                   // runtime loop; the block inside unrolls
            vec4 a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = load4(q_s + ROW(ty, i) * D_PAD + 4 * c4);
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = load4(kv_s + (tx + LANES * j) * D_PAD + 4 * c4);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) s[i][j] = dot4(a[i], b[j], s[i][j]);
        }
        __syncthreads();                                    // everyone is done with K_j

        // 3. V_j into kv_s (noting inf/NaN) while this thread does the softmax step of its rows
        const bool v_had_non_finite = load_tile_non_finite(kv_s, v_bh, k_start, n_k, BLOCK_K, tid);

        float alpha[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = q_start + ROW(ty, i);
            const int diagonal = row + n_k - n_q;           // last key this row sees when causal
            float tile_max = NEG_INF;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int key = k_start + tx + LANES * j;
                const bool visible = key < n_k && (!causal || key <= diagonal);
                s[i][j] = visible ? s[i][j] * scale_log2 : NEG_INF;
                tile_max = fmaxf(tile_max, s[i][j]);
            }
            tile_max = group_max<LANES>(tile_max);
            const float m_new = fmaxf(m[i], tile_max);
            alpha[i] = exp2f(m[i] - safe_max(m_new));       // 2^(-inf) = 0 while the row has seen nothing
            float row_sum = 0.f;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const float p = exp2f(s[i][j] - safe_max(m_new));  // masked: 2^(-inf) = 0
                p_s[ROW(ty, i) * K_PAD + tx + LANES * j] = p;
                row_sum += p;
            }
            row_sum = group_sum<LANES>(row_sum);
            l[i] = alpha[i] * l[i] + row_sum;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < NC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[i][c][e] *= alpha[i];
        }
        // V_j and P are ready; and whether any thread found inf or NaN in V_j (the same answer for all)
        const bool v_finite = __syncthreads_or(v_had_non_finite) == 0;

        // 4. o += P V_j
        if (v_finite)
            accumulate_pv<false>(o, p_s, kv_s, ty, tx);
        else
            accumulate_pv<true>(o, p_s, kv_s, ty, tx);

#ifdef FA_TRACE
        if (tx == 0)
#pragma unroll
            for (int i = 0; i < TM; ++i)
                if (trace_slot[i] >= 0) {
                    float* rec = trace + ((bh * n_trace_rows + trace_slot[i]) * trace_tiles + tile) * TRACE_FIELDS;
                    rec[0] = m[i] * LN2; rec[1] = alpha[i]; rec[2] = l[i];
                }
#endif
        __syncthreads();                                    // everyone is done with V_j and P
    }

    // ---- finalize: one division per row; rows past n_q write nothing --------------------
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = q_start + ROW(ty, i);
        if (row >= n_q) continue;
        float* out_row = out + (bh * n_q + row) * HEAD_DIM;
        const bool seen = l[i] != 0.f;                      // nothing visible -> out 0, lse -inf
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int c4 = tx + LANES * c;
            if (c4 < D4) {
                const vec4 r = {seen ? o[i][c][0] / l[i] : 0.f, seen ? o[i][c][1] / l[i] : 0.f,
                                seen ? o[i][c][2] / l[i] : 0.f, seen ? o[i][c][3] / l[i] : 0.f};
                store4(out_row + 4 * c4, r);
            }
        }
        if (tx == 0) lse[bh * n_q + row] = seen ? (m[i] + log2f(l[i])) * LN2 : NEG_INF;
    }
}
