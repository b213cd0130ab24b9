// Shared-memory tiles and the copies that fill them, for every tensor-core kernel.
//
// SwizzledTile<kRows, kCols, kPanelCols>: a kRows x kCols tile of 16-bit elements, stored as kCols /
// kPanelCols panels of kRows rows each (panel-major); a panel row is kPanelCols / 8 chunks of 16 bytes.
// Inside a panel row, chunks form aligned swizzle groups of kGroup chunks, and logical chunk c of row r
// sits at slot (c ^ f(r)) of its group:
//   kGroup 8 (kPanelCols a multiple of 64), f(r) = r % 8: with 64-column panels this is the hardware's
//     128-byte swizzle when each panel starts 1024-byte aligned, so wgmma (cuflash/wgmma_sm90.cuh) reads
//     these tiles as they are ("wide panels");
//   kGroup 4, f(r) = (r / 2) % 4: two 64-byte half lines per 128-byte bank line, f separating the four
//     row pairs. The forward's mma.sync path uses 32-column panels ("narrow panels": 64-byte rows); the
//     backward uses one panel per row (kPanelCols = kCols) for widths that are no multiple of 64.
// In every layout, the 16-byte chunk at one logical column of 8 consecutive rows starting at a multiple of 8
// lands in 8 different bank groups: ldmatrix phases, cp.async quarter warps and 4-byte C-fragment stores
// are conflict free.
#pragma once

#include "cuflash/mma_sm80.cuh"

namespace cuflash {

constexpr int kChunkBytes = 16;  // one cp.async, one ldmatrix row
constexpr int kChunkElems = 8;   // 16-bit elements per chunk

template <int kRows_, int kCols_, int kPanelCols_>
struct SwizzledTile {
    static constexpr int kRows = kRows_;
    static constexpr int kCols = kCols_;
    static constexpr int kPanelCols = kPanelCols_;
    static_assert(kPanelCols % 32 == 0 && kCols % kPanelCols == 0, "tiles are whole panels of >= 64-byte rows");
    static constexpr int kChunks = kCols / kChunkElems;
    static constexpr int kPanelChunks = kPanelCols / kChunkElems;
    static constexpr int kGroup = kPanelChunks % 8 == 0 ? 8 : 4;
    static constexpr int kPanels = kCols / kPanelCols;
    static constexpr int kPanelRowBytes = kPanelChunks * kChunkBytes;  // row to row inside a panel
    static constexpr int kRowBytes = kPanelRowBytes;
    static constexpr int kPanelBytes = kRows * kPanelRowBytes;
    // Chunk group to chunk group: the next panel, or the next group inside a one-panel row.
    static constexpr int kGroupBytes = kGroup == kPanelChunks ? kPanelBytes : kGroup * kChunkBytes;
    static_assert(kGroup == kPanelChunks || kPanels == 1, "several swizzle groups per row only in one panel");
    static constexpr int kBytes = kPanels * kPanelBytes;

    static __device__ __forceinline__ int swizzle_term(int row) { return kGroup == 8 ? (row & 7) : ((row >> 1) & 3); }
    // Byte offset of the 16-byte chunk holding columns [8*chunk, 8*chunk + 8) of row `row`.
    static __device__ __forceinline__ unsigned chunk_offset(int row, int chunk) {
        return static_cast<unsigned>((chunk / kGroup) * kGroupBytes + row * kRowBytes +
                                     ((chunk ^ swizzle_term(row)) & (kGroup - 1)) * kChunkBytes);
    }
    static __device__ __forceinline__ unsigned elem_offset(int row, int col) {
        return chunk_offset(row, col >> 3) + static_cast<unsigned>((col & 7) * 2);
    }
};

// The backward's layout: wide panels (the wgmma layout) where the width allows, else one 4-chunk-swizzled
// panel per row.
template <int kRows, int kCols>
using PanelTile = SwizzledTile<kRows, kCols, kCols % 64 == 0 ? 64 : kCols>;

// Shared-memory accesses as volatile asm, so they stay ordered with the (volatile asm) cp.async and
// ldmatrix touching the same bytes; barriers separate writers from readers of other warps.
__device__ __forceinline__ void st_shared_b32(unsigned addr, unsigned value) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}
__device__ __forceinline__ unsigned ld_shared_b32(unsigned addr) {
    unsigned value;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
    return value;
}

__device__ __forceinline__ void st_shared_b128(unsigned addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w));
}

__device__ __forceinline__ uint4 ld_shared_b128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}

__device__ __forceinline__ float2 ld_shared_f32x2(unsigned addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

__device__ __forceinline__ void st_shared_f32x4(unsigned addr, float x, float y, float z, float w) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(x), "f"(y), "f"(z), "f"(w));
}

// 4-byte global->shared async copy, zero-filling when !valid (lse / softmax_d rows carry no 16-byte
// alignment guarantee: their row stride is Sq).
__device__ __forceinline__ void cp_async_4(unsigned smem_dst, const void* gmem_src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
                 "r"(valid ? 4 : 0));
}

// ---------------------------------------------------------------------------------------------------
// Copies into a tile. Both zero-fill (cp.async with src-size 0) what lies past the valid rows / columns,
// reading nothing there, so tail tiles stay finite; both issue exactly the same number of cp.async per
// thread whatever the bounds, so cp.async group counts stay uniform.

// Where a tile's rows come from. StridedRows: row r at base + r * row_stride (every kernel's bshd slices);
// a gather (GqaRows, PagedRows in cuflash/kvcache.cuh) has at(r), the address of row r's first element, asked
// only for rows inside the slice.
template <typename Elem_>
struct StridedRows {
    using Elem = Elem_;
    static constexpr bool kGather = false;
    const Elem* base;
    long long row_stride;
};
template <typename Rows>
using Elem_of = typename Rows::Elem;

// Panel-row-parallel copy (the forward's streamed K / V / Q tiles, one-panel-row groups of kPanelChunks
// lanes, so 8 consecutive threads fill one 128-byte bank line and each group reads 64 / 128 contiguous
// global bytes). Rows [tile_row0, tile_row0 + kRows) x columns [0, kCols) of a (seqlen, dim) slice whose
// rows `rows` locates. With kChecked, rows >= seqlen and columns >= cols_valid are zero-filled
// (`fallback`, the tensor's base, stands in as the address); without, the caller guarantees the tile is in
// bounds (strided rows only). A thread's rows differ by multiples of 8 between passes, so its swizzle term,
// and hence everything but compile-time offsets, is fixed per tile.
template <typename Tile, int kThreads, bool kChecked, typename Rows>
__device__ __forceinline__ void copy_tile_rows(unsigned smem_tile, const Rows& rows, int tile_row0, int seqlen,
                                               int cols_valid, const void* fallback) {
    constexpr int kRows = Tile::kRows;
    constexpr int kGroupLanes = Tile::kPanelChunks;
    constexpr int kSlotsPerPass = kThreads / kGroupLanes;  // panel rows copied per pass, one per group
    // Both are powers of two: a pass covers part of one panel (kRowPasses passes per panel), or
    // whole panels (kPanelsPerPass of them).
    static_assert(kSlotsPerPass % kRows == 0 || kRows % kSlotsPerPass == 0, "rows and threads mismatch");
    static_assert(kSlotsPerPass % 8 == 0, "rows of one thread must share their swizzle term");
    static_assert(kChecked || !Rows::kGather, "gathered rows are always checked");
    constexpr bool kPartPanel = kRows % kSlotsPerPass == 0;
    constexpr int kRowPasses = kPartPanel ? kRows / kSlotsPerPass : 1;
    constexpr int kPanelsPerPass = kPartPanel ? 1 : kSlotsPerPass / kRows;
    constexpr int kPasses = kRowPasses * ((Tile::kPanels + kPanelsPerPass - 1) / kPanelsPerPass);

    const int group = threadIdx.x / kGroupLanes;
    const int chunk = threadIdx.x % kGroupLanes;
    const int row0 = kPartPanel ? group : group % kRows;
    const int panel0 = kPartPanel ? 0 : group / kRows;
    // The row index stays a 32-bit int until one widening multiply by the stride.
    const int thread_row = tile_row0 + row0;
    const int thread_col = panel0 * Tile::kPanelCols + chunk * kChunkElems;
    const auto* thread_src = Rows::kGather ? nullptr
                                           : rows.base + thread_row * rows.row_stride + panel0 * Tile::kPanelCols +
                                                 chunk * kChunkElems;
    const unsigned thread_dst = smem_tile + Tile::chunk_offset(row0, panel0 * kGroupLanes + chunk);
    const long long pass_row_stride = Rows::kGather ? 0 : kSlotsPerPass * rows.row_stride;
    // Validity as "compile-time offset < thread-fixed bound": no per-pass row or column registers.
    const int rows_left = seqlen - thread_row;
    const int cols_left = cols_valid - (panel0 * Tile::kPanelCols + chunk * kChunkElems);
    // A gather looks each of the thread's rows up once (kRowPasses rows; the panels reuse them), and only
    // rows inside the slice.
    const Elem_of<Rows>* gathered[Rows::kGather ? kRowPasses : 1];
    if constexpr (Rows::kGather) {
#pragma unroll
        for (int row_pass = 0; row_pass < kRowPasses; ++row_pass) {
            const int row = thread_row + row_pass * kSlotsPerPass;
            gathered[row_pass] = row_pass * kSlotsPerPass < rows_left ? rows.at(row) + thread_col : nullptr;
        }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        const int row_pass = pass % kRowPasses;                     // rows advance by kSlotsPerPass ...
        const int panel_step = pass / kRowPasses * kPanelsPerPass;  // ... then panels
        if (!kPartPanel && Tile::kPanels % kPanelsPerPass != 0 && panel0 + panel_step >= Tile::kPanels) break;
        const bool valid =
            !kChecked || (row_pass * kSlotsPerPass < rows_left && panel_step * Tile::kPanelCols < cols_left);
        const void* gmem;
        if constexpr (Rows::kGather) {
            gmem = valid ? static_cast<const void*>(gathered[row_pass] + panel_step * Tile::kPanelCols) : fallback;
        } else {
            const auto* src = thread_src + row_pass * pass_row_stride + panel_step * Tile::kPanelCols;
            gmem = valid ? static_cast<const void*>(src) : fallback;
        }
        sm80::cp_async_16(
            thread_dst + row_pass * kSlotsPerPass * Tile::kPanelRowBytes + panel_step * Tile::kPanelBytes, gmem, valid);
    }
}

template <typename Tile, int kThreads, bool kChecked, typename Elem>
__device__ __forceinline__ void copy_tile(unsigned smem_tile, const Elem* base, long long row_stride,
                                          int tile_row0, int seqlen, int cols_valid, const void* fallback) {
    copy_tile_rows<Tile, kThreads, kChecked>(smem_tile, StridedRows<Elem>{base, row_stride}, tile_row0, seqlen,
                                             cols_valid, fallback);
}

// copy_tile for any tile. With kInteriorFastPath, a tile entirely in bounds (all rows < seqlen,
// cols_valid = kCols: the common case) skips the per-copy test and its address select: one uniform branch
// per tile instead of ~5 instructions per copy. Kernels turn it off where the accumulators already take
// ~192 registers: there the second copy of the pass loop made ptxas spill (sm_90a, D128 128 x 64).
template <typename Tile, int kThreads, bool kInteriorFastPath, typename Elem>
__device__ __forceinline__ void load_tile(unsigned smem_tile, const Elem* base, long long row_stride,
                                          int tile_row0, int seqlen, int cols_valid, const void* fallback) {
    if (kInteriorFastPath && tile_row0 + Tile::kRows <= seqlen && cols_valid >= Tile::kCols) {
        copy_tile<Tile, kThreads, false>(smem_tile, base, row_stride, tile_row0, seqlen, cols_valid, fallback);
    } else {
        copy_tile<Tile, kThreads, true>(smem_tile, base, row_stride, tile_row0, seqlen, cols_valid, fallback);
    }
}

// Flat-index copy (the backward's tiles, any width): thread i copies chunks i, i + kThreads, ... of the
// kRows x kChunks tile whose row 0, column 0 is gmem_tile (in bounds: the dummy source of zero-fills).
// Rows >= rows_valid and columns >= cols_valid (a multiple of 8) are zero-filled, not read. kRowWalk (the
// wgmma mainloops' loads): where the shape allows, each thread keeps one chunk column and walks rows (see
// below). The mma.sync kernels keep the per-chunk addressing: with the row walk ptxas 13.0 allocated four
// sm_80 dK/dV variants 8-16 bytes more spill, and no A100 was there to time them.
template <typename Tile, int kThreads, bool kRowWalk = false, typename Elem>
__device__ __forceinline__ void copy_tile_flat(unsigned smem_tile, const Elem* gmem_tile, long long row_stride,
                                               int rows_valid, int cols_valid, int tid) {
    constexpr int kTotal = Tile::kRows * Tile::kChunks;
    constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
    constexpr int kRowStep = kThreads / Tile::kChunks;
    if constexpr (kRowWalk && kThreads % Tile::kChunks == 0 && kTotal % kThreads == 0 && kRowStep % 8 == 0) {
        // Each thread keeps one chunk column and walks rows kRowStep apart: a multiple of the swizzle
        // period, so the shared offset and the source pointer advance by constants (one address
        // computation per tile instead of one per chunk).
        const unsigned u = static_cast<unsigned>(tid);
        const int row0 = static_cast<int>(u / Tile::kChunks), chunk = static_cast<int>(u % Tile::kChunks);
        const bool col_ok = chunk * kChunkElems < cols_valid;
        const Elem* src = gmem_tile + row0 * row_stride + chunk * kChunkElems;
        const unsigned dst = smem_tile + Tile::chunk_offset(row0, chunk);
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const bool valid = col_ok && row0 + it * kRowStep < rows_valid;
            sm80::cp_async_16(dst + it * kRowStep * Tile::kRowBytes, valid ? src + it * kRowStep * row_stride : gmem_tile,
                              valid);
        }
    } else if constexpr (kRowWalk && kThreads % Tile::kChunks == 0 && kTotal % kThreads == 0 && 8 % kRowStep == 0) {
        // The same walk with rows fewer than the swizzle period apart (a 128-thread producer over 256-column
        // tiles: 4): one shared offset per row phase of the period, each advancing by whole periods.
        constexpr int kPhases = 8 / kRowStep;
        const unsigned u = static_cast<unsigned>(tid);
        const int row0 = static_cast<int>(u / Tile::kChunks), chunk = static_cast<int>(u % Tile::kChunks);
        const bool col_ok = chunk * kChunkElems < cols_valid;
        const Elem* src = gmem_tile + row0 * row_stride + chunk * kChunkElems;
        unsigned dst[kPhases];
#pragma unroll
        for (int ph = 0; ph < kPhases; ++ph) dst[ph] = smem_tile + Tile::chunk_offset(row0 + ph * kRowStep, chunk);
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const bool valid = col_ok && row0 + it * kRowStep < rows_valid;
            sm80::cp_async_16(dst[it % kPhases] + (it / kPhases) * 8 * Tile::kRowBytes,
                              valid ? src + it * kRowStep * row_stride : gmem_tile, valid);
        }
    } else {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int i = tid + it * kThreads;
            if (kTotal % kThreads == 0 || i < kTotal) {
                const int row = i / Tile::kChunks;
                const int chunk = i % Tile::kChunks;
                const bool valid = row < rows_valid && chunk * kChunkElems < cols_valid;
                const Elem* src = valid ? gmem_tile + row * row_stride + chunk * kChunkElems : gmem_tile;
                sm80::cp_async_16(smem_tile + Tile::chunk_offset(row, chunk), src, valid);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// A lane's address into a swizzled tile: (row, chunk) with the swizzle applied, where row / chunk are the
// lane's own row / chunk of an ldmatrix pattern plus warp-uniform offsets. at(dr, dc) addresses
// (row + dr, chunk + dc) for a compile-time dr that is a multiple of 8 (f does not change) and a
// compile-time dc such that chunk % kGroup and dc % kGroup have no bit in common and sum to less than
// kGroup (always true when dc is a multiple of kGroup). The in-group chunk bits then compose by XOR and
// the rest is an immediate: one LOP3 per ldmatrix. Needs the tile base kGroup*16-byte aligned.
template <typename Tile>
struct SmemCursor {
    unsigned addr;
    __device__ __forceinline__ SmemCursor(unsigned tile, int row, int chunk)
        : addr(tile + Tile::chunk_offset(row, chunk)) {}
    __device__ __forceinline__ unsigned at(int dr, int dc) const {
        return (addr ^ static_cast<unsigned>((dc % Tile::kGroup) * kChunkBytes)) +
               static_cast<unsigned>(dr * Tile::kRowBytes + (dc / Tile::kGroup) * Tile::kGroupBytes);
    }
};

// The two ldmatrix.x4 lane patterns (lane l gives the row address of row l % 8 of 8x8 matrix l / 8;
// register i receives matrix i, thread l holding (row l/4, cols 2(l%4), +1) of it, or of its transpose
// with .trans):
//   cursor_a: matrices (r 0-7, c 0-7), (r 8-15, c 0-7), (r 0-7, c 8-15), (r 8-15, c 8-15).
//     Non-trans on a [m][k] tile: the A fragment a0..a3 of a 16x16 tile.
//     .trans on a [k][n] tile: B fragments {b0, b1} of n-tile 0 (regs 0, 1) and of n-tile 1 (regs 2, 3).
//   cursor_b: matrices (r 0-7, c 0-7), (r 0-7, c 8-15), (r 8-15, c 0-7), (r 8-15, c 8-15).
//     Non-trans on a [n][k] tile: B fragments of n-tile 0 (regs 0, 1) and n-tile 1 (regs 2, 3).
//     .trans on a [k][m] tile: the A fragment a0..a3 of the 16x16 tile of the transpose.
template <typename Tile>
__device__ __forceinline__ SmemCursor<Tile> cursor_a(unsigned tile, int row0, int chunk0, int lane) {
    return SmemCursor<Tile>(tile, row0 + (lane & 7) + ((lane >> 3) & 1) * 8, chunk0 + (lane >> 4));
}

template <typename Tile>
__device__ __forceinline__ SmemCursor<Tile> cursor_b(unsigned tile, int row0, int chunk0, int lane) {
    return SmemCursor<Tile>(tile, row0 + (lane & 7) + (lane >> 4) * 8, chunk0 + ((lane >> 3) & 1));
}

}  // namespace cuflash
