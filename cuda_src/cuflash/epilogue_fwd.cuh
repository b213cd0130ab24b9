// Forward epilogue: lse and the normalized output of a query block, for every forward mainloop (both
// hand over acc_o in the mma C-fragment layout).
#pragma once

#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/tile.cuh"

namespace cuflash {

// QTile: the Q tile's layout, whose shared memory the epilogue reuses for staging.
template <typename Elem, typename QTile, int kThreads>
struct FwdEpilogue {
    // One warp's rows: lse, then O (already normalized) packed to Elem into its own rows of the Q tile
    // (st.shared.b32 in the C layout: the 8 rows of a store land in 8 different 16-byte bank groups,
    // conflict-free) and read back as 16-byte chunks (8 lanes = one 128-byte line) for 16-byte global
    // stores. Rows >= Sq and columns >= Dv are never stored.
    // Reusing the Q tile is safe: every mainloop's last read of Q precedes its last CTA barrier (see each
    // mainloop), so no CTA-wide barrier is needed, and each warp touches only its own rows here.
    template <int kMTiles, int kDTiles>
    static __device__ __forceinline__ void store(const AttnParams& params, const SeqInfo& seq,
                                                 const float (&acc_o)[kMTiles][kDTiles][4],
                                                 const float (&lse)[kMTiles][2], int row_begin, int warp_row0,
                                                 unsigned smem_q) {
        using Traits = ElemTraits<Elem>;
        constexpr int kWarpRows = kMTiles * 16;
        constexpr int kPassRows = 32 / QTile::kPanelChunks;  // rows of one panel a warp reads per pass
        const int lane = threadIdx.x % 32;
        const int rows_valid = seq.seqlen_q - row_begin;

        float* lse_out = seq.lse(params, row_begin);
        if (lse_out != nullptr && lane % 4 == 0) {  // a quad shares its rows' lse
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = warp_row0 + mt * 16 + half * 8 + lane / 4;
                    if (row < rows_valid) lse_out[row] = lse[mt][half];
                }
            }
        }

#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = warp_row0 + mt * 16 + half * 8 + lane / 4;
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    st_shared_b32(smem_q + QTile::chunk_offset(row, dt) + lane % 4 * 4,
                                  Traits::pack2(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]));
                }
            }
        }
        __syncwarp();  // the warp's fragments are in shared memory before any lane reads a whole chunk

        Elem* o_rows = seq.o<Elem>(params, row_begin);
        // Each pass: kPassRows rows x one panel (8 rows x 4 chunks, or 4 rows x 8 chunks); 8 consecutive
        // lanes read one 128-byte bank line.
#pragma unroll
        for (int pass = 0; pass < QTile::kPanels * kWarpRows / kPassRows; ++pass) {
            const int panel = pass * kPassRows / kWarpRows;
            const int row = warp_row0 + pass * kPassRows % kWarpRows + lane / QTile::kPanelChunks;
            const int chunk = panel * QTile::kPanelChunks + lane % QTile::kPanelChunks;
            const uint4 v = ld_shared_b128(smem_q + QTile::chunk_offset(row, chunk));
            const int col = chunk * kChunkElems;
            if (row < rows_valid && col < params.head_dim_v) {
                *reinterpret_cast<uint4*>(o_rows + row * params.o_row_stride + col) = v;
            }
        }
    }

    // A query block that sees no key at all: O = 0 (16-byte stores) and lse = -inf for its valid rows, by
    // kStoreThreads threads, this one being number tid (the whole block, or the consumer warpgroups of the
    // warp-specialized mainloop).
    template <int kBlockM, int kStoreThreads = kThreads>
    static __device__ __forceinline__ void store_empty(const AttnParams& params, const SeqInfo& seq, int row_begin,
                                                       int tid = threadIdx.x) {
        constexpr int kChunksPerRow = QTile::kCols / kChunkElems;
        const int rows_valid = seq.seqlen_q - row_begin;
        Elem* o = seq.o<Elem>(params, row_begin);
        for (int idx = tid; idx < kBlockM * kChunksPerRow; idx += kStoreThreads) {
            const int row = idx / kChunksPerRow;
            const int col = idx % kChunksPerRow * kChunkElems;
            if (row < rows_valid && col < params.head_dim_v) {
                *reinterpret_cast<uint4*>(o + row * params.o_row_stride + col) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float* lse = seq.lse(params, row_begin);
        if (lse != nullptr) {
            for (int row = tid; row < kBlockM; row += kStoreThreads) {
                if (row < rows_valid) lse[row] = -INFINITY;
            }
        }
    }
};

}  // namespace cuflash
