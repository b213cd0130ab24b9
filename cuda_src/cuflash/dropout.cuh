// Dropout on the attention probabilities (docs/api.md order: after the softmax, before P.V): each (b, h, i, j)
// keeps its probability iff its 32-bit uniform u >= params.dropout_threshold (round(dropout_p * 2^32)); kept
// probabilities are scaled by params.dropout_rp = 1 / (1 - dropout_p), which the kernels apply once to the
// output (forward) and to dV (backward) instead of per element. lse is taken before dropout.
//
// The random stream: Philox-4x32-10 (Salmon et al., SC 2011), key = the 64-bit seed, counter
// (j & ~8, i & ~8, h, b). One call gives the uniforms of the four elements whose (query i, key j) differ only
// in bit 3: word 2 * bit3(i) + bit3(j). Those four are exactly what one thread holds of an m16 x n16 block in
// every accumulator layout here (the mma / wgmma C fragment: rows g and g + 8, columns c and c + 8 of two n8
// tiles; the dK/dV kernels' transposed S^T: keys g and g + 8, queries c and c + 8), so no uniform is drawn
// twice and none is wasted. The fp32 SIMT kernels draw per element (one call, one word). i and j count from
// the start of the sequence; cuflash.reference.dropout_keep_mask reproduces the mask on the host.
//
// The backward recomputes P and marks dropped entries by their sign bit (P >= 0), so the mask costs no extra
// registers between the two GEMMs that need it: dS = |P| o (keep ? dP * rp : 0) - D), then dV takes
// max(P, 0). Picked by the mask kind (kGeneralDropoutMask, kGeneralBoolDropoutMask: DropoutOf<true>); every
// other kind gets DropoutOf<false>, whose members compile to nothing.
#pragma once

#include "cuflash/numeric.cuh"
#include "cuflash/params.cuh"

namespace cuflash {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 key) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
        if (round < 9) {
            key.x += 0x9E3779B9u;
            key.y += 0xBB67AE85u;
        }
    }
    return c;
}

// A dropped probability's mark: its sign bit (on a value >= 0).
__device__ __forceinline__ float drop_mark(float p, bool keep) {
    return keep ? p : __int_as_float(__float_as_int(p) | 0x80000000);
}

template <bool kOn>
struct DropoutOf {
    static constexpr bool kEnabled = false;
    __device__ __forceinline__ DropoutOf(const AttnParams&, int, int) {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void drop_rows(float (&)[kMTiles][kNTiles][4], int, int) const {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void mark_rows(float (&)[kMTiles][kNTiles][4], int, int) const {}
    template <int kNT>
    __device__ __forceinline__ void mark_transposed(float (&)[kNT][4], int, int) const {}
    __device__ __forceinline__ bool keep(int, int) const { return true; }
    static __device__ __forceinline__ float rp(const AttnParams&) { return 1.f; }
};

template <>
struct DropoutOf<true> {
    static constexpr bool kEnabled = true;
    uint2 key;
    unsigned threshold;
    int b, h;

    __device__ __forceinline__ DropoutOf(const AttnParams& p, int b_, int h_)
        : threshold(p.dropout_threshold), b(b_), h(h_) {
        const unsigned long long seed = p.dropout_seed_ptr != nullptr ? *p.dropout_seed_ptr : p.dropout_seed;
        key = make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
    }
    static __device__ __forceinline__ float rp(const AttnParams& p) { return p.dropout_rp; }

    // Uniforms of (i, j), (i, j + 8), (i + 8, j), (i + 8, j + 8); i and j have bit 3 clear.
    __device__ __forceinline__ uint4 uniforms(int i, int j) const {
        return philox4x32_10(make_uint4(unsigned(j), unsigned(i), unsigned(h), unsigned(b)), key);
    }

    // One element (the SIMT kernels).
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 u = uniforms(i & ~8, j & ~8);
        const int word = ((i >> 2) & 2) | ((j >> 3) & 1);
        const unsigned x = word == 0 ? u.x : word == 1 ? u.y : word == 2 ? u.z : u.w;
        return x >= threshold;
    }

    // The C-fragment tile of query rows row0 + ... and keys col0 + ... (both multiples of 16): calls
    // f(element, keep) for every element, one Philox call per four.
    template <int kMTiles, int kNTiles, typename F>
    __device__ __forceinline__ void for_rows(float (&acc)[kMTiles][kNTiles][4], int row0, int col0, F&& f) const {
        static_assert(kNTiles % 2 == 0, "dropout pairs n8 tiles: the key block is a multiple of 16");
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int pair = 0; pair < kNTiles / 2; ++pair) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const uint4 u = uniforms(row0 + mt * 16 + lane / 4, col0 + pair * 16 + 2 * (lane % 4) + c);
                    f(acc[mt][2 * pair][c], u.x >= threshold);
                    f(acc[mt][2 * pair + 1][c], u.y >= threshold);
                    f(acc[mt][2 * pair][2 + c], u.z >= threshold);
                    f(acc[mt][2 * pair + 1][2 + c], u.w >= threshold);
                }
            }
        }
    }

    // Forward: dropped probabilities become 0 (the row sums already hold them).
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void drop_rows(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        for_rows(acc, row0, col0, Zero());
    }
    // Backward, row layout (the dQ kernel): dropped probabilities get their mark.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void mark_rows(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        for_rows(acc, row0, col0, Mark());
    }

    // Backward, the dK/dV kernels' S^T: element [nt][e] is key key_row + 8 * (e / 2), query
    // query_col + 8 * nt + e % 2 (key_row = the lane's first key, query_col = its first query; the block's
    // first key and query are multiples of 16).
    template <int kNT>
    __device__ __forceinline__ void mark_transposed(float (&acc)[kNT][4], int key_row, int query_col) const {
        static_assert(kNT % 2 == 0, "dropout pairs n8 tiles: the query block is a multiple of 16");
#pragma unroll
        for (int pair = 0; pair < kNT / 2; ++pair) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const uint4 u = uniforms(query_col + pair * 16 + c, key_row);
                acc[2 * pair][c] = drop_mark(acc[2 * pair][c], u.x >= threshold);              // (i, j)
                acc[2 * pair][2 + c] = drop_mark(acc[2 * pair][2 + c], u.y >= threshold);      // (i, j + 8)
                acc[2 * pair + 1][c] = drop_mark(acc[2 * pair + 1][c], u.z >= threshold);      // (i + 8, j)
                acc[2 * pair + 1][2 + c] = drop_mark(acc[2 * pair + 1][2 + c], u.w >= threshold);
            }
        }
    }

  private:
    struct Zero {
        __device__ __forceinline__ void operator()(float& x, bool keep) const { x = keep ? x : 0.f; }
    };
    struct Mark {
        __device__ __forceinline__ void operator()(float& x, bool keep) const { x = drop_mark(x, keep); }
    };
};

// acc *= factor (dropout's 1 / (1 - p) on an output or dV tile).
template <int kA, int kB, int kC>
__device__ __forceinline__ void scale_tile(float (&acc)[kA][kB][kC], float factor) {
#pragma unroll
    for (int a = 0; a < kA; ++a)
#pragma unroll
        for (int b = 0; b < kB; ++b)
#pragma unroll
            for (int c = 0; c < kC; ++c) acc[a][b][c] *= factor;
}
template <int kB, int kC>
__device__ __forceinline__ void scale_tile(float (&acc)[kB][kC], float factor) {
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
        for (int c = 0; c < kC; ++c) acc[b][c] *= factor;
}

// dS of one element from its (possibly marked) probability: |P| o ((kept ? dP * rp : 0) - D).
__device__ __forceinline__ float dropout_dscore(float p_marked, float dp, float d, float rp) {
    const bool kept = __float_as_int(p_marked) >= 0;
    return fabsf(p_marked) * ((kept ? dp * rp : 0.f) - d);
}

}  // namespace cuflash
