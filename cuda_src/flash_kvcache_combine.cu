// Split-KV: merges the num_splits partial results of flash_kvcache_kernel (normalized fp32 outputs o_s and
// their lse_s, cuflash/kvcache.cuh) into out and lse:
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * o_s.
// A split that saw no key has lse_s = -inf and weight 0; a row no split saw gets out 0, lse -inf (no NaN).
// One warp per output row (b, h, token). Lanes read the splits' lse 32 at a time and reduce; each lane then
// computes one split's weight once (shuffled to the others), and sums four columns per pass over the splits,
// kUnroll splits' loads in flight at once: decoding's combine is a chain of dependent global loads otherwise
// (B1 H32 L128k, 16 splits: 13.7 us with two columns per lane and one split at a time, against the attention
// kernel's 185; cuDNN's reduction 4.5, session 15).
#include "cuflash/params.cuh"
#include "cuflash/numeric.cuh"
#include "cuflash/softmax.cuh"
#include "cuflash/mma_sm80.cuh"

namespace cuflash {

constexpr int kCombineWarps = 4;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, d));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) x += __shfl_xor_sync(0xffffffffu, x, d);
    return x;
}

template <typename Elem>
__device__ __forceinline__ void store4(Elem* dst, float4 v) {
    if constexpr (is_same_v<Elem, float>) {
        *reinterpret_cast<float4*>(dst) = v;
    } else {
        *reinterpret_cast<uint2*>(dst) = make_uint2(ElemTraits<Elem>::pack2(v.x, v.y), ElemTraits<Elem>::pack2(v.z, v.w));
    }
}

constexpr int kCombineUnroll = 8;

template <typename Elem>
__global__ void __launch_bounds__(kCombineWarps * 32) flash_kvcache_combine_kernel(const AttnParams params) {
    const AttnParams& p = params;
    const int lane = threadIdx.x % 32;
    const long long rows = static_cast<long long>(p.batch) * p.num_heads * p.seqlen_q;  // per split
    const long long row = blockIdx.x * static_cast<long long>(kCombineWarps) + threadIdx.x / 32;  // (b, h, token)
    if (row >= rows) return;
    const int token = static_cast<int>(row % p.seqlen_q);
    const int h = static_cast<int>(row / p.seqlen_q % p.num_heads);
    const int b = static_cast<int>(row / p.seqlen_q / p.num_heads);
    const int splits = p.num_splits;

    float m = -INFINITY;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, p.lse_accum[s * rows + row]);
    m = warp_max(m);
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) sum += expf(p.lse_accum[s * rows + row] - finite_or_zero(m));
    sum = warp_sum(sum);
    const bool empty = m == -INFINITY;  // sum >= 1 otherwise (the largest split contributes exp(0))
    const float lse = empty ? -INFINITY : finite_or_zero(m) + logf(sum);

    Elem* o = static_cast<Elem*>(p.o) + b * p.o_batch_stride + token * p.o_row_stride + h * p.o_head_stride;
    const float* part = p.o_accum + row * p.head_dim_v;  // split s's row at part + s * rows * Dv
    const long long split_stride = rows * p.head_dim_v;
    for (int col0 = 0; col0 < p.head_dim_v; col0 += 128) {  // warp-uniform passes (the shuffles); Dv % 8 == 0
        const int col = col0 + lane * 4;
        const bool active = col < p.head_dim_v;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (!empty) {
            for (int s0 = 0; s0 < splits; s0 += 32) {
                // lane s's weight exp(lse_s - lse) for splits s0 .. s0 + 31, 0 past the last
                const float w_lane = s0 + lane < splits ? expf(p.lse_accum[(s0 + lane) * rows + row] - lse) : 0.f;
                const int n = min(32, splits - s0);
                for (int i0 = 0; i0 < n; i0 += kCombineUnroll) {
                    float4 v[kCombineUnroll];
#pragma unroll
                    for (int i = 0; i < kCombineUnroll; ++i) {  // the loads first, all in flight
                        const float* src = part + (s0 + i0 + i) * split_stride + col;
                        v[i] = active && i0 + i < n ? *reinterpret_cast<const float4*>(src) : make_float4(0.f, 0.f, 0.f, 0.f);
                    }
#pragma unroll
                    for (int i = 0; i < kCombineUnroll; ++i) {  // then the sums, in split order
                        const float w = __shfl_sync(0xffffffffu, w_lane, (i0 + i) % 32);
                        if (i0 + i < n) {
                            acc.x = fmaf(w, v[i].x, acc.x);
                            acc.y = fmaf(w, v[i].y, acc.y);
                            acc.z = fmaf(w, v[i].z, acc.z);
                            acc.w = fmaf(w, v[i].w, acc.w);
                        }
                    }
                }
            }
        }
        if (active) store4(o + col, acc);
    }
    if (p.lse != nullptr && lane == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + token] = lse;
}

}  // namespace cuflash
