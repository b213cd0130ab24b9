// KV-cache attention forward in true fp32 (float32 q and cache; FFMA only, no TF32): attention_with_kvcache's
// kernel for float32, sm_80 and later.
//
// The SIMT forward's key loop (cuflash/simt_attention.cuh: scores, online softmax, two-level P.V sums) with the
// KV cache's parts (cuflash/kvcache.cuh): GQA-packed query rows (row r is token r / G of query head
// h0 + r % G, so a group's heads share each K / V tile), the packed-row mask and ALiBi, dense or paged key
// tiles, split-KV and its partial rows. Same grid as flash_kvcache.cu: (m_blocks * num_splits, Hkv, B), block x
// is query block x / num_splits and split x % num_splits; the appended keys are already in the cache
// (flash_kvcache_append.cu runs first), and flash_kvcache_combine.cu merges the splits.
// The host-side plan (cuflash/kernels/kvcache.py) mirrors FwdSmem's size (CUFLASH_CHECK_SMEM_BYTES).

#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/kvcache.cuh"
#include "cuflash/simt_attention.cuh"

namespace cuflash {
namespace simt {

// simt::Config's shape (flash_simt.cu) with the KV cache's mask, key blocks and score modifier.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kScoreMod>
struct KvSimtConfig {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kPitch = kHeadDim + kPad;
    using Cols = OutCols<kHeadDim>;
    using Mask = KvMask;
    using Dropout = DropoutOf<false>;
    using Keys = KeyBlocks<kBlockM, kBlockN>;
    using ScoreMod = KvScoreModOf<kScoreMod, float>;
    static_assert(kScoreMod == kNoScoreMod || kScoreMod == kSoftcapAlibi, "the KV cache takes no bias");
    static_assert(kBlockM % kThreadRows == 0 && kBlockN % kLanesPerRow == 0, "tiles are 16 x 16 thread grids");
};

// The loads simt::forward_rows asks for: the group's packed query rows, and key tiles of the dense cache
// (strided rows) or the paged one (a page's strided rows when the tile lies in one page, else row by row
// through the block table).
template <typename Cfg>
struct KvSimtLoads {
    const AttnParams& params;
    const SeqInfo& seq;
    const int* pages;  // this batch's block-table row, or null (dense)

    __device__ __forceinline__ KvSimtLoads(const AttnParams& p, const SeqInfo& s)
        : params(p), seq(s), pages(p.block_table == nullptr ? nullptr : p.block_table + s.b * p.block_table_batch_stride) {}

    __device__ __forceinline__ void q(float* dst, int row0) const {
        const GqaRows<float> rows{seq.q<float>(params), params.q_row_stride, params.q_head_stride, params.h_per_kv};
        load_tile_rows<Cfg::kBlockM, Cfg::kHeadDim, Cfg::kPitch>(dst, rows, row0, seq.seqlen_q * params.h_per_kv - row0,
                                                                 params.head_dim, params.q);
    }
    __device__ __forceinline__ void k(float* dst, int key0) const {
        keys(dst, key0, static_cast<const float*>(params.k), params.k_batch_stride, params.k_head_stride,
             params.k_row_stride, params.head_dim);
    }
    __device__ __forceinline__ void v(float* dst, int key0) const {
        keys(dst, key0, static_cast<const float*>(params.v), params.v_batch_stride, params.v_head_stride,
             params.v_row_stride, params.head_dim_v);
    }

  private:
    // kBlockN keys from key0 (batch_stride: the page stride when paged).
    __device__ __forceinline__ void keys(float* dst, int key0, const float* cache, long long batch_stride,
                                         long long head_stride, long long row_stride, int cols) const {
        const float* head = cache + seq.h_kv * head_stride;
        const int valid = seq.seqlen_k - key0;
        if (pages == nullptr) {
            load_tile<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kPitch>(dst, head + seq.b * batch_stride + key0 * row_stride,
                                                                row_stride, valid, cols);
            return;
        }
        const PagedRows<float> rows{head, pages, batch_stride, row_stride, params.page_size, params.num_pages};
        const int first_page = key0 / rows.page_size;
        const int last_key = min(key0 + Cfg::kBlockN, seq.seqlen_k) - 1;
        if (last_key / rows.page_size == first_page) {  // one page holds the tile's keys: a strided copy
            load_tile<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kPitch>(
                dst, rows.at(key0), row_stride, valid, cols);
        } else {
            load_tile_rows<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kPitch>(dst, rows, key0, valid, cols, cache);
        }
    }
};

// O (normalized; 0 for a row that saw no key) and lse (-inf there) of the thread's packed rows: out / lse, or
// with num_splits > 1 split `split`'s fp32 partial rows (written for every row, empty splits included: the
// combine weighs them by exp(-inf) = 0, and 0 * a stale value could be NaN).
template <typename Cfg, int kRows>
__device__ __forceinline__ void store_kv_rows(const AttnParams& params, const SeqInfo& seq,
                                              const RowSoftmax<kRows>& softmax,
                                              const float (&acc_o)[kRows][Cfg::Cols::kPerThread], int row0,
                                              TilePos<false> at, int split) {
    const int rows = seq.seqlen_q * params.h_per_kv;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const float l = row_sum16(softmax.l[i]);  // the whole half-warp shuffles, before any row test
        const int row = at.query(row0, i, 0);
        if (row >= rows) continue;
        const bool empty = !(l > 0.f);
        const KvRow dst(params, seq, row);
        float* out;
        float* lse;
        if (params.num_splits > 1) {
            const long long partial = dst.partial_row(params, seq, split);
            out = params.o_accum + partial * params.head_dim_v;
            lse = params.lse_accum + partial;
        } else {
            out = dst.out<float>(params, seq);
            lse = dst.lse(params, seq);
        }
        store_row<Cfg::kHeadDim>(out, acc_o[i], params.head_dim_v, at.tx, [&](float x) { return empty ? 0.f : x / l; });
        // m is in the log2 domain: lse = m * ln(2) + log(l).
        if (at.tx == 0 && lse != nullptr) *lse = empty ? -INFINITY : fmaf(softmax.m[i], kLn2, logf(l));
    }
}

}  // namespace simt

template <int kHeadDim, int kBlockM, int kBlockN, int kScoreMod>
__global__ void __launch_bounds__(simt::kThreads, simt::min_blocks_per_sm<kNoMask, kScoreMod>())
flash_kvcache_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Cfg = KvSimtConfig<kHeadDim, kBlockM, kBlockN, kScoreMod>;
    using Smem = FwdSmem<Cfg>;
    constexpr int kRows = kBlockM / kThreadRows;  // packed query rows per thread
    CUFLASH_CHECK_SMEM_BYTES(Smem::kSmemBytes);
    const Smem sm(shared_floats<Smem::kSmemBytes>());

    const int split = blockIdx.x % params.num_splits;
    const int m_block = blockIdx.x / params.num_splits;
    const SeqInfo seq = SeqInfo::kv_cache(params, blockIdx.z, blockIdx.y);
    const int row0 = m_block * kBlockM;
    const KvSimtLoads<Cfg> loads(params, seq);
    const TilePos<false> at = this_thread<false>();
    const KvMask mask(params, seq);
    typename Cfg::Keys blocks(mask, m_block);
    take_split(blocks, params.num_splits, split);
    const typename Cfg::ScoreMod score_mod(params, seq.b, seq.h, seq.causal_offset());

    float acc_o[kRows][Cfg::Cols::kPerThread];
    RowSoftmax<kRows> softmax;
    forward_rows<Cfg>(params, seq, sm, loads, mask, blocks, score_mod, row0, at, acc_o, softmax);
    store_kv_rows<Cfg>(params, seq, softmax, acc_o, row0, at, split);
}

}  // namespace cuflash
