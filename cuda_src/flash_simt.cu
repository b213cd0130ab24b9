// True-fp32 attention on CUDA cores: float32 inputs, FFMA only, no TF32 anywhere.
//
// Idea: the FlashAttention-2 algorithm (online softmax forward; recompute-from-lse backward with a
// dK/dV kernel over key blocks and a separate dQ kernel over query blocks) with every product an
// fp32 FFMA, so the result stays within ~1e-6 relative of a float64 reference. Speed is secondary
// to exactness here; the tiles are still register-blocked so CUDA cores, not shared memory, bound
// the run time.
//
// Thread layout, shared-tile staging and the FFMA tile products: cuflash/simt_tile.cuh (256 threads as
// a 16 x 16 grid; thread (ty, tx) owns rows ty + 16*i and columns tx + 16*j of a score tile and the
// same rows of an output tile).
//
// Accuracy: every long sum is two-level. A key (or query) block's contribution is summed into a
// zeroed block accumulator and only then added to the running one, so rounding grows like
// sqrt(kBlock) + sqrt(S / kBlock) instead of sqrt(S): at S = 16k (D = 64) the max relative error of
// O, dQ and dK drops from ~5e-6 to <= 1.1e-6 (measured on a float32 numpy port of these loops).
//
// Kernels (all deterministic: no atomics, every sum in a fixed order):
//   flash_fwd_simt_kernel             grid (ceil(Sq/kBlockM), H, B)
//   flash_bwd_preprocess_simt_kernel  grid (ceil(Sq/kPrepRows), H, B): softmax_d = rowsum(dO*O) - dlse
//   flash_bwd_dkdv_simt_kernel        grid (ceil(Sk/kBlockN), H, B): one block per QUERY head
//   flash_bwd_reduce_dkdv_simt_kernel grid (ceil(Sk/kReduceRows), Hkv, B): GQA group sums
//   flash_bwd_dq_simt_kernel          grid (ceil(Sq/kBlockM), H, B)
// The host-side plan (cuflash/kernels/simt.py) mirrors every kSmemBytes formula below.

#include "cuflash/params.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/simt_tile.cuh"

namespace cuflash {
namespace simt {

// Two resident blocks per SM: caps registers at 128 (2 x 256 threads fill the 64K register file).
// Without the hint ptxas (CUDA 13, sm_90a) squeezed some variants to 80 registers and spilled.
constexpr int kMinBlocksPerSm = 2;
constexpr int kPrepRows = 32;    // query rows per pre-pass block
constexpr int kReduceRows = 16;  // key rows per GQA reduce block

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

// Shared-memory layouts; kSmemBytes is mirrored by cuflash/kernels/simt.py.
template <int kHeadDim, int kBlockM, int kBlockN>
struct FwdSmem {
    static constexpr int kPitch = kHeadDim + kPad;
    static constexpr int kPPitch = kBlockN + kPad;
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kBlockM * kPitch;
    static constexpr int kV = kK + kBlockN * kPitch;
    static constexpr int kP = kV + kBlockN * kPitch;
    static constexpr int kFloats = kP + kBlockM * kPPitch;
    static constexpr unsigned kSmemBytes = kFloats * sizeof(float);
};

template <int kHeadDim, int kBlockM, int kBlockN>
struct DkDvSmem {
    static constexpr int kPitch = kHeadDim + kPad;
    static constexpr int kPPitch = kBlockM + kPad;  // P^T and dS^T tiles: kBlockN rows of kBlockM
    static constexpr int kK = 0;
    static constexpr int kV = kK + kBlockN * kPitch;
    static constexpr int kQ = kV + kBlockN * kPitch;
    static constexpr int kDO = kQ + kBlockM * kPitch;
    static constexpr int kPt = kDO + kBlockM * kPitch;
    static constexpr int kDSt = kPt + kBlockN * kPPitch;
    static constexpr int kFloats = kDSt + kBlockN * kPPitch;
    static constexpr unsigned kSmemBytes = kFloats * sizeof(float);
};

template <int kHeadDim, int kBlockM, int kBlockN>
struct DqSmem {
    static constexpr int kPitch = kHeadDim + kPad;
    static constexpr int kPPitch = kBlockN + kPad;
    static constexpr int kQ = 0;
    static constexpr int kDO = kQ + kBlockM * kPitch;
    static constexpr int kK = kDO + kBlockM * kPitch;
    static constexpr int kV = kK + kBlockN * kPitch;
    static constexpr int kDS = kV + kBlockN * kPitch;
    static constexpr int kFloats = kDS + kBlockM * kPPitch;
    static constexpr unsigned kSmemBytes = kFloats * sizeof(float);
};

}  // namespace simt

// ---------------------------------------------------------------------------------------------
// Forward: O = softmax(scale * Q K^T) V with an online softmax over key blocks; lse per row.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockM, int kBlockN, bool kIsCausal>
__global__ void __launch_bounds__(simt::kThreads, simt::kMinBlocksPerSm) flash_fwd_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Smem = FwdSmem<kHeadDim, kBlockM, kBlockN>;
    using Cols = OutCols<kHeadDim>;
    constexpr int kRows = kBlockM / kThreadRows;     // query rows per thread
    constexpr int kCols = kBlockN / kLanesPerRow;    // keys per thread per block
    static_assert(kBlockM % kThreadRows == 0 && kBlockN % kLanesPerRow == 0, "tiles are 16 x 16 thread grids");

    float* smem = shared_floats<Smem::kSmemBytes>();
    float* sQ = smem + Smem::kQ;
    float* sK = smem + Smem::kK;
    float* sV = smem + Smem::kV;
    float* sP = smem + Smem::kP;

    // Causal: the last query blocks see the most keys; start them first.
    const int m_block = kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int h_kv = h / params.h_per_kv;
    const int tx = threadIdx.x % kLanesPerRow, ty = threadIdx.x / kLanesPerRow;
    const int row0 = m_block * kBlockM;
    const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k;
    const AttnMask<kIsCausal> mask{seqlen_q, seqlen_k, params.causal_offset};

    const float* q_tile = static_cast<const float*>(params.q) + b * params.q_batch_stride +
                          row0 * params.q_row_stride + h * params.q_head_stride;
    const float* k_head = static_cast<const float*>(params.k) + b * params.k_batch_stride + h_kv * params.k_head_stride;
    const float* v_head = static_cast<const float*>(params.v) + b * params.v_batch_stride + h_kv * params.v_head_stride;
    const int depth_qk = round_up4(params.head_dim);

    float acc_o[kRows][Cols::kPerThread];
    float m_i[kRows];  // running row max of the raw scores (-inf while the row has seen nothing)
    float l_i[kRows];  // this thread's share of the running row sum, relative to m_i
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        m_i[i] = -INFINITY;
        l_i[i] = 0.f;
#pragma unroll
        for (int c = 0; c < Cols::kPerThread; ++c) acc_o[i][c] = 0.f;
    }

    int n_begin, n_end;
    mask.template key_block_range<kBlockM, kBlockN>(m_block, n_begin, n_end);
    if (n_begin < n_end) {
        load_tile<kBlockM, kHeadDim, Smem::kPitch>(sQ, q_tile, params.q_row_stride, seqlen_q - row0, params.head_dim);
        load_tile<kBlockN, kHeadDim, Smem::kPitch>(sK, k_head + (long long)n_begin * kBlockN * params.k_row_stride,
                                                   params.k_row_stride, seqlen_k - n_begin * kBlockN, params.head_dim);
        sm80::cp_async_commit();
    }
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int col0 = n_block * kBlockN;
        // K(n) (and Q) landed; every thread finished P.V of the previous block, so sV is free.
        sm80::cp_async_wait<0>();
        __syncthreads();
        load_tile<kBlockN, kHeadDim, Smem::kPitch>(sV, v_head + (long long)col0 * params.v_row_stride,
                                                   params.v_row_stride, seqlen_k - col0, params.head_dim_v);
        sm80::cp_async_commit();

        float s[kRows][kCols];
        tile_dot_abt<kBlockM, kBlockN, Smem::kPitch>(s, sQ, sK, depth_qk, tx, ty);
        if (mask.needs_mask(row0, kBlockM, col0, kBlockN)) {
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int j = 0; j < kCols; ++j)
                    if (!mask.visible(row0 + ty + i * kThreadRows, col0 + tx + j * kLanesPerRow)) s[i][j] = -INFINITY;
        }

        float row_correction[kRows];
        // Online softmax. Exponents are taken relative to m_scaled = m * scale_log2 (0 while the row
        // is still empty, so exp2(-inf - 0) = 0 and no -inf - -inf appears).
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            float m_new = m_i[i];
#pragma unroll
            for (int j = 0; j < kCols; ++j) m_new = fmaxf(m_new, s[i][j]);
            m_new = row_max16(m_new);
            const float m_scaled_new = m_new == -INFINITY ? 0.f : m_new * params.scale_log2;
            const float m_scaled_old = m_i[i] == -INFINITY ? 0.f : m_i[i] * params.scale_log2;
            // Nothing accumulated yet when m_i is -inf: the factor multiplies zeros, keep it finite.
            const float correction = m_i[i] == -INFINITY ? 0.f : exp2f(m_scaled_old - m_scaled_new);
            m_i[i] = m_new;
            float row_sum = 0.f;
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                const float p = exp2f(fmaf(s[i][j], params.scale_log2, -m_scaled_new));
                row_sum += p;
                sP[(ty + i * kThreadRows) * Smem::kPPitch + tx + j * kLanesPerRow] = p;
            }
            l_i[i] = fmaf(l_i[i], correction, row_sum);
            row_correction[i] = correction;
        }

        // V(n) landed and P is visible; every thread finished reading K(n), so sK is free.
        sm80::cp_async_wait<0>();
        __syncthreads();
        if (n_block + 1 < n_end) {
            load_tile<kBlockN, kHeadDim, Smem::kPitch>(sK, k_head + (long long)(col0 + kBlockN) * params.k_row_stride,
                                                       params.k_row_stride, seqlen_k - col0 - kBlockN, params.head_dim);
            sm80::cp_async_commit();
        }
        float acc_block[kRows][Cols::kPerThread];
        fill_zero(acc_block);
        tile_acc_pb<kBlockM, kBlockN, Smem::kPPitch, kHeadDim, Smem::kPitch>(acc_block, sP, sV, tx, ty);
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int c = 0; c < Cols::kPerThread; ++c) acc_o[i][c] = fmaf(acc_o[i][c], row_correction[i], acc_block[i][c]);
    }

    // Epilogue: O = acc_o / l, lse = m * scale + log(l); a row that saw nothing gets 0 and -inf.
    float* lse_row = params.lse + b * params.lse_batch_stride + h * params.lse_head_stride;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const float l = row_sum16(l_i[i]);
        const int row = row0 + ty + i * kThreadRows;
        if (row >= seqlen_q) continue;
        const bool empty = !(l > 0.f);
        float* o_row = static_cast<float*>(params.o) + b * params.o_batch_stride + row * params.o_row_stride +
                       h * params.o_head_stride;
#pragma unroll
        for (int c = 0; c < Cols::kChunks; ++c) {
            float vals[Cols::kVec];
#pragma unroll
            for (int e = 0; e < Cols::kVec; ++e) vals[e] = empty ? 0.f : acc_o[i][c * Cols::kVec + e] / l;
            store_chunk<Cols::kVec>(o_row, Cols::col(tx, c), vals, params.head_dim_v);
        }
        if (tx == 0) lse_row[row] = empty ? -INFINITY : m_i[i] * params.scale + logf(l);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward pre-pass: softmax_d[b, h, i] = sum_d dO[i, d] * O[i, d] - dlse[i]. One warp per row.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim>
__global__ void __launch_bounds__(simt::kThreads, simt::kMinBlocksPerSm) flash_bwd_preprocess_simt_kernel(const AttnParams params) {
    using namespace simt;
    constexpr int kWarps = kThreads / 32;
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seqlen_q = params.seqlen_q;
    for (int r = warp; r < kPrepRows; r += kWarps) {
        const int row = blockIdx.x * kPrepRows + r;
        if (row >= seqlen_q) break;  // uniform across the warp
        const float* o_row = static_cast<const float*>(params.o) + b * params.o_batch_stride +
                             row * params.o_row_stride + h * params.o_head_stride;
        const float* do_row = static_cast<const float*>(params.dout) + b * params.do_batch_stride +
                              row * params.do_row_stride + h * params.do_head_stride;
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < kHeadDim / 32; ++c) {
            const int col = c * 32 + lane;
            if (col < params.head_dim_v) acc = fmaf(do_row[col], o_row[col], acc);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        if (lane == 0) {
            const float dlse = params.dlse == nullptr
                                   ? 0.f
                                   : params.dlse[b * params.dlse_batch_stride + h * params.dlse_head_stride + row];
            params.softmax_d[((long long)b * params.num_heads + h) * seqlen_q + row] = acc - dlse;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward dK/dV: one block per (key block, QUERY head). K_j, V_j stay in smem; for each query block
// that sees them: S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D),
// dV += P^T dO, dK += dS^T Q. Scores are held transposed (thread rows = keys) so the rows of P^T /
// dS^T a warp writes are exactly the dK / dV rows it accumulates.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockM, int kBlockN, bool kIsCausal>
__global__ void __launch_bounds__(simt::kThreads, simt::kMinBlocksPerSm) flash_bwd_dkdv_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Smem = DkDvSmem<kHeadDim, kBlockM, kBlockN>;
    using Cols = OutCols<kHeadDim>;
    constexpr int kRows = kBlockN / kThreadRows;   // keys per thread
    constexpr int kCols = kBlockM / kLanesPerRow;  // queries per thread per block
    static_assert(kBlockM % kLanesPerRow == 0 && kBlockN % kThreadRows == 0, "tiles are 16 x 16 thread grids");

    float* smem = shared_floats<Smem::kSmemBytes>();
    float* sK = smem + Smem::kK;
    float* sV = smem + Smem::kV;
    float* sQ = smem + Smem::kQ;
    float* sdO = smem + Smem::kDO;
    float* sPt = smem + Smem::kPt;
    float* sdSt = smem + Smem::kDSt;

    const int n_block = blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int h_kv = h / params.h_per_kv;
    const int tx = threadIdx.x % kLanesPerRow, ty = threadIdx.x / kLanesPerRow;
    const int col0 = n_block * kBlockN;
    const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k;
    const AttnMask<kIsCausal> mask{seqlen_q, seqlen_k, params.causal_offset};
    const float scale = params.scale;

    const float* q_head = static_cast<const float*>(params.q) + b * params.q_batch_stride + h * params.q_head_stride;
    const float* do_head = static_cast<const float*>(params.dout) + b * params.do_batch_stride + h * params.do_head_stride;
    const float* lse_row = params.lse + b * params.lse_batch_stride + h * params.lse_head_stride;
    const float* d_row = params.softmax_d + ((long long)b * params.num_heads + h) * seqlen_q;
    const int depth_qk = round_up4(params.head_dim);
    const int depth_v = round_up4(params.head_dim_v);

    float acc_dk[kRows][Cols::kPerThread];
    float acc_dv[kRows][Cols::kPerThread];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int c = 0; c < Cols::kPerThread; ++c) acc_dk[i][c] = acc_dv[i][c] = 0.f;

    int m_begin, m_end;
    mask.template query_block_range<kBlockM, kBlockN>(n_block, m_begin, m_end);
    if (m_begin < m_end) {
        load_tile<kBlockN, kHeadDim, Smem::kPitch>(
            sK,
            static_cast<const float*>(params.k) + b * params.k_batch_stride + (long long)col0 * params.k_row_stride +
                h_kv * params.k_head_stride,
            params.k_row_stride, seqlen_k - col0, params.head_dim);
        load_tile<kBlockN, kHeadDim, Smem::kPitch>(
            sV,
            static_cast<const float*>(params.v) + b * params.v_batch_stride + (long long)col0 * params.v_row_stride +
                h_kv * params.v_head_stride,
            params.v_row_stride, seqlen_k - col0, params.head_dim_v);
        sm80::cp_async_commit();
    }
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
        const int row0 = m_block * kBlockM;
        // Every thread finished reading sQ / sdO (and its warp's sPt / sdSt rows) of the last block.
        __syncthreads();
        load_tile<kBlockM, kHeadDim, Smem::kPitch>(sQ, q_head + (long long)row0 * params.q_row_stride,
                                                   params.q_row_stride, seqlen_q - row0, params.head_dim);
        sm80::cp_async_commit();
        load_tile<kBlockM, kHeadDim, Smem::kPitch>(sdO, do_head + (long long)row0 * params.do_row_stride,
                                                   params.do_row_stride, seqlen_q - row0, params.head_dim_v);
        sm80::cp_async_commit();
        float lse[kCols], delta[kCols];
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
            const int row = row0 + tx + j * kLanesPerRow;
            lse[j] = lse_for_backward(lse_row, row, seqlen_q);
            delta[j] = row < seqlen_q ? d_row[row] : 0.f;
        }

        sm80::cp_async_wait<1>();  // K, V and Q landed (dO may be in flight)
        __syncthreads();
        float p[kRows][kCols];
        tile_dot_abt<kBlockN, kBlockM, Smem::kPitch>(p, sK, sQ, depth_qk, tx, ty);
        const bool needs_mask = mask.needs_mask(row0, kBlockM, col0, kBlockN);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                const bool visible =
                    !needs_mask || mask.visible(row0 + tx + j * kLanesPerRow, col0 + ty + i * kThreadRows);
                p[i][j] = visible ? recompute_p(p[i][j], scale, lse[j]) : 0.f;
            }
        }

        sm80::cp_async_wait<0>();  // dO landed
        __syncthreads();
        float dp[kRows][kCols];
        tile_dot_abt<kBlockN, kBlockM, Smem::kPitch>(dp, sV, sdO, depth_v, tx, ty);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                const int idx = (ty + i * kThreadRows) * Smem::kPPitch + tx + j * kLanesPerRow;
                sPt[idx] = p[i][j];
                sdSt[idx] = p[i][j] * (dp[i][j] - delta[j]);
            }
        }
        __syncwarp();  // the rows just written are read back only by this warp
        float acc_block[kRows][Cols::kPerThread];
        fill_zero(acc_block);
        tile_acc_pb<kBlockN, kBlockM, Smem::kPPitch, kHeadDim, Smem::kPitch>(acc_block, sPt, sdO, tx, ty);
        add_into(acc_dv, acc_block);
        fill_zero(acc_block);
        tile_acc_pb<kBlockN, kBlockM, Smem::kPPitch, kHeadDim, Smem::kPitch>(acc_block, sdSt, sQ, tx, ty);
        add_into(acc_dk, acc_block);
    }

    // Epilogue: dK = scale * sum dS^T Q, dV = sum P^T dO. Without GQA straight into dk / dv;
    // with GQA into this query head's fp32 partial (all kHeadDim columns; those past D / Dv are 0),
    // summed over the group by flash_bwd_reduce_dkdv_simt_kernel.
    const bool to_partials = params.dk_accum != nullptr;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int key = col0 + ty + i * kThreadRows;
        if (key >= seqlen_k) continue;
        float* dk_row;
        float* dv_row;
        int dk_cols, dv_cols;
        if (to_partials) {
            const long long offset = (((long long)b * params.num_heads + h) * seqlen_k + key) * kHeadDim;
            dk_row = params.dk_accum + offset;
            dv_row = params.dv_accum + offset;
            dk_cols = dv_cols = kHeadDim;
        } else {
            dk_row = static_cast<float*>(params.dk) + b * params.dk_batch_stride + key * params.dk_row_stride +
                     h_kv * params.dk_head_stride;
            dv_row = static_cast<float*>(params.dv) + b * params.dv_batch_stride + key * params.dv_row_stride +
                     h_kv * params.dv_head_stride;
            dk_cols = params.head_dim;
            dv_cols = params.head_dim_v;
        }
#pragma unroll
        for (int c = 0; c < Cols::kChunks; ++c) {
            float dk_vals[Cols::kVec], dv_vals[Cols::kVec];
#pragma unroll
            for (int e = 0; e < Cols::kVec; ++e) {
                dk_vals[e] = scale * acc_dk[i][c * Cols::kVec + e];
                dv_vals[e] = acc_dv[i][c * Cols::kVec + e];
            }
            store_chunk<Cols::kVec>(dk_row, Cols::col(tx, c), dk_vals, dk_cols);
            store_chunk<Cols::kVec>(dv_row, Cols::col(tx, c), dv_vals, dv_cols);
        }
    }
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
    const int seqlen_k = params.seqlen_k;
    for (int chunk = threadIdx.x; chunk < kReduceRows * kChunksPerRow; chunk += kThreads) {
        const int key = blockIdx.x * kReduceRows + chunk / kChunksPerRow;
        const int col = (chunk % kChunksPerRow) * 4;
        if (key >= seqlen_k) continue;
        float dk_sum[4] = {0.f, 0.f, 0.f, 0.f};
        float dv_sum[4] = {0.f, 0.f, 0.f, 0.f};
        for (int g = 0; g < params.h_per_kv; ++g) {
            const int h = h_kv * params.h_per_kv + g;
            const long long offset = (((long long)b * params.num_heads + h) * seqlen_k + key) * kHeadDim + col;
            // Partials are contiguous with 16-byte rows (kHeadDim % 4 == 0): aligned float4 reads.
            const float4 dk4 = *reinterpret_cast<const float4*>(params.dk_accum + offset);
            const float4 dv4 = *reinterpret_cast<const float4*>(params.dv_accum + offset);
            dk_sum[0] += dk4.x; dk_sum[1] += dk4.y; dk_sum[2] += dk4.z; dk_sum[3] += dk4.w;
            dv_sum[0] += dv4.x; dv_sum[1] += dv4.y; dv_sum[2] += dv4.z; dv_sum[3] += dv4.w;
        }
        float* dk_row = static_cast<float*>(params.dk) + b * params.dk_batch_stride + key * params.dk_row_stride +
                        h_kv * params.dk_head_stride;
        float* dv_row = static_cast<float*>(params.dv) + b * params.dv_batch_stride + key * params.dv_row_stride +
                        h_kv * params.dv_head_stride;
        store_chunk<4>(dk_row, col, dk_sum, params.head_dim);
        store_chunk<4>(dv_row, col, dv_sum, params.head_dim_v);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward dQ: one block per (query block, query head). Q_i, dO_i stay in smem; for each visible key
// block: S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = P (dP - D), dQ += dS K. Each block owns
// its dQ rows outright, so there are no atomics; dq = scale * dQ.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockM, int kBlockN, bool kIsCausal>
__global__ void __launch_bounds__(simt::kThreads, simt::kMinBlocksPerSm) flash_bwd_dq_simt_kernel(const AttnParams params) {
    using namespace simt;
    using Smem = DqSmem<kHeadDim, kBlockM, kBlockN>;
    using Cols = OutCols<kHeadDim>;
    constexpr int kRows = kBlockM / kThreadRows;   // query rows per thread
    constexpr int kCols = kBlockN / kLanesPerRow;  // keys per thread per block
    static_assert(kBlockM % kThreadRows == 0 && kBlockN % kLanesPerRow == 0, "tiles are 16 x 16 thread grids");

    float* smem = shared_floats<Smem::kSmemBytes>();
    float* sQ = smem + Smem::kQ;
    float* sdO = smem + Smem::kDO;
    float* sK = smem + Smem::kK;
    float* sV = smem + Smem::kV;
    float* sdS = smem + Smem::kDS;

    const int m_block = kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int h_kv = h / params.h_per_kv;
    const int tx = threadIdx.x % kLanesPerRow, ty = threadIdx.x / kLanesPerRow;
    const int row0 = m_block * kBlockM;
    const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k;
    const AttnMask<kIsCausal> mask{seqlen_q, seqlen_k, params.causal_offset};
    const float scale = params.scale;

    const float* k_head = static_cast<const float*>(params.k) + b * params.k_batch_stride + h_kv * params.k_head_stride;
    const float* v_head = static_cast<const float*>(params.v) + b * params.v_batch_stride + h_kv * params.v_head_stride;
    const float* lse_row = params.lse + b * params.lse_batch_stride + h * params.lse_head_stride;
    const float* d_row = params.softmax_d + ((long long)b * params.num_heads + h) * seqlen_q;
    const int depth_qk = round_up4(params.head_dim);
    const int depth_v = round_up4(params.head_dim_v);

    float lse[kRows], delta[kRows];
    float acc_dq[kRows][Cols::kPerThread];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int row = row0 + ty + i * kThreadRows;
        lse[i] = lse_for_backward(lse_row, row, seqlen_q);
        delta[i] = row < seqlen_q ? d_row[row] : 0.f;
#pragma unroll
        for (int c = 0; c < Cols::kPerThread; ++c) acc_dq[i][c] = 0.f;
    }

    int n_begin, n_end;
    mask.template key_block_range<kBlockM, kBlockN>(m_block, n_begin, n_end);
    if (n_begin < n_end) {
        load_tile<kBlockM, kHeadDim, Smem::kPitch>(
            sQ,
            static_cast<const float*>(params.q) + b * params.q_batch_stride + (long long)row0 * params.q_row_stride +
                h * params.q_head_stride,
            params.q_row_stride, seqlen_q - row0, params.head_dim);
        load_tile<kBlockM, kHeadDim, Smem::kPitch>(
            sdO,
            static_cast<const float*>(params.dout) + b * params.do_batch_stride + (long long)row0 * params.do_row_stride +
                h * params.do_head_stride,
            params.do_row_stride, seqlen_q - row0, params.head_dim_v);
        sm80::cp_async_commit();
    }
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int col0 = n_block * kBlockN;
        // Every thread finished reading sK / sV (and its warp's sdS rows) of the last block.
        __syncthreads();
        load_tile<kBlockN, kHeadDim, Smem::kPitch>(sK, k_head + (long long)col0 * params.k_row_stride,
                                                   params.k_row_stride, seqlen_k - col0, params.head_dim);
        sm80::cp_async_commit();
        load_tile<kBlockN, kHeadDim, Smem::kPitch>(sV, v_head + (long long)col0 * params.v_row_stride,
                                                   params.v_row_stride, seqlen_k - col0, params.head_dim_v);
        sm80::cp_async_commit();

        sm80::cp_async_wait<1>();  // Q, dO and K landed (V may be in flight)
        __syncthreads();
        float p[kRows][kCols];
        tile_dot_abt<kBlockM, kBlockN, Smem::kPitch>(p, sQ, sK, depth_qk, tx, ty);
        const bool needs_mask = mask.needs_mask(row0, kBlockM, col0, kBlockN);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                const bool visible =
                    !needs_mask || mask.visible(row0 + ty + i * kThreadRows, col0 + tx + j * kLanesPerRow);
                p[i][j] = visible ? recompute_p(p[i][j], scale, lse[i]) : 0.f;
            }
        }

        sm80::cp_async_wait<0>();  // V landed
        __syncthreads();
        float dp[kRows][kCols];
        tile_dot_abt<kBlockM, kBlockN, Smem::kPitch>(dp, sdO, sV, depth_v, tx, ty);
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int j = 0; j < kCols; ++j)
                sdS[(ty + i * kThreadRows) * Smem::kPPitch + tx + j * kLanesPerRow] = p[i][j] * (dp[i][j] - delta[i]);
        __syncwarp();  // the rows just written are read back only by this warp
        float acc_block[kRows][Cols::kPerThread];
        fill_zero(acc_block);
        tile_acc_pb<kBlockM, kBlockN, Smem::kPPitch, kHeadDim, Smem::kPitch>(acc_block, sdS, sK, tx, ty);
        add_into(acc_dq, acc_block);
    }

    // Epilogue: dq = scale * dQ for rows < Sq, columns < D (rows that see no key get 0).
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int row = row0 + ty + i * kThreadRows;
        if (row >= seqlen_q) continue;
        float* dq_row = static_cast<float*>(params.dq) + b * params.dq_batch_stride + row * params.dq_row_stride +
                        h * params.dq_head_stride;
#pragma unroll
        for (int c = 0; c < Cols::kChunks; ++c) {
            float vals[Cols::kVec];
#pragma unroll
            for (int e = 0; e < Cols::kVec; ++e) vals[e] = scale * acc_dq[i][c * Cols::kVec + e];
            store_chunk<Cols::kVec>(dq_row, Cols::col(tx, c), vals, params.head_dim);
        }
    }
}

}  // namespace cuflash
