// The accumulator contract of every mainloop (the sm80 mma.sync ones and the sm90 wgmma ones, whose
// m64nNk16 tiles give each warp the same layout): a warp holds a score tile as float acc[kMTiles][kNTiles][4]
// in the mma C-fragment layout, i.e. m-tile mt, n-tile nt, element e sits at
//   row = row0 + mt*16 + lane/4 + (e >= 2 ? 8 : 0),   col = col0 + nt*8 + (lane%4)*2 + (e & 1).
// The dK/dV kernels hold S^T (rows are keys, columns queries) as acc[kNTiles][4]: element e of n-tile nt of
// a lane sits at key = key_row + (e >= 2 ? 8 : 0) and query = query_col + nt*8 + (e & 1), with key_row /
// query_col the lane's own first key / query.
// The two walks below visit every element with its (row, col) / (query, key); the mask policies and the
// score modifiers are written against them.
#pragma once

namespace cuflash {

// fn(float& x, int row, int col, int mt, int nt, int e) for every element acc[mt][nt][e] of a C-fragment tile.
template <int kMTiles, int kNTiles, typename Fn>
__device__ __forceinline__ void for_each_score(float (&acc)[kMTiles][kNTiles][4], int row0, int col0, Fn&& fn) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                fn(acc[mt][nt][e], row0 + mt * 16 + lane / 4 + (e >= 2 ? 8 : 0), col0 + nt * 8 + (lane % 4) * 2 + (e & 1),
                   mt, nt, e);
            }
        }
    }
}

// fn(float& x0, float& x1, int row, int col, int mt, int nt, int half) for every column pair (col, col + 1) of a
// C-fragment tile: elements 2 * half and 2 * half + 1 of acc[mt][nt] (for operands read two columns at a time).
// for_each_score keeps a loop of its own: written through this one (the same visit order) it changed the SASS
// of every masked forward, the plain causal one included (ptxas 13.0, 2026-11-23).
template <int kMTiles, int kNTiles, typename Fn>
__device__ __forceinline__ void for_each_score_pair(float (&acc)[kMTiles][kNTiles][4], int row0, int col0, Fn&& fn) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                fn(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1], row0 + mt * 16 + lane / 4 + half * 8,
                   col0 + nt * 8 + (lane % 4) * 2, mt, nt, half);
            }
        }
    }
}

// fn(float& x, int query, int key, int nt, int e) for every element acc[nt][e] of a transposed (S^T) tile.
template <int kNTiles, typename Fn>
__device__ __forceinline__ void for_each_score_transposed(float (&acc)[kNTiles][4], int key_row, int query_col, Fn&& fn) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) fn(acc[nt][e], query_col + nt * 8 + (e & 1), key_row + (e >= 2 ? 8 : 0), nt, e);
    }
}

}  // namespace cuflash
