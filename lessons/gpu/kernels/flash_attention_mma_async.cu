// flash_attention_mma_async.cu - the tensor-core forward with ldmatrix and cp.async double buffering.
//
// The fold and the fragment layouts of flash_attention_mma.cu (read that file first: who holds
// what, and how NaN/inf in V is kept from rows that cannot see it), with two changes, the next
// two steps of FlashAttention-2's recipe (Dao 2023, Sec. 3.3; PTX ISA: ldmatrix, cp.async):
//
//   * cp.async double buffering. K_j, V_j go from global to shared memory with cp.async
//     (16 bytes per instruction, no registers on the way, the thread does not wait). Two
//     stages of k_s/v_s: while the warps multiply tile j out of one stage, the copies of
//     tile j+1 into the other are in flight. cp.async.wait_group 1 waits for tile j only.
//     A copy lands raw, so after the wait each thread clears inf/NaN in the V chunks it
//     copied itself (the same rule as flash_attention_mma.cu), then __syncthreads_or.
//   * ldmatrix. A K fragment (two 32-bit registers per lane) was two 32-bit shared loads per
//     lane; ldmatrix.x2 loads the two 8x8 matrices of a fragment for the whole warp in one
//     instruction (each of 16 lanes names one 16-byte row). The V fragment needs the
//     transpose (b0 = V[2t][g], b1 = V[2t+1][g]: two rows, one value each): ldmatrix.x2.trans
//     does it in one instruction instead of four 16-bit loads and two packs.
//
// Predicted: global->shared copies overlap the tensor-core work of the previous tile (the
// mma rung stalls on its synchronous loads); 2-4x fewer shared-memory instructions per
// fragment. Shared memory doubles (two stages), so block_k is 64 for d <= 64, 32 up to 128.
//
// On the CPU emulator cp.async is a plain 16-byte copy and ldmatrix is done by its
// definition: every lane publishes its row address, then picks its elements from the rows
// of the other lanes (so the emulator checks each lane's address arithmetic).
//
// Launch: grid = (ceil(n_q / 64), batch * heads), block = 128 threads (4 warps).
// Defines: HEAD_DIM (a multiple of 16, 16..256), BLOCK_K (16, 32 or 64), FA_DTYPE 1 or 2, FA_TRACE. sm_80+.
#include "common.cuh"
// the plumbing of the tensor cores: pack2f, non_finite, finite_part, mma_16x8x16, load_a_fragment,
// cp_async16 / cp_async_commit / cp_async_wait, ldmatrix_x2
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
static_assert(BLOCK_K == 16 || BLOCK_K == 32 || BLOCK_K == 64, "BLOCK_K must be 16, 32 or 64");

// Start the copies of key tile `tile` into one stage: 16 bytes per cp.async, zeros past n_k.
__device__ __forceinline__ void issue_tile(scalar_t* k_st, scalar_t* v_st, const scalar_t* k_bh,
                                           const scalar_t* v_bh, int tile, int n_k, int tid) {
    for (int idx = tid; idx < BLOCK_K * (HEAD_DIM / 8); idx += NUM_THREADS) {
        const int j = idx / (HEAD_DIM / 8), c = (idx % (HEAD_DIM / 8)) * 8;
        const int key = tile * BLOCK_K + j;
        if (key < n_k) {
            cp_async16(k_st + j * K_PITCH + c, k_bh + (long long)key * HEAD_DIM + c);
            cp_async16(v_st + j * K_PITCH + c, v_bh + (long long)key * HEAD_DIM + c);
        } else {
            *reinterpret_cast<uint4*>(k_st + j * K_PITCH + c) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(v_st + j * K_PITCH + c) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cp_async_commit();          // one group per tile (also when empty), so wait_group 1 means "tile j"
}

// q: (batch*heads, n_q, HEAD_DIM), k, v: (batch*heads, n_k, HEAD_DIM), 16-bit, C-contiguous,
// each 16-byte aligned. out: like q; lse: (batch*heads, n_q) float32.
// causal != 0: query i sees key j iff j <= i + n_k - n_q (bottom-right aligned).
// Trace: trace_rows (n_trace_rows,) query rows; trace (batch*heads, n_trace_rows, trace_tiles, 3).
// (__launch_bounds__(128, 1): one block per SM is enough, so ptxas may give each thread up to
// 255 registers for o, Q and S instead of spilling to reach a guessed occupancy.)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_attention_mma_async(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                    const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                    float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                    const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                    float* __restrict__ trace) {
    __shared__ __align__(16) scalar_t k_stage[2][BLOCK_K * K_PITCH];   // two stages: tile j and j + 1
    __shared__ __align__(16) scalar_t v_stage[2][BLOCK_K * K_PITCH];

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

    if (n_tiles > 0) issue_tile(k_stage[0], v_stage[0], k_bh, v_bh, 0, n_k, tid);

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;

        // 1. tile j + 1 starts copying into the other stage; wait for tile j's own copies, then
        //    clear inf/NaN in the V chunks this thread copied (added back in step 6)
        scalar_t* k_s = k_stage[tile & 1];
        scalar_t* v_s = v_stage[tile & 1];
        if (tile + 1 < n_tiles)
            issue_tile(k_stage[(tile + 1) & 1], v_stage[(tile + 1) & 1], k_bh, v_bh, tile + 1, n_k, tid);
        else
            cp_async_commit();                       // an empty group keeps the count
        cp_async_wait<1>();
        bool v_had_non_finite = false;
        for (int idx = tid; idx < BLOCK_K * (HEAD_DIM / 8); idx += NUM_THREADS) {
            const int j = idx / (HEAD_DIM / 8), c = (idx % (HEAD_DIM / 8)) * 8;
            uint4* w = reinterpret_cast<uint4*>(v_s + j * K_PITCH + c);
            *w = finite_part(*w, &v_had_non_finite);
        }
        // the barrier, which also tells every thread whether any thread met inf/NaN in V
        const bool tile_has_non_finite_v = __syncthreads_or(v_had_non_finite) != 0;

        // 2. S = Q K_j^T on tensor cores. B = K^T, so b0,b1 = K[key 8n + g][2t, 2t+1]:
        //    two neighbouring values of one row of k_s; ldmatrix.x2 fetches them for the whole warp.
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
                // lane 8i + r names row 8n + r, columns ds*16 + 8i .. +7 (matrix i = b[i])
                unsigned b[2];
                ldmatrix_x2(b, saddr(k_s + (n * 8 + lane % 8) * K_PITCH + ds * 16 + 8 * ((lane / 8) % 2)), false);
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
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                // lane 8i + r names row 16ks + 8i + r, columns 8n .. 8n+7; .trans hands each lane a column
                unsigned b[2];
                ldmatrix_x2(b, saddr(v_s + (ks * 16 + 8 * ((lane / 8) % 2) + lane % 8) * K_PITCH + n * 8), true);
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
        __syncthreads();                             // everyone is done with this stage
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

