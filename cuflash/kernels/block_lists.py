"""Plan pieces for the general mask's pre-pass, ``cuda_src/block_lists.cu``.

A kernel whose mask is the general one (window, segment ids, block ids; ``ProblemShape.general_mask``)
walks per-block lists instead of analytic ranges: per query block the key blocks it visits (``kv_blocks``,
forward and dQ kernels), or per key block the query blocks that visit it (``q_blocks``, dK / dV kernels),
each entry flagged "partial" when the per-element test must run. The lists depend on the kernel's tile, so
each attention launch that needs them is preceded by one pre-pass launch with the same tile: grid
``(outer blocks, mask heads, B)``, 128 threads, no dynamic shared memory. The lists are int32 scratch
``(B, mask heads, outer blocks, inner blocks + 1)``, rows ``[count, entries...]``; ``mask heads`` is 1
unless a bool mask differs per head (``ProblemShape.mask_heads``). The query-block lists (not transposed) carry
one more int after the rows, the warp-specialized forward's tile counter, which the pre-pass zeroes.

In the batched layout the buffer then holds the id ranges (``IdRanges`` in ``cuda_src/cuflash/params.cuh``):
``B`` flags (the inner side's segment / block ids sorted in that batch row), one int of alignment slack, and
an int pair per outer row, ``(B, S_outer)``: the half-open range of inner rows that outer row's ids let it
see. With them a partial tile tests two bounds per score instead of reading ids. Packed sequences take no
ids, so no ranges.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import KernelVariant, Launch

SOURCE = "block_lists.cu"
KERNEL_NAME = "cuflash::flash_block_lists_kernel"
THREADS = 128


@dataclass(frozen=True)
class ListConfig:
    """The template arguments of ``flash_block_lists_kernel<kOuter, kInner, kTransposed>``, in order."""

    outer: int  # rows of an outer block (query block; key block when transposed)
    inner: int  # rows of an inner block
    transposed: bool  # lists of query blocks per key block (dK / dV kernels)


def variant(outer: int, inner: int, transposed: bool) -> KernelVariant:
    return KernelVariant(SOURCE, KERNEL_NAME, ListConfig(outer, inner, bool(transposed)), THREADS, 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lists_for(batch: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, transposed: bool,
              heads: int = 1, id_ranges: bool = True):
    """The pre-pass for a kernel with ``block_m`` queries x ``block_n`` keys per tile; ``id_ranges``: room
    for the id ranges after the lists (the batched layout; packed sequences have no ids).

    Returns ``(launch, scratch entry, params fields)``: the launch to put before the kernel, the
    ``(field, shape)`` of its list buffer, and the ``AttnParams`` row count / stride fields.
    """
    if transposed:
        outer, inner, n_outer, n_inner = block_n, block_m, _cdiv(seqlen_k, block_n), _cdiv(seqlen_q, block_m)
        field, prefix = "q_blocks", "q_blocks"
    else:
        outer, inner, n_outer, n_inner = block_m, block_n, _cdiv(seqlen_q, block_m), _cdiv(seqlen_k, block_n)
        field, prefix = "kv_blocks", "kv_blocks"
    launch = Launch(variant(outer, inner, transposed), (max(n_outer, 1), heads, batch))
    # One int after the (batch, heads, outer blocks, inner blocks + 1) rows: the forward's tile counter
    # (flash_fwd.cu's FwdTileQueue; zeroed by this pre-pass, read only by the warp-specialized forward).
    size = batch * heads * max(n_outer, 1) * (n_inner + 1) + (0 if transposed else 1)
    if id_ranges:  # flags, one int of slack for the pairs' 8-byte alignment, a pair per outer row
        size += batch + 1 + 2 * batch * (seqlen_k if transposed else seqlen_q)
    scratch = (field, (size,))
    fields = ((f"{prefix}_rows", max(n_outer, 1)), (f"{prefix}_stride", n_inner + 1))
    return launch, scratch, fields


def all_variants(arch: int) -> list:
    """One pre-pass per distinct (tile, orientation) of the kernels that run the general mask on ``arch``."""
    from . import backward, forward, is_general, simt
    from ..arch import arch_caps

    tiles = set()
    for v in simt.all_variants(arch):
        c = v.config
        if is_general(getattr(c, "mask", 0)):
            tiles.add((c.block_m, c.block_n, "dkdv" in v.name))
    if arch_caps(arch).has_cp_async:
        for v in forward.all_variants(arch) + backward.all_variants(arch):
            c = v.config
            if is_general(getattr(c, "mask", 0)):
                tiles.add((c.block_m, c.block_n, "dkdv" in v.name))
                if "dkdv" in v.name and c.mainloop == backward.MAINLOOP_SM90_WS_ORDERED:  # its dQ adds' ranks
                    tiles.add((c.block_m, c.block_n, False))
    out = []
    for block_m, block_n, transposed in sorted(tiles):
        outer, inner = (block_n, block_m) if transposed else (block_m, block_n)
        out.append(variant(outer, inner, transposed))
    return out
