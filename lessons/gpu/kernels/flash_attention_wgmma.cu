// flash_attention_wgmma.cu - the Hopper rung: TMA, mbarriers and wgmma, a producer and two consumers.
//
// The fold is flash_attention_mma_fa2.cu's (read it first): the same online softmax in base 2,
// the same masking, the same NaN rule for V. What changes is who moves the data and who multiplies
// (FlashAttention-3, Shah et al. 2024, Sec. 3.1; the instructions are in kernels/hopper.cuh):
//
//   * Warp specialisation. A block is 3 warpgroups (384 threads). Warpgroup 0 is the producer: one
//     thread of its warp 0 issues every copy, its warp 1 checks each V tile for inf/NaN as it lands,
//     the other 64 threads leave at once. Warpgroups 1 and 2 are the consumers: each owns 64 of the
//     block's 128 query rows and does all the arithmetic; they never wait for each other.
//   * TMA. The producer copies the Q tile once and each K and V tile with cp.async.bulk.tensor:
//     one instruction per 64-column panel of a tile, no registers, no per-thread addresses; the
//     copy engine zero-fills rows past n_q or n_k and writes the 128-byte swizzle itself.
//   * A pipeline of STAGES (2) K/V stages handed over by mbarriers: full[s] completes when the
//     copy's bytes have landed (expect_tx, complete_tx), ready[s] when the checking warp has checked
//     that stage's V, empty[s] when all 256 consumer threads are done with the stage. A consumer
//     waits for full[s] before S = Q K_j^T and for ready[s] only before O += P V_j, so the check of
//     V_j runs beside Q K_j^T. While the consumers work on tile j, tile j + 1 is loading.
//   * wgmma. S = Q K_j^T is HEAD_DIM / 16 instructions of 64 x BLOCK_K x 16 per warpgroup, both
//     operands read from shared memory through descriptors (no ldmatrix, no B fragments in
//     registers). O += P V_j is BLOCK_K / 16 instructions of 64 x HEAD_DIM x 16 with P in
//     registers (the S accumulator, rounded to 16 bits: its layout is the A fragment's) and V
//     read from shared memory as an MN-major operand (imm-trans-b).
//   Each consumer does its steps one after the other: while it computes softmax its tensor cores
//   idle. flash_attention_wgmma_overlap.cu, the next rung, reorders the same steps so they do not.
//
// The block's shared memory, the producer and the steps are in wgmma_forward.cuh.
//
// The lazy rescale of flash_attention_mma_fa2_lazy, one step further: a warp whose 16 rows all kept their max
// over a tile skips alpha's ex2 as well as the multiplies of l and o by alpha (softmax_step, rescale_l_o in
// wgmma_forward.cuh). Skipping a multiply by 2^0 = 1 changes no bit: the output is the eager fold's.
//
// NaN rule and empty rows as flash_attention_mma_fa2.cu: the checking warp tests every 16-byte
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
// BLOCK_K (64 or 128), STAGES (2), FA_DTYPE 1 or 2, FA_TRACE. sm_90a only (wgmma exists on no other
// architecture).
#include "wgmma_forward.cuh"

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
    const HopperBlock blk = hopper_block(smem_raw, n_q, n_k, causal);
    if (produce(blk, &tm_q, &tm_k, &tm_v)) return;      // the producer warpgroup (wgmma_forward.cuh)

    // ---- the consumers ---------------------------------------------------------------------------
    const ConsumerThread me = consumer_thread(blk);
    const saddr_t base = blk.base;
    volatile int* v_flags = blk.v_flags;
    const int bh = blk.bh, n_tiles = blk.n_tiles;
    const int wg = me.wg, g = me.g, t = me.t, warp_q0 = me.warp_q0, row_g = me.row_g;
    const float scale_log2 = scale * LOG2E;
    const scalar_t* v_bh = v + (long long)bh * n_k * HEAD_DIM;
    const gmma_desc_t q_desc = q_descriptor(base, wg);    // this warpgroup's 64 rows of Q, built once
#ifdef FA_TRACE
    int trace_slot[2];
    find_trace_slots(trace_slot, trace_rows, n_trace_rows, row_g, n_q);
#endif

    float m2[2] = {NEG_INF, NEG_INF};                // in log2 units
    float l[2] = {0.f, 0.f};
    float o[O_TILES * 4];
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) o[i] = 0.f;

    mbar_wait(bar_q(base), 0);
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * BLOCK_K;
        const int s = tile % STAGES;
        // 1. K_j has landed (S_j needs nothing else; the checking warp may still be at V_j)
        mbar_wait(bar_full(base, s), (tile / STAGES) & 1);

        // 3. S = Q K_j^T, and wait for it
        float sacc[S_TILES * 4];
        wgmma_fence();
        issue_qk(sacc, q_desc, k_tile(base, s));
        wgmma_commit();
        wgmma_wait<0>();
        fence_s(sacc);

        // 4-5. mask, the online-softmax step, P (and in 16 bits); l and o rescaled, lazily: a warp none of
        //      whose 16 rows moved its max skips alpha and the multiplies (alpha would be 2^0 = 1)
        float shift[2], alpha[2], row_sum[2];
        unsigned p16[S_TILES][2];
        const bool rescale =             // false: no row of this warp moved its max (alpha = 1)
            softmax_step(sacc, m2, shift, row_sum, k_start, warp_q0, row_g, t, n_q, n_k, causal, scale_log2);
        pack_p(sacc, p16);
        rescale_l_o<true>(l, o, alpha, shift, row_sum, rescale);

        // 2. the checking warp is done with V_j (and zeroed any inf/NaN in it)
        mbar_wait(bar_ready(base, s), (tile / STAGES) & 1);
        const bool tile_has_non_finite_v = v_flags[s] != 0;
        unsigned p_zero_bits[2];
        if (tile_has_non_finite_v) zero_bits(p16, p_zero_bits);

        // 6. o += P V_j, and wait for it
        fence_o(o);                                  // the rescale stays before the products
        fence_p(p16);                                // and P's rounding too
        wgmma_fence();                               // o was rescaled and P written by ordinary code
        issue_pv(o, p16, v_tile(base, s));
        wgmma_commit();
        wgmma_wait<0>();
        fence_o(o);

        // 7. the terms p * v that step 6 left out (only for a tile whose V held inf or NaN)
        if (tile_has_non_finite_v) add_back_non_finite_v(o, p_zero_bits, v_bh, k_start, n_k, g, t);
#ifdef FA_TRACE
        record_trace(trace, trace_slot, bh, n_trace_rows, trace_tiles, tile, t, m2, alpha, l);
#endif
        mbar_arrive(bar_empty(base, s));             // this thread is done with stage s
    }
    write_output(o, m2, l, out, lse, bh, row_g, t, n_q);
}

// ---- a probe of the two products alone, for checking the layouts on a GPU -------------------
// One block. The producer's thread 0 copies A (64 rows x HEAD_DIM), B (BLOCK_K rows x HEAD_DIM)
// and V (BLOCK_K rows x HEAD_DIM) by TMA exactly as the kernel copies Q, K and V; consumer
// warpgroup 1 (threads 128..255) computes S = A B^T with the kernel's own step 3 (issue_qk: its
// descriptors, wgmma_ss), rounds S to 16 bits as the kernel rounds P, and computes O = S16 V with its
// step 6 (issue_pv, wgmma_rs_tb). It writes
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
    issue_qk(sacc, q_descriptor(base, 0), b_s);
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
    issue_pv(o, p16, v_s);
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
