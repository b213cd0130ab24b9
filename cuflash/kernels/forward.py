"""Plan for the tensor-core forward of ``cuda_src/flash_fwd.cu`` (fp16 / bf16, sm_80 and later).

One launch, grid ``(ceil(Sq / kBlockM), H, B)``, no scratch; under the general mask (window, segment or
block ids) the block-list pre-pass (``block_lists``) goes first. A variant is
``flash_fwd_kernel<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kMask, kScoreMod, kMainloop>``; each
compute warp owns ``kBlockM / kNWarps`` query rows (a multiple of 16) for the whole key loop, and K / V stream
through ``kStages`` shared-memory buffers each.

Three mainloops (``mainloop``): ``MAINLOOP_SM80`` runs the GEMMs on mma.sync (sm_80 and later:
:func:`tile_sm80`); ``MAINLOOP_SM90`` on the warpgroup instructions of sm_90a with every thread loading
(:func:`tile_sm90_wgmma`); ``MAINLOOP_SM90_WS`` on them with a producer warpgroup feeding two consumer
warpgroups that take turns on the tensor cores (:func:`tile_sm90_ws`). :func:`default_mainloop` picks: on
arch 90 the warp-specialized one wherever its variant compiles without spills (:func:`ws_fits`), else the
8-warp wgmma one at WGMMA_BUCKETS, else mma.sync (every other bucket, every other arch: sm_100 has no wgmma).

Tile choice (see :func:`tile_sm80`) follows from three budgets per SM:

- registers: 64 K per SM, at most 255 per thread; a 4-warp CTA fits twice per SM, an 8-warp CTA
  (above 128 registers per thread) once, so every choice runs 8 warps per SM. Per thread, the
  fp32 accumulators of the output rows and of the score tile stay <= 160 (zero spills), except two
  mma.sync tiles of the H100-class table a measurement chose at 192 (D64 128 x 128, D128 128 x 64;
  see tile_sm80; on arch 90 those buckets now take wgmma, so they serve sm_100-class parts only).
- shared memory: ``2 * kHeadDim * (kBlockM + 2 * kStages * kBlockN)`` bytes per CTA (Q, then kStages
  K and V tiles; the same in either panel layout), plus 1 KB the driver reserves per CTA. Per SM /
  per block (``cuflash.arch``): H100 (sm_90) 228 / 227 KB, A100 (sm_80) 164 / 163 KB, sm_86 / sm_89
  100 / 99 KB.
- shared-memory bandwidth: a warp with two m16 tiles uses each ldmatrix'd K / V fragment twice
  (mma.sync); a wgmma reads each operand once per warpgroup of four 16-row warps.
A 2-stage K/V ring (where it still fits the CTAs per SM) lets each copy hide behind a whole step
of tensor-core work instead of part of one.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arch import arch_caps
from . import HEAD_DIM_BUCKETS, MASK_KINDS, is_general, SCORE_MODS, has_bias, KernelVariant, Launch, Plan, ProblemShape
from . import DEFAULT_SMS, MASK_CAUSAL, MASK_GENERAL, MASK_NONE, MOD_NONE, MOD_SOFTCAP_ALIBI
from . import block_lists

SOURCE = "flash_fwd.cu"
#: The mainloops (``FwdMainloopKind`` in flash_fwd.cu): mma.sync with every thread loading (sm_80 and later);
#: wgmma with every thread loading (sm_90a); wgmma with a producer warpgroup and two consumer warpgroups
#: taking turns on the tensor cores (sm_90a, cuda_src/cuflash/fwd_mainloop_sm90_ws.cuh).
MAINLOOP_SM80, MAINLOOP_SM90, MAINLOOP_SM90_WS = 0, 1, 2
PRODUCER_THREADS = 128
KERNEL_NAME = "cuflash::flash_fwd_kernel"
DTYPES = ("float16", "bfloat16")
ELEM_BYTES = 2
KB = 1024


@dataclass(frozen=True)
class FwdConfig:
    """One forward variant. The fields, in this order, are the template arguments of
    ``flash_fwd_kernel<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kMask, kScoreMod, kWgmma>``
    (``cuflash.build.render_name`` renders them)."""

    dtype: str  # "float16" or "bfloat16"
    head_dim: int  # the head-dim bucket
    block_m: int  # query rows per CTA
    block_n: int  # keys per mainloop step
    num_warps: int
    stages: int  # K / V shared-memory buffers each
    mask: int  # one of MASK_KINDS (kernels/__init__.py)
    score_mod: int  # MOD_NONE, MOD_SOFTCAP_ALIBI, MOD_BIAS or MOD_BIAS_SOFTCAP
    mainloop: int  # MAINLOOP_SM80, MAINLOOP_SM90 or MAINLOOP_SM90_WS

    @property
    def wgmma(self) -> bool:
        """Whether the GEMMs run on the sm_90a warpgroup instructions."""
        return self.mainloop != MAINLOOP_SM80

    @property
    def threads(self) -> int:
        """Threads per block: the compute warps, plus the producer warpgroup of the warp-specialized mainloop."""
        return 32 * self.num_warps + (PRODUCER_THREADS if self.mainloop == MAINLOOP_SM90_WS else 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: Register spill (bytes, stores + loads, per ptxas) a variant may show because a measurement chose
#: its tile over a spill-free one; keyed by (arch, head-dim bucket, mask kind, score_mod). Anything above fails
#: tests/test_build.py. The entries: sm_90a D128 wgmma with a bool mask and softcap / ALiBi, and sm_80 D64 with a
#: bool mask, a bias and softcap (64 x 64 x 4 warps), 48 and 40 bytes on the GPU machine's NVRTC (none with
#: ptxas 13.0). (The entry for sm_90a D128 mma.sync 128x64x1 went with that
#: variant when D128 moved to the wgmma mainloop.)
SPILL_ALLOWANCE: dict = {(90, 128, 3, 1): 64, (80, 64, 3, 3): 48,
                         # The dropout kinds (4, 5; session 5, ptxas of NVRTC 13.5): Philox's temporaries on top
                         # of the general mask's registers. Not yet measured against spill-free tiles.
                         (90, 128, 4, 1): 100, (90, 128, 5, 0): 156, (90, 128, 5, 1): 172, (90, 128, 5, 3): 40,
                         (90, 64, 4, 1): 16, (90, 64, 5, 3): 20, (80, 128, 5, 1): 60, (80, 64, 4, 1): 100,
                         # The unmasked D64 tile of three consumer warpgroups (160 registers, 93c7ab6) spills 20 +
                         # 28 bytes (NVRTC 13.5) per tile, outside the key loop; timed at 1.10-1.13x the two-
                         # warpgroup tile at S4k / S16k (H100, RESULTS.md session 10 run 2).
                         (90, 64, 0, 0): 48,
                         # The general mask's ids read once per row and column (mask.cuh, kByRows) on the warp-
                         # specialized tiles: 8-28 bytes (NVRTC 13.5), against the per-element form's 0 bytes and
                         # 128 id loads per partial tile (session 11; timed in RESULTS.md session 11).
                         # Session 12, the tile queue (FwdUnitWalk): 16 / 20 / 0 / 44 bytes, the larger of NVRTC
                         # 13.5 and the GPU machine's NVRTC (its ptxas spills as nvcc 13.0 does).
                         (90, 128, 2, 0): 16, (90, 128, 2, 1): 20, (90, 64, 2, 1): 44}
# Session 12: the README's whole test command on the H100 ran this check with the GPU machine's NVRTC, whose
# ptxas spills as nvcc 13.0 does (the same bytes in every variant compared) and more than NVRTC 13.5 (CI's) in
# these variants; each entry is the larger of the two (its compile log, RESULTS.md session 12 run 3). The speed
# measured on that machine is of these kernels.
for _key, _bytes in {(90, 64, 0, 0): 56, (90, 64, 3, 3): 48, (90, 128, 4, 0): 160, (90, 128, 5, 0): 168,
                     (90, 128, 5, 1): 184, (90, 128, 5, 3): 56, (80, 64, 4, 2): 52, (80, 128, 5, 0): 8}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 13, the bias on the warp-specialized tiles (ws_fits): the larger of nvcc 13.0 (the GPU machine's
# ptxas) and NVRTC 13.5. nvcc's SASS puts them in the producer's copies (D128 unmasked 8, D64 unmasked 24) or
# in the consumers' per-tile setup, outside the key loop (D128 general mask + bias + softcap, 24); the causal
# D128 bias + softcap variant spills 48 with NVRTC 13.5 only (0 with nvcc 13.0).
for _key, _bytes in {(90, 128, 0, 2): 8, (90, 128, 0, 3): 8, (90, 128, 1, 3): 48, (90, 128, 2, 3): 24,
                     (90, 64, 0, 2): 24, (90, 64, 0, 3): 24}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 17: the warp-specialized consumers run a staged bias (no softcap) and a directly read one in copies of
# their own (FwdWork::modify_and_mask, kSplitBiasReads; H100, B2 H16 S2k D128 bias forward 256 -> 237 us): the
# larger of NVRTC 13.5 (52 / 0 / 0, D64 40 / 0 / 16) and nvcc 13.0 (16 / 16 / 0, D64 48 / 40 / 32), by mask kind.
for _key, _bytes in {(90, 128, 0, 2): 52, (90, 128, 1, 2): 16, (90, 64, 0, 2): 48, (90, 64, 1, 2): 40,
                     (90, 64, 2, 2): 32}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 21: the warp-specialized forward stages its bias in wide panels (read by ldmatrix, loaded by TMA where
# params.bias_tma): the bias variants' spills, the larger of NVRTC 13.5 and nvcc 13.0, all at the kernel's start,
# in the producer or in the consumers' first step of a tile (the softcap loops), none in the key loop.
for _key, _bytes in {(90, 64, 0, 3): 48, (90, 64, 1, 2): 48, (90, 64, 1, 3): 52, (90, 64, 2, 2): 40,
                     (90, 64, 2, 3): 56, (90, 128, 0, 2): 68, (90, 128, 0, 3): 124, (90, 128, 1, 3): 56,
                     (90, 128, 2, 2): 40, (90, 128, 2, 3): 64}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 22: Q / K / V by TMA (producer thread 0 issues the boxes beside the other threads' cp.async paths),
# the larger of NVRTC 13.5 and nvcc 13.0 (the GPU machine's NVRTC 13.0 agreed on the D128 bias + softcap one:
# 176 bytes, most of it in the consumers' first-step softcap code, as before; not timed).
for _key, _bytes in {(90, 64, 1, 2): 52, (90, 64, 1, 3): 100, (90, 64, 2, 0): 32, (90, 128, 1, 2): 68,
                     (90, 128, 1, 3): 108, (90, 128, 0, 3): 176}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 23: the general mask's ranged tile forms (mask.cuh, kRanged) beside the per-element test of unsorted ids
# moved the id + bias variants (not timed; the id-only ones went down to 0 bytes): the larger of NVRTC 13.5 and
# nvcc 13.0 (the GPU machine's NVRTC 13.0 gave the D64 / D128 bias ones 68 / 84 bytes, as nvcc does).
for _key, _bytes in {(90, 64, 2, 2): 68, (90, 64, 2, 3): 84, (90, 128, 2, 2): 84, (90, 128, 2, 3): 92,
                     (80, 64, 2, 3): 8}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 47: the warp-uniform Q-descriptor row of the warp-specialized consumers (flash_fwd.cu) moved the D64 causal
# tile to 12 + 40 bytes under NVRTC 13.5 only; nvcc 13.0 and the GPU machine's NVRTC (whose README run passed the
# allowance of 0 with it) spill nothing there. Timed on that machine only: D64 S1k causal forward +10% with the
# session's other changes (RESULTS.md session 47); where the 13.5 spills sit is unseen (its cubins do not
# disassemble with the tools here).
for _key, _bytes in {(90, 64, 1, 0): 52}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
# Session 53: the general mask's queue drops units past their packed sequence in the producer's take (varlen-skip)
# and moved the D64 general mask + bias + softcap tile from 40 + 44 to 56 + 52 bytes under nvcc 13.0 and the GPU
# machine's NVRTC 13.0 (the README run's spill check, H200); NVRTC 13.5 spills 20 + 20 in both. The new ones are
# four store / load pairs of one slot in the consumers' first, masked step of a tile (the bias + softcap code before
# the key loop): once per tile, not per key block. Not timed (that variant is outside every benchmark).
for _key, _bytes in {(90, 64, 2, 3): 108}.items():
    SPILL_ALLOWANCE[_key] = max(SPILL_ALLOWANCE.get(_key, 0), _bytes)
del _key, _bytes

#: Head-dim buckets that run the wgmma mainloop on arch 90 (sm_90a). Measured on an H100 (bf16, bench,
#: 2026-11-21), wgmma vs mma.sync forward over FlashAttention-2: D128 1.26-1.58x vs 1.03-1.11x, D256
#: 1.46-1.95x vs 0.90-1.08x; D64 0.99-1.13x vs 1.06-1.11x (the 128 x 128 wgmma tile loses at S 1k), so
#: D64 stays on the mma.sync tile until a better wgmma tile is measured.
WGMMA_BUCKETS = (128, 256)

#: K / V (and bias) stages of the warp-specialized D128 tile with a bias (128 x 64): 3 take 214 KB with O's own
#: tile, 2 take 164 KB; 3 ran the unmasked bias forward 7-16% faster and the causal one as fast (session 13
#: run 1, RESULTS.md).
BIAS_WS_STAGES = 3

#: Head-dim buckets with a warp-specialized tile (producer warpgroup, two consumer warpgroups in ping-pong);
#: :func:`ws_fits` says which variants take it. Not measured yet against the 8-warp one (2026-11-23, session 7).
WS_BUCKETS = (64, 128, 256)


def smem_bytes(head_dim_bucket: int, block_m: int, block_n: int, stages: int, bias: bool = False,
               mainloop: int = MAINLOOP_SM80, queue: bool = False) -> int:
    """Dynamic shared memory of one CTA: Q (block_m rows), then ``stages`` K and ``stages`` V tiles
    (block_n rows each), kHeadDim 2-byte columns each, then with a bias ``stages`` staged bias tiles
    (block_m rows of block_n 2-byte keys plus a 16-byte pad: cuflash/bias.cuh; the warp-specialized
    mainloop's are wide panels, no pad, which TMA can write). The warp-specialized mainloop adds, where it fits the block's 227 KB, a tile like Q's for staging O, and its mbarriers (Q's
    full and empty ones, a full and an empty one per K / V slot, 8 bytes each; under the general mask
    (``queue``) the tile queue's two more and its int slot, 8 bytes; rounded up to 16). Mirrors
    ``kSmemBytes`` in the kernel, for both panel layouts (the wgmma one adds no padding: every tile is a
    multiple of 1024 bytes); each compile checks it (``CUFLASH_EXPECTED_SMEM_BYTES`` against
    ``CUFLASH_CHECK_SMEM_BYTES``)."""
    pad = 0 if mainloop == MAINLOOP_SM90_WS else 16
    bias_bytes = stages * block_m * (block_n * ELEM_BYTES + pad) if bias else 0
    q_bytes = ELEM_BYTES * head_dim_bucket * block_m
    loads = q_bytes + 2 * stages * block_n * ELEM_BYTES * head_dim_bucket + bias_bytes
    if mainloop != MAINLOOP_SM90_WS:
        return loads
    barrier_bytes = _cdiv((2 + 4 * stages + (2 if queue else 0)) * 8 + (8 if queue else 0), 16) * 16
    separate_o = loads + q_bytes + barrier_bytes <= WS_SMEM_LIMIT
    return loads + (q_bytes if separate_o else 0) + barrier_bytes


#: The shared memory a block may use on sm_90 (kMaxSmemBytes of the warp-specialized mainloop).
WS_SMEM_LIMIT = 227 * KB


def tile_sm80(arch: int, head_dim_bucket: int, causal: bool, heavy: bool = False, bias: bool = False) -> tuple:
    """(kBlockM, kBlockN, kNWarps, kStages) of the mma.sync mainloop for one head-dim bucket on ``arch``.

    On arch 90 the buckets of WGMMA_BUCKETS take :func:`tile_sm90_wgmma` instead; the "big" rows below
    for those buckets (measured on an H200 when they ran there) now serve sm_100-class parts, untimed.

    Register rule behind the unmeasured rows: a thread's fp32 accumulators, acc_o (kMTiles x D/8 x 4)
    plus acc_s (kMTiles x kBlockN/8 x 4), stay <= 160. Above that ptxas fills the rest of the 255 with
    prefetched ldmatrix fragments and may spill (seen at 192 for D128 with 64 keys on sm_80 / sm_90a,
    and D64 with 128 keys on sm_80); at 160 it settles at 214-251 registers with no spill. The two
    measured sm_90 rows below trade that rule for speed.
    Two m16 tiles per warp (kMTiles = 2) wherever that rule allows: each K / V fragment read from
    shared memory then feeds two mma's, which keeps ldmatrix traffic under the shared-memory
    bandwidth; from D160 on the output rows alone exceed the rule at kMTiles = 2, so those warps
    own 16 rows. Causal uses the non-causal tiles except on sm_86 / sm_89 (as FlashAttention-2): the
    longest-first grid order already balances the triangle. ``heavy`` (the general mask or a score
    modifier: ids, tanh and slopes on top of the accumulators) moves D64 off the 128-key tile, which
    sits at 255 registers already and spills with them (ptxas 13.0, sm_90a: 88-152 bytes), and D32 off
    its 128-key tile too (36-48 bytes).
    """
    caps = arch_caps(arch)
    if not caps.has_cp_async:
        raise ValueError(f"the tensor-core forward needs sm_80 or later; got {arch=}")
    per_block = caps.smem_per_block
    if bias and per_block >= 160 * KB:
        # The bias variant (its staged tiles, a bias pair per two scores, four specialized loops for the
        # softcap / ALiBi terms) spilled 24-60 bytes on the heavy tiles with 32 rows per warp (D32, D64, D96:
        # 128 x 64 x 4 warps) and 8-48 at D224 / D256 (ptxas 13.0, sm_90a). These spill nothing.
        if head_dim_bucket == 32:
            return 128, 64, 8, 2
        if head_dim_bucket in (64, 96):
            return 64, 64, 4, 2
        if head_dim_bucket == 128:  # the mma.sync D128 (sm_80; sm_90a takes wgmma): 128 x 32 x 4 warps spilled 48-68
            return 128, 32, 8, 2
        if head_dim_bucket == 224:
            return 128, 32, 8, 2
        if head_dim_bucket == 256:
            return 64, 32, 4, 2
    if per_block >= 160 * KB:  # A100 and H100 class
        big = per_block >= 200 * KB  # H100 / B200
        if head_dim_bucket <= 32 and not heavy:
            # 4 warps x 32 rows x 128 keys: acc 32 + S 128. 2 stages: 40 KB, two CTAs per SM.
            return 128, 128, 4, 2
        if head_dim_bucket <= 64 and big and not heavy:
            # Measured (H200, bf16, 2026-11-21, scratch tile sweep): 128 x 128 keys with 2 stages beat
            # 128 x 64 by 13-15% at S 1k/4k/16k (332 vs 289 TFLOPS at 4k): half the barriers and
            # softmax rescales per FLOP. 255 registers, 0 spills on sm_90a; 80 KB, two CTAs per SM.
            return 128, 128, 4, 2
        if head_dim_bucket <= 96:
            # 4 warps x 32 rows x 64 keys: acc 64 / 96 + S 64 (and the heavy D32 / D64 variants). 2 stages: 48 / 72 KB, two CTAs per SM
            # (the register file holds exactly two 128-thread CTAs at 255 registers). On sm_80 the
            # 128-key tile spills 40 bytes in the causal variant, and it is unmeasured there.
            return 128, 64, 4, 2
        if head_dim_bucket <= 128 and big:
            # Measured (H200, bf16, 2026-11-21): 128 x 64 keys with ONE stage beat 128 x 32 x 2 stages
            # by 10-16% at S 1k/4k/16k (346 vs 313 TFLOPS at 4k, 314 vs 271 causal), and 128 x 64 x 2
            # stages by 4% (FlashAttention-2's overlap: V loads under Q.K^T, K under P.V). It costs a
            # declared spill (SPILL_ALLOWANCE): acc 128 + S 64 at 255 registers.
            return 128, 64, 4, 1
        if head_dim_bucket <= 128:
            # 4 warps x 32 rows x 32 keys: acc 128 + S 32 (64 keys would make 192 and spill).
            # 2 stages: 64 KB, two CTAs per SM on A100.
            return 128, 32, 4, 2
        if head_dim_bucket <= 224:
            # 8 warps x 16 rows x 64 keys: acc 80 / 96 / 112 + S 32. One such CTA per SM (256 threads
            # at > 128 registers), so shared memory is free up to the block limit: 2 stages is 120 /
            # 144 / 168 KB; A100 (163 KB) keeps 1 stage at D224 (112 KB).
            stages = 2 if big or head_dim_bucket <= 192 else 1
            return 128, 64, 8, stages
        # D256, 16 rows per warp (acc 128 + S 32). H100: FlashAttention-2's 64 x 64 with 4 warps and
        # one buffer, 96 KB, so two CTAs share an SM. A100: two of those do not fit (2 x 97 KB >
        # 164 KB), so one CTA of 8 warps x 16 rows, 128 KB.
        if big:
            return 64, 64, 4, 1
        return 128, 64, 8, 1
    # sm_86 / sm_89 / sm_120: 99 KB per block, 100 KB per SM; two 4-warp CTAs or one 8-warp CTA
    # per SM, as above.
    if head_dim_bucket <= 64:
        # 4 warps x 32 rows x 64 keys, 2 stages: 24 / 48 KB, two CTAs per SM.
        return 128, 64, 4, 2
    if head_dim_bucket <= 96:
        return 128, 64, 4, 1  # 48 KB, two CTAs per SM
    if head_dim_bucket <= 128:
        # 128 x 32 (48 KB) keeps two CTAs per SM; causal takes 64 x 64 (48 KB, 16 rows per warp) so
        # the diagonal blocks waste less (FlashAttention-2's sm8x choice).
        return (64, 64, 4, 1) if causal else (128, 32, 4, 1)
    if head_dim_bucket <= 192:
        return 128, 64, 8, 1  # 8 warps x 16 rows: 80 / 96 KB, one CTA per SM
    # D224 / D256: 32 keys per step to stay under 99 KB (84 / 96 KB), 8 warps x 16 rows.
    return 128, 32, 8, 1


def tile_sm90_wgmma(head_dim_bucket: int, bias: bool = False) -> tuple:
    """(kBlockM, kBlockN, kNWarps, kStages) of the wgmma mainloop (arch 90, buckets WGMMA_BUCKETS).

    Two warpgroups (8 warps x 16 rows, kBlockM = 128), one CTA per SM (256 threads above 128 registers):
    the SM's shared memory, 227 KB per block, is all this CTA's. Each warpgroup issues S = Q.K^T as
    m64 x kBlockN and O += P.V as m64 x D wgmma's; per thread acc_o is D/2 floats, acc_s kBlockN/2, and
    P_{j-1} (packed, kBlockN/4 registers) stays live under S_j. The mainloop needs exactly 2 K / V stages
    (K runs one step ahead of V), and 2 fit at every bucket here. Timed: see WGMMA_BUCKETS; registers per
    ptxas 13.0 (sm_90a, bf16 and fp16, causal or not), no spills.
    """
    if head_dim_bucket == 128 and bias:
        # The bias variant reads a (row, column pair) of bias per two scores, which ptxas hoists ahead of
        # the softmax: with 128 keys that spilled 52-140 bytes (ptxas 13.0); 64 keys: none.
        return 128, 64, 8, 2
    if head_dim_bucket == 128:
        # 128 keys: acc 64 + S 64 + P 32 (193 registers): half the barriers and rescales per FLOP of
        # 64 keys. Q 32 KB + 2 x (K + V) 128 KB = 160 KB.
        return 128, 128, 8, 2
    if head_dim_bucket == 256:
        # 64 keys: acc 128 + S 32 + P 16 (215 registers); 128 keys would need 128 + 64 + 32 for these
        # alone. Q 64 KB + 2 x (K + V) 128 KB = 192 KB (3 stages would be 256 KB).
        return 128, 64, 8, 2
    raise ValueError(f"no wgmma tile for head-dim bucket {head_dim_bucket}; the mma.sync path serves it")


#: D64 causal heads of at most this many queries take the 128-row warp-specialized tile instead of the 192-row one
#: (tile_sm90_ws's ``short_causal``): 1024 rows fill eight 128-row blocks but pad to six 192-row ones, the last
#: with 64 rows and the longest key walk. H100, session 16 run 9 (B x S = 16k tokens, H32, TFLOPS, 192 / 128
#: rows): S1k causal 254 / 269, S2k causal 329 / 319, S1k full 380 / 377; longer or unmasked heads keep 192.
SHORT_CAUSAL_MAX_QUERIES = 1024


#: Unmasked and causal D256 heads of at least this many keys take FlashAttention-3's 80-key tile (tile_sm90_ws's
#: ``long_keys``) instead of 64 keys. H200, session 29 (three rounds in rotating order, forward medians, ms, 64 / 80
#: keys): B1 H8 S16k 3.077 / 2.936 (+4.8%; a second run on another machine 3.100 / 2.998, +3.4%), B4 H8 S4k 0.809 /
#: 0.820 (-1.3%, inside the spread), B16 H8 S1k 0.254 / 0.272 (-7%), MQA 8/1 B2 S1k 0.050 / 0.064. Causal: session 29
#: -1.5% to +0.5% (S16k +0.5%); session 30, four rounds, B1 H8 S16k 1.494 / 1.428 (+4.7%; 80 keys faster in three of
#: the four), S4k (64 keys both) 0.451 / 0.451; so causal heads of 8192 keys and more joined. 8k keys were not measured.
#: Spills (NVRTC 13.5 and nvcc 13.0): unmasked 64 + 104 bytes, causal 36 + 56, all in the producer warpgroup (40
#: registers: its cp.async path's addresses), against 16 + 16 for 64 keys; the consumers' 232 registers hold the tile.
#: (D256 is not among the hot kernels tests/test_build.py holds to SPILL_ALLOWANCE.)
D256_WIDE_MIN_KEYS = 8192


def tile_sm90_ws(head_dim_bucket: int, bias: bool = False, mask: int = MASK_NONE, score_mod: int = MOD_NONE,
                 short_causal: bool = False, long_keys: bool = False) -> tuple:
    """(kBlockM, kBlockN, kNWarps, kStages) of the warp-specialized wgmma mainloop: kNWarps counts the consumer
    warpgroups (8 warps x 16 rows, kBlockM = 128; at D64 12 warps, 192 rows); the producer warpgroup comes on
    top (384 or 512 threads, one CTA per SM). The consumers hold 224 registers each after the hand-over (232 at D256; setmaxnreg),
    more than the 8-warp wgmma mainloop's CTA-wide budget needs at these tiles; the ring takes what shared
    memory is left, up to 227 KB per block.
    """
    if head_dim_bucket == 64 and mask == MASK_CAUSAL and score_mod == MOD_NONE and short_causal:
        # SHORT_CAUSAL_MAX_QUERIES: two consumer warpgroups, 128 rows. Q 16 KB + 3 x (K + V) 96 KB = 112 KB.
        return 128, 128, 8, 3
    if head_dim_bucket == 64 and mask in (MASK_NONE, MASK_CAUSAL) and score_mod == MOD_NONE:
        # Three consumer warpgroups (192 query rows, FlashAttention-3's D64 tile; 160 registers each after the
        # hand-over): D64 is as exp-bound as it is GEMM-bound, and a third warpgroup's softmax can run under the
        # other two's GEMMs. acc 32 + S 64 + P 32: 128 keys. Q 24 KB + 3 x (K + V) 96 KB + O 24 KB = 144 KB.
        # nvcc 13.0: no spill in the key loop (the unmasked one spills 24 + 32 bytes per tile, outside it); the
        # general mask and the score modifiers spilled 120-676 bytes at 160 registers and keep two.
        return 192, 128, 12, 3
    if head_dim_bucket == 64 and bias:
        # The producer copies a bias tile per step too: 128 keys (16 copies of 16 bytes per producer thread and
        # step) spilled 244-404 bytes there even at 72 registers, 64 keys none. Q 16 KB + 3 x (K + V) 48 KB +
        # 3 bias tiles 48 KB + O 16 KB = 128 KB.
        return 128, 64, 8, 3
    if head_dim_bucket == 64:
        # acc 32 + S 64 + P 32: 128 keys. Q 16 KB + 3 x (K + V) 96 KB = 112 KB.
        return 128, 128, 8, 3
    if head_dim_bucket == 128 and bias:
        # The bias on 64 keys, as the 8-warp wgmma mainloop (its pairs, hoisted ahead of the softmax, spilled
        # there with 128). Q 32 KB + BIAS_WS_STAGES x (K + V 32 KB + bias 16 KB) + O 32 KB.
        return 128, 64, 8, BIAS_WS_STAGES
    if head_dim_bucket == 128:
        # Q 32 KB + 2 x (K + V) 128 KB = 160 KB (3 stages would be 224 KB + the barriers: 227 KB is the limit).
        return 128, 128, 8, 2
    if head_dim_bucket == 256 and mask in (MASK_NONE, MASK_CAUSAL) and long_keys:
        # D256_WIDE_MIN_KEYS: FlashAttention-3's and -4's D256 tile, 80 keys: acc 128 + S 40 + P 20, 20% fewer softmax
        # rescales and barriers per FLOP. Q 64 KB + 2 x (K + V) 160 KB = 224 KB, O staged in Q's tile. 64 rows do not
        # divide 80: the K / V boxes are whole tiles (tma.kv_box).
        return 128, 80, 8, 2
    if head_dim_bucket == 256:
        # acc 128 + S 32 + P 16: 64 keys. Q 64 KB + 2 x (K + V) 128 KB = 192 KB.
        return 128, 64, 8, 2
    raise ValueError(f"no warp-specialized tile for head-dim bucket {head_dim_bucket}")


def uses_wgmma(arch: int, head_dim_bucket: int) -> bool:
    """True where the plan picks an sm_90a wgmma mainloop (Hopper only: sm_100 has no wgmma)."""
    return arch_caps(arch).has_wgmma and head_dim_bucket in WGMMA_BUCKETS


def default_mainloop(arch: int, head_dim_bucket: int, mask: int = 0, score_mod: int = 0) -> int:
    """The mainloop a plan picks: on sm_90a the warp-specialized one where :func:`ws_fits` (its consumers'
    224-232 registers hold the variant without spilling), else the 8-warp wgmma one at WGMMA_BUCKETS (not D256
    with a bias: Q, two K / V stages and two 128 x 64 bias tiles need 228 KB), else mma.sync."""
    if not arch_caps(arch).has_wgmma:
        return MAINLOOP_SM80
    if ws_fits(head_dim_bucket, mask, score_mod):
        return MAINLOOP_SM90_WS
    if head_dim_bucket in WGMMA_BUCKETS and not (head_dim_bucket == 256 and has_bias(score_mod)):
        return MAINLOOP_SM90
    return MAINLOOP_SM80


def ws_fits(head_dim_bucket: int, mask: int, score_mod: int) -> bool:
    """Whether the warp-specialized variant compiles without spills in its loops (ptxas 13.0 / NVRTC 13.5,
    sm_90a, session 7): the plain, causal and general (window / ids) masks with any score modifier at D64 and
    D128; at D256 the plain and causal masks without a modifier (the plain one spills 4 bytes in the producer,
    once per tile). The bias joined in session 13, once the producer kept 72 registers for its bias copies
    (the consumers' 216 hold the bias reads without a spill in the key loop; at 56 the producer had spilled
    92-476 bytes, which session 7 counted against the whole variant). The rest spilled: the bool mask and
    dropout 8-156, D256 with the general mask or a modifier 4-148."""
    if head_dim_bucket not in WS_BUCKETS or mask not in (MASK_NONE, MASK_CAUSAL, MASK_GENERAL):
        return False
    if head_dim_bucket == 256:
        return mask in (MASK_NONE, MASK_CAUSAL) and score_mod == MOD_NONE
    return score_mod in SCORE_MODS


def variant(dtype: str, head_dim_bucket: int, mask: int, arch: int, score_mod: int = 0,
            mainloop: int | None = None, short_causal: bool = False, long_keys: bool = False) -> KernelVariant:
    """The forward variant of a problem; ``mainloop`` (None: :func:`default_mainloop`) forces one, for A/B runs;
    ``short_causal``: a causal problem of at most SHORT_CAUSAL_MAX_QUERIES queries, ``long_keys``: one of at least
    D256_WIDE_MIN_KEYS keys (:func:`tile_sm90_ws`)."""
    if dtype not in DTYPES:
        raise ValueError(f"the tensor-core forward takes float16 or bfloat16; got {dtype=}")
    if head_dim_bucket not in HEAD_DIM_BUCKETS:
        raise ValueError(f"{head_dim_bucket=} is not one of {HEAD_DIM_BUCKETS}")
    bias = has_bias(score_mod)
    if mainloop is None:
        mainloop = default_mainloop(arch, head_dim_bucket, int(mask), score_mod)
    if mainloop != MAINLOOP_SM80 and not arch_caps(arch).has_wgmma:
        raise ValueError(f"the wgmma mainloops need sm_90a; got {arch=}")
    if mainloop == MAINLOOP_SM90_WS:
        block_m, block_n, warps, stages = tile_sm90_ws(head_dim_bucket, bias, int(mask), score_mod, short_causal,
                                                       long_keys)
    elif mainloop == MAINLOOP_SM90:
        block_m, block_n, warps, stages = tile_sm90_wgmma(head_dim_bucket, bias)
    else:
        block_m, block_n, warps, stages = tile_sm80(arch, head_dim_bucket, mask != 0, is_general(mask) or score_mod != 0,
                                                    has_bias(score_mod))
    smem = smem_bytes(head_dim_bucket, block_m, block_n, stages, bias, mainloop, is_general(mask))
    per_block = arch_caps(arch).smem_per_block
    # The bias tiles on top of a table tile chosen without them: shed K / V stages, then keys, until it fits
    # (A100 D192 128 x 64: 2 stages 184 KB, 1 stage 138 KB; the 99 KB parts' larger head dims).
    while bias and mainloop == MAINLOOP_SM80 and smem > per_block and (stages > 1 or block_n > 16):
        if stages > 1:
            stages -= 1
        else:
            block_n //= 2
        smem = smem_bytes(head_dim_bucket, block_m, block_n, stages, bias)
    if smem > per_block:  # a tile-table edit that breaks the arch's limit fails here, on the CPU
        raise AssertionError(f"{KERNEL_NAME} D{head_dim_bucket} {block_m}x{block_n}x{stages} needs "
                             f"{smem=} > {per_block} on sm_{arch}")
    config = FwdConfig(dtype, head_dim_bucket, block_m, block_n, warps, stages, int(mask), int(score_mod), mainloop)
    return KernelVariant(SOURCE, KERNEL_NAME, config, config.threads, smem)


#: The causal warp-specialized forward walks pairs of query blocks on a persistent grid (:func:`grid_for`) up to
#: this many query blocks per head. H100, bf16, session 11 run 3 (three interleaved rounds, against one CTA per
#: tile): D64 S1k +7.7%, D64 S4k +4.3%, D128 S1k +4.6%, D128 S4k +9.9%, GQA 32/8 D128 S4k +4.1%, but D128 S16k
#: (128 query blocks of 128 rows per head) -4.3%: 1024 equal pairs on 132 SMs end in a wave 3% short, which the
#: hardware's scheduling of single tiles avoids, while a long tile gains little from the next one's early loads.
PAIRED_MAX_QUERY_BLOCKS = 64


def grid_for(config: FwdConfig, shape: ProblemShape, num_sms: int) -> tuple:
    """The launch grid: one CTA per (query block, head, batch), (ceil(Sq / kBlockM), H, B). The
    warp-specialized kernel walks its tiles in a loop (cuda_src/flash_fwd.cu: query blocks of one head
    adjacent, CTA c taking tiles c, c + gridDim.x, ...), so its grid is one-dimensional: persistent,
    min(tiles, SMs) CTAs, where every tile has the same work (no mask, equal lengths), and one CTA per tile
    otherwise, where the hardware's scheduling balances uneven tiles. Measured on an H100 (session 7, run 3):
    persistent, the unmasked D128 S1k forward went 500 -> 527 TFLOPS and D64 S1k 316 -> 353, but causal
    D128 S16k fell 611 -> 404 (a static stride hands some CTAs only long tiles). So causal tiles go in pairs:
    a head's j-th longest and j-th shortest query blocks, whose key blocks add to about the same for every j;
    the grid is persistent over the pairs, min(pairs, SMs), and the kernel walks pairs whenever it has fewer
    CTAs than tiles (FwdTiles). That pays where tiles are short, up to PAIRED_MAX_QUERY_BLOCKS per head, and
    where the tiles do not fit one wave: where they do, one CTA per tile ends with the longest tile, sooner than
    the pairs (H200, session 36: MQA 8/1 D256 S1k B2 causal, 128 tiles of 1-8 key blocks against 64 pairs of 9,
    forward 1.08x in three interleaved rounds, bit-identical outputs). Longer heads keep one CTA per tile
    (measured below, at PAIRED_MAX_QUERY_BLOCKS). Under the general mask (packed sequences too), whose tiles'
    work only the block lists know, min(tiles, SMs) CTAs take tiles from a queue (an atomic counter after the
    lists: FwdUnitWalk in cuda_src/cuflash/fwd_mainloop_sm90_ws.cuh; session 12: documents forward +12%, window
    +10%, against one CTA per tile)."""
    tiles = (_cdiv(shape.seqlen_q, config.block_m), shape.num_heads, shape.batch)
    if config.mainloop != MAINLOOP_SM90_WS:
        return tiles
    count = tiles[0] * tiles[1] * tiles[2]
    if is_general(config.mask):  # packed sequences too: the CTAs take tiles from a queue (FwdUnitWalk)
        return (max(1, min(count, num_sms)), 1, 1)
    if shape.packed:
        return (count, 1, 1)
    if config.mask == MASK_NONE:
        return (max(1, min(count, num_sms)), 1, 1)
    if config.mask == MASK_CAUSAL and tiles[0] <= PAIRED_MAX_QUERY_BLOCKS:
        if count > num_sms:  # one wave of single tiles otherwise (the docstring)
            pairs = (tiles[0] + 1) // 2 * tiles[1] * tiles[2]
            return (min(pairs, num_sms), 1, 1)
    return (count, 1, 1)


def plan_forward(shape: ProblemShape, arch: int, num_sms: int = DEFAULT_SMS) -> Plan:
    """One launch (:func:`grid_for`); under the general mask its block lists first."""
    short_causal = shape.mask_kind == MASK_CAUSAL and shape.seqlen_q <= SHORT_CAUSAL_MAX_QUERIES  # packed: general
    long_keys = shape.seqlen_k >= D256_WIDE_MIN_KEYS
    v = variant(shape.dtype, shape.head_dim_bucket, shape.mask_kind, arch, shape.score_mod, short_causal=short_causal,
                long_keys=long_keys)
    grid = grid_for(v.config, shape, num_sms)
    if not is_general(shape.mask_kind):
        return Plan(launches=(Launch(v, grid),))
    lists, scratch, fields = block_lists.lists_for(shape.batch, shape.seqlen_q, shape.seqlen_k, v.config.block_m,
                                                   v.config.block_n, False, shape.mask_heads, not shape.packed)
    return Plan(launches=(lists, Launch(v, grid)), scratch=(scratch,), fields=fields)


def all_variants(arch: int) -> list:
    """fp16 / bf16 x every head-dim bucket x mask kind x score modifier or not (none before sm_80)."""
    if not arch_caps(arch).has_cp_async:
        return []
    out = [variant(dtype, bucket, mask, arch, score_mod)
           for dtype in DTYPES for bucket in HEAD_DIM_BUCKETS for mask in MASK_KINDS for score_mod in SCORE_MODS]
    for dtype in DTYPES:  # the short causal heads' and long heads' tiles where they differ (SHORT_CAUSAL_MAX_QUERIES,
        for bucket in HEAD_DIM_BUCKETS:  # D256_WIDE_MIN_KEYS)
            for extra in (variant(dtype, bucket, MASK_CAUSAL, arch, short_causal=True),
                          variant(dtype, bucket, MASK_NONE, arch, long_keys=True),
                          variant(dtype, bucket, MASK_CAUSAL, arch, long_keys=True)):
                if extra not in out:
                    out.append(extra)
    return out
