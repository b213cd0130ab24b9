// The SIMT forward's parts (cuda_src/flash_simt.cu), shared by the dense / packed forward and the KV cache's
// fp32 kernel (cuda_src/flash_kvcache_simt.cu): where a thread's scores sit in a tile, the forward's
// shared-memory layout, the score modifier and mask on a score tile, the online softmax and the key loop of
// one query block. The backward uses TilePos too.
//
// A kernel brings a config (kHeadDim, kBlockM, kBlockN, kPitch, Cols, Mask, Dropout, ScoreMod: simt::Config in
// flash_simt.cu, KvSimtConfig in flash_kvcache_simt.cu) and a loads object that stages rows into shared tiles:
// q(dst, row0), k(dst, key0), v(dst, key0), zero-filling rows and columns past the data (the loop commits
// the cp.async groups).
#pragma once

#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/simt_tile.cuh"

namespace cuflash {
namespace simt {

// Two resident blocks per SM: caps registers at 128 (2 x 256 threads fill the 64K register file).
// Without the hint ptxas (CUDA 13, sm_90a) squeezed some variants to 80 registers and spilled. The
// general-mask and score-modifier variants need more (ids, tanhf) and run one block per SM.
constexpr int kMinBlocksPerSm = 2;
template <int kMask, int kScoreMod>
__host__ __device__ constexpr int min_blocks_per_sm() { return is_general_mask(kMask) || kScoreMod != kNoScoreMod ? 1 : kMinBlocksPerSm; }

// Where element (i, j) of a thread's score tile sits: tile row ty + 16*i, column tx + 16*j. Tile rows
// are queries (forward, dQ) or, with kKeyRows, keys (the dK / dV kernel's transposed tile).
template <bool kKeyRows>
struct TilePos {
    int tx, ty;
    __device__ __forceinline__ int query(int row0, int i, int j) const {
        return kKeyRows ? row0 + tx + j * kLanesPerRow : row0 + ty + i * kThreadRows;
    }
    __device__ __forceinline__ int key(int col0, int i, int j) const {
        return kKeyRows ? col0 + ty + i * kThreadRows : col0 + tx + j * kLanesPerRow;
    }
};

template <bool kKeyRows>
__device__ __forceinline__ TilePos<kKeyRows> this_thread() {
    return {static_cast<int>(threadIdx.x % kLanesPerRow), static_cast<int>(threadIdx.x / kLanesPerRow)};
}

// ---------------------------------------------------------------------------------------------
// Forward pieces.
// ---------------------------------------------------------------------------------------------

// Shared-memory layout, tiles back to back; kSmemBytes is mirrored by cuflash/kernels/simt.py.
template <typename Cfg>
struct FwdSmem {
    static constexpr int kPPitch = Cfg::kBlockN + kPad;
    static constexpr unsigned kSmemBytes =
        ((Cfg::kBlockM + 2 * Cfg::kBlockN) * Cfg::kPitch + Cfg::kBlockM * kPPitch) * sizeof(float);
    float* q;  // kBlockM rows
    float* k;  // kBlockN rows
    float* v;  // kBlockN rows
    float* p;  // kBlockM x kBlockN, pitch kPPitch
    __device__ __forceinline__ explicit FwdSmem(float* base)
        : q(base), k(q + Cfg::kBlockM * Cfg::kPitch), v(k + Cfg::kBlockN * Cfg::kPitch),
          p(v + Cfg::kBlockN * Cfg::kPitch) {}
};

// Raw scores -> the score modifier -> -inf where the mask hides the pair (tested only in tiles that
// may hold such a pair; `masked`: the block list's word, see bwd_probs.cuh).
template <typename Cfg, int kI, int kJ>
__device__ __forceinline__ void modify_and_mask(float (&s)[kI][kJ], const typename Cfg::Mask& mask,
                                                const typename Cfg::ScoreMod& score_mod, bool masked,
                                                TilePos<false> at, int row0, int col0) {
#pragma unroll
    for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int j = 0; j < kJ; ++j) s[i][j] = score_mod.apply_one(s[i][j], at.query(row0, i, j), at.key(col0, i, j));
    if (masked && mask.needs_mask(row0, Cfg::kBlockM, col0, Cfg::kBlockN)) {
#pragma unroll
        for (int i = 0; i < kI; ++i)
#pragma unroll
            for (int j = 0; j < kJ; ++j)
                if (!mask.visible(at.query(row0, i, j), at.key(col0, i, j))) s[i][j] = -INFINITY;
    }
}

// The forward's online softmax for a thread's rows, in the scaled log2 domain t = s * scale_log2
// (-inf where the mask hid s): the running row max m of t (-inf while the row has seen nothing) and the
// thread's share l of the running row sum, relative to m. Scaling before the max keeps any sign of scale
// right (a max over raw scores is the min of the scaled ones when scale < 0), and a hidden score stays
// -inf for scale = 0 instead of becoming 0 * -inf = NaN.
template <int kRows>
struct RowSoftmax {
    float m[kRows];
    float l[kRows];

    __device__ __forceinline__ RowSoftmax() {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            m[i] = -INFINITY;
            l[i] = 0.f;
        }
    }

    static __device__ __forceinline__ float scaled(float s, float scale_log2) {
        return s == -INFINITY ? -INFINITY : s * scale_log2;
    }

    // Takes in one key block's scores: writes P to the thread's elements of sP (pitch kPPitch) and sets
    // correction[i], the factor row i's earlier output must be scaled by. Exponents are taken relative
    // to m (0 while the row is still empty, so exp2(-inf - 0) = 0 and no -inf - -inf appears).
    template <int kPPitch, int kCols>
    __device__ __forceinline__ void step(const float (&s)[kRows][kCols], float (&correction)[kRows], float* sP,
                                         float scale_log2, TilePos<false> at) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            float m_new = m[i];
#pragma unroll
            for (int j = 0; j < kCols; ++j) m_new = fmaxf(m_new, scaled(s[i][j], scale_log2));
            m_new = row_max16(m_new);
            const float base = m_new == -INFINITY ? 0.f : m_new;
            // Nothing accumulated yet when m is -inf: the factor multiplies zeros, keep it finite.
            correction[i] = m[i] == -INFINITY ? 0.f : exp2f(m[i] - base);
            m[i] = m_new;
            float row_sum = 0.f;
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                // One rounding (fma) inside the exponent; a hidden score gives exactly 0 for any scale.
                const float p = s[i][j] == -INFINITY ? 0.f : exp2f(fmaf(s[i][j], scale_log2, -base));
                row_sum += p;
                sP[(at.ty + i * kThreadRows) * kPPitch + at.tx + j * kLanesPerRow] = p;
            }
            l[i] = fmaf(l[i], correction[i], row_sum);
        }
    }
};


// One query block (rows row0 ..) over the key blocks `blocks` lists, ascending (index count - 1 - j of the
// last-first lists: the order the plain variants were tuned in; the descending order spilled 4-12 bytes at
// 128 registers): acc_o += P.V (each key block's product summed into a zeroed tile first) with the online
// softmax's rescaling. acc_o and softmax start empty; with no key block they stay so (output 0, lse -inf).
template <typename Cfg, typename Loads, typename Blocks, int kRows>
__device__ __forceinline__ void forward_rows(const AttnParams& params, const SeqInfo& seq, const FwdSmem<Cfg>& sm,
                                             const Loads& loads, const typename Cfg::Mask& mask, const Blocks& blocks,
                                             const typename Cfg::ScoreMod& score_mod, int row0, TilePos<false> at,
                                             float (&acc_o)[kRows][Cfg::Cols::kPerThread],
                                             RowSoftmax<kRows>& softmax) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
    constexpr int kCols = kBlockN / kLanesPerRow;  // keys per thread per block
    static_assert(kRows == kBlockM / kThreadRows, "a thread holds kBlockM / 16 rows");
    using Smem = FwdSmem<Cfg>;
    const float scale_log2 = Cfg::ScoreMod::exp_factor(params);
    const int depth_qk = round_up4(params.head_dim);

    fill_zero(acc_o);
    if (!blocks.empty()) {
        loads.q(sm.q, row0);
        loads.k(sm.k, blocks.block(blocks.count() - 1) * kBlockN);
        sm80::cp_async_commit();
    }
    for (int j = 0; j < blocks.count(); ++j) {
        const int index = blocks.count() - 1 - j;
        const int col0 = blocks.block(index) * kBlockN;
        // K(n) (and Q) landed; every thread finished P.V of the previous block, so sV is free.
        sm80::cp_async_wait<0>();
        __syncthreads();
        loads.v(sm.v, col0);
        sm80::cp_async_commit();

        float s[kRows][kCols];
        tile_dot_abt<kBlockM, kBlockN, Cfg::kPitch>(s, sm.q, sm.k, depth_qk, at.tx, at.ty);
        modify_and_mask<Cfg>(s, mask, score_mod, blocks.masked(index), at, row0, col0);
        float correction[kRows];
        softmax.template step<Smem::kPPitch>(s, correction, sm.p, scale_log2, at);
        if constexpr (Cfg::Dropout::kEnabled) {  // the thread's own P elements: dropout's zeros (l holds them)
            const typename Cfg::Dropout dropout(params, seq.b, seq.h);
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int j = 0; j < kCols; ++j)
                    if (!dropout.keep(at.query(row0, i, j), at.key(col0, i, j)))
                        sm.p[(at.ty + i * kThreadRows) * Smem::kPPitch + at.tx + j * kLanesPerRow] = 0.f;
        }

        // V(n) landed and P is visible; every thread finished reading K(n), so sK is free.
        sm80::cp_async_wait<0>();
        __syncthreads();
        if (index > 0) {
            loads.k(sm.k, blocks.block(index - 1) * kBlockN);
            sm80::cp_async_commit();
        }
        float acc_block[kRows][Cfg::Cols::kPerThread];
        fill_zero(acc_block);
        tile_acc_pb<kBlockM, kBlockN, Smem::kPPitch, Cfg::kHeadDim, Cfg::kPitch>(acc_block, sm.p, sm.v, at.tx, at.ty);
        rescale_add_into(acc_o, correction, acc_block);
    }
}

}  // namespace simt
}  // namespace cuflash
