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
// On the emulator (FA_CPU_EMULATION) a copy happens at once and the waits do nothing, so it checks
// the addresses, not the waits. Source: PTX ISA, "cp.async", "cp.async.commit_group",
// "cp.async.wait_group".
#pragma once

#ifdef FA_CPU_EMULATION
typedef unsigned short* saddr_t;
inline saddr_t saddr(const void* p) { return (saddr_t)p; }
inline void cp_async16(void* dst, const void* src) { __builtin_memcpy(dst, src, 16); }   // (synchronous)
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
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
