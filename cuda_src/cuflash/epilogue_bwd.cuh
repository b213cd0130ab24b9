// Backward epilogues, for every backward mainloop:
//   DkdvEpilogue   dK (scaled) and dV of a key block from the C-fragment layout of DkdvRole, under one of
//                  two store policies: DirectStore (bshd Elem gradients: MHA; 16-byte stores after a quad
//                  shuffle, store_c_rows_wide, or through the freed K / V tiles after the warp-specialized
//                  mainloop, store_c_rows_staged) or PartialStore (fp32 per-query-head partials, (B, H, Sk,
//                  kHeadDim) contiguous, summed per GQA group by reduce_dkdv_rows in a fixed order);
//   DqEpilogue     dQ (scaled) of the deterministic dQ kernel, from registers (store_c_rows_wide);
//   convert_dq_rows  dq = scale * dq_accum (the atomic dQ path's last step).
// Rows past Sq / Sk and columns past D / Dv are never stored.
#pragma once

#include "cuflash/bwd_config.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {

// 16 bytes of a row (8 16-bit elements) to dst: one store where dst is 16-byte aligned, else four (a
// caller's output view may start anywhere 4-byte aligned).
template <typename Elem>
__device__ __forceinline__ void store_chunk(Elem* dst, uint4 w) {
    if ((reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = w;
    } else {
        unsigned* d = reinterpret_cast<unsigned*>(dst);
        d[0] = w.x;
        d[1] = w.y;
        d[2] = w.z;
        d[3] = w.w;
    }
}

// Rows of a C-fragment tile (the thread's rows row_lo and row_lo + 8, columns 2t, 2t + 1 of each 8-column
// n-tile at col_of(nt)) times scale into Elem rows base[row * stride + col], with 16-byte stores; rows >=
// rows_end and n-tiles at or past `cols` are not stored. Per pair of n-tiles (adjacent: col_of(2p + 1) =
// col_of(2p) + 8 in every backward mainloop) a quad's lanes hold rows lo / hi x their 2 columns of each; three
// shuffle rounds (lane t gets from lane t ^ m the pair it needs) leave lane t all 8 columns of row (t >= 2 ?
// hi : lo) in n-tile 2p + (t & 1). A warp's store then covers 16 rows x 32 bytes, whole sectors, where 4-byte
// stores of the fragment covered 8 rows x 16 bytes per instruction, four times as many (ncu, session 14:
// those held ~13% of the stall samples of the document-mask dK/dV kernel, whose CTAs run few steps). The
// head dim is a multiple of 8 (validation), so an n-tile is wholly in or out. The whole warp calls it.
template <typename Elem, int kNT, typename ColOf>
__device__ __forceinline__ void store_c_rows_wide(Elem* base, long long stride, int cols, int rows_end, int row_lo,
                                                  int t, const float (&acc)[kNT][4], float scale, ColOf col_of) {
    static_assert(kNT % 2 == 0 && sizeof(Elem) == 2, "16-bit n-tiles in adjacent pairs");
    const int row = row_lo + (t >> 1) * 8;
#pragma unroll
    for (int p = 0; p < kNT / 2; ++p) {
        unsigned v[4];  // v[2 * half + j]: row lo / hi (half), n-tile 2p + j, this lane's 2 columns
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = ElemTraits<Elem>::pack2(acc[2 * p + (k & 1)][2 * (k >> 1)] * scale,
                                           acc[2 * p + (k & 1)][2 * (k >> 1) + 1] * scale);
        }
        const auto pick = [&](int k) { return (k & 2) ? ((k & 1) ? v[3] : v[2]) : ((k & 1) ? v[1] : v[0]); };
        unsigned got[4];  // got[m]: lane t ^ m's 2 columns of this lane's (row, n-tile)
        got[0] = pick(t);
#pragma unroll
        for (int m = 1; m < 4; ++m) got[m] = __shfl_xor_sync(0xffffffffu, pick(t ^ m), m);
        unsigned w[4];  // w[s]: columns 2s, 2s + 1 of the n-tile
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int m = s ^ t;
            w[s] = (m & 2) ? ((m & 1) ? got[3] : got[2]) : ((m & 1) ? got[1] : got[0]);
        }
        const int col = col_of(2 * p + (t & 1));
        if (row < rows_end && col < cols) {
            store_chunk(base + row * stride + col, make_uint4(w[0], w[1], w[2], w[3]));
        }
    }
}

// The same rows through shared memory, for a kernel with a free Tile at its end (the warp-specialized dK/dV
// kernel's K / V tiles): stmatrix puts the warp's 16 rows (from warp_row0 within the tile) x its n-tiles
// into their own 16-byte slots of the swizzled Tile, whose slots no other warp touches, then the warp reads
// them back in row order and stores 16 contiguous bytes a lane, whole rows per instruction. No shuffles or
// lane selects: ncu of the 8-document dK/dV kernel (H200, session 24) put 13% of its stall samples in
// store_c_rows_wide, 256 SELs and 48 SHFLs a warp waiting on each other, in CTAs of a few steps each.
template <typename Tile, typename Elem, int kNT, typename ColOf>
__device__ __forceinline__ void store_c_rows_staged(unsigned tile, Elem* base, long long stride, int cols,
                                                    int rows_end, int block_row0, int warp_row0, int lane,
                                                    const float (&acc)[kNT][4], float scale, ColOf col_of) {
    static_assert(kNT % 2 == 0 && sizeof(Elem) == 2 && (16 * kNT) % 32 == 0, "16-bit n-tiles in adjacent pairs");
    const int matrix = lane >> 3;  // stmatrix: lane l addresses row l % 8 of matrix l / 8
    const int store_row = warp_row0 + (lane & 7) + 8 * (matrix & 1);
#pragma unroll
    for (int p = 0; p < kNT / 2; ++p) {
        // Matrix i: rows 0-7 (i even) or 8-15 of n-tile 2p + i / 2, the C fragment's elements (0, 1) / (2, 3).
        unsigned v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = ElemTraits<Elem>::pack2(acc[2 * p + i / 2][2 * (i & 1)] * scale,
                                           acc[2 * p + i / 2][2 * (i & 1) + 1] * scale);
        }
        sm90::stmatrix_x4(tile + Tile::chunk_offset(store_row, col_of(2 * p + (matrix >> 1)) >> 3), v);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 16 * kNT / 32; ++it) {
        const int idx = it * 32 + lane;
        const int r = idx / kNT;
        const int col = col_of(idx % kNT);
        const uint4 w = ld_shared_b128(tile + Tile::chunk_offset(warp_row0 + r, col >> 3));
        const int row = block_row0 + warp_row0 + r;
        if (row < rows_end && col < cols) store_chunk(base + row * stride + col, w);
    }
}

// Where dK / dV rows go straight into the Elem outputs (stored by store_c_rows_wide).
template <typename Elem>
struct DirectStore {
    Elem* dk;
    Elem* dv;
    long long dk_stride, dv_stride;
    __device__ __forceinline__ DirectStore(const AttnParams& p, const SeqInfo& seq)
        : dk(seq.dk<Elem>(p)), dv(seq.dv<Elem>(p)), dk_stride(p.dk_row_stride), dv_stride(p.dv_row_stride) {}
};

// dK / dV rows into fp32 partial `slot` of the sequence (row width kWidth).
template <int kWidth>
struct PartialStore {
    float* dk;
    float* dv;
    __device__ __forceinline__ PartialStore(const AttnParams& p, const SeqInfo& seq, int slot)
        : dk(seq.dk_accum_slot(p, kWidth, slot)), dv(seq.dv_accum_slot(p, kWidth, slot)) {}
    __device__ __forceinline__ void store_dk(int row, int col, float x, float y) const {
        *reinterpret_cast<float2*>(dk + static_cast<long long>(row) * kWidth + col) = make_float2(x, y);
    }
    __device__ __forceinline__ void store_dv(int row, int col, float x, float y) const {
        *reinterpret_cast<float2*>(dv + static_cast<long long>(row) * kWidth + col) = make_float2(x, y);
    }
};

template <typename Cfg, typename Mainloop>
struct DkdvEpilogue {
    static constexpr int kDTiles = Cfg::kDTiles;

    // The sums over query heads [group * heads, + heads) (one kv head's, or part of them). Also runs when
    // no query sees this key block: the gradients are then 0.
    // smem: the kernel's shared memory; with a warp-specialized mainloop and dK / dV themselves every consumer
    // has passed Mainloop::release_kv, so the K / V tiles stage them (store_c_rows_staged).
    static __device__ __forceinline__ void store(const AttnParams& params, int b, int group, int heads,
                                                 int n_block, const float (&acc_dk)[kDTiles][4],
                                                 const float (&acc_dv)[kDTiles][4], unsigned smem) {
        const typename Mainloop::Role r(opaque(Mainloop::thread_index()));
        const SeqInfo seq(params, b, opaque(group) * heads, LayoutOf<Cfg::kMask>());
        const int row_lo = n_block * Cfg::kBlockN + r.key_row0 + r.g;
        if (params.dk_accum == nullptr) {  // the whole kv group: dK / dV themselves
            const DirectStore<typename Cfg::Elem> out(params, seq);
            const auto col_of = [&](int nt) { return Mainloop::col0(nt, r.d_split); };
            if constexpr (Mainloop::kWarpSpecialized) {
                using Tile = typename Cfg::TileK;
                const int block_row0 = n_block * Cfg::kBlockN;
                store_c_rows_staged<Tile>(smem + Cfg::kOffK, out.dk, out.dk_stride, params.head_dim, seq.seqlen_k,
                                          block_row0, r.key_row0, r.lane, acc_dk, params.scale, col_of);
                store_c_rows_staged<Tile>(smem + Cfg::kOffV, out.dv, out.dv_stride, params.head_dim_v, seq.seqlen_k,
                                          block_row0, r.key_row0, r.lane, acc_dv, 1.f, col_of);
            } else {
                store_c_rows_wide(out.dk, out.dk_stride, params.head_dim, seq.seqlen_k, row_lo, r.t, acc_dk,
                                  params.scale, col_of);
                store_c_rows_wide(out.dv, out.dv_stride, params.head_dim_v, seq.seqlen_k, row_lo, r.t, acc_dv, 1.f,
                                  col_of);
            }
        } else {
            const PartialStore<Cfg::kHeadDim> out(params, seq, group);
            store_rows(out, params, seq, r, row_lo, acc_dk, acc_dv);
        }
    }

    template <typename Out>
    static __device__ __forceinline__ void store_rows(const Out& out, const AttnParams& params, const SeqInfo& seq,
                                                      const typename Mainloop::Role& r, int row_lo,
                                                      const float (&acc_dk)[kDTiles][4],
                                                      const float (&acc_dv)[kDTiles][4]) {
        const int row_hi = row_lo + 8;
        const float scale = params.scale;
#pragma unroll
        for (int nt = 0; nt < kDTiles; ++nt) {
            const int c0 = Mainloop::col0(nt, r.d_split);
            const int col = c0 + 2 * r.t;
            if (c0 < params.head_dim) {
                if (row_lo < seq.seqlen_k) out.store_dk(row_lo, col, acc_dk[nt][0] * scale, acc_dk[nt][1] * scale);
                if (row_hi < seq.seqlen_k) out.store_dk(row_hi, col, acc_dk[nt][2] * scale, acc_dk[nt][3] * scale);
            }
            if (c0 < params.head_dim_v) {
                if (row_lo < seq.seqlen_k) out.store_dv(row_lo, col, acc_dv[nt][0], acc_dv[nt][1]);
                if (row_hi < seq.seqlen_k) out.store_dv(row_hi, col, acc_dv[nt][2], acc_dv[nt][3]);
            }
        }
    }
};

// dq = scale * dQ for the warp's 16 queries (from row0 within the query block at query0), its n-tiles at
// the head-dim columns col0(nt).
template <typename Cfg>
struct DqEpilogue {
    using Elem = typename Cfg::Elem;
    template <int kDTiles, typename ColOf>
    static __device__ __forceinline__ void store(const AttnParams& params, const SeqInfo& seq,
                                                 const float (&acc_dq)[kDTiles][4], int query0, int row0, int g, int t,
                                                 ColOf col_of) {
        store_c_rows_wide(seq.dq<Elem>(params), params.dq_row_stride, params.head_dim, seq.seqlen_q,
                          query0 + row0 + g, t, acc_dq, params.scale, col_of);
    }
};

// Atomic dQ path: dq[b, i, h, :D] = scale * dq_accum[b, h, i, :D] for rows [row0, row0 + kRows). Row-major
// dq_accum: one thread per 8 columns (two float4 loads, one 16-byte store). kSwizzledDq (rows in
// dq_accum_chunk's order, the warp-specialized dK/dV kernel's staged adds): one thread per 16 columns, the four
// chunks that hold them (64 contiguous bytes), two 16-byte stores. (H100, session 20, ncu: 70.8 us against the
// row-major form's 64.8 at B4 H16 S4k D128.)
// `untouched`: no add reached these rows of a dq_accum the pre-pass left unzeroed (dq_order.cuh): dq = 0. The
// "+ 0.f" makes a -0 sum +0, as the adds onto zeros did: a first store keeps a tile's -0 (a row that sees no key
// has dS = +-0), so both ways give the same bits.
template <typename Elem, int kHeadDim, int kRows, int kThreads, bool kSwizzledDq>
__device__ __forceinline__ void convert_dq_rows(const AttnParams& params, const SeqInfo& seq, int row0,
                                                bool untouched) {
    const float* acc = seq.dq_accum(params, 0, kHeadDim);
    Elem* dq = seq.dq<Elem>(params);
    const float scale = params.scale;
    const auto scaled = [scale](float x) { return x * scale + 0.f; };
    if (untouched) {
        constexpr int kChunks = kHeadDim / 8;
        for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
            const int row = row0 + i / kChunks;
            const int c = i % kChunks;
            if (row < seq.seqlen_q && c * 8 < params.head_dim) {
                *reinterpret_cast<uint4*>(dq + row * params.dq_row_stride + c * 8) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        return;
    }
    if constexpr (!kSwizzledDq) {
        constexpr int kChunks = kHeadDim / 8;
        for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
            const int row = row0 + i / kChunks;
            const int c = i % kChunks;
            if (row >= seq.seqlen_q || c * 8 >= params.head_dim) continue;
            const float4* src = reinterpret_cast<const float4*>(acc + static_cast<long long>(row) * kHeadDim + c * 8);
            const float4 x = src[0], y = src[1];
            uint4 out;
            out.x = ElemTraits<Elem>::pack2(scaled(x.x), scaled(x.y));
            out.y = ElemTraits<Elem>::pack2(scaled(x.z), scaled(x.w));
            out.z = ElemTraits<Elem>::pack2(scaled(y.x), scaled(y.y));
            out.w = ElemTraits<Elem>::pack2(scaled(y.z), scaled(y.w));
            *reinterpret_cast<uint4*>(dq + row * params.dq_row_stride + c * 8) = out;
        }
    } else {
        constexpr int kGroups = kHeadDim / 16;
        for (int i = threadIdx.x; i < kRows * kGroups; i += kThreads) {
            const int row = row0 + i / kGroups;
            const int c = i % kGroups;
            if (row >= seq.seqlen_q || c * 16 >= params.head_dim) continue;
            const float4* src = reinterpret_cast<const float4*>(acc + static_cast<long long>(row) * kHeadDim);
            float v[16];  // columns 16c .. 16c + 15
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const float4 x = src[dq_accum_chunk(row, 16 * c + 2 * t)];
                v[2 * t] = x.x, v[2 * t + 1] = x.y, v[8 + 2 * t] = x.z, v[8 + 2 * t + 1] = x.w;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // the head dim is a multiple of 8: each half wholly in or out
                if (c * 16 + h * 8 >= params.head_dim) break;
                uint4 out;
                out.x = ElemTraits<Elem>::pack2(scaled(v[8 * h]), scaled(v[8 * h + 1]));
                out.y = ElemTraits<Elem>::pack2(scaled(v[8 * h + 2]), scaled(v[8 * h + 3]));
                out.z = ElemTraits<Elem>::pack2(scaled(v[8 * h + 4]), scaled(v[8 * h + 5]));
                out.w = ElemTraits<Elem>::pack2(scaled(v[8 * h + 6]), scaled(v[8 * h + 7]));
                *reinterpret_cast<uint4*>(dq + row * params.dq_row_stride + c * 16 + h * 8) = out;
            }
        }
    }
}

// GQA: dk[b, j, hk, :D] = the sum, in ascending order, of the partials of kv head hk's query heads
// (h_per_kv / dkdv_heads of them, already scaled; see DkdvEpilogue); likewise dv with Dv, for key rows
// [row0, row0 + kRows). `first` is the SeqInfo of the group's first query head. The fixed order makes
// dK / dV deterministic even when dQ uses atomics.
template <typename Elem, int kHeadDim, int kRows, int kThreads>
__device__ __forceinline__ void reduce_dkdv_rows(const AttnParams& params, const SeqInfo& first, int row0) {
    constexpr int kChunks = kHeadDim / 8;
    const long long head_size = params.k_scratch_head_stride * kHeadDim;  // floats between partials
    const int parts = params.h_per_kv / params.dkdv_heads;
    const int slot0 = first.h_kv * parts;
    for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
        const int row = row0 + i / kChunks;
        const int c = i % kChunks;
        if (row >= first.seqlen_k) continue;
        const long long offset = static_cast<long long>(row) * kHeadDim + c * 8;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            const int cols = which == 0 ? params.head_dim : params.head_dim_v;
            if (c * 8 >= cols) continue;
            const float* part = (which == 0 ? first.dk_accum_slot(params, kHeadDim, slot0)
                                            : first.dv_accum_slot(params, kHeadDim, slot0)) + offset;
            float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
            for (int j = 0; j < parts; ++j) {  // 4 partials' loads in flight per thread
                const float4 x = reinterpret_cast<const float4*>(part + j * head_size)[0];
                const float4 y = reinterpret_cast<const float4*>(part + j * head_size)[1];
                sum[0] += x.x; sum[1] += x.y; sum[2] += x.z; sum[3] += x.w;
                sum[4] += y.x; sum[5] += y.y; sum[6] += y.z; sum[7] += y.w;
            }
            uint4 out;
            out.x = ElemTraits<Elem>::pack2(sum[0], sum[1]);
            out.y = ElemTraits<Elem>::pack2(sum[2], sum[3]);
            out.z = ElemTraits<Elem>::pack2(sum[4], sum[5]);
            out.w = ElemTraits<Elem>::pack2(sum[6], sum[7]);
            Elem* dst = which == 0 ? first.dk<Elem>(params, row) : first.dv<Elem>(params, row);
            *reinterpret_cast<uint4*>(dst + c * 8) = out;
        }
    }
}

}  // namespace cuflash
