// flash_attention_wgmma.cu - the Hopper rung: TMA, mbarriers and wgmma, a producer and two consumers.
//
// The fold is flash_attention_mma_fa2.cu's (read it first): the same online softmax in base 2,
// the same masking, the same NaN rule for V. What changes is who moves the data and who multiplies
// (FlashAttention-3, Shah et al. 2024, Sec. 3.1; the instructions are in kernels/hopper.cuh):
//
//   * Warp specialisation. A block is 3 warpgroups (384 threads). Warpgroup 0 is the producer: its
//     first warp issues every copy (one thread) and checks each V tile for inf/NaN as it lands (all
//     32), the other 96 threads leave at once. Warpgroups 1 and 2 are the consumers: each owns 64
//     of the block's 128 query rows and does all the arithmetic; they never wait for each other.
//   * TMA. The producer copies the Q tile once and each K and V tile with cp.async.bulk.tensor:
//     one instruction per 64-column panel of a tile, no registers, no per-thread addresses; the
//     copy engine zero-fills rows past n_q or n_k and writes the 128-byte swizzle itself.
//   * A pipeline of STAGES (2) K/V stages handed over by mbarriers: full[s] completes when the
//     copy's bytes have landed (expect_tx, complete_tx), ready[s] when the producer warp has checked
//     that stage's V, empty[s] when all 256 consumer threads are done with the stage. While the
//     consumers work on tile j, tile j + 1 is loading and then being checked.
//   * wgmma. S = Q K_j^T is HEAD_DIM / 16 instructions of 64 x BLOCK_K x 16 per warpgroup, both
//     operands read from shared memory through descriptors (no ldmatrix, no B fragments in
//     registers). O += P V_j is BLOCK_K / 16 instructions of 64 x HEAD_DIM x 16 with P in
//     registers (the S accumulator, rounded to 16 bits: its layout is the A fragment's) and V
//     read from shared memory as an MN-major operand (imm-trans-b).
//   Not here yet (FlashAttention-3's next steps): the two consumers' softmax and products are not
//   ping-ponged, softmax does not overlap the next tile's Q K^T, and registers are not moved from
//   the producer to the consumers (setmaxnreg).
//
// Shared memory (dynamic, from a 1024-byte aligned base): the Q tile (BLOCK_Q x HEAD_DIM),
// STAGES x [K tile | V tile] (BLOCK_K x HEAD_DIM each), then the mbarriers and one flag per stage
// (its V held inf or NaN). Every tile is stored as HEAD_DIM / 64 panels of rows of 64 values,
// 128-byte swizzled (hopper.cuh).
//
// NaN rule and empty rows as flash_attention_mma_fa2.cu: the producer warp tests every 16-byte
// chunk of a stage's V tile when it lands and rewrites a chunk holding inf or NaN with zeros (then
// fence.proxy.async, since wgmma reads shared memory through the async proxy), and leaves a flag
// for the consumers; for a flagged tile each consumer adds the terms p * v left out, from global
// memory, for keys its rows give p > 0. A row that sees nothing gives 0 and lse -inf. (Checking V in
// the producer, not in the consumers, spares the two consumer warpgroups a barrier per tile: they
// run out of step, so one's softmax can overlap the other's products.)
//
// Launch: grid = (ceil(n_q / BLOCK_Q), batch * heads), block = 384 threads, dynamic shared memory
// SMEM_ALLOC bytes. Tensor maps (3-D: HEAD_DIM, rows, batch * heads; boxes of 64 x BLOCK_Q or
// 64 x BLOCK_K x 1; 128-byte swizzle): made by lessons.gpu.hopper. Defines: HEAD_DIM (64 or 128),
// BLOCK_K (64 or 128), FA_DTYPE 1 or 2, FA_TRACE. sm_90a only (wgmma exists on no other architecture).
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
#define BLOCK_Q 128                     // 2 consumer warpgroups x 64 rows
#define STAGES 2
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

// q, k, v: (batch*heads, n, HEAD_DIM), 16-bit, C-contiguous, read through the tensor maps tm_q,
// tm_k, tm_v; v also directly (the NaN rule's step 7). out: like q; lse: (batch*heads, n_q) float32.
// causal != 0: query i sees key j iff j <= i + n_k - n_q (bottom-right aligned).
// Trace: trace_rows (n_trace_rows,) query rows; trace (batch*heads, n_trace_rows, trace_tiles, 3).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_attention_wgmma(const __grid_constant__ TmaDescriptor tm_q, const __grid_constant__ TmaDescriptor tm_k,
                      const __grid_constant__ TmaDescriptor tm_v, const scalar_t* __restrict__ v,
                      scalar_t* __restrict__ out, float* __restrict__ lse, int n_q, int n_k, float scale,
                      int causal, const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                      float* __restrict__ trace) {
    DECLARE_SMEM;
    const saddr_t raw_s = saddr(smem_raw);
    const int pad = pad_to_1024(raw_s);
    unsigned char* smem = smem_raw + pad;
    const saddr_t base = sadd_bytes(raw_s, pad);
    const saddr_t bar_q = sadd_bytes(base, BAR_OFFSET);              // Q has landed
#define FULL(s) sadd_bytes(base, BAR_OFFSET + 8 + 8 * (s))           // stage s has landed
#define READY(s) sadd_bytes(base, BAR_OFFSET + 8 + 8 * STAGES + 8 * (s))   // stage s's V is checked
#define EMPTY(s) sadd_bytes(base, BAR_OFFSET + 8 + 16 * STAGES + 8 * (s))  // stage s is free again
    volatile int* v_flags = reinterpret_cast<volatile int*>(smem + FLAG_OFFSET);   // stage s's V held inf/NaN
#define K_TILE(s) sadd_bytes(base, Q_BYTES + (s) * STAGE_BYTES)
#define V_TILE(s) sadd_bytes(base, Q_BYTES + (s) * STAGE_BYTES + KV_BYTES)

    const int tid = threadIdx.x;
    const int q_start = blockIdx.x * BLOCK_Q;
    const int bh = blockIdx.y;
    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);

    if (tid == 0) {
        mbar_init(bar_q, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(FULL(s), 1);                                     // the producer's expect_tx
            mbar_init(READY(s), 1);                                    // the producer warp's lane 0
            mbar_init(EMPTY(s), CONSUMER_THREADS);                     // every consumer thread
        }
        mbar_fence_init();
    }
    __syncthreads();

    // ---- the producer warp: lane 0 issues every TMA copy; all 32 check each V tile ---------------
    if (tid < 128) {
        if (tid >= 32) return;
        const int lane = tid;
        // start copying tile `tile` into its stage, once the consumers are done with what it held
        auto load = [&](int tile) {
            const int s = tile % STAGES;
            if (tile >= STAGES) mbar_wait(EMPTY(s), ((tile / STAGES) & 1) ^ 1);
            mbar_expect_tx(FULL(s), STAGE_BYTES);
            for (int p = 0; p < PANELS; ++p) {
                tma_load_3d(sadd_bytes(K_TILE(s), p * BLOCK_K * 128), &tm_k, 64 * p, tile * BLOCK_K, bh, FULL(s));
                tma_load_3d(sadd_bytes(V_TILE(s), p * BLOCK_K * 128), &tm_v, 64 * p, tile * BLOCK_K, bh, FULL(s));
            }
        };
        if (lane == 0) {
            mbar_expect_tx(bar_q, Q_BYTES);
            for (int p = 0; p < PANELS; ++p)
                tma_load_3d(sadd_bytes(base, p * BLOCK_Q * 128), &tm_q, 64 * p, q_start, bh, bar_q);
            if (n_tiles > 0) load(0);
        }
        for (int tile = 0; tile < n_tiles; ++tile) {
            const int s = tile % STAGES;
            mbar_wait(FULL(s), (tile / STAGES) & 1);
            // inf/NaN in V: test every 16-byte chunk of the stage's V tile (where a chunk sits does not
            // matter), rewrite a bad one with zeros; the consumers add the dropped terms back (step 7)
            bool bad = false;
            unsigned char* v_tile = smem + Q_BYTES + s * STAGE_BYTES + KV_BYTES;
#pragma unroll 4
            for (int c = lane; c < KV_BYTES / 16; c += 32) {
                uint4* w = reinterpret_cast<uint4*>(v_tile + 16 * c);
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
                mbar_arrive(READY(s));               // releases the rewrite and the flag to the consumers
                if (tile + 1 < n_tiles) load(tile + 1);
            }
            __syncwarp();
        }
        return;
    }

    // ---- the consumers -----------------------------------------------------------------------
    const int ctid = tid - 128;                      // 0 .. 255
    const int wg = ctid / 128;                       // this warpgroup's rows: wg * 64 .. + 63 of the block
    const int warp = (ctid % 128) / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;            // fragment coordinates (hopper.cuh)
    const int warp_q0 = q_start + wg * 64 + warp * 16;
    const int row_g = warp_q0 + g;                   // this lane's two query rows: row_g, row_g + 8
    const float scale_log2 = scale * LOG2E;
    const scalar_t* v_bh = v + (long long)bh * n_k * HEAD_DIM;

#ifdef FA_TRACE
    int trace_slot[2] = {-1, -1};
    for (int h = 0; h < 2; ++h)
        if ((row_g + 8 * h) < n_q)
            for (int i = 0; i < n_trace_rows; ++i)
                if (trace_rows[i] == (row_g + 8 * h)) trace_slot[h] = i;
#endif

    float m2[2] = {NEG_INF, NEG_INF};                // in log2 units
    float l[2] = {0.f, 0.f};
    float o[O_TILES * 4];                            // o[4n + i]: row row_g + 8 * (i / 2), column 8n + 2t + i % 2
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) o[i] = 0.f;

    mbar_wait(bar_q, 0);
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;
        const int s = tile % STAGES;
        // 1-2. K_j and V_j have landed, and the producer warp has checked V_j (and zeroed any inf/NaN)
        mbar_wait(READY(s), (tile / STAGES) & 1);
        const bool tile_has_non_finite_v = v_flags[s] != 0;

        // 3. S = Q K_j^T: D_STEPS products of 64 x BLOCK_K x 16; A = this warpgroup's 64 rows of Q,
        //    B = K_j, both K-major in shared memory; a 16-wide step is 32 bytes into a 64-column panel
        float sacc[S_TILES * 4];                     // sacc[4n + i]: row row_g + 8 * (i / 2), key 8n + 2t + i % 2
        wgmma_fence();
#pragma unroll
        for (int ds = 0; ds < D_STEPS; ++ds) {
            const gmma_desc_t a = desc_k_major(sadd_bytes(base, (ds / 4) * BLOCK_Q * 128 + wg * 64 * 128 + (ds % 4) * 32));
            const gmma_desc_t b = desc_k_major(sadd_bytes(K_TILE(s), (ds / 4) * BLOCK_K * 128 + (ds % 4) * 32));
            wgmma_ss<BLOCK_K>(sacc, a, b, ds > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < S_TILES * 4; ++i) fence_operand(sacc[i]);

        // 4. scale into log2 units; mask only in a tile that reaches past n_k or past this warp's
        //    first row's causal diagonal
        const bool needs_mask = k_start + BLOCK_K > n_k ||
                                (causal && k_start + BLOCK_K - 1 > warp_q0 + n_k - n_q);
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i / 2;
                float x = sacc[4 * n + i] * scale_log2;
                if (needs_mask) {
                    const int key = k_start + n * 8 + 2 * t + i % 2;
                    if (key >= n_k || (causal && key > (row_g + 8 * h) + n_k - n_q)) x = NEG_INF;
                }
                sacc[4 * n + i] = x;
                tile_max[h] = fmaxf(tile_max[h], x);
            }

        // 5. the online-softmax step for both rows (a row's 4 lanes form a quad), in base 2;
        //    p16[n][h]: keys 8n + 2t, 8n + 2t + 1 of row (row_g + 8 h), rounded to 16 bits
        float alpha[2], m_safe[2], row_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m2[h], group_max<4>(tile_max[h]));
            m_safe[h] = safe_max(m_new);
            alpha[h] = fast_exp2(m2[h] - m_safe[h]);
            m2[h] = m_new;
        }
        unsigned p16[S_TILES][2];
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float p0 = fast_exp2(sacc[4 * n + 2 * h] - m_safe[h]);      // masked: 2^-inf = 0
                const float p1 = fast_exp2(sacc[4 * n + 2 * h + 1] - m_safe[h]);
                row_sum[h] += p0 + p1;
                p16[n][h] = pack_float2(p0, p1);
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = alpha[h] * l[h] + group_sum<4>(row_sum[h]);
#pragma unroll
        for (int i = 0; i < O_TILES * 4; ++i) o[i] *= alpha[(i % 4) / 2];

        // (for step 7, only when V held inf or NaN: bit 2n + e of p_zero_bits[h] is set when key
        //  8n + 2t + e of row (row_g + 8 h) has p = 0 as rounded for the product)
        unsigned p_zero_bits[2] = {0u, 0u};
        if (tile_has_non_finite_v)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if ((p16[n][h] & 0xffffu) == 0u) p_zero_bits[h] |= 1u << (2 * n);
                    if ((p16[n][h] >> 16) == 0u) p_zero_bits[h] |= 1u << (2 * n + 1);
                }

        // 6. o += P V_j: KEY_STEPS products of 64 x HEAD_DIM x 16. A = P from registers (the S
        //    accumulator of 16 keys is the A fragment of one step), B = 16 rows of V_j, MN-major:
        //    16 rows are 2048 bytes on; a second 64-column panel is one panel (BLOCK_K rows) on
#pragma unroll
        for (int i = 0; i < O_TILES * 4; ++i) fence_operand(o[i]);   // the rescale stays before the products
        wgmma_fence();                               // o was rescaled and P written by ordinary code
#pragma unroll
        for (int ks = 0; ks < KEY_STEPS; ++ks) {
            const unsigned p_frag[4] = {p16[2 * ks][0], p16[2 * ks][1], p16[2 * ks + 1][0], p16[2 * ks + 1][1]};
            wgmma_rs_tb<HEAD_DIM>(o, p_frag, desc_mn_major(sadd_bytes(V_TILE(s), ks * 16 * 128), BLOCK_K * 128), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < O_TILES * 4; ++i) fence_operand(o[i]);

        // 7. (only for a tile whose V held inf or NaN; the same for both consumers) the terms
        //    p * v that step 6 left out: for v = inf or NaN and p > 0, p * v is v itself. Key j's p
        //    of rows g, g + 8 is in lane 4g + (j % 8) / 2, which passes its p_zero bits by a shuffle
        if (tile_has_non_finite_v) {
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

#ifdef FA_TRACE
        if (t == 0)
            for (int h = 0; h < 2; ++h)
                if (trace_slot[h] >= 0) {
                    float* rec = trace + (((long long)bh * n_trace_rows + trace_slot[h]) * trace_tiles + tile) * TRACE_FIELDS;
                    rec[0] = m2[h] * LN2; rec[1] = alpha[h]; rec[2] = l[h];
                }
#endif
        mbar_arrive(EMPTY(s));                       // this thread is done with stage s
    }

    // ---- finalize: one reciprocal per row; 32-bit stores; rows past n_q write nothing --------
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
#undef FULL
#undef READY
#undef EMPTY
#undef K_TILE
#undef V_TILE
}

// ---- a probe of the two products alone, for checking the layouts on a GPU -------------------
// One block. The producer's thread 0 copies A (64 rows x HEAD_DIM), B (BLOCK_K rows x HEAD_DIM)
// and V (BLOCK_K rows x HEAD_DIM) by TMA exactly as the kernel copies Q, K and V; consumer
// warpgroup 1 (threads 128..255) computes S = A B^T with the kernel's descriptors (wgmma_ss),
// rounds S to 16 bits as the kernel rounds P, and computes O = S16 V (wgmma_rs_tb). It writes
// s (64 x BLOCK_K) and o (64 x HEAD_DIM), float32, row-major, through the accumulator layout.
// If s is right and o wrong, the MN-major (V) descriptor is at fault; if s is wrong, TMA's
// swizzle or the K-major descriptor.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
wgmma_probe(const __grid_constant__ TmaDescriptor tm_a, const __grid_constant__ TmaDescriptor tm_b,
            const __grid_constant__ TmaDescriptor tm_v, float* __restrict__ s_out, float* __restrict__ o_out) {
    DECLARE_SMEM;
    const saddr_t raw_s = saddr(smem_raw);
    const int pad = pad_to_1024(raw_s);
    const saddr_t base = sadd_bytes(raw_s, pad);                     // A as the Q tile (64 of its 128 rows)
    const saddr_t b_s = sadd_bytes(base, Q_BYTES), v_s = sadd_bytes(base, Q_BYTES + KV_BYTES);
    const saddr_t bar = sadd_bytes(base, BAR_OFFSET);
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (tid == 0) {
        mbar_expect_tx(bar, Q_BYTES + 2 * KV_BYTES);
        for (int p = 0; p < PANELS; ++p) {
            tma_load_3d(sadd_bytes(base, p * BLOCK_Q * 128), &tm_a, 64 * p, 0, 0, bar);   // rows past 64: zeros
            tma_load_3d(sadd_bytes(b_s, p * BLOCK_K * 128), &tm_b, 64 * p, 0, 0, bar);
            tma_load_3d(sadd_bytes(v_s, p * BLOCK_K * 128), &tm_v, 64 * p, 0, 0, bar);
        }
    }
    if (tid < 128 || tid >= 256) return;
    const int warp = (tid - 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    mbar_wait(bar, 0);
    float sacc[S_TILES * 4], o[O_TILES * 4];
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) o[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int ds = 0; ds < D_STEPS; ++ds)
        wgmma_ss<BLOCK_K>(sacc, desc_k_major(sadd_bytes(base, (ds / 4) * BLOCK_Q * 128 + (ds % 4) * 32)),
                          desc_k_major(sadd_bytes(b_s, (ds / 4) * BLOCK_K * 128 + (ds % 4) * 32)), ds > 0);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < S_TILES * 4; ++i) fence_operand(sacc[i]);
    unsigned p16[S_TILES][2];
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) p16[n][h] = pack_float2(sacc[4 * n + 2 * h], sacc[4 * n + 2 * h + 1]);
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) fence_operand(o[i]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KEY_STEPS; ++ks) {
        const unsigned p_frag[4] = {p16[2 * ks][0], p16[2 * ks][1], p16[2 * ks + 1][0], p16[2 * ks + 1][1]};
        wgmma_rs_tb<HEAD_DIM>(o, p_frag, desc_mn_major(sadd_bytes(v_s, ks * 16 * 128), BLOCK_K * 128), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) fence_operand(o[i]);
    const int row = warp * 16 + g;
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s_out[(row + 8 * (i / 2)) * BLOCK_K + 8 * n + 2 * t + i % 2] = sacc[4 * n + i];
#pragma unroll
    for (int n = 0; n < O_TILES; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o_out[(row + 8 * (i / 2)) * HEAD_DIM + 8 * n + 2 * t + i % 2] = o[4 * n + i];
}
