// True-fp32 attention on CUDA cores: float32 inputs, FFMA only, no TF32 anywhere.
//
// Idea: the FlashAttention-2 algorithm (online softmax forward; recompute-from-lse backward with a
// dK/dV kernel over key blocks and a separate dQ kernel over query blocks) with every product an
// fp32 FFMA, so the result stays within ~1e-6 relative of a float64 reference. Speed is secondary
// to exactness here; the tiles are still register-blocked so CUDA cores, not shared memory, bound
// the run time.
//
// Built on the same parts as the tensor-core kernels, so a feature added there reaches this path too:
// sequence info (cuflash/seqlen.cuh: every pointer and length of a (batch, head)), block ranges
// (cuflash/block.cuh: KeyBlocks / QueryBlocks), the mask (cuflash/mask.cuh: AttnMask::visible) and the
// score modifier (cuflash/score_mod.cuh: apply_one on each raw score before the mask, grad_one on each
// dS), all chosen in simt::Config. The thread grid and the FFMA tile products are in
// cuflash/simt_tile.cuh: 256 threads as 16 x 16, thread (ty, tx) owning rows ty + 16*i and columns
// tx + 16*j of a score tile and the same rows of an output tile.
//
// Backward: both kernels run one mainloop (BwdMainloop). A block keeps one side's tiles resident (K, V
// for dK/dV; Q, dO for dQ) and streams the other side's blocks; the score tile is held with the resident
// side as thread rows (kKeyRows: keys, so the rows of P^T / dS^T a warp writes are exactly the dK / dV
// rows it accumulates), and the recomputation of P and dS is one code path for both.
//
// Accuracy: every long sum is two-level. A key (or query) block's contribution is summed into a
// zeroed block accumulator and only then added to the running one, so rounding grows like
// sqrt(kBlock) + sqrt(S / kBlock) instead of sqrt(S): at S = 16k (D = 64) the max relative error of
// O, dQ and dK drops from ~5e-6 to <= 1.1e-6 (measured on a float32 numpy port of these loops). The
// blocks are visited in ascending order.
//
// Kernels (all deterministic: no atomics, every sum in a fixed order):
//   flash_fwd_simt_kernel             grid (ceil(Sq/kBlockM), H, B)
//   flash_bwd_preprocess_simt_kernel  grid (ceil(Sq/kPrepRows), H, B): softmax_d = rowsum(dO*O) - dlse
//   flash_bwd_dkdv_simt_kernel        grid (ceil(Sk/kBlockN), H, B): one block per QUERY head
//   flash_bwd_reduce_dkdv_simt_kernel grid (ceil(Sk/kReduceRows), Hkv, B): GQA group sums
//   flash_bwd_dq_simt_kernel          grid (ceil(Sq/kBlockM), H, B)
// The host-side plan (cuflash/kernels/simt.py) mirrors every kSmemBytes formula below
// (CUFLASH_CHECK_SMEM_BYTES).

#include "cuflash/params.cuh"
#include "cuflash/dbias_order.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/block.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/score_mod.cuh"
#include "cuflash/dropout.cuh"
#include "cuflash/simt_tile.cuh"
#include "cuflash/simt_attention.cuh"

namespace cuflash {
namespace simt {

constexpr int kPrepRows = 32;    // query rows per pre-pass block
constexpr int kReduceRows = 16;  // key rows per GQA reduce block

// A tiled SIMT kernel's template arguments and the parts it is built from: the one place that picks
// the mask, the block ranges and the score modifier.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kMask_, int kScoreMod_>
struct Config {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kMask = kMask_;  // MaskKind
    static constexpr int kScoreMod = kScoreMod_;  // ScoreModKind
    static constexpr int kPitch = kHeadDim + kPad;  // row pitch of the (rows x kHeadDim) shared tiles
    using Cols = OutCols<kHeadDim>;
    using Mask = MaskOf<kMask>;
    using Dropout = DropoutOf<mask_has_dropout(kMask)>;
    using Keys = KeyBlocksOf<kMask, kBlockM, kBlockN>;       // key blocks of a query block (forward, dQ)
    using Queries = QueryBlocksOf<kMask, kBlockM, kBlockN>;  // query blocks of a key block (dK / dV)
    using ScoreMod = ScoreModOf<kScoreMod_, float>;
    static_assert(kBlockM % kThreadRows == 0 && kBlockN % kThreadRows == 0 && kThreadRows == kLanesPerRow,
                  "tiles are 16 x 16 thread grids");
};

// Stages one (batch, head)'s operand rows into (rows x kHeadDim) shared tiles: q / dout take kBlockM rows
// from query row `row`, k / v kBlockN rows from key row `row`. Rows past the sequence and columns past
// D / Dv are zero-filled; the caller commits the cp.async group.
template <typename Cfg>
struct Loads {
    const AttnParams& params;
    const SeqInfo& seq;

    template <int kRows>
    __device__ __forceinline__ void rows(float* dst, const float* src, long long stride, int valid, int cols) const {
        load_tile<kRows, Cfg::kHeadDim, Cfg::kPitch>(dst, src, stride, valid, cols);
    }
    __device__ __forceinline__ void q(float* dst, int row) const {
        rows<Cfg::kBlockM>(dst, seq.q<float>(params, row), params.q_row_stride, seq.seqlen_q - row, params.head_dim);
    }
    __device__ __forceinline__ void dout(float* dst, int row) const {
        rows<Cfg::kBlockM>(dst, seq.dout<float>(params, row), params.do_row_stride, seq.seqlen_q - row,
                           params.head_dim_v);
    }
    __device__ __forceinline__ void k(float* dst, int row) const {
        rows<Cfg::kBlockN>(dst, seq.k<float>(params, row), params.k_row_stride, seq.seqlen_k - row, params.head_dim);
    }
    __device__ __forceinline__ void v(float* dst, int row) const {
        rows<Cfg::kBlockN>(dst, seq.v<float>(params, row), params.v_row_stride, seq.seqlen_k - row,
                           params.head_dim_v);
    }
};

// O = acc_o / l and lse = m * ln(2) + log(l) for the thread's rows < Sq; a row that saw nothing gets
// 0 and -inf.
template <typename Cfg, int kRows, int kC>
__device__ __forceinline__ void store_forward(const AttnParams& params, const SeqInfo& seq,
                                              const RowSoftmax<kRows>& softmax, const float (&acc_o)[kRows][kC],
                                              int row0, TilePos<false> at) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const float l = row_sum16(softmax.l[i]);  // the whole half-warp shuffles, before any row test
        const int row = at.query(row0, i, 0);
        if (row >= seq.seqlen_q) continue;
        const bool empty = !(l > 0.f);
        const float rp = Cfg::Dropout::rp(params);  // dropout's 1 / (1 - p) on the kept probabilities
        store_row<Cfg::kHeadDim>(seq.o<float>(params, row), acc_o[i], params.head_dim_v, at.tx,
                                 [&](float x) { return empty ? 0.f : (Cfg::Dropout::kEnabled ? rp * x : x) / l; });
        float* lse = seq.lse(params, row);
        // m is in the log2 domain: lse = m * ln(2) + log(l).
        if (at.tx == 0 && lse != nullptr) *lse = empty ? -INFINITY : fmaf(softmax.m[i], kLn2, logf(l));
    }
}

// ---------------------------------------------------------------------------------------------
// Backward pieces: one mainloop for the dK/dV (kKeyRows) and the dQ kernels.
// ---------------------------------------------------------------------------------------------

// P = exp(s * scale - lse) recomputed in the backward. expf of one fused fma rounds once on a small
// argument; folding lse into a log2 domain would add a rounding of size eps * |lse * log2(e)|.
// lse_or_inf is +inf for rows that see no key (lse = -inf) and for rows past Sq, so P = 0 there.
__device__ __forceinline__ float recompute_p(float s, float scale, float lse_or_inf) {
    return expf(fmaf(s, scale, -lse_or_inf));
}

__device__ __forceinline__ float lse_for_backward(const float* lse_row, int row, int seqlen_q) {
    const float lse = row < seqlen_q ? lse_row[row] : INFINITY;
    return lse == -INFINITY ? INFINITY : lse;
}

// Shared-memory layout, tiles back to back; kSmemBytes is mirrored by cuflash/kernels/simt.py. The
// resident side has kTileRows rows per tile (K, V of the dK/dV kernel; Q, dO of the dQ kernel), the
// streamed side kTileCols (Q, dO; K, V). Then the dS tile (kTileRows x kTileCols, pitch kPPitch),
// preceded in the dK/dV kernel by P^T, which dV needs.
template <typename Cfg, bool kKeyRows>
struct BwdSmem {
    static constexpr int kTileRows = kKeyRows ? Cfg::kBlockN : Cfg::kBlockM;
    static constexpr int kTileCols = kKeyRows ? Cfg::kBlockM : Cfg::kBlockN;
    static constexpr int kPPitch = kTileCols + kPad;
    static constexpr int kScoreTiles = kKeyRows ? 2 : 1;
    static constexpr unsigned kSmemBytes =
        (2 * (kTileRows + kTileCols) * Cfg::kPitch + kScoreTiles * kTileRows * kPPitch) * sizeof(float);
    float* fixed_s;   // resident operand of S = A.B^T (A): K, or Q
    float* fixed_dp;  // resident operand of dP (A2): V, or dO
    float* step_s;    // streamed operand of S (B): Q, or K
    float* step_dp;   // streamed operand of dP (B2): dO, or V
    float* p;         // P^T (dK/dV kernel only; in the dQ kernel p == ds and is unused)
    float* ds;
    __device__ __forceinline__ explicit BwdSmem(float* base)
        : fixed_s(base), fixed_dp(fixed_s + kTileRows * Cfg::kPitch), step_s(fixed_dp + kTileRows * Cfg::kPitch),
          step_dp(step_s + kTileCols * Cfg::kPitch), p(step_dp + kTileCols * Cfg::kPitch),
          ds(p + (kScoreTiles - 1) * kTileRows * kPPitch) {}
};

// Grid block `fixed_block` (a key block with kKeyRows, else a query block) of one (batch, head):
// walks the blocks of the other side that it meets, ascending, and accumulates acc[0] += dS.B (dK
// with kKeyRows, else dQ; both unscaled) and, with kKeyRows, acc[1] += P^T.dO (dV).
template <typename Cfg, bool kKeyRows>
struct BwdMainloop {
    using Smem = BwdSmem<Cfg, kKeyRows>;
    static constexpr int kTileRows = Smem::kTileRows, kTileCols = Smem::kTileCols;
    static constexpr int kI = kTileRows / kThreadRows;   // tile rows per thread
    static constexpr int kJ = kTileCols / kLanesPerRow;  // tile columns per thread
    static constexpr int kQueries = kKeyRows ? kJ : kI;  // query rows per thread
    static constexpr int kAccs = kKeyRows ? 2 : 1;
    using Acc = float[kAccs][kI][Cfg::Cols::kPerThread];

    // The streamed blocks: query blocks that see this key block, or key blocks this query block sees.
    using Steps = conditional_t<kKeyRows, typename Cfg::Queries, typename Cfg::Keys>;

    const AttnParams& params;
    const SeqInfo& seq;
    const Smem sm;
    const typename Cfg::Mask mask;
    const TilePos<kKeyRows> at;
    const int fixed_block;

    __device__ __forceinline__ BwdMainloop(const AttnParams& params_, const SeqInfo& seq_, int fixed_block_)
        : params(params_), seq(seq_), sm(shared_floats<Smem::kSmemBytes>()), mask(params_, seq_),
          at(this_thread<kKeyRows>()), fixed_block(fixed_block_) {}

    __device__ __forceinline__ void run(Acc& acc) const {
        const int fixed0 = fixed_block * kTileRows;  // first key (kKeyRows) or query row of the resident side
        float lse[kQueries], delta[kQueries];
        if constexpr (!kKeyRows) row_stats(seq, lse, delta, fixed0);
#pragma unroll
        for (int a = 0; a < kAccs; ++a) fill_zero(acc[a]);
        const Steps blocks(mask, fixed_block);
        if (blocks.count() > 0) load_side<!kKeyRows>(seq, sm.fixed_s, sm.fixed_dp, fixed0, false);
        for (int step = 0; step < blocks.count(); ++step) {
            const int index = blocks.count() - 1 - step;  // ascending for both kinds of blocks
            const int start = blocks.block(index) * kTileCols;
            const int row0 = kKeyRows ? start : fixed0, col0 = kKeyRows ? fixed0 : start;
            // The deterministic backward's dbias adds into a broadcast bias take turns (dbias_order.cuh): this
            // step's, before the barrier below hands it to the CTA.
            constexpr bool kOrderable = kKeyRows && dbias_order::orders(has_bias(Cfg::kScoreMod), true);
            if (kOrderable && dbias_order::enabled(params) && threadIdx.x == 0) {
                dbias_order::wait_turn(params, seq.b, seq.h, blocks.block(index), fixed_block);
            }
            // Every thread finished reading the last step's tiles (and its warp's rows of P / dS).
            __syncthreads();
            const SeqInfo streamed = streamed_seq();
            load_side<kKeyRows>(streamed, sm.step_s, sm.step_dp, start, true);
            if constexpr (kKeyRows) row_stats(streamed, lse, delta, row0);
            recompute(lse, delta, row0, col0, blocks.masked(index));
            if (kOrderable && dbias_order::enabled(params)) {  // every thread's adds are visible: the next turn
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) dbias_order::pass_turn(params, seq.b, seq.h, blocks.block(index), fixed_block);
            }
            __syncwarp();  // the rows just written are read back only by this warp
            if constexpr (kKeyRows) accumulate(acc[1], sm.p, sm.step_dp);  // dV += P^T dO
            accumulate(acc[0], sm.ds, sm.step_s);                          // dK += dS^T Q, or dQ += dS K
        }
    }

  private:

    // The sequence info of the streamed side's loads. The dK/dV kernel rebuilds it every step from an
    // opaque (b, h): its Q / dO / lse / D pointers are then formed from the constant-bank params where
    // used instead of being hoisted and held in registers across the loop (hoisted, D = 96 and D = 224
    // causal spilled on sm_80). The dQ kernel keeps the hoisted one: a rebuilt K / V pointer would redo
    // the h / h_per_kv division every step.
    __device__ __forceinline__ SeqInfo streamed_seq() const {
        if constexpr (kKeyRows) return SeqInfo::query_side<LayoutOf<Cfg::kMask>::value>(params, opaque(seq.b), opaque(seq.h));
        else return seq;
    }

    // S's and dP's operands of one side, from query row / key `start`: Q and dO, or K and V. With
    // two_groups, S's operand is a cp.async group of its own, so it can be waited on alone.
    template <bool kQuerySide>
    __device__ __forceinline__ void load_side(const SeqInfo& on, float* for_s, float* for_dp, int start,
                                              bool two_groups) const {
        const Loads<Cfg> loads{params, on};
        if constexpr (kQuerySide) loads.q(for_s, start); else loads.k(for_s, start);
        if (two_groups) sm80::cp_async_commit();
        if constexpr (kQuerySide) loads.dout(for_dp, start); else loads.v(for_dp, start);
        sm80::cp_async_commit();
    }

    __device__ __forceinline__ void accumulate(float (&acc)[kI][Cfg::Cols::kPerThread], const float* sP,
                                               const float* sB) const {
        add_block_product<kTileRows, kTileCols, Smem::kPPitch, Cfg::kHeadDim, Cfg::kPitch>(acc, sP, sB, at.tx, at.ty);
    }

    // lse (as lse_for_backward) and D = softmax_d of the thread's query rows of the block at row0.
    __device__ __forceinline__ void row_stats(const SeqInfo& on, float (&lse)[kQueries], float (&delta)[kQueries],
                                              int row0) const {
        const float* lse_row = on.lse_in(params);
        const float* d_row = on.softmax_d(params);
#pragma unroll
        for (int n = 0; n < kQueries; ++n) {
            const int row = kKeyRows ? at.query(row0, 0, n) : at.query(row0, n, 0);
            lse[n] = lse_for_backward(lse_row, row, on.seqlen_q);
            delta[n] = row < on.seqlen_q ? d_row[row] : 0.f;
        }
    }

    // The tile of query rows [row0, +kBlockM) x keys [col0, +kBlockN): S = A.B^T, the score modifier,
    // the mask, P = exp(scale S - lse) (0 where hidden); then dP = A2.B2^T and dS = grad(P (dP - D)).
    // Waits for the step's cp.async groups: B with the first wait, B2 with the second.
    __device__ __forceinline__ void recompute(const float (&lse)[kQueries], const float (&delta)[kQueries], int row0,
                                              int col0, bool masked) const {
        const typename Cfg::ScoreMod score_mod(params, seq.b, seq.h, seq.causal_offset());
        // A modifier of the scaled domain (score_mod.cuh) has applied the scale already.
        const float p_scale = Cfg::ScoreMod::kScaled ? 1.f : params.scale;
        sm80::cp_async_wait<1>();  // the resident tiles and B landed (B2 may be in flight)
        __syncthreads();
        float s[kI][kJ], p[kI][kJ];
        tile_dot_abt<kTileRows, kTileCols, Cfg::kPitch>(s, sm.fixed_s, sm.step_s, round_up4(params.head_dim), at.tx,
                                                        at.ty);
        const bool needs_mask = masked && mask.needs_mask(row0, Cfg::kBlockM, col0, Cfg::kBlockN);
#pragma unroll
        for (int i = 0; i < kI; ++i) {
#pragma unroll
            for (int j = 0; j < kJ; ++j) {
                const bool visible = !needs_mask || mask.visible(at.query(row0, i, j), at.key(col0, i, j));
                const float s_mod = score_mod.apply_one(s[i][j], at.query(row0, i, j), at.key(col0, i, j));
                p[i][j] = visible ? recompute_p(s_mod, p_scale, lse[kKeyRows ? j : i]) : 0.f;
            }
        }

        sm80::cp_async_wait<0>();  // B2 landed
        __syncthreads();
        float dp[kI][kJ];
        tile_dot_abt<kTileRows, kTileCols, Cfg::kPitch>(dp, sm.fixed_dp, sm.step_dp, round_up4(params.head_dim_v),
                                                        at.tx, at.ty);
        const typename Cfg::Dropout dropout(params, seq.b, seq.h);
        const float rp = Cfg::Dropout::rp(params);
#pragma unroll
        for (int i = 0; i < kI; ++i) {
#pragma unroll
            for (int j = 0; j < kJ; ++j) {
                // Dropout: dP of a kept probability times 1 / (1 - p), of a dropped one 0; dV sees P kept or 0.
                const bool keep = dropout.keep(at.query(row0, i, j), at.key(col0, i, j));
                const float dp_kept = Cfg::Dropout::kEnabled ? (keep ? dp[i][j] * rp : 0.f) : dp[i][j];
                const float ds_mod = p[i][j] * (dp_kept - delta[kKeyRows ? j : i]);
                const int idx = (at.ty + i * kThreadRows) * Smem::kPPitch + at.tx + j * kLanesPerRow;
                if constexpr (kKeyRows) sm.p[idx] = keep ? p[i][j] : 0.f;
                // The dK/dV kernel (kKeyRows) sees each score once per query head: it writes dbias.
                if constexpr (kKeyRows) {
                    sm.ds[idx] = score_mod.grad_one_dbias(params, ds_mod, s[i][j], at.query(row0, i, j), at.key(col0, i, j));
                } else {
                    sm.ds[idx] = score_mod.grad_one(ds_mod, s[i][j], at.query(row0, i, j), at.key(col0, i, j));
                }
            }
        }
    }
};

// dK = scale * sum dS^T Q and dV = sum P^T dO for the thread's keys < Sk. Without GQA straight into
// dk / dv; with GQA into this query head's fp32 partials (B, H, Sk, kHeadDim) (all kHeadDim columns;
// those past D / Dv are 0), summed over the group by flash_bwd_reduce_dkdv_simt_kernel.
template <typename Cfg, int kRows, int kC>
__device__ __forceinline__ void store_dkdv(const AttnParams& params, const SeqInfo& seq,
                                           const float (&acc_dk)[kRows][kC], const float (&acc_dv)[kRows][kC],
                                           int col0, TilePos<true> at) {
    constexpr int kHeadDim = Cfg::kHeadDim;
    const bool to_partials = params.dk_accum != nullptr;
    const float scale = params.scale;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int key = at.key(col0, i, 0);
        if (key >= seq.seqlen_k) continue;
        const long long partial = static_cast<long long>(key) * kHeadDim;
        float* dk_row = to_partials ? seq.dk_accum(params, kHeadDim) + partial : seq.dk<float>(params, key);
        float* dv_row = to_partials ? seq.dv_accum(params, kHeadDim) + partial : seq.dv<float>(params, key);
        store_row<kHeadDim>(dk_row, acc_dk[i], to_partials ? kHeadDim : params.head_dim, at.tx,
                            [&](float x) { return scale * x; });
        const float rp = Cfg::Dropout::rp(params);  // dropout's 1 / (1 - p); 1 without dropout
        store_row<kHeadDim>(dv_row, acc_dv[i], to_partials ? kHeadDim : params.head_dim_v, at.tx,
                            [&](float x) { return Cfg::Dropout::kEnabled ? rp * x : x; });
    }
}

}  // namespace simt

// ---------------------------------------------------------------------------------------------
// Forward: O = softmax(scale * Q K^T) V with an online softmax over key blocks; lse per row.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockM, int kBlockN, int kMask, int kScoreMod>
__global__ void __launch_bounds__(simt::kThreads, simt::min_blocks_per_sm<kMask, kScoreMod>())
flash_fwd_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Cfg = Config<kHeadDim, kBlockM, kBlockN, kMask, kScoreMod>;
    using Smem = FwdSmem<Cfg>;
    constexpr int kRows = kBlockM / kThreadRows;  // query rows per thread
    CUFLASH_CHECK_SMEM_BYTES(Smem::kSmemBytes);
    const Smem sm(shared_floats<Smem::kSmemBytes>());

    // Masks: the last query blocks see the most keys; start them first.
    const int m_block = kMask != kNoMask ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const SeqInfo seq(params, blockIdx.z, blockIdx.y, LayoutOf<kMask>());
    const Loads<Cfg> loads{params, seq};
    const TilePos<false> at = this_thread<false>();
    const int row0 = m_block * kBlockM;
    if (row0 >= seq.seqlen_q) return;  // past a shorter packed sequence (the grid covers the longest)
    const typename Cfg::Mask mask(params, seq);
    const typename Cfg::Keys blocks(mask, m_block);
    const typename Cfg::ScoreMod score_mod(params, seq.b, seq.h, seq.causal_offset());
    float acc_o[kRows][Cfg::Cols::kPerThread];
    RowSoftmax<kRows> softmax;
    forward_rows<Cfg>(params, seq, sm, loads, mask, blocks, score_mod, row0, at, acc_o, softmax);
    store_forward<Cfg>(params, seq, softmax, acc_o, row0, at);
}

// ---------------------------------------------------------------------------------------------
// Backward pre-pass: softmax_d[b, h, i] = sum_d dO[i, d] * O[i, d] - dlse[i]. One warp per row.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim>
__global__ void __launch_bounds__(simt::kThreads, simt::kMinBlocksPerSm) flash_bwd_preprocess_simt_kernel(const AttnParams params) {
    using namespace simt;
    constexpr int kWarps = kThreads / 32;
    const SeqInfo seq(params, blockIdx.z, blockIdx.y);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < kPrepRows; r += kWarps) {
        const int row = blockIdx.x * kPrepRows + r;
        if (row >= seq.seqlen_q) break;  // uniform across the warp
        const float* o_row = seq.o<const float>(params, row);
        const float* do_row = seq.dout<float>(params, row);
        // In double: D cancels against dP in dS = P (dP - D), so its float32 rounding went on into dq (a host
        // emulation of the long fuzz's fp32 failures, session 51: one problem's dq error 3.3e-4 -> 6.2e-5).
        double acc = 0.0;
#pragma unroll
        for (int c = 0; c < kHeadDim / 32; ++c) {
            const int col = c * 32 + lane;
            if (col < params.head_dim_v)
                acc = fma(static_cast<double>(do_row[col]), static_cast<double>(o_row[col]), acc);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        if (lane == 0) {
            const double dlse = params.dlse == nullptr ? 0.0 : *seq.dlse(params, row);
            *seq.softmax_d(params, row) = static_cast<float>(acc - dlse);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward dK/dV: one block per (key block, QUERY head). K_j, V_j stay in smem; for each query block
// that sees them: S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D),
// dV += P^T dO, dK += dS^T Q (simt::BwdMainloop with kKeyRows).
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockM, int kBlockN, int kMask, int kScoreMod>
__global__ void __launch_bounds__(simt::kThreads, simt::min_blocks_per_sm<kMask, kScoreMod>())
flash_bwd_dkdv_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Cfg = Config<kHeadDim, kBlockM, kBlockN, kMask, kScoreMod>;
    using Mainloop = BwdMainloop<Cfg, true>;
    CUFLASH_CHECK_SMEM_BYTES(Mainloop::Smem::kSmemBytes);

    const int n_block = blockIdx.x;
    const SeqInfo seq(params, blockIdx.z, blockIdx.y, LayoutOf<kMask>());
    if (n_block * kBlockN >= seq.seqlen_k) return;  // past a shorter packed sequence
    typename Mainloop::Acc acc;  // dK (unscaled), dV
    const Mainloop mainloop(params, seq, n_block);
    mainloop.run(acc);
    store_dkdv<Cfg>(params, seq, acc[0], acc[1], n_block * kBlockN, mainloop.at);
}

// ---------------------------------------------------------------------------------------------
// GQA reduce: dk[b, j, hk] = sum over the group's h_per_kv query heads, ascending, of dk_accum[b, h, j]
// (same for dv). Fixed order, so the result is bitwise reproducible.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim>
__global__ void __launch_bounds__(simt::kThreads, simt::kMinBlocksPerSm) flash_bwd_reduce_dkdv_simt_kernel(const AttnParams params) {
    using namespace simt;
    constexpr int kChunksPerRow = kHeadDim / 4;
    const int h_kv = blockIdx.y, b = blockIdx.z;
    const SeqInfo group(params, b, h_kv * params.h_per_kv);  // the group's first query head: kv head h_kv
    for (int chunk = threadIdx.x; chunk < kReduceRows * kChunksPerRow; chunk += kThreads) {
        const int key = blockIdx.x * kReduceRows + chunk / kChunksPerRow;
        const int col = (chunk % kChunksPerRow) * 4;
        if (key >= group.seqlen_k) continue;
        const long long offset = static_cast<long long>(key) * kHeadDim + col;
        float dk_sum[4] = {0.f, 0.f, 0.f, 0.f};
        float dv_sum[4] = {0.f, 0.f, 0.f, 0.f};
        for (int g = 0; g < params.h_per_kv; ++g) {
            const SeqInfo seq(params, b, h_kv * params.h_per_kv + g);
            // Partials are contiguous with 16-byte rows (kHeadDim % 4 == 0): aligned float4 reads.
            const float4 dk4 = *reinterpret_cast<const float4*>(seq.dk_accum(params, kHeadDim) + offset);
            const float4 dv4 = *reinterpret_cast<const float4*>(seq.dv_accum(params, kHeadDim) + offset);
            dk_sum[0] += dk4.x; dk_sum[1] += dk4.y; dk_sum[2] += dk4.z; dk_sum[3] += dk4.w;
            dv_sum[0] += dv4.x; dv_sum[1] += dv4.y; dv_sum[2] += dv4.z; dv_sum[3] += dv4.w;
        }
        store_chunk<4>(group.dk<float>(params, key), col, dk_sum, params.head_dim);
        store_chunk<4>(group.dv<float>(params, key), col, dv_sum, params.head_dim_v);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward dQ: one block per (query block, query head). Q_i, dO_i stay in smem; for each visible key
// block: S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = P (dP - D), dQ += dS K
// (simt::BwdMainloop). Each block owns its dQ rows outright, so there are no atomics; dq = scale * dQ.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockM, int kBlockN, int kMask, int kScoreMod>
__global__ void __launch_bounds__(simt::kThreads, simt::min_blocks_per_sm<kMask, kScoreMod>())
flash_bwd_dq_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Mainloop = BwdMainloop<Config<kHeadDim, kBlockM, kBlockN, kMask, kScoreMod>, false>;
    CUFLASH_CHECK_SMEM_BYTES(Mainloop::Smem::kSmemBytes);

    const int m_block = kMask != kNoMask ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const SeqInfo seq(params, blockIdx.z, blockIdx.y, LayoutOf<kMask>());
    if (m_block * kBlockM >= seq.seqlen_q) return;  // past a shorter packed sequence
    typename Mainloop::Acc acc;  // dQ (unscaled)
    const Mainloop mainloop(params, seq, m_block);
    mainloop.run(acc);

    // dq = scale * dQ for rows < Sq, columns < D (rows that see no key get 0).
    const float scale = params.scale;
#pragma unroll
    for (int i = 0; i < Mainloop::kI; ++i) {
        const int row = mainloop.at.query(m_block * kBlockM, i, 0);
        if (row >= seq.seqlen_q) continue;
        store_row<kHeadDim>(seq.dq<float>(params, row), acc[0][i], params.head_dim, mainloop.at.tx,
                            [&](float x) { return scale * x; });
    }
}

}  // namespace cuflash
