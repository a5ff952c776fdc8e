// flash_attention_wgmma_overlap.cu - the Hopper rung with softmax overlapped with the products.
//
// Everything of flash_attention_wgmma.cu stays (read it first): the producer warpgroup, TMA, the
// mbarrier pipeline, the two consumer warpgroups of 64 query rows, wgmma, the fold and its NaN rule;
// the steps themselves are the same functions (wgmma_forward.cuh). What changes is their order in
// each consumer (FlashAttention-3, Shah et al. 2024, Sec. 3.2, "intra-warpgroup overlapping", Alg. 2).
//
// In flash_attention_wgmma.cu a consumer waits for S_j = Q K_j^T, does the softmax of tile j, then
// issues and waits for O += P_j V_j: while it computes exp2 and the row sums its tensor cores idle,
// and while they multiply it idles. wgmma is asynchronous, so a consumer can keep two products in
// flight and compute between them:
//
//     S_0 = Q K_0^T; wait; softmax(S_0) -> P_0
//     for j = 1 .. T - 1:
//         issue S_j = Q K_j^T                  (commit group 1)
//         issue O += P_{j-1} V_{j-1}           (commit group 2)
//         wait until at most 1 group is left:  S_j is done, P_{j-1} V_{j-1} may still run
//         softmax(S_j) -> P_j, m_j             (CUDA cores, while the tensor cores do P_{j-1} V_{j-1})
//         wait for all:                        P_{j-1} V_{j-1} is done; release tile j - 1's stage
//         alpha_j, l = alpha_j l + rowsum(P_j), O = alpha_j O   (skipped, as in the plain rung, by a warp
//                                              none of whose rows moved its max: alpha_j = 1)
//     O += P_{T-1} V_{T-1}; wait
//
// The arithmetic is the plain rung's, in the plain rung's order (O = alpha_j (O + P_{j-1} V_{j-1})
// before P_j V_j is added, as O = alpha_j O_{j-1} + P_j V_j does), so the output is bitwise the same.
// (alpha's two ex2 come after the second wait, in the branch with O's multiplies that the lazy rescale skips
// when no row moved: placed before it, on their own, ptxas predicates them and issues them on every tile.)
// What it costs: registers for S_j and P_{j-1} at once (P_{j-1} must stay untouched in its registers
// until the product reading it has finished), and one stage more (STAGES = 3): a tile's V is
// released one iteration later than in the plain rung, so the copy of tile j + 2 can start only when
// P_{j-1} V_{j-1} is done, and a third stage keeps it an iteration ahead of its use.
//
// The second entry point, flash_attention_wgmma_pingpong, adds FlashAttention-3's other scheduling step
// (Sec. 3.1, "pingpong scheduling"): the two consumer warpgroups take turns to issue their products,
// handed over by two named barriers, so that while one warpgroup's products run the other computes its
// softmax, and the tensor cores see one warpgroup's products after the other's instead of both at
// once. Warpgroup w waits on barrier 1 + w before it issues, and arrives on the other's barrier
// after; warpgroup 1 arrives once on warpgroup 0's barrier at the start (warpgroup 0 goes first) and
// skips its very last arrival (no one waits for it), so every barrier phase completes: per warpgroup
// n_tiles + 1 turns (tile 0's S, n_tiles - 1 loop iterations, the last P V). The turns change no
// arithmetic: the output is bitwise the overlapped and the plain rung's.
// Not here: registers are not moved from the producer to the consumers (setmaxnreg).
//
// Launch as flash_attention_wgmma (grid, 384 threads, tensor maps, arguments), with this build's
// SMEM_ALLOC bytes of dynamic shared memory. Defines: HEAD_DIM (64 or 128), BLOCK_K (64 or 128),
// STAGES (3), FA_DTYPE 1 or 2, FA_TRACE. sm_90a only.
#include "wgmma_forward.cuh"

// Ping-pong: warpgroup wg's turn to issue products begins when the other has arrived on its barrier.
#define TURN_THREADS CONSUMER_THREADS
// (barrier 1: warpgroup 0's turn, barrier 2: warpgroup 1's)
template <bool PINGPONG>
__device__ __forceinline__ void wait_for_turn(int wg) {
    if (!PINGPONG) return;
    if (wg == 0) named_barrier_sync<1, TURN_THREADS>();
    else named_barrier_sync<2, TURN_THREADS>();
}
template <bool PINGPONG>
__device__ __forceinline__ void pass_turn(int wg, bool last) {
    if (!PINGPONG) return;
    if (wg == 0) named_barrier_arrive<2, TURN_THREADS>();
    else if (!last) named_barrier_arrive<1, TURN_THREADS>();
}

// (the block's shared memory is declared by each entry point and passed in: on the CPU emulator a
// __shared__ array is a static variable, and a static inside a template function is one object for
// every library loaded into the process, whatever head dim each was built for)
template <bool PINGPONG>
__device__ __forceinline__ void
overlapped_forward(unsigned char* smem_raw, const TmaDescriptor& tm_q, const TmaDescriptor& tm_k, const TmaDescriptor& tm_v,
                   const scalar_t* __restrict__ v, scalar_t* __restrict__ out, float* __restrict__ lse, int n_q,
                   int n_k, float scale, int causal, const int* __restrict__ trace_rows, int n_trace_rows,
                   int trace_tiles, float* __restrict__ trace) {
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

    float m2[2] = {NEG_INF, NEG_INF};
    float l[2] = {0.f, 0.f};
    float o[O_TILES * 4];
#pragma unroll
    for (int i = 0; i < O_TILES * 4; ++i) o[i] = 0.f;
    unsigned p16[S_TILES][2];                        // P of the tile whose P V is issued next
    unsigned p_zero_bits[2] = {0u, 0u};              // its zero bits, when its V held inf or NaN
    bool prev_bad = false;                           // its V held inf or NaN
    float shift[2], alpha[2], row_sum[2];
    // S_j needs only K_j: it waits for full[s] (the tile has landed); P_j V_j waits for ready[s] too (the
    // checking warp is done with V_j), one iteration later, so the check of V never delays Q K^T
    auto v_checked = [&](int tile) {                 // V of `tile` is checked: its flag, its zero bits
        mbar_wait(bar_ready(base, tile % STAGES), (tile / STAGES) & 1);
        prev_bad = v_flags[tile % STAGES] != 0;
        if (prev_bad) zero_bits(p16, p_zero_bits);
    };

    mbar_wait(bar_q(base), 0);
    if (PINGPONG && wg == 1 && n_tiles > 0) named_barrier_arrive<1, TURN_THREADS>();   // warpgroup 0 goes first
    if (n_tiles > 0) {                               // tile 0: S_0, then its softmax (nothing to overlap)
        mbar_wait(bar_full(base, 0), 0);
        float sacc[S_TILES * 4];
        wait_for_turn<PINGPONG>(wg);
        wgmma_fence();
        issue_qk(sacc, q_desc, k_tile(base, 0));
        wgmma_commit();
        pass_turn<PINGPONG>(wg, false);
        wgmma_wait<0>();
        fence_s(sacc);
        const bool rescale =             // (true: m was -inf)
            softmax_step(sacc, m2, shift, row_sum, 0, warp_q0, row_g, t, n_q, n_k, causal, scale_log2);
        pack_p(sacc, p16);
        rescale_l_o<false>(l, o, alpha, shift, row_sum, rescale);   // (o is 0: nothing to rescale)
#ifdef FA_TRACE
        record_trace(trace, trace_slot, bh, n_trace_rows, trace_tiles, 0, t, m2, alpha, l);
#endif
    }
    for (int tile = 1; tile < n_tiles; ++tile) {
        const int s = tile % STAGES, prev_s = (tile - 1) % STAGES;
        mbar_wait(bar_full(base, s), (tile / STAGES) & 1);      // K_j has landed
        v_checked(tile - 1);                                    // V_{j-1} is checked

        // issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two commit groups in flight
        float sacc[S_TILES * 4];
        fence_o(o);
        fence_p(p16);                                // P_{j-1} and O were written by ordinary code
        wait_for_turn<PINGPONG>(wg);
        wgmma_fence();
        issue_qk(sacc, q_desc, k_tile(base, s));
        wgmma_commit();
        issue_pv(o, p16, v_tile(base, prev_s));
        wgmma_commit();
        pass_turn<PINGPONG>(wg, false);

        // S_j is done (at most the newest group, P V, still runs): its softmax overlaps the product.
        // It writes P_j in float32 over S_j, registers no product in flight uses
        wgmma_wait<1>();
        fence_s(sacc);
        const bool rescale =             // false: no row of this warp moved its max (alpha = 1)
            softmax_step(sacc, m2, shift, row_sum, tile * BLOCK_K, warp_q0, row_g, t, n_q, n_k, causal, scale_log2);

        // P_{j-1} V_{j-1} is done: step 7 for tile j - 1, release its stage, l and O for tile j, and
        // only now round P_j into the registers P_{j-1} held (writing them while the product still read
        // them would be wrong, and ptxas would serialise the products to prevent it)
        wgmma_wait<0>();
        fence_o(o);
        fence_p(p16);
        if (prev_bad) add_back_non_finite_v(o, p_zero_bits, v_bh, (tile - 1) * BLOCK_K, n_k, g, t);
        mbar_arrive(bar_empty(base, prev_s));
        rescale_l_o<true>(l, o, alpha, shift, row_sum, rescale);   // l too: alpha and o's multiplies in one branch
        pack_p(sacc, p16);
#ifdef FA_TRACE
        record_trace(trace, trace_slot, bh, n_trace_rows, trace_tiles, tile, t, m2, alpha, l);
#endif
    }
    if (n_tiles > 0) {                               // the last tile's P V (nothing left to overlap it with)
        const int last_s = (n_tiles - 1) % STAGES;
        v_checked(n_tiles - 1);
        fence_o(o);
        fence_p(p16);
        wait_for_turn<PINGPONG>(wg);
        wgmma_fence();
        issue_pv(o, p16, v_tile(base, last_s));
        wgmma_commit();
        pass_turn<PINGPONG>(wg, true);
        wgmma_wait<0>();
        fence_o(o);
        fence_p(p16);
        if (prev_bad) add_back_non_finite_v(o, p_zero_bits, v_bh, (n_tiles - 1) * BLOCK_K, n_k, g, t);
        mbar_arrive(bar_empty(base, last_s));
    }
    write_output(o, m2, l, out, lse, bh, row_g, t, n_q);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_attention_wgmma_overlap(const __grid_constant__ TmaDescriptor tm_q, const __grid_constant__ TmaDescriptor tm_k,
                              const __grid_constant__ TmaDescriptor tm_v, const scalar_t* __restrict__ v,
                              scalar_t* __restrict__ out, float* __restrict__ lse, int n_q, int n_k, float scale,
                              int causal, const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                              float* __restrict__ trace) {
    DECLARE_SMEM;
    overlapped_forward<false>(smem_raw, tm_q, tm_k, tm_v, v, out, lse, n_q, n_k, scale, causal, trace_rows, n_trace_rows,
                              trace_tiles, trace);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_attention_wgmma_pingpong(const __grid_constant__ TmaDescriptor tm_q, const __grid_constant__ TmaDescriptor tm_k,
                               const __grid_constant__ TmaDescriptor tm_v, const scalar_t* __restrict__ v,
                               scalar_t* __restrict__ out, float* __restrict__ lse, int n_q, int n_k, float scale,
                               int causal, const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                               float* __restrict__ trace) {
    DECLARE_SMEM;
    overlapped_forward<true>(smem_raw, tm_q, tm_k, tm_v, v, out, lse, n_q, n_k, scale, causal, trace_rows, n_trace_rows,
                             trace_tiles, trace);
}
