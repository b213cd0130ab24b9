// KV-cache attention forward (attention_with_kvcache): decoding and chunked prefill over a dense or paged
// cache, fp16 / bf16, sm_80 and later.
//
// The forward's mma.sync mainloop (cuflash/fwd_mainloop_sm80.cuh) as it is, with the KV cache's query rows,
// key tiles, mask and ALiBi (cuflash/kvcache.cuh). Grid (m_blocks * num_splits, Hkv, B): block x is query
// block x / num_splits (kBlockM rows of the GQA-packed queries of one kv head) and split x % num_splits,
// which takes an equal share of the query block's visible key blocks. The keys are appended by
// flash_kvcache_append.cu first (same stream), so this kernel only reads the cache.
// Decoding is bound by reading the cache: one CTA per (batch, kv head, split) reads each key once for the
// whole group, and split-KV spreads a long cache over the SMs when B x Hkv CTAs cannot fill them.

#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/kvcache.cuh"

namespace cuflash {

// kPanelCols: the K / V / Q tiles' panels (cuflash/tile.cuh), 64 columns (wide: rows of whole 128-byte lines)
// or 32 (narrow, the forward's). Wide, each warp's copies fill whole shared lines and L2 serves them in half the
// requests of narrow panels' 64-byte pieces: the decoding tiles (D128 decode on an H100: L2 requests 33.6M ->
// 16.8M, cuDNN's count; DRAM 87% -> 91% of peak, session 15). The plan picks it (cuflash/kernels/kvcache.py).
// kWarpsN: 1, each warp owns kBlockM / kNWarps rows; or the few-row decoding tile (16 rows, a GQA group's
// token): the warps split every key block, each with its own online softmax, merged after the mainloop
// (KeySplitMerge), so the four warps share the math that one warp would do alone.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, int kScoreMod,
          int kPanelCols, int kWarpsN>
__global__ void __launch_bounds__(kNWarps * 32) flash_kvcache_kernel(const AttnParams params) {
    using Cfg = KvConfig<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kScoreMod, kWarpsN>;
    using Mainloop = FwdMainloopSm80<Cfg, KvLoads<Cfg, SwizzledTile<kBlockN, kHeadDim, kPanelCols>, kStages>>;
    using Merge = KeySplitMerge<Cfg::kWarpsM, kWarpsN, Cfg::kMTiles, Cfg::kDTiles>;
    CUFLASH_CHECK_SMEM_BYTES(Mainloop::kSmemBytes);
    static_assert(Merge::kScratchBytes <= Mainloop::kSmemBytes, "the merge reuses the tiles' shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned smem_q = sm80::smem_addr(smem);
    Mainloop::check_smem(smem_q);

    const int split = blockIdx.x % params.num_splits;
    const int m_block = blockIdx.x / params.num_splits;
    const SeqInfo seq = SeqInfo::kv_cache(params, blockIdx.z, blockIdx.y);
    const int row_begin = m_block * kBlockM;
    const int warp_row0 = Cfg::warp_row0();

    const KvMask mask(params, seq);
    typename Cfg::Blocks blocks(mask, m_block);
    take_split(blocks, params.num_splits, split);

    float acc_o[Cfg::kMTiles][Cfg::kDTiles][4];
    clear(acc_o);
    OnlineSoftmax<Cfg::kMTiles> softmax;
    if (!blocks.empty()) {
        Mainloop mainloop(params, seq, blocks, mask, smem_q, row_begin, warp_row0);
        mainloop.run(params, seq, acc_o, softmax);
    }
    if constexpr (kWarpsN > 1) {
        __syncthreads();  // every warp is done with Q, K and V (the mainloop drained its copies)
        if (!Merge::run(softmax, acc_o, smem_q, softmax_scale_log2<typename Cfg::ScoreMod>(params))) return;
    }
    float lse[Cfg::kMTiles][2];  // -inf, with acc_o 0, for rows that saw no key (or a split with no blocks)
    softmax.finalize(acc_o, Cfg::ScoreMod::kScaled ? 1.f : fabsf(params.scale), lse);
    KvEpilogue<Elem>::store(params, seq, acc_o, lse, row_begin + warp_row0, split);
}

}  // namespace cuflash
