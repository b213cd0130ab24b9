// Tiles on CUDA cores for the true-fp32 kernels (flash_simt.cu): the 16 x 16 thread grid, shared-memory
// staging, the two register-blocked FFMA tile products, half-warp row reductions and guarded row stores.
// Nothing here knows about attention; the score-tile steps and the kernels live in flash_simt.cu.
//
// Thread grid: 256 threads, tx = tid % 16, ty = tid / 16.
//   Score-like tiles (rows x cols): thread (ty, tx) owns rows ty + 16*i and columns tx + 16*j. The 16
//   threads of a row are one half-warp, so a row max / row sum is four xor-shuffles, and the rows a warp
//   writes to a shared tile are the rows that same warp reads back (__syncwarp suffices).
//   Output tiles (rows x kHeadDim): the same rows; columns in chunks of kVec (float4 when kHeadDim is a
//   multiple of 64, else float2): chunk c of thread tx covers columns (16*c + tx) * kVec + [0, kVec).
//
// Shared tiles of (rows x kHeadDim) operands are row-major with a pitch of kHeadDim + kPad floats: the
// 16 B pad makes eight consecutive rows start in eight different 16-byte bank groups (kHeadDim/4 + 1 is
// odd), so the float4 reads of 16 different rows in tile_dot_abt are conflict-free.
#pragma once

#include "cuflash/mma_sm80.cuh"
#include "cuflash/numeric.cuh"

namespace cuflash {
namespace simt {

constexpr int kThreads = 256;
constexpr int kLanesPerRow = 16;                      // a half-warp shares each tile row
constexpr int kThreadRows = kThreads / kLanesPerRow;  // 16
constexpr int kPad = 4;                               // floats of padding per smem row (16 B)

// The dynamic shared memory as floats; traps when the launch gave fewer than kBytes.
template <unsigned kBytes>
__device__ __forceinline__ float* shared_floats() {
    extern __shared__ __align__(16) float smem[];
    if (sm80::dynamic_smem_bytes() < kBytes) __trap();
    return smem;
}

// Columns of a (rows x kHeadDim) output tile that one thread owns.
template <int kHeadDim>
struct OutCols {
    static constexpr int kVec = kHeadDim % (kLanesPerRow * 4) == 0 ? 4 : 2;
    static constexpr int kChunks = kHeadDim / (kLanesPerRow * kVec);
    static constexpr int kPerThread = kChunks * kVec;
    static_assert(kHeadDim % (kLanesPerRow * kVec) == 0, "kHeadDim must be a multiple of 32");
    static __device__ __forceinline__ int col(int tx, int chunk) { return (chunk * kLanesPerRow + tx) * kVec; }
};

__device__ __forceinline__ bool aligned16(const void* ptr) {
    return (reinterpret_cast<unsigned long long>(ptr) & 15ull) == 0;
}

__device__ __forceinline__ int round_up4(int x) { return (x + 3) & ~3; }

// Stages rows [0, kRows) x columns [0, kCols) of a global row-major tile into shared memory (row
// pitch kPitch floats). Entries outside rows_valid x cols_valid are zero-filled and never read.
// 16-byte cp.async when the tile base and the row stride allow it (the caller waits on the group),
// else plain scalar loads (complete when the caller's next barrier passes).
template <int kRows, int kCols, int kPitch>
__device__ __forceinline__ void load_tile(float* smem, const float* gmem, long long row_stride,
                                          int rows_valid, int cols_valid) {
    constexpr int kChunksPerRow = kCols / 4;
    static_assert(kCols % 4 == 0 && kPitch % 4 == 0, "tiles are copied in 16-byte chunks");
    const bool vec = aligned16(gmem) && row_stride % 4 == 0 && cols_valid % 4 == 0;
    for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
        const int r = chunk / kChunksPerRow;
        const int c = (chunk % kChunksPerRow) * 4;
        float* dst = smem + r * kPitch + c;
        if (vec) {
            const bool valid = r < rows_valid && c < cols_valid;
            const float* src = valid ? gmem + r * row_stride + c : gmem;
            sm80::cp_async_16(sm80::smem_addr(dst), src, valid);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                dst[e] = (r < rows_valid && c + e < cols_valid) ? gmem[r * row_stride + c + e] : 0.f;
            }
        }
    }
}

// load_tile's gather form: tile row r is rows.at(row0 + r), a row functor's pointer (GQA-packed query rows,
// the rows of a paged cache). `base`: any valid address of the tensor, for the zero-filling copies. A chunk
// copies with cp.async when its source is 16-byte aligned, else with plain loads.
template <int kRows, int kCols, int kPitch, typename Rows>
__device__ __forceinline__ void load_tile_rows(float* smem, const Rows& rows, int row0, int rows_valid,
                                               int cols_valid, const void* base) {
    constexpr int kChunksPerRow = kCols / 4;
    static_assert(kCols % 4 == 0 && kPitch % 4 == 0, "tiles are copied in 16-byte chunks");
    for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
        const int r = chunk / kChunksPerRow;
        const int c = (chunk % kChunksPerRow) * 4;
        float* dst = smem + r * kPitch + c;
        const bool row_valid = r < rows_valid;
        const float* src = row_valid ? rows.at(row0 + r) + c : static_cast<const float*>(base);
        if (!row_valid || c >= cols_valid || (c + 4 <= cols_valid && aligned16(src))) {
            sm80::cp_async_16(sm80::smem_addr(dst), row_valid && c < cols_valid ? src : base,
                              row_valid && c < cols_valid);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) dst[e] = c + e < cols_valid ? src[e] : 0.f;
        }
    }
}

template <int kI, int kC>
__device__ __forceinline__ void fill_zero(float (&x)[kI][kC]) {
#pragma unroll
    for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int c = 0; c < kC; ++c) x[i][c] = 0.f;
}

template <int kI, int kC>
__device__ __forceinline__ void add_into(float (&acc)[kI][kC], const float (&x)[kI][kC]) {
#pragma unroll
    for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int c = 0; c < kC; ++c) acc[i][c] += x[i][c];
}

// acc[i][c] = acc[i][c] * factor[i] + x[i][c], one fma each (the forward's rescale of the running output).
template <int kI, int kC>
__device__ __forceinline__ void rescale_add_into(float (&acc)[kI][kC], const float (&factor)[kI],
                                                 const float (&x)[kI][kC]) {
#pragma unroll
    for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int c = 0; c < kC; ++c) acc[i][c] = fmaf(acc[i][c], factor[i], x[i][c]);
}

// acc[i][j] += sum_{d0 <= d < end} A[ty + 16i][d] * B[tx + 16j][d] in one fmaf chain, A and B in smem with row
// pitch kPitch; d0 and end are multiples of 4.
template <int kRowsA, int kRowsB, int kPitch>
__device__ __forceinline__ void tile_dot_abt_chain(float (&acc)[kRowsA / kThreadRows][kRowsB / kLanesPerRow],
                                                   const float* sA, const float* sB, int d0, int end, int tx, int ty) {
    constexpr int kI = kRowsA / kThreadRows;
    constexpr int kJ = kRowsB / kLanesPerRow;
#pragma unroll 2
    for (int d = d0; d < end; d += 4) {
        float4 a[kI], b[kJ];
#pragma unroll
        for (int i = 0; i < kI; ++i) a[i] = *reinterpret_cast<const float4*>(sA + (ty + i * kThreadRows) * kPitch + d);
#pragma unroll
        for (int j = 0; j < kJ; ++j) b[j] = *reinterpret_cast<const float4*>(sB + (tx + j * kLanesPerRow) * kPitch + d);
#pragma unroll
        for (int i = 0; i < kI; ++i) {
#pragma unroll
            for (int j = 0; j < kJ; ++j) {
                acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
                acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
                acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
                acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
            }
        }
    }
}

// Above 96 head-dim columns tile_dot_abt sums runs of kDotRun columns, each in its own chain, and adds the runs:
// fp32 rounding then grows with about depth / kDotRun + kDotRun terms instead of depth (cuBLAS blocks its sums
// too). One chain over 256 columns put the fp32 backward's dq / dk up to 3x past their tolerance where dropout's
// dP - D cancels (the long fuzz, session 51; a host emulation: 2.2x lower mean error at D256 with runs of 32).
// Up to 96 columns one chain stays: the D64 / D96 tiles hold 16 / 8 accumulators a thread, and a second set spilled.
constexpr int kDotRun = 32;

// acc[i][j] = sum_{d < depth} A[ty + 16i][d] * B[tx + 16j][d], A and B in smem with row pitch kPitch.
// depth is the runtime head dim rounded up to 4; the zero-filled columns past it are skipped.
template <int kRowsA, int kRowsB, int kPitch>
__device__ __forceinline__ void tile_dot_abt(float (&acc)[kRowsA / kThreadRows][kRowsB / kLanesPerRow],
                                             const float* sA, const float* sB, int depth, int tx, int ty) {
    constexpr int kI = kRowsA / kThreadRows;
    constexpr int kJ = kRowsB / kLanesPerRow;
    fill_zero(acc);
    if constexpr (kPitch - kPad <= 96) {
        tile_dot_abt_chain<kRowsA, kRowsB, kPitch>(acc, sA, sB, 0, depth, tx, ty);
    } else {
        for (int d0 = 0; d0 < depth; d0 += kDotRun) {
            float run[kI][kJ];
            fill_zero(run);
            tile_dot_abt_chain<kRowsA, kRowsB, kPitch>(run, sA, sB, d0, min(depth, d0 + kDotRun), tx, ty);
#pragma unroll
            for (int i = 0; i < kI; ++i)
#pragma unroll
                for (int j = 0; j < kJ; ++j) acc[i][j] += run[i][j];
        }
    }
}

// acc[i][c] += sum_{k < kDepth} P[ty + 16i][k] * B[k][col c], P in smem with pitch kPPitch (rows
// this thread's warp wrote), B a (kDepth x kHeadDim) smem tile with pitch kPitch.
template <int kRowsP, int kDepth, int kPPitch, int kHeadDim, int kPitch>
__device__ __forceinline__ void tile_acc_pb(float (&acc)[kRowsP / kThreadRows][OutCols<kHeadDim>::kPerThread],
                                            const float* sP, const float* sB, int tx, int ty) {
    using Cols = OutCols<kHeadDim>;
    constexpr int kI = kRowsP / kThreadRows;
    static_assert(kDepth % 4 == 0 && kPPitch % 4 == 0, "P rows are read as float4");
#pragma unroll 2
    for (int k = 0; k < kDepth; k += 4) {
        float4 p4[kI];
#pragma unroll
        for (int i = 0; i < kI; ++i) p4[i] = *reinterpret_cast<const float4*>(sP + (ty + i * kThreadRows) * kPPitch + k);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const float* b_row = sB + (k + kk) * kPitch;
#pragma unroll
            for (int c = 0; c < Cols::kChunks; ++c) {
                float b[Cols::kVec];
                if constexpr (Cols::kVec == 4) {
                    const float4 v = *reinterpret_cast<const float4*>(b_row + Cols::col(tx, c));
                    b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
                } else {
                    const float2 v = *reinterpret_cast<const float2*>(b_row + Cols::col(tx, c));
                    b[0] = v.x; b[1] = v.y;
                }
#pragma unroll
                for (int i = 0; i < kI; ++i) {
                    const float p = kk == 0 ? p4[i].x : kk == 1 ? p4[i].y : kk == 2 ? p4[i].z : p4[i].w;
#pragma unroll
                    for (int e = 0; e < Cols::kVec; ++e) {
                        acc[i][c * Cols::kVec + e] = fmaf(p, b[e], acc[i][c * Cols::kVec + e]);
                    }
                }
            }
        }
    }
}

// acc += P.B summed two-level: the block's product goes into a zeroed tile first, then into acc.
template <int kRowsP, int kDepth, int kPPitch, int kHeadDim, int kPitch, int kI, int kC>
__device__ __forceinline__ void add_block_product(float (&acc)[kI][kC], const float* sP, const float* sB, int tx,
                                                  int ty) {
    float block[kI][kC];
    fill_zero(block);
    tile_acc_pb<kRowsP, kDepth, kPPitch, kHeadDim, kPitch>(block, sP, sB, tx, ty);
    add_into(acc, block);
}

// Reductions over the 16 threads of a tile row (a half-warp: xor offsets < 16 stay inside it).
__device__ __forceinline__ float row_max16(float x) {
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
__device__ __forceinline__ float row_sum16(float x) {
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Writes vals[0, kVec) to dst_row[col, col + kVec), skipping columns >= cols_valid; one vector
// store when the address is aligned and the chunk lies wholly inside.
template <int kVec>
__device__ __forceinline__ void store_chunk(float* dst_row, int col, const float* vals, int cols_valid) {
    float* dst = dst_row + col;
    if (col + kVec <= cols_valid && (reinterpret_cast<unsigned long long>(dst) % (4 * kVec)) == 0) {
        if constexpr (kVec == 4) {
            *reinterpret_cast<float4*>(dst) = make_float4(vals[0], vals[1], vals[2], vals[3]);
        } else {
            *reinterpret_cast<float2*>(dst) = make_float2(vals[0], vals[1]);
        }
    } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            if (col + e < cols_valid) dst[e] = vals[e];
        }
    }
}

// Writes f(acc[c]) for this thread's columns of one output-tile row to dst_row, columns < cols_valid.
template <int kHeadDim, typename F>
__device__ __forceinline__ void store_row(float* dst_row, const float (&acc)[OutCols<kHeadDim>::kPerThread],
                                          int cols_valid, int tx, F f) {
    using Cols = OutCols<kHeadDim>;
#pragma unroll
    for (int c = 0; c < Cols::kChunks; ++c) {
        float vals[Cols::kVec];
#pragma unroll
        for (int e = 0; e < Cols::kVec; ++e) vals[e] = f(acc[c * Cols::kVec + e]);
        store_chunk<Cols::kVec>(dst_row, Cols::col(tx, c), vals, cols_valid);
    }
}

}  // namespace simt
}  // namespace cuflash
