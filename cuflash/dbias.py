"""How the backward makes dbias for a bias that broadcasts: its gradient is dS summed over the broadcast dims.

A bias with an element per (b, h, i, j) needs no sums: the dK/dV kernels store each element once (api.py). A
broadcast one takes one of these (:class:`Sums`, chosen by :func:`plan_sums`):

- ``atomic``: fp32 atomic adds into a zeroed accumulator of the bias's shape, then a conversion (the default).
- ``in_place``: the same adds into an fp32, contiguous dbias itself.
- ``ordered`` (deterministic=True, a bias broadcast over the batch and / or the heads only): the same adds taking
  turns in a fixed order, their counters after the accumulator (cuda_src/cuflash/dbias_order.cuh).
- ``key_slots`` (deterministic=True, a key bias (B|1, H|Hkv|1, 1, Sk)): each dK/dV thread adds its sums over the
  queries into partials (B, H, slots, Sk) that it alone writes, so they land in its program order
  (BiasView::add_grad_over_queries); the host then sums them over the slots and the broadcast dims in a fixed
  order.
- ``lse`` (a bias constant along the keys, (B|1, H|Hkv|1, Sq|1, 1), either mode): adding c to every score of a
  row leaves its softmax, hence the output, unchanged and adds c to its lse, so dbias of the row is exactly
  dlse (0 where the row sees no key: its lse is -inf), summed over the broadcast dims; no kernel adds.
"""
from __future__ import annotations

import dataclasses
import math

from . import launch
from .arrays import describe
from .kernels import ProblemShape
from .kernels import backward as backward_kernels

#: A deterministic key bias's partials per (batch, query head, key) in the SIMT kernels: one per query residue
#: modulo 16 (their threads' rows; BiasView::store_grad<true>). The tensor-core ones take one per warp sharing a key.
SIMT_SLOTS = 16
#: The kernels that add dbias (the dK/dV ones), by name.
DKDV_KERNELS = ("cuflash::flash_bwd_dkdv_kernel", "cuflash::flash_bwd_dkdv_simt_kernel")


@dataclasses.dataclass(frozen=True)
class Sums:
    """How one backward's broadcast dbias is summed (module docstring); a cached call repeats it."""
    bias_shape: tuple
    dtype: str  # the inputs' dtype name (dbias's)
    how: str  # atomic | in_place | ordered | key_slots | lse
    q_blocks: int = 0  # ordered: the dK/dV tile's query / key blocks (one counter per slice and tile)
    k_blocks: int = 0
    partials: tuple = ()  # key_slots: (B, H, slots, Sk)

    def buffer(self, dbias_d):
        """The zeroed fp32 array the kernels add into (dbias itself for in_place; None for lse)."""
        import cupy

        if self.how == "lse":
            return None
        if self.how == "in_place":
            dbias_d.array.fill(0)
            return dbias_d.array
        if self.how == "key_slots":
            return cupy.zeros(self.partials, dtype=cupy.float32)
        if self.how == "atomic":
            return cupy.zeros(self.bias_shape, dtype=cupy.float32)
        elements = math.prod(self.bias_shape)  # ordered: the int counters after the sums, zeroed with them
        slices = self.bias_shape[0] * self.bias_shape[1]
        storage = cupy.zeros(elements + slices * self.q_blocks * self.k_blocks, dtype=cupy.float32)
        return storage[:elements].reshape(self.bias_shape)

    def fields(self, buffer) -> dict:
        """The params fields that point the kernels at ``buffer`` (none for lse)."""
        if buffer is None:
            return {}
        if self.how == "key_slots":  # per query head h = bias head * div + h % div (the kernels' bias_head_div)
            _, heads, slots, keys = self.partials
            div = heads // self.bias_shape[1] if self.bias_shape[1] > 1 else 1
            return dict(dbias_accum=buffer.data.ptr, dbias_batch_stride=heads * slots * keys,
                        dbias_head_stride=div * slots * keys, dbias_qhead_stride=slots * keys, dbias_row_stride=0,
                        dbias_col_stride=1, dbias_slot_stride=keys)
        st = [s // 4 if n > 1 else 0 for n, s in zip(buffer.shape, buffer.strides)]
        fields = dict(dbias_accum=buffer.data.ptr, dbias_batch_stride=st[0], dbias_head_stride=st[1],
                      dbias_row_stride=st[2], dbias_col_stride=st[3])
        if self.how == "ordered":
            fields.update(dbias_order_offset=math.prod(self.bias_shape), dbias_order_qblocks=self.q_blocks,
                          dbias_order_kblocks=self.k_blocks)
        return fields

    def finish(self, buffer, dbias_d, device: int, stream_ptr: int, lse=None, dlse=None) -> None:
        """dbias from the kernels' sums in ``buffer`` (or, for lse, from the backward's lse / dlse arrays),
        enqueued on the current CuPy stream (the launches')."""
        if self.how == "in_place":
            return
        if self.how == "lse":
            sums = _row_sums_from_lse(describe(lse, "lse").array,
                                      None if dlse is None else describe(dlse, "dlse").array, self.bias_shape)
        elif self.how == "key_slots":
            sums = _sum_key_slots(buffer, self.bias_shape)
        else:
            sums = buffer
        _convert(sums, dbias_d, self.dtype, device, stream_ptr)


def plan_sums(opts, shape: ProblemShape, deterministic: bool, plan, dbias_d) -> Sums:
    """The :class:`Sums` of a broadcast bias's backward. Under deterministic=True every form sums in a fixed order:
    a key bias in its threads' own partials, a bias with the scores' rows and keys broadcast over the batch and / or
    the heads by turns (cuda_src/cuflash/dbias_order.cuh; under ids or a bool mask over the union of the
    contributors' tiles, cuda_src/block_lists.cu), a bias constant along the keys from dlse. All are laid out per
    batch row of the batched layout (packed sequences take no bias: cuflash/varlen.py)."""
    bias_shape, dtype = tuple(opts.bias.shape), shape.dtype
    if bias_shape[3] == 1:
        return Sums(bias_shape, dtype, "lse")
    if deterministic:
        assert not shape.packed, "a bias with packed sequences is refused by the varlen entry points"
        kernel = next(l.variant for l in plan.launches if l.variant.name in DKDV_KERNELS)
        dkdv = kernel.config
        if bias_shape[2] == 1:
            slots = (SIMT_SLOTS if kernel.name.endswith("simt_kernel")
                     else max(1, dkdv.num_warps // (dkdv.block_n // 16)))  # DkdvConfig::kWarpsD
            return Sums(bias_shape, dtype, "key_slots", partials=(shape.batch, shape.num_heads, slots, shape.seqlen_k))
        # The kernels carry the turns where a deterministic plan runs them (dbias_order.cuh, dkdv_mainloop.cuh):
        # the warp-specialized dK/dV kernel, or another one without the atomic dQ adds.
        assert not getattr(dkdv, "atomic_dq", False) or dkdv.mainloop in backward_kernels.WS_MAINLOOPS, dkdv
        return Sums(bias_shape, dtype, "ordered", q_blocks=-(-shape.seqlen_q // dkdv.block_m),
                    k_blocks=-(-shape.seqlen_k // dkdv.block_n))
    if dtype == "float32" and dbias_d.array.flags.c_contiguous:
        return Sums(bias_shape, dtype, "in_place")
    return Sums(bias_shape, dtype, "atomic")


def _row_sums_from_lse(lse, dlse, bias_shape: tuple, xp=None):
    """dbias of a bias constant along the keys, fp32 in ``bias_shape``: dlse where the row's lse is finite,
    summed over the broadcast batch / heads / rows in a fixed order (CuPy's reductions use no atomics).
    ``xp``: the array module (CuPy; NumPy in the CPU tests)."""
    if xp is None:
        import cupy as xp
    if dlse is None:
        return xp.zeros(bias_shape, dtype=xp.float32)
    grad = xp.where(xp.isneginf(lse), xp.float32(0), dlse.astype(xp.float32, copy=False))
    batch, heads, rows = grad.shape
    grad = grad.reshape(batch, bias_shape[1], heads // bias_shape[1], rows).sum(axis=2)
    if bias_shape[0] == 1:
        grad = grad.sum(axis=0, keepdims=True)
    if bias_shape[2] == 1:
        grad = grad.sum(axis=2, keepdims=True)
    return xp.ascontiguousarray(grad.reshape(bias_shape))


def _sum_key_slots(partials, bias_shape: tuple, xp=None):
    """A deterministic key bias's partials (B, H, slots, Sk) summed over the slots and the broadcast batch /
    heads, in a fixed order, into fp32 ``bias_shape``. ``xp``: as for :func:`_row_sums_from_lse`."""
    if xp is None:
        import cupy as xp

    batch, heads, _, keys = partials.shape
    sums = partials.sum(axis=2).reshape(batch, bias_shape[1], heads // bias_shape[1], keys).sum(axis=2)
    if bias_shape[0] == 1:
        sums = sums.sum(axis=0, keepdims=True)
    return xp.ascontiguousarray(sums.reshape(bias_shape))


def _convert(sums, dbias_d, dtype: str, device: int, stream_ptr: int) -> None:
    """fp32 sums into dbias: the conversion kernel for fp16 / bf16 where dbias is contiguous and 16-byte
    aligned (always so when cuflash allocates it), else CuPy's cast or copy (a dbias= view of another layout;
    fp32 sums that could not be made in dbias itself)."""
    import cupy

    if dtype != "float32" and dbias_d.array.flags.c_contiguous and dbias_d.ptr % 16 == 0:
        launch.convert_dbias(sums, dbias_d.ptr, dtype, device, stream_ptr)
    else:
        cupy.copyto(dbias_d.array, sums, casting="unsafe")
