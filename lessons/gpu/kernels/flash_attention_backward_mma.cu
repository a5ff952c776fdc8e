// flash_attention_backward_mma.cu - the FlashAttention-2 backward pass on tensor cores.
//
// The same algorithm, the same two passes and the same outputs as flash_attention_backward.cu
// (read that file first), with every matrix product done by mma.sync.m16n8k16 (16-bit inputs,
// float32 accumulation), as in flash_attention_mma.cu:
//
//   0. D = rowsum(dO * O): the preprocess kernel of flash_attention_backward.cu, reused as is.
//   1. dK, dV:  one thread block per key block of BLOCK_K = 64 keys; warp w owns keys
//               16w .. 16w+15 of it, and their rows of dK_j and dV_j (float32 registers).
//               for each query block Q_i, dO_i of DKDV_BLOCK_Q rows that sees the block:
//                   Q_i, dO_i, L_i, D_i -> shared memory
//                   for each 16 queries of the block (so only 16 scores per key are live):
//                       S^T  = K_j Q^T               (tensor cores; scale applied after)
//                       P^T  = exp(scale S^T - L)    (float32; 0 where not visible)
//                       dP^T = V_j dO^T              (tensor cores)
//                       dS^T = P^T * (dP^T - D)      (float32; 0 where not visible)
//                       dV_j += P^T dO               (tensor cores, P^T rounded to 16 bits)
//                       dK_j += dS^T Q               (tensor cores, dS^T rounded to 16 bits)
//               dK_j = scale * dK_j
//   2. dQ:      one thread block per query block of BLOCK_Q = 64 rows; warp w owns rows
//               16w .. 16w+15, their Q and dO (as mma A fragments) and dQ_i in registers.
//               for each key block K_j, V_j of DQ_BLOCK_K keys, up to the causal diagonal:
//                   K_j, V_j -> shared memory
//                   for each 16 keys of the block (so only 16 scores per row are live):
//                       S = Q_i K^T, dP = dO_i V^T   (tensor cores)
//                       P, dS as above
//                       dQ_i += dS K                 (tensor cores, dS rounded to 16 bits)
//               dQ_i = scale * dQ_i
//
// Source: Dao 2023, "FlashAttention-2", Alg. 2 (the backward) and Sec. 3.3 (each warp owns
// rows, so no warp needs another's partial sums); the PTX ISA for mma.m16n8k16's fragments.
//
// Why the dK/dV kernel computes S^T, not S. With the warp owning 16 *keys*, S^T = K_j Q_i^T is
// an mma whose A operand is the warp's own 16 keys and whose C fragment holds, per lane, two
// keys (g, g + 8) and a few queries. That C layout is the A layout of the next products, so
// P^T and dS^T go straight from registers into dV_j += P^T dO_i and dK_j += dS^T Q_i, with no
// trip through shared memory and no exchange between warps (FlashAttention-2 does the same).
// The dQ kernel is the forward's layout: the warp owns 16 query rows, S = Q_i K_j^T, and dS
// (C layout) is the A operand of dQ_i += dS K_j.
//
// Deterministic, like flash_attention_backward.cu: dQ has its own pass (no atomicAdd), every
// sum runs in an order fixed by the code, so two runs give bitwise the same dq, dk, dv.
//
// Fragment layouts (g = lane / 4, t = lane % 4; see flash_attention_mma.cu for the picture):
//   A (16 x 16, row-major): a0 = A[g][2t..2t+1]  a1 = A[g+8][2t..]  a2 = A[g][2t+8..]  a3 = A[g+8][2t+8..]
//   B (16 x 8):             b0 = B[2t..2t+1][g]  b1 = B[2t+8..2t+9][g]
//   C (16 x 8, float32):    c0,c1 = C[g][2t, 2t+1]   c2,c3 = C[g+8][2t, 2t+1]
// Two ways to read a B operand from a row-major tile M in shared memory, each one ldmatrix.x2
// for the whole warp (as flash_attention_mma_async.cu):
//   * B = M^T (B[k][n] = M[n][k]: "K^T" of S = Q K^T): two neighbouring values of row n
//     (load_b_transposed: ldmatrix);
//   * B = M   (B[k][n] = M[k][n]: "V" of o += P V): one value from each of two rows
//     (load_b: ldmatrix.trans).
//
// Precision, as FlashAttention-2: Q, K, V, dO enter the products as stored (16 bits); P and dS
// are computed in float32 and rounded to 16 bits once, to enter their product; all sums are
// float32; dq, dk, dv are rounded to the storage dtype once, at the end.
//
// Masking, as flash_attention_backward.cu: causal != 0 is bottom-right (query i sees key j iff
// j <= i + n_k - n_q); a pair that is not visible (causal, past n_q, past n_k) gets P = 0 and
// dS = 0; a row with L = -inf (it saw no key) gets P = 0, so dq = 0 and it adds nothing to dk,
// dv; a key no row sees gets dk = dv = 0. Rows past n_q and keys past n_k load as zeros and
// write nothing. Tiles wholly above the diagonal are skipped (FA-2 Sec. 3.1).
//
// Shared memory (16-bit, rows of HEAD_DIM + 8 values: 16-byte aligned, and the 8 rows a
// fragment load touches fall on different banks):
//   dK/dV: k_s, v_s [BLOCK_K][HEAD_DIM + 8], q_s, do_s [DKDV_BLOCK_Q][HEAD_DIM + 8],
//          lse_s, delta_s [DKDV_BLOCK_Q] float32
//   dQ:    k_s, v_s [DQ_BLOCK_K][HEAD_DIM + 8]
// lessons/gpu/source.py (flash_attention_backward_mma_config) picks DKDV_BLOCK_Q and DQ_BLOCK_K
// so that each fits 48 KiB and nothing spills: (64, 64) for d = 64, (16, 64) for d = 128.
//
// Not done here (next steps towards FlashAttention-2's speed): ldmatrix.x4 for the A fragments
// and for two B fragments at once, cp.async double buffering, more than 48 KiB of (dynamic)
// shared memory for larger query tiles at d = 128, and the fused dQ by atomicAdd (5 matmuls
// per tile pair, not 7, but no longer bitwise repeatable).
//
// Launch (block = 128 threads, 4 warps; needs sm_80 or newer):
//   flash_attention_backward_mma_dkdv  grid = (ceil(n_k / 64), batch * heads)
//   flash_attention_backward_mma_dq    grid = (ceil(n_q / 64), batch * heads)
// Defines: HEAD_DIM (64 or 128), DKDV_BLOCK_Q and DQ_BLOCK_K (multiples of 16),
// FA_DTYPE 1 (float16) or 2 (bfloat16).
#include "common.cuh"
// the plumbing of the tensor cores: pack2f, mma_16x8x16, saddr, ldmatrix_x2
#include "tensor_core.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef DKDV_BLOCK_Q
#define DKDV_BLOCK_Q 64
#endif
#ifndef DQ_BLOCK_K
#define DQ_BLOCK_K 64
#endif
#define NUM_THREADS 128
#define BLOCK_K 64                       // keys per block of the dK/dV kernel: 4 warps x 16
#define BLOCK_Q 64                       // query rows per block of the dQ kernel: 4 warps x 16
#define PITCH (HEAD_DIM + 8)             // 16-bit values per row of every shared tile
#define D_STEPS (HEAD_DIM / 16)          // 16-wide slices of d (the K of S = Q K^T)
#define D_TILES (HEAD_DIM / 8)           // 16x8 tiles of a 16-row slice of dK, dV or dQ

static_assert(FA_DTYPE == 1 || FA_DTYPE == 2, "tensor cores take float16 or bfloat16 inputs");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "the tensor-core backward takes HEAD_DIM 64 or 128");
static_assert(DKDV_BLOCK_Q % 16 == 0 && DKDV_BLOCK_Q >= 16 && DKDV_BLOCK_Q <= 64, "DKDV_BLOCK_Q: 16, 32, 48 or 64");
static_assert(DQ_BLOCK_K % 16 == 0 && DQ_BLOCK_K >= 16 && DQ_BLOCK_K <= 64, "DQ_BLOCK_K: 16, 32, 48 or 64");

// The A fragment of rows row .. row + 15, columns col .. col + 15 of a row-major tile m with
// `pitch` values per row (shared or global memory); rows at or past n_rows read as zeros.
__device__ __forceinline__ void load_a(unsigned a[4], const scalar_t* m, long long pitch, int row, int n_rows,
                                       int col, int g, int t) {
    const scalar_t* lo = m + (long long)(row + g) * pitch + col + 2 * t;
    const scalar_t* hi = lo + 8 * pitch;
    const bool has_lo = row + g < n_rows, has_hi = row + g + 8 < n_rows;
    a[0] = has_lo ? *reinterpret_cast<const unsigned*>(lo) : 0u;
    a[1] = has_hi ? *reinterpret_cast<const unsigned*>(hi) : 0u;
    a[2] = has_lo ? *reinterpret_cast<const unsigned*>(lo + 8) : 0u;
    a[3] = has_hi ? *reinterpret_cast<const unsigned*>(hi + 8) : 0u;
}

// The B fragment of B = M^T, B[k][n] = M[n0 + n][k0 + k] (k 0..15, n 0..7), M a row-major
// shared tile: b0 = M[n0 + g][k0 + 2t, 2t + 1], b1 = the same 8 columns on. Matrix i of the
// ldmatrix is rows n0 .. n0 + 7, columns k0 + 8i .. k0 + 8i + 7, read as stored.
__device__ __forceinline__ void load_b_transposed(unsigned b[2], const scalar_t* m, int n0, int k0, int lane) {
    ldmatrix_x2(b, saddr(m + (n0 + lane % 8) * PITCH + k0 + 8 * ((lane / 8) % 2)), false);
}

// The B fragment of B = M, B[k][n] = M[k0 + k][n0 + n]: b0 = M[k0 + 2t, 2t + 1][n0 + g], b1 the
// same 8 rows on. Matrix i is rows k0 + 8i .. k0 + 8i + 7, columns n0 .. n0 + 7, transposed.
__device__ __forceinline__ void load_b(unsigned b[2], const scalar_t* m, int k0, int n0, int lane) {
    ldmatrix_x2(b, saddr(m + (k0 + 8 * ((lane / 8) % 2) + lane % 8) * PITCH + n0), true);
}

// Rows first .. first + n_rows_tile - 1 of a (n_rows, HEAD_DIM) matrix into a shared tile,
// 8 values (16 bytes) per load, zeros past n_rows.
__device__ __forceinline__ void load_tile(scalar_t* tile, const scalar_t* m, int first, int n_rows_tile, int n_rows,
                                          int tid) {
    for (int idx = tid; idx < n_rows_tile * (HEAD_DIM / 8); idx += NUM_THREADS) {
        const int r = idx / (HEAD_DIM / 8), c = (idx % (HEAD_DIM / 8)) * 8;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (first + r < n_rows) w = *reinterpret_cast<const uint4*>(m + (long long)(first + r) * HEAD_DIM + c);
        *reinterpret_cast<uint4*>(tile + r * PITCH + c) = w;
    }
}

// P and dS of one (query, key) pair from its recomputed q.k (unscaled) and dO.v, as
// flash_attention_backward.cu: not visible -> both 0; L = -inf (a row that saw no key) -> P = 0.
__device__ __forceinline__ void probability_and_ds(float s, float dp, float scale, float L, float D,
                                                   bool visible, float* p, float* ds) {
    const float prob = (visible && L != NEG_INF) ? expf(s * scale - L) : 0.f;
    *p = prob;
    *ds = visible ? prob * (dp - D) : 0.f;
}

// ---------------------------------------------------------------------------
// 1. dK_j, dV_j: one thread block per key block of 64, the query blocks streaming past.
// q, d_o: (batch*heads, n_q, HEAD_DIM); k, v, dk, dv: (batch*heads, n_k, HEAD_DIM), 16-bit,
// 16-byte aligned; lse, delta: (batch*heads, n_q) float32.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2)
flash_attention_backward_mma_dkdv(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                  const scalar_t* __restrict__ v, const scalar_t* __restrict__ d_o,
                                  const float* __restrict__ lse, const float* __restrict__ delta,
                                  scalar_t* __restrict__ dk, scalar_t* __restrict__ dv, int n_q, int n_k,
                                  float scale, int causal) {
    __shared__ __align__(16) scalar_t k_s[BLOCK_K * PITCH];
    __shared__ __align__(16) scalar_t v_s[BLOCK_K * PITCH];
    __shared__ __align__(16) scalar_t q_s[DKDV_BLOCK_Q * PITCH];
    __shared__ __align__(16) scalar_t do_s[DKDV_BLOCK_Q * PITCH];
    __shared__ float lse_s[DKDV_BLOCK_Q];
    __shared__ float delta_s[DKDV_BLOCK_Q];

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int k_start = blockIdx.x * BLOCK_K;
    const int kw = warp * 16;                        // this warp's first key inside the block
    const int keys[2] = {k_start + kw + g, k_start + kw + g + 8};    // this lane's two keys
    const long long bh = blockIdx.y;

    const scalar_t* q_bh = q + bh * n_q * HEAD_DIM;
    const scalar_t* do_bh = d_o + bh * n_q * HEAD_DIM;
    const float* lse_bh = lse + bh * n_q;
    const float* delta_bh = delta + bh * n_q;

    // ---- K_j, V_j stay in shared memory for the whole kernel (zeros past n_k) -----------
    load_tile(k_s, k + bh * n_k * HEAD_DIM, k_start, BLOCK_K, n_k, tid);
    load_tile(v_s, v + bh * n_k * HEAD_DIM, k_start, BLOCK_K, n_k, tid);

    // dk_acc[n][i], dv_acc[n][i]: key keys[i / 2], column 8n + 2t + i % 2 (C layout)
    float dk_acc[D_TILES][4], dv_acc[D_TILES][4];
#pragma unroll
    for (int n = 0; n < D_TILES; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { dk_acc[n][i] = 0.f; dv_acc[n][i] = 0.f; }

    // ---- which query blocks: causal -> from the block holding the first row that sees this
    // block's first key (query i sees key j iff i >= j - (n_k - n_q)); the same for every thread.
    const int n_qblocks = (n_q + DKDV_BLOCK_Q - 1) / DKDV_BLOCK_Q;
    int first_qblock = 0;
    if (causal) {
        const long long first_row = (long long)k_start - (n_k - n_q);
        first_qblock = first_row <= 0 ? 0 : first_row >= n_q ? n_qblocks : (int)(first_row / DKDV_BLOCK_Q);
    }

    for (int qb = first_qblock; qb < n_qblocks; ++qb) {
        const int q_start = qb * DKDV_BLOCK_Q;

        // 1. Q_i, dO_i (zeros past n_q), L_i (-inf past n_q), D_i into shared memory
        load_tile(q_s, q_bh, q_start, DKDV_BLOCK_Q, n_q, tid);
        load_tile(do_s, do_bh, q_start, DKDV_BLOCK_Q, n_q, tid);
        for (int r = tid; r < DKDV_BLOCK_Q; r += NUM_THREADS) {
            lse_s[r] = q_start + r < n_q ? lse_bh[q_start + r] : NEG_INF;
            delta_s[r] = q_start + r < n_q ? delta_bh[q_start + r] : 0.f;
        }
        __syncthreads();                             // Q_i, dO_i, L_i, D_i (and K_j, V_j) are ready

        // 16 queries at a time (so only 16 scores per key are live, whatever DKDV_BLOCK_Q; the
        // loop is not unrolled, as in the dQ kernel, so that ptxas does not start the next
        // slice's loads early while dK_j, dV_j hold HEAD_DIM registers)
#pragma unroll 1
        for (int qs = 0; qs < DKDV_BLOCK_Q / 16; ++qs) {
            // 2. S^T = K_j Q^T and dP^T = V_j dO^T for the warp's 16 keys x queries 16qs .. 16qs+15.
            //    Tile n (0, 1), element i: key keys[i / 2], query q_start + 16qs + 8n + 2t + i % 2.
            float s[2][4], dp[2][4];
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) { s[n][i] = 0.f; dp[n][i] = 0.f; }
#pragma unroll
            for (int ds = 0; ds < D_STEPS; ++ds) {
                unsigned k_frag[4], v_frag[4];
                load_a(k_frag, k_s, PITCH, kw, BLOCK_K, ds * 16, g, t);
                load_a(v_frag, v_s, PITCH, kw, BLOCK_K, ds * 16, g, t);
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    unsigned b[2];
                    load_b_transposed(b, q_s, qs * 16 + n * 8, ds * 16, lane);
                    mma_16x8x16(s[n], k_frag, b);
                    load_b_transposed(b, do_s, qs * 16 + n * 8, ds * 16, lane);
                    mma_16x8x16(dp[n], v_frag, b);
                }
            }

            // 3. P^T into s, dS^T into dp (float32), 0 where the pair is not visible
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = keys[i / 2];
                    const int col = qs * 16 + n * 8 + 2 * t + i % 2;      // the query inside the block
                    const int row = q_start + col;
                    const bool visible = key < n_k && row < n_q && (!causal || key <= row + n_k - n_q);
                    probability_and_ds(s[n][i], dp[n][i], scale, lse_s[col], delta_s[col], visible, &s[n][i],
                                       &dp[n][i]);
                }

            // 4. dV_j += P^T dO and dK_j += dS^T Q for these 16 queries. The A fragment is the C
            //    fragments of the two tiles, rounded to 16 bits; B = dO (or Q) itself.
            const unsigned p_frag[4] = {pack2f(s[0][0], s[0][1]), pack2f(s[0][2], s[0][3]),
                                        pack2f(s[1][0], s[1][1]), pack2f(s[1][2], s[1][3])};
            const unsigned ds_frag[4] = {pack2f(dp[0][0], dp[0][1]), pack2f(dp[0][2], dp[0][3]),
                                         pack2f(dp[1][0], dp[1][1]), pack2f(dp[1][2], dp[1][3])};
#pragma unroll
            for (int n = 0; n < D_TILES; ++n) {
                unsigned b[2];
                load_b(b, do_s, qs * 16, n * 8, lane);
                mma_16x8x16(dv_acc[n], p_frag, b);
                load_b(b, q_s, qs * 16, n * 8, lane);
                mma_16x8x16(dk_acc[n], ds_frag, b);
            }
        }
        __syncthreads();                             // everyone is done with q_s, do_s, lse_s, delta_s
    }

    // ---- write dK_j = scale * dS^T Q, dV_j; keys past n_k write nothing -----------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (keys[h] >= n_k) continue;
        const long long base = (bh * n_k + keys[h]) * HEAD_DIM;
#pragma unroll
        for (int n = 0; n < D_TILES; ++n) {
            const int c = n * 8 + 2 * t;
            *reinterpret_cast<unsigned*>(dk + base + c) = pack2f(scale * dk_acc[n][2 * h], scale * dk_acc[n][2 * h + 1]);
            *reinterpret_cast<unsigned*>(dv + base + c) = pack2f(dv_acc[n][2 * h], dv_acc[n][2 * h + 1]);
        }
    }
}

// ---------------------------------------------------------------------------
// 2. dQ_i: one thread block per query block of 64 rows, the key blocks streaming past.
// Arguments as the dK/dV kernel; dq: like q.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2)
flash_attention_backward_mma_dq(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                const scalar_t* __restrict__ v, const scalar_t* __restrict__ d_o,
                                const float* __restrict__ lse, const float* __restrict__ delta,
                                scalar_t* __restrict__ dq, int n_q, int n_k, float scale, int causal) {
    __shared__ __align__(16) scalar_t k_s[DQ_BLOCK_K * PITCH];
    __shared__ __align__(16) scalar_t v_s[DQ_BLOCK_K * PITCH];

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int q_start = blockIdx.x * BLOCK_Q;
    const int qw = q_start + warp * 16;              // this warp's first query row
    const int rows[2] = {qw + g, qw + g + 8};        // this lane's two rows
    const long long bh = blockIdx.y;

    const scalar_t* q_bh = q + bh * n_q * HEAD_DIM;
    const scalar_t* do_bh = d_o + bh * n_q * HEAD_DIM;
    const scalar_t* k_bh = k + bh * n_k * HEAD_DIM;
    const scalar_t* v_bh = v + bh * n_k * HEAD_DIM;

    // ---- the warp's 16 rows of Q and dO, as A fragments, for the whole kernel -------------
    unsigned q_frag[D_STEPS][4], do_frag[D_STEPS][4];
#pragma unroll
    for (int ds = 0; ds < D_STEPS; ++ds) {
        load_a(q_frag[ds], q_bh, HEAD_DIM, qw, n_q, ds * 16, g, t);
        load_a(do_frag[ds], do_bh, HEAD_DIM, qw, n_q, ds * 16, g, t);
    }
    float L[2], D[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        L[h] = rows[h] < n_q ? lse[bh * n_q + rows[h]] : NEG_INF;     // the forward's lse of the row
        D[h] = rows[h] < n_q ? delta[bh * n_q + rows[h]] : 0.f;       // rowsum(dO * O) of the row
    }

    // dq_acc[n][i]: row rows[i / 2], column 8n + 2t + i % 2 (C layout)
    float dq_acc[D_TILES][4];
#pragma unroll
    for (int n = 0; n < D_TILES; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dq_acc[n][i] = 0.f;

    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, DQ_BLOCK_K, causal);
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k_start = tile * DQ_BLOCK_K;
        load_tile(k_s, k_bh, k_start, DQ_BLOCK_K, n_k, tid);
        load_tile(v_s, v_bh, k_start, DQ_BLOCK_K, n_k, tid);
        __syncthreads();                             // K_j, V_j are ready

        // 16 keys at a time (so only 16 scores per row are live, whatever DQ_BLOCK_K); not unrolled,
        // so that ptxas does not start the next slice's loads early: with Q, dO and dQ of d = 128
        // in registers (128 of them) that would spill
#pragma unroll 1
        for (int ks = 0; ks < DQ_BLOCK_K / 16; ++ks) {
            // S = Q_i K^T, dP = dO_i V^T for keys 16ks .. 16ks+15 of the block;
            // tile n (0, 1), element i: row rows[i / 2], key k_start + 16ks + 8n + 2t + i % 2
            float s[2][4], dp[2][4];
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) { s[n][i] = 0.f; dp[n][i] = 0.f; }
#pragma unroll
            for (int ds = 0; ds < D_STEPS; ++ds)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    unsigned b[2];
                    load_b_transposed(b, k_s, ks * 16 + n * 8, ds * 16, lane);
                    mma_16x8x16(s[n], q_frag[ds], b);
                    load_b_transposed(b, v_s, ks * 16 + n * 8, ds * 16, lane);
                    mma_16x8x16(dp[n], do_frag[ds], b);
                }

            // P (into s, unused after) and dS (into dp)
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int h = i / 2;
                    const int key = k_start + ks * 16 + n * 8 + 2 * t + i % 2;
                    const bool visible = rows[h] < n_q && key < n_k && (!causal || key <= rows[h] + n_k - n_q);
                    probability_and_ds(s[n][i], dp[n][i], scale, L[h], D[h], visible, &s[n][i], &dp[n][i]);
                }

            // dQ_i += dS K: A = dS of these 16 keys (its two C tiles, rounded to 16 bits), B = K itself
            const unsigned ds_frag[4] = {pack2f(dp[0][0], dp[0][1]), pack2f(dp[0][2], dp[0][3]),
                                         pack2f(dp[1][0], dp[1][1]), pack2f(dp[1][2], dp[1][3])};
#pragma unroll
            for (int n = 0; n < D_TILES; ++n) {
                unsigned b[2];
                load_b(b, k_s, ks * 16, n * 8, lane);
                mma_16x8x16(dq_acc[n], ds_frag, b);
            }
        }
        __syncthreads();                             // everyone is done with k_s, v_s
    }

    // ---- dQ_i = scale * dS K; rows past n_q write nothing ---------------------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (rows[h] >= n_q) continue;
        scalar_t* dq_row = dq + (bh * n_q + rows[h]) * HEAD_DIM;
#pragma unroll
        for (int n = 0; n < D_TILES; ++n)
            *reinterpret_cast<unsigned*>(dq_row + n * 8 + 2 * t) =
                pack2f(scale * dq_acc[n][2 * h], scale * dq_acc[n][2 * h + 1]);
    }
}
