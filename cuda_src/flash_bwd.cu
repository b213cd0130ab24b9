// Tensor-core backward of attention (FlashAttention-2 algorithm), fp16 / bf16, sm_80 and later.
//
// With S = Q.K^T (raw scores), P = exp(scale*S - lse) and D_i = sum_d dO_id*O_id - dlse_i:
//   dV = P^T.dO     dP = dO.V^T     dS = P o (dP - D)     dK = scale * dS^T.Q     dQ = scale * dS.K
// (the -dlse folded into D is the gradient that reaches S through lse: d lse_i / d s_ij = P_ij).
//
// Kernels, in launch order (cuflash/kernels/backward.py plans them):
//   flash_bwd_preprocess_kernel   softmax_d = rowsum(dO o O) - dlse; lse_log2 = lse_log2_offset(lse) for the
//                                 dK/dV kernels; zeroes dq_accum on the atomic path.
//   flash_bwd_dkdv_kernel         one block per (key block, dkdv_heads query heads of a kv head, batch):
//                                 K_j, V_j stay in shared memory and dK_j, dV_j in registers while the
//                                 block walks every query block that sees them, for each of its heads
//                                 (the plan picks dkdv_heads so that MQA still fills the GPU). With
//                                 kAtomicDq it also adds dS.K to dq_accum.
//   flash_bwd_dq_kernel           dQ without atomics: one block per query block, walks its key blocks
//                                 (the deterministic backward; on sm_90a at D256 the default one too,
//                                 whose dK/dV kernel then has no dQ step: backward.split_dq).
//   flash_bwd_convert_dq_kernel   dq = scale * dq_accum (atomic path; kSwizzledDq after the warp-specialized
//                                 dK/dV kernel, whose staged adds permute each row: dq_accum_chunk).
//   flash_bwd_reduce_dkdv_kernel  GQA, when a block holds less than a whole group: sums a group's dK/dV
//                                 partials in a fixed order.
//
// The kernels are glue: block index -> sequence info (cuflash/seqlen.cuh) -> the blocks to visit
// (cuflash/block.cuh, from the mask policy in cuflash/mask.cuh) -> mainloop -> epilogue
// (cuflash/epilogue_bwd.cuh). The dK/dV mainloop is DkdvMainloopSm80 (mma.sync,
// cuflash/dkdv_mainloop_sm80.cuh) or, on sm_90a for head dims 64 / 128 / 256, DkdvMainloopSm90 (wgmma,
// cuflash/dkdv_mainloop_sm90.cuh), both running the step loop and load side of cuflash/dkdv_mainloop.cuh,
// or DkdvMainloopSm90Ws (the same wgmma math behind a producer warpgroup, cuflash/dkdv_mainloop_sm90_ws.cuh),
// chosen by kMainloop; all share the P recomputation / dS of cuflash/bwd_probs.cuh. The dQ
// mainloop is cuflash/dq_mainloop_sm80.cuh (mma.sync) or cuflash/dq_mainloop_sm90.cuh (wgmma), chosen by the dQ
// kernel's kMainloop. Configs and shared-memory layouts: cuflash/bwd_config.cuh.
//
// Numerics: fp32 accumulation everywhere; the exp is one FFMA + ex2. A row with lse = -inf (it sees no
// key) gets P = 0 exactly. Rows / columns past Sq, Sk, D, Dv are zero-filled on load, masked before the
// exp, and never stored, so no NaN or garbage reaches a gradient. Global tensors need 16-byte aligned rows
// (base and strides multiples of 8 elements), as for the forward.

#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/block.cuh"
#include "cuflash/bwd_config.cuh"
#include "cuflash/dkdv_mainloop_sm80.cuh"
#include "cuflash/dkdv_mainloop_sm90.cuh"
#include "cuflash/dkdv_mainloop_sm90_ws.cuh"
#include "cuflash/dq_mainloop_sm80.cuh"
#include "cuflash/dq_mainloop_sm90.cuh"
#include "cuflash/epilogue_bwd.cuh"

namespace cuflash {

extern __shared__ __align__(1024) unsigned char bwd_smem[];

// The dK/dV kernel's mainloop (its last template argument; cuflash/kernels/backward.py: MAINLOOP_*).
// kDkdvMainloopSm90WsOrdered: the warp-specialized one under a general mask whose dQ adds may also be ordered
// (the deterministic backward's; DkdvMainloopSm90Ws's kGeneralOrdered). The default general-mask kernels leave
// that code out: beside it ptxas 13.0 spilled their producer's 24 registers 240 bytes more.
enum DkdvMainloopKind { kDkdvMainloopSm80 = 0, kDkdvMainloopSm90 = 1, kDkdvMainloopSm90Ws = 2, kDkdvMainloopSm90WsOrdered = 3 };
__host__ __device__ constexpr bool is_ws_mainloop(int kind) { return kind == kDkdvMainloopSm90Ws || kind == kDkdvMainloopSm90WsOrdered; }
// The dQ kernel's (its last template argument; cuflash/kernels/backward.py: DQ_MAINLOOP_*).
enum DqMainloopKind { kDqMainloopSm80 = 0, kDqMainloopSm90 = 1 };

// ---------------------------------------------------------------------------------------------------
// Pre-pass: softmax_d[b, h, i] = sum_{d < Dv} dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i] (fp32), and
// dq_accum[b, h, i, :] = 0 when the atomic path is planned (scratch arrives uninitialized), also past the
// sequence up to a whole kDqAccumBlockRows block.
// Grid (ceil(Sq / kBlockM), H, B); 8 consecutive lanes per row, each summing 16-byte chunks c, c+8, ...
template <typename Elem, int kHeadDim, int kBlockM, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_preprocess_kernel(const AttnParams params) {
    constexpr int kThreads = kNWarps * 32;
    constexpr int kThreadsPerRow = 8;
    constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
    constexpr int kChunks = kHeadDim / 8;
    static_assert(kBlockM % kRowsPerPass == 0 && kHeadDim % 32 == 0, "bad pre-pass tiling");

    const SeqInfo seq(params, blockIdx.z, blockIdx.y);
    const int sub = threadIdx.x % kThreadsPerRow;
    const Elem* o_ptr = seq.o<Elem>(params);
    const Elem* do_ptr = seq.dout<Elem>(params);
#pragma unroll
    for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
        const int row = blockIdx.x * kBlockM + pass * kRowsPerPass + threadIdx.x / kThreadsPerRow;
        const bool row_ok = row < seq.seqlen_q;
        float sum = 0.f;
        if (row_ok) {
#pragma unroll
            for (int c = sub; c < kChunks; c += kThreadsPerRow) {
                if (c * 8 < params.head_dim_v) {
                    const uint4 o4 = *reinterpret_cast<const uint4*>(o_ptr + row * params.o_row_stride + c * 8);
                    const uint4 d4 = *reinterpret_cast<const uint4*>(do_ptr + row * params.do_row_stride + c * 8);
                    const Elem* oe = reinterpret_cast<const Elem*>(&o4);
                    const Elem* de = reinterpret_cast<const Elem*>(&d4);
#pragma unroll
                    for (int e = 0; e < 8; ++e) sum += ElemTraits<Elem>::to_float(oe[e]) * ElemTraits<Elem>::to_float(de[e]);
                }
            }
        }
        // The 8 threads of a row are consecutive lanes of one warp; every lane takes part.
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (row_ok && sub == 0) {
            *seq.softmax_d(params, row) = sum - (params.dlse != nullptr ? *seq.dlse(params, row) : 0.f);
            *seq.lse_log2(params, row) = lse_log2_offset(*seq.lse_in(params, row));  // every plan sets lse_log2
        }
    }
    // dq_accum: this block's rows, and the sequence's last block also the rows up to the next multiple of
    // kDqAccumBlockRows. The wgmma dK/dV kernel adds whole query blocks (up to that many rows) with no
    // bounds test (WgmmaDqStep::add): rows past the sequence belong to the next head or sequence, which
    // zeroes them too, or to the buffer's slack (backward.dq_accum_shape), and every add reads zeros.
    // Not where the first add into each block stores instead (dq_order::first_store).
    const int row0 = blockIdx.x * kBlockM;
    if (params.dq_accum != nullptr && row0 < seq.seqlen_q && !dq_order::first_store(params)) {
        const int end = row0 + kBlockM >= seq.seqlen_q
                            ? (seq.seqlen_q + kDqAccumBlockRows - 1) / kDqAccumBlockRows * kDqAccumBlockRows
                            : row0 + kBlockM;
        for (int row = row0 + static_cast<int>(threadIdx.x) / kThreadsPerRow; row < end; row += kRowsPerPass) {
            float4* dst = reinterpret_cast<float4*>(seq.dq_accum(params, row, kHeadDim));
#pragma unroll
            for (int c = sub; c < kHeadDim / 4; c += kThreadsPerRow) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    // The dQ adds' counters of this (batch, head), when the plan asks for them (dq_order.cuh).
    if (params.dq_order_offset != 0 && blockIdx.x == 0) {
        int* counters = dq_order::counters(params, blockIdx.z, blockIdx.y);
        for (int i = threadIdx.x; i < params.dq_order_blocks; i += kThreads) counters[i] = 0;
    }
}

// ---------------------------------------------------------------------------------------------------
// dK, dV (and, with kAtomicDq, dQ += dS.K into dq_accum) for key block blockIdx.x of the query-head group
// blockIdx.y of batch blockIdx.z. kMask: a MaskKind (mask.cuh); kScoreMod: a ScoreModKind, the softcap / ALiBi (/ bias) modifier
// (score_mod.cuh). kMainloop: a DkdvMainloopKind (the wgmma ones sm_90a only); the warp-specialized one runs
// 384 threads, a producer warpgroup and the kNWarps math warps.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kMask, int kScoreMod, bool kAtomicDq,
          int kMainloop>
__global__ void __launch_bounds__(is_ws_mainloop(kMainloop) ? 384 : kNWarps * 32, 1)
flash_bwd_dkdv_kernel(const AttnParams params, const __grid_constant__ TmaParams tma) {  // tma: cuflash/tma_sm90.cuh
    // The warp-specialized mainloop's atomic path stages a bias in its dS tiles (DkdvConfig's kBiasInDs).
    using Cfg = DkdvConfig<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kMask, kScoreMod, kAtomicDq,
                           is_ws_mainloop(kMainloop) && has_bias(kScoreMod) && kAtomicDq>;
    using Mainloop = conditional_t<is_ws_mainloop(kMainloop),
                                   DkdvMainloopSm90Ws<Cfg, kMainloop == kDkdvMainloopSm90WsOrdered>,
                                   conditional_t<kMainloop == kDkdvMainloopSm90, DkdvMainloopSm90<Cfg>,
                                                 DkdvMainloopSm80<Cfg>>>;
    CUFLASH_CHECK_SMEM_BYTES(Mainloop::kSmemBytes);
    const unsigned smem = sm80::smem_addr(bwd_smem);
    Mainloop::check_smem(smem);

    // Query heads group*heads .. +heads (params.dkdv_heads of one kv head's group; the plan picks it).
    int n_block = blockIdx.x, group = blockIdx.y, b = blockIdx.z;
    const int heads = params.dkdv_heads;
    // The other mainloops keep the grid's order: the remap's registers spilled some mma.sync variants at 255,
    // nvcc 13.0.
    if constexpr (Mainloop::kWarpSpecialized) Mainloop::grid_position(params, heads, n_block, group, b);
    const SeqInfo seq(params, b, group * heads, LayoutOf<kMask>());
    if (n_block * kBlockN >= seq.seqlen_k) return;  // past a shorter packed sequence (the grid covers the longest)
    const typename Cfg::Mask mask(params, seq);  // one head per block under the general mask
    const typename Cfg::Blocks blocks(mask, n_block);

    if constexpr (Mainloop::kWarpSpecialized) {
        Mainloop::init_barriers(params, smem);
        __syncthreads();
        if (threadIdx.x < Mainloop::kProducerThreads) {
            sm90::setmaxnreg_dec<Mainloop::kProducerRegisters>();
            Mainloop::produce(params, tma, b, group * heads, heads, n_block, blocks, smem);
            return;
        }
        sm90::setmaxnreg_inc<Mainloop::kConsumerRegisters>();
    }
    float acc_dv[Cfg::kDTiles][4];
    float acc_dk[Cfg::kDTiles][4];
    clear(acc_dv);
    clear(acc_dk);
    if constexpr (Mainloop::kWarpSpecialized) {
        Mainloop::consume(params, b, group * heads, heads, n_block, blocks, mask, smem, acc_dk, acc_dv);
        if (params.dk_accum == nullptr) Mainloop::release_kv();  // only the staged stores need K / V free
    } else {
        Mainloop::run(params, b, group * heads, heads, n_block, blocks, mask, smem, acc_dk, acc_dv);
    }
    if constexpr (Cfg::Dropout::kEnabled) scale_tile(acc_dv, Cfg::Dropout::rp(params));  // kept p / (1 - dropout_p)
    DkdvEpilogue<Cfg, Mainloop>::store(params, b, group, heads, n_block, acc_dk, acc_dv, smem);
}

// ---------------------------------------------------------------------------------------------------
// dQ without atomics: query block blockIdx.x (longest first when causal) of head blockIdx.y walks its key
// blocks and accumulates dQ = dS . K in registers. kMainloop: a DqMainloopKind (the wgmma one sm_90a only).
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kMask, int kScoreMod, int kMainloop>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dq_kernel(const AttnParams params) {
    using Cfg = DqConfig<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kMask, kScoreMod>;
    using Mainloop = conditional_t<kMainloop == kDqMainloopSm90, DqMainloopSm90<Cfg>, DqMainloopSm80<Cfg>>;
    CUFLASH_CHECK_SMEM_BYTES(Mainloop::kSmemBytes);
    const unsigned smem = sm80::smem_addr(bwd_smem);
    Mainloop::check_smem(smem);

    const int m_block = kMask != kNoMask ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const SeqInfo seq(params, b, h, LayoutOf<kMask>());
    if (m_block * kBlockM >= seq.seqlen_q) return;  // past a shorter packed sequence
    const typename Cfg::Mask mask(params, seq);
    const typename Mainloop::Blocks blocks(mask, m_block);

    float acc_dq[Cfg::kDTiles][4];
    Mainloop::run(params, b, h, blocks, mask, smem, m_block * kBlockM, acc_dq);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    DqEpilogue<Cfg>::store(params, seq, acc_dq, m_block * kBlockM, (warp % Cfg::kWarpsM) * 16,
                           lane >> 2, lane & 3, [&](int nt) { return Mainloop::col0(nt, warp / Cfg::kWarpsM); });
}

// ---------------------------------------------------------------------------------------------------
// Atomic path epilogue: dq = scale * dq_accum. Grid (ceil(Sq / kBlockM), H, B). kSwizzledDq: the dK/dV kernel
// staged its dQ adds in dq_accum_chunk's order (the warp-specialized mainloop, bwd_config.cuh).
template <typename Elem, int kHeadDim, int kBlockM, int kNWarps, bool kSwizzledDq>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_convert_dq_kernel(const AttnParams params) {
    // A query block no key block added into holds no sum where dq_accum was left unzeroed (dq_order.cuh); the
    // plan makes the counters' blocks a multiple of kBlockM rows.
    const bool untouched = dq_order::untouched(params, blockIdx.z, blockIdx.y, blockIdx.x * kBlockM);
    convert_dq_rows<Elem, kHeadDim, kBlockM, kNWarps * 32, kSwizzledDq>(params, SeqInfo(params, blockIdx.z, blockIdx.y),
                                                                        blockIdx.x * kBlockM, untouched);
}

// ---------------------------------------------------------------------------------------------------
// GQA epilogue: dk / dv of kv head blockIdx.y = the fixed-order sum of its query heads' fp32 partials.
// Grid (ceil(Sk / kBlockN), Hkv, B).
template <typename Elem, int kHeadDim, int kBlockN, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_reduce_dkdv_kernel(const AttnParams params) {
    const SeqInfo first(params, blockIdx.z, blockIdx.y * params.h_per_kv);  // the group's first query head
    reduce_dkdv_rows<Elem, kHeadDim, kBlockN, kNWarps * 32>(params, first, blockIdx.x * kBlockN);
}

}  // namespace cuflash
