// Warp-level GEMM pieces on mma.sync m16n8k16 (sm_80 and later), over SwizzledTile operands, for every
// kernel family. The C layout (g = lane / 4, t = lane % 4; element e of n-tile nt at row g + 8*(e >= 2),
// column 8*nt + 2t + (e & 1)) is the accumulator contract of cuda_src/README.md.
//
// Two addressing styles, both kept on purpose:
//   - LdmatrixLanes + gemm_qk / gemm_pv: the forward's narrow-panel (32-column) tiles, the per-lane part
//     of every address precomputed once per kernel (registers are plentiful in the forward);
//   - SmemCursor + gemm_abt / gemm_ab: any tile, the lane's address rebuilt per call from an opaque lane
//     index (the backward holds ~192 accumulator registers and cannot keep hoisted addresses).
#pragma once

#include "cuflash/mma_sm80.cuh"
#include "cuflash/tile.cuh"

namespace cuflash {

// x = fn(x) for every element of a warp's C-fragment tile.
template <int kNTiles, typename Fn>
__device__ __forceinline__ void transform(float (&acc)[kNTiles][4], Fn&& fn) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = fn(acc[nt][e]);
    }
}

template <int kNTiles>
__device__ __forceinline__ void clear(float (&acc)[kNTiles][4]) {
    transform(acc, [](float) { return 0.f; });
}

template <int kMTiles, int kNTiles>
__device__ __forceinline__ void clear(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) clear(acc[mt]);
}

// C fragments of n-tiles 2kk, 2kk+1 (16 rows x 16 cols) -> the A fragment of k-tile kk (which wgmma's
// register A operand shares): a0 = (row g, k 2t..), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..),
// a3 = (row g+8, k 2t+8..). This is how P (and dS) never leave registers between two GEMMs.
template <typename Elem, int kNTiles>
__device__ __forceinline__ void c_to_a(unsigned (&a)[4], const float (&c)[kNTiles][4], int kk) {
    a[0] = ElemTraits<Elem>::pack2(c[2 * kk][0], c[2 * kk][1]);
    a[1] = ElemTraits<Elem>::pack2(c[2 * kk][2], c[2 * kk][3]);
    a[2] = ElemTraits<Elem>::pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = ElemTraits<Elem>::pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// A whole C tile (16 x 8*kNTiles) -> the A fragments of its kNTiles/2 k-tiles.
template <typename Elem, int kNTiles>
__device__ __forceinline__ void pack_a(unsigned (&a)[kNTiles / 2][4], const float (&c)[kNTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) c_to_a<Elem>(a[kk], c, kk);
}

template <typename Elem>
__device__ __forceinline__ void mma_pair(float (&c0)[4], float (&c1)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[4]) {
    const unsigned b0[2] = {b[0], b[1]};
    const unsigned b1[2] = {b[2], b[3]};
    sm80::mma_16816<Elem>(c0, a, b0);
    sm80::mma_16816<Elem>(c1, a, b1);
}

// Stores A fragments of a warp's 16 rows (row0..) x 16*kKTiles columns (from column 0) into a swizzled tile.
template <typename Tile, int kKTiles>
__device__ __forceinline__ void store_a_tile(unsigned tile, const unsigned (&a)[kKTiles][4], int row0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < kKTiles; ++kk) {
        st_shared_b32(tile + Tile::elem_offset(row0 + g, kk * 16 + 2 * t), a[kk][0]);
        st_shared_b32(tile + Tile::elem_offset(row0 + g + 8, kk * 16 + 2 * t), a[kk][1]);
        st_shared_b32(tile + Tile::elem_offset(row0 + g, kk * 16 + 8 + 2 * t), a[kk][2]);
        st_shared_b32(tile + Tile::elem_offset(row0 + g + 8, kk * 16 + 8 + 2 * t), a[kk][3]);
    }
}

// Stores a warp's C tile (16 rows from row0, 8*kNTiles columns from col0) as Elem into a swizzled tile.
template <typename Elem, typename Tile, int kNTiles>
__device__ __forceinline__ void store_c_tile(unsigned tile, const float (&c)[kNTiles][4], int row0, int col0,
                                             int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const int col = col0 + nt * 8 + 2 * t;
        st_shared_b32(tile + Tile::elem_offset(row0 + g, col), ElemTraits<Elem>::pack2(c[nt][0], c[nt][1]));
        st_shared_b32(tile + Tile::elem_offset(row0 + g + 8, col), ElemTraits<Elem>::pack2(c[nt][2], c[nt][3]));
    }
}

// acc (16 x 8*kNTiles) += A (16 x kK) . B^T, both operands stored K-contiguous: a_cur = cursor_a on the
// A tile at the warp's 16 rows, b_cur = cursor_b on the B tile at the warp's first n row.
template <typename Elem, int kK, int kNTiles, typename TileA, typename TileB>
__device__ __forceinline__ void gemm_abt(float (&acc)[kNTiles][4], const SmemCursor<TileA>& a_cur,
                                         const SmemCursor<TileB>& b_cur) {
    static_assert(kK % 16 == 0 && kNTiles % 2 == 0, "gemm_abt works on 16 x 16 steps");
#pragma unroll
    for (int kt = 0; kt < kK / 16; ++kt) {
        unsigned a[4];
        sm80::ldmatrix_x4(a, a_cur.at(0, 2 * kt));
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            unsigned b[4];
            sm80::ldmatrix_x4(b, b_cur.at(16 * np, 2 * kt));
            mma_pair<Elem>(acc[2 * np], acc[2 * np + 1], a, b);
        }
    }
}

// acc (16 x 8*kNTiles) += A (16 x 16*kKTiles) . B, B stored [k][n] and read with .trans: b_cur = cursor_a
// on the B tile at k row 0 and the warp's first n chunk; n-tile pair np lives kPairStride chunks after
// pair np - 1 (2 when a warp owns contiguous columns, 2*kWarpsD when warps interleave 16-column groups).
// a_frag(kk, a) yields the A fragment of k-tile kk (from registers or from shared memory).
template <typename Elem, int kKTiles, int kNTiles, int kPairStride, typename TileB, typename AFrag>
__device__ __forceinline__ void gemm_ab(float (&acc)[kNTiles][4], AFrag&& a_frag, const SmemCursor<TileB>& b_cur) {
    static_assert(kNTiles % 2 == 0, "gemm_ab works on pairs of n-tiles");
#pragma unroll
    for (int kk = 0; kk < kKTiles; ++kk) {
        unsigned a[4];
        a_frag(kk, a);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            unsigned b[4];
            sm80::ldmatrix_x4_trans(b, b_cur.at(16 * kk, kPairStride * np));
            mma_pair<Elem>(acc[2 * np], acc[2 * np + 1], a, b);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The forward's panel GEMMs, on SwizzledTile<rows, cols, kPanelCols> tiles: NarrowTile (32-column panels of
// 64-byte rows: every forward) or WideTile (64-column panels of 128-byte rows: the KV cache's streamed tiles,
// whose copies then fill whole 128-byte lines, cuflash/tile.cuh copy_tile_rows).
template <int kRows, int kCols>
using NarrowTile = SwizzledTile<kRows, kCols, 32>;
template <int kRows, int kCols>
using WideTile = SwizzledTile<kRows, kCols, 64>;

// The per-lane part of every ldmatrix address into a panel tile, by the 16-column k-step within a panel
// (a panel holds kPanelCols / 16). Every ldmatrix tile starts on a 16-row boundary, so the swizzle term
// depends on the lane only.
template <int kPanelCols = 32>
struct LdmatrixLanes {
    static constexpr int kSteps = kPanelCols / 16;
    // A pattern, x4 as rows 0-7|8-15 x cols 0-7|8-15 of a 16x16 tile: Q as the A operand, and V
    // (with .trans) as the B operand of two n8 tiles: row lane % 16, chunk lane / 16.
    unsigned a[kSteps];
    // B pattern, x4 as keys 0-7 x k 0-7|8-15, keys 8-15 x k 0-7|8-15: K as the B operand of two n8
    // tiles: row (lane / 16) * 8 + lane % 8, chunk (lane / 8) % 2.
    unsigned b[kSteps];

    __device__ __forceinline__ explicit LdmatrixLanes(int lane) {
        using Panel = SwizzledTile<16, kPanelCols, kPanelCols>;
        const int a_row = lane % 16;
        const int b_row = lane / 16 * 8 + lane % 8;
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
            a[step] = Panel::chunk_offset(a_row, 2 * step + lane / 16);
            b[step] = Panel::chunk_offset(b_row, 2 * step + lane / 8 % 2);
        }
    }
};

// The register-blocked mma.sync loop of the forward's GEMMs: for each of kKSteps k16 steps, kMTiles A
// fragments (a_frag(k, mt, a)) and kNTiles / 2 B fragment pairs (b_frag(k, np, b)), each B pair feeding
// kMTiles x 2 mma's.
template <typename Elem, int kKSteps, int kMTiles, int kNTiles, typename AFrag, typename BFrag>
__device__ __forceinline__ void mma_blocked(float (&acc)[kMTiles][kNTiles][4], AFrag&& a_frag, BFrag&& b_frag) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        unsigned a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) a_frag(kk, mt, a[mt]);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            unsigned b[4];
            b_frag(kk, np, b);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) mma_pair<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], a[mt], b);
        }
    }
}

// acc_s = Q . K^T for this warp's kMTiles x 16 query rows (q_warp: its first row in the Q tile) and
// the kNTiles x 8 keys of a K tile; both tiles of kPanelCols-column panels.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kMTiles, int kNTiles, int kPanelCols>
__device__ __forceinline__ void gemm_qk(float (&acc_s)[kMTiles][kNTiles][4], unsigned q_warp, unsigned k_tile,
                                        const LdmatrixLanes<kPanelCols>& lanes) {
    using QTile = SwizzledTile<kBlockM, kHeadDim, kPanelCols>;
    using KTile = SwizzledTile<kBlockN, kHeadDim, kPanelCols>;
    constexpr int kSteps = LdmatrixLanes<kPanelCols>::kSteps;
    clear(acc_s);
    mma_blocked<Elem, kHeadDim / 16, kMTiles, kNTiles>(
        acc_s,
        [&](int kk, int mt, unsigned (&a)[4]) {
            sm80::ldmatrix_x4(a, q_warp + lanes.a[kk % kSteps] + kk / kSteps * QTile::kPanelBytes +
                                     mt * 16 * QTile::kPanelRowBytes);
        },
        [&](int kk, int np, unsigned (&b)[4]) {
            sm80::ldmatrix_x4(b, k_tile + lanes.b[kk % kSteps] + kk / kSteps * KTile::kPanelBytes +
                                     np * 16 * KTile::kPanelRowBytes);
        });
}

// acc_o += P . V with P = acc_s (fp32 probabilities) packed to Elem in registers: the C fragment of
// n8 tiles 2kk and 2kk+1 is exactly the A fragment of k16 step kk. V fragments are read with .trans.
template <typename Elem, int kHeadDim, int kBlockN, int kMTiles, int kNTiles, int kDTiles, int kPanelCols>
__device__ __forceinline__ void gemm_pv(float (&acc_o)[kMTiles][kDTiles][4],
                                        const float (&acc_s)[kMTiles][kNTiles][4], unsigned v_tile,
                                        const LdmatrixLanes<kPanelCols>& lanes) {
    using VTile = SwizzledTile<kBlockN, kHeadDim, kPanelCols>;
    constexpr int kSteps = LdmatrixLanes<kPanelCols>::kSteps;
    mma_blocked<Elem, kNTiles / 2, kMTiles, kDTiles>(
        acc_o, [&](int kk, int mt, unsigned (&a)[4]) { c_to_a<Elem>(a, acc_s[mt], kk); },
        [&](int kk, int dp, unsigned (&b)[4]) {
            sm80::ldmatrix_x4_trans(b, v_tile + lanes.a[dp % kSteps] + dp / kSteps * VTile::kPanelBytes +
                                           kk * 16 * VTile::kPanelRowBytes);
        });
}

}  // namespace cuflash
