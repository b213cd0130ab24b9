// Warp-level tensor-core and async-copy primitives available from sm_80 on (mma.sync, ldmatrix,
// cp.async). Every mainloop that runs on Ampere, Ada or (as the portable path) Hopper builds on
// these; nothing here knows about attention.
//
// Fragment layouts of mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), lane = threadIdx.x % 32:
//   A (16x16, 4 regs of 2 halves): rows lane/4 and lane/4+8, cols (lane%4)*2+{0,1} and +8.
//   B (16x8,  2 regs):             rows (lane%4)*2+{0,1} and +8, col lane/4.
//   C (16x8,  4 floats):           c0,c1 at row lane/4, c2,c3 at row lane/4+8, cols (lane%4)*2+{0,1}.
// The C layout of S = Q.K^T equals the A layout P needs for P.V, so P never leaves registers.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cuflash {

// Element-type conversions, by overload on the element type (fp16, bf16; fp32 for the SIMT kernels).
__device__ __forceinline__ __half2 to_pair(float lo, float hi, __half) { return __floats2half2_rn(lo, hi); }
__device__ __forceinline__ __nv_bfloat162 to_pair(float lo, float hi, __nv_bfloat16) {
    return __floats2bfloat162_rn(lo, hi);
}
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename Elem>
struct ElemTraits {
    // Two floats rounded to Elem and packed into one 32-bit register (low half first).
    static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
        auto pair = to_pair(lo, hi, Elem());
        return *reinterpret_cast<unsigned*>(&pair);
    }
    static __device__ __forceinline__ float to_float(Elem x) { return cuflash::to_float(x); }
};

namespace sm80 {

__device__ __forceinline__ unsigned smem_addr(const void* ptr) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// 16-byte global->shared copy that bypasses L1. When `valid` is false nothing is read and the 16
// destination bytes are zero-filled: this is how tail tiles (rows past Sq/Sk, columns past D) stay
// finite. The caller still passes an in-bounds address (e.g. the tensor's base) when !valid.
__device__ __forceinline__ void cp_async_16(unsigned smem_dst, const void* gmem_src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(kPending));
}

// Four 8x8 b16 matrices; lane l supplies the row address of row l%8 of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned smem_src) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_src));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned smem_src) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_src));
}

// Two 8x8 b16 matrices; lanes 0-15 supply the row addresses.
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], unsigned smem_src) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_src));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], unsigned smem_src) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_src));
}

// d += a * b on one m16n8k16 tile with fp32 accumulation; TYPE is the PTX name of the input type.
#define CUFLASH_MMA_16816(TYPE)                                                            \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "             \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], __half) {
    CUFLASH_MMA_16816("f16");
}
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                          __nv_bfloat16) {
    CUFLASH_MMA_16816("bf16");
}
#undef CUFLASH_MMA_16816

template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    mma_16816(d, a, b, Elem());
}

// Bytes of dynamic shared memory this launch actually received; kernels compare it with what their
// layout needs and trap on a mismatch, so a drifted host-side size formula fails loudly.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
    return r;
}

}  // namespace sm80
}  // namespace cuflash
