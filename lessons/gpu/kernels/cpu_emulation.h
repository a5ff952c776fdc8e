// cpu_emulation.h - run the series' CUDA kernels, unchanged, on CPU threads.
//
// Not a CUDA implementation: just enough of one for these kernels, so that their
// indexing, bounds, barriers and -inf handling can be tested on a machine without a
// GPU (lessons/gpu/emulator.py compiles a kernel file with `g++ -include` this header).
//
//   * one block runs at a time; each of its threads is a POSIX thread;
//   * __shared__ becomes `static`: one copy, shared by the threads of the running block;
//   * __syncthreads() is a barrier over the block, __syncwarp() over the 32 lanes of a warp;
//   * __shfl_xor_sync and __shfl_sync exchange values through a per-thread slot between two
//     warp barriers; __syncthreads_or does the same with block barriers;
//   * mma.sync (the tensor-core product) is rebuilt from the warp's registers by its documented
//     fragment layout, between two warp barriers (emu::mma_m16n8k16);
//   * a barrier that some thread never reaches (a divergent __syncthreads, a bug on a GPU
//     too) times out and the launch reports failure instead of hanging.
// It is slow (thread switches at every barrier) and meant for small tests.
// Only C headers, so that g++ builds a kernel in a second or two.
#pragma once
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#define FA_CPU_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim, gridDim;

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

namespace emu {

struct Divergence {};                      // thrown by a barrier that timed out

inline volatile bool poisoned = false;     // set when a barrier timed out: every waiter gives up
inline double barrier_timeout_s = 20.0;

inline double now_s() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

struct Barrier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n = 0, count = 0;
    long generation = 0;

    void init(int threads) {
        pthread_mutex_init(&mu, nullptr);
        pthread_cond_init(&cv, nullptr);
        n = threads; count = 0; generation = 0;
    }
    void destroy() { pthread_mutex_destroy(&mu); pthread_cond_destroy(&cv); }

    void wait() {
        pthread_mutex_lock(&mu);
        const long my_generation = generation;
        if (++count == n) {                // the last one in releases the others
            count = 0;
            ++generation;
            pthread_cond_broadcast(&cv);
            pthread_mutex_unlock(&mu);
            return;
        }
        const double start = now_s();
        while (generation == my_generation) {
            timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 50 * 1000 * 1000;
            if (until.tv_nsec >= 1000000000) { until.tv_sec += 1; until.tv_nsec -= 1000000000; }
            pthread_cond_timedwait(&cv, &mu, &until);
            if (generation != my_generation) break;
            if (poisoned || now_s() - start > barrier_timeout_s) {
                poisoned = true;
                pthread_mutex_unlock(&mu);
                throw Divergence();
            }
        }
        pthread_mutex_unlock(&mu);
    }
};

inline Barrier block_barrier;
inline Barrier warp_barrier[32];
inline float shuffle_slot[1024];
inline int vote_slot[1024];

template <class Fn>
struct Job {
    Fn* fn;
    dim3 grid;
    unsigned thread;
    int status;
};

// One CPU thread plays CUDA thread `job->thread` of every block in turn. A block
// barrier between blocks keeps the next block from touching the (static) shared
// memory while a slow thread still works on the previous one.
// Blocks run in *reverse* order (a GPU promises no order at all): then a block that
// wrote past its own rows into the next head's would do so after that head's block
// has written, and the damage would stay visible to the tests.
template <class Fn>
void* run_job(void* p) {
    Job<Fn>* job = static_cast<Job<Fn>*>(p);
    threadIdx = dim3{job->thread, 0, 0};
    try {
        for (unsigned z = job->grid.z; z-- > 0;)
            for (unsigned y = job->grid.y; y-- > 0;)
                for (unsigned x = job->grid.x; x-- > 0;) {
                    blockIdx = dim3{x, y, z};
                    (*job->fn)();
                    block_barrier.wait();
                }
    } catch (const Divergence&) {
        job->status = 1;
    } catch (...) {
        poisoned = true;
        job->status = 2;
    }
    return nullptr;
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier.wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier[threadIdx.x / 32].wait(); }

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
// reached by every thread of a block; 2 on another exception; 3 for an unsupported block.
template <typename... Params, typename... Args>
int emulate_launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
    const int n = (int)block.x;
    if (n <= 0 || n > 1024 || n % 32 || block.y != 1 || block.z != 1) return 3;
    blockDim = block;
    gridDim = grid;
    emu::poisoned = false;
    emu::block_barrier.init(n);
    for (int w = 0; w < n / 32; ++w) emu::warp_barrier[w].init(32);

    auto body = [&]() { kernel(args...); };
    using Fn = decltype(body);
    emu::Job<Fn>* jobs = new emu::Job<Fn>[n];
    pthread_t* threads = new pthread_t[n];
    int started = 0, status = 0;
    for (; started < n; ++started) {
        jobs[started] = emu::Job<Fn>{&body, grid, (unsigned)started, 0};
        if (pthread_create(&threads[started], nullptr, emu::run_job<Fn>, &jobs[started])) {
            emu::poisoned = true;          // the threads already started give up at their next barrier
            status = 2;
            break;
        }
    }
    for (int t = 0; t < started; ++t) pthread_join(threads[t], nullptr);
    for (int t = 0; t < started; ++t) status = status > jobs[t].status ? status : jobs[t].status;
    delete[] jobs;
    delete[] threads;
    emu::block_barrier.destroy();
    for (int w = 0; w < n / 32; ++w) emu::warp_barrier[w].destroy();
    return status;
}
