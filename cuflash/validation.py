"""Every rule of docs/api.md's "Errors" section, checked on :class:`~cuflash.arrays.TensorDesc` before any
launch. Messages name the argument, what was expected and what came.

Works on descriptions only (no GPU needed), so CPU tests exercise every rule.
"""
from __future__ import annotations

import math

from .arrays import SUPPORTED_DTYPES, TensorDesc
from .kernels import MAX_HEAD_DIM, ProblemShape

#: Vectorized loads move 16 bytes: base pointers and row/head/batch strides must keep that alignment.
LOAD_ALIGNMENT_BYTES = 16
#: Grid y (heads) and z (batch) are limited to 65535 blocks.
MAX_GRID_YZ = 65535
#: Options docs/api.md promises that are not implemented yet; passing one raises NotImplementedError.
PLANNED_OPTIONS = ("window", "softcap", "mask", "bias", "alibi_slopes", "segment_ids", "block_ids",
                   "dropout_p", "seed")


def reject_planned(options: dict) -> None:
    """Raise for an option docs/api.md specifies but this build does not implement yet (never ignore it)."""
    defaults = {"window": (None, None), "dropout_p": 0.0}
    for name in PLANNED_OPTIONS:
        value = options.get(name, defaults.get(name))
        if name == "window" and value is not None and tuple(value) == (None, None):
            continue
        if value is None or (name == "dropout_p" and value == 0.0):
            continue
        raise NotImplementedError(
            f"{name}= is not implemented in this version of cuflash yet (planned); today's kernels "
            f"support scale, causal, GQA/MQA, dlse and deterministic"
        )
    unknown = set(options) - set(PLANNED_OPTIONS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")


def _check_dtype(t: TensorDesc) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{t.name} has dtype {t.dtype}; cuflash supports {', '.join(SUPPORTED_DTYPES)}")


def _check_loadable(t: TensorDesc) -> None:
    """Last dim contiguous, base pointer and outer strides 16-byte aligned."""
    if t.shape[-1] != 1 and t.strides[-1] != 1:
        raise ValueError(
            f"{t.name} must be contiguous in its last dimension (stride 1), but its last stride is "
            f"{t.strides[-1]} elements; pass a copy or a view whose last dimension is contiguous"
        )
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{t.name} has negative strides {t.strides}; pass a copy")
    if t.ptr % LOAD_ALIGNMENT_BYTES:
        raise ValueError(
            f"{t.name}'s base pointer is not {LOAD_ALIGNMENT_BYTES}-byte aligned (address % 16 = "
            f"{t.ptr % LOAD_ALIGNMENT_BYTES}); cuflash loads {LOAD_ALIGNMENT_BYTES} bytes at a time. "
            f"This happens with a view at an odd element offset: pass a copy"
        )
    for axis, (size, stride) in enumerate(zip(t.shape[:-1], t.strides[:-1])):
        if size > 1 and (stride * t.itemsize) % LOAD_ALIGNMENT_BYTES:
            raise ValueError(
                f"{t.name}'s stride along axis {axis} is {stride} elements ({stride * t.itemsize} "
                f"bytes), not a multiple of {LOAD_ALIGNMENT_BYTES} bytes; pass a copy"
            )


def _check_head_dim(t: TensorDesc, what: str) -> None:
    d = t.shape[-1]
    if d % 8 or d < 8 or d > MAX_HEAD_DIM:
        raise ValueError(
            f"{t.name} has {what} {d}; cuflash supports head dims that are multiples of 8 from 8 to "
            f"{MAX_HEAD_DIM}"
        )


def check_qkv(q: TensorDesc, k: TensorDesc, v: TensorDesc, *, causal: bool) -> ProblemShape:
    """Validate q/k/v (layout bshd) and return the problem shape."""
    for t in (q, k, v):
        if t.ndim != 4:
            raise ValueError(f"{t.name} must have 4 dimensions (batch, seq, heads, head_dim), got shape {t.shape}")
        _check_dtype(t)
    for t in (k, v):
        if t.dtype != q.dtype:
            raise TypeError(f"{t.name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype")
        if t.device != q.device:
            raise ValueError(f"{t.name} is on CUDA device {t.device} but q is on device {q.device}")
    batch, seqlen_q, num_heads, head_dim = q.shape
    _, seqlen_k, num_heads_k, _ = k.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q has {batch}, k has {k.shape[0]}, v has {v.shape[0]}")
    if v.shape[1] != seqlen_k:
        raise ValueError(f"v has {v.shape[1]} keys but k has {seqlen_k}")
    if v.shape[2] != num_heads_k:
        raise ValueError(f"v has {v.shape[2]} heads but k has {num_heads_k}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head dim {k.shape[3]} but q has {head_dim}")
    if num_heads_k < 1 or num_heads % num_heads_k:
        raise ValueError(f"k has {num_heads_k} heads, which does not divide q's {num_heads} heads")
    if num_heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"q has batch {batch} and {num_heads} heads; each must be at most {MAX_GRID_YZ}")
    _check_head_dim(q, "head dim")
    _check_head_dim(v, "head dim (Dv)")
    for t in (q, k, v):
        _check_loadable(t)
    return ProblemShape(batch, seqlen_q, seqlen_k, num_heads, num_heads_k, head_dim, v.shape[3],
                        q.dtype, bool(causal))


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_buffer(t: TensorDesc, shape: tuple, dtype: str, device: int, *, rows_contiguous_only=False) -> None:
    """An ``out=``-style buffer or a backward input: exact shape, dtype, device and loadability."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{t.name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{t.name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{t.name} is on CUDA device {t.device} but q is on device {device}")
    if rows_contiguous_only:  # lse-like (B, H, Sq) fp32: only the last dim must be contiguous
        if t.shape[-1] != 1 and t.strides[-1] != 1:
            raise ValueError(f"{t.name} must be contiguous in its last dimension, got strides {t.strides}")
        if any(s < 0 for s in t.strides):
            raise ValueError(f"{t.name} has negative strides {t.strides}; pass a copy")
        return
    _check_loadable(t)


def out_shape(shape: ProblemShape) -> tuple:
    return (shape.batch, shape.seqlen_q, shape.num_heads, shape.head_dim_v)


def lse_shape(shape: ProblemShape) -> tuple:
    return (shape.batch, shape.num_heads, shape.seqlen_q)
