"""Plans for the tensor-core backward (fp16 / bf16, sm_80 and later): ``cuda_src/flash_bwd.cu``.

Launch order::

    deterministic=False: preprocess (zeroes dq_accum*) -> dkdv<atomic dQ> -> convert_dq -> [reduce_dkdv]
    deterministic=True:  preprocess -> dkdv<no dQ> -> dq                             -> [reduce_dkdv]

On sm_90a the deterministic backward orders the dK/dV kernel's dQ adds instead where it can
(:func:`ordered_dq_fits`), and at D256 the default backward takes the deterministic plan (:func:`split_dq`).
(*) Not where the dK/dV kernel stores each query block's first dQ tile instead (:func:`dq_counters`).

With GQA / MQA the dK/dV kernel runs one block per ``dkdv_heads`` query heads of a group (see
:func:`dkdv_heads`: enough blocks to fill the GPU), keeping dK / dV in registers across those heads; when
that is less than the whole group it writes fp32 partials, and ``reduce_dkdv`` sums each group's in a fixed
order. With ``deterministic=True`` no kernel uses float atomics, so two runs are
bit-identical.

Shared-memory sizes are formulas of the template arguments that mirror the ``DkdvConfig`` / ``DqConfig``
layouts in the source. The build compiles each variant with ``-DCUFLASH_EXPECTED_SMEM_BYTES=<smem_bytes>``,
which the kernel's ``CUFLASH_CHECK_SMEM_BYTES`` static_asserts against its layout: a drifted formula fails
the compile, on the CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..arch import arch_caps
from . import HEAD_DIM_BUCKETS, MASK_CAUSAL, MASK_GENERAL, MASK_KINDS, MASK_NONE, is_general, MOD_BIAS, MOD_BIAS_SOFTCAP, SCORE_MODS, has_bias, KernelVariant, Launch, Plan, ProblemShape
from . import block_lists

SOURCE = "flash_bwd.cu"
DTYPES = ("float16", "bfloat16")
ELEM_BYTES = 2  # fp16 and bf16

#: The small memory-bound kernels: 64 rows per block, 4 warps.
SMALL_BLOCK_ROWS = 64

SMALL_NUM_WARPS = 4


def reduce_block_rows(bucket: int) -> int:
    """Key rows per block of the GQA reduce: 1024 / D, so each of its 128 threads sums one 8-column chunk of
    dK and of dV (D256: 4 rows, D128: 8, D64: 16). Its grid has only (Sk / rows) x Hkv x B blocks, and it reads
    every partial once: more blocks put more loads in flight. MQA B2 S1k D256 on an H100: 32 blocks of 64 rows
    left 100 of 132 SMs idle and took 64 us (a fifth of that backward); 16 rows (128 blocks) 15 us full and
    28 us causal, 1.2 TB/s (session 16 run 12)."""
    return max(1, 1024 // bucket)


@dataclass(frozen=True)
class DkdvConfig:
    """One dK/dV variant. The fields, in this order, are the template arguments of
    ``flash_bwd_dkdv_kernel<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kMask, kScoreMod, kAtomicDq, kMainloop>``
    (``cuflash.build.render_name`` renders them)."""

    dtype: str  # "float16" or "bfloat16"
    head_dim: int  # the head-dim bucket
    block_m: int  # queries per step (streamed)
    block_n: int  # keys per CTA (resident)
    num_warps: int
    mask: int  # one of MASK_KINDS (kernels/__init__.py)
    score_mod: int  # MOD_NONE, MOD_SOFTCAP_ALIBI, MOD_BIAS or MOD_BIAS_SOFTCAP
    atomic_dq: bool  # also accumulate dQ with float atomics (the default, non-deterministic path)
    mainloop: int  # MAINLOOP_SM80 (mma.sync), MAINLOOP_SM90 (wgmma), MAINLOOP_SM90_WS (warp-specialized) or
    # MAINLOOP_SM90_WS_ORDERED (that one with ordered dQ adds under a general mask)

    @property
    def wgmma(self) -> bool:
        return self.mainloop != MAINLOOP_SM80


@dataclass(frozen=True)
class DqConfig:
    """One dQ-kernel variant: the template arguments of
    ``flash_bwd_dq_kernel<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kMask, kScoreMod, kMainloop>``, in order."""

    dtype: str
    head_dim: int
    block_m: int  # queries per CTA (resident)
    block_n: int  # keys per step (streamed)
    num_warps: int
    mask: int
    score_mod: int
    mainloop: int  # DQ_MAINLOOP_SM80 (mma.sync) or DQ_MAINLOOP_SM90 (wgmma)


@dataclass(frozen=True)
class SmallConfig:
    """The memory-bound helper kernels (pre-pass, dQ convert, GQA dK/dV reduce): the template arguments
    of ``flash_bwd_{preprocess,convert_dq,reduce_dkdv}_kernel<Elem, kHeadDim, kBlockM, kNWarps>``, in order
    (the reduce kernel calls its rows kBlockN: they are keys; the convert adds ConvertDqConfig's field)."""

    dtype: str
    head_dim: int
    block_rows: int = SMALL_BLOCK_ROWS  # query rows (key rows for the reduce) per CTA
    num_warps: int = SMALL_NUM_WARPS


@dataclass(frozen=True)
class ConvertDqConfig(SmallConfig):
    """The dQ convert: SmallConfig's arguments, then ``kSwizzledDq`` (dq_accum's rows in the order the
    warp-specialized dK/dV kernel stages them: ``dq_accum_chunk`` in cuda_src/cuflash/bwd_config.cuh)."""

    swizzled: bool = False


@dataclass(frozen=True)
class BwdTile:
    block_m: int  # queries per block (streamed in the dK/dV kernel, resident in the dQ kernel)
    block_n: int  # keys per block (resident in the dK/dV kernel, streamed in the dQ kernel)
    num_warps: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _tier(arch: int) -> str:
    """Which tile table serves ``arch``: by the shared memory one block may have (cuflash.arch)."""
    caps = arch_caps(arch)
    if not caps.has_cp_async:
        raise ValueError(f"arch={arch}: the tensor-core backward needs sm_80 or later")
    limit = caps.smem_per_block
    if limit >= 227 * 1024:
        return "hopper"
    if limit >= 163 * 1024:
        return "ampere"
    return "small"


# The dK/dV kernel: a warp owns 16 keys; kBlockN / 16 key groups, and kNWarps / (kBlockN / 16) warps per
# group split the head dim (1 up to head dim 128: P^T, dS^T stay in registers for dK/dV). Per-thread fp32
# accumulators: (kHeadDim + kBlockM) / warps_per_group (dK + dV + S^T + dP^T). About 192 is the most 255
# registers hold without spilling (ptxas front-loads ldmatrix results); every variant below compiles with
# zero spills on sm_80 and sm_90a. Shared memory: atomic-path sizes (the deterministic ones are smaller).
#   32: 128 x 128, 8 warps: 32 + 128 accumulators; tiny GEMMs, so big tiles amortize barriers, lse / D
#       reads and the pipeline issue (82 KB).
#   64: 64 x 128, 8 warps (64 + 64 accumulators, 81 KB). FA2's 128 x 128 (64 + 128) spills here under
#       the atomic dQ step, and costs only ~3% fewer ldmatrix per FLOP.
#   96: 64 x 128, 8 warps (96 + 64; 113 KB); 32 x 128 on 99 KB parts (81 KB).
#  128: 64 x 128, 8 warps (FA2's hdim128 tile: 128 + 64 accumulators, 145 KB, fits A100's 163 KB);
#       99 KB parts: 32 x 64, 8 warps as 4 key groups x 2 head-dim halves (73 KB).
#  160-256: 64 x 64, 8 warps = 4 key groups x 2 head-dim halves ((kHeadDim + 64) / 2 <= 160
#       accumulators). Q/dO double-buffered: 137 / 162 / 185 / 209 KB. A100 (163 KB) takes 64 x 64 up to
#       192, 32 x 32 x 4 warps at 224 (89 KB) and 32 x 64 x 8 at 256 (137 KB); 99 KB parts 32 x 64 at 160
#       (89 KB), 32 x 32 x 4 warps above (77 / 89 / 99 KB, the last one sharing the P^T / dS^T buffer).
_DKDV_TILES = {
    "hopper": {32: (128, 128, 8), 64: (64, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8),
               160: (64, 64, 8), 192: (64, 64, 8), 224: (64, 64, 8), 256: (64, 64, 8)},
    "ampere": {32: (128, 128, 8), 64: (64, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8),
               160: (64, 64, 8), 192: (64, 64, 8), 224: (32, 32, 4), 256: (32, 64, 8)},
    "small": {32: (128, 128, 8), 64: (64, 128, 8), 96: (32, 128, 8), 128: (32, 64, 8),
              160: (32, 64, 8), 192: (32, 32, 4), 224: (32, 32, 4), 256: (32, 32, 4)},
}

# The deterministic dQ kernel: a warp owns 16 queries (kBlockM / 16 groups), K/V double-buffered, Q/dO
# resident. Per-thread accumulators: (kHeadDim + 2 * kBlockN) / warps_per_group (dQ + S + dP).
#   32: 128 x 128 (16 + 128; 48 KB). 64, 96: 128 x 64 (32 + 64, 48 + 64; 64 / 96 KB).
#   128: 128 x 64 (64 + 64; 128 KB) on sm80 / sm90, 64 x 64 x 4 warps on 99 KB parts (96 KB).
#   160-256: 64 x 64, 8 warps = 4 query groups x 2 head-dim halves, dS through shared memory
#   (128 / 152 / 176 / 200 KB); A100 64 x 32 above 192 (116 / 132 KB); 99 KB parts 64 x 32 at 160
#   (84 KB) and 32 x 32 x 4 warps above (74 / 86 / 98 KB).
_DQ_TILES = {
    "hopper": {32: (128, 128, 8), 64: (128, 64, 8), 96: (128, 64, 8), 128: (128, 64, 8),
               160: (64, 64, 8), 192: (64, 64, 8), 224: (64, 64, 8), 256: (64, 64, 8)},
    "ampere": {32: (128, 128, 8), 64: (128, 64, 8), 96: (128, 64, 8), 128: (128, 64, 8),
               160: (64, 64, 8), 192: (64, 64, 8), 224: (64, 32, 8), 256: (64, 32, 8)},
    "small": {32: (128, 128, 8), 64: (128, 64, 8), 96: (128, 64, 8), 128: (64, 64, 4),
              160: (64, 32, 8), 192: (32, 32, 4), 224: (32, 32, 4), 256: (32, 32, 4)},
}


#: Register spill (bytes, stores + loads, per ptxas 13.0) a dK/dV variant may show; keyed by (arch, head-dim
#: bucket, mask kind, score_mod, atomic_dq); anything above fails tests/test_build.py. The one entry: D128 on
#: wgmma with a score modifier and the atomic dQ step, no mask (36 + 48 bytes; the same kernel under the
#: causal or general mask allocates spill-free). It stays on wgmma rather than the spill-free mma.sync
#: tile until the two are timed against each other.
SPILL_ALLOWANCE: dict = {(90, 128, 0, 1, True): 84,
                         # The bias (no softcap) on the D128 wgmma tile under the general mask, and the bool-mask
                         # variants at D64 / D128: 12-88 bytes, the larger of ptxas 13.0 (local) and the GPU
                         # machine's NVRTC (2026-11-23), which differ by up to 44 bytes here. The spill-free
                         # alternative (mma.sync 32 x 128) ran the bias backward 1.36x slower (1428 against
                         # 1053 us, B2 H16 S2k D128, H100).
                         (90, 128, 2, 2, True): 96, (90, 128, 2, 2, False): 32,
                         (90, 128, 3, 2, True): 96, (90, 128, 3, 2, False): 48, (90, 64, 3, 0, True): 96,
                         # sm_80 D128 with a bool mask, deterministic: 8 + 12 on the GPU machine's NVRTC (none
                         # with ptxas 13.0).
                         (80, 128, 3, 0, False): 32,
                         # Session 5 (ptxas of NVRTC 13.5): the general kinds read per-sequence lengths (packed
                         # sequences run them) and the dropout kinds (4, 5) draw Philox numbers; the bias variants
                         # of the batched-only kinds moved by 16 bytes with the scratch-stride change. Their cost is
                         # not measured yet; the bool mask + bias atomic variant grew most (36 -> 168 bytes).
                         (90, 128, 1, 2, False): 16,
                         (90, 128, 3, 2, True): 168,
                         (90, 128, 4, 2, False): 48,
                         (90, 128, 5, 0, True): 16,
                         (90, 128, 5, 2, False): 56,
                         (90, 64, 2, 0, True): 52,
                         (90, 64, 5, 0, True): 40,
                         (80, 128, 4, 3, True): 20,
                         (80, 128, 4, 0, False): 32,
                         (80, 128, 4, 0, True): 20,
                         (80, 64, 2, 3, False): 20,
                         # Session 8: the wgmma mainloop's warp-uniform role and unpredicated dQ adds moved three
                         # D128 bias variants 4-16 bytes past their session-5 allowance (NVRTC 13.5: 32, 48, 48;
                         # were 16, 44, 32). Their speed was not timed again (the bias backward is not in the grid).
                         (90, 128, 0, 2, False): 32,
                         (90, 128, 4, 2, True): 48,
                         (90, 128, 5, 2, True): 48,
                         # The warp-specialized mainloop (branch ws-bwd, 2026-11-23): its producer warpgroup runs at
                         # 24 registers (setmaxnreg 24 / 240; at 32 / 232 ptxas serialized the consumers' wgmma) and
                         # spills the atomic path's dQ-add bookkeeping: nvcc 13.0 measured 44 / 44 / 124 (D128 none /
                         # causal / general) and 84 / 84 / 156 (D64), +16 for NVRTC's allocation. The none / causal
                         # ones now carry the ordered dQ adds (their entries below). Session 10: with the dQ add
                         # after the step's load issue (3dae20c) the general ones spill 188 / 200 bytes (NVRTC
                         # 13.5); that is the tree timed as the default there (RESULTS.md, session 10 run 14).
                         # Session 11: the transposed mask form reading ids once per key and query (mask.cuh,
                         # kByRows) moved the D64 one to 216 (D128 unchanged).
                         (90, 128, 2, 0, True): 188, (90, 64, 2, 0, True): 216,
                         # Session 9: with the producer publishing each stage before its next load issue (f2ca187),
                         # the deterministic D128 variant's producer spills 12 + 20 bytes (NVRTC 13.5; 24 registers).
                         # That is the tree timed at 1.02-1.13x the 8-warp mainloop (RESULTS.md, session 9 run 2).
                         (90, 128, 0, 0, False): 32,
                         # Session 9: the mma.sync variant with dropout, bias and softcap at D128 on sm_90a spills
                         # 8 + 12 bytes (NVRTC 13.5) since the dK/dV mainloops share probs_and_dscores (93dcc3e).
                         # Not timed (the combination is not in any bench).
                         (90, 128, 4, 3, True): 20,
                         # Session 10: the ordered dQ adds of the deterministic backward (a counter wait, a bulk add
                         # sized to the sequence, a release; causal ranks from the mask) in the producer at 24
                         # registers, issued after the step's loads, NVRTC 13.5: D128 none / causal 128 / 80, D64
                         # 188 / 112 bytes (session 8's plain atomic path: 60 / 100). The tree timed at 1.07-1.36x
                         # the dQ-kernel deterministic backward (RESULTS.md, session 10 run 3).
                         (90, 128, 0, 0, True): 128, (90, 128, 1, 0, True): 80,
                         (90, 64, 0, 0, True): 188, (90, 64, 1, 0, True): 112}
# Session 12: the GPU machine's NVRTC (its ptxas spills as nvcc 13.0 does) spills more than NVRTC 13.5 (CI's)
# in these; each entry is the larger of the two (the H100's compile log and nvcc 13.0 for sm_80, RESULTS.md
# session 12 run 3). The general-mask ones (612 / 368 bytes against 13.5's 216 / 188) are the kernels the
# GPU machine timed; their cost against NVRTC 13.5's is not measured yet.
for _key, _bytes in {(90, 64, 1, 0, True): 136, (90, 64, 2, 0, True): 612, (90, 64, 2, 0, False): 204,
                     (90, 64, 4, 0, True): 32, (90, 128, 1, 0, True): 96, (90, 128, 2, 0, True): 368,
                     (90, 128, 2, 0, False): 140, (90, 128, 3, 2, False): 56, (90, 128, 3, 3, True): 20,
                     (90, 128, 4, 2, False): 76, (90, 128, 5, 2, False): 132, (80, 64, 5, 3, True): 20,
                     (80, 128, 4, 3, True): 32}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 14: dbias read from the dS^T tile without bank conflicts (bias.cuh, store_dbias_tile) moved two
# variants that no bench runs past their allowance on nvcc 13.0 (the GPU machine's compiler): sm_90a D128, the
# bias under dropout kind 5, 24 -> 56 bytes (NVRTC 13.5: 28); sm_80 D64, bias + softcap under dropout kind 4,
# 0 -> 32 (NVRTC 13.5: 0).
# The dK/dV epilogue's 16-byte stores (f6c7d1d, shuffles in a quad) moved three more of that kind: sm_90a D128
# bias under dropout kind 4, 40 -> 52 (nvcc 13.0) / 0 -> 60 (NVRTC 13.5); bool mask + bias + softcap 20 -> 32
# (nvcc; NVRTC 0); dropout kind 5 + bias + softcap 0 -> 20 (nvcc; NVRTC 0), all on the mma.sync 32 x 128 tile or
# the 8-warp wgmma one; none is in a bench.
for _key, _bytes in {(90, 128, 5, 2, True): 56, (80, 64, 4, 3, True): 32, (90, 128, 4, 2, True): 60,
                     (90, 128, 3, 3, True): 32, (90, 128, 5, 3, True): 20}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 17: the bias (no softcap) at D128 on the warp-specialized mainloop (its atomic path stages the bias in the dS
# tiles; without the dQ step in DkdvConfig's own tiles): the producer's copy of the bias tile at 24 registers spills
# in the producer; none / causal keep the consumers' loop at 2 spill instructions. The general-mask ones also spill in
# the consumers (nvcc 13.0: 46 spill instructions in the atomic loop, 89 in the deterministic one; NVRTC 13.5: 42,
# -); their speed is not measured. Each entry the larger of NVRTC 13.5 and nvcc 13.0 (the GPU machine's compiler).
for _key, _bytes in {(90, 128, 0, 2, True): 224, (90, 128, 1, 2, True): 188, (90, 128, 2, 2, True): 408,
                     (90, 128, 2, 2, False): 364, (90, 128, 1, 2, False): 16}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 22: K / V / Q / dO by TMA, the producer (24 registers) issuing boxes beside its cp.async paths for lse /
# D: the larger of NVRTC 13.5 and nvcc 13.0 (the GPU machine's NVRTC 13.0 gave the D64 one 220 bytes, as nvcc
# does; most of its spill instructions sit in the producer, after its setmaxnreg). The D64 and D128 ones are timed:
# faster than before (D64-S4k-full dK/dV 0.967x, D128 0.88-0.97x; H200, RESULTS.md session 22).
for _key, _bytes in {(90, 64, 1, 0, True): 180, (90, 128, 0, 0, True): 176, (90, 128, 1, 0, True): 144,
                     (90, 128, 2, 2, True): 444, (90, 64, 0, 0, True): 220}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 23: the ranged mask forms beside the per-element test of unsorted ids (mask.cuh, kRanged): the
# warp-specialized general-mask kernels went down (D128 136 -> 96, bias 180 -> 16 bytes, nvcc 13.0); the mma.sync
# 32 x 128 one with ids + bias + softcap (not timed) up, 0 -> 32 bytes (the GPU machine's NVRTC 13.0 and nvcc
# 13.0 agree) and 0 -> 20 on sm_80. The larger of NVRTC 13.5 and nvcc 13.0.
for _key, _bytes in {(90, 128, 2, 3, True): 32, (80, 128, 2, 3, True): 20}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 25: the ordered dQ adds on a warp of their own (dkdv_mainloop_sm90_ws.cuh, dq_writer_warp) instantiate
# the producer twice (loads with and without the adds); both spill in the producer's 24 registers, the consumers
# not at all. Timed on an H200 (NVRTC 13.0): the atomic dK/dV 0.998-1.007x its time before, the deterministic
# one 0.73-0.80x (RESULTS.md session 25). The larger of NVRTC 13.5, nvcc 13.0 and the GPU machine's NVRTC 13.0.
# Session 26: the unmasked ordered adds' staggered grid (chunked_grid_order, in the kernel's prologue) moved the D128
# bias variant (deterministic without a mask; in no bench) from 256 to 272 bytes (the GPU machine's NVRTC 13.0;
# nvcc 13.0 268, NVRTC 13.5 264). The others kept their counts.
for _key, _bytes in {(90, 64, 0, 0, True): 276, (90, 64, 1, 0, True): 252, (90, 128, 0, 0, True): 240,
                     (90, 128, 0, 2, True): 272, (90, 128, 1, 0, True): 196, (90, 128, 1, 2, True): 228}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 32: lse read in the exp2 domain from the pre-pass (lse_log2) moved the D128 dropout-kind-5 atomic variant on
# the 8-warp wgmma tile (no score modifier; in no bench) from 16 to 40 bytes (16 + 24: the GPU machine's NVRTC 13.0
# and nvcc 13.0 agree); its D64 twin went 16 -> 32 (allowance 40). The warp-specialized producers went down.
SPILL_ALLOWANCE[(90, 128, 5, 0, True)] = max(SPILL_ALLOWANCE.get((90, 128, 5, 0, True), 0), 40)
# Session 38: the dK/dV walk over a step's scores for dbias skipped where the backward makes none (bias_grad=False;
# score_mod.cuh grad_transposed) moved sm_80's D64 causal bias + softcap deterministic variant (in no bench) from 0
# to 16 bytes (NVRTC 13.x of the CI install). The test inside store_grad instead spilled nothing but left the
# per-element offset math running: 1.09 ms against 0.37 without a bias (B2 H16 S2k D128, H200).
SPILL_ALLOWANCE[(80, 64, 1, 3, False)] = max(SPILL_ALLOWANCE.get((80, 64, 1, 3, False), 0), 16)
# Session 39: the D64 bias dK/dV on the warp-specialized tile (302-362 bytes atomic, 16-244 deterministic; the D128
# bias WS kernel's producer spills alike, 252-444) and the dbias tile adds (bias.cuh DbiasOut) beside the mma.sync /
# 8-warp wgmma bias + ALiBi / softcap, bool-mask and dropout variants (4-44 bytes; none in a bench). NVRTC 13.0.
# Measured with these spills (H200, backward only, B4 S2k H16 D64, a (1, 1, S, S) bias with dbias): 2.19 -> 1.28 ms.
# NVRTC 13.5 (the CI install's) spills more in two of them: the D64 WS bias with a general mask 358 bytes (334 under
# 13.0) and the mma.sync D64 bias + softcap with a general mask 20 (0 under 13.0; session 39's CPU CI replica).
# The keys bias's per-warp query sums (bias.cuh add_grad_over_queries, branch dbias-keys) raised the D64 ones with a
# general mask (window / ids; no bench times them): the WS ones 334 / 244 -> 398 / 304 bytes under NVRTC 13.0 (358 /
# 48 under 13.5), the mma.sync bias + softcap one 20 -> 32 under 13.5 (0 under 13.0). Not measured.
for _key, _bytes in {(90, 64, 0, 2, True): 362, (90, 64, 0, 2, False): 16, (90, 64, 1, 2, True): 302,
                     (90, 64, 1, 2, False): 32, (90, 64, 2, 2, True): 398, (90, 64, 2, 2, False): 304,
                     (90, 64, 2, 3, True): 32, (90, 64, 3, 3, True): 8, (90, 64, 4, 3, True): 20,
                     (90, 64, 5, 3, True): 44,
                     (90, 128, 3, 3, True): 40, (90, 128, 4, 2, True): 64, (90, 128, 5, 3, True): 40,
                     (80, 64, 3, 3, True): 8, (80, 128, 3, 3, True): 8, (80, 128, 5, 3, True): 8}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 41: a key bias's deterministic partials (a term per query head within its bias head, bias.cuh
# add_grad_over_queries) took the mma.sync D64 bias + softcap dropout-and-bool-mask variant (in no bench) 44 -> 72
# bytes under NVRTC 13.0, and under NVRTC 13.5 (the CI install's; session 41's CPU CI replica) the wgmma D128 bias
# variant with a bool mask, deterministic (in no bench), to 68 (56 under 13.0); every other bf16 D64 / D128 bias
# dK/dV variant stays within its allowance.
SPILL_ALLOWANCE[(90, 64, 5, 3, True)] = max(SPILL_ALLOWANCE[(90, 64, 5, 3, True)], 72)
SPILL_ALLOWANCE[(90, 128, 3, 2, False)] = max(SPILL_ALLOWANCE[(90, 128, 3, 2, False)], 68)
# Session 42: the dbias turns (dbias_order.cuh) in the deterministic bias variants of every general kind (a window,
# dropout, ids and a bool mask; in no bench): mma.sync tiles with a bias + softcap, sm_90a D128 dropout 8 bytes
# (NVRTC 13.0) / 20 (13.5), bool mask + dropout 8 / 20, D64 dropout 12 / 0, D64 window or ids 0 / 8, D64 bool mask
# 8 / 0; the 8-warp wgmma D128 bias with a bool mask 96 / 72. sm_80: none.
for _key, _bytes in {(90, 128, 4, 3, False): 20, (90, 128, 5, 3, False): 20, (90, 64, 4, 3, False): 12,
                     (90, 64, 2, 3, False): 8, (90, 64, 3, 3, False): 8, (90, 128, 3, 2, False): 96}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 53: the general masks' dK/dV grid in chunks of heads (chunked_grid_order, as under causal) took the D64 WS
# bias variant with a general mask from 390 to 414 bytes under nvcc 13.0 (the GPU machine's NVRTC spills as it does;
# 370 -> 382 under NVRTC 13.5), none of them in the per-step loop (the same 13 loads / 17 stores there). Not timed.
SPILL_ALLOWANCE[(90, 64, 2, 2, True)] = max(SPILL_ALLOWANCE[(90, 64, 2, 2, True)], 414)
del _key, _bytes
#: Session 43: the general mask's ordered warp-specialized dK/dV variants (MAINLOOP_SM90_WS_ORDERED, only the
#: deterministic plan's), per (arch, head dim, score modifier), against the default variants' 168 bytes that leave the
#: ordered path out. Session 44 (add_rank reads the list row through GeneralMaskOf::kv_list_of; the bias variants
#: carry the dbias turns): the producer (24 registers) spills 340 / 332 bytes (D128 / D64, NVRTC 13.0) and 356 / 368
#: (13.5); with a bias 602 / 698 (13.0) and 478 / 658 (13.5); the default general-mask bias variants allow 444 / 398.
#: Measured with them: benchmarks/RESULTS.md, sessions 43 and 44.
ORDERED_SPILL_ALLOWANCE: dict = {(90, 128, 0): 356, (90, 64, 0): 368, (90, 128, 2): 602, (90, 64, 2): 698}


def spill_allowance(arch: int, config) -> int:
    """The spill bytes (stores + loads) a dK/dV variant's build may report (SPILL_ALLOWANCE)."""
    if config.mainloop == MAINLOOP_SM90_WS_ORDERED:
        return ORDERED_SPILL_ALLOWANCE.get((arch, config.head_dim, config.score_mod), 0)
    return SPILL_ALLOWANCE.get((arch, config.head_dim, config.mask, config.score_mod, config.atomic_dq), 0)

#: The dK/dV kernel's mainloops (DkdvMainloopKind in cuda_src/flash_bwd.cu): mma.sync; wgmma with every
#: thread loading; wgmma behind a producer warpgroup (loads and the dQ adds; cuflash/dkdv_mainloop_sm90_ws.cuh).
MAINLOOP_SM80, MAINLOOP_SM90, MAINLOOP_SM90_WS = 0, 1, 2
#: The warp-specialized mainloop under a general mask with its ordered dQ adds compiled in (the deterministic
#: plan's; flash_bwd.cu's kDkdvMainloopSm90WsOrdered). The default general-mask kernels are built without them.
MAINLOOP_SM90_WS_ORDERED = 3
WS_MAINLOOPS = (MAINLOOP_SM90_WS, MAINLOOP_SM90_WS_ORDERED)
#: The producer warpgroup of the warp-specialized mainloop, on top of the tile's math warps.
PRODUCER_THREADS = 128

#: Head-dim buckets whose dK/dV kernel runs on wgmma on sm_90a: whole 64-column panels, split evenly
#: between the two warpgroups at head dim 256. The wgmma path reads each shared-memory operand once per
#: warpgroup instead of once per warp; the mma.sync path is bound by shared-memory bandwidth (ncu, D128:
#: L1/shared 74% busy, SM 39%). 192 would need a 96-column (1.5-panel) half per warpgroup.
WGMMA_BUCKETS = (64, 128, 256)


def uses_wgmma(arch: int, head_dim_bucket: int, score_mod: int = 0) -> bool:
    """Whether the dK/dV kernel of this bucket takes the sm_90a warpgroup (wgmma) path. Not at D64 with a
    softcap or ALiBi: its 128-query tile would add 64 registers of softcap factors to 192 accumulators (a bias
    alone needs none; it takes the warp-specialized tile, see dkdv_mainloop)."""
    if score_mod and score_mod != MOD_BIAS and head_dim_bucket == 64:
        return False
    if score_mod == MOD_BIAS_SOFTCAP and head_dim_bucket == 128:
        # The bias reads on top of S^T, dP^T, the softcap factors and dK / dV spilled 100-650 bytes on the
        # 64 x 128 wgmma tile (ptxas 13.0); the mma.sync 32 x 128 tile spills nothing. Without the softcap
        # (no factor per score) the wgmma tile keeps (SPILL_ALLOWANCE).
        return False
    return arch_caps(arch).has_wgmma and head_dim_bucket in WGMMA_BUCKETS


# The dK/dV tiles of the wgmma path (sm_90a), 8 warps = 2 warpgroups of 64 keys each:
#   64: 128 queries x 128 keys. S^T / dP^T are m64n128 per warpgroup (64 + 64 accumulators) on top of
#       dK + dV (32 + 32): twice the GEMM work per query block of the 64-query tile for the same
#       barriers, exp bookkeeping and K / V residency, and the dQ step splits by query panel (one atomic
#       per dq element per block instead of two). 130 KB.
#  128: 64 x 128 (the mma.sync tile): dK + dV are already 64 + 64 accumulators. 145 KB.
#  256: 64 x 64 (the mma.sync tile): both warpgroups compute S^T / dP^T for all 64 keys and their
#       32-query half, exchange P^T / dS^T through shared memory, and each keeps dK / dV for all keys
#       and its 128-column half (64 + 64 accumulators). 209 KB.
_DKDV_TILES_WGMMA = {64: (128, 128, 8), 128: (64, 128, 8), 256: (64, 64, 8)}


def tile_sm80(arch: int, head_dim_bucket: int, causal: bool, score_mod: int = 0, wgmma: bool | None = None) -> BwdTile:
    """(kBlockM, kBlockN, kNWarps) of the dK/dV kernel; the reasons are in the tables' comments.

    Causal uses the same tiles: only the diagonal blocks pay for the mask, and smaller tiles would not
    shorten the (already longest-first) schedule enough to pay for more barriers per FLOP. A score
    modifier keeps its backward factor per score (softcap), which moves D32 and D64 to smaller tiles.
    """
    del causal
    if wgmma is None:
        wgmma = uses_wgmma(arch, head_dim_bucket, score_mod)
    if wgmma:
        return BwdTile(*_DKDV_TILES_WGMMA[head_dim_bucket])
    if score_mod and head_dim_bucket == 32:
        # The softcap factors of 128 queries (32 registers) push the 128 x 128 tile past 255 (28 bytes of
        # spill, sm_90a); 64 queries: 191 registers.
        return BwdTile(64, 128, 8)
    if score_mod and head_dim_bucket in (96, 128) and _tier(arch) != "small":
        # mma.sync (sm_80; sm_90a keeps D128 on wgmma): 64 queries spill 12-124 bytes with the factors.
        return BwdTile(32, 128, 8)
    return BwdTile(*_DKDV_TILES[_tier(arch)][head_dim_bucket])


#: The dQ kernel's mainloops (its kMainloop template argument): mma.sync, or wgmma (sm_90a).
DQ_MAINLOOP_SM80, DQ_MAINLOOP_SM90 = 0, 1

#: The wgmma dQ tile, by head-dim bucket: a warpgroup per 64 queries, all head-dim columns of their dQ in
#: registers (D256: 128 accumulators per thread), K / V double-buffered. 256: 128 queries x 32 keys, 8 warps:
#: Q and dO resident (128 KB) and two stages of K, V (64 KB); 64-key stages would not fit beside them.
_DQ_TILES_WGMMA = {256: (128, 32, 8)}


def dq_uses_wgmma(arch: int, head_dim_bucket: int, mask: int, score_mod: int) -> bool:
    """Whether the dQ kernel of this variant runs the wgmma mainloop (cuda_src/cuflash/dq_mainloop_sm90.cuh):
    sm_90a, the buckets with a wgmma dQ tile, without a score modifier or the bool mask / dropout kinds (the
    masks whose dK/dV kernel takes the warp-specialized mainloop)."""
    return (arch_caps(arch).has_wgmma and head_dim_bucket in _DQ_TILES_WGMMA and score_mod == 0
            and mask in (MASK_NONE, MASK_CAUSAL, MASK_GENERAL))


def split_dq(arch: int, head_dim_bucket: int, mask: int, score_mod: int) -> bool:
    """Whether the default (non-deterministic) backward computes dQ in the dQ kernel, as the deterministic one
    does, instead of the dK/dV kernel's atomic step. H100, B4 H8 S4k D256 (session 18, ncu): the dK/dV kernel
    ran 4890 us with the atomic step and 2167 us without it: its 64-key tile adds 64 KB of fp32 partials into
    dq_accum per 10.5 MFLOP step (twice D128's bytes per FLOP), and those adds, not the GEMMs, set its pace.
    The wgmma dQ kernel recomputes S and dP instead. The two modes are then one plan (bit-identical)."""
    return dq_uses_wgmma(arch, head_dim_bucket, mask, score_mod)


def dq_tile_sm80(arch: int, head_dim_bucket: int, causal: bool, score_mod: int = 0) -> BwdTile:
    """(kBlockM, kBlockN, kNWarps) of the deterministic dQ kernel. The bias variant's reads (hoisted ahead
    of the exp by ptxas) spilled 40-148 bytes at D32 (128 x 128) and 16-52 at D128 (128 x 64) on sm_90a:
    those take 128 x 64 and 64 x 64 (spill-free)."""
    del causal
    tile = _DQ_TILES[_tier(arch)][head_dim_bucket]
    if has_bias(score_mod) and head_dim_bucket == 32 and tile[:2] == (128, 128):
        return BwdTile(128, 64, 8)
    if has_bias(score_mod) and head_dim_bucket == 128 and tile == (128, 64, 8):
        return BwdTile(64, 64, 8)
    return BwdTile(*tile)


def dkdv_smem_bytes(head_dim: int, block_m: int, block_n: int, num_warps: int, atomic_dq: bool,
                    bias: bool = False, bias_in_ds: bool = False) -> int:
    """Mirror of ``DkdvConfig::kSmemBytes`` (cuda_src/cuflash/bwd_config.cuh).

    K, V: block_n x head_dim each; Q, dO: block_m x head_dim, two stages each; P^T and dS^T tiles
    (block_n x block_m) when the head dim is split across warps (dS^T also for the atomic dQ step; one
    shared tile for both when block_n <= 32); lse and softmax_d: block_m floats, two stages each; with a
    bias, two stages of its (block_m x block_n) tile, rows padded by 16 bytes (cuflash/bias.cuh), unless
    ``bias_in_ds`` (the warp-specialized atomic path stages it in its dS tiles: no bytes of its own).
    """
    bias_bytes = 2 * block_m * (block_n * ELEM_BYTES + 16) if bias and not bias_in_ds else 0
    warps_d = num_warps // (block_n // 16)
    share_p = warps_d > 1 and block_n <= 32
    has_p = warps_d > 1 and not share_p
    has_ds = warps_d > 1 or atomic_dq
    tile_k = block_n * head_dim * ELEM_BYTES
    tile_q = block_m * head_dim * ELEM_BYTES
    tile_p = block_n * block_m * ELEM_BYTES
    return 2 * tile_k + 4 * tile_q + (int(has_p) + int(has_ds)) * tile_p + 4 * block_m * 4 + bias_bytes


def dq_smem_bytes(head_dim: int, block_m: int, block_n: int, num_warps: int) -> int:
    """Mirror of ``DqConfig::kSmemBytes``: Q, dO once; K, V two stages each; a dS tile (block_m x
    block_n) when the head dim is split across warps."""
    warps_d = num_warps // (block_m // 16)
    tile_q = block_m * head_dim * ELEM_BYTES
    tile_k = block_n * head_dim * ELEM_BYTES
    return 2 * tile_q + 4 * tile_k + (block_m * block_n * ELEM_BYTES if warps_d > 1 else 0)


def _check_fits(variant: KernelVariant, arch: int) -> KernelVariant:
    limit = arch_caps(arch).smem_per_block
    if variant.smem_bytes > limit:
        raise ValueError(f"{variant.name} {variant.config} needs {variant.smem_bytes} bytes of shared "
                         f"memory, more than the {limit} an sm_{arch} block can have")
    return variant


def preprocess_variant(dtype: str, bucket: int) -> KernelVariant:
    return KernelVariant(SOURCE, "cuflash::flash_bwd_preprocess_kernel", SmallConfig(dtype, bucket),
                         SMALL_NUM_WARPS * 32, 0)


def convert_dq_variant(dtype: str, bucket: int, swizzled: bool = False) -> KernelVariant:
    return KernelVariant(SOURCE, "cuflash::flash_bwd_convert_dq_kernel",
                         ConvertDqConfig(dtype, bucket, swizzled=swizzled), SMALL_NUM_WARPS * 32, 0)


def stages_dq(dkdv: KernelVariant) -> bool:
    """Whether a dK/dV variant adds its dQ through the warp-specialized mainloop's staging tiles, whose rows it
    writes in dq_accum_chunk's order (DkdvMainloopSm90Ws::kStagedDq: the atomic step without the head-dim split
    of the D256 tile, which adds from registers)."""
    c = dkdv.config
    warps_d = c.num_warps // (c.block_n // 16)
    return c.mainloop in WS_MAINLOOPS and c.atomic_dq and warps_d == 1


def reduce_dkdv_variant(dtype: str, bucket: int) -> KernelVariant:
    return KernelVariant(SOURCE, "cuflash::flash_bwd_reduce_dkdv_kernel", SmallConfig(dtype, bucket, reduce_block_rows(bucket)),
                         SMALL_NUM_WARPS * 32, 0)


def ws_fits(bucket: int, mask: int, score_mod: int) -> bool:
    """Whether a dK/dV variant takes the warp-specialized mainloop on sm_90a: the 8-warp tiles (D64, D128 with
    whole query blocks per warpgroup; D256 with the head dim split over them, ws_exchanges), without a bool mask
    or dropout (their staged tiles and per-score state do not fit beside the producer's stages and dQ tiles),
    and without a score modifier but a bias alone at D64 / D128 (its tile staged in the dS tiles on the atomic
    path; D64 with a softcap or ALiBi is on mma.sync). H100 (session 18, ncu): D256 without the dQ step 0.835x
    the 8-warp mainloop's time, with the atomic step 0.97-0.98x."""
    return (bucket in (64, 128, 256) and mask in (MASK_NONE, MASK_CAUSAL, MASK_GENERAL)
            and (score_mod == 0 or (score_mod == MOD_BIAS and bucket in (64, 128))))


def ws_exchanges(bucket: int) -> bool:
    """Whether the warp-specialized dK/dV tile splits the head dim over its two warpgroups (D256: DkdvConfig's
    kWarpsD = 2): P^T and dS^T then go through shared tiles, and the atomic dQ step adds from registers (no
    staging tiles, so no ordered adds)."""
    return bucket == 256


def dkdv_mainloop(arch: int, bucket: int, mask: int, score_mod: int, atomic_dq: bool) -> int:
    """The dK/dV mainloop a variant runs by default: the warp-specialized one where it fits (ws_fits). H100:
    without a dQ step 1.02-1.13x the 8-warp wgmma mainloop (session 9); with the atomic dQ step 0.96-1.01x as
    first built (session 9), then 1.06-1.16x once its producer issued a step's loads before the step's dQ add
    (session 10, run 9; ncu of the 8-warp one, run 8: 2 warps per scheduler, one issue every 3.7 cycles, L2 at
    74% of its throughput under the warps' fp32 atomics). Under the general mask (run 14, B4 S4k H16 D128):
    window 1024 + causal 1.07x, block-causal 512 1.12x, 8 causal documents 0.97x."""
    if not uses_wgmma(arch, bucket, score_mod):
        return MAINLOOP_SM80
    if ws_fits(bucket, mask, score_mod):
        return MAINLOOP_SM90_WS
    if score_mod and bucket == 64:
        # The D64 bias beside a bool mask or dropout on the 8-warp wgmma tile spilled 440-564 bytes (nvcc 13.0
        # NVRTC, session 38): mma.sync, as before.
        return MAINLOOP_SM80
    return MAINLOOP_SM90


def ws_extra_smem_bytes(block_m: int, block_n: int, head_dim: int, atomic_dq: bool) -> int:
    """Mirror of what DkdvMainloopSm90Ws adds to DkdvConfig's layout: a second dS^T tile and two fp32 dQ
    staging tiles (atomic path), or with the exchanged layout (ws_exchanges) a second P^T and dS^T pair, then
    its mbarriers (1 + 2 * 2 stages + 6, rounded to 16 bytes)."""
    tile_p = block_n * block_m * ELEM_BYTES
    if ws_exchanges(head_dim):
        extra = 2 * tile_p
    else:
        extra = (tile_p + 2 * block_m * head_dim * 4) if atomic_dq else 0
    return extra + (11 * 8 + 15) // 16 * 16


def dkdv_variant(arch: int, dtype: str, bucket: int, mask: int, atomic_dq: bool, score_mod: int = 0,
                 mainloop: int | None = None, ordered: bool = False) -> KernelVariant:
    """``ordered``: the deterministic plan's kernel with ordered dQ adds (ordered_dq_fits); under a general mask
    the warp-specialized variant that has them compiled in (MAINLOOP_SM90_WS_ORDERED)."""
    if mainloop is None:
        mainloop = dkdv_mainloop(arch, bucket, mask, score_mod, atomic_dq)
        if ordered and mainloop == MAINLOOP_SM90_WS and is_general(mask):
            mainloop = MAINLOOP_SM90_WS_ORDERED
    if mainloop != MAINLOOP_SM80 and not uses_wgmma(arch, bucket, score_mod):
        raise ValueError(f"no wgmma dK/dV tile for D{bucket} score_mod {score_mod} on sm_{arch}")
    tile = tile_sm80(arch, bucket, mask != 0, score_mod, wgmma=mainloop != MAINLOOP_SM80)
    bias = has_bias(score_mod)
    bias_in_ds = bias and atomic_dq and mainloop in WS_MAINLOOPS  # DkdvConfig's kBiasInDs (flash_bwd.cu)
    smem = dkdv_smem_bytes(bucket, tile.block_m, tile.block_n, tile.num_warps, atomic_dq, bias, bias_in_ds)
    # The bias tiles on top of a table tile chosen without them: halve the streamed queries until it fits
    # (A100 D160-D192 64 x 64: 183 KB with the bias, 32 x 64: 131 KB), keeping 16 queries per warp.
    warps_d = tile.num_warps // (tile.block_n // 16)
    while bias and smem > arch_caps(arch).smem_per_block and tile.block_m // 2 // warps_d >= 16:
        tile = BwdTile(tile.block_m // 2, tile.block_n, tile.num_warps)
        smem = dkdv_smem_bytes(bucket, tile.block_m, tile.block_n, tile.num_warps, atomic_dq, bias)
    threads = tile.num_warps * 32
    if mainloop in WS_MAINLOOPS:
        if not ws_fits(bucket, mask, score_mod):
            raise ValueError(f"no warp-specialized dK/dV mainloop for D{bucket} mask {mask} score_mod {score_mod}")
        smem += ws_extra_smem_bytes(tile.block_m, tile.block_n, bucket, atomic_dq)
        threads += PRODUCER_THREADS
    return _check_fits(KernelVariant(
        SOURCE, "cuflash::flash_bwd_dkdv_kernel",
        DkdvConfig(dtype, bucket, tile.block_m, tile.block_n, tile.num_warps, int(mask), int(score_mod),
                   bool(atomic_dq), int(mainloop)),
        threads, smem), arch)


def dq_variant(arch: int, dtype: str, bucket: int, mask: int, score_mod: int = 0) -> KernelVariant:
    wgmma = dq_uses_wgmma(arch, bucket, mask, score_mod)
    tile = BwdTile(*_DQ_TILES_WGMMA[bucket]) if wgmma else dq_tile_sm80(arch, bucket, mask != 0, score_mod)
    smem = dq_smem_bytes(bucket, tile.block_m, tile.block_n, tile.num_warps)
    return _check_fits(KernelVariant(
        SOURCE, "cuflash::flash_bwd_dq_kernel",
        DqConfig(dtype, bucket, tile.block_m, tile.block_n, tile.num_warps, int(mask), int(score_mod),
                 DQ_MAINLOOP_SM90 if wgmma else DQ_MAINLOOP_SM80),
        tile.num_warps * 32, smem), arch)


#: The cost model of :func:`dkdv_heads`: one SM's backward rate (FLOP/s, ~330 TFLOPS over 132 SMs) and the
#: memory bandwidth the fp32 partials and their reduce see (bytes/s). Only their ratio matters.
_SM_FLOPS = 2.5e12
_PARTIAL_BYTES_PER_S = 2.5e12


def dkdv_heads(shape: ProblemShape, block_m: int, block_n: int, num_sms: int, longest_first: bool = False) -> int:
    """Query heads one dK/dV block accumulates (a divisor of the GQA group size ``H / Hkv``).

    A block keeps its key block's dK / dV in registers across the query heads it walks, so G heads per
    block write G times fewer fp32 partials (none at all, and no reduce kernel, when G is the whole
    group), but the grid has G times fewer, G times longer blocks. Without a causal mask every block has
    the same work, and the model is whole waves of blocks (``ceil(blocks / num_sms) * G`` steps of one
    block_m x block_n tile of the five GEMMs) plus the partials' write-and-reduce traffic; ties go to the
    larger G. With a causal (or general) mask blocks differ (the triangle, a sparse pattern) and merging
    heads lengthens the longest ones: one head per block, except as below. Measured on the H100 (fwd+bwd TFLOPS for G = 1 / 2 / 4 / 8, 2026-11-23): MQA B2 S1k
    H8 D256 full 187 / 208 / 140 / 83 (G = 2 picked), causal 107 / 110 / 71 / 42; GQA 32/8 B4 S4k D128 full
    386 / 398 / 410 (G = 4: no partials, no reduce), causal 340 / 323 / 329.

    ``longest_first`` (causal, the warp-specialized kernel's grid order ``chunked_grid_order`` in bwd_config.cuh):
    the blocks are dispatched longest first, so the makespan is about the larger of all steps over the SMs and
    the longest block's steps, and merged heads cost only where that block gets longer than an SM's share.
    """
    group = shape.num_heads // shape.num_heads_k
    if group == 1 or (shape.skips_blocks and not (longest_first and shape.mask_kind == MASK_CAUSAL)):
        return 1
    step_s = 10.0 * block_m * block_n * shape.head_dim_bucket / _SM_FLOPS  # 5 GEMMs of 2 m n k FLOPs
    if shape.skips_blocks:  # causal, longest first: all steps over the SMs, or G x the longest block's
        steps = _causal_block_steps(shape, block_m, block_n)
        total = sum(steps) * shape.num_heads * shape.batch

        def makespan(g: int) -> float:
            return max(total / num_sms, g * max(steps, default=0))
    else:  # every block alike: whole waves
        key_blocks = _ceil_div(shape.seqlen_k, block_n)
        steps_per_head = _ceil_div(shape.seqlen_q, block_m)  # query blocks each block walks, per head

        def makespan(g: int) -> float:
            return _ceil_div(key_blocks * (shape.num_heads // g) * shape.batch, num_sms) * g * steps_per_head
    best, best_cost = 1, None
    for g in range(1, group + 1):
        if group % g:
            continue
        cost = makespan(g) * step_s
        if g != group:  # fp32 dK and dV partials: written once, read once by the reduce
            cost += 16.0 * shape.batch * (shape.num_heads // g) * shape.seqlen_k * shape.head_dim_bucket \
                / _PARTIAL_BYTES_PER_S
        if best_cost is None or cost <= best_cost * (1 + 1e-9):
            best, best_cost = g, cost
    return best


def _causal_block_steps(shape: ProblemShape, block_m: int, block_n: int) -> list:
    """Query blocks each key block walks per head under causal (bottom-right aligned when Sq != Sk)."""
    num_m = _ceil_div(shape.seqlen_q, block_m)
    offset = shape.seqlen_k - shape.seqlen_q
    steps = []
    for n in range(_ceil_div(shape.seqlen_k, block_n)):
        first_row = n * block_n - offset  # the first query row that sees key block n
        steps.append(num_m - (0 if first_row <= 0 else min(num_m, first_row // block_m)))
    return steps


#: The most query rows a dK/dV block adds into dq_accum at once (kDqAccumBlockRows in bwd_config.cuh).
DQ_ACCUM_BLOCK_ROWS = 128


def dq_accum_shape(shape: ProblemShape, bucket: int) -> tuple:
    """The atomic path's fp32 dQ accumulator: a row of ``bucket`` columns per query row of
    :meth:`ProblemShape.q_scratch` (the kernels address it through ``scratch_strides``), then
    DQ_ACCUM_BLOCK_ROWS rows of slack. The wgmma dK/dV kernel adds whole query blocks with no bounds tests
    (its rows past a sequence and columns past head_dim add +-0: WgmmaDqStep::add) and the pre-pass zeroes
    each sequence's rows up to a whole such block, so the last block of the last head stays inside."""
    return (math.prod(shape.q_scratch(shape.num_heads)) + DQ_ACCUM_BLOCK_ROWS, bucket)


def ordered_dq_fits(arch: int, bucket: int, mask: int, score_mod: int) -> bool:
    """Whether the deterministic backward runs the warp-specialized dK/dV kernel with its dQ step, the adds
    into each query block taken in key-block order (cuda_src/cuflash/dq_order.cuh), instead of a dQ kernel of
    its own: sm_90a, the warp-specialized tiles, and every mask kind (the caller leaves out packed sequences).
    Without a mask the key blocks add into a query block in increasing order; under causal and the general kinds
    from its last visible key block down, ranked under a general mask by the query block's list of the dK/dV tile
    (plan_backward builds it beside the transposed one; with a bias whose dbias adds take turns, both lists are the
    union over the turns' contributors, block_lists.cu). The kernel is the atomic backward's own (which takes the
    warp-specialized mainloop wherever it fits), under a general mask its variant with the ordered path and the
    dbias turns compiled in (dkdv_variant's ``ordered``)."""
    return dkdv_mainloop(arch, bucket, mask, score_mod, True) == MAINLOOP_SM90_WS and not ws_exchanges(bucket)


def dq_order_counters(shape: ProblemShape, block_m: int) -> int:
    """The dQ adds' counters per (batch, query head): one per query block of the dK/dV tile."""
    return _ceil_div(shape.seqlen_q, block_m)


def dq_counters(shape: ProblemShape, bucket: int, dkdv: KernelVariant, ordered: bool) -> tuple:
    """dq_accum with the dQ adds' counters after its rows and slack (int32 in float32 slots, rounded up to whole
    rows; cuda_src/cuflash/dq_order.cuh), and the fields that locate them: for the ordered adds of the
    deterministic backward, and for the default backward's first stores (on a warp-specialized dK/dV kernel that
    stages its dQ, batched layout: stages_dq and not packed). With the counters, where the kernels find Q / dO
    by TMA (no bias copied by the producer's threads), the pre-pass leaves dq_accum unzeroed, each query block's
    first add stores, and the convert writes zeros where nothing was added (dq_order::first_store)."""
    rows, width = dq_accum_shape(shape, bucket)
    block_m = dkdv.config.block_m
    if block_m % SMALL_BLOCK_ROWS:  # the convert tests one counter per block of its rows
        raise AssertionError(f"dK/dV query blocks of {block_m} rows straddle the convert's {SMALL_BLOCK_ROWS}")
    blocks_per_head = dq_order_counters(shape, block_m)
    scratch = ("dq_accum", (rows + _ceil_div(shape.batch * shape.num_heads * blocks_per_head, width), width))
    fields = [("dq_order_offset", rows * width), ("dq_order_blocks", blocks_per_head), ("dq_order_rows", block_m),
              ("dq_ordered", int(ordered))]
    return scratch, fields


def plan_backward(shape: ProblemShape, arch: int, deterministic: bool, num_sms: int = 132) -> Plan:
    if shape.dtype not in DTYPES:
        raise ValueError(f"dtype={shape.dtype!r}: the tensor-core backward takes float16 or bfloat16")
    if shape.num_heads % shape.num_heads_k != 0:
        raise ValueError(f"num_heads_k={shape.num_heads_k} does not divide num_heads={shape.num_heads}")
    bucket = shape.head_dim_bucket
    b, h, hk = shape.batch, shape.num_heads, shape.num_heads_k
    sq, sk = shape.seqlen_q, shape.seqlen_k
    dtype, mask, mod = shape.dtype, shape.mask_kind, shape.score_mod
    general = is_general(mask)

    launches = [Launch(preprocess_variant(dtype, bucket), (_ceil_div(sq, SMALL_BLOCK_ROWS), h, b))]
    # softmax_d and lse_log2 (the pre-pass writes both; the dK/dV kernels read lse from lse_log2).
    scratch = [("softmax_d", shape.q_scratch(h)), ("lse_log2", shape.q_scratch(h))]
    fields = []

    def add_lists(kernel: KernelVariant, transposed: bool) -> None:
        """The general mask's pre-pass for ``kernel``'s tile, before it."""
        pre, lists, list_fields = block_lists.lists_for(b, sq, sk, kernel.config.block_m, kernel.config.block_n,
                                                        transposed, shape.mask_heads, not shape.packed)
        launches.append(pre)
        scratch.append(lists)
        fields.extend(list_fields)

    ordered = deterministic and not shape.packed and ordered_dq_fits(arch, bucket, mask, mod)
    separate_dq = (deterministic and not ordered) or split_dq(arch, bucket, mask, mod)  # dQ in the dQ kernel
    dkdv = dkdv_variant(arch, dtype, bucket, mask, not separate_dq, mod, ordered=ordered)  # the default's, or its
    # ordered variant (a general mask)
    if general:  # the query blocks of each key block
        add_lists(dkdv, True)
        if ordered:  # and the key blocks of each query block: the ordered adds' ranks
            add_lists(dkdv, False)
    key_blocks = _ceil_div(sk, dkdv.config.block_n)
    # Causal blocks go longest first on the warp-specialized kernel unless its dQ adds are ordered (flash_bwd.cu).
    longest_first = dkdv.config.mainloop in WS_MAINLOOPS and not ordered and not shape.packed
    heads = dkdv_heads(shape, dkdv.config.block_m, dkdv.config.block_n, num_sms, longest_first)
    launches.append(Launch(dkdv, (key_blocks, h // heads, b)))
    # dq = scale * dq_accum, read in the order the dK/dV kernel's adds wrote (stages_dq); after an atomic dK/dV
    # kernel or ordered adds.
    convert = Launch(convert_dq_variant(dtype, bucket, stages_dq(dkdv)), (_ceil_div(sq, SMALL_BLOCK_ROWS), h, b))
    if ordered or (not separate_dq and stages_dq(dkdv) and not shape.packed):
        launches.append(convert)
        accum, counter_fields = dq_counters(shape, bucket, dkdv, ordered)
        scratch.append(accum)
        fields += counter_fields
    elif separate_dq:
        dq = dq_variant(arch, dtype, bucket, mask, mod)
        if general:  # the key blocks of each query block
            add_lists(dq, False)
        launches.append(Launch(dq, (_ceil_div(sq, dq.config.block_m), h, b)))
    else:
        launches.append(convert)
        scratch.append(("dq_accum", dq_accum_shape(shape, bucket)))
    if heads != h // hk:  # partials of each `heads` query heads, summed per group in a fixed order
        reduce = reduce_dkdv_variant(dtype, bucket)
        launches.append(Launch(reduce, (_ceil_div(sk, reduce.config.block_rows), hk, b)))
        scratch.append(("dk_accum", shape.k_scratch(h // heads, bucket)))
        scratch.append(("dv_accum", shape.k_scratch(h // heads, bucket)))
    return Plan(launches=tuple(launches), scratch=tuple(scratch),
                fields=(("dkdv_heads", heads), *shape.scratch_strides(h // heads), *fields))


def all_variants(arch: int) -> list:
    """Every backward variant on ``arch`` (none before sm_80). A bias variant whose staged tiles do not fit the
    arch's shared memory (D256 on the 99 KB parts) is left out: a call plans it and gets _check_fits' error."""
    if not arch_caps(arch).has_cp_async:
        return []
    out = []
    for dtype in DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            out.append(preprocess_variant(dtype, bucket))
            out.append(convert_dq_variant(dtype, bucket))
            if arch_caps(arch).has_wgmma:  # after the warp-specialized dK/dV kernel's staged adds
                out.append(convert_dq_variant(dtype, bucket, swizzled=True))
            out.append(reduce_dkdv_variant(dtype, bucket))
            for mask in MASK_KINDS:
                for mod in SCORE_MODS:
                    try:
                        dkdv = [dkdv_variant(arch, dtype, bucket, mask, atomic, mod) for atomic in (True, False)]
                    except ValueError:
                        if not has_bias(mod):
                            raise
                        dkdv = []
                    out += dkdv + [dq_variant(arch, dtype, bucket, mask, mod)]
                    if is_general(mask) and ordered_dq_fits(arch, bucket, mask, mod):  # the deterministic plan's
                        out.append(dkdv_variant(arch, dtype, bucket, mask, True, mod, ordered=True))
    return out
