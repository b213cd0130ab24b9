// A broadcast bias's dbias: the dK/dV kernels sum it in fp32 (params.dbias_accum, contiguous in the bias's own
// shape); this converts the sums to the bias's dtype into the dbias output, after the backward's launches.
// A grid-stride walk over 8-element chunks: two 16-byte loads, one 16-byte store (the output contiguous and
// 16-byte aligned: checked on the host, which converts any other output itself); the last n % 8 elements one by
// one. It replaced an astype + copy that ran at about a third of memory speed (B2 S2k H16, a (1, 16, S, S) bias:
// 2 x 318 us, H200, session 39).

#include "cuflash/mma_sm80.cuh"

namespace cuflash {

constexpr int kConvertThreads = 256;

template <typename Elem>
__global__ void __launch_bounds__(kConvertThreads)
    flash_dbias_convert_kernel(const float* __restrict__ src, Elem* __restrict__ dst, long long n) {
    static_assert(sizeof(Elem) == 2, "fp32 sums of an fp32 bias need no conversion (the host adds into dbias)");
    const long long chunks = n / 8;
    const long long stride = static_cast<long long>(gridDim.x) * kConvertThreads;
    for (long long c = blockIdx.x * static_cast<long long>(kConvertThreads) + threadIdx.x; c < chunks; c += stride) {
        const float4 a = __ldcs(reinterpret_cast<const float4*>(src) + 2 * c);
        const float4 b = __ldcs(reinterpret_cast<const float4*>(src) + 2 * c + 1);
        using T = ElemTraits<Elem>;
        const uint4 out = make_uint4(T::pack2(a.x, a.y), T::pack2(a.z, a.w), T::pack2(b.x, b.y), T::pack2(b.z, b.w));
        reinterpret_cast<uint4*>(dst)[c] = out;
    }
    if (blockIdx.x == 0 && threadIdx.x < n - chunks * 8) {
        const long long i = chunks * 8 + threadIdx.x;
        const auto pair = to_pair(src[i], 0.f, Elem());
        dst[i] = pair.x;
    }
}

}  // namespace cuflash
