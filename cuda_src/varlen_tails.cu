// Packed (varlen) sequences: the rows of the packed tensors that no sequence covers, [0, cu[0]) and
// [cu[B], T), get defined values: out = 0 and lse = -inf after a forward, dq / dk / dv = 0 after a
// backward. The attention kernels only visit rows inside a sequence (cuflash/seqlen.cuh), so without this
// launch those rows would keep whatever the memory held. The host cannot see the offsets without a
// device-to-host copy (a sync), so the kernel reads them: a fixed grid strides over the uncovered rows
// only, and costs a launch when there are none.
//
// kElemBytes: 2 (fp16 / bf16) or 4 (fp32); the rows are zeroed 16 bytes at a time (their length is a
// multiple of 16 bytes and their bases 16-byte aligned: checked on the host, as for the attention kernels).

#include "cuflash/params.cuh"
#include "cuflash/numeric.cuh"

namespace cuflash {

constexpr int kTailThreads = 128;

// Zeroes `cols` elements from `row` (16-byte chunks, one thread).
template <int kElemBytes>
__device__ __forceinline__ void zero_row(void* row, int cols) {
    uint4* chunks = static_cast<uint4*>(row);
    for (int c = 0; c < cols * kElemBytes / 16; ++c) chunks[c] = make_uint4(0u, 0u, 0u, 0u);
}

// Calls f(row, head) for every (row, head) of a packed side of `total` rows and `heads` heads whose row lies
// outside every sequence of `cu` (batch + 1 offsets), spread over the whole grid.
template <typename F>
__device__ __forceinline__ void for_uncovered_rows(const int* cu, int batch, int total, int heads, F&& f) {
    const int begin = min(max(__ldg(cu), 0), total);
    const int end = min(max(__ldg(cu + batch), begin), total);
    const long long uncovered = static_cast<long long>(begin + (total - end)) * heads;
    for (long long i = blockIdx.x * static_cast<long long>(kTailThreads) + threadIdx.x; i < uncovered;
         i += static_cast<long long>(gridDim.x) * kTailThreads) {
        const int index = static_cast<int>(i / heads), head = static_cast<int>(i % heads);
        f(index < begin ? index : end + (index - begin), head);
    }
}

template <int kElemBytes, bool kBackward>
__global__ void __launch_bounds__(kTailThreads) flash_varlen_tails_kernel(const AttnParams params) {
    const AttnParams& p = params;
    if constexpr (!kBackward) {
        for_uncovered_rows(p.cu_seqlens_q, p.batch, p.total_q, p.num_heads, [&](int row, int h) {
            zero_row<kElemBytes>(static_cast<char*>(p.o) + (row * p.o_row_stride + h * p.o_head_stride) * kElemBytes,
                                 p.head_dim_v);
            if (p.lse != nullptr) p.lse[h * p.lse_head_stride + row] = -INFINITY;
        });
    } else {
        for_uncovered_rows(p.cu_seqlens_q, p.batch, p.total_q, p.num_heads, [&](int row, int h) {
            zero_row<kElemBytes>(static_cast<char*>(p.dq) + (row * p.dq_row_stride + h * p.dq_head_stride) * kElemBytes,
                                 p.head_dim);
        });
        for_uncovered_rows(p.cu_seqlens_k, p.batch, p.total_k, p.num_heads_k, [&](int row, int h) {
            zero_row<kElemBytes>(static_cast<char*>(p.dk) + (row * p.dk_row_stride + h * p.dk_head_stride) * kElemBytes,
                                 p.head_dim);
            zero_row<kElemBytes>(static_cast<char*>(p.dv) + (row * p.dv_row_stride + h * p.dv_head_stride) * kElemBytes,
                                 p.head_dim_v);
        });
    }
}

}  // namespace cuflash
