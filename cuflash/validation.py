"""Every rule of docs/api.md's "Errors" section, checked on :class:`~cuflash.arrays.TensorDesc` before any
launch. Messages name the argument, what was expected and what came.

Works on descriptions only (no GPU needed), so CPU tests exercise every rule.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from .arrays import SUPPORTED_DTYPES, TensorDesc
from . import tma
from .kernels import MAX_HEAD_DIM, MOD_BIAS, MOD_BIAS_SOFTCAP, MOD_NONE, MOD_SOFTCAP_ALIBI, ProblemShape

#: Vectorized loads move 16 bytes: base pointers and row/head/batch strides must keep that alignment.
LOAD_ALIGNMENT_BYTES = 16
#: Grid y (heads) and z (batch) are limited to 65535 blocks.
MAX_GRID_YZ = 65535
#: Score options the kernels implement (docs/api.md); see :func:`check_score_options`.
SCORE_OPTIONS = ("window", "softcap", "alibi_slopes", "segment_ids", "block_ids", "bias", "mask", "dropout_p", "seed")
#: Options docs/api.md promises that are not implemented yet; passing one raises NotImplementedError.
PLANNED_OPTIONS = ()
#: A window side of None (unbounded) travels to the kernels as this many keys.
UNBOUNDED_WINDOW = 1 << 30


def reject_planned(options: dict) -> None:
    """Raise for an option docs/api.md specifies but this build does not implement yet (never ignore it),
    and for keyword arguments no entry point takes."""
    for name in PLANNED_OPTIONS:
        if options.get(name) is not None:
            raise NotImplementedError(f"{name}= is not implemented in this version of cuflash yet (planned)")
    unknown = set(options) - set(PLANNED_OPTIONS) - set(SCORE_OPTIONS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")


@dataclasses.dataclass(frozen=True)
class ScoreOptions:
    """The validated score options of one call (docs/api.md order: softcap, ALiBi, then the masks)."""

    window: tuple = (None, None)  # (left, right), ints >= 0 or None
    softcap: float = 0.0  # 0 = off
    alibi: TensorDesc | None = None  # float32 (H,) or (B, H)
    segment_ids: tuple | None = None  # (q_ids, k_ids) TensorDescs, int32 (B, Sq), (B, Sk)
    block_ids: tuple | None = None
    bias: TensorDesc | None = None  # q's dtype, 4-D, each dim full or 1 (the head dim H, Hkv or 1)
    num_heads: int = 0  # H, for the bias's and the mask's head mapping
    mask: TensorDesc | None = None  # bool, 4-D, broadcast like bias
    dropout_p: float = 0.0  # in [0, 1); > 0 runs the general mask's dropout variants
    seed: int | None = None  # dropout's seed in [0, 2**64), or None when seed_array holds it
    seed_array: TensorDesc | None = None  # the seed in device memory: 8 bytes (int64 / uint64, or 2 x 32 bits)
    packed: bool = False  # packed sequences: only the general mask's kernels serve them

    @property
    def general_mask(self) -> bool:
        return (self.window != (None, None) or self.segment_ids is not None or self.block_ids is not None
                or self.mask is not None or self.dropout_p > 0.0 or self.packed)

    @property
    def mask_heads(self) -> int:
        """Heads of the block lists: the bool mask's head dim (1 without one)."""
        return 1 if self.mask is None else int(self.mask.shape[1])

    @property
    def score_mod(self) -> int:
        """The kernels' score-modifier kind (the bias ones also apply ALiBi)."""
        if self.bias is not None:
            return MOD_BIAS_SOFTCAP if self.softcap > 0.0 else MOD_BIAS
        return MOD_SOFTCAP_ALIBI if self.softcap > 0.0 or self.alibi is not None else MOD_NONE

    def bias_is_full(self, shape: ProblemShape) -> bool:
        """Whether every (b, h, i, j) has its own bias element: then each dbias element has one writer
        (stored directly, deterministic); otherwise dbias is summed over the broadcast dims (fp32 atomics)."""
        return tuple(self.bias.shape) == (shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k)

    def bias_layout(self):
        """``(shape, element strides (0 along broadcast dims), itemsize)`` of the bias, or None: what a cached
        call re-encodes the bias's tensor map from (launch.CallPlan)."""
        if self.bias is None:
            return None
        t = self.bias
        return tuple(t.shape), tuple(st if n > 1 else 0 for n, st in zip(t.shape, t.strides)), t.itemsize

    def params(self, causal: bool) -> dict:
        """The ``AttnParams`` fields these options set (window sides folded with ``causal``); none without
        options, so a plain call's parameter block is the one the cached path packs."""
        if not (self.general_mask or self.score_mod):
            return {}
        left, right = (UNBOUNDED_WINDOW if w is None else min(int(w), UNBOUNDED_WINDOW) for w in self.window)
        values = {"window_left": left, "window_right": min(right, 0) if causal else right,
                  "softcap": self.softcap}
        if self.alibi is not None:
            values["alibi_slopes"] = self.alibi.ptr
            values["alibi_batch_stride"] = self.alibi.strides[0] if self.alibi.ndim == 2 else 0
        if self.bias is not None:
            t = self.bias
            strides = [st if n > 1 else 0 for n, st in zip(t.shape, t.strides)]
            # Staged (cuda_src/cuflash/bias.cuh): 16-byte rows of contiguous keys, so the tensor-core kernels
            # copy its tiles with cp.async; otherwise (and in fp32) they read it element by element. The keys come
            # in whole 16-byte chunks, so a row's last chunk must end at its last key: a key bias (row stride 0)
            # of Sk % 8 != 0 keys would read past its one row (compute-sanitizer's memcheck, session 41).
            staged = (t.itemsize == 2 and t.shape[3] > 1 and t.shape[3] % 8 == 0 and strides[3] == 1
                      and t.ptr % 16 == 0 and all(st % 8 == 0 for st in strides[:3]))
            values.update(bias=t.ptr, bias_batch_stride=strides[0], bias_head_stride=strides[1],
                          bias_row_stride=strides[2], bias_col_stride=1 if strides[3] else 0,
                          bias_head_div=max(1, self.num_heads // t.shape[1]) if t.shape[1] > 1 else 1,
                          bias_staged=int(staged))
            # TMA where it can read the bias (cuflash/tma.py; the launch passes the map, launch.CallPlan): the
            # warp-specialized sm_90a kernels then load its staged tiles by TMA; every other kernel ignores the flag.
            if staged and not self.packed and tma.bias_map(t.shape, strides, t.itemsize, t.ptr) is not None:
                values["bias_tma"] = 1
        if self.mask is not None:
            t = self.mask
            strides = [st if n > 1 else 0 for n, st in zip(t.shape, t.strides)]
            values.update(mask=t.ptr, mask_batch_stride=strides[0], mask_head_stride=strides[1],
                          mask_row_stride=strides[2], mask_col_stride=strides[3], mask_heads=self.mask_heads,
                          mask_head_div=max(1, self.num_heads // self.mask_heads))
        for pair, prefix in ((self.segment_ids, "segment"), (self.block_ids, "block")):
            if pair is not None:
                for side, t in zip("qk", pair):
                    values[f"{side}_{prefix}_ids"] = t.ptr
                    values[f"{side}_{prefix}_batch_stride"] = t.strides[0]
        if self.dropout_p > 0.0:
            from .reference import dropout_threshold

            values["dropout_threshold"] = dropout_threshold(self.dropout_p)
            values["dropout_rp"] = 1.0 / (1.0 - self.dropout_p)
            if self.seed_array is not None:
                values["dropout_seed_ptr"] = self.seed_array.ptr
            else:  # the 64 seed bits, as the int64 the field holds
                values["dropout_seed"] = self.seed - (1 << 64) if self.seed >= (1 << 63) else self.seed
        return values


def _check_window(window) -> tuple:
    if window is None:
        return (None, None)
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
    sides = []
    for name, w in zip(("left", "right"), window):
        if w is None:
            sides.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window {name} must be an int >= 0 or None, got {type(w).__name__} {w!r}")
        if w < 0:
            raise ValueError(f"window {name} must be >= 0 (None for unbounded), got {w}")
        sides.append(int(w))
    return tuple(sides)


def _check_softcap(softcap) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number > 0 or None, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be a finite number > 0 (or None / 0 for none), got {value}")
    return value


def _check_dropout(dropout_p, seed, describe, device: int) -> tuple:
    """``(dropout_p, seed int or None, seed TensorDesc or None)``; the seed only matters when dropout_p > 0."""
    if dropout_p is None:
        return 0.0, None, None
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if p == 0.0:
        return 0.0, None, None
    if seed is None:
        raise ValueError("seed= is required with dropout_p > 0: the backward regenerates the forward's dropout "
                         "mask from it, so pass the same seed to both (an int in [0, 2**64), or an 8-byte array "
                         "on the GPU)")
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        if not 0 <= int(seed) < (1 << 64):
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        return p, int(seed), None
    if isinstance(seed, (bool, numbers.Number, str, bytes)):
        raise TypeError(f"seed must be an int or an 8-byte array on the GPU, got {type(seed).__name__}")
    t = describe(seed, "seed")
    n = 1
    for size in t.shape:
        n *= size
    if t.dtype not in ("int64", "uint64", "int32", "uint32") or n * t.itemsize != 8:
        raise ValueError(f"seed as an array must hold 8 bytes: one int64 / uint64 or two int32 / uint32 (a JAX "
                         f"key's data), got shape {tuple(t.shape)} dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"seed is on CUDA device {t.device} but q is on device {device}")
    if n > 1 and t.strides[-1] != 1:
        raise ValueError(f"seed must be contiguous, got strides {t.strides}")
    if t.ptr % 8:
        raise ValueError("seed's base pointer is not 8-byte aligned")
    return p, None, t


def _check_small_array(t: TensorDesc, shapes: tuple, dtype: str, device: int, expected: str) -> None:
    """An option array: one of ``shapes``, ``dtype``, on ``device``, last dim contiguous, strides >= 0."""
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{t.name} must have shape {expected}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{t.name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{t.name} is on CUDA device {t.device} but q is on device {device}")
    if t.shape and t.shape[-1] != 1 and t.strides[-1] != 1:
        raise ValueError(f"{t.name} must be contiguous in its last dimension, got strides {t.strides}")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{t.name} has negative strides {t.strides}; pass a copy")
    if t.ptr % t.itemsize:
        raise ValueError(f"{t.name}'s base pointer is not aligned to its {t.itemsize}-byte elements")


def _check_broadcast(t: TensorDesc, shape: ProblemShape, dtype: str, device: int, dtype_rule: str) -> None:
    """bias / mask: 4-D, broadcastable to (B, H, Sq, Sk) with a head dim of H, Hkv or 1, the dtype the
    option wants, on q's device, no negative strides."""
    b, h, hk, sq, sk = shape.batch, shape.num_heads, shape.num_heads_k, shape.seqlen_q, shape.seqlen_k
    expected = f"(B|1, H|Hkv|1, Sq|1, Sk|1) = ({b}|1, {h}|{hk}|1, {sq}|1, {sk}|1)"
    if t.ndim != 4:
        raise ValueError(f"{t.name} must have 4 dimensions {expected}, got shape {tuple(t.shape)}")
    allowed = ((b, 1), (h, hk, 1), (sq, 1), (sk, 1))
    for axis, (n, ok, what) in enumerate(zip(t.shape, allowed, ("batch", "heads", "seq_q", "seq_k"))):
        if n not in ok:
            raise ValueError(f"{t.name} has {n} along axis {axis} ({what}); it must broadcast to (B, H, Sq, Sk): "
                             f"shape {expected}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{t.name} must have {dtype_rule}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{t.name} is on CUDA device {t.device} but q is on device {device}")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{t.name} has negative strides {t.strides}; pass a copy")


def _check_bias(t: TensorDesc, shape: ProblemShape, dtype: str, device: int) -> None:
    """bias: broadcastable (``_check_broadcast``) in q's dtype; its last dim contiguous or broadcast (stride
    0), element-aligned."""
    _check_broadcast(t, shape, dtype, device, f"q's dtype {dtype}")
    if t.shape[3] > 1 and t.strides[3] not in (0, 1):
        raise ValueError(f"bias must be contiguous (or broadcast, stride 0) in its last dimension, got strides "
                         f"{t.strides}")
    if t.ptr % t.itemsize:
        raise ValueError(f"bias's base pointer is not aligned to its {t.itemsize}-byte elements")


def check_score_options(shape: ProblemShape, options: dict, describe, device: int) -> tuple:
    """Validate window / softcap / alibi_slopes / segment_ids / block_ids / bias / mask / dropout_p and seed
    (``describe(x, name)``
    turns an array into a TensorDesc). Returns ``(shape with general_mask / score_mod / mask_heads set,
    ScoreOptions)``."""
    b, h, sq, sk = shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k
    window = _check_window(options.get("window"))
    softcap = _check_softcap(options.get("softcap"))
    alibi = None
    if options.get("alibi_slopes") is not None:
        alibi = describe(options["alibi_slopes"], "alibi_slopes")
        _check_small_array(alibi, ((h,), (b, h)), "float32", device, f"({h},) or ({b}, {h}) (H or B, H)")
    pairs = {}
    for name in ("segment_ids", "block_ids"):
        pair = options.get(name)
        if pair is None:
            pairs[name] = None
            continue
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise TypeError(f"{name} must be a pair (q_ids, k_ids) of int32 arrays (B, Sq) and (B, Sk)")
        q_ids = describe(pair[0], f"{name}[0] (q_ids)")
        k_ids = describe(pair[1], f"{name}[1] (k_ids)")
        _check_small_array(q_ids, ((b, sq),), "int32", device, f"({b}, {sq}) (B, Sq)")
        _check_small_array(k_ids, ((b, sk),), "int32", device, f"({b}, {sk}) (B, Sk)")
        pairs[name] = (q_ids, k_ids)
    bias = mask = None
    if options.get("bias") is not None:
        bias = describe(options["bias"], "bias")
        _check_bias(bias, shape, shape.dtype, device)
    if options.get("mask") is not None:
        mask = describe(options["mask"], "mask")
        _check_broadcast(mask, shape, "bool", device, "dtype bool (True = attend)")
    dropout_p, seed, seed_array = _check_dropout(options.get("dropout_p"), options.get("seed"), describe, device)
    opts = ScoreOptions(window, softcap, alibi, pairs["segment_ids"], pairs["block_ids"], bias, h, mask, dropout_p,
                        seed, seed_array, shape.packed)
    return dataclasses.replace(shape, general_mask=opts.general_mask, score_mod=opts.score_mod,
                               mask_heads=opts.mask_heads, bool_mask=mask is not None, dropout=dropout_p > 0.0), opts


def _check_dtype(t: TensorDesc) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{t.name} has dtype {t.dtype}; cuflash supports {', '.join(SUPPORTED_DTYPES)}")


def check_aligned_base(t: TensorDesc) -> None:
    """Base pointer 16-byte aligned (the kernels' vector and bulk copies)."""
    if t.ptr % LOAD_ALIGNMENT_BYTES:
        raise ValueError(
            f"{t.name}'s base pointer is not {LOAD_ALIGNMENT_BYTES}-byte aligned (address % 16 = "
            f"{t.ptr % LOAD_ALIGNMENT_BYTES}); cuflash loads {LOAD_ALIGNMENT_BYTES} bytes at a time. "
            f"This happens with a view at an odd element offset: pass a copy"
        )


def _check_loadable(t: TensorDesc) -> None:
    """Last dim contiguous, base pointer and outer strides 16-byte aligned."""
    if t.shape[-1] != 1 and t.strides[-1] != 1:
        raise ValueError(
            f"{t.name} must be contiguous in its last dimension (stride 1), but its last stride is "
            f"{t.strides[-1]} elements; pass a copy or a view whose last dimension is contiguous"
        )
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{t.name} has negative strides {t.strides}; pass a copy")
    check_aligned_base(t)
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
    if shape.packed:
        return (shape.total_q, shape.num_heads, shape.head_dim_v)
    return (shape.batch, shape.seqlen_q, shape.num_heads, shape.head_dim_v)


def lse_shape(shape: ProblemShape) -> tuple:
    if shape.packed:
        return (shape.num_heads, shape.total_q)
    return (shape.batch, shape.num_heads, shape.seqlen_q)
