"""Plans for the true-fp32 kernels of ``cuda_src/flash_simt.cu`` (float32 inputs, FFMA only, no TF32).

Every kernel runs 256 threads as a 16 x 16 grid; a thread owns ``kBlockM / 16`` rows and
``kBlockN / 16`` columns of a score tile and the same rows of the output tile. Shared-memory tiles of
Q / K / V / dO have a row pitch of ``kHeadDim + 4`` floats (see the source's header comment), and the
P / dS tiles a pitch of ``kBlock + 4``. The byte formulas below mirror the kernels' ``*Smem`` structs,
and each compile checks them (``CUFLASH_EXPECTED_SMEM_BYTES`` against the kernel's
``CUFLASH_CHECK_SMEM_BYTES``), so a drifted formula fails the build on the CPU.

Tile choice: every variant must fit the dynamic shared memory that all archs from sm_80 on grant a
block (``cuflash.arch.min_smem_per_block()``, 99 KB: sm_86 / sm_89 / sm_120), and 128 registers
per thread (``__launch_bounds__(256, 2)``) without spilling. Within that, the largest tiles per
head-dim bucket, since each element read from shared memory then feeds more FFMAs and fewer blocks
re-read K/V (or Q/dO) from L2. Every long sum is two-level (a zeroed per-block accumulator added to
the running one), which costs a second accumulator tile per thread and keeps the relative error near
1e-6 even at 16k keys.

The backward is always deterministic (no atomics: dQ is owned by one block per query block, GQA dK/dV
partials are summed in ascending head order), so ``deterministic`` is accepted and honored for free.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import arch as _arch
from . import HEAD_DIM_BUCKETS, MASK_KINDS, is_general, SCORE_MODS, KernelVariant, Launch, Plan, ProblemShape
from . import block_lists

SOURCE = "flash_simt.cu"
THREADS = 256  # simt::kThreads
PAD = 4  # simt::kPad, floats of padding per shared-memory row
PREP_ROWS = 32  # simt::kPrepRows, query rows per pre-pass block
REDUCE_ROWS = 16  # simt::kReduceRows, key rows per GQA reduce block
FLOAT_BYTES = 4
#: Every SIMT tile fits this on every arch the kernels run on, so the variant list is the same on all.
MAX_SMEM_BYTES = _arch.min_smem_per_block()


@dataclass(frozen=True)
class SimtConfig:
    """One tiled SIMT variant (forward, dK/dV or dQ): the template arguments of
    ``flash_{fwd,bwd_dkdv,bwd_dq}_simt_kernel<kHeadDim, kBlockM, kBlockN, kMask, kScoreMod>``, in order."""

    head_dim: int  # the head-dim bucket
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    mask: int  # one of MASK_KINDS (kernels/__init__.py)
    score_mod: int  # MOD_NONE, MOD_SOFTCAP_ALIBI, MOD_BIAS or MOD_BIAS_SOFTCAP


@dataclass(frozen=True)
class SimtSmallConfig:
    """The SIMT pre-pass and GQA reduce: ``flash_bwd_{preprocess,reduce_dkdv}_simt_kernel<kHeadDim>``."""

    head_dim: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- tiles: (kBlockM, kBlockN) per head-dim bucket ----------------------------------------------

def forward_tiles(head_dim: int) -> tuple:
    """Forward (kBlockM, kBlockN). 64 query rows (4 per thread) up to D = 128; above, the running
    and the per-block O accumulators (2 x 4 x D/16 floats) no longer fit 128 registers (D = 160
    spilled), so 32 rows; at D = 256 the three (rows x D) smem tiles also force 16-key blocks."""
    if head_dim <= 64:
        return 64, 64
    if head_dim <= 128:
        return 64, 32
    if head_dim <= 224:
        return 32, 32
    return 32, 16


def dkdv_tiles(head_dim: int) -> tuple:
    """dK/dV (kBlockM, kBlockN): four (rows x D) tiles live at once (K, V, Q, dO), so kBlockM +
    kBlockN shrinks with D; keys (the accumulator rows) get the larger share."""
    if head_dim <= 32:
        return 64, 64
    if head_dim <= 96:
        return 32, 64
    if head_dim <= 160:
        return 32, 32
    if head_dim <= 224:
        return 16, 32
    return 16, 16


def dq_tiles(head_dim: int) -> tuple:
    """dQ (kBlockM, kBlockN): the same four tiles; query rows (the accumulator rows) get the
    larger share."""
    if head_dim <= 64:
        return 64, 64
    if head_dim <= 96:
        return 64, 32
    if head_dim <= 128:
        return 64, 16
    if head_dim <= 160:
        return 32, 32
    if head_dim <= 224:
        return 32, 16
    return 16, 16


# --- shared memory (bytes), mirroring FwdSmem and BwdSmem (dK/dV, dQ) in flash_simt.cu ---------

def forward_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Q (block_m rows), K and V (block_n rows each) at pitch D+4, P (block_m x block_n+4)."""
    return FLOAT_BYTES * ((block_m + 2 * block_n) * (head_dim + PAD) + block_m * (block_n + PAD))


def dkdv_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """K, V (block_n rows) and Q, dO (block_m rows) at pitch D+4; P^T and dS^T (block_n x block_m+4)."""
    return FLOAT_BYTES * (2 * (block_n + block_m) * (head_dim + PAD) + 2 * block_n * (block_m + PAD))


def dq_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Q, dO (block_m rows) and K, V (block_n rows) at pitch D+4; dS (block_m x block_n+4)."""
    return FLOAT_BYTES * (2 * (block_m + block_n) * (head_dim + PAD) + block_m * (block_n + PAD))


# --- variants -----------------------------------------------------------------------------------

def _tiled(name: str, head_dim: int, tiles: tuple, smem_bytes, mask: int, score_mod: int) -> KernelVariant:
    block_m, block_n = tiles
    smem = smem_bytes(head_dim, block_m, block_n)
    if smem > MAX_SMEM_BYTES:  # a tile-table edit that breaks the promise fails here, on the CPU
        raise AssertionError(f"{name}<{head_dim}, {block_m}, {block_n}> needs {smem=} > {MAX_SMEM_BYTES}")
    return KernelVariant(SOURCE, name, SimtConfig(head_dim, block_m, block_n, int(mask), int(score_mod)), THREADS,
                         smem)


def forward_variant(head_dim: int, mask: int, score_mod: int = 0) -> KernelVariant:
    return _tiled("cuflash::flash_fwd_simt_kernel", head_dim, forward_tiles(head_dim), forward_smem_bytes, mask,
                  score_mod)


def dkdv_variant(head_dim: int, mask: int, score_mod: int = 0) -> KernelVariant:
    return _tiled("cuflash::flash_bwd_dkdv_simt_kernel", head_dim, dkdv_tiles(head_dim), dkdv_smem_bytes, mask,
                  score_mod)


def dq_variant(head_dim: int, mask: int, score_mod: int = 0) -> KernelVariant:
    return _tiled("cuflash::flash_bwd_dq_simt_kernel", head_dim, dq_tiles(head_dim), dq_smem_bytes, mask, score_mod)


def preprocess_variant(head_dim: int) -> KernelVariant:
    return KernelVariant(SOURCE, "cuflash::flash_bwd_preprocess_simt_kernel", SimtSmallConfig(head_dim), THREADS, 0)


def reduce_variant(head_dim: int) -> KernelVariant:
    return KernelVariant(SOURCE, "cuflash::flash_bwd_reduce_dkdv_simt_kernel", SimtSmallConfig(head_dim), THREADS, 0)


def _check(shape: ProblemShape, arch: int) -> None:
    if not _arch.arch_caps(arch).has_cp_async:
        raise ValueError(f"the fp32 kernels need sm_80 or later (cp.async); got {arch=}")
    if shape.dtype != "float32":
        raise ValueError(f"the SIMT kernels take float32 inputs; got dtype={shape.dtype!r}")


# --- plans --------------------------------------------------------------------------------------

def plan_forward(shape: ProblemShape, arch: int, num_sms: int | None = None) -> Plan:
    """One launch, grid (ceil(Sq / kBlockM), H, B); under the general mask its block lists first. (``num_sms``:
    the tensor-core family's persistent grid needs it; this one does not.)"""
    _check(shape, arch)
    variant = forward_variant(shape.head_dim_bucket, shape.mask_kind, shape.score_mod)
    grid = (_cdiv(shape.seqlen_q, variant.config.block_m), shape.num_heads, shape.batch)
    if not is_general(shape.mask_kind):
        return Plan(launches=(Launch(variant, grid),))
    lists, scratch, fields = block_lists.lists_for(shape.batch, shape.seqlen_q, shape.seqlen_k,
                                                   variant.config.block_m, variant.config.block_n, False,
                                                   shape.mask_heads, not shape.packed)
    return Plan(launches=(lists, Launch(variant, grid)), scratch=(scratch,), fields=fields)


def plan_backward(shape: ProblemShape, arch: int, deterministic: bool, num_sms: int | None = None) -> Plan:
    """Pre-pass -> dK/dV (-> GQA reduce) -> dQ. Always deterministic, whatever ``deterministic`` says.

    Scratch: ``softmax_d`` (B, H, Sq); with GQA/MQA (H != Hkv) also ``dk_accum`` / ``dv_accum``
    (B, H, Sk, kHeadDim), per-query-head partials (dk pre-scaled) that the reduce kernel sums (packed
    sequences: no batch dim, a row per packed token; ProblemShape.q_scratch / k_scratch).
    """
    del deterministic, num_sms  # no atomics anywhere: every reduction has a fixed order; one head per CTA
    _check(shape, arch)
    bucket = shape.head_dim_bucket
    b, h, h_kv, sq, sk = shape.batch, shape.num_heads, shape.num_heads_k, shape.seqlen_q, shape.seqlen_k
    dkdv = dkdv_variant(bucket, shape.mask_kind, shape.score_mod)
    dq = dq_variant(bucket, shape.mask_kind, shape.score_mod)
    launches = [Launch(preprocess_variant(bucket), (_cdiv(sq, PREP_ROWS), h, b))]
    scratch = [("softmax_d", shape.q_scratch(h))]
    fields = []
    general = is_general(shape.mask_kind)
    if general:  # the query blocks of each key block (dK/dV), the key blocks of each query block (dQ)
        for kernel, transposed in ((dkdv, True), (dq, False)):
            pre, lists, list_fields = block_lists.lists_for(b, sq, sk, kernel.config.block_m, kernel.config.block_n,
                                                            transposed, shape.mask_heads, not shape.packed)
            launches.append(pre)
            scratch.append(lists)
            fields += list_fields
    launches.append(Launch(dkdv, (_cdiv(sk, dkdv.config.block_n), h, b)))
    if h != h_kv:
        launches.append(Launch(reduce_variant(bucket), (_cdiv(sk, REDUCE_ROWS), h_kv, b)))
        scratch += [("dk_accum", shape.k_scratch(h, bucket)), ("dv_accum", shape.k_scratch(h, bucket))]
    launches.append(Launch(dq, (_cdiv(sq, dq.config.block_m), h, b)))
    return Plan(launches=tuple(launches), scratch=tuple(scratch), fields=(*shape.scratch_strides(h), *fields))


def all_variants(arch: int) -> list:
    """Every SIMT kernel variant: each head-dim bucket x mask kind x modifier for the tiled kernels, each bucket for
    the pre-pass and the reduce. All fit MAX_SMEM_BYTES, so the list is the same on every arch from
    sm_80 on."""
    if not _arch.arch_caps(arch).has_cp_async:
        return []
    out = []
    for head_dim in HEAD_DIM_BUCKETS:
        for mask in MASK_KINDS:
            for mod in SCORE_MODS:
                out += [forward_variant(head_dim, mask, mod), dkdv_variant(head_dim, mask, mod),
                        dq_variant(head_dim, mask, mod)]
        out += [preprocess_variant(head_dim), reduce_variant(head_dim)]
    return out
