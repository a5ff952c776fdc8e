// paged_decode_split.cu - decoding attention over a paged KV cache, written to run at the
// speed of memory: one block per (sequence, GQA group, split), 16-byte vector loads, and
// several key rows in flight per warp.
//
// The problem is the one of paged_decode.cu (one new query per head, a long paged history,
// vLLM layout, Kwon et al. 2023, Sec. 4.1-4.2):
//     k_cache, v_cache   (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
//     block_tables       (num_seqs, max_blocks_per_seq) int32     logical page -> physical page
//     seq_lens           (num_seqs,) int32
// Token t of sequence s lives in page block_tables[s][t / BLOCK_SIZE], slot t % BLOCK_SIZE, and
// nothing at or past seq_len is ever read. Decoding does a few FLOPs per byte of K/V read (one
// multiply-add per query head for each value: 4 per byte for 4 heads in fp16): it is
// bound by how fast the cache streams from HBM, so everything here is about the loads.
//
// 1. GQA sharing. One block serves HEADS_PER_BLOCK query heads of one group (all of it when the
//    group has at most 4 heads), so each K/V row is read from HBM once per group, not once per
//    query head (Ainslie et al. 2023).
// 2. Vector loads. A key row of HEAD_DIM values is read by LANES lanes of a warp, VEC values
//    (16 bytes: 8 halves or 4 floats) per lane per load: at d = 128 in fp16 one row is 256 bytes
//    = 16 lanes x 16 bytes, so a warp reads 2 keys' rows per instruction, each row contiguous.
//    (When 16 bytes do not divide a row, VEC is 1: one value per load.)
// 3. Loads in flight. Each lane group takes UNROLL keys per step and issues all their K and V
//    loads before it uses any of them. The block's 4 warps take different keys, and each lane
//    group keeps its own running state (m, l, o) for its keys: NUM_STATES states per block.
//    With PREFETCH=1 a group issues the loads of its next step before it absorbs this one, so a
//    step's rows are always in flight, also while it computes (software pipelining in registers:
//    two steps' rows live at once, so the build asks for MIN_BLOCKS = 3 blocks per SM, not 4). The
//    same keys are absorbed in the same order: the output is bitwise that of PREFETCH=0.
//    With ASYNC_STAGES=S (2..4) the rows do not wait in registers at all: each thread copies its
//    16-byte pieces of K and V straight into a ring of S steps in shared memory (cp.async, sm_80+),
//    S - 1 steps ahead of the step it absorbs, and waits only for the oldest of its copies
//    (cp.async.wait_group S - 1 after issuing the next: S groups were in flight). The copies of
//    S - 1 steps stay in flight while a step is absorbed, and they hold no registers, so 4 blocks
//    still fit on an SM. A thread reads back only what it copied itself and refills only the slot
//    it read a step ago, so no barrier is needed. The output is again bitwise that of the plain
//    build.
// 4. At the end the block merges its NUM_STATES states in shared memory, in a fixed order, by
//    the rule of lessons.merge_states: m = max m_i, l = sum exp(m_i - m) l_i, o likewise.
// 5. Split-KV (flash-decoding, Dao, Haziza, Massa, Sizov 2023): with few sequences a grid of one
//    block per (sequence, group) leaves most SMs idle, so the pages of a sequence are cut into
//    num_splits contiguous ranges (split s: pages [s * per, (s + 1) * per), per = ceil(pages /
//    num_splits), as in paged_decode.cu), one block each; each writes its partial (m, l, o) and
//    merge_split_states folds them with the same rule, then out = o / l, lse = m + log(l).
//    With write_partials == 0 (one split) the block writes out and lse itself.
//
// Per key and head: s = scale * q . k (each lane's partial dot, then a butterfly over the LANES
// lanes of the row), and per step of UNROLL keys one online-softmax update:
//     m_new = max(m, s_1..s_U);  alpha = exp(m - m_new);  p_u = exp(s_u - m_new)
//     (once m has settled it rarely moves: when m_new == m, alpha is exactly 1 and the rescale of
//     l and o is skipped, which changes no bit of the result)
//     l = alpha l + sum_u p_u;   o = alpha o + sum_u p_u v_u   (a key with p = 0 adds nothing:
//     never 0 * v, so NaN in a value its row does not weigh cannot reach it).
// Keys past the end of the split load nothing and score -inf. (Dao 2023, FA-2 Alg. 1.)
// When a row's lanes hold exactly one (key, head) pair each (SCATTER_SOFTMAX: d = 128 fp16, 4 heads,
// 4 keys, 16 lanes), the dots are summed by a reduce-scatter and each lane does the softmax of one
// pair, instead of every lane doing all of them: fewer shuffles and exps per byte read.
//
// Launch: paged_decode_gqa_split  grid = (num_heads / HEADS_PER_BLOCK, num_seqs, num_splits), block = 128
//         merge_split_states      grid = (num_heads, num_seqs),                               block = 128
// Defines: HEAD_DIM (1..256), BLOCK_SIZE (1..32), HEADS_PER_BLOCK (1..4, divides the group), FA_DTYPE,
//          PREFETCH (0 or 1, default 0), ASYNC_STAGES (0: off, default; 2..4: the cp.async ring's steps),
//          MIN_BLOCKS (the launch bounds' blocks per SM, default 4).
#include "common.cuh"
#include "async_copy.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d>"
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 16
#endif
#ifndef HEADS_PER_BLOCK
#define HEADS_PER_BLOCK 1
#endif
// 1: load step i + 1's rows while step i is absorbed (software pipelining in registers)
#ifndef PREFETCH
#define PREFETCH 0
#endif
// 2..4: K/V rows copied into a ring of that many steps in shared memory with cp.async (0: off)
#ifndef ASYNC_STAGES
#define ASYNC_STAGES 0
#endif
// blocks per SM the launch bounds ask for: 4 (<= 128 registers per thread), or fewer when the
// prefetched rows need more registers
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 4
#endif
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)

// values per 16-byte load; 1 when a row is not a whole number of 16-byte pieces
#define VEC16 (FA_DTYPE == 0 ? 4 : 8)
#define VEC ((HEAD_DIM % VEC16) == 0 ? VEC16 : 1)
// loads per row, and lanes per row: the smallest power of two >= N_VEC, at most 32
#define N_VEC (HEAD_DIM / VEC)
#define LANES (N_VEC > 16 ? 32 : N_VEC > 8 ? 16 : N_VEC > 4 ? 8 : N_VEC > 2 ? 4 : N_VEC > 1 ? 2 : 1)
#define CHUNKS ((N_VEC + LANES - 1) / LANES)           // loads per lane per row
#define PER_LANE (CHUNKS * VEC)                         // values of a row each lane holds (<= 8)
#define KEYS_PER_WARP (32 / LANES)                      // rows a warp reads side by side
#define NUM_STATES (NUM_WARPS * KEYS_PER_WARP)          // running states per block, merged at the end
// 32-bit registers one key's K and V take while in flight; UNROLL (<= 4) keys per step keep <= 32 of them
#define WORDS_PER_LOAD (VEC == 1 ? 1 : 4)
#define UNROLL_FIT (32 / (2 * CHUNKS * WORDS_PER_LOAD))
#if FA_DTYPE == 2
#define UNROLL_MAX 2        // bfloat16 widens by a shift, and ptxas then holds the rows as floats: 4 spill
#else
#define UNROLL_MAX 4
#endif
#define UNROLL (UNROLL_FIT > UNROLL_MAX ? UNROLL_MAX : UNROLL_FIT > 0 ? UNROLL_FIT : 1)
// the reduce-scatter softmax when the group's lanes hold exactly one (key, head) pair each
// (d = 128 fp16 or d = 64 fp32 with 4 heads per block: 16 lanes, 4 keys x 4 heads)
#define SCATTER_SOFTMAX (UNROLL * HEADS_PER_BLOCK == LANES && LANES >= 2)

static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 256, "HEAD_DIM must be in 1..256");
static_assert(BLOCK_SIZE >= 1 && BLOCK_SIZE <= 32, "BLOCK_SIZE must be in 1..32");
static_assert(HEADS_PER_BLOCK >= 1 && HEADS_PER_BLOCK <= 4, "HEADS_PER_BLOCK must be in 1..4");
static_assert(PREFETCH == 0 || PREFETCH == 1, "PREFETCH must be 0 or 1");
static_assert(MIN_BLOCKS >= 1 && MIN_BLOCKS <= 16, "MIN_BLOCKS must be in 1..16");
static_assert(ASYNC_STAGES == 0 || (ASYNC_STAGES >= 2 && ASYNC_STAGES <= 4), "ASYNC_STAGES must be 0 or in 2..4");
static_assert(ASYNC_STAGES == 0 || PREFETCH == 0, "PREFETCH and ASYNC_STAGES are two ways to the same end: pick one");
static_assert(ASYNC_STAGES == 0 || VEC != 1, "ASYNC_STAGES copies 16-byte pieces: the row must be a whole number of them");
static_assert(PER_LANE <= 8, "a lane holds at most 8 values of a row");

// One load of a row: VEC values as raw words (16 bytes, or one value widened to a word).
struct RowLoad {
    uint4 w[CHUNKS];
};

// Lane `sub` of a row's LANES lanes holds elements c = (j * LANES + sub) * VEC + e of the row,
// j < CHUNKS, e < VEC; j * LANES + sub >= N_VEC: nothing (its values count as 0).
__device__ __forceinline__ bool chunk_in_row(int j, int sub) { return j * LANES + sub < N_VEC; }

__device__ __forceinline__ void load_row(RowLoad& r, const scalar_t* __restrict__ row, int sub, bool valid) {
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        r.w[j] = make_uint4(0u, 0u, 0u, 0u);
        if (valid && chunk_in_row(j, sub)) {
            const int c = (j * LANES + sub) * VEC;
#if (HEAD_DIM % VEC16) == 0
            r.w[j] = *reinterpret_cast<const uint4*>(row + c);    // 16 bytes: ld.global.nc.v4
#else
            const scalar_t x = row[c];
#if FA_DTYPE == 0
            r.w[j].x = __float_as_uint(x);
#else
            r.w[j].x = x;
#endif
#endif
        }
    }
}

// Value e (< VEC) of load j, as float32.
__device__ __forceinline__ float row_value(const RowLoad& r, int j, int e) {
#if (HEAD_DIM % VEC16) != 0
#if FA_DTYPE == 0
    return __uint_as_float(r.w[j].x);
#else
    return to_float((scalar_t)r.w[j].x);
#endif
#else
    const unsigned word = e / (VEC / 4) == 0 ? r.w[j].x : e / (VEC / 4) == 1 ? r.w[j].y
                        : e / (VEC / 4) == 2 ? r.w[j].z : r.w[j].w;
#if FA_DTYPE == 0
    return __uint_as_float(word);
#else
    return to_float((scalar_t)(e % 2 ? word >> 16 : word & 0xffffu));
#endif
#endif
}

// All PER_LANE values of a lane's part of a row, as float32 (value j * VEC + e: row_value(r, j, e)).
__device__ __forceinline__ void row_values(const RowLoad& r, float (&x)[PER_LANE]) {
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) x[j * VEC + e] = row_value(r, j, e);
}

// The K and V rows of one step of a lane group: UNROLL keys, all loads issued before any is used.
struct StepRows {
    RowLoad k[UNROLL], v[UNROLL];
    bool valid[UNROLL];
};

// Where the row of key `key` (of KV head kv_head) starts in the cache, in elements. When UNROLL divides
// BLOCK_SIZE, `page` is the key's page, looked up by the caller ahead of time; otherwise the key looks
// its own page up here.
__device__ __forceinline__ long long row_offset(const int* __restrict__ table, int page, int key, int num_kv_heads,
                                                int kv_head) {
#if BLOCK_SIZE % UNROLL != 0
    page = table[key / BLOCK_SIZE];
#endif
    return (((long long)page * BLOCK_SIZE + key % BLOCK_SIZE) * num_kv_heads + kv_head) * HEAD_DIM;
}

// Issue the loads of keys key0 .. key0 + UNROLL - 1 that lie before key_end (the others load nothing).
// When UNROLL divides BLOCK_SIZE the UNROLL keys share one page, `page`, looked up by the caller
// ahead of time; otherwise each key looks its own page up here.
__device__ __forceinline__ void load_step(StepRows& r, int key0, int key_end, int page,
                                          const int* __restrict__ table, const scalar_t* __restrict__ k_cache,
                                          const scalar_t* __restrict__ v_cache, int num_kv_heads, int kv_head,
                                          int sub) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int key = key0 + u;
        r.valid[u] = key < key_end;
        const long long off = r.valid[u] ? row_offset(table, page, key, num_kv_heads, kv_head) : 0;
        load_row(r.k[u], k_cache + off, sub, r.valid[u]);
        load_row(r.v[u], v_cache + off, sub, r.valid[u]);
    }
}

// The page of key `key` (0 past key_end, and 0 when each key looks its page up in load_step).
__device__ __forceinline__ int page_of(const int* __restrict__ table, int key, int key_end) {
#if BLOCK_SIZE % UNROLL == 0
    return key < key_end ? table[key / BLOCK_SIZE] : 0;
#else
    return 0;
#endif
}

#if ASYNC_STAGES
// The ring: slot [stage][u][0 = K, 1 = V][j][thread] holds load j of key u's row of one step, for
// each thread its own 16-byte pieces (thread-minor, so a warp's 16-byte accesses are contiguous).
// At most 2 * UNROLL * CHUNKS <= 8 pieces per thread and step (UNROLL_FIT): <= 16 KiB per step.
typedef uint4 Ring[ASYNC_STAGES][UNROLL][2][CHUNKS][NUM_THREADS];
static_assert(sizeof(Ring) <= 48 * 1024, "the ring must fit in 48 KiB of static shared memory: fewer ASYNC_STAGES");

// Copy the K and V pieces of keys key0 .. key0 + UNROLL - 1 that lie before key_end into ring slot
// `stage` (the others copy nothing); pages as in load_step.
__device__ __forceinline__ void copy_step(Ring& ring, int stage, int key0, int key_end, int page,
                                          const int* __restrict__ table, const scalar_t* __restrict__ k_cache,
                                          const scalar_t* __restrict__ v_cache, int num_kv_heads, int kv_head,
                                          int sub) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int key = key0 + u;
        if (key < key_end) {
            const long long off = row_offset(table, page, key, num_kv_heads, kv_head);
#pragma unroll
            for (int j = 0; j < CHUNKS; ++j)
                if (chunk_in_row(j, sub)) {
                    const int c = (j * LANES + sub) * VEC;
                    cp_async16(&ring[stage][u][0][j][threadIdx.x], k_cache + off + c);
                    cp_async16(&ring[stage][u][1][j][threadIdx.x], v_cache + off + c);
                }
        }
    }
}

// Read ring slot `stage` back into registers as load_step would have loaded it: zeros for keys
// past key_end and for pieces past the row (this thread copied exactly the others).
__device__ __forceinline__ void read_step(StepRows& r, const Ring& ring, int stage, int key0, int key_end, int sub) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        r.valid[u] = key0 + u < key_end;
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) {
            const bool copied = r.valid[u] && chunk_in_row(j, sub);
            r.k[u].w[j] = copied ? ring[stage][u][0][j][threadIdx.x] : make_uint4(0u, 0u, 0u, 0u);
            r.v[u].w[j] = copied ? ring[stage][u][1][j][threadIdx.x] : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}
#endif

// One head's running state (m, l, o) moved to the new max m_new: rescaled by alpha = exp(m - m_new) where the max
// moved, left as it is where it did not (alpha would be exactly 1).
__device__ __forceinline__ void move_max(float& m, float& l, float (&o)[PER_LANE], float m_new) {
    if (m_new != m) {
        const float alpha = correction_factor(m, m_new);
        l *= alpha;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) o[i] *= alpha;
        m = m_new;
    }
}

#if SCATTER_SOFTMAX && ASYNC_STAGES
// One level of the reduce-scatter of absorb_step, for the cp.async build: lanes OFF apart swap
// halves of their OFF first pairs, a lane keeping the upper half where bit OFF of its `sub` is set,
// and add what they get; then the next level with OFF / 2. A template per level makes every loop
// bound, so every index of v, a constant. (The plain and prefetch builds keep the loop of
// absorb_step, which NVRTC leaves rolled with v in local memory and ptxas then unrolls into
// registers; in the larger cp.async kernel ptxas does not, and v stayed in local memory, 64
// bytes. Written this way for all builds, the prefetch build spilled 16 bytes at its 168
// registers, so those two keep the code they were measured and tested with.)
template <int OFF>
__device__ __forceinline__ void scatter_level(float (&v)[LANES], int sub) {
    const bool upper = (sub & OFF) != 0;
#pragma unroll
    for (int i = 0; i < OFF; ++i) {
        const float send = upper ? v[i] : v[i + OFF];
        const float keep = upper ? v[i + OFF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
    if constexpr (OFF > 1) scatter_level<OFF / 2>(v, sub);
}
#endif

// Absorb one step's UNROLL keys (key0.., loaded in r) into this lane group's running states
// (m, l, o) of its HEADS_PER_BLOCK heads: the online-softmax update of the header.
__device__ __forceinline__ void absorb_step(const StepRows& r, int key0, int key_end, float scale,
                                            const float (&qv)[HEADS_PER_BLOCK][PER_LANE],
                                            float (&m)[HEADS_PER_BLOCK], float (&l)[HEADS_PER_BLOCK],
                                            float (&o)[HEADS_PER_BLOCK][PER_LANE], int lane, int sub) {
    // scores: each lane's partial dot over its part of the row, for every key and head
    float s[UNROLL][HEADS_PER_BLOCK];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float kf[PER_LANE];
        row_values(r.k[u], kf);
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) dot += qv[h][i] * kf[i];
            s[u][h] = dot;
        }
    }
#if SCATTER_SOFTMAX
    // The group's LANES lanes hold partial dots of LANES (key, head) pairs: a reduce-scatter
    // leaves lane `sub` with the whole dot of pair sub (head sub / UNROLL, key sub % UNROLL)
    // in LANES - 1 shuffles (a butterfly per pair would take LANES * log2(LANES)). Each lane
    // then does the softmax of its own pair (one exp instead of one per pair), the heads' max
    // and sum over the group's UNROLL keys take log2(UNROLL) shuffles, and the results are
    // broadcast back to every lane of the group for the P V update.
    float v[LANES];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) v[h * UNROLL + u] = s[u][h];
#if ASYNC_STAGES
    scatter_level<LANES / 2>(v, sub);
#else
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2) {
        const bool upper = (sub & off) != 0;       // keep the upper half of the pairs, send the lower
#pragma unroll
        for (int i = 0; i < off; ++i) {
            const float send = upper ? v[i] : v[i + off];
            const float keep = upper ? v[i + off] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
    }
#endif
    const int my_head = sub / UNROLL, group_lane = lane - sub;     // first lane of this row's group
    const float s_mine = key0 + sub % UNROLL < key_end ? v[0] * scale : NEG_INF;
    float m_old = m[0];
#pragma unroll
    for (int h = 1; h < HEADS_PER_BLOCK; ++h) m_old = my_head == h ? m[h] : m_old;
    const float m_mine = fmaxf(m_old, group_max<UNROLL>(s_mine));  // max over this head's UNROLL keys
    const float p_mine = expf(s_mine - safe_max(m_mine));
    const float sum_mine = group_sum<UNROLL>(p_mine);
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        const float m_new = __shfl_sync(0xffffffffu, m_mine, group_lane + h * UNROLL);
        const float p_sum = __shfl_sync(0xffffffffu, sum_mine, group_lane + h * UNROLL);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) s[u][h] = __shfl_sync(0xffffffffu, p_mine, group_lane + h * UNROLL + u);
        move_max(m[h], l[h], o[h], m_new);
        l[h] += p_sum;
    }
#else
    // each pair's dot summed by a butterfly over the row's LANES lanes (all 32 lanes shuffle),
    // then one online-softmax update per head for the UNROLL keys
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            const float dot = group_sum<LANES>(s[u][h]);
            s[u][h] = r.valid[u] ? dot * scale : NEG_INF;
        }
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        float m_new = m[h];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][h]);
        move_max(m[h], l[h], o[h], m_new);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            s[u][h] = expf(s[u][h] - safe_max(m_new));      // p
            l[h] += s[u][h];
        }
    }
#endif
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float vf[PER_LANE];
        row_values(r.v[u], vf);
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            const float p = s[u][h];
            if (p != 0.f) {                            // p = 0 adds nothing, never 0 * v
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) o[h][i] += p * vf[i];
            }
        }
    }
}

struct SplitShared {
    float m[NUM_STATES][HEADS_PER_BLOCK];
    float l[NUM_STATES][HEADS_PER_BLOCK];
    float o[NUM_STATES][HEADS_PER_BLOCK][HEAD_DIM];
};

// Pages [split * per, min((split + 1) * per, n_pages)) of one sequence, for the HEADS_PER_BLOCK
// query heads head0.. of kv head head0 / group. Writes (part_m, part_l, part_o) at
// ((seq * num_heads + head) * num_splits + split) when write_partials, else out and lse.
// q, out: (num_seqs, num_heads, HEAD_DIM); lse: (num_seqs, num_heads) float32;
// part_m, part_l: (num_seqs, num_heads, num_splits) float32; part_o: (..., HEAD_DIM) float32.
// __launch_bounds__(128, MIN_BLOCKS): MIN_BLOCKS blocks per SM (4: up to 128 registers per thread).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
paged_decode_gqa_split(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                       const scalar_t* __restrict__ v_cache, const int* __restrict__ block_tables,
                       const int* __restrict__ seq_lens, int max_blocks_per_seq, int num_heads,
                       int num_kv_heads, float scale, int num_splits, int write_partials,
                       float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o,
                       scalar_t* __restrict__ out, float* __restrict__ lse) {
#if ASYNC_STAGES
    // the ring while the keys stream, then (after every copy has landed and a barrier) the merge
    __shared__ union {
        Ring ring;
        SplitShared merge;
    } smem;
    SplitShared& sh = smem.merge;
#else
    __shared__ SplitShared sh;
#endif
    const int seq = blockIdx.y, split = blockIdx.z;
    const int head0 = blockIdx.x * HEADS_PER_BLOCK;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key_in_warp = lane / LANES, sub = lane % LANES;
    const int state = warp * KEYS_PER_WARP + key_in_warp;

    const int seq_len = seq_lens[seq];
    const int n_pages = min((seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE, max_blocks_per_seq);
    const int per_split = (n_pages + num_splits - 1) / num_splits;
    const int page_begin = min(split * per_split, n_pages);
    const int page_end = min(page_begin + per_split, n_pages);
    const int key_begin = page_begin * BLOCK_SIZE;
    const int key_end = min(page_end * BLOCK_SIZE, seq_len);
    const int* __restrict__ table = block_tables + (long long)seq * max_blocks_per_seq;

    // this lane's part of each query, as float32
    float qv[HEADS_PER_BLOCK][PER_LANE];
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        RowLoad r;
        load_row(r, q + ((long long)seq * num_heads + head0 + h) * HEAD_DIM, sub, true);
        row_values(r, qv[h]);
    }

    float m[HEADS_PER_BLOCK], l[HEADS_PER_BLOCK], o[HEADS_PER_BLOCK][PER_LANE];
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) o[h][i] = 0.f;
    }

    // Each step a warp takes KEYS_PER_WARP * UNROLL consecutive keys; lane group g takes keys
    // first + g * UNROLL + u. The loop bound is the same for every lane of a warp (shuffles inside).
    // When UNROLL divides BLOCK_SIZE a group's UNROLL keys lie in one page (they start at a multiple
    // of UNROLL, and a split starts on a page), so the group looks up one page per step, one step
    // ahead of its loads (the look-up is off the path from one step's loads to the next's).
    const int keys_per_step = NUM_WARPS * KEYS_PER_WARP * UNROLL;
    int first = key_begin + warp * KEYS_PER_WARP * UNROLL;
#if PREFETCH
    // Software pipelining in registers: the rows of step i + 1 are loaded while step i is absorbed,
    // so a lane group always has a step's loads in flight (not only between its steps). Two sets of
    // registers take turns, `even` for steps 0, 2, 4, ... and `odd` for 1, 3, 5, ...: the loop body is
    // two steps, so no step's rows are copied from one set to the other (a copy would read the rows,
    // and so wait for them, at the end of every step). The two steps are written out: as an inner loop
    // over an array of two sets, NVRTC 12.9 spilled (68 bytes at d = 128 in fp16).
    StepRows even, odd;
    load_step(even, first + key_in_warp * UNROLL, key_end, page_of(table, first + key_in_warp * UNROLL, key_end),
              table, k_cache, v_cache, num_kv_heads, kv_head, sub);
    int page = page_of(table, first + key_in_warp * UNROLL + keys_per_step, key_end);
    // each pass of the loop is two steps: the even set's, then the odd set's; key0 is this group's first key
    for (int key0 = first + key_in_warp * UNROLL; first < key_end; first += keys_per_step, key0 += keys_per_step) {
        int page_after = page_of(table, key0 + 2 * keys_per_step, key_end);
        load_step(odd, key0 + keys_per_step, key_end, page, table, k_cache, v_cache, num_kv_heads, kv_head, sub);
        page = page_after;
        absorb_step(even, key0, key_end, scale, qv, m, l, o, lane, sub);
        first += keys_per_step;
        key0 += keys_per_step;
        if (first >= key_end) break;                             // the same for every lane of the warp
        page_after = page_of(table, key0 + 2 * keys_per_step, key_end);
        load_step(even, key0 + keys_per_step, key_end, page, table, k_cache, v_cache, num_kv_heads, kv_head, sub);
        page = page_after;
        absorb_step(odd, key0, key_end, scale, qv, m, l, o, lane, sub);
    }
#elif ASYNC_STAGES
    // A ring of ASYNC_STAGES steps in shared memory: before step i is absorbed, the copies of step
    // i + ASYNC_STAGES - 1 are issued into the slot step i - 1 used (read into registers and absorbed
    // already), one commit group per step (empty past the end, so the count stays the same), then
    // the thread waits until at most ASYNC_STAGES - 1 groups are in flight: step i's has landed.
    int key0 = first + key_in_warp * UNROLL;                     // this group's first key
    int page = page_of(table, key0, key_end);
#pragma unroll
    for (int i = 0; i < ASYNC_STAGES - 1; ++i) {
        const int next_page = page_of(table, key0 + (i + 1) * keys_per_step, key_end);
        copy_step(smem.ring, i, key0 + i * keys_per_step, key_end, page, table, k_cache, v_cache,
                  num_kv_heads, kv_head, sub);
        cp_async_commit();
        page = next_page;
    }
    int stage = 0;                                               // the slot of step i
    for (; first < key_end; first += keys_per_step, key0 += keys_per_step) {
        const int refill = stage == 0 ? ASYNC_STAGES - 1 : stage - 1;      // step i - 1's slot: step i + S - 1's
        const int next_page = page_of(table, key0 + ASYNC_STAGES * keys_per_step, key_end);
        copy_step(smem.ring, refill, key0 + (ASYNC_STAGES - 1) * keys_per_step, key_end, page, table, k_cache,
                  v_cache, num_kv_heads, kv_head, sub);
        cp_async_commit();
        page = next_page;
        cp_async_wait<ASYNC_STAGES - 1>();                       // step i's copies (this thread's) have landed
        StepRows r;
        read_step(r, smem.ring, stage, key0, key_end, sub);
        absorb_step(r, key0, key_end, scale, qv, m, l, o, lane, sub);
        stage = stage + 1 == ASYNC_STAGES ? 0 : stage + 1;
    }
    cp_async_wait<0>();                                          // nothing lands in the ring after this
    __syncthreads();                                             // every thread's, before it becomes sh
#else
    int page = page_of(table, first + key_in_warp * UNROLL, key_end);
    for (; first < key_end; first += keys_per_step) {
        const int key0 = first + key_in_warp * UNROLL;           // this group's first key
        const int next_page = page_of(table, key0 + keys_per_step, key_end);
        StepRows r;                                              // all loads first: 2 * UNROLL rows in flight
        load_step(r, key0, key_end, page, table, k_cache, v_cache, num_kv_heads, kv_head, sub);
        page = next_page;
        absorb_step(r, key0, key_end, scale, qv, m, l, o, lane, sub);
    }
#endif

    // the block's NUM_STATES states into shared memory
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        if (sub == 0) {
            sh.m[state][h] = m[h];
            sh.l[state][h] = l[h];
        }
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j)
            if (chunk_in_row(j, sub))
#pragma unroll
                for (int e = 0; e < VEC; ++e) sh.o[state][h][(j * LANES + sub) * VEC + e] = o[h][j * VEC + e];
    }
    __syncthreads();

    // merge them in state order: m = max m_i, beta_i = exp(m_i - m), l = sum beta_i l_i, o likewise
    for (int idx = threadIdx.x; idx < HEADS_PER_BLOCK * HEAD_DIM; idx += NUM_THREADS) {
        const int h = idx / HEAD_DIM, c = idx % HEAD_DIM;
        float m_all = NEG_INF;
        for (int i = 0; i < NUM_STATES; ++i) m_all = fmaxf(m_all, sh.m[i][h]);
        float l_all = 0.f, o_all = 0.f;
        for (int i = 0; i < NUM_STATES; ++i) {
            const float beta = correction_factor(sh.m[i][h], m_all);
            l_all += beta * sh.l[i][h];
            o_all += beta * sh.o[i][h][c];
        }
        const long long row = (long long)seq * num_heads + head0 + h;
        if (write_partials) {
            const long long st = row * num_splits + split;
            part_o[st * HEAD_DIM + c] = o_all;
            if (c == 0) {
                part_m[st] = m_all;
                part_l[st] = l_all;
            }
        } else {
            out[row * HEAD_DIM + c] = from_float(l_all != 0.f ? o_all / l_all : 0.f);
            if (c == 0) lse[row] = l_all != 0.f ? m_all + logf(l_all) : NEG_INF;
        }
    }
}

// Fold the num_splits partial states of one (seq, head) by the same rule, then out = o / l,
// lse = m + log(l) (0 and -inf when l == 0). First m over all splits (a strided max, then a block
// max); then warp w takes splits w, w + 4, ... (lane i columns i, i + 32, ...: coalesced loads,
// and the loads of different splits are independent, so several are in flight), and the 4 warps'
// sums are added in warp order in shared memory (the same order every run).
#define MERGE_COLS ((HEAD_DIM + 31) / 32)

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 4)
merge_split_states(const float* __restrict__ part_m, const float* __restrict__ part_l,
                   const float* __restrict__ part_o, int num_heads, int num_splits,
                   scalar_t* __restrict__ out, float* __restrict__ lse) {
    __shared__ float warp_max[NUM_WARPS];
    __shared__ float warp_l[NUM_WARPS];
    __shared__ float warp_o[NUM_WARPS][HEAD_DIM];
    const int head = blockIdx.x, seq = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long row = (long long)seq * num_heads + head;
    const float* __restrict__ pm = part_m + row * num_splits;
    const float* __restrict__ pl = part_l + row * num_splits;
    const float* __restrict__ po = part_o + row * num_splits * HEAD_DIM;

    float m = NEG_INF;
    for (int i = threadIdx.x; i < num_splits; i += NUM_THREADS) m = fmaxf(m, pm[i]);
    m = group_max<32>(m);
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    m = NEG_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, warp_max[w]);

    float l = 0.f, o[MERGE_COLS];
#pragma unroll
    for (int k = 0; k < MERGE_COLS; ++k) o[k] = 0.f;
#pragma unroll 4
    for (int i = warp; i < num_splits; i += NUM_WARPS) {
        const float beta = correction_factor(pm[i], m);
        l += beta * pl[i];
#pragma unroll
        for (int k = 0; k < MERGE_COLS; ++k) {
            const int c = lane + 32 * k;
            if (c < HEAD_DIM) o[k] += beta * po[(long long)i * HEAD_DIM + c];
        }
    }
    if (lane == 0) warp_l[warp] = l;
#pragma unroll
    for (int k = 0; k < MERGE_COLS; ++k) {
        const int c = lane + 32 * k;
        if (c < HEAD_DIM) warp_o[warp][c] = o[k];
    }
    __syncthreads();
    l = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) l += warp_l[w];
    for (int c = threadIdx.x; c < HEAD_DIM; c += NUM_THREADS) {
        float o_all = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) o_all += warp_o[w][c];
        out[row * HEAD_DIM + c] = from_float(l != 0.f ? o_all / l : 0.f);
    }
    if (threadIdx.x == 0) lse[row] = l != 0.f ? m + logf(l) : NEG_INF;
}
