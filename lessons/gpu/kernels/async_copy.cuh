// async_copy.cuh - copies from global to shared memory that do not pass through registers
// (cp.async, PTX ISA 7.0+, sm_80+), for the tensor-core kernels (through tensor_core.cuh) and the
// cp.async decode rung (paged_decode_split.cu with ASYNC_STAGES).
//
// saddr_t is a shared-memory address: on the GPU a 32-bit address in the shared window (what
// cp.async and ldmatrix take), on the emulator a pointer. saddr(p) converts a pointer into a
// __shared__ array (one cvta.to.shared).
//
// cp_async16(dst, src): copy 16 bytes from global to shared memory; the thread does not wait.
// dst is a saddr_t or a pointer into a __shared__ array. cp_async_commit() closes the group of
// copies this thread issued since its last commit; cp_async_wait<N>() waits until at most N of
// this thread's groups are still in flight. A thread waits only for its own copies: another
// thread's must be waited for by that thread and then published by a barrier.
//
// On the emulator (FA_CPU_EMULATION) a copy waits in its thread's queue, tagged with the group it
// will be committed in, and lands (its 16 bytes read and written) only at the first
// cp_async_wait<N>() that covers its group: a copy still in the open group, or in one of the N
// newest committed groups, has not landed, so a kernel that reads a slot before the wait that
// covers it reads what was there before, and its output goes wrong in the tests. A thread's
// queue is emptied as it starts a block (copies never waited for are dropped: on a GPU they land
// while the block still runs, but nothing may read them without a wait).
// That is the latest a GPU may land a copy; it may also land it as soon as it is asked for. With
// LESSONS_EMULATOR_CP_ASYNC=issue in the environment (read as each block starts) every copy lands
// at once, as cp_async16 is called: a kernel that refills a slot before it has read what the slot
// held (a ring with too few slots, a refill of the slot it is about to read) then reads the new
// bytes, and its output goes wrong. Run with both, the tests see either hazard; neither shows
// timing, and an uncommitted copy lands at once in the second mode. Source: PTX ISA, "cp.async",
// "cp.async.commit_group", "cp.async.wait_group".
#pragma once

#ifdef FA_CPU_EMULATION
typedef unsigned short* saddr_t;
inline saddr_t saddr(const void* p) { return (saddr_t)p; }
namespace emu_copy {
struct Copy {
    void* dst;
    const void* src;
    long group;                            // the commits the thread had made when it issued the copy
};
constexpr int CAPACITY = 256;              // copies one thread may have in flight
inline Copy queue[1024][CAPACITY];
inline int head[1024], tail[1024];         // queue[t][head .. tail) are in flight, oldest first
inline long commits[1024];
inline bool land_at_issue = false;         // LESSONS_EMULATOR_CP_ASYNC=issue: each copy lands as it is issued
inline void reset() {
    const unsigned t = threadIdx.x;
    head[t] = tail[t] = 0;
    commits[t] = 0;
    const char* when = getenv("LESSONS_EMULATOR_CP_ASYNC");
    land_at_issue = when != nullptr && strcmp(when, "issue") == 0;
}
inline const bool cleared_per_block = (emu::on_block_start = reset, true);
}  // namespace emu_copy
inline void cp_async16(void* dst, const void* src) {
    using namespace emu_copy;
    const unsigned t = threadIdx.x;
    if (land_at_issue) {                            // the earliest a GPU may land it
        __builtin_memcpy(dst, src, 16);
        return;
    }
    if (tail[t] == CAPACITY) {                      // move what is in flight to the front
        memmove(queue[t], queue[t] + head[t], (tail[t] - head[t]) * sizeof(Copy));
        tail[t] -= head[t];
        head[t] = 0;
    }
    if (tail[t] == CAPACITY) {
        fprintf(stderr, "cp.async: thread %u has %d copies in flight, more than the emulator holds\n", t, CAPACITY);
        throw 2;
    }
    queue[t][tail[t]++] = Copy{dst, src, commits[t]};
}
inline void cp_async_commit() { ++emu_copy::commits[threadIdx.x]; }
template <int N> inline void cp_async_wait() {      // land every copy of a group older than the N newest
    using namespace emu_copy;
    const unsigned t = threadIdx.x;
    while (head[t] < tail[t] && queue[t][head[t]].group < commits[t] - N) {
        __builtin_memcpy(queue[t][head[t]].dst, queue[t][head[t]].src, 16);
        ++head[t];
    }
}
#else
typedef unsigned saddr_t;
__device__ __forceinline__ saddr_t saddr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(saddr_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16(saddr(dst), src); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
#endif
