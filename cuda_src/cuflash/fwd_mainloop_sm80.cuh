// Forward mainloop parts shared by both arches (FwdConfig, FwdLoads: the load side), and the sm_80+
// mma.sync mainloop (FwdMainloopSm80).
//
// Interface of a forward mainloop Mainloop<Cfg> (FwdMainloopSm90 has the same one):
//   Mainloop::Tile                 the Q / K / V shared-memory tile layout it wants
//   Mainloop::kSmemBytes           its dynamic shared memory
//   Mainloop::check_smem(smem)     traps on a launch it cannot run with (size, alignment)
//   Mainloop(params, seq, blocks, mask, smem, row_begin, warp_row0)   (the FwdWork constructor: both
//                                  mainloops derive from FwdWork, which holds these and the shared
//                                  score-modifier + mask step)
//   load side:    FwdLoads::load_q / load_k(j) / load_v(j): one cp.async group per call, uniform per
//                 thread (a future TMA producer warp replaces these with mbarrier-completed bulk copies)
//   compute side: run(acc_o, softmax): walks every visible key block (blocks.count() steps, masked phase
//                 first) and leaves acc_o un-normalized in the C-fragment layout, Q's shared memory free
//                 for the epilogue.
#pragma once

#include "cuflash/params.cuh"
#include "cuflash/mma_sm80.cuh"
#include "cuflash/tile.cuh"
#include "cuflash/gemm_sm80.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/block.cuh"
#include "cuflash/score_mod.cuh"
#include "cuflash/softmax.cuh"
#include "cuflash/dropout.cuh"

namespace cuflash {

// The forward's compile-time shape, from the kernel's template arguments.
// kWarpsN_: the warps that share a group of query rows, each taking its own kBlockN / kWarpsN keys of every
// key block with its own online softmax (KeySplitMerge folds them together after the mainloop). 1 (every
// forward): each warp owns kBlockM / kNWarps rows and all of a block's keys. 4: the KV cache's few-row
// decoding tile (16 rows), where one warp alone would do all the math of a CTA (cuflash/kvcache.cuh).
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, int kMask_,
          int kScoreMod_, int kWarpsN_ = 1>
struct FwdConfig {
    using Elem = Elem_;
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_, kStages = kStages_;
    static constexpr int kMask = kMask_;  // MaskKind
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpsN = kWarpsN_;             // warps splitting the keys of a row group
    static constexpr int kWarpsM = kNWarps / kWarpsN;    // row groups
    static constexpr int kWarpRows = kBlockM / kWarpsM;  // query rows a warp owns
    static constexpr int kWarpKeys = kBlockN / kWarpsN;  // keys of each block a warp owns
    static constexpr int kMTiles = kWarpRows / 16;
    static constexpr int kNTiles = kWarpKeys / 8;        // a warp's score columns, in mma n8 tiles
    static constexpr int kDTiles = kHeadDim / 8;         // output columns, in mma n8 tiles
    static constexpr int kAccRegisters = kMTiles * (kDTiles + kNTiles) * 4;  // fp32 acc_o + acc_s per thread
    static constexpr bool kFastLoads = kAccRegisters <= 160;                 // see load_tile
    // Warps whose rows all lie past the query rows skip the math (they still load and meet every barrier):
    // the KV cache's decoding blocks, whose few rows fill one warp of four (cuflash/kvcache.cuh). The mask
    // then has `rows`. Off here: a forward block's warps all have rows but in its last block.
    static constexpr bool kSkipIdleWarps = false;
    // The ranged mask forms up to D128 (they replaced reading ids by rows, which gave the warp-specialized
    // tiles 2x on 8 causal documents in session 11); the D256 wgmma tile went from 228 to 255 registers with
    // ids by rows and its forward 6% slower on tiles it never masks, so it keeps the per-element form.
    using Mask = MaskOf<kMask, (kHeadDim <= 128)>;
    using Dropout = DropoutOf<mask_has_dropout(kMask)>;
    using Blocks = KeyBlocksOf<kMask, kBlockM, kBlockN>;
    using ScoreMod = ScoreModOf<kScoreMod_, Elem>;
    static constexpr bool kBias = has_bias(kScoreMod_);
    static constexpr bool kBiasAlone = kScoreMod_ == kBiasScoreMod;  // a bias (maybe ALiBi), no softcap
    using BiasTileT = BiasTile<Elem, kBlockM, kBlockN>;  // one step's staged bias (with kBias)
    // This warp's first row within the block and first key within each key block.
    static __device__ __forceinline__ int warp_row0() { return int(threadIdx.x) / 32 / kWarpsN * kWarpRows; }
    static __device__ __forceinline__ int warp_key0() {
        return kWarpsN == 1 ? 0 : int(threadIdx.x) / 32 % kWarpsN * kWarpKeys;
    }
    static constexpr int kBiasSlotBytes = kBias ? BiasTileT::kBytes : 0;
    static_assert(sizeof(Elem) == 2, "the tensor-core forward takes fp16 or bf16");
    static_assert(kWarpRows % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
    static_assert(kWarpKeys % 16 == 0, "P.V steps over 16 keys");
    static_assert(kNWarps % kWarpsN == 0 && (kWarpsN == 1 || !kBias), "key-split warps take no staged bias");
    static_assert(kStages >= 1, "at least one K and one V buffer");
    // Query rows: powers of two, or 192 (three warpgroups of the warp-specialized D64 tile). Keys: multiples of 16
    // (P.V's k-steps), powers of two but for the warp-specialized D256 tile's 80.
    static_assert(((kBlockM & (kBlockM - 1)) == 0 || kBlockM == 192) && kBlockN % 16 == 0,
                  "power-of-two query tiles (or 192 rows), keys a multiple of 16");
};

// The load side: Q once, then K / V of step j (key block blocks.block(j)) into slot j % kSlots. Each
// load_k / load_v commits one cp.async group, empty when step j does not exist, so every thread commits
// the same groups and the mainloops' wait counts hold for every step. With a staged bias (Cfg::kBias and
// params.bias_staged) load_k also copies step j's bias tile into bias slot j % kSlots, in K's group: it
// is read (modify_and_mask) between K_j's wait and the barrier before K_{j+kSlots} reuses the slot.
// kLoadThreads: the threads that share the copies (threads 0 .. kLoadThreads - 1): the whole CTA, or a
// warp-specialized kernel's producer warpgroup.
// BiasT: the staged bias tile's layout (bias.cuh): BiasTile (padded rows), or BiasPanelTile (the wide-panel
// swizzle, which TMA writes: the warp-specialized forward's, whose producer loads it by TMA when
// params.bias_tma; load_k then leaves it out and the caller issues it, load_bias_tma).
template <typename Cfg, typename Tile_, int kSlots, int kLoadThreads = Cfg::kThreads,
          typename BiasT = typename Cfg::BiasTileT>
struct FwdLoads {
    using Elem = typename Cfg::Elem;
    using QTile = SwizzledTile<Cfg::kBlockM, Cfg::kHeadDim, Tile_::kPanelCols>;
    using KVTile = Tile_;
    using BiasTileT = BiasT;
    static constexpr bool kPanelBias = BiasT::kPanels;
    static constexpr int kBiasSlotBytes = Cfg::kBias ? BiasT::kBytes : 0;
    const AttnParams& params;
    const typename Cfg::Blocks blocks;  // a copy: two or three ints
    const Elem* k_src;
    const Elem* v_src;
    unsigned smem_k, smem_v;
    int b, h, h_kv, row_begin;  // for the bias tiles and the TMA loads
    int seqlen_k;               // this sequence's keys

    static constexpr int kSmemBytes = QTile::kBytes + 2 * kSlots * KVTile::kBytes + kSlots * kBiasSlotBytes;

    __device__ __forceinline__ FwdLoads(const AttnParams& p, const SeqInfo& seq, const typename Cfg::Blocks& blocks_,
                                        unsigned smem_q, int row_begin_)
        : params(p), blocks(blocks_), k_src(seq.k<Elem>(p)), v_src(seq.v<Elem>(p)), smem_k(smem_q + QTile::kBytes),
          smem_v(smem_q + QTile::kBytes + kSlots * KVTile::kBytes), b(seq.b), h(seq.h), h_kv(seq.h_kv),
          row_begin(row_begin_), seqlen_k(seq.seqlen_k) {}

    // Slot j % kSlots of the staged bias tiles (after the V slots).
    __device__ __forceinline__ unsigned bias_slot(int j) const {
        return smem_v + kSlots * KVTile::kBytes + unsigned(j % kSlots) * kBiasSlotBytes;
    }
    // Step j's staged bias tile, or none (not staged: the modifier reads the bias directly). ring_j: the
    // step's position in a ring that runs across tiles (the persistent mainloop), j otherwise.
    __device__ __forceinline__ BiasTileRef bias_tile(int ring_j, int n) const {
        static_assert(!kPanelBias, "a panel tile has no 'none': bias_panel, under params.bias_staged");
        if (Cfg::kBias && params.bias_staged) return BiasT::ref(bias_slot(ring_j), row_begin, n * Cfg::kBlockN);
        return BiasTileRef::none();
    }
    // The staged panel tile of step j (kPanelBias; only when params.bias_staged).
    __device__ __forceinline__ auto bias_panel(int ring_j, int n) const {
        return BiasT::ref(bias_slot(ring_j), row_begin, n * Cfg::kBlockN);
    }
    // Step j's bias tile by TMA from `map` (kPanelBias, params.bias_tma), issued by the calling thread alone,
    // its bytes counted on `full` (the step's K barrier).
    __device__ __forceinline__ void load_bias_tma(const TmaDescriptor* map, int j, int ring_j, unsigned full) const {
        if constexpr (Cfg::kBias && kPanelBias) {
            BiasT::load_tma(bias_slot(ring_j), params, map, b, h, row_begin, blocks.block(j) * Cfg::kBlockN, full);
        }
    }

    __device__ __forceinline__ void load_q(unsigned smem_q, const SeqInfo& seq, int row_begin) const {
        load_tile<QTile, kLoadThreads, Cfg::kFastLoads>(smem_q, seq.q<Elem>(params), params.q_row_stride, row_begin,
                                                         seq.seqlen_q, params.head_dim, params.q);
    }
    // By TMA (the warp-specialized forward, params.qkv_tma; the batched layout), issued by the calling thread
    // alone, their bytes counted on `full`: Q of this tile, step j's K or V (into slot ring_j % kSlots).
    __device__ __forceinline__ void load_q_tma(unsigned smem_q, const TmaDescriptor* map, unsigned full) const {
        sm90::tma_load_rows<QTile>(smem_q, map, full, h, row_begin, b);
    }
    __device__ __forceinline__ void load_kv_tma(bool is_v, const TmaDescriptor* map, int j, int ring_j,
                                                unsigned full) const {
        if (j < blocks.count()) {
            constexpr int kBoxRows = sm90::kv_box_rows(KVTile::kRows);
            sm90::tma_load_rows<KVTile, kBoxRows>((is_v ? smem_v : smem_k) + (ring_j % kSlots) * KVTile::kBytes, map,
                                                  full, h_kv, blocks.block(j) * Cfg::kBlockN, b);
        }
    }
    // Step j's K (and bias) / V tiles into slot ring_j % kSlots (ring_j = j but in the persistent mainloop).
    // kv_by_tma: the caller's thread 0 loads K / V by TMA (load_kv_tma); this copies the bias alone, if any,
    // and commits the group as always.
    __device__ __forceinline__ void load_k(int j, int ring_j, bool kv_by_tma = false) const {
        if constexpr (Cfg::kBias) {
            if (j < blocks.count() && params.bias_staged && !(kPanelBias && params.bias_tma)) {
                BiasT::template copy<kLoadThreads>(bias_slot(ring_j), params, b, h, row_begin,
                                                   blocks.block(j) * Cfg::kBlockN, threadIdx.x);
            }
        }
        load_step(kv_by_tma ? -1 : j, ring_j, smem_k, k_src, params.k_row_stride, params.head_dim, params.k);
    }
    __device__ __forceinline__ void load_v(int j, int ring_j, bool kv_by_tma = false) const {
        load_step(kv_by_tma ? -1 : j, ring_j, smem_v, v_src, params.v_row_stride, params.head_dim_v, params.v);
    }
    __device__ __forceinline__ void load_k(int j) const { load_k(j, j); }
    __device__ __forceinline__ void load_v(int j) const { load_v(j, j); }
    // Step j's key block of K or V (src, its row stride, valid columns, the tensor's base) into slot
    // ring_j % kSlots.
    __device__ __forceinline__ void load_step(int j, int ring_j, unsigned smem, const Elem* src, long long row_stride,
                                              int cols, const void* base) const {
        if (j >= 0 && j < blocks.count()) {  // j < 0: nothing to copy (loaded by TMA), the group still committed
            load_tile<KVTile, kLoadThreads, Cfg::kFastLoads>(smem + (ring_j % kSlots) * KVTile::kBytes, src, row_stride,
                                                              blocks.block(j) * Cfg::kBlockN, seqlen_k, cols,
                                                              base);
        }
        sm80::cp_async_commit();
    }
};

// What a forward mainloop works on, for both arches: its load side, the query block's key blocks and
// mask, Q's shared memory, the block's first row and the warp's first row within the block.
template <typename Cfg, typename Loads>
struct FwdWork {
    Loads loads;
    const typename Cfg::Blocks& blocks;
    const typename Cfg::Mask& mask;
    const typename Cfg::ScoreMod mod;
    const typename Cfg::Dropout dropout;
    unsigned smem_q;
    int row_begin, warp_row0;

    __device__ __forceinline__ FwdWork(const AttnParams& p, const SeqInfo& seq, const typename Cfg::Blocks& b,
                                       const typename Cfg::Mask& m, unsigned smem, int row_begin_, int warp_row0_)
        : loads(p, seq, b, smem, row_begin_), blocks(b), mask(m), mod(p, seq.b, seq.h, seq.causal_offset()),
          dropout(p, seq.b, seq.h), smem_q(smem), row_begin(row_begin_),
          warp_row0(warp_row0_) {}

    // The warp's raw scores against key block n (step j) -> the score modifier, then -inf where
    // invisible (the per-element test only on warp tiles that can need it).
    // ring_j: the step's position in the load ring (bias slot), j but in the persistent mainloop.
    // kSplitBiasReads: a staged bias and one read directly take separate copies of the modifier's loop, each
    // with its reads fixed at compile time (one uniform branch per step instead of a select per score), for a
    // bias without a softcap. The warp-specialized mainloop's consumers take it; on the 8-warp wgmma tile the
    // second copy cost 80-128 bytes of spill, with a softcap 16-130 more on the warp-specialized one (ptxas
    // of NVRTC 13.5).
    // spans: the mask's reads for this thread's rows made once per query block (Mask::row_spans; the
    // warp-specialized consumers), else NoSpans (the mask reads them here).
    template <bool kSplitBiasReads = false, int kMTiles, int kNTiles, typename Spans = NoSpans>
    __device__ __forceinline__ void modify_and_mask(float (&acc_s)[kMTiles][kNTiles][4], int j, int n,
                                                    int ring_j, const Spans& spans = Spans{}) const {
        const int warp_row_begin = row_begin + warp_row0;
        if constexpr (Cfg::kBias && Loads::kPanelBias) {  // staged in panels, or read directly: two loops
            if (loads.params.bias_staged) {
                mod.apply(acc_s, warp_row_begin, n * Cfg::kBlockN, loads.bias_panel(ring_j, n));
            } else {
                mod.apply(acc_s, warp_row_begin, n * Cfg::kBlockN, BiasTileRef::none());
            }
        } else if constexpr (Cfg::kBias) {
            if (!(kSplitBiasReads && Cfg::kBiasAlone) || loads.params.bias_staged) {
                mod.apply(acc_s, warp_row_begin, n * Cfg::kBlockN, loads.bias_tile(ring_j, n));
            } else {
                mod.apply(acc_s, warp_row_begin, n * Cfg::kBlockN, BiasTileRef::none());
            }
        } else {
            mod.apply(acc_s, warp_row_begin, n * Cfg::kBlockN + Cfg::warp_key0());
        }
        // The lists' partial bit where the blocks have one; the analytic policies' warp-tile test otherwise.
        // (A constant `true && needs_mask` here changed the plain D128 wgmma loop's SASS and cost 6% on an
        // H100: keep the analytic path free of it.)
        bool maybe_hidden;
        if constexpr (Cfg::Blocks::kListed) {
            maybe_hidden = blocks.masked(j);
        } else {
            maybe_hidden = mask.needs_mask(warp_row_begin, Cfg::kWarpRows, n * Cfg::kBlockN + Cfg::warp_key0(),
                                           Cfg::kWarpKeys);
        }
        if (maybe_hidden) mask.apply_spans(acc_s, spans, warp_row_begin, n * Cfg::kBlockN + Cfg::warp_key0());
    }
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void modify_and_mask(float (&acc_s)[kMTiles][kNTiles][4], int j, int n) const {
        modify_and_mask(acc_s, j, n, j);
    }

    // After the softmax's exponentials (the row sums hold every probability): dropout's zeros, key block n.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void drop(float (&acc_s)[kMTiles][kNTiles][4], int n) const {
        dropout.drop_rows(acc_s, row_begin + warp_row0, n * Cfg::kBlockN + Cfg::warp_key0());
    }
};

constexpr unsigned kSignBits2 = 0x80008000u;  // the sign bits of two packed fp16 / bf16

// Flips the sign of every element of a tile (bytes a multiple of 16), all threads sharing the work.
template <int kBytes, int kThreads>
__device__ __forceinline__ void negate_tile(unsigned tile) {
    for (int idx = threadIdx.x; idx < kBytes / kChunkBytes; idx += kThreads) {
        const unsigned addr = tile + idx * kChunkBytes;
        uint4 v = ld_shared_b128(addr);
        v.x ^= kSignBits2;
        v.y ^= kSignBits2;
        v.z ^= kSignBits2;
        v.w ^= kSignBits2;
        st_shared_b128(addr, v);
    }
}

// The online softmax wants scale > 0 (softmax.cuh). A negative scale is |scale| applied to -Q: flip Q's
// sign bits once, in shared memory, as soon as Q has landed (negate_q_if_needed; the next barrier
// publishes the flip). A zero scale becomes the smallest normal float, which keeps every finite exponent
// at 0 while masked scores stay -inf (0 * -inf would be NaN); lse still uses 0.
// A score modifier of the scaled domain (score_mod.cuh) has applied the scale itself: the softmax then
// runs with log2(e), and Q stays as it is.
template <typename ScoreMod>
__device__ __forceinline__ float softmax_scale_log2(const AttnParams& params) {
    if constexpr (ScoreMod::kScaled) return ScoreMod::exp_factor(params);
    constexpr float kMinScaleLog2 = 1.17549435e-38f;  // smallest normal float
    return fmaxf(fabsf(params.scale_log2), kMinScaleLog2);
}
// The sign flip, by the kThreads threads that share it, once Q has landed for all of them.
template <typename QTile, int kThreads, typename ScoreMod>
__device__ __forceinline__ void negate_q_if_needed(const AttnParams& params, unsigned smem_q) {
    if (!ScoreMod::kScaled && params.scale < 0.f) negate_tile<QTile::kBytes, kThreads>(smem_q);
}

// Both, for the kernels whose threads all load: kYoungerGroups cp.async groups were committed after the
// one holding Q. (Written out rather than through the two helpers above: that form scheduled the 8-warp
// wgmma loop's loads differently.)
template <typename QTile, int kThreads, int kYoungerGroups, typename ScoreMod>
__device__ __forceinline__ float positive_scale_log2(const AttnParams& params, unsigned smem_q) {
    if constexpr (ScoreMod::kScaled) return ScoreMod::exp_factor(params);
    constexpr float kMinScaleLog2 = 1.17549435e-38f;  // smallest normal float
    const float scale_log2 = fmaxf(fabsf(params.scale_log2), kMinScaleLog2);
    if (params.scale < 0.f) {
        sm80::cp_async_wait<kYoungerGroups>();  // the group of Q (and K0) landed for this thread ...
        __syncthreads();                        // ... and for all
        negate_tile<QTile::kBytes, kThreads>(smem_q);
    }
    return scale_log2;
}

// mma.sync m16n8k16 with Q / K / V fragments by ldmatrix from narrow-panel tiles (cuflash/tile.cuh).
// Shared memory: Q (kBlockM x kHeadDim), then kStages K tiles, then kStages V tiles (kBlockN x kHeadDim),
// then (bias variants) kStages bias tiles (FwdLoads).
// Pipeline (cp.async groups, committed in the order K0 V0 K1 V1 ...). Step j handles key block
// blocks.block(j) (masked phase first) in slot j % kStages:
//   wait K_j; barrier (everyone done with P.V of step j-1) -> issue V_{j+kStages-1};  S = Q.K_j^T
//   wait V_j; barrier (everyone done with Q.K_j^T)          -> issue K_{j+kStages};   softmax; P.V_j
// With kStages = 1 this is FlashAttention-2's overlap: V_j loads under Q.K_j^T, K_{j+1} under the
// softmax and P.V_j. With kStages >= 2 each load has a whole step or more to land. Every warp's last
// ldmatrix of Q precedes the last __syncthreads, so the epilogue may reuse Q's shared memory.
// Loads_: the load side (FwdLoads; the KV-cache kernel's gathers, KvLoads in cuflash/kvcache.cuh), whose
// tiles set the panel width the GEMMs read: narrow (32 columns, every forward) or wide (64, the KV cache's).
template <typename Cfg, typename Loads_ = FwdLoads<Cfg, NarrowTile<Cfg::kBlockN, Cfg::kHeadDim>, Cfg::kStages>>
struct FwdMainloopSm80 : FwdWork<Cfg, Loads_> {
    using Elem = typename Cfg::Elem;
    using Loads = Loads_;
    static constexpr int kPanelCols = Loads::KVTile::kPanelCols;
    using Tile = SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, kPanelCols>;
    using QTile = typename Loads::QTile;
    static_assert((kPanelCols == 32 || kPanelCols == 64) && Loads::KVTile::kBytes == Tile::kBytes &&
                      QTile::kPanelCols == kPanelCols,
                  "the load side fills narrow- or wide-panel tiles, Q's like K's and V's");
    static constexpr int kStages = Cfg::kStages;
    static constexpr int kSmemBytes = Loads::kSmemBytes;
    static constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;

    static __device__ __forceinline__ void check_smem(unsigned smem_q) {
        if (sm80::dynamic_smem_bytes() < kSmemBytes) __trap();  // the plan's smem formula drifted
    }

    using FwdWork<Cfg, Loads_>::FwdWork;

    // Prologue: groups K0 (with Q), V0, K1, V1, ..., V_{kStages-2}, K_{kStages-1}: 2*kStages-1 groups.
    // Later steps commit V_{j+kStages-1} and K_{j+kStages}, keeping the order K0 V0 K1 V1 ...: when step
    // j waits for K_j (group 2j) or V_j (group 2j+1), exactly 2*kStages-2 younger groups exist.
    __device__ __forceinline__ void run(const AttnParams& params, const SeqInfo& seq, float (&acc_o)[kMTiles][kDTiles][4],
                                        OnlineSoftmax<kMTiles>& softmax) {
        this->loads.load_q(this->smem_q, seq, this->row_begin);
        this->loads.load_k(0);
#pragma unroll
        for (int s = 0; s + 1 < kStages; ++s) {
            this->loads.load_v(s);
            this->loads.load_k(s + 1);
        }
        const float scale_log2 = positive_scale_log2<QTile, Cfg::kThreads, 2 * kStages - 2, typename Cfg::ScoreMod>(params, this->smem_q);

        const LdmatrixLanes<kPanelCols> lanes(threadIdx.x % 32);
        const unsigned q_warp = this->smem_q + this->warp_row0 * QTile::kPanelRowBytes;
        const unsigned kv_warp = Cfg::warp_key0() * Tile::kPanelRowBytes;  // this warp's keys of a K / V tile
        bool idle = false;  // (a warp-uniform branch around the math only)
        if constexpr (Cfg::kSkipIdleWarps) idle = this->row_begin + this->warp_row0 >= this->mask.rows;
        for (int j = 0; j < this->blocks.count(); ++j) {
            const int n = this->blocks.block(j);
            const unsigned slot = kStages == 1 ? 0u : unsigned(j % kStages) * Tile::kBytes;

            sm80::cp_async_wait<2 * kStages - 2>();  // K_j (and Q) landed for this thread ...
            __syncthreads();                         // ... and for all; everyone finished P.V_{j-1}
            this->loads.load_v(j + kStages - 1);           // into the V slot P.V_{j-1} just released

            float acc_s[kMTiles][kNTiles][4];
            if (!idle) {
                gemm_qk<Elem, Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN>(acc_s, q_warp, this->loads.smem_k + slot + kv_warp,
                                                                      lanes);
                this->modify_and_mask(acc_s, j, n);
            }

            sm80::cp_async_wait<2 * kStages - 2>();  // V_j landed for this thread ...
            __syncthreads();                         // ... and for all; everyone finished Q.K_j^T
            this->loads.load_k(j + kStages);               // into the K slot Q.K_j^T just released

            if (!idle) {
                softmax.update(acc_s, acc_o, scale_log2);
                this->drop(acc_s, n);
                gemm_pv<Elem, Cfg::kHeadDim, Cfg::kBlockN>(acc_o, acc_s, this->loads.smem_v + slot + kv_warp, lanes);
            }
        }
        sm80::cp_async_wait<0>();  // only empty groups can remain; keep the invariant explicit
    }
};

}  // namespace cuflash
