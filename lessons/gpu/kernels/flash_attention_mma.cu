// flash_attention_mma.cu - the FlashAttention-2 forward pass on tensor cores.
//
// The same fold as flash_attention.cu, with both matrix products done by the
// tensor-core instruction mma.sync.m16n8k16 (16x16 times 16x8, 16-bit inputs,
// float32 accumulation, one warp at a time), as FlashAttention-2 does on A100/H100:
//
//   for each query block Q_i of BLOCK_Q = 64 rows:                       <- one thread block
//       warp w owns rows 16w .. 16w+15 of the block; their Q stays in registers (d <= 128)
//       m = -inf, l = 0, o = 0                      (registers, see "who holds what")
//       for each key tile K_j, V_j of BLOCK_K keys, up to the causal diagonal:
//           K_j, V_j -> shared memory               (all 4 warps, 16-byte loads)
//           S = Q K_j^T                  (tensor cores: HEAD_DIM/16 x BLOCK_K/8 mma)
//           m_new = max(m, rowmax(scale*S)); alpha = exp(m - m_new)
//           P = exp(scale*S - m_new)     (float32, then rounded to 16 bits for the mma)
//           l = alpha * l + rowsum(P);   o = alpha * o
//           o += P V_j                   (tensor cores: BLOCK_K/16 x HEAD_DIM/8 mma)
//       O_i = o / l;   lse_i = m + log(l)
//
// Source: Dao 2023, "FlashAttention-2", Alg. 1 and Sec. 3.3 (work split between warps:
// each warp owns query rows, so no warp needs another's partial results).
//
// Who holds what. mma.sync spreads each matrix over the 32 lanes of a warp by a fixed
// layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// With g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major): a0,a1 = A[g][2t, 2t+1]      a2,a3 = A[g+8][2t, 2t+1]
//                           a4,a5 = A[g][2t+8, 2t+9]    a6,a7 = A[g+8][2t+8, 2t+9]
//   B (16 x 8,  "col"):     b0,b1 = B[2t, 2t+1][g]      b2,b3 = B[2t+8, 2t+9][g]
//   C (16 x 8,  float32):   c0,c1 = C[g][2t, 2t+1]      c2,c3 = C[g+8][2t, 2t+1]
// Two consequences shape the whole kernel:
//   * a lane holds scores and outputs of exactly two rows, g and g + 8. So m, l and
//     alpha of those two rows live in that lane's registers, the rescale o *= alpha
//     needs no communication, and a row's max and sum need only the 4 lanes of a quad
//     (two __shfl_xor_sync).
//   * the C layout of two neighbouring 16x8 score tiles is the A layout of one 16x16
//     tile: P goes from the first product to the second without leaving registers.
//
// Shared memory: k_s and v_s, BLOCK_K rows of HEAD_DIM + 8 16-bit values (the 8 extra,
// 16 bytes, keep 16-byte alignment and put the 8 rows g = 0..7 that a K fragment reads
// on different banks). Keys past n_k are zeros, never read from global memory.
//
// What a row cannot see never reaches it. In the diagonal tile a key hidden from row r
// (j > r + n_k - n_q) has p = 0 exactly, and its score is replaced by -inf whatever K
// holds. But the tensor core cannot skip a product: o += P V multiplies that p = 0 by
// the key's v, and if v holds NaN or inf (a cache position not yet written),
// 0 * NaN = NaN reaches row r. So:
//   * the load writes non-finite V values into v_s as 0, and __syncthreads_or tells the
//     whole block whether the tile had any (a finite v times p = 0 adds exactly 0);
//   * only then (never, for clean data) step 6 adds the missing terms p * v by hand where
//     p > 0: for v = inf or NaN that term is v itself (inf, or NaN). A key with p = 0
//     (every hidden key) adds nothing. So NaN or inf in V reaches exactly the rows and
//     columns it reaches in the reference's P V, and nothing else.
//
// Not done here, to keep the lesson short (each is a next step on the way to FA-2's
// speed): cp.async double buffering of K/V, ldmatrix fragment loads, exp2 with log2(e)
// folded into the scale, and Hopper's wgmma/TMA (FlashAttention-3).
//
// Launch: grid = (ceil(n_q / 64), batch * heads), block = 128 threads (4 warps).
// Defines: HEAD_DIM (a multiple of 16, 16..256), BLOCK_K (a multiple of 16),
// FA_DTYPE 1 (float16) or 2 (bfloat16), FA_TRACE. Needs sm_80 or newer.
#include "common.cuh"
// the plumbing of the tensor cores: pack2, pack2f, non_finite, finite_part, mma_16x8x16, load_a_fragment
#include "tensor_core.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_K
#define BLOCK_K 64
#endif
#define BLOCK_Q 64
#define NUM_THREADS 128
#define ROWS_PER_WARP 16
#define K_PITCH (HEAD_DIM + 8)          // 16-bit values per row of k_s and v_s
#define D_STEPS (HEAD_DIM / 16)         // 16-wide slices of d:   S = sum over slices of Q K^T
#define S_TILES (BLOCK_K / 8)           // 16x8 score tiles per warp and key tile
#define KEY_STEPS (BLOCK_K / 16)        // 16-key slices:         o += sum over slices of P V
#define O_TILES (HEAD_DIM / 8)          // 16x8 output tiles per warp
// Q's fragments take HEAD_DIM / 4 registers per lane: kept for the whole kernel up to d = 128;
// above that, o alone takes HEAD_DIM / 2 and Q is re-read from global memory for each tile.
#define Q_IN_REGISTERS (HEAD_DIM <= 128)

static_assert(FA_DTYPE == 1 || FA_DTYPE == 2, "tensor cores take float16 or bfloat16 inputs");
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 16 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 16 in 16..256");
static_assert(BLOCK_K % 16 == 0 && BLOCK_K >= 16 && BLOCK_K <= 128, "BLOCK_K must be a multiple of 16 in 16..128");

// q: (batch*heads, n_q, HEAD_DIM), k, v: (batch*heads, n_k, HEAD_DIM), 16-bit, C-contiguous,
// each 16-byte aligned. out: like q; lse: (batch*heads, n_q) float32.
// causal != 0: query i sees key j iff j <= i + n_k - n_q (bottom-right aligned).
// Trace: trace_rows (n_trace_rows,) query rows; trace (batch*heads, n_trace_rows, trace_tiles, 3).
// (__launch_bounds__(128, 1): one block per SM is enough, so ptxas may give each thread up to
// 255 registers for o, Q and S instead of spilling to reach a guessed occupancy.)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_attention_mma(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                    const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                    float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                    const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                    float* __restrict__ trace) {
    __shared__ __align__(16) scalar_t k_s[BLOCK_K * K_PITCH];
    __shared__ __align__(16) scalar_t v_s[BLOCK_K * K_PITCH];

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;            // the fragment coordinates (see above)
    const int q_start = blockIdx.x * BLOCK_Q;
    const int row_lo = q_start + warp * ROWS_PER_WARP + g;     // this lane's two query rows:
    const int rows[2] = {row_lo, row_lo + 8};                  // rows[0] = g, rows[1] = g + 8
    const long long bh = blockIdx.y;

    const scalar_t* q_bh = q + bh * n_q * HEAD_DIM;
    const scalar_t* k_bh = k + bh * n_k * HEAD_DIM;
    const scalar_t* v_bh = v + bh * n_k * HEAD_DIM;

    // ---- this warp's 16 query rows, as A fragments, for the whole kernel -------------
#if Q_IN_REGISTERS
    unsigned q_frag[D_STEPS][4];
#pragma unroll
    for (int ds = 0; ds < D_STEPS; ++ds) load_a_fragment(q_frag[ds], q_bh, HEAD_DIM, row_lo, n_q, ds * 16, t);
#endif

    // ---- which key tiles to visit (causal: none wholly above the diagonal) ------------
    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);

#ifdef FA_TRACE
    int trace_slot[2] = {-1, -1};
    for (int h = 0; h < 2; ++h)
        if (rows[h] < n_q)
            for (int i = 0; i < n_trace_rows; ++i)
                if (trace_rows[i] == rows[h]) trace_slot[h] = i;
#endif

    // ---- the running state of rows g and g + 8 (index h = 0, 1) ------------------------
    float m[2] = {NEG_INF, NEG_INF};
    float l[2] = {0.f, 0.f};
    float o[O_TILES][4];                             // o[n][i]: row rows[i / 2], column 8n + 2t + i % 2
#pragma unroll
    for (int n = 0; n < O_TILES; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.f;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;

        // 1. K_j, V_j into shared memory, 8 values (16 bytes) per load; zeros past n_k,
        //    and zeros for inf/NaN in V (added back in step 6 where a row sees them)
        bool v_had_non_finite = false;
        for (int idx = tid; idx < BLOCK_K * (HEAD_DIM / 8); idx += NUM_THREADS) {
            const int j = idx / (HEAD_DIM / 8), c = (idx % (HEAD_DIM / 8)) * 8;
            const int key = k_start + j;
            uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = kw;
            if (key < n_k) {
                kw = *reinterpret_cast<const uint4*>(k_bh + (long long)key * HEAD_DIM + c);
                vw = finite_part(*reinterpret_cast<const uint4*>(v_bh + (long long)key * HEAD_DIM + c),
                                 &v_had_non_finite);
            }
            *reinterpret_cast<uint4*>(k_s + j * K_PITCH + c) = kw;
            *reinterpret_cast<uint4*>(v_s + j * K_PITCH + c) = vw;
        }
        // the barrier, which also tells every thread whether any thread met inf/NaN in V
        const bool tile_has_non_finite_v = __syncthreads_or(v_had_non_finite) != 0;

        // 2. S = Q K_j^T on tensor cores. B = K^T, so b0,b1 = K[key 8n + g][2t, 2t+1]:
        //    two neighbouring values of one row of k_s, one 32-bit load.
        float s[S_TILES][4];
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = 0.f;
#pragma unroll
        for (int ds = 0; ds < D_STEPS; ++ds) {
#if Q_IN_REGISTERS
            const unsigned* q_ds = q_frag[ds];
#else
            unsigned q_ds[4];                        // (re-read: it stays in L1/L2 cache)
            load_a_fragment(q_ds, q_bh, HEAD_DIM, row_lo, n_q, ds * 16, t);
#endif
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) {
                const scalar_t* k_row = k_s + (n * 8 + g) * K_PITCH + ds * 16 + 2 * t;
                const unsigned b[2] = {*reinterpret_cast<const unsigned*>(k_row),
                                       *reinterpret_cast<const unsigned*>(k_row + 8)};
                mma_16x8x16(s[n], q_ds, b);
            }
        }

        // 3. scale, mask (past n_k, above the causal diagonal: -inf), and each row's max
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i / 2;
                const int key = k_start + n * 8 + 2 * t + i % 2;
                const bool visible = key < n_k && (!causal || key <= rows[h] + n_k - n_q);
                s[n][i] = visible ? s[n][i] * scale : NEG_INF;
                tile_max[h] = fmaxf(tile_max[h], s[n][i]);
            }

        // 4. the online-softmax step for both rows (a row's 4 lanes form a quad)
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m[h], group_max<4>(tile_max[h]));
            alpha[h] = correction_factor(m[h], m_new);
            float row_sum = 0.f;
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int i = 2 * h; i < 2 * h + 2; ++i) {
                    s[n][i] = expf(s[n][i] - safe_max(m_new));     // s now holds P; masked: 0
                    row_sum += s[n][i];
                }
            l[h] = alpha[h] * l[h] + group_sum<4>(row_sum);
            m[h] = m_new;
        }
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[n][i] *= alpha[i / 2];

        // (for step 6, only when V held inf or NaN: which of this lane's p round to 0 in the
        //  mma; bit 2n + e of p_zero_bits[h] is key 8n + 2t + e of row rows[h])
        unsigned p_zero_bits[2] = {0u, 0u};
        if (tile_has_non_finite_v)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (from_float(s[n][i]) == 0) p_zero_bits[i / 2] |= 1u << (2 * n + i % 2);

        // 5. o += P V_j on tensor cores. P's A fragment for keys 16ks .. 16ks+15 is the C
        //    fragments of score tiles 2ks and 2ks+1, rounded to 16 bits. B = V, so
        //    b0,b1 = V[key 16ks + 2t, 2t+1][column 8n + g]: two rows of v_s, one value each.
#pragma unroll
        for (int ks = 0; ks < KEY_STEPS; ++ks) {
            const unsigned p_frag[4] = {
                pack2f(s[2 * ks][0], s[2 * ks][1]),
                pack2f(s[2 * ks][2], s[2 * ks][3]),
                pack2f(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                pack2f(s[2 * ks + 1][2], s[2 * ks + 1][3])};
            const scalar_t* v_col = v_s + (ks * 16 + 2 * t) * K_PITCH + g;
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                const scalar_t* v_n = v_col + n * 8;
                const unsigned b[2] = {pack2(v_n[0], v_n[K_PITCH]),
                                       pack2(v_n[8 * K_PITCH], v_n[9 * K_PITCH])};
                mma_16x8x16(o[n], p_frag, b);
            }
        }

        // 6. (only for a tile whose V held inf or NaN; the same for the whole block) the terms
        //    p * v that step 5 left out: for v = inf or NaN and p > 0 (as rounded for the mma)
        //    p * v is v itself; p = 0 (every key the row cannot see) adds nothing. Key j's p of
        //    rows g, g + 8 is in lane 4g + (j % 8) / 2 of the quad, which passes its p_zero bits
        //    by a shuffle.
        if (tile_has_non_finite_v) {
            const int n_keys = min(BLOCK_K, n_k - k_start);          // the same for the whole block
#pragma unroll 1
            for (int j = 0; j < n_keys; ++j) {
                const int key = k_start + j;
                bool adds[2];                                        // p > 0 for row rows[h]
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned bits = __shfl_sync(0xffffffffu, p_zero_bits[h], 4 * g + (j % 8) / 2);
                    adds[h] = !((bits >> (2 * (j / 8) + j % 2)) & 1u);
                }
                if (!adds[0] && !adds[1]) continue;                  // (no shuffle follows)
                const scalar_t* v_row = v_bh + (long long)key * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < O_TILES; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const scalar_t x = v_row[n * 8 + e];
                        if (!non_finite(x)) continue;                // already in o via v_s
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            if (adds[h]) o[n][2 * h + e] += to_float(x);
                    }
            }
        }

#ifdef FA_TRACE
        if (t == 0)
            for (int h = 0; h < 2; ++h)
                if (trace_slot[h] >= 0) {
                    float* rec = trace + ((bh * n_trace_rows + trace_slot[h]) * trace_tiles + tile) * TRACE_FIELDS;
                    rec[0] = m[h]; rec[1] = alpha[h]; rec[2] = l[h];
                }
#endif
        __syncthreads();                             // everyone is done with k_s, v_s
    }

    // ---- finalize: one division per row; rows past n_q write nothing -------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (rows[h] >= n_q) continue;
        const bool seen = l[h] != 0.f;               // false: nothing visible -> 0, lse -inf
        scalar_t* out_row = out + (bh * n_q + rows[h]) * HEAD_DIM;
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
#pragma unroll
            for (int i = 2 * h; i < 2 * h + 2; ++i)
                out_row[n * 8 + 2 * t + i % 2] = from_float(seen ? o[n][i] / l[h] : 0.f);
        if (t == 0) lse[bh * n_q + rows[h]] = seen ? m[h] + logf(l[h]) : NEG_INF;
    }
}

// One tensor-core instruction on its own, for checking the fragment layout above:
// d (16 x 8, float32) = a (16 x 16, row-major) @ b (16 x 8, row-major). Warp 0 computes it.
extern "C" __global__ void mma_probe(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                     float* __restrict__ d) {
    if (threadIdx.x >= 32) return;                   // one warp is enough
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned a_frag[4];
    load_a_fragment(a_frag, a, 16, g, 16, 0, t);
    const unsigned b_frag[2] = {pack2(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]),
                                pack2(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g])};
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16x8x16(c, a_frag, b_frag);
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = c[i];
}
