// flash_attention.cu - FlashAttention-2 forward pass, one query block per thread block.
//
//   for each query block Q_i (BLOCK_Q rows, kept in shared memory):      <- one thread block
//       m = -inf, l = 0, o = 0                  (per row, in registers)
//       for each key tile K_j, V_j (BLOCK_K keys) up to the causal diagonal:
//           S   = scale * Q_i K_j^T             (BLOCK_Q x BLOCK_K, in registers)
//           m_new = max(m, rowmax(S));  alpha = exp(m - m_new)
//           P   = exp(S - m_new)                (shared memory, to share it across the row)
//           l   = alpha * l + rowsum(P)
//           o   = alpha * o + P V_j
//           m   = m_new
//       O_i = o / l;   lse_i = m + log(l)
//
// Source: Dao 2023, "FlashAttention-2", Alg. 1 (outer loop over query blocks, one
// division at the end); causal masking aligned bottom-right as in FlashAttention-2.
//
// Thread layout. NUM_THREADS = 128 threads serve BLOCK_Q rows, so each query row is
// owned by THREADS_PER_ROW = 128 / BLOCK_Q consecutive lanes of one warp (2, 4 or 8).
// Those lanes split the row's work:
//   * scores:  lane t of the row computes keys j = t, t + THREADS_PER_ROW, ...
//   * output:  lane t of the row owns columns c = t, t + THREADS_PER_ROW, ... of o
// and they agree on the row max and row sum with a butterfly shuffle (group_max/sum).
// m and l are held (identically) by every lane of the row.
//
// Shared memory (float32, one extra column of padding per row so that lanes reading
// the same column of different rows hit different banks):
//   q_s[BLOCK_Q][HEAD_DIM + 1]   the query block, loaded once
//   k_s[BLOCK_K][HEAD_DIM + 1]   the current key tile   (zeros past n_k)
//   v_s[BLOCK_K][HEAD_DIM + 1]   the current value tile (zeros past n_k)
//   p_s[BLOCK_Q][BLOCK_K + 1]    the tile's probabilities P
// The launcher picks BLOCK_Q, BLOCK_K per head dim so that this stays under the
// 48 KiB of static shared memory (lessons/gpu/source.py: flash_attention_config).
//
// Launch: grid = (ceil(n_q / BLOCK_Q), batch * heads), block = (NUM_THREADS).
// Defines: HEAD_DIM (1..256), BLOCK_Q, BLOCK_K, FA_DTYPE, FA_TRACE.
#include "common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_Q
#define BLOCK_Q 32
#endif
#ifndef BLOCK_K
#define BLOCK_K 16
#endif
#define NUM_THREADS 128
#define THREADS_PER_ROW (NUM_THREADS / BLOCK_Q)
#define D_PAD (HEAD_DIM + 1)
#define COLS_PER_THREAD ((HEAD_DIM + THREADS_PER_ROW - 1) / THREADS_PER_ROW)
#define KEYS_PER_THREAD (BLOCK_K / THREADS_PER_ROW)

static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 256, "HEAD_DIM must be in 1..256");
static_assert(NUM_THREADS % BLOCK_Q == 0, "BLOCK_Q must divide 128");
static_assert(THREADS_PER_ROW >= 1 && THREADS_PER_ROW <= 32 &&
              (THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0,
              "a row's lanes must be a power of two within one warp");
static_assert(BLOCK_K % THREADS_PER_ROW == 0, "BLOCK_K must be a multiple of 128 / BLOCK_Q");

// q: (batch*heads, n_q, HEAD_DIM), k, v: (batch*heads, n_k, HEAD_DIM), all C-contiguous.
// out: like q; lse: (batch*heads, n_q) float32.
// causal != 0: query i sees key j iff j <= i + n_k - n_q (bottom-right aligned).
// Trace: trace_rows (n_trace_rows,) query rows; trace (batch*heads, n_trace_rows, trace_tiles, 3).
// __launch_bounds__(128, 4): ask for 4 resident blocks per SM (up to 128 registers per thread);
// without the second number ptxas aimed higher and spilled a few bytes at small head dims.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
flash_attention_forward(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                        const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                        float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                        const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                        float* __restrict__ trace) {
    __shared__ float q_s[BLOCK_Q][D_PAD];
    __shared__ float k_s[BLOCK_K][D_PAD];
    __shared__ float v_s[BLOCK_K][D_PAD];
    __shared__ float p_s[BLOCK_Q][BLOCK_K + 1];

    const int tid = threadIdx.x;
    const int r = tid / THREADS_PER_ROW;          // this thread's row inside the block
    const int lane = tid % THREADS_PER_ROW;       // its place among the row's lanes
    const int q_start = blockIdx.x * BLOCK_Q;     // first query row of the block
    const int row = q_start + r;                  // this thread's global query row (may be >= n_q)
    const long long bh = blockIdx.y;              // which (batch, head)

    const scalar_t* q_bh = q + bh * n_q * HEAD_DIM;
    const scalar_t* k_bh = k + bh * n_k * HEAD_DIM;
    const scalar_t* v_bh = v + bh * n_k * HEAD_DIM;

    // ---- load the query block once (zeros for rows past n_q: they compute, never write)
    for (int idx = tid; idx < BLOCK_Q * HEAD_DIM; idx += NUM_THREADS) {
        const int rr = idx / HEAD_DIM, c = idx % HEAD_DIM;
        const int g = q_start + rr;
        q_s[rr][c] = g < n_q ? to_float(q_bh[(long long)g * HEAD_DIM + c]) : 0.f;
    }
    // (no barrier yet: q_s is first read after the barrier that follows the first K/V load)

    // ---- which key tiles to visit (causal: none wholly above the diagonal) ------------
    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);

#ifdef FA_TRACE
    int trace_slot = -1;
    if (row < n_q)
        for (int i = 0; i < n_trace_rows; ++i)
            if (trace_rows[i] == row) trace_slot = i;
#endif

    // ---- the running state of this row ----------------------------------------------
    float m = NEG_INF;
    float l = 0.f;
    float o[COLS_PER_THREAD];                      // o[i] is column lane + i * THREADS_PER_ROW
#pragma unroll
    for (int i = 0; i < COLS_PER_THREAD; ++i) o[i] = 0.f;

    const int diagonal = row + n_k - n_q;          // the last key this row may see when causal

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;

        // 1. all threads load K_j, V_j (coalesced: consecutive threads, consecutive columns).
        //    Keys past n_k are zeros, never read from global memory.
        for (int idx = tid; idx < BLOCK_K * HEAD_DIM; idx += NUM_THREADS) {
            const int j = idx / HEAD_DIM, c = idx % HEAD_DIM;
            const int key = k_start + j;
            const bool inside = key < n_k;
            k_s[j][c] = inside ? to_float(k_bh[(long long)key * HEAD_DIM + c]) : 0.f;
            v_s[j][c] = inside ? to_float(v_bh[(long long)key * HEAD_DIM + c]) : 0.f;
        }
        __syncthreads();                           // K_j, V_j (and Q the first time) are ready

        // 2. scores of this row against my keys j = lane + t * THREADS_PER_ROW;
        //    masked scores (past n_k, or above the causal diagonal) are -inf
        float s[KEYS_PER_THREAD];
#pragma unroll
        for (int t = 0; t < KEYS_PER_THREAD; ++t) s[t] = 0.f;
        for (int c = 0; c < HEAD_DIM; ++c) {       // runtime loop; the t loop inside unrolls
            const float q_c = q_s[r][c];
#pragma unroll
            for (int t = 0; t < KEYS_PER_THREAD; ++t) s[t] += q_c * k_s[lane + t * THREADS_PER_ROW][c];
        }
        float tile_max = NEG_INF;
#pragma unroll
        for (int t = 0; t < KEYS_PER_THREAD; ++t) {
            const int key = k_start + lane + t * THREADS_PER_ROW;
            const bool visible = key < n_k && (!causal || key <= diagonal);
            s[t] = visible ? s[t] * scale : NEG_INF;
            tile_max = fmaxf(tile_max, s[t]);
        }
        tile_max = group_max<THREADS_PER_ROW>(tile_max);   // the row's max over the whole tile

        // 3. the online-softmax step: move m, rescale, add this tile's probabilities
        const float m_new = fmaxf(m, tile_max);
        const float alpha = correction_factor(m, m_new);
        float row_sum = 0.f;
#pragma unroll
        for (int t = 0; t < KEYS_PER_THREAD; ++t) {
            const float p = expf(s[t] - safe_max(m_new));  // masked: exp(-inf) = 0
            p_s[r][lane + t * THREADS_PER_ROW] = p;
            row_sum += p;
        }
        row_sum = group_sum<THREADS_PER_ROW>(row_sum);
        l = alpha * l + row_sum;
        m = m_new;
        __syncwarp();                              // the row's P (written by the row's lanes,
                                                   // all in this warp) is visible to those lanes

        // 4. o = alpha * o + P V_j for the columns c = lane + i * THREADS_PER_ROW this thread
        //    owns: rescale once, then add one key at a time (each p_j read once, broadcast).
        //    A key with p = 0 is skipped, not multiplied: a key above the causal diagonal has
        //    p = 0 exactly, and in the diagonal tile its v may hold NaN or inf (a position not
        //    yet written); 0 * NaN = NaN would reach a row that cannot see it. (Keys past n_k
        //    are zeros in v_s.) NaN or inf in v with p > 0 still reaches the row, as in P V.
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) o[i] *= alpha;
        for (int j = 0; j < BLOCK_K; ++j) {        // runtime loop; the i loop inside unrolls
            const float p = p_s[r][j];
            if (p == 0.f) continue;                // adds exactly nothing, whatever v holds
#pragma unroll
            for (int i = 0; i < COLS_PER_THREAD; ++i) {
                const int c = lane + i * THREADS_PER_ROW;
                if (c < HEAD_DIM) o[i] += p * v_s[j][c];
            }
        }

#ifdef FA_TRACE
        if (trace_slot >= 0 && lane == 0) {
            float* rec = trace + ((bh * n_trace_rows + trace_slot) * trace_tiles + tile) * TRACE_FIELDS;
            rec[0] = m; rec[1] = alpha; rec[2] = l;
        }
#endif
        __syncthreads();                           // everyone is done with k_s, v_s, p_s
    }

    // ---- finalize: one division per row; rows past n_q write nothing ------------------
    // (without this check the last block would write into the next head's rows)
    if (row < n_q) {
        scalar_t* out_row = out + (bh * n_q + row) * HEAD_DIM;
        const bool seen = l != 0.f;                // false: nothing visible -> out 0, lse -inf (NaN stays NaN)
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            const int c = lane + i * THREADS_PER_ROW;
            if (c < HEAD_DIM) out_row[c] = from_float(seen ? o[i] / l : 0.f);
        }
        if (lane == 0) lse[bh * n_q + row] = seen ? m + logf(l) : NEG_INF;
    }
}
