// flash_attention_backward.cu - the FlashAttention-2 backward pass: recompute, don't store.
//
// The forward kept only O and the row log-sum-exp L (lse). From them the backward recomputes
// the probabilities tile by tile, P = exp(S - L), never holding the N x N matrix:
//
//   0. preprocess:  D_i = rowsum(dO_i * O_i)                          (one number per query row)
//   1. dK, dV:      for each key block K_j, V_j (BLOCK_K keys)        <- one thread block
//                       dK_j = 0, dV_j = 0                             (registers)
//                       for each query block Q_i, dO_i, L_i, D_i that sees the block:
//                           S  = scale * Q_i K_j^T                     (recomputed)
//                           P  = exp(S - L_i)                          (already normalised)
//                           dV_j += P^T dO_i
//                           dP = dO_i V_j^T
//                           dS = P * (dP - D_i)
//                           dK_j += scale * dS^T Q_i
//   2. dQ:          for each query block Q_i (BLOCK_Q rows)           <- one thread block
//                       dQ_i = 0
//                       for each key block up to the causal diagonal:
//                           S, P, dP, dS recomputed as above
//                           dQ_i += scale * dS K_j
//
// Source: Dao 2023, "FlashAttention-2", Alg. 2 (and Sec. 3.1.2 for the backward's loop order);
// Dao et al. 2022, "FlashAttention", Alg. 4 and App. B.2 for D = rowsum(dO * O).
//
// Why dQ is a separate pass, not a float32 atomicAdd from step 1.
// FlashAttention-2's Alg. 2 adds each block's dS K_j into dQ_i in global memory with atomicAdd:
// S and dP are computed once (5 matmuls per tile pair in all). But the order in which the key
// blocks' additions land is the scheduler's, and float addition is not associative, so dQ then
// differs in its last bits from run to run; it also needs a float32 dQ buffer and a final
// conversion to 16-bit storage. Here the dQ kernel recomputes S and dP itself (7 matmuls per tile
// pair instead of 5: 1.4x the FLOPs of the fused loop) and owns its rows: every dQ_i is summed in
// one fixed key order by one thread block, so dq, dk and dv are bitwise the same on every run,
// with no atomics and no extra buffer. A lesson values that repeatability over the 40 %.
//
// Masking, as the forward (lessons/gpu/kernels/flash_attention.cu):
//   * causal != 0 is aligned bottom-right: query i sees key j iff j <= i + n_k - n_q;
//     the dK/dV kernel starts at the first query block that sees any key of its block and the
//     dQ kernel stops at the last key block its rows see (tile skipping, FA-2 Sec. 3.1);
//   * a pair (i, j) that is not visible (causal, or past n_q / n_k) gets P = 0 and dS = 0;
//   * a row with no visible key has L = -inf: its P is 0 (never exp(+inf)), so its dq is 0 and
//     it adds nothing to any dk, dv; a key no row sees gets dk = dv = 0.
//
// Thread layouts (NUM_THREADS = 128 threads):
//   dK/dV kernel: each key row of the block is owned by THREADS_PER_KEY = 128 / BLOCK_K
//     consecutive lanes of one warp. For a query block, lane t of key row jj computes the
//     scores S[i][jj] and dP[i][jj] of queries i = t, t + THREADS_PER_KEY, ..., writes P and dS
//     into shared memory (column jj), and then accumulates columns c = t, t + THREADS_PER_KEY, ...
//     of dK_j[jj] and dV_j[jj] over all the block's queries.
//   dQ kernel: as the forward, each query row is owned by THREADS_PER_ROW = 128 / BLOCK_Q lanes;
//     lane t computes the keys t, t + THREADS_PER_ROW, ... and owns those columns of dQ_i.
//   The lanes that write a row of P / dS are the lanes that read it back (one warp), so a
//   __syncwarp() between the two suffices.
//
// Shared memory (float32, +1 column of padding against bank conflicts):
//   dK/dV: k_s, v_s [BLOCK_K][d+1], q_s, do_s [BLOCK_Q][d+1], p_s, ds_s [BLOCK_K][BLOCK_Q+1],
//          lse_s, delta_s [BLOCK_Q]
//   dQ:    q_s, do_s [BLOCK_Q][d+1], k_s, v_s [BLOCK_K][d+1], ds_s [BLOCK_Q][BLOCK_K+1]
// lessons/gpu/source.py (flash_attention_backward_config) picks BLOCK_Q, BLOCK_K so that both
// stay within 48 KiB; the backward takes head dims up to 128.
//
// Trace build (-DFA_TRACE): the dK/dV block trace_block writes its running dK_j (scaled, as it
// would be output) and dV_j after every query block it absorbs, into
// trace[bh][query_block][2][BLOCK_K][HEAD_DIM]; query blocks it skipped stay NaN (the launcher
// fills the buffer with NaN), as do key rows past n_k. The dQ kernel writes every row's running
// dQ_i (scaled, as it would be output) after every key block it absorbs, into
// dq_trace[bh][key_block][row][HEAD_DIM]; key blocks a row's query block skipped stay NaN.
// Builds without FA_TRACE never touch trace or dq_trace.
//
// Launch (all three: block = 128 threads):
//   flash_attention_backward_preprocess  grid = (ceil(n_q / 4), batch * heads)
//   flash_attention_backward_dkdv        grid = (ceil(n_k / BLOCK_K), batch * heads)
//   flash_attention_backward_dq          grid = (ceil(n_q / BLOCK_Q), batch * heads)
// Defines: HEAD_DIM (1..128), BLOCK_Q, BLOCK_K, FA_DTYPE, FA_TRACE.
#include "common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_Q
#define BLOCK_Q 16
#endif
#ifndef BLOCK_K
#define BLOCK_K 16
#endif
#define NUM_THREADS 128
#define ROWS_PER_PREPROCESS (NUM_THREADS / 32)                 // one warp per row of D
#define THREADS_PER_KEY (NUM_THREADS / BLOCK_K)                 // dK/dV kernel
#define THREADS_PER_ROW (NUM_THREADS / BLOCK_Q)                 // dQ kernel
#define D_PAD (HEAD_DIM + 1)
#define KEY_COLS ((HEAD_DIM + THREADS_PER_KEY - 1) / THREADS_PER_KEY)   // dK/dV columns per thread
#define ROW_COLS ((HEAD_DIM + THREADS_PER_ROW - 1) / THREADS_PER_ROW)   // dQ columns per thread
#define QUERIES_PER_THREAD (BLOCK_Q / THREADS_PER_KEY)          // scores per thread, dK/dV kernel
#define KEYS_PER_THREAD (BLOCK_K / THREADS_PER_ROW)             // scores per thread, dQ kernel

static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 128, "the backward takes HEAD_DIM in 1..128");
static_assert(NUM_THREADS % BLOCK_Q == 0 && NUM_THREADS % BLOCK_K == 0, "BLOCK_Q and BLOCK_K must divide 128");
static_assert(THREADS_PER_KEY >= 1 && THREADS_PER_KEY <= 32 && (THREADS_PER_KEY & (THREADS_PER_KEY - 1)) == 0,
              "a key row's lanes must be a power of two within one warp");
static_assert(THREADS_PER_ROW >= 1 && THREADS_PER_ROW <= 32 && (THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0,
              "a query row's lanes must be a power of two within one warp");
static_assert(BLOCK_Q % THREADS_PER_KEY == 0 && BLOCK_K % THREADS_PER_ROW == 0,
              "BLOCK_Q * BLOCK_K must be a multiple of 128");

// P and dS of one (query, key) pair from its recomputed score s (unscaled q.k) and dp (dO.v).
// Not visible: both 0. L = -inf (a row that saw no key): P = 0, not exp(s + inf).
__device__ __forceinline__ void probability_and_ds(float s, float dp, float scale, float L, float D,
                                                   bool visible, float* p, float* ds) {
    const float prob = (visible && L != NEG_INF) ? expf(s * scale - L) : 0.f;
    *p = prob;
    *ds = visible ? prob * (dp - D) : 0.f;
}

// ---------------------------------------------------------------------------
// 0. D = rowsum(dO * O), one warp per query row (coalesced: lanes read consecutive columns).
// o, d_o: (batch*heads, n_q, HEAD_DIM); delta: (batch*heads, n_q) float32.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_attention_backward_preprocess(const scalar_t* __restrict__ o, const scalar_t* __restrict__ d_o,
                                    float* __restrict__ delta, int n_q) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * ROWS_PER_PREPROCESS + warp;
    const long long bh = blockIdx.y;
    float sum = 0.f;
    if (row < n_q) {
        const long long base = (bh * n_q + row) * HEAD_DIM;
        for (int c = lane; c < HEAD_DIM; c += 32) sum += to_float(o[base + c]) * to_float(d_o[base + c]);
    }
    sum = group_sum<32>(sum);                      // every lane takes part (full mask)
    if (row < n_q && lane == 0) delta[bh * n_q + row] = sum;
}

// ---------------------------------------------------------------------------
// 1. dK_j, dV_j: one thread block per key block, the query blocks streaming past.
// q, d_o: (batch*heads, n_q, HEAD_DIM); k, v, dk, dv: (batch*heads, n_k, HEAD_DIM);
// lse, delta: (batch*heads, n_q) float32.
// Trace: trace (batch*heads, ceil(n_q / BLOCK_Q), 2, BLOCK_K, HEAD_DIM) for key block trace_block.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
flash_attention_backward_dkdv(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                              const scalar_t* __restrict__ v, const scalar_t* __restrict__ d_o,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              scalar_t* __restrict__ dk, scalar_t* __restrict__ dv, int n_q, int n_k,
                              float scale, int causal, int trace_block, float* __restrict__ trace) {
    __shared__ float k_s[BLOCK_K][D_PAD];
    __shared__ float v_s[BLOCK_K][D_PAD];
    __shared__ float q_s[BLOCK_Q][D_PAD];
    __shared__ float do_s[BLOCK_Q][D_PAD];
    __shared__ float p_s[BLOCK_K][BLOCK_Q + 1];
    __shared__ float ds_s[BLOCK_K][BLOCK_Q + 1];
    __shared__ float lse_s[BLOCK_Q];
    __shared__ float delta_s[BLOCK_Q];

    const int tid = threadIdx.x;
    const int jj = tid / THREADS_PER_KEY;          // this thread's key row inside the block
    const int lane = tid % THREADS_PER_KEY;        // its place among the key row's lanes
    const int k_start = blockIdx.x * BLOCK_K;
    const int key = k_start + jj;                  // global key index (may be >= n_k)
    const long long bh = blockIdx.y;

    const scalar_t* q_bh = q + bh * n_q * HEAD_DIM;
    const scalar_t* do_bh = d_o + bh * n_q * HEAD_DIM;
    const float* lse_bh = lse + bh * n_q;
    const float* delta_bh = delta + bh * n_q;

    // ---- K_j, V_j stay on chip for the whole kernel (zeros past n_k) -------------------
    for (int idx = tid; idx < BLOCK_K * HEAD_DIM; idx += NUM_THREADS) {
        const int j = idx / HEAD_DIM, c = idx % HEAD_DIM;
        const int g = k_start + j;
        const bool inside = g < n_k;
        k_s[j][c] = inside ? to_float(k[(bh * n_k + g) * HEAD_DIM + c]) : 0.f;
        v_s[j][c] = inside ? to_float(v[(bh * n_k + g) * HEAD_DIM + c]) : 0.f;
    }

    float dk_acc[KEY_COLS], dv_acc[KEY_COLS];      // column lane + i * THREADS_PER_KEY of row jj
#pragma unroll
    for (int i = 0; i < KEY_COLS; ++i) { dk_acc[i] = 0.f; dv_acc[i] = 0.f; }

    // ---- which query blocks: causal -> from the first row that sees this block's first key
    // (query i sees key j iff i >= j - (n_k - n_q)); the count is the block's, so every thread
    // runs the same iterations and reaches every barrier.
    const int n_qblocks = (n_q + BLOCK_Q - 1) / BLOCK_Q;
    int first_qblock = 0;
    if (causal) {
        const long long first_row = (long long)k_start - (n_k - n_q);
        first_qblock = first_row <= 0 ? 0 : first_row >= n_q ? n_qblocks : (int)(first_row / BLOCK_Q);
    }

    for (int qb = first_qblock; qb < n_qblocks; ++qb) {
        const int q_start = qb * BLOCK_Q;

        // 1. all threads load Q_i, dO_i (zeros past n_q), L_i and D_i (-inf and 0 past n_q)
        for (int idx = tid; idx < BLOCK_Q * HEAD_DIM; idx += NUM_THREADS) {
            const int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
            const int g = q_start + r;
            const bool inside = g < n_q;
            q_s[r][c] = inside ? to_float(q_bh[(long long)g * HEAD_DIM + c]) : 0.f;
            do_s[r][c] = inside ? to_float(do_bh[(long long)g * HEAD_DIM + c]) : 0.f;
        }
        for (int r = tid; r < BLOCK_Q; r += NUM_THREADS) {
            const int g = q_start + r;
            lse_s[r] = g < n_q ? lse_bh[g] : NEG_INF;
            delta_s[r] = g < n_q ? delta_bh[g] : 0.f;
        }
        __syncthreads();                           // Q_i, dO_i, L_i, D_i (and K_j, V_j) are ready

        // 2. recompute S[i][jj] = q_i . k_jj and dP[i][jj] = dO_i . v_jj for my queries
        //    i = lane + t * THREADS_PER_KEY
        float s[QUERIES_PER_THREAD], dp[QUERIES_PER_THREAD];
#pragma unroll
        for (int t = 0; t < QUERIES_PER_THREAD; ++t) { s[t] = 0.f; dp[t] = 0.f; }
        for (int c = 0; c < HEAD_DIM; ++c) {       // runtime loop; the t loop inside unrolls
            const float k_c = k_s[jj][c], v_c = v_s[jj][c];
#pragma unroll
            for (int t = 0; t < QUERIES_PER_THREAD; ++t) {
                const int i = lane + t * THREADS_PER_KEY;
                s[t] += q_s[i][c] * k_c;
                dp[t] += do_s[i][c] * v_c;
            }
        }

        // 3. P = exp(S - L), dS = P * (dP - D), into shared memory (row jj: this key's lanes)
#pragma unroll
        for (int t = 0; t < QUERIES_PER_THREAD; ++t) {
            const int i = lane + t * THREADS_PER_KEY;
            const int row = q_start + i;
            const bool visible = key < n_k && row < n_q && (!causal || key <= row + n_k - n_q);
            probability_and_ds(s[t], dp[t], scale, lse_s[i], delta_s[i], visible, &p_s[jj][i], &ds_s[jj][i]);
        }
        __syncwarp();                              // the key row's P and dS are visible to its lanes

        // 4. dV_j += P^T dO_i and dK_j += dS^T Q_i for my columns c = lane + i * THREADS_PER_KEY
        for (int i = 0; i < BLOCK_Q; ++i) {        // runtime loop; the column loop inside unrolls
            const float p = p_s[jj][i], ds = ds_s[jj][i];
#pragma unroll
            for (int cc = 0; cc < KEY_COLS; ++cc) {
                const int c = lane + cc * THREADS_PER_KEY;
                if (c < HEAD_DIM) {
                    dv_acc[cc] += p * do_s[i][c];
                    dk_acc[cc] += ds * q_s[i][c];
                }
            }
        }

#ifdef FA_TRACE
        if ((int)blockIdx.x == trace_block && key < n_k) {
            float* rec = trace + ((bh * n_qblocks + qb) * 2) * BLOCK_K * HEAD_DIM;
#pragma unroll
            for (int cc = 0; cc < KEY_COLS; ++cc) {
                const int c = lane + cc * THREADS_PER_KEY;
                if (c < HEAD_DIM) {
                    rec[jj * HEAD_DIM + c] = scale * dk_acc[cc];                       // running dK_j
                    rec[(BLOCK_K + jj) * HEAD_DIM + c] = dv_acc[cc];                   // running dV_j
                }
            }
        }
#endif
        __syncthreads();                           // everyone is done with q_s, do_s, p_s, ds_s
    }

    // ---- write dK_j = scale * dS^T Q, dV_j; keys past n_k write nothing ----------------
    if (key < n_k) {
        const long long base = (bh * n_k + key) * HEAD_DIM;
#pragma unroll
        for (int cc = 0; cc < KEY_COLS; ++cc) {
            const int c = lane + cc * THREADS_PER_KEY;
            if (c < HEAD_DIM) {
                dk[base + c] = from_float(scale * dk_acc[cc]);
                dv[base + c] = from_float(dv_acc[cc]);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// 2. dQ_i: one thread block per query block, the key blocks streaming past (the forward's loop).
// Arguments as the dK/dV kernel; dq: like q.
// Trace: dq_trace (batch*heads, ceil(n_k / BLOCK_K), n_q, HEAD_DIM), every row after every key block.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
flash_attention_backward_dq(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                            const scalar_t* __restrict__ v, const scalar_t* __restrict__ d_o,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            scalar_t* __restrict__ dq, int n_q, int n_k, float scale, int causal,
                            float* __restrict__ dq_trace) {
    __shared__ float q_s[BLOCK_Q][D_PAD];
    __shared__ float do_s[BLOCK_Q][D_PAD];
    __shared__ float k_s[BLOCK_K][D_PAD];
    __shared__ float v_s[BLOCK_K][D_PAD];
    __shared__ float ds_s[BLOCK_Q][BLOCK_K + 1];

    const int tid = threadIdx.x;
    const int r = tid / THREADS_PER_ROW;           // this thread's row inside the block
    const int lane = tid % THREADS_PER_ROW;
    const int q_start = blockIdx.x * BLOCK_Q;
    const int row = q_start + r;                   // global query row (may be >= n_q)
    const long long bh = blockIdx.y;

    const scalar_t* k_bh = k + bh * n_k * HEAD_DIM;
    const scalar_t* v_bh = v + bh * n_k * HEAD_DIM;

    for (int idx = tid; idx < BLOCK_Q * HEAD_DIM; idx += NUM_THREADS) {
        const int rr = idx / HEAD_DIM, c = idx % HEAD_DIM;
        const int g = q_start + rr;
        const bool inside = g < n_q;
        q_s[rr][c] = inside ? to_float(q[(bh * n_q + g) * HEAD_DIM + c]) : 0.f;
        do_s[rr][c] = inside ? to_float(d_o[(bh * n_q + g) * HEAD_DIM + c]) : 0.f;
    }
    const float L = row < n_q ? lse[bh * n_q + row] : NEG_INF;     // the forward's lse of my row
    const float D = row < n_q ? delta[bh * n_q + row] : 0.f;       // rowsum(dO * O) of my row
    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);
    const int diagonal = row + n_k - n_q;          // the last key this row may see when causal

    float dq_acc[ROW_COLS];                        // column lane + i * THREADS_PER_ROW
#pragma unroll
    for (int i = 0; i < ROW_COLS; ++i) dq_acc[i] = 0.f;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;
        for (int idx = tid; idx < BLOCK_K * HEAD_DIM; idx += NUM_THREADS) {
            const int j = idx / HEAD_DIM, c = idx % HEAD_DIM;
            const int g = k_start + j;
            const bool inside = g < n_k;
            k_s[j][c] = inside ? to_float(k_bh[(long long)g * HEAD_DIM + c]) : 0.f;
            v_s[j][c] = inside ? to_float(v_bh[(long long)g * HEAD_DIM + c]) : 0.f;
        }
        __syncthreads();                           // K_j, V_j (and Q_i, dO_i the first time) are ready

        float s[KEYS_PER_THREAD], dp[KEYS_PER_THREAD];
#pragma unroll
        for (int t = 0; t < KEYS_PER_THREAD; ++t) { s[t] = 0.f; dp[t] = 0.f; }
        for (int c = 0; c < HEAD_DIM; ++c) {
            const float q_c = q_s[r][c], do_c = do_s[r][c];
#pragma unroll
            for (int t = 0; t < KEYS_PER_THREAD; ++t) {
                const int j = lane + t * THREADS_PER_ROW;
                s[t] += q_c * k_s[j][c];
                dp[t] += do_c * v_s[j][c];
            }
        }
#pragma unroll
        for (int t = 0; t < KEYS_PER_THREAD; ++t) {
            const int j = lane + t * THREADS_PER_ROW;
            const int key = k_start + j;
            const bool visible = row < n_q && key < n_k && (!causal || key <= diagonal);
            float p;
            probability_and_ds(s[t], dp[t], scale, L, D, visible, &p, &ds_s[r][j]);
        }
        __syncwarp();                              // the row's dS is visible to its lanes

        for (int j = 0; j < BLOCK_K; ++j) {        // dQ_i += dS K_j (scale applied once, at the end)
            const float ds = ds_s[r][j];
#pragma unroll
            for (int i = 0; i < ROW_COLS; ++i) {
                const int c = lane + i * THREADS_PER_ROW;
                if (c < HEAD_DIM) dq_acc[i] += ds * k_s[j][c];
            }
        }
#ifdef FA_TRACE
        if (row < n_q) {                           // running dQ_i after key block `tile`, scaled as output
            float* rec = dq_trace + ((bh * ((n_k + BLOCK_K - 1) / BLOCK_K) + tile) * n_q + row) * HEAD_DIM;
#pragma unroll
            for (int i = 0; i < ROW_COLS; ++i) {
                const int c = lane + i * THREADS_PER_ROW;
                if (c < HEAD_DIM) rec[c] = scale * dq_acc[i];
            }
        }
#endif
        __syncthreads();                           // everyone is done with k_s, v_s, ds_s
    }

    if (row < n_q) {                               // rows past n_q write nothing
        scalar_t* dq_row = dq + (bh * n_q + row) * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < ROW_COLS; ++i) {
            const int c = lane + i * THREADS_PER_ROW;
            if (c < HEAD_DIM) dq_row[c] = from_float(scale * dq_acc[i]);
        }
    }
}
