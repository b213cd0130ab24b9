// KV cache: writes k_new / v_new (B, Snew, Hkv, D) into the cache at rows cache_seqlens[b] ... + Snew - 1 of
// batch b, dense or paged (cuflash/kvcache.cuh), before flash_kvcache_kernel reads the cache (same stream).
// Rows past the cache's capacity are dropped (the host refuses them when it has the lengths; lengths on the
// device are clamped like the attention kernel's), page ids clamped into [0, num_pages): no access
// outside the cache. 16 bytes per thread and step, a grid-stride loop over (b, token, kv head, chunk).
//
// kElemBytes: 2 (fp16 / bf16) or 4 (fp32); rows are whole 16-byte chunks (head dims are multiples of 8
// elements, bases and strides 16-byte aligned: checked on the host).

#include "cuflash/params.cuh"
#include "cuflash/numeric.cuh"

namespace cuflash {

constexpr int kAppendThreads = 256;

template <int kElemBytes>
__global__ void __launch_bounds__(kAppendThreads) flash_kvcache_append_kernel(const AttnParams params) {
    const AttnParams& p = params;
    const int k_chunks = p.head_dim * kElemBytes / 16, v_chunks = p.head_dim_v * kElemBytes / 16;
    const int row_chunks = k_chunks + v_chunks;
    const long long total = static_cast<long long>(p.batch) * p.seqlen_new * p.num_heads_k * row_chunks;
    for (long long i = blockIdx.x * static_cast<long long>(kAppendThreads) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * kAppendThreads) {
        const int chunk = static_cast<int>(i % row_chunks);
        const long long head_row = i / row_chunks;
        const int h = static_cast<int>(head_row % p.num_heads_k);
        const long long token_row = head_row / p.num_heads_k;
        const int t = static_cast<int>(token_row % p.seqlen_new);
        const int b = static_cast<int>(token_row / p.seqlen_new);
        const int row = min(max(__ldg(p.cache_seqlens + b), 0), p.kv_capacity) + t;  // the key's index in batch b
        if (row >= p.kv_capacity) continue;
        long long slot, row_in;  // (batch or page, row) of the cache
        if (p.block_table != nullptr) {
            slot = min(max(__ldg(p.block_table + b * p.block_table_batch_stride + row / p.page_size), 0),
                       p.num_pages - 1);
            row_in = row % p.page_size;
        } else {
            slot = b, row_in = row;
        }
        const bool is_k = chunk < k_chunks;
        const int c = is_k ? chunk : chunk - k_chunks;
        const char* src = static_cast<const char*>(is_k ? p.k_new : p.v_new) +
                          (is_k ? b * p.knew_batch_stride + t * p.knew_row_stride + h * p.knew_head_stride
                                : b * p.vnew_batch_stride + t * p.vnew_row_stride + h * p.vnew_head_stride) *
                              kElemBytes;
        char* dst = static_cast<char*>(const_cast<void*>(is_k ? p.k : p.v)) +
                    (is_k ? slot * p.k_batch_stride + row_in * p.k_row_stride + h * p.k_head_stride
                          : slot * p.v_batch_stride + row_in * p.v_row_stride + h * p.v_head_stride) *
                        kElemBytes;
        reinterpret_cast<uint4*>(dst)[c] = __ldg(reinterpret_cast<const uint4*>(src) + c);
    }
}

}  // namespace cuflash
