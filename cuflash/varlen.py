"""Packed variable-length attention: the varlen entry points and the checks of their offsets.

Sequence ``b`` is rows ``[cu_seqlens_q[b], cu_seqlens_q[b+1])`` of the packed ``q (Tq, H, D)`` and rows
``[cu_seqlens_k[b], cu_seqlens_k[b+1])`` of ``k (Tk, Hkv, D)`` / ``v (Tk, Hkv, Dv)``. The kernels are the
batched ones: the parameter block carries the offsets, and each block reads its sequence's rows and lengths
(cuda_src/cuflash/seqlen.cuh), so work follows the sum of the sequences' work, not B x the longest.

Offsets given as host data (a list, a NumPy array, a CPU tensor) are checked in full and copied to the GPU.
Offsets already on the GPU are checked for shape, dtype and device only, unless ``max_seqlen_q`` /
``max_seqlen_k`` is None: then they are copied back (a host synchronization) to find the longest sequence,
and checked in full on the way. Offsets on the GPU that break the rules (decreasing, past the packed rows,
a sequence longer than ``max_seqlen``) never make a kernel touch memory outside the tensors (the kernels
clamp them), but the result is then unspecified.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from . import validation
from .arrays import TensorDesc, array_key, describe, require_cuda

#: Options the varlen entry points refuse: they index a (B, ..., Sq, Sk) batch, which packed rows do not have.
UNSUPPORTED_OPTIONS = ("bias", "mask", "segment_ids", "block_ids")
_DLPACK_CUDA_DEVICES = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _on_gpu(x) -> bool:
    if type(x).__module__.startswith("cupy"):
        return True
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in _DLPACK_CUDA_DEVICES
    except Exception:  # an object whose DLPack device cannot be read: treat it as host data
        return False


#: A packed call's grid covers the longest sequence rounded up to a multiple of this many rows (at most the packed
#: total): steps whose longest lengths differ by less share one cached plan (packed training passes the batch's
#: longest every step), and the few blocks past a sequence's end return at once (cuda_src/cuflash/seqlen.cuh clamps
#: each length to the grid's, which is never below the longest).
LENGTH_GRANULE = 128


def _granules(longest: int) -> int:
    """How many LENGTH_GRANULE rows cover ``longest``."""
    return -(-longest // LENGTH_GRANULE)


def _grid_rows(longest: int, total: int) -> int:
    """The rows a packed side's grid covers: ``longest`` rounded up to LENGTH_GRANULE, at most ``total``."""
    return min(_granules(longest) * LENGTH_GRANULE, total)


def _max_seqlen(value, name: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0 or None, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_offsets(values, name: str, total: int, longest_allowed: int | None, tokens: str) -> int:
    """Check host offsets (1-D ints) of a packed side with ``total`` rows; returns the longest sequence."""
    values = np.asarray(values)
    if values.ndim != 1 or values.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(values.shape)}")
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {values.dtype}")
    values = values.astype(np.int64)
    if values[0] < 0:
        raise ValueError(f"{name} must start at 0 (or later), got {int(values[0])}")
    lengths = np.diff(values)
    if (lengths < 0).any():
        at = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing, but entry {at + 1} ({int(values[at + 1])}) is less "
                         f"than entry {at} ({int(values[at])})")
    if values[-1] > total:
        raise ValueError(f"{name} ends at {int(values[-1])}, past {tokens}'s {total} packed rows")
    longest = int(lengths.max())
    if longest_allowed is not None and longest > longest_allowed:
        raise ValueError(f"{name} has a sequence of {longest} tokens, more than max_seqlen_{tokens[0]} = "
                         f"{longest_allowed}")
    return longest


@dataclasses.dataclass
class _Side:
    """One side's offsets once checked: the device array's description, the longest sequence."""

    desc: TensorDesc
    longest: int
    owner: object = None  # the device copy made from host offsets (alive until the launches are enqueued)


class PackedSequences:
    """The varlen arguments of one call, checked by :meth:`check` inside the call (``cuflash.api``).

    After :meth:`check`, ``fields`` holds the parameter-block fields of the offsets and ``batch`` the
    number of sequences."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.max_seqlen_q = _max_seqlen(max_seqlen_q, "max_seqlen_q")
        self.max_seqlen_k = _max_seqlen(max_seqlen_k, "max_seqlen_k")
        self.fields = ()
        self._sides = ()

    @staticmethod
    def reject_unsupported(options: dict) -> None:
        for name in UNSUPPORTED_OPTIONS:
            if options.get(name) is not None:
                raise ValueError(f"{name} is not supported with packed (varlen) sequences: it indexes a "
                                 f"(B, H, Sq, Sk) batch; pad the batch and call cuflash.attention instead")

    def _side(self, x, name: str, total: int, max_len: int | None, tokens: str, device: int) -> _Side:
        if x is None:
            raise TypeError(f"{name} must be an int32 array (batch + 1,) of row offsets, got None")
        if not _on_gpu(x):
            if not hasattr(x, "__len__") and not hasattr(x, "__array__"):
                raise TypeError(f"{name} must be an int32 array (batch + 1,) of row offsets, got {type(x).__name__}")
            host = np.asarray(x)
            longest = check_offsets(host, name, total, max_len, tokens)
            import cupy

            with cupy.cuda.Device(device):
                owner = cupy.asarray(host.astype(np.int32))
            return _Side(describe(owner, name), longest, owner)
        require_cuda(x, name)
        desc = describe(x, name)
        if desc.ndim != 1 or desc.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(desc.shape)}")
        if desc.dtype != "int32":
            raise TypeError(f"{name} must have dtype int32, got {desc.dtype}")
        if desc.device != device:
            raise ValueError(f"{name} is on CUDA device {desc.device} but q is on device {device}")
        if desc.strides[0] != 1:
            raise ValueError(f"{name} must be contiguous, got strides {desc.strides}")
        if max_len is None:  # find the longest sequence: a device-to-host copy (and a full check)
            import cupy

            device_values = desc.array if desc.array is not None else cupy.from_dlpack(x)  # a torch int tensor
            longest = check_offsets(cupy.asnumpy(device_values), name, total, None, tokens)
        else:
            longest = max_len
        return _Side(desc, longest)

    def check(self, qd: TensorDesc, kd: TensorDesc, vd: TensorDesc, *, causal: bool):
        """Validate packed q ``(Tq, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)`` and the offsets;
        returns the packed :class:`~cuflash.kernels.ProblemShape`."""
        for t, axes in ((qd, "(Tq, H, D)"), (kd, "(Tk, Hkv, D)"), (vd, "(Tk, Hkv, Dv)")):
            if t.ndim != 3:
                raise ValueError(f"{t.name} must have 3 dimensions {axes} (packed sequences), got shape {t.shape}")
        shape = validation.check_qkv(*(_batch_of_one(t) for t in (qd, kd, vd)), causal=causal)
        total_q, total_k = qd.shape[0], kd.shape[0]
        q_side = self._side(self.cu_seqlens_q, "cu_seqlens_q", total_q, self.max_seqlen_q, "q", qd.device)
        k_side = self._side(self.cu_seqlens_k, "cu_seqlens_k", total_k, self.max_seqlen_k, "k", qd.device)
        batch = q_side.desc.shape[0] - 1
        if k_side.desc.shape[0] - 1 != batch:
            raise ValueError(f"cu_seqlens_q has {batch} sequences but cu_seqlens_k has {k_side.desc.shape[0] - 1}")
        if batch > validation.MAX_GRID_YZ:
            raise ValueError(f"{batch} sequences; at most {validation.MAX_GRID_YZ} are supported")
        self._sides = (q_side, k_side)
        self.fields = (("cu_seqlens_q", q_side.desc.ptr), ("cu_seqlens_k", k_side.desc.ptr))
        # No sequence is longer than its side's packed rows: a larger max_seqlen only widens the grid.
        return dataclasses.replace(shape, batch=batch, seqlen_q=_grid_rows(q_side.longest, total_q),
                                   seqlen_k=_grid_rows(k_side.longest, total_k), packed=True, total_q=total_q,
                                   total_k=total_k)


def _batch_of_one(t: TensorDesc) -> TensorDesc:
    """A packed (T, H, D) description as a batch of one (1, T, H, D), for the batched checks."""
    return dataclasses.replace(t, shape=(1, *t.shape), strides=(0, *t.strides))


# ---------------------------------------------------------------------------------------------------------
# Entry points


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                             scale=None, causal=False, deterministic=False, out=None, lse=None, stream=None,
                             **options):
    """Attention over packed variable-length sequences. Returns ``(out (Tq, H, Dv), lse (H, Tq))``.

    ``q (Tq, H, D)``, ``k (Tk, Hkv, D)``, ``v (Tk, Hkv, Dv)`` hold the sequences back to back;
    ``cu_seqlens_q`` / ``cu_seqlens_k`` ``(B + 1,)`` int32 are their row offsets (on the GPU, or host data:
    checked and copied), ``max_seqlen_q`` / ``max_seqlen_k`` the longest lengths (None: read from the
    offsets, a host synchronization when those are on the GPU). Causal and window are aligned per sequence
    (bottom-right); ``alibi_slopes`` may be ``(H,)`` or ``(B, H)``; ``softcap``, ``scale`` as for
    :func:`cuflash.attention_forward`. Rows outside every sequence get out 0 and lse -inf. ``bias``,
    ``mask``, ``segment_ids`` and ``block_ids`` are refused (they index a padded batch).
    """
    from . import api, launch

    try:
        packed_key, offsets = _packed_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        key, pointers, option_pointers = api._forward_key(q, k, v, out, lse, scale, causal, options)
        key = (*key, packed_key)
        plan = api._forward_plans.get(key)
    except Exception:  # what the keys do not cover (host offsets, no longest lengths): the validating path
        key = plan = None
    if plan is not None and launch.current_device() == plan.device:
        return api._hit_forward(plan, pointers, out, lse, stream, option_pointers, packed=offsets)
    packed = PackedSequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return api._forward(q, k, v, scale, causal, out, lse, stream, options, key, packed=packed)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     return_lse=False, **kwargs):
    """:func:`varlen_attention_forward`'s ``out``, or ``(out, lse)`` with ``return_lse=True``. For
    gradients use :func:`varlen_attention_backward` or the adapters' ``varlen_attention``."""
    out, lse = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        **kwargs)
    return (out, lse) if return_lse else out


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, dlse=None, scale=None, causal=False, deterministic=False,
                              dq=None, dk=None, dv=None, workspace=None, stream=None, **options):
    """Gradients of :func:`varlen_attention_forward`: ``(dq, dk, dv)`` in the packed shapes of q, k, v.

    ``out`` / ``lse`` are the forward's results for the same inputs and options; ``dlse (H, Tq)`` the
    gradient flowing into lse. Keys no query sees, and rows outside every sequence, get zero gradients.
    ``deterministic=True``: bit-identical across runs. ``workspace``: see
    :func:`varlen_backward_workspace`.
    """
    from . import api, launch

    try:
        packed_key, offsets = _packed_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        key, pointers, scratch, option_pointers, _ = api._backward_key(
            dout, q, k, v, out, lse, dlse, dq, dk, dv, workspace, scale, causal, deterministic, options)
        key = (*key, packed_key)
        plan = api._backward_plans.get(key)
    except Exception:  # what the keys do not cover (host offsets, no longest lengths): the validating path
        key = plan = None
    if plan is not None and launch.current_device() == plan.device:
        return api._hit_backward(plan, pointers, scratch, dq, dk, dv, stream, option_pointers, packed=offsets)
    packed = PackedSequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return api._backward(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, dq, dk, dv, workspace,
                         stream, options, key, packed=packed)


def _packed_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """``(key, (cu_seqlens_q pointer, cu_seqlens_k pointer))`` of a varlen call's packed part. Only offsets on the
    GPU with both longest lengths given are cached: the shape then follows from metadata alone, as for a batched
    call (host offsets are checked and copied, and a missing length is read from the offsets, every call).
    Raises otherwise."""
    if max_seqlen_q is None or max_seqlen_k is None or not (_on_gpu(cu_seqlens_q) and _on_gpu(cu_seqlens_k)):
        raise KeyError("validated every call")
    (kq, pq), (kk, pk) = array_key(cu_seqlens_q), array_key(cu_seqlens_k)
    lengths = (_max_seqlen(max_seqlen_q, "max_seqlen_q"), _max_seqlen(max_seqlen_k, "max_seqlen_k"))
    # The grid's rows (what the plan depends on): with the packed totals in the arrays' keys, the rounded lengths
    # fix them (_grid_rows).
    return ("packed", kq, kk, *(_granules(n) for n in lengths)), (pq, pk)


def _meta_shape(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal: bool, options: dict):
    """The packed problem shape from metadata only (``.shape`` / ``.dtype``; ints for the longest lengths,
    which fix the grid): for frameworks that plan before the data exists."""
    from . import api

    validation.reject_planned(options)
    PackedSequences.reject_unsupported(options)
    if max_seqlen_q is None or max_seqlen_k is None:
        raise TypeError("max_seqlen_q and max_seqlen_k must be ints here (they fix the grid)")
    descs = [api._meta_desc(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    for t in descs:
        if t.ndim != 3:
            raise ValueError(f"{t.name} must have 3 dimensions (packed sequences), got shape {t.shape}")
    if len(cu_seqlens_q.shape) != 1 or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens_q.shape)}")
    shape = validation.check_qkv(*(_batch_of_one(t) for t in descs), causal=causal)
    total_q, total_k = descs[0].shape[0], descs[1].shape[0]
    shape = dataclasses.replace(shape, batch=int(cu_seqlens_q.shape[0]) - 1,
                                seqlen_q=_grid_rows(_max_seqlen(max_seqlen_q, "max_seqlen_q"), total_q),
                                seqlen_k=_grid_rows(_max_seqlen(max_seqlen_k, "max_seqlen_k"), total_k),
                                packed=True, total_q=total_q, total_k=total_k)
    return validation.check_score_options(shape, options, api._meta_desc, 0)[0]


def varlen_backward_workspace(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                              deterministic=False, scale=None, **options) -> dict:
    """Shapes of the float32 scratch :func:`varlen_attention_backward` needs, by name (for frameworks that
    allocate it). Needs only ``.shape`` / ``.dtype`` of q, k, v and the offsets, and ints for the longest
    lengths (which fix the grid)."""
    from . import api, launch

    del cu_seqlens_k, scale  # the plan does not depend on them
    shape = _meta_shape(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, options)
    if not api._has_work(shape) or shape.seqlen_k == 0:
        return {}
    return launch.backward_plan(shape, launch.current_device(), bool(deterministic)).scratch_dict()


def varlen_prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                   deterministic=False, backward=True, scale=None, **options) -> None:
    """:func:`cuflash.prepare` for a packed call: compile and load every kernel it launches (metadata only,
    as for :func:`varlen_backward_workspace`)."""
    from . import api

    del cu_seqlens_k, scale
    api.load_kernels(_meta_shape(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, options), backward,
                     deterministic)
