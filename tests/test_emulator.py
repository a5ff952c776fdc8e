"""The CPU emulation header itself (lessons/gpu/kernels/cpu_emulation.h) on tiny kernels written here:
barriers order the threads of a block, a barrier that some thread never reaches fails the launch at
once, and a read of shared memory that lacks its barrier gives a visibly wrong answer."""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

from lessons.gpu.emulator import _compiler, emulator_available
from lessons.gpu.source import KERNEL_DIR

pytestmark = pytest.mark.skipif(not emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")

SOURCE = r"""
__global__ void neighbour(float* out, int with_barrier) {
    __shared__ float s[1024];
    const int t = threadIdx.x, n = blockDim.x;
    s[t] = (float)(blockIdx.x * 1000 + t);
    if (with_barrier) __syncthreads();
    out[blockIdx.x * n + t] = s[(t + 1) % n];            // the next thread's value
}

__global__ void block_sum(float* out) {                   // tree reduction over the block
    __shared__ float s[1024];
    const int t = threadIdx.x;
    s[t] = (float)(t + 1);
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) s[t] += s[t + half];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

__global__ void warp_sum(float* out) {                    // butterfly over each warp's lanes
    float x = (float)threadIdx.x;
    for (int mask = 16; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
    out[threadIdx.x] = x;
}

__global__ void divergent(float* out) {                   // thread 0 skips a barrier the others wait at
    if (threadIdx.x != 0) { __syncthreads(); __syncthreads(); }
    out[threadIdx.x] = 1.f;
}

extern "C" int run_neighbour(unsigned blocks, unsigned threads, float* out, int with_barrier) {
    return emulate_launch(neighbour, dim3{blocks, 1, 1}, dim3{threads, 1, 1}, out, with_barrier);
}
extern "C" int run_block_sum(unsigned blocks, unsigned threads, float* out) {
    return emulate_launch(block_sum, dim3{blocks, 1, 1}, dim3{threads, 1, 1}, out);
}
extern "C" int run_warp_sum(unsigned threads, float* out) {
    return emulate_launch(warp_sum, dim3{1, 1, 1}, dim3{threads, 1, 1}, out);
}
extern "C" int run_divergent(unsigned threads, float* out) {
    return emulate_launch(divergent, dim3{1, 1, 1}, dim3{threads, 1, 1}, out);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emulation")
    (folder / "tiny.cpp").write_text(SOURCE)
    subprocess.run([_compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-include",
                    str(KERNEL_DIR / "cpu_emulation.h"), str(folder / "tiny.cpp"), "-o", str(folder / "tiny.so")],
                   check=True, capture_output=True, timeout=300)
    return ctypes.CDLL(str(folder / "tiny.so"))


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("blocks,threads", [(1, 32), (3, 128), (2, 1024)])
def test_a_tree_reduction_over_shared_memory_sums_the_block(lib, blocks, threads):
    out = np.zeros(blocks, np.float32)
    assert lib.run_block_sum(blocks, threads, _ptr(out)) == 0
    np.testing.assert_array_equal(out, threads * (threads + 1) / 2)      # 1 + 2 + ... + threads


def test_shuffles_exchange_within_each_warp_only(lib):
    out = np.zeros(96, np.float32)
    assert lib.run_warp_sum(96, _ptr(out)) == 0
    lanes = np.arange(96).reshape(3, 32)
    np.testing.assert_array_equal(out.reshape(3, 32), np.repeat(lanes.sum(axis=1, keepdims=True), 32, axis=1))


def test_with_its_barrier_every_thread_reads_its_neighbours_value(lib):
    blocks, threads = 3, 64
    out = np.zeros(blocks * threads, np.float32)
    assert lib.run_neighbour(blocks, threads, _ptr(out), 1) == 0
    t = np.arange(threads)
    np.testing.assert_array_equal(out.reshape(blocks, threads), np.arange(blocks)[:, None] * 1000 + (t + 1) % threads)


def test_without_its_barrier_the_read_sees_a_value_not_yet_written(lib):
    blocks, threads = 3, 64
    out = np.zeros(blocks * threads, np.float32)
    assert lib.run_neighbour(blocks, threads, _ptr(out), 0) == 0
    right = np.arange(blocks)[:, None] * 1000 + (np.arange(threads) + 1) % threads
    wrong = out.reshape(blocks, threads) != right
    assert wrong.any(axis=1).all() and wrong.sum() > blocks * threads // 2   # threads ran before their neighbours


def test_a_barrier_that_one_thread_never_reaches_fails_the_launch_at_once(lib):
    out = np.zeros(64, np.float32)
    assert lib.run_divergent(64, _ptr(out)) == 1
    assert lib.run_block_sum(1, 64, _ptr(out)) == 0          # and the next launch runs normally
    assert out[0] == 64 * 65 / 2


def test_a_block_that_is_not_whole_warps_is_refused(lib):
    out = np.zeros(64, np.float32)
    assert lib.run_block_sum(1, 48, _ptr(out)) == 3


# ---------------------------------------------------------------------------
# mbarriers (kernels/hopper.cuh): a producer hands values to consumers; a wait that can never end
# ---------------------------------------------------------------------------

HOPPER_SOURCE = r"""
#include "common.cuh"
#include "tensor_core.cuh"
#include "hopper.cuh"

// warp 0's thread 0 writes `rounds` values one after another; the other warps add each one up.
// full completes when the value is written, empty when every consumer has read it.
__global__ void handoff(float* out, int rounds, int producer_runs) {
    __shared__ __align__(8) unsigned long long bars[2];
    __shared__ float value;
    const saddr_t full = saddr(&bars[0]), empty = saddr(&bars[1]);
    if (threadIdx.x == 0) {
        mbar_init(full, 1);
        mbar_init(empty, blockDim.x - 32);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0 && producer_runs)
            for (int r = 0; r < rounds; ++r) {
                if (r > 0) mbar_wait(empty, (r - 1) & 1);     // the consumers have read value r - 1
                value = (float)(r + 1);
                mbar_arrive(full);
            }
        return;
    }
    float sum = 0.f;
    for (int r = 0; r < rounds; ++r) {
        mbar_wait(full, r & 1);
        sum += value;
        mbar_arrive(empty);
    }
    out[threadIdx.x] = sum;
}

// one warpgroup: a 64 x 64 x 16 product of all-ones tiles (so the swizzle does not matter) added to
// accumulators that hold 7; each thread records its first accumulator before and after the wait
__global__ void deferred(float* out) {
    __shared__ __align__(1024) unsigned short tiles[2 * 64 * 64];
    for (int i = threadIdx.x; i < 2 * 64 * 64; i += blockDim.x) tiles[i] = 0x3c00;   // 1.0 in float16
    __syncthreads();
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 7.f;
    wgmma_fence();
    wgmma_ss<64>(d, desc_k_major(saddr(tiles)), desc_k_major(saddr(tiles + 64 * 64)), 1);
    wgmma_commit();
    out[2 * threadIdx.x] = d[0];                         // not waited for yet: still 7
    wgmma_wait<0>();
    out[2 * threadIdx.x + 1] = d[0];                     // 7 + 16 ones
}

// desc_add: the operand its descriptor points at is the one desc_k_major / desc_mn_major build for the address
// `bytes` on, also where that crosses a multiple of 2^18 (a carry out of the 14-bit start field). 1: the same,
// 0: not, -1: desc_add refused the step (not a multiple of 16 bytes)
extern "C" int check_desc_add(unsigned long long address, int bytes) {
    const saddr_t a = (saddr_t)(uintptr_t)address, b = sadd_bytes(a, bytes);
    try {
        const emu::Operand k = emu::decode(desc_add(desc_k_major(a), bytes)), k_want = emu::decode(desc_k_major(b));
        const emu::Operand m = emu::decode(desc_add(desc_mn_major(a, 8192), bytes));
        const emu::Operand m_want = emu::decode(desc_mn_major(b, 8192));
        return k.start == k_want.start && k.lbo == k_want.lbo && k.sbo == k_want.sbo && m.start == m_want.start &&
               m.lbo == m_want.lbo && m.sbo == m_want.sbo;
    } catch (int) {
        return -1;
    }
}

// cp.async: each thread copies 16 bytes of `src` (its own 4 floats) into shared memory in two groups (round 0
// into slot 0, round 1 into slot 1, src + 0 then src + 512) and records slot 0's first float three times: before
// any wait (the 0 it held), after wait_group 1 (group 0 landed), and slot 1's after wait_group 0; a copy left out
// of every group (no commit) has not landed after wait_group 0 either: slot 2 reads 0
__global__ void copies(const float* src, float* out) {
    __shared__ __align__(16) float slots[3][128 * 4];
    for (int s = 0; s < 3; ++s)
        for (int i = 0; i < 4; ++i) slots[s][threadIdx.x * 4 + i] = 0.f;
    const int t = threadIdx.x;
    cp_async16(&slots[0][t * 4], src + t * 4);
    cp_async_commit();
    cp_async16(&slots[1][t * 4], src + 512 + t * 4);
    cp_async_commit();
    cp_async16(&slots[2][t * 4], src + t * 4);           // never committed
    out[4 * t] = slots[0][t * 4];
    cp_async_wait<1>();
    out[4 * t + 1] = slots[0][t * 4] + slots[1][t * 4];  // group 0 only
    cp_async_wait<0>();
    out[4 * t + 2] = slots[1][t * 4];
    out[4 * t + 3] = slots[2][t * 4];
}

extern "C" int run_copies(const float* src, float* out) {
    return emulate_launch(copies, dim3{2, 1, 1}, dim3{128, 1, 1}, src, out);
}

extern "C" int run_deferred(float* out) {
    return emulate_launch(deferred, dim3{1, 1, 1}, dim3{128, 1, 1}, out);
}

extern "C" int run_handoff(unsigned threads, float* out, int rounds, int producer_runs) {
    return emulate_launch(handoff, dim3{2, 1, 1}, dim3{threads, 1, 1}, out, rounds, producer_runs);
}
"""


@pytest.fixture(scope="module")
def hopper_lib(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emulation_hopper")
    (folder / "handoff.cpp").write_text(HOPPER_SOURCE)
    subprocess.run([_compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-DFA_DTYPE=1", "-I", str(KERNEL_DIR),
                    "-include", str(KERNEL_DIR / "cpu_emulation.h"), str(folder / "handoff.cpp"),
                    "-o", str(folder / "handoff.so")], check=True, capture_output=True, timeout=300)
    return ctypes.CDLL(str(folder / "handoff.so"))


@pytest.mark.parametrize("threads, rounds", [(64, 1), (128, 5), (256, 8)])
def test_an_mbarrier_hands_each_value_to_every_consumer_in_turn(hopper_lib, threads, rounds):
    out = np.zeros(threads, np.float32)
    assert hopper_lib.run_handoff(threads, _ptr(out), rounds, 1) == 0
    assert (out[32:] == rounds * (rounds + 1) / 2).all()         # 1 + 2 + ... + rounds, each value once
    assert not out[:32].any()


def test_an_mbarrier_wait_that_can_never_end_fails_the_launch(hopper_lib):
    out = np.zeros(64, np.float32)
    assert hopper_lib.run_handoff(64, _ptr(out), 3, 0) == 1      # no producer: the consumers would spin forever
    assert hopper_lib.run_handoff(64, _ptr(out), 3, 1) == 0      # and the next launch runs normally
    assert (out[32:] == 6).all()


@pytest.mark.parametrize("address, step", [
    pytest.param(0x7F0000100000, 32, id="a-16-wide-k-step"),
    pytest.param(0x7F0000104000, 16 * 128 * 3, id="the-fourth-16-row-step-of-V"),
    pytest.param(0x7F000013FFE0, 32, id="the-start-field-carries-across-5x2^18"),
    pytest.param(0x7F000013C000, 0x4000 + 96, id="a-second-panel-across-the-same-boundary"),
    pytest.param(0x7F0000100400, 0, id="no-step"),
])
def test_desc_add_points_where_building_the_descriptor_again_would(hopper_lib, address, step):
    assert hopper_lib.check_desc_add(ctypes.c_ulonglong(address), step) == 1


def test_desc_add_refuses_a_step_that_is_not_whole_16_byte_units(hopper_lib):
    assert hopper_lib.check_desc_add(ctypes.c_ulonglong(0x7F0000100000), 8) == -1


def test_a_cp_async_copy_lands_only_at_the_wait_that_covers_its_group(hopper_lib):
    src = np.arange(1, 1025, dtype=np.float32)
    out = np.full(4 * 128, -1, np.float32)
    assert hopper_lib.run_copies(_ptr(src), _ptr(out)) == 0
    before, first, second, uncommitted = out[0::4], out[1::4], out[2::4], out[3::4]
    t = np.arange(128)
    assert (before == 0).all()                                   # issued, not waited for: the old value
    assert (first == src[4 * t]).all()                           # group 0 landed, group 1 not yet (slot 1 still 0)
    assert (second == src[512 + 4 * t]).all()
    assert (uncommitted == 0).all()                              # in no group: no wait covers it



def test_a_cp_async_copy_lands_as_it_is_issued_when_asked(hopper_lib, monkeypatch):
    # LESSONS_EMULATOR_CP_ASYNC=issue: the earliest a GPU may land a copy; every read after the copy sees it,
    # the uncommitted one too
    monkeypatch.setenv("LESSONS_EMULATOR_CP_ASYNC", "issue")
    src = np.arange(1, 1025, dtype=np.float32)
    out = np.full(4 * 128, -1, np.float32)
    assert hopper_lib.run_copies(_ptr(src), _ptr(out)) == 0
    t = np.arange(128)
    assert (out[0::4] == src[4 * t]).all()
    assert (out[1::4] == src[4 * t] + src[512 + 4 * t]).all()
    assert (out[2::4] == src[512 + 4 * t]).all() and (out[3::4] == src[4 * t]).all()
    monkeypatch.setenv("LESSONS_EMULATOR_CP_ASYNC", "wait")              # and back: the next launch waits again
    assert hopper_lib.run_copies(_ptr(src), _ptr(out)) == 0
    assert (out[0::4] == 0).all() and (out[3::4] == 0).all()

def test_a_wgmma_result_reaches_the_registers_only_at_its_wait(hopper_lib):
    out = np.zeros(256, np.float32)
    assert hopper_lib.run_deferred(_ptr(out)) == 0
    before, after = out[0::2], out[1::2]
    assert (before == 7).all() and (after == 7 + 16).all()
