// Score modifiers: the hook between S = Q.K^T (raw scores, C-fragment layout) and the mask.
//
// A modifier sees a warp's score tile acc_s[kMTiles][kNTiles][4] with its first row / column (the
// accumulator contract of cuda_src/README.md gives every element's row and column) and may rewrite it
// (softcap, additive bias, ALiBi). Its backward counterpart `grad` turns dS with respect to the modified
// scores into dS with respect to the raw ones (and may accumulate a dbias). Every mainloop, the SIMT one
// included, calls `apply` right after its QK^T GEMM and `grad` right after forming dS, so a modifier is one
// struct here plus its selection in the kernels' configs; the online softmax works on whatever comes out.
//
// Contract for modifiers: they must keep masked-to-be scores finite (the mask runs after them) and must
// not produce NaN; the softmax's scale > 0 mapping (flash_fwd.cu) applies to their output.
#pragma once

namespace cuflash {

struct IdentityScoreMod {
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&)[kMTiles][kNTiles][4], int /*row0*/, int /*col0*/) const {}
    // Transposed tiles (dK / dV kernels: rows are keys, columns queries).
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed(float (&)[kNTiles][4], int /*key0*/, int /*query0*/) const {}
    template <int kNTiles>
    __device__ __forceinline__ void grad_transposed(float (&)[kNTiles][4], int /*key0*/, int /*query0*/) const {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void grad(float (&)[kMTiles][kNTiles][4], int /*row0*/, int /*col0*/) const {}
    // One score (SIMT kernels): the modified score, and dS w.r.t. the raw score from dS w.r.t. the
    // modified one (given the raw score, which the backward recomputes).
    __device__ __forceinline__ float apply_one(float s, int /*row*/, int /*col*/) const { return s; }
    __device__ __forceinline__ float grad_one(float ds, float /*raw_s*/, int /*row*/, int /*col*/) const { return ds; }
};

}  // namespace cuflash
