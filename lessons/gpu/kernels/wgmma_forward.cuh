// wgmma_forward.cuh - what the two Hopper forward kernels share: the block's shared memory, the
// producer warp, and the consumers' steps, each a short function named after the step of
// flash_attention_mma_fa2.cu's fold it does (read flash_attention_wgmma.cu first: it calls these in
// the plain order; flash_attention_wgmma_overlap.cu calls the same steps in FlashAttention-3's order).
//
// Shared memory (dynamic, from a 1024-byte aligned base): the Q tile (BLOCK_Q x HEAD_DIM),
// STAGES x [K tile | V tile] (BLOCK_K x HEAD_DIM each), then the mbarriers and one flag per stage
// (its V held inf or NaN). Every tile is stored as HEAD_DIM / 64 panels of rows of 64 values,
// 128-byte swizzled (hopper.cuh).
//
// The consumers' registers (one thread; hopper.cuh's fragment layout: rows row_g and row_g + 8,
// g = lane / 4, t = lane % 4):
//   sacc[S_TILES * 4]   S of one tile, then its P in float32: sacc[4n + i] is row row_g + 8 (i / 2),
//                       key 8n + 2t + i % 2
//   p16[S_TILES][2]     P of one tile rounded to 16 bits, two keys per word: p16[n][h] holds keys
//                       8n + 2t, 8n + 2t + 1 of row row_g + 8h (the A fragment of O += P V)
//   o[O_TILES * 4]      the unnormalised output: o[4n + i] is row row_g + 8 (i / 2), column 8n + 2t + i % 2
//   m2[2], l[2]         the running max (log2 units) and sum of the two rows
#pragma once
#include "common.cuh"
// pack_float2, fast_exp2, non_finite, chunk_non_finite, finite_part, saddr
#include "tensor_core.cuh"
// TmaDescriptor, mbar_*, tma_load_3d, fence_proxy_async, desc_k_major / desc_mn_major, wgmma_*
#include "hopper.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_K
#define BLOCK_K 64
#endif
#ifndef STAGES
#define STAGES 2
#endif
#define BLOCK_Q 128                     // 2 consumer warpgroups x 64 rows
#define CONSUMER_THREADS 256
#define NUM_THREADS (128 + CONSUMER_THREADS)
#define PANELS (HEAD_DIM / 64)          // 64-column panels of a tile (128-byte rows)
#define D_STEPS (HEAD_DIM / 16)         // 16-wide slices of d: S = sum over slices of Q K^T
#define S_TILES (BLOCK_K / 8)           // 8-key column blocks of the S accumulator
#define KEY_STEPS (BLOCK_K / 16)        // 16-key slices: o += sum over slices of P V
#define O_TILES (HEAD_DIM / 8)          // 8-column blocks of the O accumulator
#define Q_BYTES (BLOCK_Q * HEAD_DIM * 2)
#define KV_BYTES (BLOCK_K * HEAD_DIM * 2)
#define STAGE_BYTES (2 * KV_BYTES)      // K tile, then V tile
#define BAR_OFFSET (Q_BYTES + STAGES * STAGE_BYTES)
#define FLAG_OFFSET (BAR_OFFSET + 8 * (1 + 3 * STAGES))   // after q_full, full[], ready[], empty[]
#define SMEM_BYTES (FLAG_OFFSET + 4 * STAGES)
#define SMEM_ALLOC (SMEM_BYTES + 1024)  // room to round the base up to 1024 bytes

static_assert(FA_DTYPE == 1 || FA_DTYPE == 2, "tensor cores take float16 or bfloat16 inputs");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");
static_assert(BLOCK_K == 64 || BLOCK_K == 128, "BLOCK_K must be 64 or 128");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be in 2..4");

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// The block's shared memory: dynamic on the GPU (SMEM_ALLOC bytes asked for at launch), a static array
// on the emulator; and how many bytes into it the first 1024-byte boundary lies (the 128-byte swizzle
// repeats every 1024 bytes of address, so every tile starts on such a boundary).
#ifdef FA_CPU_EMULATION
#define DECLARE_SMEM __shared__ __align__(1024) unsigned char smem_raw[SMEM_ALLOC]
#else
#define DECLARE_SMEM extern __shared__ __align__(1024) unsigned char smem_raw[]
#endif
__device__ __forceinline__ int pad_to_1024(saddr_t a) { return (int)((1024u - (saddr_bits(a) & 1023u)) & 1023u); }

// Where things are, from the aligned base.
__device__ __forceinline__ saddr_t bar_q(saddr_t base) { return sadd_bytes(base, BAR_OFFSET); }            // Q has landed
__device__ __forceinline__ saddr_t bar_full(saddr_t base, int s) { return sadd_bytes(base, BAR_OFFSET + 8 + 8 * s); }
__device__ __forceinline__ saddr_t bar_ready(saddr_t base, int s) {          // stage s's V is checked
    return sadd_bytes(base, BAR_OFFSET + 8 + 8 * STAGES + 8 * s);
}
__device__ __forceinline__ saddr_t bar_empty(saddr_t base, int s) {          // stage s is free again
    return sadd_bytes(base, BAR_OFFSET + 8 + 16 * STAGES + 8 * s);
}
__device__ __forceinline__ saddr_t k_tile(saddr_t base, int s) { return sadd_bytes(base, Q_BYTES + s * STAGE_BYTES); }
__device__ __forceinline__ saddr_t v_tile(saddr_t base, int s) { return sadd_bytes(base, Q_BYTES + s * STAGE_BYTES + KV_BYTES); }

// Thread 0 sets up the barriers: Q's and each stage's full (the producer's expect_tx), ready (the
// producer warp's lane 0) and empty (every consumer thread).
__device__ __forceinline__ void init_barriers(saddr_t base) {
    mbar_init(bar_q(base), 1);
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(bar_full(base, s), 1);
        mbar_init(bar_ready(base, s), 1);
        mbar_init(bar_empty(base, s), CONSUMER_THREADS);
    }
    mbar_fence_init();
}

// ---- the producer: warp 0's lane 0 issues every TMA copy, warp 1 checks each V tile -------------
// Two warps, so that neither waits for the other: the copies run up to STAGES tiles ahead of the
// consumers (tile j goes into stage j % STAGES once they have released tile j - STAGES), and the
// check of a tile starts as soon as it lands.
__device__ __forceinline__ void copy_tiles(const TmaDescriptor* tm_q, const TmaDescriptor* tm_k, const TmaDescriptor* tm_v,
                                           saddr_t base, int q_start, int bh, int n_tiles) {
    mbar_expect_tx(bar_q(base), Q_BYTES);
    for (int p = 0; p < PANELS; ++p)
        tma_load_3d(sadd_bytes(base, p * BLOCK_Q * 128), tm_q, 64 * p, q_start, bh, bar_q(base));
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int s = tile % STAGES;
        if (tile >= STAGES) mbar_wait(bar_empty(base, s), ((tile / STAGES) & 1) ^ 1);
        mbar_expect_tx(bar_full(base, s), STAGE_BYTES);
        for (int p = 0; p < PANELS; ++p) {
            tma_load_3d(sadd_bytes(k_tile(base, s), p * BLOCK_K * 128), tm_k, 64 * p, tile * BLOCK_K, bh, bar_full(base, s));
            tma_load_3d(sadd_bytes(v_tile(base, s), p * BLOCK_K * 128), tm_v, 64 * p, tile * BLOCK_K, bh, bar_full(base, s));
        }
    }
}

// inf/NaN in V: when a stage has landed, test every 16-byte chunk of its V tile (where a chunk sits
// does not matter), rewrite a bad one with zeros, leave the stage's flag for the consumers (they add
// the dropped terms back, step 7) and arrive on ready[s]. All 32 lanes of one warp.
__device__ __forceinline__ void check_v_tiles(saddr_t base, unsigned char* smem, volatile int* v_flags, int lane,
                                              int n_tiles) {
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int s = tile % STAGES;
        mbar_wait(bar_full(base, s), (tile / STAGES) & 1);
        bool bad = false;
        unsigned char* v_bytes = smem + Q_BYTES + s * STAGE_BYTES + KV_BYTES;
#pragma unroll 4
        for (int c = lane; c < KV_BYTES / 16; c += 32) {
            uint4* w = reinterpret_cast<uint4*>(v_bytes + 16 * c);
            const uint4 x = *w;
            if (chunk_non_finite(x)) {
                bad = true;
                *w = finite_part(x);
            }
        }
        if (bad) fence_proxy_async();            // the rewrite before wgmma reads it
        const bool any = __any_sync(0xffffffffu, bad);
        __syncwarp();                            // every lane's rewrite before lane 0's arrive
        if (lane == 0) {
            v_flags[s] = any;
            mbar_arrive(bar_ready(base, s));     // releases the rewrite and the flag to the consumers
        }
        __syncwarp();
    }
}

// ---- one block: its shared memory, its rows, its threads' jobs --------------------------------------

// The block's shared memory (from the 1024-byte aligned base), its first query row, its (batch, head) and
// how many key tiles it visits; thread 0 sets up the barriers before any thread goes on.
struct HopperBlock {
    saddr_t base;                                  // the aligned base, as wgmma and TMA address it
    unsigned char* smem;                           // the same, as a pointer
    volatile int* v_flags;                         // v_flags[s]: stage s's V held inf or NaN
    int q_start, bh, n_tiles;
};
__device__ __forceinline__ HopperBlock hopper_block(unsigned char* smem_raw, int n_q, int n_k, int causal) {
    HopperBlock b;
    const saddr_t raw_s = saddr(smem_raw);
    const int pad = pad_to_1024(raw_s);
    b.smem = smem_raw + pad;
    b.base = sadd_bytes(raw_s, pad);
    b.v_flags = reinterpret_cast<volatile int*>(b.smem + FLAG_OFFSET);
    b.q_start = blockIdx.x * BLOCK_Q;
    b.bh = blockIdx.y;
    b.n_tiles = tiles_to_visit(b.q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);
    if (threadIdx.x == 0) init_barriers(b.base);
    __syncthreads();
    return b;
}

// The thread's warpgroup (0: the producer, 1 and 2: the consumers), read from lane 0 of its warp: the same
// number, but one the compiler can tell is the same for the whole warp. So the branch between producer and
// consumers is not divergent, and what a consumer computes from warp-uniform values (the Q, K and V
// descriptors, the stage) can stay in the uniform registers wgmma reads its descriptors from, instead of
// being computed per thread and moved there (R2UR) for every product. (CUTLASS's canonical_warp_group_idx
// does the same.)
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0); }

// The producer warpgroup's jobs: thread 0 copies, warp 1 checks V, the other 64 threads have none.
// True for every thread of the producer warpgroup (the caller then returns), false for a consumer.
__device__ __forceinline__ bool produce(const HopperBlock& b, const TmaDescriptor* tm_q, const TmaDescriptor* tm_k,
                                        const TmaDescriptor* tm_v) {
    const int tid = threadIdx.x;
    if (warpgroup_index() != 0) return false;
    if (tid == 0) copy_tiles(tm_q, tm_k, tm_v, b.base, b.q_start, b.bh, b.n_tiles);
    else if (tid >= 32 && tid < 64) check_v_tiles(b.base, b.smem, b.v_flags, tid - 32, b.n_tiles);
    return true;
}

// A consumer thread's place: its warpgroup (rows wg * 64 .. + 63 of the block), its fragment
// coordinates g = lane / 4, t = lane % 4 (hopper.cuh), its warp's first row and its two rows row_g, row_g + 8.
struct ConsumerThread {
    int wg, g, t, warp_q0, row_g;
};
__device__ __forceinline__ ConsumerThread consumer_thread(const HopperBlock& b) {
    const int ctid = threadIdx.x - 128;            // 0 .. 255
    const int lane = threadIdx.x % 32;
    ConsumerThread c;
    c.wg = warpgroup_index() - 1;
    c.g = lane / 4;
    c.t = lane % 4;
    c.warp_q0 = b.q_start + c.wg * 64 + ((ctid % 128) / 32) * 16;
    c.row_g = c.warp_q0 + c.g;
    return c;
}

// ---- the consumers' steps (numbered as in flash_attention_mma_fa2.cu) --------------------------

// 3. issue S = Q K^T for the K tile at k_s: D_STEPS products of 64 x BLOCK_K x 16; A = warpgroup wg's 64 rows
//    of Q, B = the K tile, both K-major in shared memory; a 16-wide step is 32 bytes into a 64-column
//    panel. The descriptors are built once (q_desc: once per kernel, q_descriptor; the K tile's: once per
//    tile) and stepped by desc_add (hopper.cuh), constant offsets. Asynchronous: the caller commits, and
//    waits before it reads sacc.
__device__ __forceinline__ gmma_desc_t q_descriptor(saddr_t base, int wg) {
    return desc_k_major(sadd_bytes(base, wg * 64 * 128));
}
__device__ __forceinline__ void issue_qk(float* sacc, gmma_desc_t q_desc, saddr_t k_s) {
    const gmma_desc_t k_desc = desc_k_major(k_s);
#pragma unroll
    for (int ds = 0; ds < D_STEPS; ++ds) {
        const gmma_desc_t a = desc_add(q_desc, (ds / 4) * BLOCK_Q * 128 + (ds % 4) * 32);
        const gmma_desc_t b = desc_add(k_desc, (ds / 4) * BLOCK_K * 128 + (ds % 4) * 32);
        wgmma_ss<BLOCK_K>(sacc, a, b, ds > 0);
    }
}

// 4-5. The online-softmax step of one tile for this thread's two rows, in base 2. Scales S into log2
//    units and masks it (MASK: a tile that reaches past n_k or past the warp's first row's causal
//    diagonal); then m2 moves to the new max, shift[h] = m_old - m_new (alpha = 2^shift, computed by
//    rescale_l_o), and sacc is overwritten with P = 2^(S - m_new) (float32; a masked key gets 0);
//    row_sum[h] is this thread's part of the rows' sum of P (rescale_l_o folds it into l). Touches
//    neither o nor the 16-bit P (pack_p does that).
//    The lazy rescale (flash_attention_mma_fa2.cu's LAZY_RESCALE, one step further): returns false when no
//    row of the warp moved its max; then alpha = 1 and rescale_l_o computes no alpha and multiplies nothing.
__device__ __forceinline__ bool tile_needs_mask(int k_start, int warp_q0, int n_q, int n_k, int causal) {
    return k_start + BLOCK_K > n_k || (causal && k_start + BLOCK_K - 1 > warp_q0 + n_k - n_q);
}
// S in log2 units, masked (MASK) where a key lies past n_k or past the row's causal diagonal; and the max
// of each of the thread's two rows over its scores
template <bool MASK>
__device__ __forceinline__ void scale_and_mask(float* sacc, float* tile_max, int k_start, int row_g, int t, int n_q,
                                               int n_k, int causal, float scale_log2) {
    tile_max[0] = tile_max[1] = NEG_INF;
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h = i / 2;
            float x = sacc[4 * n + i] * scale_log2;
            if (MASK) {
                const int key = k_start + n * 8 + 2 * t + i % 2;
                if (key >= n_k || (causal && key > (row_g + 8 * h) + n_k - n_q)) x = NEG_INF;
            }
            sacc[4 * n + i] = x;
            tile_max[h] = fmaxf(tile_max[h], x);
        }
}
// Two copies of the scale-and-mask, picked per tile (the test is the same for the warp's 32 threads): most
// tiles need no mask, and their copy has no mask code at all (in one copy with a run-time test ptxas
// predicates the mask instead: an integer compare and a select per score in every tile).
__device__ __forceinline__ bool softmax_step(float* sacc, float* m2, float* shift, float* row_sum,
                                             int k_start, int warp_q0, int row_g, int t, int n_q, int n_k,
                                             int causal, float scale_log2) {
    float tile_max[2];
    if (tile_needs_mask(k_start, warp_q0, n_q, n_k, causal))
        scale_and_mask<true>(sacc, tile_max, k_start, row_g, t, n_q, n_k, causal, scale_log2);
    else
        scale_and_mask<false>(sacc, tile_max, k_start, row_g, t, n_q, n_k, causal, scale_log2);
    float m_safe[2];
    bool moved = false;                          // does one of this thread's rows need its alpha?
#pragma unroll
    for (int h = 0; h < 2; ++h) {                // a row's 4 lanes form a quad
        const float m_new = fmaxf(m2[h], group_max<4>(tile_max[h]));
        m_safe[h] = safe_max(m_new);
        shift[h] = m2[h] - m_safe[h];            // alpha = 2^shift
        // shift is exactly 0 only when the row had a finite max and this tile did not raise it; then
        // alpha = 2^0 = 1 exactly, and l * 1 and o * 1 are l and o bit for bit: the multiplies can go.
        // Any other shift needs its alpha: negative (the max moved up: o and l shrink), -inf (the row
        // saw nothing before: alpha = 2^(-inf - 0) = 0, also for a row that still sees nothing, as the
        // NumPy fold has it) or NaN (an inf score, max inf before and after: alpha = NaN, as before).
        // (x != 0 is true for NaN.)
        moved |= shift[h] != 0.f;
        m2[h] = m_new;
        row_sum[h] = 0.f;
    }
    // One answer for the whole warp (its 16 rows): if the lanes decided alone, some would rescale and
    // others not, and the warp would run both sides of the branch one after the other. With the vote
    // it takes one side: when no row moved, no ex2 for alpha and no multiplies of l and o; when one
    // row moved, every row computes its alpha (a row that did not move gets 2^0 = 1: its o unchanged).
    const bool rescale = __any_sync(0xffffffffu, moved);
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float p0 = fast_exp2(sacc[4 * n + 2 * h] - m_safe[h]);      // masked: 2^-inf = 0
            const float p1 = fast_exp2(sacc[4 * n + 2 * h + 1] - m_safe[h]);
            row_sum[h] += p0 + p1;
            sacc[4 * n + 2 * h] = p0;
            sacc[4 * n + 2 * h + 1] = p1;
        }
    return rescale;
}

// P rounded to 16 bits, two keys per word: the A fragment of O += P V (hopper.cuh)
__device__ __forceinline__ void pack_p(const float* p, unsigned (*p16)[2]) {
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) p16[n][h] = pack_float2(p[4 * n + 2 * h], p[4 * n + 2 * h + 1]);
}

// alpha = 2^shift, l = alpha l + (the row's sum of P over its quad), o = alpha o (each row by its own
// alpha; WITH_O false: o is still 0, nothing to rescale). When the warp does not rescale (softmax_step's
// answer, the same for all its lanes) every shift is 0 and alpha is 1: l + sum is 1 * l + sum to the bit,
// o * 1 is o, and the branch skips the two ex2 and the 2 + 4 * O_TILES multiplies. (The ex2 sit in the
// same branch as o's multiplies: alone, ptxas would predicate them instead, and still issue them.)
template <bool WITH_O>
__device__ __forceinline__ void rescale_l_o(float* l, float* o, float* alpha, const float* shift, const float* row_sum,
                                            bool rescale) {
    float sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) sum[h] = group_sum<4>(row_sum[h]);
    if (rescale) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            alpha[h] = fast_exp2(shift[h]);
            l[h] = alpha[h] * l[h] + sum[h];
        }
        if (WITH_O)
#pragma unroll
            for (int i = 0; i < O_TILES * 4; ++i) o[i] *= alpha[(i % 4) / 2];
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            alpha[h] = 1.f;                      // 2^0, as the trace records it
            l[h] += sum[h];
        }
    }
}

// (for step 7, only when V held inf or NaN) bit 2n + e of p_zero_bits[h] is set when key 8n + 2t + e
// of row (row_g + 8 h) has p = 0 as rounded for the product
__device__ __forceinline__ void zero_bits(const unsigned (*p16)[2], unsigned* p_zero_bits) {
    p_zero_bits[0] = p_zero_bits[1] = 0u;
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if ((p16[n][h] & 0xffffu) == 0u) p_zero_bits[h] |= 1u << (2 * n);
            if ((p16[n][h] >> 16) == 0u) p_zero_bits[h] |= 1u << (2 * n + 1);
        }
}

// 6. issue o += P V for the V tile at v_s: KEY_STEPS products of 64 x HEAD_DIM x 16. A = P from
//    registers (the S accumulator of 16 keys is the A fragment of one step), B = 16 rows of V, MN-major:
//    16 rows are 2048 bytes on (one desc_add from the tile's descriptor); a second 64-column panel is one
//    panel (BLOCK_K rows) on, the LBO. Asynchronous: until the wait that covers it, neither o nor p16 may
//    be touched.
__device__ __forceinline__ void issue_pv(float* o, const unsigned (*p16)[2], saddr_t v_s) {
    const gmma_desc_t v_desc = desc_mn_major(v_s, BLOCK_K * 128);
#pragma unroll
    for (int ks = 0; ks < KEY_STEPS; ++ks) {
        const unsigned p_frag[4] = {p16[2 * ks][0], p16[2 * ks][1], p16[2 * ks + 1][0], p16[2 * ks + 1][1]};
        wgmma_rs_tb<HEAD_DIM>(o, p_frag, desc_add(v_desc, ks * 16 * 128), 1);
    }
}

// keep the compiler from moving reads or writes of registers across a wgmma issue or wait
__device__ __forceinline__ void fence_o(float* o) {
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) fence_operand(o[i]);
}
__device__ __forceinline__ void fence_s(float* sacc) {
#pragma unroll
    for (int i = 0; i < S_TILES * 4; ++i) fence_operand(sacc[i]);
}
__device__ __forceinline__ void fence_p(unsigned (*p16)[2]) {
#pragma unroll
    for (int n = 0; n < S_TILES; ++n) {
        fence_operand(p16[n][0]);
        fence_operand(p16[n][1]);
    }
}

// 7. (only for a tile whose V held inf or NaN; the same for both consumers) the terms p * v that
//    step 6 left out: for v = inf or NaN and p > 0, p * v is v itself. Key j's p of rows g, g + 8 is
//    in lane 4g + (j % 8) / 2, which passes its p_zero bits by a shuffle
__device__ __forceinline__ void add_back_non_finite_v(float* o, const unsigned* p_zero_bits, const scalar_t* v_bh,
                                                      int k_start, int n_k, int g, int t) {
    const int n_keys = min(BLOCK_K, n_k - k_start);
#pragma unroll 1
    for (int j = 0; j < n_keys; ++j) {
        bool adds[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned bits = __shfl_sync(0xffffffffu, p_zero_bits[h], 4 * g + (j % 8) / 2);
            adds[h] = !((bits >> (2 * (j / 8) + j % 2)) & 1u);
        }
        if (!adds[0] && !adds[1]) continue;
        const scalar_t* v_row = v_bh + (long long)(k_start + j) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const scalar_t x = v_row[n * 8 + e];
                if (!non_finite(x)) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (adds[h]) o[4 * n + 2 * h + e] += to_float(x);
            }
    }
}

// The trace: which of the traced rows (if any) this thread's two rows are, and a record of (m, alpha,
// l) after a tile. trace: (batch*heads, n_trace_rows, trace_tiles, 3).
__device__ __forceinline__ void find_trace_slots(int* slot, const int* trace_rows, int n_trace_rows, int row_g, int n_q) {
    slot[0] = slot[1] = -1;
    for (int h = 0; h < 2; ++h)
        if ((row_g + 8 * h) < n_q)
            for (int i = 0; i < n_trace_rows; ++i)
                if (trace_rows[i] == (row_g + 8 * h)) slot[h] = i;
}
__device__ __forceinline__ void record_trace(float* trace, const int* slot, int bh, int n_trace_rows, int trace_tiles,
                                             int tile, int t, const float* m2, const float* alpha, const float* l) {
    if (t != 0) return;
    for (int h = 0; h < 2; ++h)
        if (slot[h] >= 0) {
            float* rec = trace + (((long long)bh * n_trace_rows + slot[h]) * trace_tiles + tile) * TRACE_FIELDS;
            rec[0] = m2[h] * LN2; rec[1] = alpha[h]; rec[2] = l[h];
        }
}

// ---- finalize: one reciprocal per row; 32-bit stores; rows past n_q write nothing --------------
__device__ __forceinline__ void write_output(const float* o, const float* m2, const float* l, scalar_t* out, float* lse,
                                             int bh, int row_g, int t, int n_q) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if ((row_g + 8 * h) >= n_q) continue;
        const bool seen = l[h] != 0.f;               // false: nothing visible -> 0, lse -inf
        const float inv_l = seen ? 1.f / l[h] : 0.f;
        unsigned* out_row = reinterpret_cast<unsigned*>(out + ((long long)bh * n_q + (row_g + 8 * h)) * HEAD_DIM);
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
            out_row[n * 4 + t] = pack_float2(o[4 * n + 2 * h] * inv_l, o[4 * n + 2 * h + 1] * inv_l);
        if (t == 0) lse[(long long)bh * n_q + (row_g + 8 * h)] = seen ? (m2[h] + log2f(l[h])) * LN2 : NEG_INF;
    }
}
