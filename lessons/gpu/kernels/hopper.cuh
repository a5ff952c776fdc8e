// hopper.cuh - the Hopper (sm_90a) instructions of flash_attention_wgmma.cu, with CPU twins.
//
// Three things arrive with Hopper, and the Hopper rung of the ladder uses all three:
//
//   * TMA (the tensor memory accelerator): one thread names a box of a tensor (a tensor map made
//     on the host, cuTensorMapEncodeTiled) and the copy engine moves it into shared memory, with
//     rows past the tensor's edge filled with zeros and the 128-byte swizzle applied on the way.
//     No registers, no address arithmetic per thread: cp.async.bulk.tensor.
//   * mbarrier: a barrier object in shared memory that counts arrivals and bytes. The TMA copy
//     adds its bytes when they land (complete_tx); a thread waits for a phase to complete with
//     try_wait.parity. This is how a producer and its consumers hand stages to each other.
//   * wgmma: a warpgroup (4 warps, 128 threads) issues one 64 x N x 16 product whose B operand
//     (and optionally A) is read straight from shared memory through a 64-bit matrix descriptor;
//     the product runs asynchronously until wgmma.wait_group.
//
// The shared-memory layout the descriptors describe ("128-byte swizzle"): rows of 64 16-bit
// values (128 bytes); 8 consecutive rows form a 1024-byte atom; inside an atom the 16-byte chunk
// c of row r sits at chunk c ^ r. A head dim of 128 is two panels of 64 columns, one after the
// other. TMA writes exactly this layout (CU_TENSOR_MAP_SWIZZLE_128B); the swizzle acts on the
// shared address bits [4, 7) ^= [7, 10), so every tile starts on a 1024-byte boundary.
//   K-major operand (K tile for S = Q K^T, Q tile): element (row n, k) at
//       start + (n / 8) * SBO + (n % 8) * 128 + 2 k,  SBO = 1024; a 16-wide k step moves start by 32 bytes.
//   MN-major operand (V tile for O += P V, .trans): element (k, column n) at
//       start + (n / 64) * LBO + (k / 8) * SBO + (k % 8) * 128 + 2 (n % 64),  SBO = 1024, LBO = one panel.
// Descriptor bits: [0, 14) start >> 4, [16, 30) LBO >> 4, [32, 46) SBO >> 4, [49, 52) base offset (0 here:
// every tile starts on a 1024-byte boundary, so the swizzle's phase is the address's own), [62, 64)
// swizzle (1 = 128B). A K-major operand with the 128-byte swizzle ignores LBO (set to 1, as is usual).
//
// Fragments (PTX ISA, "wgmma" register fragments): warp w of the warpgroup owns rows 16w .. 16w + 15
// of the 64-row product. Its accumulator d[N / 2] holds, for every 8-column block j, the four
// values (g, 8j + 2t), (g, 8j + 2t + 1), (g + 8, 8j + 2t), (g + 8, 8j + 2t + 1) (g = lane / 4,
// t = lane % 4), as the C fragment of mma.m16n8k16; an A operand from registers is the A fragment
// of mma.m16n8k16 for the warp's 16 rows.
//
// On the CPU emulator (FA_CPU_EMULATION) every instruction here is done by its definition: TMA
// copies the box at once (zeros past the edge, the swizzle on the destination address bits) and
// completes its bytes on the mbarrier; a thread that waits on an mbarrier phase yields to the
// others until it completes; wgmma gathers the warpgroup's A registers between two warpgroup
// barriers, decodes the descriptors' bits (the same desc_bits the GPU uses) and reads A and B with the
// layouts above, and holds its result back until the wgmma.wait_group that covers it; the wait first lets
// every other thread run, and then checks that the shared memory the product read has not changed (a
// stage released or refilled too early fails the launch). Named barriers (bar.sync / bar.arrive) count
// threads as on the GPU. What it cannot check: the driver's tensor-map encoding (it reads its own),
// fences (wgmma.fence and fence.proxy.async do nothing here), and an A operand's registers written while
// their product runs (it copies them at the issue).
//
// Sources: PTX ISA 8.x, "cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async" (matrix descriptors,
// register fragments); CUDA driver API, cuTensorMapEncodeTiled; Shah et al. 2024 (FlashAttention-3), Sec. 3.1.
#pragma once

#if FA_DTYPE == 1
#define WG_AB "f16"
#else
#define WG_AB "bf16"
#endif

// The 64 bits of a shared-memory matrix descriptor with the 128-byte swizzle: the start address (its
// shared-window offset, 18 bits, in 16-byte units), LBO and SBO (bytes, in 16-byte units), layout type 1.
// The same code on the GPU and the emulator, which decodes these bits again when it multiplies.
__device__ __forceinline__ unsigned long long desc_bits(unsigned start, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((start & 0x3ffffu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

// A tensor map: 128 opaque bytes made on the host, passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaDescriptor {
    unsigned long long words[16];
};

#ifdef FA_CPU_EMULATION
// ---------------------------------------------------------------------------
// CPU twins
// ---------------------------------------------------------------------------
#include <stdint.h>

inline saddr_t sadd_bytes(saddr_t a, int bytes) { return (saddr_t)((unsigned char*)a + bytes); }
inline unsigned saddr_bits(saddr_t a) { return (unsigned)(uintptr_t)a; }

// the 128-byte swizzle on an address: bits [4, 7) ^= bits [7, 10)
inline unsigned char* swizzle128(unsigned char* p) {
    const uintptr_t a = (uintptr_t)p;
    return (unsigned char*)(a ^ (((a >> 7) & 7u) << 4));
}

// an mbarrier: the arrivals it expects per phase, those still pending, the phase's parity, and the
// bytes still to land (arrive.expect_tx adds them, each TMA copy takes its own off when it completes)
struct EmuMbarrier {
    unsigned expected : 10, pending : 10, phase : 1;
    int tx;                                            // bytes still to land in this phase
};
static_assert(sizeof(EmuMbarrier) == 8, "an mbarrier is 8 bytes");

inline void mbar_complete_if_done(EmuMbarrier& b) {
    if (b.pending == 0 && b.tx == 0) {
        b.phase ^= 1u;
        b.pending = b.expected;
    }
    ++emu::progress;
}
inline void mbar_init(saddr_t bar, unsigned count) { *(EmuMbarrier*)bar = EmuMbarrier{count, count, 0, 0}; }
inline void mbar_fence_init() {}
inline void mbar_arrive(saddr_t bar) {
    EmuMbarrier& b = *(EmuMbarrier*)bar;
    if (b.pending == 0) throw 1;                       // more arrivals than the barrier expects
    --b.pending;
    mbar_complete_if_done(b);
}
inline void mbar_expect_tx(saddr_t bar, unsigned bytes) {
    EmuMbarrier& b = *(EmuMbarrier*)bar;
    b.tx += (int)bytes;
    mbar_arrive(bar);
}
// wait until the phase of parity `parity` has completed (the current phase's parity differs)
inline void mbar_wait(saddr_t bar, unsigned parity) {
    while (((EmuMbarrier*)bar)->phase == (parity & 1u)) emu::yield();
}

// TMA at once: the box at (c0, c1, c2) of the emulator's tensor map (lessons.gpu.hopper.emulated_tensor_map:
// words[0] the data's address, [1..3] the sizes, innermost first, in elements, [4..5] the strides of dims 1
// and 2 in bytes, [6] the box (3 x 16 bits), [7] bytes per element, [8] the swizzle in bytes, 128 or 0),
// zeros outside the tensor, the swizzle on the destination's address bits; then its bytes complete on bar
inline void tma_load_3d(saddr_t dst, const TmaDescriptor* map, int c0, int c1, int c2, saddr_t bar) {
    const unsigned long long* w = map->words;
    const unsigned char* data = (const unsigned char*)(uintptr_t)w[0];
    const long long size[3] = {(long long)w[1], (long long)w[2], (long long)w[3]};
    const unsigned box[3] = {(unsigned)(w[6] & 0xffff), (unsigned)((w[6] >> 16) & 0xffff), (unsigned)((w[6] >> 32) & 0xffff)};
    const unsigned eb = (unsigned)w[7];
    const bool swizzled = w[8] == 128;
    unsigned char* out = (unsigned char*)dst;
    for (unsigned z = 0; z < box[2]; ++z)
        for (unsigned y = 0; y < box[1]; ++y)
            for (unsigned x = 0; x < box[0]; ++x) {
                const long long gx = c0 + (long long)x, gy = c1 + (long long)y, gz = c2 + (long long)z;
                unsigned char* to = out + ((size_t)(z * box[1] + y) * box[0] + x) * eb;
                if (swizzled) to = swizzle128(to);
                const bool inside = gx >= 0 && gx < size[0] && gy >= 0 && gy < size[1] && gz >= 0 && gz < size[2];
                if (inside)
                    memcpy(to, data + gz * (long long)w[5] + gy * (long long)w[4] + gx * eb, eb);
                else
                    memset(to, 0, eb);
            }
    EmuMbarrier& b = *(EmuMbarrier*)bar;
    b.tx -= (int)(box[0] * box[1] * box[2] * eb);
    mbar_complete_if_done(b);
}

inline void fence_proxy_async() {}

// the descriptor's bits, as on the GPU, and the address bits above the 18 a descriptor holds (the
// emulator's shared memory is an ordinary array somewhere in the process)
struct gmma_desc_t {
    unsigned long long bits;
    uintptr_t high;
};
inline gmma_desc_t desc_k_major(saddr_t start) {
    return gmma_desc_t{desc_bits(saddr_bits(start), 16u, 1024u), (uintptr_t)start & ~(uintptr_t)0x3ffff};
}
inline gmma_desc_t desc_mn_major(saddr_t start, unsigned panel_bytes) {
    return gmma_desc_t{desc_bits(saddr_bits(start), panel_bytes, 1024u), (uintptr_t)start & ~(uintptr_t)0x3ffff};
}
// the descriptor of the operand `bytes` further on (desc_add below, for the GPU): the same add to the start
// field; a carry out of its 14 bits, which a GPU's shared window never makes, moves the high address bits on
// (the emulator's shared memory may straddle a multiple of 2^18 in the process's address space)
inline gmma_desc_t desc_add(gmma_desc_t d, int bytes) {
    if (bytes < 0 || bytes % 16) throw 1;              // the field counts 16-byte units
    const unsigned long long start = (d.bits & 0x3fffu) + (unsigned)(bytes >> 4);
    return gmma_desc_t{(d.bits & ~0x3fffull) | (start & 0x3fffu), d.high + (uintptr_t)((start >> 14) << 18)};
}

namespace emu {
inline unsigned wg_a[1024][4];

// a descriptor decoded from its bits: start address, LBO, SBO (bytes); a layout other than the 128-byte
// swizzle (type 1) is not one this emulator knows: the launch fails
struct Operand {
    unsigned char* start;
    unsigned lbo, sbo;
};
inline Operand decode(const gmma_desc_t& d) {
    if ((d.bits >> 62) != 1 || ((d.bits >> 49) & 7u) != 0) throw 1;
    return Operand{(unsigned char*)(d.high | (uintptr_t)((d.bits & 0x3fffu) << 4)),
                   (unsigned)((d.bits >> 16) & 0x3fffu) << 4, (unsigned)((d.bits >> 32) & 0x3fffu) << 4};
}
inline unsigned short k_major_at(const Operand& d, unsigned n, unsigned k) {
    unsigned short v;
    memcpy(&v, swizzle128(d.start + (n / 8) * d.sbo + (n % 8) * 128 + 2 * k), 2);
    return v;
}
inline unsigned short mn_major_at(const Operand& d, unsigned k, unsigned n) {
    unsigned short v;
    memcpy(&v, swizzle128(d.start + (n / 64) * d.lbo + (k / 8) * d.sbo + (k % 8) * 128 + 2 * (n % 64)), 2);
    return v;
}

// wgmma is asynchronous: its result reaches the accumulator registers only at the wgmma.wait_group that
// covers it. So here a product's result is held back, per thread, until then; a kernel that read its
// accumulators before waiting would see the old values, as it might on a GPU.
// The hardware also reads a product's shared-memory operands while it runs, not when it is issued: a
// stage refilled before the wait that covers the product would corrupt it. So each thread keeps a hash of
// the operands it read, and its write-back checks them again: memory that changed in between fails the
// launch (THROW_OPERAND_CHANGED). (Every thread, not one per warpgroup: the last thread to release a stage
// is the one whose write-back comes after the refill.)
struct Pending {
    float* d;
    int count;
    unsigned group;                                    // the commit group it belongs to
    float value[128];
    Operand a, b;                                      // the operands read from shared memory (a: if a_in_smem)
    bool a_in_smem, b_mn_major;
    unsigned n, a_row;                                 // B's columns; the first of this thread's two A rows
    unsigned long long hash;                           // of what this thread read, checked at the write-back
};
constexpr int THROW_OPERAND_CHANGED = 5;

// FNV-1a over the 16-bit elements one thread's product reads from shared memory: its rows a_row and
// a_row + 8 of A (when A is there) and all of B (16 x n, K- or MN-major)
inline unsigned long long operand_hash(const Pending& p) {
    unsigned long long h = 1469598103934665603ull;
    auto mix = [&](unsigned short v) { h = (h ^ v) * 1099511628211ull; };
    if (p.a_in_smem)
        for (unsigned row = p.a_row; row <= p.a_row + 8; row += 8)
            for (unsigned k = 0; k < 16; ++k) mix(k_major_at(p.a, row, k));
    for (unsigned k = 0; k < 16; ++k)
        for (unsigned n = 0; n < p.n; ++n) mix(p.b_mn_major ? mn_major_at(p.b, k, n) : k_major_at(p.b, n, k));
    return h;
}
inline Pending pending[1024][16];
inline int n_pending[1024];
inline unsigned groups_committed[1024];

// named barriers (bar.sync / bar.arrive), ids 1..15 (0 is __syncthreads): named_barrier_sync below
inline Barrier named_barrier[16];

// (products left pending by a launch that failed must not be written back in the next one, nor
// arrivals at a named barrier counted in it)
inline const bool pending_cleared_per_launch = (on_launch = [] {
    memset(n_pending, 0, sizeof n_pending);
    memset(groups_committed, 0, sizeof groups_committed);
    for (Barrier& b : named_barrier) b = Barrier{};
}, true);

inline void flush(unsigned tid, unsigned keep_groups) {     // write back all but the newest keep_groups groups
    int kept = 0;
    for (int i = 0; i < n_pending[tid]; ++i) {
        Pending& p = pending[tid][i];
        if (groups_committed[tid] - p.group > keep_groups) {
            if (operand_hash(p) != p.hash) throw THROW_OPERAND_CHANGED;
            for (int j = 0; j < p.count; ++j) p.d[j] = p.value[j];
        } else {
            pending[tid][kept++] = p;
        }
    }
    n_pending[tid] = kept;
}

// d (64 x N, this thread's N / 2 values) = (scale_d ? d : 0) + A (64 x 16) B (16 x N) for the calling
// thread's warpgroup. A: from each thread's registers a_regs, or through a_desc (K-major);
// B through b (K-major, or MN-major when b_mn_major).
template <int N, class ToFloat>
inline void wgmma(float* d, const unsigned* a_regs, const gmma_desc_t* a_desc, const gmma_desc_t& b_desc,
                  bool b_mn_major, int scale_d, ToFloat to_f) {
    const unsigned tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const unsigned g = lane / 4, t = lane % 4;
    const Operand b = decode(b_desc);
    if (a_regs)
        for (int r = 0; r < 4; ++r) wg_a[tid][r] = a_regs[r];
    wait(group_barrier[wg]);                           // the warpgroup's registers are published
    float A[2][16], B[16][N];                          // (both branches below fill every element)
    if (a_regs) {                                      // rows g, g + 8 of the warp's 16: lanes 4g .. 4g + 3
        for (unsigned src_t = 0; src_t < 4; ++src_t) {
            const unsigned src = wg * 128 + warp * 32 + 4 * g + src_t;
            for (unsigned i = 0; i < 8; ++i) {
                const unsigned short bits = (unsigned short)(wg_a[src][i / 2] >> (16 * (i % 2)));
                A[(i / 2) % 2][2 * src_t + i % 2 + 8 * (i >= 4)] = to_f(bits);
            }
        }
    } else {
        const Operand a = decode(*a_desc);
        for (unsigned h = 0; h < 2; ++h)
            for (unsigned k = 0; k < 16; ++k) A[h][k] = to_f(k_major_at(a, 16 * warp + g + 8 * h, k));
    }
    for (unsigned k = 0; k < 16; ++k)
        for (unsigned n = 0; n < (unsigned)N; ++n)
            B[k][n] = to_f(b_mn_major ? mn_major_at(b, k, n) : k_major_at(b, n, k));
    wait(group_barrier[wg]);                           // every thread has read before the next product
    // the accumulator this product adds to: a product still pending on the same registers (products
    // on one accumulator run in order), else the registers
    const float* before = d;
    for (int i = n_pending[tid] - 1; i >= 0; --i)
        if (pending[tid][i].d == d) { before = pending[tid][i].value; break; }
    if (n_pending[tid] == 16) throw 1;                 // (more products in flight than this emulator holds)
    Pending& p = pending[tid][n_pending[tid]++];
    p.d = d;
    p.count = N / 2;
    p.group = groups_committed[tid];
    p.a_in_smem = a_regs == nullptr;
    if (p.a_in_smem) p.a = decode(*a_desc);
    p.a_row = 16 * warp + g;
    p.b = b;
    p.b_mn_major = b_mn_major;
    p.n = N;
    p.hash = operand_hash(p);
    for (unsigned j = 0; j < (unsigned)N / 8; ++j)
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned h = i / 2, col = 8 * j + 2 * t + i % 2;
            float acc = 0.f;
            for (unsigned k = 0; k < 16; ++k) acc += A[h][k] * B[k][col];
            p.value[4 * j + i] = (scale_d ? before[4 * j + i] : 0.f) + acc;
        }
}
}  // namespace emu

template <int N> inline void wgmma_ss(float* d, gmma_desc_t a, gmma_desc_t b, int scale_d) {
    emu::wgmma<N>(d, nullptr, &a, b, false, scale_d, [](unsigned short x) { return to_float(x); });
}
template <int N> inline void wgmma_rs_tb(float* d, const unsigned* a, gmma_desc_t b, int scale_d) {
    emu::wgmma<N>(d, a, nullptr, b, true, scale_d, [](unsigned short x) { return to_float(x); });
}
inline void wgmma_fence() {}
inline void wgmma_commit() { ++emu::groups_committed[threadIdx.x]; }
// (the wait lets every other thread run first, as a GPU's products take time: for two sweeps of the
// scheduler, which runs the threads in one order and then the other, so a stage released too early is
// refilled before the write-back that checks its operands; the wait is time passing, not a spin, so it
// counts as progress for the deadlock check)
template <int N> inline void wgmma_wait() {
    for (int sweep = 0; sweep < 2; ++sweep) {
        ++emu::progress;
        emu::yield();
    }
    emu::flush(threadIdx.x, N);
}
inline void fence_operand(float&) {}
inline void fence_operand(unsigned&) {}

// Named barriers (bar.sync / bar.arrive with an id and a thread count): `count` threads complete a
// phase, some waiting (sync), some only arriving (arrive). A barrier used with two thread counts, or an
// id outside 1..15, fails the launch.
namespace emu {
inline Barrier& named(int id, int count) {
    if (id < 1 || id > 15 || count <= 0 || count % 32) throw 1;
    Barrier& b = named_barrier[id];
    if (b.n == 0) b.n = count;
    if (b.n != count) throw 1;
    return b;
}
}  // namespace emu
template <int ID, int COUNT> inline void named_barrier_sync() { emu::wait(emu::named(ID, COUNT)); }
template <int ID, int COUNT> inline void named_barrier_arrive() {
    emu::Barrier& b = emu::named(ID, COUNT);
    ++emu::progress;
    if (++b.count == b.n) {
        b.count = 0;
        ++b.generation;
    }
}

#else
// ---------------------------------------------------------------------------
// the GPU (sm_90a)
// ---------------------------------------------------------------------------
typedef unsigned long long gmma_desc_t;

__device__ __forceinline__ saddr_t sadd_bytes(saddr_t a, int bytes) { return a + (unsigned)bytes; }
__device__ __forceinline__ unsigned saddr_bits(saddr_t a) { return a; }

__device__ __forceinline__ void mbar_init(saddr_t bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// make the initialised barriers visible to the async proxy (TMA) before first use
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(saddr_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// arrive, and add `bytes` to the bytes this phase waits for (the TMA copies about to be issued)
__device__ __forceinline__ void mbar_expect_tx(saddr_t bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(saddr_t bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// one TMA copy of a box at coordinates (c0, c1, c2) (innermost first) into shared memory at dst;
// its bytes complete on the mbarrier bar
__device__ __forceinline__ void tma_load_3d(saddr_t dst, const TmaDescriptor* map, int c0, int c1, int c2,
                                            saddr_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

// order this thread's ordinary shared-memory writes before later async-proxy reads (wgmma, TMA)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ gmma_desc_t desc_k_major(saddr_t start) { return desc_bits(start, 16u, 1024u); }
__device__ __forceinline__ gmma_desc_t desc_mn_major(saddr_t start, unsigned panel_bytes) {
    return desc_bits(start, panel_bytes, 1024u);
}
// The descriptor of the operand `bytes` further on (a multiple of 16): `bytes >> 4` added to the low word,
// whose bits [0, 14) hold the start address as (address & 0x3FFFF) >> 4 (PTX ISA, "Matrix Descriptor
// Format"). Legal while the add does not carry out of those 14 bits, and it cannot: a shared-window address
// is below 2^18 (228 KiB of shared memory at most), so an address inside the block's shared memory plus an
// offset that stays inside it is too. So a kernel builds an operand's descriptor once (desc_k_major /
// desc_mn_major: the masks, the shift and the LBO / SBO / swizzle bits) and steps it by one add per product,
// as CUTLASS's GmmaDescriptor + offset does; with a constant offset and a descriptor the compiler can keep,
// that add is all a step costs. The high word (SBO, swizzle) is not touched.
__device__ __forceinline__ gmma_desc_t desc_add(gmma_desc_t d, int bytes) {
    const unsigned lo = (unsigned)d + ((unsigned)bytes >> 4), hi = (unsigned)(d >> 32);
    return ((unsigned long long)hi << 32) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// keep the compiler from moving reads of an accumulator across wgmma.wait_group, or from reusing the
// registers of an A operand from registers before the wait that covers its product
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void fence_operand(unsigned& x) { asm volatile("" : "+r"(x) :: "memory"); }

// named barrier ID (1..15; 0 is __syncthreads) of COUNT threads: wait for the phase (sync), or only
// count this warp's threads in it (arrive). Immediate ids: ptxas then reserves only the barriers used.
template <int ID, int COUNT> __device__ __forceinline__ void named_barrier_sync() {
    static_assert(ID >= 1 && ID <= 15 && COUNT % 32 == 0, "a named barrier: id 1..15, a multiple of 32 threads");
    asm volatile("bar.sync %0, %1;" :: "n"(ID), "n"(COUNT) : "memory");
}
template <int ID, int COUNT> __device__ __forceinline__ void named_barrier_arrive() {
    static_assert(ID >= 1 && ID <= 15 && COUNT % 32 == 0, "a named barrier: id 1..15, a multiple of 32 threads");
    asm volatile("bar.arrive %0, %1;" :: "n"(ID), "n"(COUNT) : "memory");
}

// d (64 x N) = (scale_d ? d : 0) + A B; wgmma_ss: A and B from shared memory (both K-major);
// wgmma_rs_tb: A from registers, B MN-major (.trans, imm-trans-b = 1). One instruction each.
__device__ __forceinline__ void wgmma_ss_n64(float* d, gmma_desc_t a, gmma_desc_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_AB "." WG_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_rs_n64_tb(float* d, const unsigned* a, gmma_desc_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_AB "." WG_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_ss_n128(float* d, gmma_desc_t a, gmma_desc_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_AB "." WG_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_rs_n128_tb(float* d, const unsigned* a, gmma_desc_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_AB "." WG_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

template <int N> __device__ __forceinline__ void wgmma_ss(float* d, gmma_desc_t a, gmma_desc_t b, int scale_d) {
    if constexpr (N == 64) wgmma_ss_n64(d, a, b, scale_d);
    else wgmma_ss_n128(d, a, b, scale_d);
}
template <int N> __device__ __forceinline__ void wgmma_rs_tb(float* d, const unsigned* a, gmma_desc_t b, int scale_d) {
    if constexpr (N == 64) wgmma_rs_n64_tb(d, a, b, scale_d);
    else wgmma_rs_n128_tb(d, a, b, scale_d);
}
#endif
