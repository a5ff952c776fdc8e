// cpu_emulation.h - run the series' CUDA kernels, unchanged, on the CPU.
//
// Not a CUDA implementation: just enough of one for these kernels, so that their
// indexing, bounds, barriers and -inf handling can be tested on a machine without a
// GPU (lessons/gpu/emulator.py compiles a kernel file with `g++ -include` this header).
//
//   * one block runs at a time; each of its threads is a fiber (a ucontext with its own stack)
//     on the one CPU thread that launched the kernel, so an emulated launch uses one core;
//   * a fiber runs until it reaches a barrier, then the next fiber runs; the sweep over the
//     fibers goes up through the threads, then down, in turn, so a read of shared memory that
//     lacks its barrier sees the value written by the wrong thread sooner or later;
//   * __shared__ becomes `static`: one copy, shared by the threads of the running block;
//   * __syncthreads() is a barrier over the block, __syncwarp() over the 32 lanes of a warp;
//   * __shfl_xor_sync and __shfl_sync exchange values through a per-thread slot between two
//     warp barriers; __syncthreads_or does the same with block barriers;
//   * mma.sync (the tensor-core product) is rebuilt from the warp's registers by its documented
//     fragment layout, between two warp barriers (emu::mma_m16n8k16);
//   * a cp.async copy waits in its thread's queue and lands at the cp.async.wait_group that covers
//     its group (kernels/async_copy.cuh), so a read of shared memory before that wait sees old data;
//   * a thread that waits for an mbarrier phase (kernels/hopper.cuh) yields to the others until
//     the phase completes; a warpgroup barrier (128 threads) serves wgmma;
//   * a barrier that some thread never reaches (a divergent __syncthreads, a bug on a GPU
//     too) leaves every fiber waiting: the launch stops at once and reports failure.
// It is slow (a context switch per thread at every barrier) and meant for small tests.
// Only C headers, so that g++ builds a kernel in a second or two.
#pragma once
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <stdio.h>
#include <string.h>

#define FA_CPU_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
// A __shared__ array is a static variable of its function. Declare one only in an entry point (an
// extern "C" function): a static inside an inline or template function is made one object for every
// library loaded into the process (g++'s STB_GNU_UNIQUE), so builds of two head dims would share it.
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
// Globals, not thread-locals: the scheduler sets threadIdx before it resumes a fiber; blockIdx is
// the running block's (every thread reaches the block barrier between two blocks).
inline dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

namespace emu {

struct Barrier {
    int n = 0, count = 0;
    long generation = 0;                   // how many times every thread has arrived
};

enum State { RUNNING, WAITING, YIELDED, DONE };

struct Fiber {
    ucontext_t context;
    void* stack = nullptr;
    State state = RUNNING;
    const Barrier* barrier = nullptr;      // the barrier it waits at, and that barrier's generation then
    long generation = 0;
    int status = 0;                        // 2: the kernel threw
};

inline Barrier block_barrier;
inline Barrier warp_barrier[32];
inline Barrier group_barrier[8];           // one per warpgroup (128 threads): wgmma
inline unsigned long progress = 0;         // arrivals so far: a sweep that adds none is stuck
inline void (*on_launch)() = nullptr;      // state a header keeps per thread, cleared before each launch
inline void (*on_block_start)() = nullptr; // the running thread's state a header keeps, cleared as it starts a block
inline float shuffle_slot[1024];
inline int vote_slot[1024];

inline Fiber* fibers = nullptr;
inline unsigned running = 0;               // the fiber that runs now (= threadIdx.x)
inline ucontext_t scheduler;
inline void (*body)(void*) = nullptr;      // runs the kernel with the launch's arguments
inline void* body_data = nullptr;

// The calling fiber arrives at `b`: the last to arrive releases the others and runs on; the
// others go back to the scheduler until the barrier's generation moves on.
inline void wait(Barrier& b) {
    ++progress;
    if (++b.count == b.n) {
        b.count = 0;
        ++b.generation;
        return;
    }
    Fiber& f = fibers[running];
    f.state = WAITING;
    f.barrier = &b;
    f.generation = b.generation;
    swapcontext(&f.context, &scheduler);
}

// Every fiber plays one CUDA thread of every block in turn, with a block barrier between two
// blocks, so that no thread starts the next block while another still works in this one's shared
// memory. Blocks run in *reverse* order (a GPU promises no order at all): then a block that wrote
// past its own rows into the next head's would do so after that head's block has written, and the
// damage would stay visible to the tests.
inline void fiber_main() {
    Fiber& self = fibers[running];
    try {
        for (unsigned z = gridDim.z; z-- > 0;)
            for (unsigned y = gridDim.y; y-- > 0;)
                for (unsigned x = gridDim.x; x-- > 0;) {
                    blockIdx = dim3{x, y, z};
                    if (on_block_start) on_block_start();
                    body(body_data);
                    wait(block_barrier);
                }
    } catch (int code) {
        self.status = code == 5 ? 5 : 2;   // 5: a wgmma operand changed in flight (hopper.cuh)
    } catch (...) {
        self.status = 2;
    }
    self.state = DONE;                     // uc_link returns to the scheduler
    ++progress;
}

// The calling fiber lets the others run (a spin-wait on an mbarrier); it runs again next sweep.
inline void yield() {
    Fiber& f = fibers[running];
    f.state = YIELDED;
    swapcontext(&f.context, &scheduler);
}

// Resume fibers until all are done (0) or all that are left wait at barriers that can never
// open (1, a divergent barrier); 2 if a kernel threw, 4 if a fiber could not be made, 5 if a
// wgmma's shared-memory operand changed before the wait that covers it (hopper.cuh).
inline int run_fibers(unsigned n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), stack_bytes = 512 * 1024;
    int status = 0;
    unsigned made = 0;
    for (; made < n; ++made) {             // each stack has a PROT_NONE page below it: an overflow faults
        void* mem = mmap(nullptr, stack_bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) { status = 4; break; }
        mprotect(mem, page, PROT_NONE);
        Fiber& f = fibers[made];
        f.stack = mem;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = (char*)mem + page;
        f.context.uc_stack.ss_size = stack_bytes;
        f.context.uc_link = &scheduler;
        makecontext(&f.context, fiber_main, 0);
    }
    for (bool up = true; status == 0; up = !up) {
        unsigned done = 0, resumed = 0;
        const unsigned long before = progress;
        for (unsigned k = 0; k < n; ++k) {
            const unsigned i = up ? k : n - 1 - k;
            Fiber& f = fibers[i];
            if (f.state == DONE) { ++done; continue; }
            if (f.state == WAITING && f.barrier->generation == f.generation) continue;
            f.state = RUNNING;
            running = i;
            threadIdx = dim3{i, 0, 0};
            swapcontext(&scheduler, &f.context);
            ++resumed;
            if (f.status) status = f.status;
        }
        if (done == n) break;
        if (resumed == 0 || progress == before) status = 1;   // (only yields: no mbarrier phase can complete)
    }
    for (unsigned i = 0; i < made; ++i) munmap(fibers[i].stack, stack_bytes + page);
    return status;
}

}  // namespace emu

inline void __syncthreads() { emu::wait(emu::block_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::warp_barrier[threadIdx.x / 32]); }

// __syncthreads_or: a barrier that also returns, to every thread, whether any thread's
// predicate was non-zero (each publishes it, then all read all of them between two barriers).
inline int __syncthreads_or(int predicate) {
    emu::vote_slot[threadIdx.x] = predicate != 0;
    __syncthreads();                                       // every thread has published its vote
    int any = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) any |= emu::vote_slot[i];
    __syncthreads();                                       // every thread has read before the next vote
    return any;
}

// __shfl_sync with width 32: lane src_lane's x (a float or a 32-bit int), for every lane of the warp.
template <class T>
inline T __shfl_sync(unsigned, T x, int src_lane) {
    static_assert(sizeof(T) == 4, "32-bit values only");
    const unsigned t = threadIdx.x;
    memcpy(&emu::shuffle_slot[t], &x, 4);                  // (the bits, whatever the type)
    __syncwarp();                                          // every lane has published its value
    T other;
    memcpy(&other, &emu::shuffle_slot[(t & ~31u) | ((unsigned)src_lane & 31u)], 4);
    __syncwarp();                                          // every lane has read before the next exchange
    return other;
}

// __any_sync over the whole warp: whether any lane's predicate is non-zero (votes published, then read,
// between two warp barriers)
inline int __any_sync(unsigned, int predicate) {
    const unsigned t = threadIdx.x;
    emu::vote_slot[t] = predicate != 0;
    __syncwarp();                                          // every lane has published its vote
    int any = 0;
    for (unsigned i = t & ~31u; i < (t & ~31u) + 32; ++i) any |= emu::vote_slot[i];
    __syncwarp();                                          // every lane has read before the next vote
    return any;
}

inline float __shfl_xor_sync(unsigned, float x, int lane_mask) {
    const unsigned t = threadIdx.x;
    emu::shuffle_slot[t] = x;
    __syncwarp();                                          // every lane has published its value
    const float other = emu::shuffle_slot[(t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask)];
    __syncwarp();                                          // every lane has read before the next exchange
    return other;
}

namespace emu {

inline unsigned mma_a[1024][4];
inline unsigned mma_b[1024][2];

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: c += A (16x16) B (16x8) for one warp.
// Every lane publishes its registers; each then rebuilds A and B from the warp's registers
// by the PTX ISA fragment layout (g = lane / 4, t = lane % 4, element i of a register pair
// in its low (i even) or high (i odd) 16 bits) and computes its own four elements of C:
//   a_i: row g + 8 * ((i / 2) % 2), column 2t + i % 2 + 8 * (i >= 4)
//   b_i: row 2t + i % 2 + 8 * (i >= 2), column g
//   c_i: row g + 8 * (i >= 2),         column 2t + i % 2
// The products are summed in float32 in k order (the hardware's rounding differs slightly).
template <class ToFloat>
inline void mma_m16n8k16(float c[4], const unsigned a[4], const unsigned b[2], ToFloat to_f) {
    const unsigned tid = threadIdx.x, first = tid & ~31u, lane = tid & 31u;
    for (int r = 0; r < 4; ++r) mma_a[tid][r] = a[r];
    for (int r = 0; r < 2; ++r) mma_b[tid][r] = b[r];
    __syncwarp();                                          // every lane has published its registers
    float A[16][16], B[16][8];
    for (unsigned src = 0; src < 32; ++src) {
        const unsigned g = src / 4, t = src % 4;
        for (unsigned i = 0; i < 8; ++i) {
            const unsigned short bits = (unsigned short)(mma_a[first + src][i / 2] >> (16 * (i % 2)));
            A[g + 8 * ((i / 2) % 2)][2 * t + i % 2 + 8 * (i >= 4)] = to_f(bits);
        }
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned short bits = (unsigned short)(mma_b[first + src][i / 2] >> (16 * (i % 2)));
            B[2 * t + i % 2 + 8 * (i >= 2)][g] = to_f(bits);
        }
    }
    __syncwarp();                                          // every lane has read before the next product
    const unsigned g = lane / 4, t = lane % 4;
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = g + 8 * (i >= 2), col = 2 * t + i % 2;
        float acc = 0.f;
        for (unsigned kk = 0; kk < 16; ++kk) acc += A[row][kk] * B[kk][col];
        c[i] += acc;
    }
}

}  // namespace emu

// Run kernel<<<grid, block>>>(args...) block by block (last block first). Returns 0; 1 if a barrier was not
// reached by every thread of a block; 2 on an exception; 3 for an unsupported block; 4 if no stack could be made.
template <typename... Params, typename... Args>
int emulate_launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
    const int n = (int)block.x;
    if (n <= 0 || n > 1024 || n % 32 || block.y != 1 || block.z != 1) return 3;
    blockDim = block;
    gridDim = grid;
    emu::block_barrier = emu::Barrier{n};
    for (int w = 0; w < n / 32; ++w) emu::warp_barrier[w] = emu::Barrier{32};
    for (int w = 0; w < 8; ++w) emu::group_barrier[w] = emu::Barrier{128};
    if (emu::on_launch) emu::on_launch();
    auto run = [&]() { kernel(args...); };
    emu::body = [](void* data) { (*static_cast<decltype(run)*>(data))(); };
    emu::body_data = &run;
    emu::fibers = new emu::Fiber[n];
    const int status = emu::run_fibers((unsigned)n);
    delete[] emu::fibers;
    emu::fibers = nullptr;
    return status;
}
