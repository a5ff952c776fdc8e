// paged_decode.cu - decoding attention over a paged KV cache, with grouped-query heads,
// in one pass (paged_decode) or split over the keys and merged (flash-decoding:
// paged_decode_split + merge_splits).
//
// Decoding: each sequence has ONE new query per head and a long history of keys kept
// in a paged cache (vLLM layout):
//     k_cache, v_cache   (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)   pages of tokens
//     block_tables       (num_seqs, max_blocks_per_seq) int32   logical block -> page
//     seq_lens           (num_seqs,) int32                      tokens of each sequence
// Token t of sequence s lives in page block_tables[s][t / BLOCK_SIZE], slot t % BLOCK_SIZE.
// Nothing at or past seq_len is ever read: the slots there may hold stale data (even NaN).
// Source: Kwon et al. 2023 (PagedAttention), Sec. 4.1-4.2.
//
// Grouped-query attention: num_heads query heads share num_kv_heads key/value heads;
// query head h reads kv head h / (num_heads / num_kv_heads). One thread block takes
// HEADS_PER_BLOCK query heads of the same group, so each K/V page it loads is used by
// all of them (that sharing is what GQA saves). Source: Ainslie et al. 2023 (GQA).
//
// Each key tile is one page: the loop is the FA-2 loop, with the tile's address looked
// up in the block table. Per query head the state (m, l) lives in shared memory and o in
// registers; the layout:
//   q_s[HEADS_PER_BLOCK][HEAD_DIM + 1]     the queries
//   k_s, v_s[BLOCK_SIZE][HEAD_DIM + 1]      the current page (zeros past seq_len)
//   s_s[HEADS_PER_BLOCK][BLOCK_SIZE + 1]    scores, then probabilities
//   m_s, l_s, alpha_s[HEADS_PER_BLOCK]      the running state per head
// Thread i of the block owns output elements idx = i + k * NUM_THREADS of the
// (HEADS_PER_BLOCK, HEAD_DIM) output block, in registers o[k].
//
// Flash-decoding (Dao, Haziza, Massa, Sizov 2023): with few sequences, one block per
// (sequence, head group) leaves most of the GPU idle. paged_decode_split gives each
// block a contiguous range of pages (a split) and writes its partial (m, l, o);
// merge_splits then folds the partial states with the same rescaling as absorb.
//
// Launch: paged_decode        grid = (num_heads / HEADS_PER_BLOCK, num_seqs),            block = 128
//         paged_decode_split  grid = (num_heads / HEADS_PER_BLOCK, num_seqs, num_splits), block = 128
//         merge_splits        grid = (num_heads, num_seqs),                               block = 128
// Defines: HEAD_DIM (1..256), BLOCK_SIZE (1..32), HEADS_PER_BLOCK (divides the group), FA_DTYPE, FA_TRACE.
#include "common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 16
#endif
#ifndef HEADS_PER_BLOCK
#define HEADS_PER_BLOCK 1
#endif
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
#define D_PAD (HEAD_DIM + 1)
#define OUT_PER_THREAD ((HEADS_PER_BLOCK * HEAD_DIM + NUM_THREADS - 1) / NUM_THREADS)
#define MERGE_PER_THREAD ((HEAD_DIM + NUM_THREADS - 1) / NUM_THREADS)

static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 256, "HEAD_DIM must be in 1..256");
static_assert(BLOCK_SIZE >= 1 && BLOCK_SIZE <= 32, "one warp handles a page: BLOCK_SIZE <= 32");
static_assert(HEADS_PER_BLOCK >= 1 && HEADS_PER_BLOCK <= 16, "HEADS_PER_BLOCK must be in 1..16");

// Everything the tile loop needs, in shared memory.
struct DecodeShared {
    float q[HEADS_PER_BLOCK][D_PAD];
    float k[BLOCK_SIZE][D_PAD];
    float v[BLOCK_SIZE][D_PAD];
    float s[HEADS_PER_BLOCK][BLOCK_SIZE + 1];
    float m[HEADS_PER_BLOCK];
    float l[HEADS_PER_BLOCK];
    float alpha[HEADS_PER_BLOCK];
};

#ifdef FA_TRACE
// Slot of (seq, head) among the traced rows (row = seq * num_heads + head), or -1.
__device__ __forceinline__ int trace_slot_of(const int* trace_rows, int n_trace_rows, long long row) {
    int slot = -1;
    for (int i = 0; i < n_trace_rows; ++i)
        if (trace_rows[i] == row) slot = i;
    return slot;
}
#endif

// Load the block's queries and start every head empty (m = -inf, l = 0, o = 0).
__device__ __forceinline__ void decode_begin(DecodeShared& sh, const scalar_t* __restrict__ q,
                                             int seq, int head0, int num_heads,
                                             float (&o)[OUT_PER_THREAD]) {
    const int tid = threadIdx.x;
    for (int idx = tid; idx < HEADS_PER_BLOCK * HEAD_DIM; idx += NUM_THREADS) {
        const int i = idx / HEAD_DIM, c = idx % HEAD_DIM;
        sh.q[i][c] = to_float(q[((long long)seq * num_heads + head0 + i) * HEAD_DIM + c]);
    }
    if (tid < HEADS_PER_BLOCK) {
        sh.m[tid] = NEG_INF;
        sh.l[tid] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < OUT_PER_THREAD; ++k) o[k] = 0.f;
    __syncthreads();
}

// Absorb the pages [tile_begin, tile_end) of one sequence into the state of the
// block's HEADS_PER_BLOCK heads. All threads of the block must call it with the
// same range (it contains barriers). Trace: (n_trace_rows, trace_tiles, 3).
__device__ __forceinline__ void decode_tiles(
        DecodeShared& sh, float (&o)[OUT_PER_THREAD],
        const scalar_t* __restrict__ k_cache, const scalar_t* __restrict__ v_cache,
        const int* __restrict__ block_table, int seq_len, int tile_begin, int tile_end,
        int kv_head, int num_kv_heads, float scale,
        long long first_row, const int* __restrict__ trace_rows, int n_trace_rows,
        int trace_tiles, float* __restrict__ trace) {
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const long long page = block_table[tile];      // the block-table look-up
        const int k_start = tile * BLOCK_SIZE;
        const int valid = min(BLOCK_SIZE, seq_len - k_start);   // tokens of this page in use

        // 1. load this page's keys and values of our kv head; slots past seq_len -> 0
        for (int idx = tid; idx < BLOCK_SIZE * HEAD_DIM; idx += NUM_THREADS) {
            const int t = idx / HEAD_DIM, c = idx % HEAD_DIM;
            if (t < valid) {
                const long long off = ((page * BLOCK_SIZE + t) * num_kv_heads + kv_head) * HEAD_DIM + c;
                sh.k[t][c] = to_float(k_cache[off]);
                sh.v[t][c] = to_float(v_cache[off]);
            } else {
                sh.k[t][c] = 0.f;
                sh.v[t][c] = 0.f;
            }
        }
        __syncthreads();

        // 2. scores: one (head, token) pair per thread (and more if the block is larger)
        for (int idx = tid; idx < HEADS_PER_BLOCK * BLOCK_SIZE; idx += NUM_THREADS) {
            const int i = idx / BLOCK_SIZE, t = idx % BLOCK_SIZE;
            float dot = 0.f;
#pragma unroll 8
            for (int c = 0; c < HEAD_DIM; ++c) dot += sh.q[i][c] * sh.k[t][c];
            sh.s[i][t] = t < valid ? dot * scale : NEG_INF;
        }
        __syncthreads();

        // 3. the online-softmax step, one warp per head (lane t holds token t)
        for (int i = warp; i < HEADS_PER_BLOCK; i += NUM_WARPS) {   // warp-uniform loop
            const float s = lane < BLOCK_SIZE ? sh.s[i][lane] : NEG_INF;
            const float m_old = sh.m[i];
            const float m_new = fmaxf(m_old, group_max<32>(s));
            const float alpha = correction_factor(m_old, m_new);
            const float p = expf(s - safe_max(m_new));
            if (lane < BLOCK_SIZE) sh.s[i][lane] = p;
            const float tile_sum = group_sum<32>(p);
            __syncwarp();                              // every lane has read m[i] before lane 0 updates it
            if (lane == 0) {
                const float l_new = alpha * sh.l[i] + tile_sum;
                sh.m[i] = m_new;
                sh.l[i] = l_new;
                sh.alpha[i] = alpha;
#ifdef FA_TRACE
                const int slot = trace_slot_of(trace_rows, n_trace_rows, first_row + i);
                if (slot >= 0) {
                    float* rec = trace + ((long long)slot * trace_tiles + tile) * TRACE_FIELDS;
                    rec[0] = m_new; rec[1] = alpha; rec[2] = l_new;
                }
#endif
            }
        }
        __syncthreads();

        // 4. o = alpha * o + P V for the output elements idx = tid + k * NUM_THREADS this
        //    thread owns (head i = idx / HEAD_DIM, column c = idx % HEAD_DIM):
        //    rescale once, then add one token at a time
#pragma unroll
        for (int k = 0; k < OUT_PER_THREAD; ++k) {
            const int idx = tid + k * NUM_THREADS;
            if (idx < HEADS_PER_BLOCK * HEAD_DIM) o[k] *= sh.alpha[idx / HEAD_DIM];
        }
        //    (a token with p = 0 adds exactly nothing: skipped, never 0 * v, so NaN or inf in
        //    its v cannot reach the row; slots past seq_len are zeros in v anyway)
        for (int t = 0; t < BLOCK_SIZE; ++t) {     // runtime loop; the k loop inside unrolls
#pragma unroll
            for (int k = 0; k < OUT_PER_THREAD; ++k) {
                const int idx = tid + k * NUM_THREADS;
                if (idx < HEADS_PER_BLOCK * HEAD_DIM) {
                    const int i = idx / HEAD_DIM, c = idx % HEAD_DIM;
                    const float p = sh.s[i][t];
                    if (p != 0.f) o[k] += p * sh.v[t][c];
                }
            }
        }
        __syncthreads();                               // before the next page overwrites k, v, s, alpha
    }
}

// One pass: every page of the sequence, then o / l.
// q: (num_seqs, num_heads, HEAD_DIM); out like q; lse: (num_seqs, num_heads) float32.
// __launch_bounds__(128, 4): at least 4 blocks per SM, so ptxas may use up to 128 registers
// per thread; without the second number it squeezed some head dims into 32 and spilled.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
paged_decode(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
             const scalar_t* __restrict__ v_cache, const int* __restrict__ block_tables,
             const int* __restrict__ seq_lens, int max_blocks_per_seq, int num_heads,
             int num_kv_heads, float scale, scalar_t* __restrict__ out, float* __restrict__ lse,
             const int* __restrict__ trace_rows, int n_trace_rows, float* __restrict__ trace) {
    __shared__ DecodeShared sh;
    const int seq = blockIdx.y;
    const int head0 = blockIdx.x * HEADS_PER_BLOCK;              // first query head of this block
    const int kv_head = head0 / (num_heads / num_kv_heads);      // shared by all heads of the block
    const int seq_len = seq_lens[seq];
    const int n_tiles = min((seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE, max_blocks_per_seq);

    float o[OUT_PER_THREAD];
    decode_begin(sh, q, seq, head0, num_heads, o);
    decode_tiles(sh, o, k_cache, v_cache, block_tables + (long long)seq * max_blocks_per_seq,
                 seq_len, 0, n_tiles, kv_head, num_kv_heads, scale,
                 (long long)seq * num_heads + head0, trace_rows, n_trace_rows, max_blocks_per_seq, trace);

    // finalize (a sequence with seq_len == 0 has l == 0: out 0, lse -inf)
#pragma unroll
    for (int k = 0; k < OUT_PER_THREAD; ++k) {
        const int idx = threadIdx.x + k * NUM_THREADS;
        if (idx < HEADS_PER_BLOCK * HEAD_DIM) {
            const int i = idx / HEAD_DIM, c = idx % HEAD_DIM;
            const float l = sh.l[i];
            out[((long long)seq * num_heads + head0 + i) * HEAD_DIM + c] = from_float(l != 0.f ? o[k] / l : 0.f);
        }
    }
    if (threadIdx.x < HEADS_PER_BLOCK) {
        const int i = threadIdx.x;
        const float l = sh.l[i];
        lse[(long long)seq * num_heads + head0 + i] = l != 0.f ? sh.m[i] + logf(l) : NEG_INF;
    }
}

// Flash-decoding, step 1: split `split` of num_splits takes the pages
// [split * per_split, min((split + 1) * per_split, n_tiles)), per_split = ceil(n_tiles / num_splits),
// and writes its unnormalised partial state. A split with no pages writes the empty
// state (m = -inf, l = 0, o = 0), which the merge ignores.
// part_m, part_l: (num_seqs, num_heads, num_splits) float32; part_o: (..., num_splits, HEAD_DIM) float32.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
paged_decode_split(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                   const scalar_t* __restrict__ v_cache, const int* __restrict__ block_tables,
                   const int* __restrict__ seq_lens, int max_blocks_per_seq, int num_heads,
                   int num_kv_heads, float scale, int num_splits, float* __restrict__ part_m,
                   float* __restrict__ part_l, float* __restrict__ part_o,
                   const int* __restrict__ trace_rows, int n_trace_rows, float* __restrict__ trace) {
    __shared__ DecodeShared sh;
    const int seq = blockIdx.y, split = blockIdx.z;
    const int head0 = blockIdx.x * HEADS_PER_BLOCK;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int seq_len = seq_lens[seq];
    const int n_tiles = min((seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE, max_blocks_per_seq);
    const int per_split = (n_tiles + num_splits - 1) / num_splits;
    const int tile_begin = min(split * per_split, n_tiles);
    const int tile_end = min(tile_begin + per_split, n_tiles);

    float o[OUT_PER_THREAD];
    decode_begin(sh, q, seq, head0, num_heads, o);
    decode_tiles(sh, o, k_cache, v_cache, block_tables + (long long)seq * max_blocks_per_seq,
                 seq_len, tile_begin, tile_end, kv_head, num_kv_heads, scale,
                 (long long)seq * num_heads + head0, trace_rows, n_trace_rows, max_blocks_per_seq, trace);

#pragma unroll
    for (int k = 0; k < OUT_PER_THREAD; ++k) {
        const int idx = threadIdx.x + k * NUM_THREADS;
        if (idx < HEADS_PER_BLOCK * HEAD_DIM) {
            const int i = idx / HEAD_DIM, c = idx % HEAD_DIM;
            const long long state = ((long long)seq * num_heads + head0 + i) * num_splits + split;
            part_o[state * HEAD_DIM + c] = o[k];
        }
    }
    if (threadIdx.x < HEADS_PER_BLOCK) {
        const int i = threadIdx.x;
        const long long state = ((long long)seq * num_heads + head0 + i) * num_splits + split;
        part_m[state] = sh.m[i];
        part_l[state] = sh.l[i];
    }
}

// Flash-decoding, step 2: fold the num_splits partial states of one (seq, head), in
// split order, with merge(a, b): m = max(m_a, m_b), l = a_a l_a + a_b l_b,
// o = a_a o_a + a_b o_b with a_x = exp(m_x - m). Then out = o / l, lse = m + log(l).
// Every thread recomputes the (cheap) scalars m, l so no barrier is needed; thread i
// owns columns i, i + 128 of o. Trace: (n_trace_rows, num_splits, 3), one record per split merged.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
merge_splits(const float* __restrict__ part_m, const float* __restrict__ part_l,
             const float* __restrict__ part_o, int num_heads, int num_splits,
             scalar_t* __restrict__ out, float* __restrict__ lse,
             const int* __restrict__ trace_rows, int n_trace_rows, float* __restrict__ trace) {
    const int head = blockIdx.x, seq = blockIdx.y;
    const long long row = (long long)seq * num_heads + head;

#ifdef FA_TRACE
    const int slot = trace_slot_of(trace_rows, n_trace_rows, row);
#endif

    float m = NEG_INF, l = 0.f;
    float o[MERGE_PER_THREAD];
#pragma unroll
    for (int k = 0; k < MERGE_PER_THREAD; ++k) o[k] = 0.f;

    for (int split = 0; split < num_splits; ++split) {
        const long long state = row * num_splits + split;
        const float m_b = part_m[state], l_b = part_l[state];
        const float m_new = fmaxf(m, m_b);
        const float alpha = correction_factor(m, m_new);     // rescales what was merged so far
        const float beta = correction_factor(m_b, m_new);    // rescales the incoming split
        l = alpha * l + beta * l_b;
#pragma unroll
        for (int k = 0; k < MERGE_PER_THREAD; ++k) {
            const int c = threadIdx.x + k * NUM_THREADS;
            if (c < HEAD_DIM) o[k] = alpha * o[k] + beta * part_o[state * HEAD_DIM + c];
        }
        m = m_new;
#ifdef FA_TRACE
        if (slot >= 0 && threadIdx.x == 0) {
            float* rec = trace + ((long long)slot * num_splits + split) * TRACE_FIELDS;
            rec[0] = m; rec[1] = alpha; rec[2] = l;
        }
#endif
    }

#pragma unroll
    for (int k = 0; k < MERGE_PER_THREAD; ++k) {
        const int c = threadIdx.x + k * NUM_THREADS;
        if (c < HEAD_DIM) out[row * HEAD_DIM + c] = from_float(l != 0.f ? o[k] / l : 0.f);
    }
    if (threadIdx.x == 0) lse[row] = l != 0.f ? m + logf(l) : NEG_INF;
}
