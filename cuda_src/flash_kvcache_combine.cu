// Split-KV: merges the num_splits partial results of flash_kvcache_kernel (normalized fp32 outputs o_s and
// their lse_s, cuflash/kvcache.cuh) into out and lse:
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * o_s.
// A split that saw no key has lse_s = -inf and weight 0; a row no split saw gets out 0, lse -inf (no NaN).
// One warp per output row (b, h, token): lanes read the splits' lse (at most 32 per pass), reduce, then
// each lane sums two columns at a time.

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
__global__ void __launch_bounds__(kCombineWarps * 32) flash_kvcache_combine_kernel(const AttnParams params) {
    const AttnParams& p = params;
    const int lane = threadIdx.x % 32;
    const long long rows = static_cast<long long>(p.batch) * p.num_heads * p.seqlen_q;  // per split
    const long long row = blockIdx.x * static_cast<long long>(kCombineWarps) + threadIdx.x / 32;  // (b, h, token)
    if (row >= rows) return;
    const int token = static_cast<int>(row % p.seqlen_q);
    const int h = static_cast<int>(row / p.seqlen_q % p.num_heads);
    const int b = static_cast<int>(row / p.seqlen_q / p.num_heads);

    float m = -INFINITY;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.lse_accum[s * rows + row]);
    m = warp_max(m);
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(p.lse_accum[s * rows + row] - finite_or_zero(m));
    sum = warp_sum(sum);
    const bool empty = m == -INFINITY;  // sum >= 1 otherwise (the largest split contributes exp(0))
    const float lse = empty ? -INFINITY : finite_or_zero(m) + logf(sum);

    Elem* o = static_cast<Elem*>(p.o) + b * p.o_batch_stride + token * p.o_row_stride + h * p.o_head_stride;
    for (int col = lane * 2; col < p.head_dim_v; col += 64) {
        float2 acc = make_float2(0.f, 0.f);
        if (!empty) {
            for (int s = 0; s < p.num_splits; ++s) {
                const float w = expf(p.lse_accum[s * rows + row] - lse);
                const float2 part = *reinterpret_cast<const float2*>(p.o_accum + (s * rows + row) * p.head_dim_v + col);
                acc.x = fmaf(w, part.x, acc.x);
                acc.y = fmaf(w, part.y, acc.y);
            }
        }
        if constexpr (is_same_v<Elem, float>) {
            *reinterpret_cast<float2*>(o + col) = acc;
        } else {
            *reinterpret_cast<unsigned*>(o + col) = ElemTraits<Elem>::pack2(acc.x, acc.y);
        }
    }
    if (p.lse != nullptr && lane == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + token] = lse;
}

}  // namespace cuflash
