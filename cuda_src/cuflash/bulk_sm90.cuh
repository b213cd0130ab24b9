// Bulk asynchronous copies of sm_90a without a tensor map (cp.reduce.async.bulk / cp.async.bulk: one contiguous
// run of bytes): the warp-specialized dK/dV kernel's adds (and first stores) into dq_accum. The issuing thread
// owns its bulk groups: bulk_commit() closes the ops it issued since its last commit; bulk_wait_read<N>()
// returns once at most N of its groups still read shared memory (the source may then be overwritten),
// bulk_wait<N>() once at most N are incomplete. Bytes written by st.shared reach a bulk op's read only after
// sm90::fence_proxy_async() in the writing threads and a barrier (an mbarrier arrive / wait) between them and the
// issuing thread.
#pragma once

#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {
namespace sm90 {

// gmem[i] += smem[i] for the bytes / 4 floats (the adds run at L2, like red.global.add); bytes a multiple
// of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, unsigned smem, unsigned bytes) {
    CUFLASH_SM90A_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
                      "r"(smem), "r"(bytes)
                      : "memory");
}

// gmem[i] = smem[i] for the bytes / 4 floats (the first add into a block that was not zeroed: dq_order.cuh);
// the same size and alignment rules.
__device__ __forceinline__ void bulk_store_f32(float* gmem, unsigned smem, unsigned bytes) {
    CUFLASH_SM90A_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem), "r"(bytes)
                      : "memory");
}

__device__ __forceinline__ void bulk_commit() { CUFLASH_SM90A_ASM("cp.async.bulk.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
    CUFLASH_SM90A_ASM("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

template <int kPending>
__device__ __forceinline__ void bulk_wait() {
    CUFLASH_SM90A_ASM("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace sm90
}  // namespace cuflash
