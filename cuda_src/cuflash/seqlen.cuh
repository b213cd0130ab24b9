// Sequence info: where one (batch, head)'s rows live, and how many there are. Every kernel forms its
// q / k / v / o / dout / dq / dk / dv / lse / dlse / softmax_d / fp32-scratch pointers through this struct
// and nowhere else, so varlen (cu_seqlens: a per-batch row offset and length) and a KV cache (a per-batch
// key length and page table) change this file, not the kernels.
//
// It holds only the indices and lengths (a few registers); the offsets are formed where a pointer is
// needed. Kernels that keep registers scarce build it from opaque copies of (b, h) inside their loops so
// nothing derived from it is hoisted and kept live (cuflash/dkdv_mainloop.cuh).
//
// Batched layout today (cuda_src/cuflash/params.cuh): row r of (b, h) of q is
//   q + b * q_batch_stride + h * q_head_stride + r * q_row_stride,
// k / v / dk / dv use the kv head h_kv = h / h_per_kv (GQA / MQA: never materialized per query head).
#pragma once

#include "cuflash/params.cuh"

namespace cuflash {

struct SeqInfo {
    int b;         // batch index
    int h;         // query head
    int h_kv;      // kv head of this query head
    int seqlen_q;  // rows of q / o / dout / dq / lse of this batch
    int seqlen_k;  // rows of k / v / dk / dv of this batch

    __device__ __forceinline__ SeqInfo(const AttnParams& p, int b_, int h_)
        : b(b_), h(h_), h_kv(h_ / p.h_per_kv), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k) {}

    // (b, h) as one index of the contiguous (B, H, ...) scratch tensors.
    __device__ __forceinline__ long long bh(const AttnParams& p) const {
        return static_cast<long long>(b) * p.num_heads + h;
    }

    // Row `row` of this (batch, head) of each bshd tensor (query-side rows for q / o / dout / dq, key-side
    // rows for k / v / dk / dv).
    template <typename Elem>
    __device__ __forceinline__ const Elem* q(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + row * p.q_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ const Elem* k(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride + row * p.k_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ const Elem* v(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride + row * p.v_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* o(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + row * p.o_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ const Elem* dout(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
               row * p.do_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* dq(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + row * p.dq_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* dk(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride + row * p.dk_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* dv(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride + row * p.dv_row_stride;
    }

    // lse of query row `row` (null when the caller asked for no lse), and the incoming dlse (may be null).
    __device__ __forceinline__ float* lse(const AttnParams& p, int row = 0) const {
        return p.lse == nullptr ? nullptr : p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + row;
    }
    __device__ __forceinline__ const float* lse_in(const AttnParams& p, int row = 0) const {
        return p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + row;
    }
    __device__ __forceinline__ const float* dlse(const AttnParams& p, int row = 0) const {
        return p.dlse + b * p.dlse_batch_stride + h * p.dlse_head_stride + row;
    }

    // Contiguous fp32 scratch, (B, H, S, width) with the width the caller's (kHeadDim bucket, or 1).
    __device__ __forceinline__ float* softmax_d(const AttnParams& p, int row = 0) const {
        return p.softmax_d + bh(p) * seqlen_q + row;
    }
    __device__ __forceinline__ float* dq_accum(const AttnParams& p, int row, int width) const {
        return p.dq_accum + (bh(p) * seqlen_q + row) * width;
    }
    __device__ __forceinline__ float* dk_accum(const AttnParams& p, int width) const {
        return p.dk_accum + bh(p) * seqlen_k * width;
    }
    __device__ __forceinline__ float* dv_accum(const AttnParams& p, int width) const {
        return p.dv_accum + bh(p) * seqlen_k * width;
    }
    // Partial `slot` of `slots` per batch, (B, slots, Sk, width): the tensor-core dK/dV kernel writes one
    // per dkdv_heads query heads.
    __device__ __forceinline__ float* dk_accum(const AttnParams& p, int width, int slot, int slots) const {
        return p.dk_accum + (static_cast<long long>(b) * slots + slot) * seqlen_k * width;
    }
    __device__ __forceinline__ float* dv_accum(const AttnParams& p, int width, int slot, int slots) const {
        return p.dv_accum + (static_cast<long long>(b) * slots + slot) * seqlen_k * width;
    }
};

}  // namespace cuflash
