// flash_attention_mma_fa2.cu - the tensor-core forward, further along FlashAttention-2's recipe.
//
// The fold and the fragment layouts of flash_attention_mma.cu and the cp.async double
// buffering of flash_attention_mma_async.cu (read those first), with the remaining steps of
// FlashAttention-2's forward (Dao 2023, Sec. 3.1 and 3.3):
//
//   * Bigger blocks, fewer registers. d = 64: 128 query rows over 8 warps (16 rows each),
//     key tiles of 64, at most 128 registers per thread so that 2 blocks (16 warps) share an
//     SM. d = 128: 64 rows over 4 warps, key tiles of 32, 2+ blocks per SM.
//   * Q through shared memory once: cp.async copies the block's Q tile into shared memory
//     (the space of the second K/V stage, before it is needed), ldmatrix.x4 turns it into
//     A fragments that stay in registers for the whole kernel.
//   * ldmatrix.x4: one instruction loads the B fragments of two 8-key (K) or two 8-column
//     (V, .trans) tiles, half the ldmatrix instructions of the .x2 rung.
//   * No padding: rows of d 16-bit values with their 16-byte chunks XOR-swizzled. Chunk c of
//     row r sits at chunk  c ^ (r % 8)  (within its group of 8 chunks = 128 bytes). ldmatrix
//     reads 8 rows at one logical chunk: the 8 physical chunks are all different, so the 8
//     16-byte reads hit 8 different groups of 4 banks: no bank conflict (a row is 128 or 256
//     bytes, a multiple of the 32 banks' width, so only the chunk decides the banks).
//   * exp2 with log2(e) folded into the scale: scores are kept in log2 units,
//     s2 = (q . k) * scale * log2(e), and p = 2^(s2 - m2) is one ex2.approx instruction
//     (expf is ex2 plus a multiply and range handling). m and lse leave the kernel in natural
//     units: m = m2 * ln 2, lse = (m2 + log2 l) * ln 2.
//   * Masking only where it can matter: a tile that lies wholly inside n_k and wholly below
//     this warp's causal diagonal skips the per-element tests (most tiles at large N).
//   * A cheap inf/NaN test on V: each thread tests the 16-byte chunks it copied (8 exponent
//     compares per chunk) and rewrites a chunk only when it holds inf or NaN; the async rung
//     rewrote every chunk of every tile.
//   * Fewer instructions around the products: P is rounded and packed two values at a time
//     (cvt.rn.f16x2.f32 / bf16x2), and shared-memory addresses are 32-bit integers computed
//     once (no generic-to-shared conversion per ldmatrix or cp.async).
//   P stays in registers as the A operand of P V (the C fragment of two score tiles is the A
//   fragment of one 16-key step, rounded to 16 bits), as in the rungs below.
//
// Compile report (NVRTC 12.9, float16 and bfloat16, sm_80 and sm_90, no spills): d = 64: 128
// registers x 256 threads, 32768 bytes of shared memory: 2 blocks (16 warps) per SM; d = 128:
// 202-208 registers x 128 threads, 32768 bytes: 2 blocks (8 warps) per SM.
//
// Two compile-time switches (both 0 by default, which is the kernel above, as measured) make the
// next rung, flash_attention_mma_fa2_lazy (the entry point is called so when LAZY_RESCALE is 1):
//
//   * LAZY_RESCALE: rescale o only when the running max moves. alpha = 2^(m_old - m_new) is
//     exactly 1 for a row whose max did not move, and once the max has settled (after the first
//     few tiles of a long row) most tiles move no row's max. So each warp votes (__any_sync) on
//     whether any of its 16 rows moved, and skips the o[n][i] *= alpha loop when none did
//     (4 * O_TILES multiplies per thread per tile, 64 at d = 128). A row that did not move gets
//     alpha = 1.f written, not ex2(0), so that when another row of the warp moved, multiplying
//     its o by alpha leaves it bitwise as it was; a row that still sees nothing (m = -inf before
//     and after) counts as not moved and keeps alpha = 2^-inf = 0, as the plain kernel and NumPy
//     have it (its l and o are 0 either way). The output is bitwise the plain kernel's for the
//     same tiles. FlashAttention-4 goes further: it keeps a stale max until the new one is larger
//     by more than a threshold (still exact in exact arithmetic, as o and l share the stale max,
//     but no longer bitwise the eager kernel's); a threshold of 0, as here, changes no bit.
//   * FA2_DYNAMIC_SMEM: the two K/V stages in dynamic shared memory (asked for at launch), so
//     that d = 128 can take 64-key tiles (2 stages x (K + V) x 64 keys x 128 x 2 bytes = 64 KiB,
//     over the 48 KiB a block may declare statically) and 128-row query blocks. On the CPU
//     emulator the stages stay a static array of the same size, declared here in the entry point.
//   Compile report of the lazy rung (NVRTC 12.9, float16 and bfloat16, sm_80 / sm_90, no spills):
//   d = 64, 128 x 64 tiles: 128 registers x 256 threads, 32768 bytes (dynamic); d = 128, 64 x 64
//   tiles: 242 / 245 registers x 128 threads, 65536 bytes: 2 blocks per SM either way. The lazy
//   rescale costs registers at d = 128 (64 x 32 tiles: 218-224 against 202-208 without it). The other
//   legal tiles: lessons.gpu.source.FA2_LAZY_SWEEP.
//
// A third switch, WARP_ROWS = 32 (with the two above: 16 by default), makes the rung after that,
// flash_attention_mma_fa2_wide: FlashAttention-2's own warp shape, each warp owning 32 query rows
// (two 16-row m-tiles, M_TILES = 2) instead of 16, so a block of 128 rows is 4 warps, not 8.
//   * Each K fragment (ldmatrix.x4 in step 3) and each V fragment (step 6) read from shared memory
//     feeds two mma instructions instead of one: half the shared-memory reads per product, and two
//     independent mmas in flight per fragment.
//   * The price is registers: o and s double per thread (o: 2 x 4 x HEAD_DIM / 8 floats, 128 at
//     d = 128). So Q no longer stays in registers: it keeps its own region of shared memory behind
//     the two stages (BLOCK_Q x HEAD_DIM x 2 bytes), and step 3 loads its A fragments (ldmatrix.x4,
//     one per m-tile and 16-wide slice of d) as it goes, as FlashAttention-2 does.
//   FlashAttention-2 takes 128 x 128 tiles at d = 64 and 128 x 64 at d = 128 on an A100 and an H100 (128 x 32
//   at d = 128 only with dropout, or without causal masking on sm_86 / sm_89 GPUs); here 128 keys at d = 64
//   spill (s alone is 128 floats per thread) and 128 x 64 at d = 128 spills on sm_80, so the defaults are
//   128 x 64 at d = 64 and 128 x 32 at d = 128 (128 x 64 is in the sweep).
//   Compile report (NVRTC 12.9, float16, no spills): d = 64, 128 x 64: 225 / 223 registers (sm_80 /
//   sm_90) x 128 threads, 48 KiB; d = 128, 128 x 32: 254 / 255 x 128 threads, 64 KiB: 2 blocks (8 warps)
//   per SM. The other legal tiles: lessons.gpu.source.FA2_WIDE_SWEEP.
//
// A fourth switch, FA2_LEAN = 1 (on top of the wide rung's three), makes flash_attention_mma_fa2_lean: the wide
// rung whose interior key tiles issue only what they need. In the wide rung every tile, interior or not, pays
// for V's inf/NaN test (each thread tests the chunks it copied, then a block-wide vote, __syncthreads_or), for
// the masks (ptxas predicates `if (needs_mask)`, so each score costs a compare and a select even where no key
// is masked) and for a bounds test per copied chunk. FlashAttention-2 runs its few masking steps apart from the
// rest (n_masking_steps) and copies even tiles without bounds tests (Is_even_MN); so does this build:
//   * at d = 64, two loops, one body: first the key tiles that need no mask for any row of the block (inside n_k
//     and, causal, wholly at or below the block's first row's diagonal), compiled without any mask code, then the
//     rest with the masked step (and its per-warp needs_mask) as before (at d = 128 one loop: see there why);
//   * a tile that lies wholly inside n_k is copied with no test per chunk (one uniform test per tile);
//   * a pre-pass (entry point flash_attention_mma_fa2_lean_v_flags) reads V once and writes one int32 flag per
//     (batch * head, key tile): 1 where the tile holds an inf or NaN. A tile reads its flag (one tile ahead, so
//     the load's latency hides) and only a flagged tile rewrites its V chunks and runs step 7; the barrier after
//     the copies is a plain __syncthreads().
//   The arithmetic is the wide rung's: with the same tiles the output is bitwise the wide rung's.
//   Compile report (NVRTC 12.9, float16 / bfloat16, default tiles, no spills): d = 64, 128 x 64: 242-243
//   registers on sm_80 and sm_90 (wide: 225 / 223); d = 128, 128 x 32: 255 on both (wide: 254 / 255).
//   Instructions one warp issues on an interior key tile (lessons.gpu.sass.tensor_tile; 128 HMMA per tile
//   either way), sm_90: d = 64, 982 (wide) -> 760 (the loop without masks); d = 128, 801 -> 673.
//   The other legal tiles: lessons.gpu.source.FA2_LEAN_SWEEP.
//
// NaN rule and empty rows exactly as flash_attention_mma_async.cu: inf/NaN in V reach only
// the rows that give that key p > 0 (step 7), a row that sees nothing gives 0 and lse -inf.
//
// On the CPU emulator cp.async is a plain copy, ldmatrix is done by its definition (every lane
// publishes its row address, then picks its elements out of the other lanes' rows) and ex2 is exp2f.
//
// Launch: grid = (ceil(n_q / BLOCK_Q), batch * heads), block = BLOCK_Q / WARP_ROWS warps.
// Defines: HEAD_DIM (64 or 128), BLOCK_Q (64 or 128), BLOCK_K (32 or 64),
// MIN_BLOCKS (blocks per SM promised to ptxas), FA_DTYPE 1 or 2, FA_TRACE, LAZY_RESCALE and
// FA2_DYNAMIC_SMEM (0 or 1), WARP_ROWS (16 or 32; 32 needs the other two), FA2_LEAN (0 or 1; 1 needs
// WARP_ROWS 32; the main kernel then takes v_flags, the pre-pass's output, as its last argument). With
// FA2_DYNAMIC_SMEM a launch asks for 8 * BLOCK_K * HEAD_DIM bytes of dynamic shared memory (+ 2 * BLOCK_Q * HEAD_DIM with
// WARP_ROWS 32, for Q). sm_80+.
#include "common.cuh"
// the plumbing of the tensor cores: pack2f, pack_float2, fast_exp2, non_finite, chunk_non_finite, finite_part,
// mma_16x8x16, saddr / sadd (32-bit shared-memory addresses), cp_async16 / cp_async_commit / cp_async_wait,
// ldmatrix_x4
#include "tensor_core.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_Q
#define BLOCK_Q 128
#endif
#ifndef BLOCK_K
#define BLOCK_K 64
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef LAZY_RESCALE
#define LAZY_RESCALE 0
#endif
#ifndef FA2_DYNAMIC_SMEM
#define FA2_DYNAMIC_SMEM 0
#endif
#ifndef WARP_ROWS
#define WARP_ROWS 16
#endif
#ifndef FA2_LEAN
#define FA2_LEAN 0
#endif
// the lean build's loop split (see the key-tile loop): at d = 64 only
#define FA2_SPLIT_MASKED (FA2_LEAN && HEAD_DIM == 64)
#define M_TILES (WARP_ROWS / 16)        // 16-row m-tiles per warp
#define Q_IN_REGS (M_TILES == 1)        // Q's A fragments stay in registers (else: read from shared memory)
#define NUM_WARPS (BLOCK_Q / WARP_ROWS)
#define NUM_THREADS (NUM_WARPS * 32)
#define CHUNKS (HEAD_DIM / 8)           // 16-byte chunks per row of Q, K, V
#define D_STEPS (HEAD_DIM / 16)         // 16-wide slices of d:   S = sum over slices of Q K^T
#define S_TILES (BLOCK_K / 8)           // 16x8 score tiles per warp and key tile
#define KEY_STEPS (BLOCK_K / 16)        // 16-key slices:         o += sum over slices of P V
#define O_TILES (HEAD_DIM / 8)          // 16x8 output tiles per warp
#define STAGE_ELEMS (2 * BLOCK_K * HEAD_DIM)   // one stage: K tile, then V tile
// shared memory: two stages, then (WARP_ROWS 32) the Q tile; with 16-row warps Q passes through stage 1
#define SMEM_ELEMS (2 * STAGE_ELEMS + (Q_IN_REGS ? 0 : BLOCK_Q * HEAD_DIM))
#define Q_OFFSET (Q_IN_REGS ? STAGE_ELEMS : 2 * STAGE_ELEMS)

static_assert(FA_DTYPE == 1 || FA_DTYPE == 2, "tensor cores take float16 or bfloat16 inputs");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");
static_assert(BLOCK_Q == 64 || BLOCK_Q == 128, "BLOCK_Q must be 64 or 128");
static_assert(WARP_ROWS == 16 || WARP_ROWS == 32, "WARP_ROWS must be 16 or 32");
static_assert(WARP_ROWS == 16 || (LAZY_RESCALE && FA2_DYNAMIC_SMEM), "the wide rung builds on the lazy one");
static_assert(!FA2_LEAN || WARP_ROWS == 32, "the lean rung builds on the wide one");
static_assert(BLOCK_K == 32 || BLOCK_K == 64, "BLOCK_K must be 32 or 64");
static_assert(!Q_IN_REGS || BLOCK_Q * HEAD_DIM <= STAGE_ELEMS, "the Q tile must fit in one K/V stage");
static_assert(FA2_DYNAMIC_SMEM || SMEM_ELEMS * 2 <= 48 * 1024,
              "two stages over 48 KiB need dynamic shared memory (FA2_DYNAMIC_SMEM=1)");

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// The swizzle: element offset of chunk `chunk` (8 values) of row `row` in a row-major tile of
// HEAD_DIM values per row. Mirrored by lessons.gpu.source.fa2_swizzle (tested there).
__device__ __forceinline__ int swz(int row, int chunk) { return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3); }

// Start copying ROWS rows (row0 ..) of a (n_rows, HEAD_DIM) matrix into a swizzled tile;
// rows at or past n_rows are zero-filled (plain stores). No commit. Thread tid copies chunk
// tid % CHUNKS of rows tid / CHUNKS + i * (NUM_THREADS / CHUNKS): a fixed count per thread,
// so the loop unrolls and the swizzled offsets are constants plus one per-thread term.
// CHECKED = false (the lean rung, for a tile known to lie wholly inside n_rows): no per-chunk test.
template <int ROWS, bool CHECKED = true>
__device__ __forceinline__ void copy_rows(scalar_t* dst, saddr_t dst_s, const scalar_t* src, int row0, int n_rows,
                                          int tid) {
    static_assert((ROWS * CHUNKS) % NUM_THREADS == 0, "the threads must share the chunks evenly");
    const int c = tid % CHUNKS;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / NUM_THREADS; ++i) {
        const int r = tid / CHUNKS + i * (NUM_THREADS / CHUNKS);
        if (!CHECKED || row0 + r < n_rows)
            cp_async16(sadd(dst_s, swz(r, c)), src + (long long)(row0 + r) * HEAD_DIM + c * 8);
        else
            *reinterpret_cast<uint4*>(dst + swz(r, c)) = make_uint4(0u, 0u, 0u, 0u);
    }
}

#if FA2_LEAN
// The lean rung's pre-pass: v_flags[bh][j] = 1 when key tile j of V (keys j BLOCK_K .. + BLOCK_K - 1 below n_k)
// of head bh holds an inf or NaN, else 0 (int32: one flag per tile is a few bytes per head, and an aligned
// 32-bit load is one instruction). V is read once here, so the main kernel's key tiles test nothing: a tile
// reads its flag (uniform over the block) instead of testing every chunk it copied.
// Launch: grid = (ceil(n_k / BLOCK_K), batch * heads), block = NUM_THREADS; no shared memory.
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_attention_mma_fa2_lean_v_flags(const scalar_t* __restrict__ v, int n_k, int* __restrict__ v_flags) {
    const int tile = blockIdx.x;
    const long long bh = blockIdx.y;
    const int n_chunks = min(BLOCK_K, n_k - tile * BLOCK_K) * CHUNKS;          // (the last tile may be partial)
    const uint4* src = reinterpret_cast<const uint4*>(v + (bh * n_k + (long long)tile * BLOCK_K) * HEAD_DIM);
    bool bad = false;
    for (int i = threadIdx.x; i < n_chunks; i += NUM_THREADS) bad = bad || chunk_non_finite(src[i]);
    const int any = __syncthreads_or(bad);
    if (threadIdx.x == 0) v_flags[bh * gridDim.x + tile] = any != 0;
}
#endif

// q: (batch*heads, n_q, HEAD_DIM), k, v: (batch*heads, n_k, HEAD_DIM), 16-bit, C-contiguous,
// each 16-byte aligned. out: like q; lse: (batch*heads, n_q) float32.
// causal != 0: query i sees key j iff j <= i + n_k - n_q (bottom-right aligned).
// Trace: trace_rows (n_trace_rows,) query rows; trace (batch*heads, n_trace_rows, trace_tiles, 3).
// (One body, four names: the entry point is flash_attention_mma_fa2_lean when FA2_LEAN is 1, else
//  flash_attention_mma_fa2_wide when WARP_ROWS is 32, else flash_attention_mma_fa2_lazy when LAZY_RESCALE is 1.)
// v_flags (lean only): (batch*heads, ceil(n_k / BLOCK_K)) int32 from flash_attention_mma_fa2_lean_v_flags.
#if FA2_LEAN
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_attention_mma_fa2_lean(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                             const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                             float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                             const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                             float* __restrict__ trace, const int* __restrict__ v_flags) {
#elif WARP_ROWS == 32
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_attention_mma_fa2_wide(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                             const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                             float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                             const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                             float* __restrict__ trace) {
#elif LAZY_RESCALE
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_attention_mma_fa2_lazy(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                             const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                             float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                             const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                             float* __restrict__ trace) {
#else
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_attention_mma_fa2(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                        const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                        float* __restrict__ lse, int n_q, int n_k, float scale, int causal,
                        const int* __restrict__ trace_rows, int n_trace_rows, int trace_tiles,
                        float* __restrict__ trace) {
#endif
    // two stages of [K tile | V tile], swizzled; the Q tile at Q_OFFSET (stage 1, or its own region)
#if FA2_DYNAMIC_SMEM && !defined(FA_CPU_EMULATION)
    extern __shared__ __align__(128) scalar_t smem[];             // SMEM_ELEMS, asked for at launch
#else
    __shared__ __align__(128) scalar_t smem[SMEM_ELEMS];
#endif

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;            // fragment coordinates (flash_attention_mma.cu)
    const int q_start = blockIdx.x * BLOCK_Q;
    const int warp_q0 = q_start + warp * WARP_ROWS;  // this warp's first query row
    const int row_g = warp_q0 + g;                   // this lane's query rows: row_g + 16 mt + 8 h
    const long long bh = blockIdx.y;
    const float scale_log2 = scale * LOG2E;          // scores in log2 units: 2^(s2 - m2) = e^(s - m)

    const scalar_t* q_bh = q + bh * n_q * HEAD_DIM;
    const scalar_t* k_bh = k + bh * n_k * HEAD_DIM;
    const scalar_t* v_bh = v + bh * n_k * HEAD_DIM;

    const int n_tiles = tiles_to_visit(q_start, BLOCK_Q, n_q, n_k, BLOCK_K, causal);
    const saddr_t smem_s = saddr(smem);

    // ---- 0. Q and tile 0 (stage 0) by cp.async; then (16-row warps) Q into registers ---------
    copy_rows<BLOCK_Q>(smem + Q_OFFSET, sadd(smem_s, Q_OFFSET), q_bh, q_start, n_q, tid);
    cp_async_commit();
    if (n_tiles > 0) {
#if FA2_LEAN
        if (BLOCK_K <= n_k) {                        // (see step 1)
            copy_rows<BLOCK_K, false>(smem, smem_s, k_bh, 0, n_k, tid);
            copy_rows<BLOCK_K, false>(smem + BLOCK_K * HEAD_DIM, sadd(smem_s, BLOCK_K * HEAD_DIM), v_bh, 0, n_k, tid);
        } else
#endif
        {
            copy_rows<BLOCK_K>(smem, smem_s, k_bh, 0, n_k, tid);
            copy_rows<BLOCK_K>(smem + BLOCK_K * HEAD_DIM, sadd(smem_s, BLOCK_K * HEAD_DIM), v_bh, 0, n_k, tid);
        }
    }
    cp_async_commit();
    cp_async_wait<1>();                              // Q has landed (tile 0 may still be in flight)
    __syncthreads();
    // A fragment of m-tile mt (rows warp * WARP_ROWS + 16 mt .. +15), columns 16ds .. +15:
    // lane L names row L % 16, chunk 2ds + L / 16
#if Q_IN_REGS
    unsigned q_frag[D_STEPS][4];
#pragma unroll
    for (int ds = 0; ds < D_STEPS; ++ds)
        ldmatrix_x4(q_frag[ds], sadd(smem_s, Q_OFFSET + swz(warp * 16 + lane % 16, 2 * ds + lane / 16)), false);
    __syncthreads();                                 // stage 1 is free for tile 1
#endif

#ifdef FA_TRACE
    int trace_slot[M_TILES][2];
    for (int mt = 0; mt < M_TILES; ++mt)
        for (int h = 0; h < 2; ++h) {
            trace_slot[mt][h] = -1;
            const int row = row_g + 16 * mt + 8 * h;
            if (row < n_q)
                for (int i = 0; i < n_trace_rows; ++i)
                    if (trace_rows[i] == row) trace_slot[mt][h] = i;
        }
#endif

    // ---- the running state of rows row_g + 16 mt + 8 h (index [mt][h]); m2 in log2 units ---------
    float m2[M_TILES][2], l[M_TILES][2];
    float o[M_TILES][O_TILES][4];                    // o[mt][n][i]: row row_g + 16 mt + 8 (i / 2), column 8n + 2t + i % 2
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m2[mt][h] = NEG_INF;
            l[mt][h] = 0.f;
        }
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[mt][n][i] = 0.f;
    }

#if FA2_LEAN
    // v_flag: the pre-pass's flag of the tile being absorbed, read one tile ahead (its latency hides behind a tile)
    const int* v_flags_bh = v_flags + bh * ((n_k + BLOCK_K - 1) / BLOCK_K);
    int v_flag = n_tiles > 0 ? v_flags_bh[0] : 0;

    // The key tiles that need no mask for any row of the block come first, then the rest (FlashAttention-2
    // runs its few masking steps apart from the others, n_masking_steps). Tile j needs none when it lies
    // inside n_k and, causal, its last key is at most the block's first row's diagonal q_start + n_k - n_q
    // (negative when n_q > n_k and the block's first rows see nothing): j + 1 <= (diagonal + 1) / BLOCK_K.
    // Only at d = 64 (FA2_SPLIT_MASKED): at d = 128 the two copies of the body do not fit 255 registers on
    // sm_80 (52-56 bytes spilled), and ptxas already branches around most of the mask code in a tile that
    // needs none, so one loop issues as few instructions per interior tile (sm_90, NVRTC 12.9: 673 against
    // the unmasked loop's 676, for 128 HMMA).
    int n_full = 0;                                     // tiles 0 .. n_full - 1 take the loop without masks
#if FA2_SPLIT_MASKED
    n_full = n_k / BLOCK_K;
    if (causal) {
        const int diagonal = q_start + n_k - n_q;
        n_full = min(n_full, diagonal < 0 ? 0 : (diagonal + 1) / BLOCK_K);
    }
    n_full = min(n_full, n_tiles);
#endif
    // One body, two loops: the pass loop is unrolled, so `masked` is a constant in each copy and the first
    // loop's step 4 compiles with no mask code at all (nor the test that picks it); without the split only
    // the second copy is made.
#pragma unroll
    for (int masked = FA2_SPLIT_MASKED ? 0 : 1; masked < 2; ++masked)   // 0: tiles 0 .. n_full - 1, 1: the rest
    for (int tile = masked ? n_full : 0; tile < (masked ? n_tiles : n_full); ++tile) {
#else
    const bool masked = true;                           // (every tile takes step 4 with its mask test)
    for (int tile = 0; tile < n_tiles; ++tile) {
#endif
        const int k_start = tile * BLOCK_K;
        const int stage = (tile & 1) * STAGE_ELEMS;
        const saddr_t k_s = sadd(smem_s, stage);                     // for ldmatrix
        const saddr_t v_s = sadd(smem_s, stage + BLOCK_K * HEAD_DIM);
        scalar_t* v_tile = smem + stage + BLOCK_K * HEAD_DIM;        // for the inf/NaN test

        // 1. tile j + 1 starts copying into the other stage (the lean rung: and its V flag is read); wait for
        //    tile j's copies
#if FA2_LEAN
        int next_v_flag = 0;
#endif
        if (tile + 1 < n_tiles) {
            const int next = ((tile + 1) & 1) * STAGE_ELEMS;
#if FA2_LEAN
            // a tile that lies inside n_k (all but a last partial one) is copied with no test per chunk, as
            // FlashAttention-2 copies even tiles (Is_even_MN): one uniform test here instead of one per chunk
            if (k_start + 2 * BLOCK_K <= n_k) {
                copy_rows<BLOCK_K, false>(smem + next, sadd(smem_s, next), k_bh, k_start + BLOCK_K, n_k, tid);
                copy_rows<BLOCK_K, false>(smem + next + BLOCK_K * HEAD_DIM, sadd(smem_s, next + BLOCK_K * HEAD_DIM),
                                          v_bh, k_start + BLOCK_K, n_k, tid);
            } else
#endif
            {
                copy_rows<BLOCK_K>(smem + next, sadd(smem_s, next), k_bh, k_start + BLOCK_K, n_k, tid);
                copy_rows<BLOCK_K>(smem + next + BLOCK_K * HEAD_DIM, sadd(smem_s, next + BLOCK_K * HEAD_DIM), v_bh,
                                   k_start + BLOCK_K, n_k, tid);
            }
#if FA2_LEAN
            next_v_flag = v_flags_bh[tile + 1];
#endif
        }
        cp_async_commit();                           // (an empty group at the last tile keeps the count)
        cp_async_wait<1>();

#if FA2_LEAN
        // 2. only a tile the pre-pass flagged (uniform: no divergence) rewrites the inf/NaN in the V chunks
        //    this thread copied (the terms it drops are added back in step 7); any other tile tests nothing.
        //    The barrier makes every thread's copies (and rewrites) visible to the others' ldmatrix.
        if (v_flag) {
#pragma unroll
            for (int i = 0; i < BLOCK_K * CHUNKS / NUM_THREADS; ++i) {       // (the chunks of copy_rows)
                uint4* w = reinterpret_cast<uint4*>(v_tile + swz(tid / CHUNKS + i * (NUM_THREADS / CHUNKS), tid % CHUNKS));
                const uint4 x = *w;
                if (chunk_non_finite(x)) *w = finite_part(x);
            }
        }
        __syncthreads();
        const bool tile_has_non_finite_v = v_flag != 0;
#else
        // 2. inf/NaN in the V chunks this thread copied: test each, rewrite only a bad one
        //    (the terms it drops are added back in step 7); the barrier tells every thread
        bool v_had_non_finite = false;
#pragma unroll
        for (int i = 0; i < BLOCK_K * CHUNKS / NUM_THREADS; ++i) {           // (the chunks of copy_rows)
            uint4* w = reinterpret_cast<uint4*>(v_tile + swz(tid / CHUNKS + i * (NUM_THREADS / CHUNKS), tid % CHUNKS));
            const uint4 x = *w;
            if (chunk_non_finite(x)) {
                v_had_non_finite = true;
                *w = finite_part(x);
            }
        }
        const bool tile_has_non_finite_v = __syncthreads_or(v_had_non_finite) != 0;
#endif

        // 3. S = Q K_j^T. B = K^T: b0, b1 of score tile n are K[key 8n + g][16ds + 2t (+8)].
        //    ldmatrix.x4 for tiles n, n + 1: lane L names key 8n + 8(L / 16) + L % 8, chunk 2ds + (L / 8) % 2;
        //    each B fragment serves the warp's M_TILES m-tiles
        float s[M_TILES][S_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][n][i] = 0.f;
#pragma unroll
        for (int ds = 0; ds < D_STEPS; ++ds) {
#if Q_IN_REGS
            const unsigned (*a)[4] = &q_frag[ds];    // a[0]: the A fragment of the warp's one m-tile
#else
            unsigned a[M_TILES][4];                  // (32-row warps) Q's A fragments, from shared memory
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                ldmatrix_x4(a[mt], sadd(smem_s, Q_OFFSET + swz(warp * WARP_ROWS + 16 * mt + lane % 16,
                                                               2 * ds + lane / 16)), false);
#endif
#pragma unroll
            for (int n = 0; n < S_TILES; n += 2) {
                unsigned b[4];
                ldmatrix_x4(b, sadd(k_s, swz(n * 8 + 8 * (lane / 16) + lane % 8, 2 * ds + (lane / 8) % 2)), false);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_16x8x16(s[mt][n], a[mt], b);
                    mma_16x8x16(s[mt][n + 1], a[mt], b + 2);
                }
            }
        }

        // 4. scale into log2 units; mask (past n_k, above the causal diagonal) only in a tile
        //    that reaches past n_k or past this warp's first row's diagonal (the same for the warp);
        //    the lean rung's first loop (masked = 0) has no mask code at all
        const bool needs_mask = k_start + BLOCK_K > n_k ||
                                (causal && k_start + BLOCK_K - 1 > warp_q0 + n_k - n_q);
        float tile_max[M_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            tile_max[mt][0] = tile_max[mt][1] = NEG_INF;
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int h = i / 2;
                    float x = s[mt][n][i] * scale_log2;
                    if (masked && needs_mask) {
                        const int key = k_start + n * 8 + 2 * t + i % 2;
                        if (key >= n_k || (causal && key > (row_g + 16 * mt + 8 * h) + n_k - n_q)) x = NEG_INF;
                    }
                    s[mt][n][i] = x;
                    tile_max[mt][h] = fmaxf(tile_max[mt][h], x);
                }
        }

        // 5. the online-softmax step for each row (a row's 4 lanes form a quad), in base 2;
        //    each p is rounded to 16 bits as soon as it is made: p16[mt][n][h] holds keys 8n + 2t,
        //    8n + 2t + 1 of row (row_g + 16 mt + 8 h), the registers of the A fragment of P V (half of s's)
        float alpha[M_TILES][2], m_safe[M_TILES][2], row_sum[M_TILES][2];
#if LAZY_RESCALE
        bool moved = false;                          // did the max of one of this lane's rows move up?
#endif
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_new = fmaxf(m2[mt][h], group_max<4>(tile_max[mt][h]));
                m_safe[mt][h] = safe_max(m_new);
#if LAZY_RESCALE
                // m_new >= m2 and neither is NaN (fmaxf drops NaN scores), so m_new != m2 means the max
                // moved up. A row whose max did not move gets alpha = 1.f, not ex2(0); one that still sees
                // nothing (-inf before and after) is no move either and keeps 2^(-inf - 0) = 0, as NumPy
                // has it (its l and o are 0). ex2 is computed either way: written as "up ? ex2 : 1",
                // NVVM branches around it, and ptxas then spills at d = 64 with 128-row blocks.
                const bool up = m_new != m2[mt][h];
                const float a = fast_exp2(m2[mt][h] - m_safe[mt][h]);
                alpha[mt][h] = up || m2[mt][h] == NEG_INF ? a : 1.f;
                moved |= up;
#else
                alpha[mt][h] = fast_exp2(m2[mt][h] - m_safe[mt][h]);
#endif
                m2[mt][h] = m_new;
                row_sum[mt][h] = 0.f;
            }
        unsigned p16[M_TILES][S_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float p0 = fast_exp2(s[mt][n][2 * h] - m_safe[mt][h]);        // masked: 2^-inf = 0
                    const float p1 = fast_exp2(s[mt][n][2 * h + 1] - m_safe[mt][h]);
                    row_sum[mt][h] += p0 + p1;
                    p16[mt][n][h] = pack_float2(p0, p1);
                }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) l[mt][h] = alpha[mt][h] * l[mt][h] + group_sum<4>(row_sum[mt][h]);
#if LAZY_RESCALE
        const bool rescale = __any_sync(0xffffffffu, moved);    // one answer per warp: no divergence
#else
        const bool rescale = true;
#endif
        if (rescale) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int n = 0; n < O_TILES; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) o[mt][n][i] *= alpha[mt][i / 2];
        }

        // (for step 7, only when V held inf or NaN: bit 2n + e of p_zero_bits[mt][h] is set when
        //  key 8n + 2t + e of row (row_g + 16 mt + 8 h) has p = 0 as rounded for the mma)
        unsigned p_zero_bits[M_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) p_zero_bits[mt][0] = p_zero_bits[mt][1] = 0u;
        if (tile_has_non_finite_v)
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if ((p16[mt][n][h] & 0xffffu) == 0u) p_zero_bits[mt][h] |= 1u << (2 * n);
                        if ((p16[mt][n][h] >> 16) == 0u) p_zero_bits[mt][h] |= 1u << (2 * n + 1);
                    }

        // 6. o += P V_j. P's A fragment for keys 16ks .. +15 is the (rounded) C fragments of score
        //    tiles 2ks and 2ks + 1 (no shared memory). B = V: b0, b1 of output tile n are
        //    V[key 16ks + 2t (+8), +1][column 8n + g]: ldmatrix.x4.trans for tiles n, n + 1,
        //    lane L names key 16ks + 8((L / 8) % 2) + L % 8, chunk n + L / 16; each B fragment serves
        //    the warp's M_TILES m-tiles
#pragma unroll
        for (int ks = 0; ks < KEY_STEPS; ++ks) {
#pragma unroll
            for (int n = 0; n < O_TILES; n += 2) {
                unsigned b[4];
                ldmatrix_x4(b, sadd(v_s, swz(ks * 16 + 8 * ((lane / 8) % 2) + lane % 8, n + lane / 16)), true);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    const unsigned p_frag[4] = {p16[mt][2 * ks][0], p16[mt][2 * ks][1], p16[mt][2 * ks + 1][0],
                                                p16[mt][2 * ks + 1][1]};
                    mma_16x8x16(o[mt][n], p_frag, b);
                    mma_16x8x16(o[mt][n + 1], p_frag, b + 2);
                }
            }
        }

        // 7. (only for a tile whose V held inf or NaN; the same for the whole block) the terms
        //    p * v that step 6 left out: for v = inf or NaN and p > 0, p * v is v itself; p = 0
        //    adds nothing. Key j's p of rows g, g + 8 (of each m-tile) is in lane 4g + (j % 8) / 2,
        //    which passes its p_zero bits by a shuffle. (As flash_attention_mma_async.cu.)
        if (tile_has_non_finite_v) {
            const int n_keys = min(BLOCK_K, n_k - k_start);
#pragma unroll 1
            for (int j = 0; j < n_keys; ++j) {
                bool adds[M_TILES][2];
                bool any = false;
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const unsigned bits = __shfl_sync(0xffffffffu, p_zero_bits[mt][h], 4 * g + (j % 8) / 2);
                        adds[mt][h] = !((bits >> (2 * (j / 8) + j % 2)) & 1u);
                        any |= adds[mt][h];
                    }
                if (!any) continue;
                const scalar_t* v_row = v_bh + (long long)(k_start + j) * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < O_TILES; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const scalar_t x = v_row[n * 8 + e];
                        if (!non_finite(x)) continue;
#pragma unroll
                        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                            for (int h = 0; h < 2; ++h)
                                if (adds[mt][h]) o[mt][n][2 * h + e] += to_float(x);
                    }
            }
        }

#ifdef FA_TRACE
        if (t == 0)
            for (int mt = 0; mt < M_TILES; ++mt)
                for (int h = 0; h < 2; ++h)
                    if (trace_slot[mt][h] >= 0) {
                        float* rec = trace + ((bh * n_trace_rows + trace_slot[mt][h]) * trace_tiles + tile) * TRACE_FIELDS;
                        rec[0] = m2[mt][h] * LN2; rec[1] = alpha[mt][h]; rec[2] = l[mt][h];
                    }
#endif
        __syncthreads();                             // everyone is done with this stage
#if FA2_LEAN
        v_flag = next_v_flag;
#endif
    }

    // ---- finalize: one reciprocal per row; 32-bit stores; rows past n_q write nothing --------
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_g + 16 * mt + 8 * h;
            if (row >= n_q) continue;
            const bool seen = l[mt][h] != 0.f;       // false: nothing visible -> 0, lse -inf
            const float inv_l = seen ? 1.f / l[mt][h] : 0.f;
            unsigned* out_row = reinterpret_cast<unsigned*>(out + (bh * n_q + row) * HEAD_DIM);
#pragma unroll
            for (int n = 0; n < O_TILES; ++n)
                out_row[n * 4 + t] = pack_float2(o[mt][n][2 * h] * inv_l, o[mt][n][2 * h + 1] * inv_l);
            if (t == 0) lse[bh * n_q + row] = seen ? (m2[mt][h] + log2f(l[mt][h])) * LN2 : NEG_INF;
        }
}
