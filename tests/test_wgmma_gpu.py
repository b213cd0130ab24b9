"""The sm_90a warpgroup GEMMs of ``cuda_src/cuflash/wgmma_sm90.cuh`` against numpy, one operand form at a time.

Each case stores random bf16 / fp16 matrices into shared memory in the panel layout the kernels use, runs
one of ``gemm_abt`` (A, B K-major), ``gemm_rs`` (A from registers, B MN-major) or ``gemm_atb`` (A, B
MN-major) on one warpgroup and writes the accumulator out through the mma.sync C layout. A wrong
descriptor field (LBO / SBO / swizzle), fragment layout or transpose flag shows up here as a wrong
matrix, before it can hide inside an attention kernel. Runs only on an sm_90 GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SOURCE = r"""
#include "cuflash/mma_sm80.cuh"
#include "cuflash/wgmma_sm90.cuh"

extern __shared__ __align__(1024) unsigned char selftest_smem[];

// Byte offset of element (r, c) of a panel tile with kRows rows (see wgmma_sm90.cuh).
__device__ unsigned panel_offset(int rows, int r, int c) {
    const int chunk = c / 8;
    return (chunk / 8) * rows * 128 + r * 128 + (((chunk % 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

template <typename Elem, int kRows, int kCols>
__device__ void stage(unsigned char* dst, const Elem* src) {
    for (int i = threadIdx.x; i < kRows * kCols; i += 128) {
        *reinterpret_cast<Elem*>(dst + panel_offset(kRows, i / kCols, i % kCols)) = src[i];
    }
}

// kMode 0: C = A . B[32*kPanel .. +kN, :]^T, A (64 x kK) and B (32*kPanel + kN x kK) K-major.
// kMode 1: C = A . B[:, 64*kPanel ..], A (64 x kK) from registers, B (kK x kColsB) MN-major.
// kMode 2: C = A^T . B[:, 64*kPanel ..], A (kK x 64) and B (kK x kColsB) MN-major.
// kMode 3: C = A . B[:, 64*kPanel ..], A (64 x kK) K-major, B (kK x kColsB) MN-major.
template <typename Elem, int kMode, int kK, int kN, int kColsB, int kPanel>
__global__ void __launch_bounds__(128) wgmma_selftest(const Elem* a, const Elem* b, float* c) {
    using namespace cuflash;
    constexpr int kRowsA = kMode == 2 ? kK : 64;
    constexpr int kColsA = kMode == 2 ? 64 : kK;
    constexpr int kRowsB = kMode == 0 ? kN + 32 * kPanel : kK;
    constexpr int kBytesA = (kRowsA * kColsA * 2 + 1023) / 1024 * 1024;
    unsigned char* smem_a = selftest_smem;
    unsigned char* smem_b = selftest_smem + kBytesA;
    const unsigned sa = sm80::smem_addr(smem_a), sb = sm80::smem_addr(smem_b);
    if ((sa & 1023u) != 0) __trap();
    stage<Elem, kRowsA, kColsA>(smem_a, a);
    stage<Elem, kRowsB, kColsB>(smem_b, b);
    sm90::fence_proxy_async();
    __syncthreads();

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    float acc[kN / 8][4];
    if constexpr (kMode == 0) {
        sm90::gemm_abt<Elem, kK, kRowsA, kRowsB>(acc, sa, 0, sb, 32 * kPanel, false);
    } else if constexpr (kMode == 1) {
        unsigned frag[kK / 16][4];
        const int r0 = 16 * warp + g;
        for (int kk = 0; kk < kK / 16; ++kk) {
            const int c0 = 16 * kk + 2 * t;
            frag[kk][0] = ElemTraits<Elem>::pack2(ElemTraits<Elem>::to_float(a[r0 * kK + c0]),
                                                  ElemTraits<Elem>::to_float(a[r0 * kK + c0 + 1]));
            frag[kk][1] = ElemTraits<Elem>::pack2(ElemTraits<Elem>::to_float(a[(r0 + 8) * kK + c0]),
                                                  ElemTraits<Elem>::to_float(a[(r0 + 8) * kK + c0 + 1]));
            frag[kk][2] = ElemTraits<Elem>::pack2(ElemTraits<Elem>::to_float(a[r0 * kK + c0 + 8]),
                                                  ElemTraits<Elem>::to_float(a[r0 * kK + c0 + 9]));
            frag[kk][3] = ElemTraits<Elem>::pack2(ElemTraits<Elem>::to_float(a[(r0 + 8) * kK + c0 + 8]),
                                                  ElemTraits<Elem>::to_float(a[(r0 + 8) * kK + c0 + 9]));
        }
        sm90::gemm_rs<Elem, kK / 16, kRowsB>(acc, frag, sb, 0, kPanel, false);
    } else if constexpr (kMode == 2) {
        sm90::gemm_atb<Elem, kK, kRowsA, kRowsB>(acc, sa, 0, sb, kPanel, 0, false);
    } else {
        sm90::gemm_ab<Elem, kK, kRowsA, kRowsB>(acc, sa, 0, sb, kPanel, false);
    }
    sm90::wait<0>();
    sm90::fence_operand(acc);
    for (int nt = 0; nt < kN / 8; ++nt) {
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * warp + g + (e >= 2 ? 8 : 0);
            const int col = 8 * nt + 2 * t + (e & 1);
            c[row * kN + col] = acc[nt][e];
        }
    }
}
"""

# (mode, K, N, columns of B, panel of B): every descriptor field and both panels of a 2-panel tile.
CASES = [
    (0, 128, 64, 128, 0),   # S = Q.K^T at head dim 128: two K panels on both operands
    (0, 64, 128, 64, 0),    # 128 B rows
    (1, 64, 128, 128, 0),   # dV += P^T.dO at head dim 128: MN-major B over two panels (LBO)
    (1, 64, 64, 128, 1),    # ... starting at the second panel
    (1, 128, 64, 64, 0),    # K = 128: eight 16-row k-steps (SBO)
    (2, 128, 64, 128, 1),   # dQ += dS.K: A transposed, B at its second panel
    (2, 64, 64, 64, 0),
    (0, 256, 32, 256, 1),   # S^T of one 32-query half at head dim 256: four panels, B rows from 32
    (3, 64, 128, 256, 1),   # dV += P^T.dO at head dim 256: A from shared memory, B's second half
    (3, 64, 64, 64, 0),
]


def _module(dtype_name: str):
    import cupy as cp

    from cuflash import build, sources

    names = [f"wgmma_selftest<{dtype_name}, {m}, {k}, {n}, {cb}, {p}>" for (m, k, n, cb, p) in CASES]
    opts = tuple(o for o in build._toolchain().options if not o.startswith("-Xptxas")) + ("-arch=sm_90a",)
    return cp.RawModule(code=SOURCE, options=opts, name_expressions=names, backend="nvrtc"), names


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_warpgroup_gemms_match_numpy(dtype):
    import cupy as cp
    import ml_dtypes

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma needs an sm_90 GPU")
    elem = {"bfloat16": "__nv_bfloat16", "float16": "__half"}[dtype]
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    module, names = _module(elem)
    rng = np.random.default_rng(7)
    for (mode, k, n, cols_b, panel), name in zip(CASES, names):
        rows_a, cols_a = (k, 64) if mode == 2 else (64, k)
        rows_b = n + 32 * panel if mode == 0 else k
        a = rng.uniform(-1, 1, (rows_a, cols_a)).astype(np_dtype)
        b = rng.uniform(-1, 1, (rows_b, cols_b)).astype(np_dtype)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        if mode == 0:
            want = a64 @ b64[32 * panel:].T
        elif mode in (1, 3):
            want = a64 @ b64[:, 64 * panel: 64 * panel + n]
        else:
            want = a64.T @ b64[:, 64 * panel: 64 * panel + n]
        a_dev = cp.asarray(a.view(np.uint16)).view(cp.uint16)
        b_dev = cp.asarray(b.view(np.uint16)).view(cp.uint16)
        c_dev = cp.full((64, n), cp.nan, dtype=cp.float32)
        kernel = module.get_function(name)
        smem = (rows_a * cols_a * 2 + 1023) // 1024 * 1024 + rows_b * cols_b * 2
        kernel.max_dynamic_shared_size_bytes = smem
        kernel((1,), (128,), (a_dev, b_dev, c_dev), shared_mem=smem)
        got = cp.asnumpy(c_dev)
        err = np.abs(got - want).max()
        assert np.isfinite(got).all(), f"{name}: unwritten accumulator elements"
        assert err < 1e-3 * max(1.0, np.abs(want).max()), f"{name}: max error {err}"
