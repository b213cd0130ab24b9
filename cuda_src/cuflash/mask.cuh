// Which (query, key) pairs are visible, for every mainloop.
//
// Accumulator contract (shared by the sm80 mma.sync mainloops and, later, the sm90 wgmma ones):
// a warp holds a score tile as float acc[kMTiles][kNTiles][4] in the mma C-fragment layout, i.e.
// m-tile mt, n-tile nt, element e sits at
//   row = row0 + mt*16 + lane/4 + (e >= 2 ? 8 : 0),   col = col0 + nt*8 + (lane%4)*2 + (e & 1).
// Masks are applied only to tiles that can contain an invisible pair (see needs_mask), so the
// common interior tile pays nothing. Future masks (window, segment / block ids, bool masks) extend
// `visible` and the block ranges below; the mainloops do not change.
#pragma once

#include "cuflash/numeric.cuh"

namespace cuflash {

template <bool kIsCausal>
struct AttnMask {
    int seqlen_q;
    int seqlen_k;
    int causal_offset;  // seqlen_k - seqlen_q (bottom-right aligned causal)

    __device__ __forceinline__ bool visible(int row, int col) const {
        if (col >= seqlen_k) return false;
        if (kIsCausal && col > row + causal_offset) return false;
        return true;
    }

    // Key blocks [n_begin, n_end) that query block m_block (rows [m_block*kBlockM, +kBlockM)) can see.
    // n_end <= n_begin means every row of the block sees nothing (output 0, lse -inf).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void key_block_range(int m_block, int& n_begin, int& n_end) const {
        n_begin = 0;
        n_end = ceil_div(seqlen_k, kBlockN);
        if (kIsCausal) {
            const int last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
            const int last_col = last_row + causal_offset;  // last key the block's last row sees
            n_end = min(n_end, last_col < 0 ? 0 : last_col / kBlockN + 1);
        }
    }

    // Query blocks [m_begin, m_end) that see any key of key block n_block (for the backward).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void query_block_range(int n_block, int& m_begin, int& m_end) const {
        m_begin = 0;
        m_end = ceil_div(seqlen_q, kBlockM);
        if (kIsCausal) {
            const int first_row = n_block * kBlockN - causal_offset;  // first row seeing this block
            m_begin = first_row <= 0 ? 0 : first_row / kBlockM;
        }
    }

    // Key blocks below the returned index are visible to every row of query block m_block (no per-element
    // test needed): inside the keys and, for causal, left of the diagonal of the block's first row.
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ int key_interior_end(int m_block) const {
        int end = seqlen_k / kBlockN;
        if (kIsCausal) {
            const int first_row_last_col = m_block * kBlockM + causal_offset;  // last key row 0 sees
            end = min(end, first_row_last_col < 0 ? 0 : (first_row_last_col + 1) / kBlockN);
        }
        return end;
    }

    // True when the tile [row0, row0+rows) x [col0, col0+cols) may contain an invisible pair.
    __device__ __forceinline__ bool needs_mask(int row0, int rows, int col0, int cols) const {
        if (col0 + cols > seqlen_k) return true;
        if (kIsCausal && col0 + cols - 1 > row0 + causal_offset) return true;
        return false;
    }

    // Sets invisible scores of a C-fragment tile to -inf.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + mt * 16 + lane / 4 + (e >= 2 ? 8 : 0);
                    const int col = col0 + nt * 8 + (lane % 4) * 2 + (e & 1);
                    if (!visible(row, col)) acc[mt][nt][e] = -INFINITY;
                }
            }
        }
    }

    // The transposed form (the dK/dV kernels' S^T: rows are keys, columns queries), which also hides
    // queries >= rows_valid (the backward's zero-filled rows past Sq carry no lse to zero them):
    // element e of n-tile nt of a lane sits at key = key_row + (e >= 2 ? 8 : 0) and query = query_col +
    // nt*8 + (e & 1), with key_row / query_col the lane's own first key / query.
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kNTiles][4], int key_row, int query_col,
                                                     int rows_valid) const {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key_row + (e >= 2 ? 8 : 0);
                const int query = query_col + nt * 8 + (e & 1);
                const bool ok = (query < rows_valid) & visible(query, key);
                acc[nt][e] = ok ? acc[nt][e] : -INFINITY;
            }
        }
    }
};

}  // namespace cuflash
