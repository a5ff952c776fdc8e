// online_softmax.cu - softmax of each row of x, streaming over tiles of TILE columns.
//
// One thread block per row. Pass 1 walks the row tile by tile and keeps only the
// running (m, l) of the row: for each tile the block finds the tile's max
// (block reduction), moves m up, rescales l by alpha = exp(m_old - m_new) and adds
// the tile's sum of exp(x - m_new). Pass 2 writes y = exp(x - m) / l.
// That is two reads of x instead of the three of "max, then sum, then normalise".
// Source: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", Alg. 3.
//
// Launch: grid = (n_rows), block = (TILE). Every thread holds one column of a tile.
// Defines: TILE (threads per block = columns per tile, a multiple of 32, <= 1024),
//          FA_DTYPE, FA_TRACE (see common.cuh).
#include "common.cuh"

#ifndef TILE
#define TILE 256
#endif
#define NUM_WARPS (TILE / 32)
static_assert(TILE % 32 == 0 && TILE <= 1024, "TILE must be a multiple of 32 and at most 1024");

// Reduce one float per thread to one per block. Each warp reduces with shuffles,
// lane 0 leaves the warp's result in shared memory, and then *every* thread reads
// the NUM_WARPS partials in the same order, so all threads hold the same, bitwise
// reproducible value. The second __syncthreads() protects `partial` from being
// overwritten by the next reduction while a slow thread still reads it.
__device__ __forceinline__ float block_max(float x, float* partial) {
    x = group_max<32>(x);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
    __syncthreads();
    float r = partial[0];
    for (int w = 1; w < NUM_WARPS; ++w) r = fmaxf(r, partial[w]);
    __syncthreads();
    return r;
}

__device__ __forceinline__ float block_sum(float x, float* partial) {
    x = group_sum<32>(x);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
    __syncthreads();
    float r = partial[0];
    for (int w = 1; w < NUM_WARPS; ++w) r += partial[w];
    __syncthreads();
    return r;
}

// x, y: (n_rows, n_cols) C-contiguous; lse: (n_rows,) float32.
// trace_rows: (n_trace_rows,) row indices to record; trace: (n_trace_rows, n_tiles, 3).
extern "C" __global__ void __launch_bounds__(TILE)
online_softmax(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, float* __restrict__ lse,
               int n_rows, int n_cols,
               const int* __restrict__ trace_rows, int n_trace_rows, float* __restrict__ trace) {
    __shared__ float partial[NUM_WARPS];

    const int row = blockIdx.x;
    if (row >= n_rows) return;                  // the whole block leaves together: no barrier is skipped
    const scalar_t* x_row = x + (long long)row * n_cols;
    scalar_t* y_row = y + (long long)row * n_cols;
    const int n_tiles = (n_cols + TILE - 1) / TILE;

#ifdef FA_TRACE
    int trace_slot = -1;                        // where this row's trace goes, if it is traced
    for (int i = 0; i < n_trace_rows; ++i)
        if (trace_rows[i] == row) trace_slot = i;
#endif

    // ---- pass 1: the running (m, l), one tile at a time --------------------------
    float m = NEG_INF;                          // every thread keeps the same copy
    float l = 0.f;
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int j = tile * TILE + threadIdx.x;
        const float s = j < n_cols ? to_float(x_row[j]) : NEG_INF;   // past the end: -inf, never read

        const float m_new = fmaxf(m, block_max(s, partial));
        const float alpha = correction_factor(m, m_new);
        const float p = expf(s - safe_max(m_new));                     // exp(-inf) = 0 past the end
        l = alpha * l + block_sum(p, partial);
        m = m_new;

#ifdef FA_TRACE
        if (trace_slot >= 0 && threadIdx.x == 0) {
            float* rec = trace + ((long long)trace_slot * n_tiles + tile) * TRACE_FIELDS;
            rec[0] = m; rec[1] = alpha; rec[2] = l;
        }
#endif
    }

    // ---- pass 2: normalise once -----------------------------------------------------
    // A row with nothing visible (all -inf, or no columns) has l == 0: y = 0, lse = -inf.
    const float m_safe = safe_max(m);
    for (int j = threadIdx.x; j < n_cols; j += TILE) {
        const float p = expf(to_float(x_row[j]) - m_safe);
        y_row[j] = from_float(l != 0.f ? p / l : 0.f);
    }
    if (threadIdx.x == 0) lse[row] = l != 0.f ? m + logf(l) : NEG_INF;
}
