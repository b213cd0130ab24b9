// Synchronization of the warp-specialized (producer / consumer) Hopper kernels: shared-memory mbarriers,
// named barriers between warpgroups, and the per-warpgroup register budget (setmaxnreg).
//
// An mbarrier counts arrivals towards an expected count; when they are all in, its phase completes and its
// parity flips. A waiter names the parity of the phase it waits for: a ring slot s used for the
// (j / kStages)-th time has parity (j / kStages) & 1. Arrive has release and wait has acquire semantics
// (CTA scope): what the arriving threads wrote to shared memory before arriving is visible to a thread
// after its wait returns.
//
// Named barriers (bar.sync / bar.arrive with an id and a thread count, a multiple of 32) let two
// warpgroups hand a turn to each other without stopping the rest of the CTA; id 0 is __syncthreads.
#pragma once

#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {
namespace sm90 {

constexpr int kMbarrierBytes = 8;

__device__ __forceinline__ void mbarrier_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, int parity) {
    CUFLASH_SM90A_ASM(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Named barrier `id`: wait until `count` threads (this one included) have synced or arrived.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Named barrier `id`: count this thread as arrived and go on.
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The register budget of the calling warpgroup (every thread of it executes this): a producer gives
// registers back, the consumers take them. Needs a register cap at kernel entry (__launch_bounds__ with
// a minimum of 1 block per SM); kRegisters a multiple of 8 in [24, 256].
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
    CUFLASH_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
    CUFLASH_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace sm90
}  // namespace cuflash
