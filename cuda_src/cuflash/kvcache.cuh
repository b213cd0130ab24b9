// KV-cache attention (cuda_src/flash_kvcache.cu): the parts where it differs from the forward's mainloop,
// which it runs as it is (FwdMainloopSm80 with these as its mask, score modifier and load side). The float32
// kernel (cuda_src/flash_kvcache_simt.cu) takes the mask, the modifier's one-score form, the row functors,
// take_split and KvRow from here too.
//
// Query rows pack a GQA group. One CTA serves a (batch, kv head) and kBlockM rows of its group's queries:
// row r is token r / G of query head h0 + r % G (G = h_per_kv query heads per kv head, h0 = the group's first),
// so the group's heads share each K / V tile the CTA loads: a decoding step (one token, G heads) reads the
// cache once per kv head, not once per query head. Masks and ALiBi see the token (KvMask, KvScoreMod);
// the softmax, the GEMMs and the pipeline do not care which row is which.
//
// The cache is dense (B, L, Hkv, D) or paged (num_pages, page_size, Hkv, D) with a block table (B,
// max_pages): key j of batch b is row j % page_size of page block_table[b, j / page_size]. A key tile whose
// keys lie in one page (every tile when page_size is a multiple of kBlockN) is copied like a dense one from
// that page; any other (small or unaligned pages, down to page_size 1) row by row through the table.
//
// Split-KV: with num_splits > 1 each CTA takes one share of its rows' key blocks and writes its normalized
// partial output and lse in fp32 (o_accum / lse_accum); flash_kvcache_combine.cu merges them.
// Clamps instead of checks on the device: page ids into [0, num_pages), lengths into [0, kv_capacity]
// (SeqInfo::kv_cache), so a bad table or length never addresses memory outside the cache.
#pragma once

#include "cuflash/fwd_mainloop_sm80.cuh"

namespace cuflash {

// Visibility for packed query rows: key j of the batch's seqlen_k is visible to row r (token t = r / G)
// iff -window_left <= j - t - causal_offset <= window_right (causal folded into window_right <= 0 on the
// host). Rows past Sq * G are never stored; their zero-filled Q rows see what token t would.
struct KvMask : MaskTiles<KvMask> {
    int group, rows, seqlen_k, causal_offset, window_left, window_right;

    __device__ __forceinline__ KvMask(const AttnParams& p, const SeqInfo& seq)
        : group(p.h_per_kv), rows(seq.seqlen_q * p.h_per_kv), seqlen_k(seq.seqlen_k),
          causal_offset(seq.causal_offset()), window_left(p.window_left), window_right(p.window_right) {}

    __device__ __forceinline__ bool visible(int row, int col) const {
        const int d = col - row / group - causal_offset;
        return col < seqlen_k && d >= -window_left && d <= window_right;
    }

    // Key blocks [n_begin, n_end) holding a key some row of query block m_block sees (KeyBlocks' contract).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void key_block_range(int m_block, int& n_begin, int& n_end) const {
        const int first_token = m_block * kBlockM / group;
        const int last_token = (min((m_block + 1) * kBlockM, rows) - 1) / group;
        const int lo = max(0, first_token + causal_offset - window_left);
        const int hi = min(seqlen_k - 1, last_token + causal_offset + window_right);
        n_begin = lo / kBlockN;
        n_end = hi < lo ? n_begin : hi / kBlockN + 1;
    }

    // Whether the tile [row0, row0 + rows_) x [col0, col0 + cols) may hold an invisible pair.
    __device__ __forceinline__ bool needs_mask(int row0, int rows_, int col0, int cols) const {
        const int first_token = row0 / group, last_token = (row0 + rows_ - 1) / group;
        return col0 + cols > seqlen_k || col0 + cols - 1 - first_token - causal_offset > window_right ||
               col0 - last_token - causal_offset < -window_left;
    }
};

// softcap and ALiBi for packed rows: GeneralScoreMod's scale and softcap, then each row's own head slope and
// token distance (the base holds no slope: it is the group's, not one head's).
template <typename Elem>
struct KvScoreMod : GeneralScoreMod<Elem, false, true> {
    using Base = GeneralScoreMod<Elem, false, true>;
    const float* slopes;  // the slopes of this batch's group, from its first head; null without ALiBi
    int group;

    __device__ __forceinline__ KvScoreMod(const AttnParams& p, int b, int h0, int causal_offset)
        : Base(p, b, h0, causal_offset),
          slopes(p.alibi_slopes == nullptr ? nullptr : p.alibi_slopes + b * p.alibi_batch_stride + h0),
          group(p.h_per_kv) {
        this->slope = 0.f;
    }

    // The modified score of packed row `row`, key `col` (kPrecise: tanhf for the fp32 kernel, else fast_tanh).
    template <bool kPrecise = false>
    __device__ __forceinline__ float packed(float raw, int row, int col) const {
        float unused;
        float x = this->template one<kPrecise>(raw, row, col, unused, 0.f);
        if (slopes != nullptr) {
            const float distance = fabsf(static_cast<float>(row / group + this->causal_offset - col));
            x = fmaf(-__ldg(slopes + row % group), distance, x);
        }
        return x;
    }

    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], int row0, int col0,
                                          const BiasTileRef& = BiasTileRef{}) const {
        for_each_score(acc, row0, col0, [&](float& x, int row, int col, int, int, int) { x = packed(x, row, col); });
    }
    // One score (the SIMT kernel's form).
    __device__ __forceinline__ float apply_one(float raw, int row, int col) const { return packed<true>(raw, row, col); }
};

template <int kScoreMod, typename Elem>
using KvScoreModOf = conditional_t<kScoreMod == kNoScoreMod, IdentityScoreMod, KvScoreMod<Elem>>;

// The kernel's compile-time shape: the forward's, with the packed-row mask and modifier. kWarpsN > 1: the
// few-row decoding tile, whose warps split each key block (FwdConfig).
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, int kScoreMod,
          int kWarpsN>
struct KvConfig : FwdConfig<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kNoMask, kScoreMod, kWarpsN> {
    static_assert(kScoreMod == kNoScoreMod || kScoreMod == kSoftcapAlibi, "the KV cache takes no bias");
    using Mask = KvMask;
    using Blocks = KeyBlocks<kBlockM, kBlockN>;
    static constexpr bool kSkipIdleWarps = true;  // decoding: G x Sq rows often fill one warp of the four
    using ScoreMod = KvScoreModOf<kScoreMod, Elem>;
};

// Query rows of a group: row r at q[b, r / G, h0 + r % G].
template <typename Elem_>
struct GqaRows {
    using Elem = Elem_;
    static constexpr bool kGather = true;
    const Elem* base;  // q[b, 0, h0]
    long long row_stride, head_stride;
    int group;
    __device__ __forceinline__ const Elem* at(int r) const {
        return base + (r / group) * row_stride + (r % group) * head_stride;
    }
};

// Keys of a paged cache: key j at page block_table[b, j / page_size] (clamped), row j % page_size.
template <typename Elem_>
struct PagedRows {
    using Elem = Elem_;
    static constexpr bool kGather = true;
    const Elem* base;  // the cache at page 0, row 0, this kv head
    const int* pages;  // this batch's block-table row
    long long page_stride, row_stride;
    int page_size, num_pages;
    __device__ __forceinline__ int page(int i) const { return min(max(__ldg(pages + i), 0), num_pages - 1); }
    __device__ __forceinline__ const Elem* at(int j) const {
        return base + page(j / page_size) * page_stride + (j % page_size) * row_stride;
    }
};

// The load side of FwdLoads' interface for the KV cache: Q's rows gathered from the group's heads, K / V
// tiles from the dense or paged cache (no bias tiles).
template <typename Cfg, typename Tile_, int kSlots>
struct KvLoads {
    using Elem = typename Cfg::Elem;
    using QTile = SwizzledTile<Cfg::kBlockM, Cfg::kHeadDim, Tile_::kPanelCols>;
    using KVTile = Tile_;
    static constexpr bool kPanelBias = false;  // no bias on the KV cache
    static constexpr int kSmemBytes = QTile::kBytes + 2 * kSlots * KVTile::kBytes;
    const AttnParams& params;
    const typename Cfg::Blocks blocks;
    const Elem* k_src;  // dense: this batch's and kv head's key 0; paged: page 0's, this kv head
    const Elem* v_src;
    const int* pages;   // this batch's block-table row, or null (dense)
    unsigned smem_k, smem_v;
    int seqlen_k;

    __device__ __forceinline__ KvLoads(const AttnParams& p, const SeqInfo& seq, const typename Cfg::Blocks& blocks_,
                                       unsigned smem_q, int)
        : params(p), blocks(blocks_),
          k_src(p.block_table == nullptr ? seq.k<Elem>(p) : static_cast<const Elem*>(p.k) + seq.h_kv * p.k_head_stride),
          v_src(p.block_table == nullptr ? seq.v<Elem>(p) : static_cast<const Elem*>(p.v) + seq.h_kv * p.v_head_stride),
          pages(p.block_table == nullptr ? nullptr : p.block_table + seq.b * p.block_table_batch_stride),
          smem_k(smem_q + QTile::kBytes), smem_v(smem_q + QTile::kBytes + kSlots * KVTile::kBytes),
          seqlen_k(seq.seqlen_k) {}

    __device__ __forceinline__ BiasTileRef bias_tile(int, int) const { return BiasTileRef::none(); }

    __device__ __forceinline__ void load_q(unsigned smem_q, const SeqInfo& seq, int row_begin) const {
        const GqaRows<Elem> rows{seq.q<Elem>(params), params.q_row_stride, params.q_head_stride, params.h_per_kv};
        copy_tile_rows<QTile, Cfg::kThreads, true>(smem_q, rows, row_begin, seq.seqlen_q * params.h_per_kv,
                                                   params.head_dim, params.q);
    }
    __device__ __forceinline__ void load_k(int j) const {
        load_step(j, smem_k, k_src, params.k_batch_stride, params.k_row_stride, params.head_dim, params.k);
    }
    __device__ __forceinline__ void load_v(int j) const {
        load_step(j, smem_v, v_src, params.v_batch_stride, params.v_row_stride, params.head_dim_v, params.v);
    }

    // Step j's key block of K or V into slot j % kSlots (page_stride: the cache's batch stride, which is the
    // page stride when paged).
    __device__ __forceinline__ void load_step(int j, unsigned smem, const Elem* src, long long page_stride,
                                              long long row_stride, int cols, const void* base) const {
        if (j < blocks.count()) {
            const unsigned dst = smem + (j % kSlots) * KVTile::kBytes;
            const int row0 = blocks.block(j) * Cfg::kBlockN;
            if (pages == nullptr) {
                load_tile<KVTile, Cfg::kThreads, Cfg::kFastLoads>(dst, src, row_stride, row0, seqlen_k, cols, base);
            } else {
                const PagedRows<Elem> rows{src, pages, page_stride, row_stride, params.page_size, params.num_pages};
                const int first_page = row0 / rows.page_size;
                const int last_row = min(row0 + Cfg::kBlockN, seqlen_k) - 1;
                if (last_row / rows.page_size == first_page) {  // one page holds the tile's keys: a strided copy
                    const int page_row0 = first_page * rows.page_size;
                    load_tile<KVTile, Cfg::kThreads, Cfg::kFastLoads>(dst, src + rows.page(first_page) * page_stride,
                                                                      row_stride, row0 - page_row0,
                                                                      seqlen_k - page_row0, cols, base);
                } else {
                    copy_tile_rows<KVTile, Cfg::kThreads, true>(dst, rows, row0, seqlen_k, cols, base);
                }
            }
        }
        sm80::cp_async_commit();
    }
};

// Split-KV: split `split` of num_splits takes an equal share of the key blocks (KeyBlocks) its query block
// sees: blocks [n * split / S, n * (split + 1) / S) of its n, so the shares differ by one block at most (a
// ceil(n / S) share per split left the last one short: 2048 blocks in 33 splits ran 63 blocks per CTA where
// 62.06 is the mean).
template <typename Blocks>
__device__ __forceinline__ void take_split(Blocks& blocks, int num_splits, int split) {
    if (num_splits > 1) {
        const int n = blocks.count(), begin = blocks.n_begin;
        blocks.n_begin = begin + n * split / num_splits;
        blocks.n_end = begin + n * (split + 1) / num_splits;
    }
}

// Where packed row `row` (token row / G of query head seq.h + row % G) goes: out[b, token, h] and lse[b, h,
// token], or with num_splits > 1 row `partial_row` of split `split`'s o_accum (Dv floats) and lse_accum.
struct KvRow {
    int token, h;
    __device__ __forceinline__ KvRow(const AttnParams& p, const SeqInfo& seq, int row)
        : token(row / p.h_per_kv), h(seq.h + row % p.h_per_kv) {}
    __device__ __forceinline__ long long partial_row(const AttnParams& p, const SeqInfo& seq, int split) const {
        return ((static_cast<long long>(split) * p.batch + seq.b) * p.num_heads + h) * p.seqlen_q + token;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* out(const AttnParams& p, const SeqInfo& seq) const {
        return static_cast<Elem*>(p.o) + seq.b * p.o_batch_stride + token * p.o_row_stride + h * p.o_head_stride;
    }
    __device__ __forceinline__ float* lse(const AttnParams& p, const SeqInfo& seq) const {
        return p.lse == nullptr ? nullptr : p.lse + seq.b * p.lse_batch_stride + h * p.lse_head_stride + token;
    }
};

// Stores a CTA's rows: out (q's dtype, bshd) and lse, or with num_splits > 1 split `split`'s fp32 partial
// output and lse. acc_o is normalized, lse[mt][half] per row (-inf for a row that saw no key: its output is 0).
// Straight from the fragments (4- / 8-byte stores): the KV-cache kernel's rows are few.
template <typename Elem>
struct KvEpilogue {
    template <int kMTiles, int kDTiles>
    static __device__ __forceinline__ void store(const AttnParams& p, const SeqInfo& seq,
                                                 const float (&acc_o)[kMTiles][kDTiles][4],
                                                 const float (&lse)[kMTiles][2], int warp_row_begin, int split) {
        using Traits = ElemTraits<Elem>;
        const int lane = threadIdx.x % 32, rows = seq.seqlen_q * p.h_per_kv;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = warp_row_begin + mt * 16 + half * 8 + lane / 4;
                if (row >= rows) continue;
                const KvRow at(p, seq, row);
                const int col0 = lane % 4 * 2;
                if (p.num_splits > 1) {
                    const long long out_row = at.partial_row(p, seq, split);
                    float* o = p.o_accum + out_row * p.head_dim_v;
#pragma unroll
                    for (int dt = 0; dt < kDTiles; ++dt) {
                        if (dt * 8 + col0 < p.head_dim_v) {
                            *reinterpret_cast<float2*>(o + dt * 8 + col0) =
                                make_float2(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]);
                        }
                    }
                    if (lane % 4 == 0) p.lse_accum[out_row] = lse[mt][half];
                } else {
                    Elem* o = at.out<Elem>(p, seq);
#pragma unroll
                    for (int dt = 0; dt < kDTiles; ++dt) {
                        if (dt * 8 + col0 < p.head_dim_v) {
                            *reinterpret_cast<unsigned*>(o + dt * 8 + col0) =
                                Traits::pack2(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]);
                        }
                    }
                    if (p.lse != nullptr && lane % 4 == 0) *at.lse(p, seq) = lse[mt][half];
                }
            }
        }
    }
};

}  // namespace cuflash
