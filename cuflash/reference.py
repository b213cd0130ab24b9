"""Float64 reference attention: the oracle every cuflash kernel is checked against.

This module computes exactly what the API contract says attention means -- every option (scale,
causal, window, softcap, bias, ALiBi, boolean masks, segment ids, block ids, GQA/MQA, dropout and a
gradient flowing into ``lse``) -- in plain float64 array code, with no tiling and no online softmax.
It is slow and memory-hungry (it materializes the full ``(B, H, Sq, Sk)`` score matrix) and is meant
for small problems: tests, and users debugging a surprising result.

Every public function takes ``xp``, the array module: ``None`` means numpy; the GPU tests pass
``xp=cupy`` to run the same float64 math on the device. Inputs may have any float dtype, including
``ml_dtypes.bfloat16``; they are upcast to float64 first. Layout is "bshd", as in the kernels:
``q (B, Sq, H, D)``, ``k (B, Sk, Hkv, D)``, ``v (B, Sk, Hkv, Dv)``.

Debugging a kernel result on the host::

    import cupy, cuflash
    from cuflash import reference

    out, lse = cuflash.attention_forward(q, k, v, causal=True, window=(128, 0))
    ref_out, ref_lse = reference.attention_forward(q.get(), k.get(), v.get(),
                                                   causal=True, window=(128, 0))
    print(reference.relative_error(out.get(), ref_out))   # ~1e-3 for bfloat16 is healthy

Dropout takes its keep-mask explicitly: ``dropout_mask`` (bool, True = keep). ``dropout_keep_mask(seed,
dropout_p, ...)`` computes the very mask the kernels draw for a seed (Philox-4x32-10, one 32-bit uniform per
(b, h, i, j); see its docstring), so a kernel's dropout can be checked element for element.

The module also holds the low-precision "naive" model (``naive_forward`` / ``naive_backward``): how a
plain framework computes attention in float16/bfloat16/float32. Tests use its error as the baseline a
kernel's error is measured against.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "NAIVE_DTYPES",
    "attention_backward",
    "attention_forward",
    "dropout_keep_mask",
    "philox4x32_10",
    "naive_backward",
    "naive_forward",
    "relative_error",
    "round_to_bfloat16",
    "round_to_dtype",
    "varlen_attention_backward",
    "varlen_attention_forward",
]

NAIVE_DTYPES = ("float16", "bfloat16", "float32")
"""Precisions ``naive_forward`` / ``naive_backward`` model."""

_NEG_INF = float("-inf")
_FULL_AXES = "(B, H, Sq, Sk)"
_FULL_AXIS_NAMES = ("B", "H", "Sq", "Sk")
_HEAD_AXIS = 1  # of the (B, H, Sq, Sk) score layout

# bfloat16 is the top 16 bits of a float32. Rounding to nearest-even adds 0x7FFF plus the lowest kept
# bit before truncating: a tail above half rounds up, below half rounds down, an exact half rounds to
# the even neighbour. Written as integer arithmetic so it runs the same under numpy and cupy.
_BF16_DROPPED_BITS = 16
_BF16_HALF_ULP_MINUS_ONE = 0x7FFF
_BF16_KEPT_BITS_MASK = 0xFFFF0000


# ----------------------------------------------------------------------------------------------------
# Array plumbing
# ----------------------------------------------------------------------------------------------------

def _array_module(xp):
    return np if xp is None else xp


def _quiet(xp):
    """Silences numpy's floating-point warnings for one block; cupy never raises them."""
    if xp is np:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore")
    return contextlib.nullcontext()


def _as_float(x, xp, dtype):
    """x as an xp array of ``dtype``. Host arrays (ml_dtypes bfloat16 included) convert on the host."""
    if xp is np or isinstance(x, np.ndarray):
        host = np.asarray(x, dtype=dtype)
        return host if xp is np else xp.asarray(host)
    return xp.asarray(x).astype(dtype, copy=False)


# ----------------------------------------------------------------------------------------------------
# Shapes and options
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Dims:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int

    @property
    def group(self) -> int:
        """Query heads per kv head (1 = MHA, heads = MQA)."""
        return self.heads // self.kv_heads

    @property
    def scores_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seqlen_q, self.seqlen_k)


def _check_qkv(q, k, v) -> _Dims:
    for name, x, axes in (("q", q, "(B, Sq, H, D)"), ("k", k, "(B, Sk, Hkv, D)"),
                          ("v", v, "(B, Sk, Hkv, Dv)")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims {axes}, got shape {tuple(x.shape)}")
    batch, seqlen_q, heads, head_dim = q.shape
    batch_k, seqlen_k, kv_heads, head_dim_k = k.shape
    batch_v, seqlen_v, kv_heads_v, head_dim_v = v.shape
    if batch_k != batch:
        raise ValueError(f"k has batch {batch_k}, q has batch {batch}")
    if batch_v != batch:
        raise ValueError(f"v has batch {batch_v}, q has batch {batch}")
    if seqlen_v != seqlen_k:
        raise ValueError(f"v has {seqlen_v} keys, k has {seqlen_k}")
    if kv_heads_v != kv_heads:
        raise ValueError(f"v has {kv_heads_v} heads, k has {kv_heads}")
    if head_dim == 0:
        raise ValueError(f"q has head dim 0, got shape {tuple(q.shape)}")
    if head_dim_k != head_dim:
        raise ValueError(f"k has head dim {head_dim_k}, q has head dim {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k has {kv_heads} heads, which does not divide q's {heads} heads")
    return _Dims(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v)


def _check_shape(name, x, expected, axes):
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {axes} = {tuple(expected)}")


def _default_scale(scale, dims: _Dims) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dims.head_dim)
    return float(scale)


def _check_softcap(softcap):
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or positive, got {softcap!r}")


def _check_window(window):
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints or None, got {window!r}") from None
    for side, value in (("left", left), ("right", right)):
        if value is not None and not isinstance(value, (int, np.integer)):
            raise ValueError(f"window's {side} bound must be an int or None, got {value!r}")
    return left, right


def _check_dropout(dropout_p, dropout_mask):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0 and dropout_mask is None:
        raise ValueError("dropout_p > 0 needs dropout_mask: the reference cannot reproduce the "
                         "kernel's Philox stream, so pass the keep-mask (bool, True = keep)")


def _broadcast_operand(name, x, dims: _Dims, xp):
    """A bias-like operand as 4-D (B|1, H|1, Sq|1, Sk|1), a head dim of Hkv repeated to H."""
    shape = tuple(x.shape)
    if x.ndim > 4:
        raise ValueError(f"{name} has shape {shape}, which does not broadcast to "
                         f"{_FULL_AXES} = {dims.scores_shape}")
    padded = (1,) * (4 - x.ndim) + shape
    for axis, (got, full) in enumerate(zip(padded, dims.scores_shape)):
        allowed = [1, full] + ([dims.kv_heads] if axis == _HEAD_AXIS else [])
        if got not in allowed:
            choices = "1 or H" + (f" or Hkv = {dims.kv_heads}" if axis == _HEAD_AXIS else "")
            raise ValueError(
                f"{name} has shape {shape}, which does not broadcast to {_FULL_AXES} = "
                f"{dims.scores_shape}: its {_FULL_AXIS_NAMES[axis]} dim is {got}, expected {choices}")
    x = x.reshape(padded)
    if padded[_HEAD_AXIS] not in (1, dims.heads):
        x = xp.repeat(x, dims.heads // padded[_HEAD_AXIS], axis=_HEAD_AXIS)
    return x


def _reduce_to_shape(full, shape, dims: _Dims):
    """Sums a (B, H, Sq, Sk) gradient down to a broadcast operand's own shape."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    if padded[_HEAD_AXIS] not in (1, dims.heads):  # Hkv heads: sum each group of query heads
        b, h, sq, sk = full.shape
        full = full.reshape(b, padded[_HEAD_AXIS], h // padded[_HEAD_AXIS], sq, sk).sum(axis=2)
    for axis, size in enumerate(padded):
        if size == 1 and full.shape[axis] != 1:
            full = full.sum(axis=axis, keepdims=True)
    return full.reshape(shape)


def _id_pair(name, ids, dims: _Dims, xp):
    """(q_ids, k_ids) as (B, 1, Sq, 1) and (B, 1, 1, Sk) arrays."""
    try:
        q_ids, k_ids = ids
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (q_ids (B, Sq), k_ids (B, Sk))") from None
    q_ids, k_ids = xp.asarray(q_ids), xp.asarray(k_ids)
    _check_shape(f"{name}[0] (q ids)", q_ids, (dims.batch, dims.seqlen_q), "(B, Sq)")
    _check_shape(f"{name}[1] (k ids)", k_ids, (dims.batch, dims.seqlen_k), "(B, Sk)")
    return q_ids[:, None, :, None], k_ids[:, None, None, :]


def _diagonal_offset(dims: _Dims, xp):
    """(Sq, Sk) ints ``i + Sk - Sq - j``: 0 on the bottom-right aligned diagonal, > 0 left of it."""
    i = xp.arange(dims.seqlen_q)[:, None]
    j = xp.arange(dims.seqlen_k)[None, :]
    return i + (dims.seqlen_k - dims.seqlen_q) - j


def _band(dims: _Dims, causal, window, xp):
    """(1, 1, Sq, Sk) bool for causal and sliding-window visibility, or None when neither applies."""
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    offset = _diagonal_offset(dims, xp)
    band = xp.ones(offset.shape, dtype=bool)
    if left is not None:
        band &= offset <= left
    if right is not None:
        band &= offset >= -right
    return band[None, None]


def _visible(dims: _Dims, causal, window, mask, segment_ids, block_ids, xp):
    """Bool broadcastable to (B, H, Sq, Sk): True where query i may attend key j; None = all may."""
    conditions = []
    band = _band(dims, causal, window, xp)
    if band is not None:
        conditions.append(band)
    if mask is not None:
        mask = xp.asarray(mask)
        if mask.dtype != bool:
            raise TypeError(f"mask must be a bool array (True = attend), got dtype {mask.dtype}")
        conditions.append(_broadcast_operand("mask", mask, dims, xp))
    if segment_ids is not None:
        q_ids, k_ids = _id_pair("segment_ids", segment_ids, dims, xp)
        conditions.append(q_ids == k_ids)
    if block_ids is not None:
        q_ids, k_ids = _id_pair("block_ids", block_ids, dims, xp)
        conditions.append(k_ids <= q_ids)
    if not conditions:
        return None
    visible = conditions[0]
    for condition in conditions[1:]:
        visible = visible & condition
    return visible


def _alibi(alibi_slopes, dims: _Dims, xp):
    """(B|1, H, Sq, Sk) ALiBi term ``-slope * |i + Sk - Sq - j|``."""
    slopes = _as_float(alibi_slopes, xp, np.float64)
    if slopes.shape == (dims.heads,):
        slopes = slopes[None, :]
    elif slopes.shape != (dims.batch, dims.heads):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}, expected (H,) = "
                         f"({dims.heads},) or (B, H) = ({dims.batch}, {dims.heads})")
    distance = xp.abs(_diagonal_offset(dims, xp)).astype(np.float64)
    return -slopes[:, :, None, None] * distance[None, None]


def _repeat_kv_heads(x, dims: _Dims, xp):
    """(B, Sk, Hkv, d) -> (B, Sk, H, d): query head h reads kv head h // group."""
    return x if dims.group == 1 else xp.repeat(x, dims.group, axis=2)


def _sum_kv_groups(x, dims: _Dims):
    """(B, Sk, H, d) -> (B, Sk, Hkv, d): a kv head's gradient sums over the query heads sharing it."""
    if dims.group == 1:
        return x
    b, sk, _, d = x.shape
    return x.reshape(b, sk, dims.kv_heads, dims.group, d).sum(axis=3)


# ----------------------------------------------------------------------------------------------------
# The float64 problem, shared by forward and backward
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Problem:
    xp: Any
    dims: _Dims
    q: Any                 # (B, Sq, H, D) float64
    k: Any                 # (B, Sk, H, D) float64, kv heads repeated to H
    v: Any                 # (B, Sk, H, Dv) float64, kv heads repeated to H
    scale: float
    softcap: float | None
    additive: Any          # bias + ALiBi, broadcastable to (B, H, Sq, Sk); None when neither is given
    visible: Any           # bool broadcastable to (B, H, Sq, Sk); None when every key is visible
    keep_scale: Any        # dropout multiplier keep / (1 - p), broadcastable; None without dropout
    bias_shape: tuple | None


def _prepare(q, k, v, *, scale, causal, window, softcap, mask, bias, alibi_slopes, segment_ids,
             block_ids, dropout_p, dropout_mask, xp) -> _Problem:
    q, k, v = (_as_float(x, xp, np.float64) for x in (q, k, v))
    dims = _check_qkv(q, k, v)
    window = _check_window(window)
    _check_softcap(softcap)
    _check_dropout(dropout_p, dropout_mask)

    additive, bias_shape = None, None
    if bias is not None:
        bias = _as_float(bias, xp, np.float64)
        bias_shape = tuple(bias.shape)
        additive = _broadcast_operand("bias", bias, dims, xp)
    if alibi_slopes is not None:
        alibi = _alibi(alibi_slopes, dims, xp)
        additive = alibi if additive is None else additive + alibi

    keep_scale = None
    if dropout_mask is not None:
        keep = xp.asarray(dropout_mask)
        if keep.dtype != bool:
            raise TypeError(f"dropout_mask must be a bool array (True = keep), got dtype {keep.dtype}")
        keep = _broadcast_operand("dropout_mask", keep, dims, xp)
        keep_scale = keep.astype(np.float64) / (1.0 - dropout_p)

    return _Problem(
        xp=xp, dims=dims, q=q, k=_repeat_kv_heads(k, dims, xp), v=_repeat_kv_heads(v, dims, xp),
        scale=_default_scale(scale, dims), softcap=None if softcap is None else float(softcap),
        additive=additive, visible=_visible(dims, causal, window, mask, segment_ids, block_ids, xp),
        keep_scale=keep_scale, bias_shape=bias_shape)


def _scores(problem: _Problem):
    """(raw, s), both (B, H, Sq, Sk): raw = scale * q.k; s = softcap(raw) + bias + ALiBi."""
    xp = problem.xp
    raw = problem.scale * xp.einsum("bqhd,bkhd->bhqk", problem.q, problem.k)
    s = raw if problem.softcap is None else problem.softcap * xp.tanh(raw / problem.softcap)
    if problem.additive is not None:
        s = s + problem.additive
    return raw, s


def _softmax_rows(s, visible, xp):
    """Masked softmax over the last axis -> (P, lse), in s's dtype.

    A row with no visible key (or only -inf scores) gets P = 0 and lse = -inf. The row max is replaced
    by 0 on such rows, so ``-inf - (-inf)`` is never formed and no NaN can appear.
    """
    neg_inf = xp.asarray(_NEG_INF, dtype=s.dtype)
    zero = xp.asarray(0, dtype=s.dtype)
    one = xp.asarray(1, dtype=s.dtype)
    if visible is not None:
        s = xp.where(visible, s, neg_inf)
    if s.shape[-1] == 0:
        row_max = xp.full(s.shape[:-1] + (1,), _NEG_INF, dtype=s.dtype)
    else:
        row_max = xp.max(s, axis=-1, keepdims=True)
    has_key = xp.isfinite(row_max)
    m_i = xp.where(has_key, row_max, zero)
    p = xp.exp(s - m_i)
    l_i = xp.where(has_key, xp.sum(p, axis=-1, keepdims=True), one)
    lse = xp.where(has_key, m_i + xp.log(l_i), neg_inf)
    return p / l_i, lse[..., 0]


def _softcap_derivative(raw, softcap, xp):
    """d softcap(raw) / d raw = 1 - tanh(raw / c)^2."""
    t = xp.tanh(raw / softcap)
    return 1.0 - t * t


# ----------------------------------------------------------------------------------------------------
# Dense attention
# ----------------------------------------------------------------------------------------------------

def attention_forward(q, k, v, *, scale=None, causal=False, window=(None, None), softcap=None,
                      mask=None, bias=None, alibi_slopes=None, segment_ids=None, block_ids=None,
                      dropout_p=0.0, dropout_mask=None, xp=None):
    """Reference attention forward in float64 -> ``(out (B, Sq, H, Dv), lse (B, H, Sq))``.

    Scores are ``s = scale * q.k`` (``scale`` defaults to ``1/sqrt(D)``), then
    ``softcap * tanh(s / softcap)``, then ``+ bias - slope * |i + Sk - Sq - j|`` (ALiBi), then every
    mask sets invisible scores to -inf:

    - ``causal``: key j visible iff ``j <= i + Sk - Sq`` (bottom-right aligned);
    - ``window=(left, right)``: visible iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``,
      ``None`` = unbounded;
    - ``mask``: bool, broadcastable to (B, H, Sq, Sk) (head dim 1, H or Hkv), True = attend;
    - ``segment_ids=(q_ids (B, Sq), k_ids (B, Sk))``: attend iff the ids are equal;
    - ``block_ids=(q_ids, k_ids)``: attend iff ``k_id <= q_id``.

    ``bias`` broadcasts like ``mask``; ``alibi_slopes`` is (H,) or (B, H). ``lse`` is the natural-log
    sum of ``exp(s)`` over visible keys. Dropout needs the keep-mask: ``dropout_mask`` (bool,
    broadcastable to (B, H, Sq, Sk), True = keep) scales ``P`` by ``keep / (1 - dropout_p)`` after the
    softmax; ``lse`` is taken before dropout. A row with no visible key gets out 0 and lse -inf.
    Query head h uses kv head ``h // (H // Hkv)``. ``xp`` is the array module (default numpy).
    """
    xp = _array_module(xp)
    problem = _prepare(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                       mask=mask, bias=bias, alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                       block_ids=block_ids, dropout_p=dropout_p, dropout_mask=dropout_mask, xp=xp)
    with _quiet(xp):
        _, s = _scores(problem)
        probs, lse = _softmax_rows(s, problem.visible, xp)
        if problem.keep_scale is not None:
            probs = probs * problem.keep_scale
        out = xp.einsum("bhqk,bkhd->bqhd", probs, problem.v)
    return out, lse


def attention_backward(dout, q, k, v, *, dlse=None, scale=None, causal=False, window=(None, None),
                       softcap=None, mask=None, bias=None, alibi_slopes=None, segment_ids=None,
                       block_ids=None, dropout_p=0.0, dropout_mask=None, xp=None):
    """Reference attention backward in float64 -> ``{"dq", "dk", "dv"}`` (+ ``"dbias"`` with a bias).

    Takes the same options as :func:`attention_forward` (it recomputes the forward) plus
    ``dout (B, Sq, H, Dv)`` and optionally ``dlse (B, H, Sq)``, the gradient flowing into ``lse``
    (``d lse_i / d s_ij = P_ij``). Gradients are derived analytically:
    ``dS = P * (dP - rowsum(P * dP) + dlse)``, through softcap's ``tanh`` when set. ``dk``/``dv`` sum
    over each GQA group; ``dbias`` is summed down to the bias's own shape (a head dim of 1 or Hkv
    included). ALiBi slopes get no gradient. Rows with no visible key contribute nothing.
    """
    xp = _array_module(xp)
    problem = _prepare(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                       mask=mask, bias=bias, alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                       block_ids=block_ids, dropout_p=dropout_p, dropout_mask=dropout_mask, xp=xp)
    dims = problem.dims
    dout = _as_float(dout, xp, np.float64)
    _check_shape("dout", dout, (dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v),
                 "(B, Sq, H, Dv)")
    if dlse is not None:
        dlse = _as_float(dlse, xp, np.float64)
        _check_shape("dlse", dlse, (dims.batch, dims.heads, dims.seqlen_q), "(B, H, Sq)")

    with _quiet(xp):
        raw, s = _scores(problem)
        probs, _ = _softmax_rows(s, problem.visible, xp)
        kept = probs if problem.keep_scale is None else probs * problem.keep_scale
        dv = xp.einsum("bhqk,bqhd->bkhd", kept, dout)
        dprobs = xp.einsum("bqhd,bkhd->bhqk", dout, problem.v)
        if problem.keep_scale is not None:
            dprobs = dprobs * problem.keep_scale
        # softmax backward; rowsum(P * dP) equals rowsum(dout * out), dropout included
        dscores = dprobs - xp.sum(probs * dprobs, axis=-1, keepdims=True)
        if dlse is not None:
            dscores = dscores + dlse[..., None]
        dscores = probs * dscores
        draw = dscores if problem.softcap is None else (
            dscores * _softcap_derivative(raw, problem.softcap, xp))
        dq = problem.scale * xp.einsum("bhqk,bkhd->bqhd", draw, problem.k)
        dk = problem.scale * xp.einsum("bhqk,bqhd->bkhd", draw, problem.q)

    grads = {"dq": dq, "dk": _sum_kv_groups(dk, dims), "dv": _sum_kv_groups(dv, dims)}
    if problem.bias_shape is not None:
        grads["dbias"] = _reduce_to_shape(dscores, problem.bias_shape, dims)
    return grads


# ----------------------------------------------------------------------------------------------------
# Variable-length (packed) attention: a loop of dense B=1 problems
# ----------------------------------------------------------------------------------------------------

_VARLEN_UNSUPPORTED = ("mask", "bias", "segment_ids", "block_ids", "dropout_p", "dropout_mask")


def _reject_unsupported(unsupported: dict):
    for name, value in unsupported.items():
        if name not in _VARLEN_UNSUPPORTED:
            raise TypeError(f"unexpected keyword argument {name!r}")
        if value is not None and not (name == "dropout_p" and value == 0):
            raise ValueError(f"{name} is not supported by the varlen reference; "
                             "use attention_forward / attention_backward on a padded batch")


def _check_packed(q, k, v):
    for name, x, axes in (("q", q, "(Tq, H, D)"), ("k", k, "(Tk, Hkv, D)"),
                          ("v", v, "(Tk, Hkv, Dv)")):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims {axes}, got shape {tuple(x.shape)}")
    return _check_qkv(q[None], k[None], v[None])


def _host_ints(name, cu_seqlens):
    values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    if not isinstance(values, list) or any(isinstance(x, list) for x in values):
        raise ValueError(f"{name} must be 1-D (batch + 1,), got {values!r}")
    return [int(x) for x in values]


def _sequence_spans(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """[(q_start, q_end, k_start, k_end)] per sequence, validated."""
    bounds = {}
    for name, cu, total, max_len, tokens in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "q"),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "k")):
        cu = _host_ints(name, cu)
        if len(cu) < 2:
            raise ValueError(f"{name} must have batch + 1 >= 2 entries, got {len(cu)}")
        if cu[0] < 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must be non-negative and non-decreasing, got {cu}")
        if cu[-1] > total:
            raise ValueError(f"{name} ends at {cu[-1]}, beyond {tokens}'s {total} tokens")
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if max_len is not None and longest > max_len:
            raise ValueError(f"{name} has a sequence of {longest} tokens, more than "
                             f"max_seqlen_{tokens} = {max_len}")
        bounds[tokens] = cu
    if len(bounds["q"]) != len(bounds["k"]):
        raise ValueError(f"cu_seqlens_q has {len(bounds['q']) - 1} sequences, "
                         f"cu_seqlens_k has {len(bounds['k']) - 1}")
    return [(qs, qe, ks, ke) for qs, qe, ks, ke in
            zip(bounds["q"], bounds["q"][1:], bounds["k"], bounds["k"][1:])]


def _sequence_slopes(alibi_slopes, index, num_sequences, xp):
    """One sequence's (H,) slopes from (H,) or (num_sequences, H)."""
    if alibi_slopes is None:
        return None
    slopes = _as_float(alibi_slopes, xp, np.float64)
    if slopes.ndim == 2:
        if slopes.shape[0] != num_sequences:
            raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}, expected (H,) or "
                             f"({num_sequences}, H) for {num_sequences} sequences")
        return slopes[index]
    return slopes


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                             max_seqlen_k=None, scale=None, causal=False, window=(None, None),
                             softcap=None, alibi_slopes=None, xp=None, **unsupported):
    """Reference packed variable-length attention -> ``(out (Tq, H, Dv), lse (H, Tq))``.

    ``q (Tq, H, D)``, ``k (Tk, Hkv, D)``, ``v (Tk, Hkv, Dv)`` hold the sequences back to back;
    sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` attending to the matching slice of k/v,
    with causal, window and ALiBi positions aligned per sequence. Options: ``scale``, ``causal``,
    ``window``, ``softcap``, ``alibi_slopes`` ((H,) or (batch, H)); ``max_seqlen_q/k``, when given,
    are checked. Tokens outside every sequence get out 0 and lse -inf. Bias, masks, ids and dropout
    raise ``ValueError``: use the dense reference for those.
    """
    xp = _array_module(xp)
    _reject_unsupported(unsupported)
    q, k, v = (_as_float(x, xp, np.float64) for x in (q, k, v))
    dims = _check_packed(q, k, v)
    spans = _sequence_spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                            max_seqlen_q, max_seqlen_k)
    out = xp.zeros((q.shape[0], dims.heads, dims.head_dim_v), dtype=np.float64)
    lse = xp.full((dims.heads, q.shape[0]), _NEG_INF, dtype=np.float64)
    for index, (qs, qe, ks, ke) in enumerate(spans):
        if qe == qs:
            continue
        seq_out, seq_lse = attention_forward(
            q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=scale, causal=causal,
            window=window, softcap=softcap,
            alibi_slopes=_sequence_slopes(alibi_slopes, index, len(spans), xp), xp=xp)
        out[qs:qe] = seq_out[0]
        lse[:, qs:qe] = seq_lse[0]
    return out, lse


def varlen_attention_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, dlse=None,
                              max_seqlen_q=None, max_seqlen_k=None, scale=None, causal=False,
                              window=(None, None), softcap=None, alibi_slopes=None, xp=None,
                              **unsupported):
    """Reference packed variable-length backward -> ``{"dq", "dk", "dv"}`` in q/k/v's packed shapes.

    ``dout (Tq, H, Dv)``; ``dlse (H, Tq)`` optional. Same options as
    :func:`varlen_attention_forward`.
    """
    xp = _array_module(xp)
    _reject_unsupported(unsupported)
    q, k, v = (_as_float(x, xp, np.float64) for x in (q, k, v))
    dims = _check_packed(q, k, v)
    dout = _as_float(dout, xp, np.float64)
    _check_shape("dout", dout, (q.shape[0], dims.heads, dims.head_dim_v), "(Tq, H, Dv)")
    if dlse is not None:
        dlse = _as_float(dlse, xp, np.float64)
        _check_shape("dlse", dlse, (dims.heads, q.shape[0]), "(H, Tq)")
    spans = _sequence_spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                            max_seqlen_q, max_seqlen_k)
    grads = {"dq": xp.zeros(q.shape, dtype=np.float64), "dk": xp.zeros(k.shape, dtype=np.float64),
             "dv": xp.zeros(v.shape, dtype=np.float64)}
    for index, (qs, qe, ks, ke) in enumerate(spans):
        if qe == qs:
            continue
        seq = attention_backward(
            dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
            dlse=None if dlse is None else dlse[None, :, qs:qe], scale=scale, causal=causal,
            window=window, softcap=softcap,
            alibi_slopes=_sequence_slopes(alibi_slopes, index, len(spans), xp), xp=xp)
        grads["dq"][qs:qe] = seq["dq"][0]
        grads["dk"][ks:ke] += seq["dk"][0]
        grads["dv"][ks:ke] += seq["dv"][0]
    return grads


# ----------------------------------------------------------------------------------------------------
# Dropout's random stream: the kernels' keep-mask, reproduced on the host
# ----------------------------------------------------------------------------------------------------

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def philox4x32_10(counter, key, xp=None):
    """Philox-4x32-10 (Salmon et al., SC 2011; Random123's ``philox4x32``): four uint32 arrays ``counter``
    (broadcastable) and a key of two uint32 -> four uint32 arrays. The same function the kernels run
    (cuda_src/cuflash/dropout.cuh)."""
    xp = _array_module(xp)
    mask = np.uint64(_U32)
    c0, c1, c2, c3 = (xp.asarray(c).astype(np.uint64) for c in counter)
    k0, k1 = np.uint64(int(key[0]) & _U32), np.uint64(int(key[1]) & _U32)
    m0, m1 = np.uint64(_PHILOX_M[0]), np.uint64(_PHILOX_M[1])
    for r in range(10):
        p0, p1 = m0 * c0, m1 * c2  # 32 x 32 -> 64 bits, exact in uint64
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> np.uint64(32)) ^ c3 ^ k1) & mask, \
            p0 & mask
        if r < 9:
            k0, k1 = (k0 + np.uint64(_PHILOX_W[0])) & mask, (k1 + np.uint64(_PHILOX_W[1])) & mask
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def dropout_threshold(dropout_p: float) -> int:
    """The uint32 threshold of ``dropout_p``: a uniform u is kept iff u >= threshold (so the keep probability
    is 1 - dropout_p to within 2^-32)."""
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return min(int(round(float(dropout_p) * 2.0 ** 32)), _U32)


def dropout_keep_mask(seed: int, dropout_p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      xp=None):
    """The kernels' dropout keep-mask, bool ``(batch, heads, seqlen_q, seqlen_k)`` (True = keep).

    Element (b, h, i, j) keeps its probability iff its uniform u >= ``dropout_threshold(dropout_p)``, where
    u is word ``2 * bit3(i) + bit3(j)`` of ``philox4x32_10((j & ~8, i & ~8, h, b), (seed low 32 bits, seed
    high 32 bits))``: one Philox call serves the four elements (i, j), (i, j + 8), (i + 8, j), (i + 8, j + 8)
    whose indices differ only in bit 3, which is what one GPU thread holds in every accumulator layout the
    kernels use. ``i`` / ``j`` count from the start of the sequence (per sequence with packed sequences, b
    being the sequence); ``h`` is the query head.
    """
    xp = _array_module(xp)
    threshold = dropout_threshold(dropout_p)
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed}")
    b = xp.arange(batch, dtype=np.uint32)[:, None, None, None]
    h = xp.arange(heads, dtype=np.uint32)[None, :, None, None]
    i = xp.arange(seqlen_q, dtype=np.uint32)[None, None, :, None]
    j = xp.arange(seqlen_k, dtype=np.uint32)[None, None, None, :]
    not8 = np.uint32(~8 & _U32)
    words = philox4x32_10((j & not8, i & not8, h, b), (seed & _U32, seed >> 32), xp)
    shape = (batch, heads, seqlen_q, seqlen_k)
    which = xp.broadcast_to(((i >> np.uint32(3)) & np.uint32(1)) * 2 + ((j >> np.uint32(3)) & np.uint32(1)), shape)
    u = xp.where(which == 0, words[0], xp.where(which == 1, words[1], xp.where(which == 2, words[2], words[3])))
    return xp.broadcast_to(u, shape) >= np.uint32(threshold) if threshold else xp.ones(shape, dtype=bool)


# ----------------------------------------------------------------------------------------------------
# Low-precision naive model: the error baseline for kernels
# ----------------------------------------------------------------------------------------------------

def _dtype_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in NAIVE_DTYPES:
        raise ValueError(f"dtype must be one of {NAIVE_DTYPES}, got {dtype!r}")
    return name


def round_to_bfloat16(x, xp=None):
    """x rounded to the nearest bfloat16 (ties to even), returned as float32.

    Pure integer arithmetic on the float32 bits, so it runs under cupy, which may lack a bfloat16
    cast. NaN stays NaN; values beyond bfloat16's range round to +-inf, as ``ml_dtypes`` does.
    """
    xp = _array_module(xp)
    x = _as_float(x, xp, np.float32)
    bits = x.view(np.uint32)
    lowest_kept_bit = (bits >> np.uint32(_BF16_DROPPED_BITS)) & np.uint32(1)
    with _quiet(xp):  # only NaN bit patterns can wrap around, and those are restored below
        rounded = (bits + np.uint32(_BF16_HALF_ULP_MINUS_ONE) + lowest_kept_bit) & np.uint32(
            _BF16_KEPT_BITS_MASK)
    return xp.where(xp.isnan(x), x, rounded.view(np.float32))


def round_to_dtype(x, dtype, xp=None):
    """x rounded to ``dtype`` ("float16", "bfloat16" or "float32"), returned as float32."""
    xp = _array_module(xp)
    name = _dtype_name(dtype)
    if name == "bfloat16":
        return round_to_bfloat16(x, xp)
    x = _as_float(x, xp, np.float32)
    if name == "float16":
        with _quiet(xp):
            return x.astype(np.float16).astype(np.float32)
    return x


def _naive_inputs(q, k, v, dtype, xp):
    """q, k, v in float32 (values representable in dtype), kv heads repeated, as (B, H, S, d)."""
    q, k, v = (round_to_dtype(x, dtype, xp) for x in (q, k, v))
    dims = _check_qkv(q, k, v)
    to_bhsd = (0, 2, 1, 3)
    return (dims, q.transpose(to_bhsd), _repeat_kv_heads(k, dims, xp).transpose(to_bhsd),
            _repeat_kv_heads(v, dims, xp).transpose(to_bhsd))


def _naive_scores(q, k, dims: _Dims, scale, softcap, alibi_slopes, xp, bias=None):
    """fp32 scores -> (raw, s), both (B, H, Sq, Sk) float32: raw = scale * q @ k^T, then
    s = softcap(raw) + bias + ALiBi, each step rounded to float32 as a framework's elementwise ops are."""
    raw = xp.matmul(q, k.transpose(0, 1, 3, 2)) * np.float32(_default_scale(scale, dims))
    s = raw
    if softcap is not None:
        cap = np.float32(softcap)
        s = cap * xp.tanh(raw / cap)
    if bias is not None:  # already float32 values of the input dtype, broadcast to (B, H, Sq, Sk)
        s = s + bias
    if alibi_slopes is not None:
        # slope and distance are float32-exact, so the float64 product rounds like an fp32 multiply
        s = s + _alibi(alibi_slopes, dims, xp).astype(np.float32)
    return raw, s


def _naive_probabilities(q, k, dims: _Dims, options: dict, xp):
    """fp32 softmax of the naive scores under every mask -> (P, lse, raw), all float32."""
    bias = options.get("bias")
    if bias is not None:
        bias = _broadcast_operand("bias", round_to_dtype(_as_float(bias, xp, np.float32), options["dtype"], xp),
                                  dims, xp).astype(np.float32)
    raw, s = _naive_scores(q, k, dims, options["scale"], options["softcap"],
                           options["alibi_slopes"], xp, bias)
    visible = _visible(dims, options["causal"], options["window"], options.get("mask"), options["segment_ids"],
                       options["block_ids"], xp)
    probs, lse = _softmax_rows(s, visible, xp)
    return probs, lse, raw


def _naive_options(scale, causal, window, softcap, alibi_slopes, segment_ids, block_ids, bias=None,
                   dtype=None, mask=None, dropout_p=0.0, dropout_mask=None) -> dict:
    _check_softcap(softcap)
    _check_dropout(dropout_p, dropout_mask)
    return {"scale": scale, "causal": causal, "window": _check_window(window),
            "softcap": None if softcap is None else float(softcap), "alibi_slopes": alibi_slopes,
            "segment_ids": segment_ids, "block_ids": block_ids, "bias": bias, "dtype": dtype, "mask": mask,
            "dropout_p": dropout_p, "dropout_mask": dropout_mask}


def _naive_keep_scale(options: dict, dims: _Dims, xp):
    """Dropout's float32 multiplier keep / (1 - p), (B, H, Sq, Sk), or None."""
    if options["dropout_mask"] is None:
        return None
    keep = _broadcast_operand("dropout_mask", xp.asarray(options["dropout_mask"]), dims, xp)
    return keep.astype(np.float32) * np.float32(1.0 / (1.0 - options["dropout_p"]))


def naive_forward(q, k, v, *, dtype, scale=None, causal=False, window=(None, None), softcap=None,
                  alibi_slopes=None, segment_ids=None, block_ids=None, bias=None, mask=None, dropout_p=0.0,
                  dropout_mask=None, xp=None):
    """How a plain framework computes attention in ``dtype`` -> ``(out (B, Sq, H, Dv), lse (B, H, Sq))``.

    ``S = q @ k^T`` and the softmax run in float32; ``P`` is rounded to ``dtype`` before ``P @ V``
    (float32 accumulation); ``out`` is rounded to ``dtype``. Returns float32 arrays (``out``'s values
    are representable in ``dtype``; ``lse`` is unrounded float32, like the kernels'). Inputs should
    already be in ``dtype``; other floats are rounded to it first. Rows with no visible key give 0
    rather than a framework's NaN. With cupy, fp32 matmuls use cuBLAS (TF32 stays off unless
    ``CUPY_TF32=1``).

    Options as in :func:`attention_forward`: ``causal``, ``window``, ``softcap`` (``tanh`` in float32),
    ``alibi_slopes`` ((H,) or (B, H); the ALiBi term added in float32), ``segment_ids``,
    ``block_ids``, ``bias`` (rounded to ``dtype``, added in float32), ``mask``, dropout (``dropout_p`` with
    its ``dropout_mask``: ``P`` times keep / (1 - p) in float32 before the rounding).
    """
    xp = _array_module(xp)
    options = _naive_options(scale, causal, window, softcap, alibi_slopes, segment_ids, block_ids, bias, dtype, mask,
                             dropout_p, dropout_mask)
    dims, q, k, v = _naive_inputs(q, k, v, dtype, xp)
    with _quiet(xp):
        probs, lse, _ = _naive_probabilities(q, k, dims, options, xp)
        keep_scale = _naive_keep_scale(options, dims, xp)
        if keep_scale is not None:
            probs = probs * keep_scale
        out = xp.matmul(round_to_dtype(probs, dtype, xp), v)
        out = round_to_dtype(out, dtype, xp)
    return out.transpose(0, 2, 1, 3), lse


def naive_backward(dout, q, k, v, *, dtype, scale=None, causal=False, window=(None, None),
                   softcap=None, alibi_slopes=None, segment_ids=None, block_ids=None, bias=None, mask=None,
                   dlse=None, dropout_p=0.0, dropout_mask=None, out=None, xp=None):
    """The naive model's backward -> ``{"dq", "dk", "dv"}`` (+ ``"dbias"``: the float32 dS summed to the
    bias's shape, rounded to ``dtype``), float32 arrays of ``dtype`` values.

    Float32 throughout, as a framework's autograd does: ``P`` is rounded to ``dtype`` before
    ``dV = P^T @ dO``; ``dS = P * (dP - rowsum(P * dP) + dlse)`` (times ``1 - tanh(raw / softcap)^2``
    with a softcap) is rounded to ``dtype`` before ``dQ = dS @ K`` and ``dK = dS^T @ Q``; results are
    rounded to ``dtype``. Same options as :func:`naive_forward`; with dropout ``dV = (P keep / (1 - p))^T @ dO``
    and ``dP`` is scaled by keep / (1 - p) before the softmax backward.

    ``out`` (B, Sq, H, Dv): a forward output to take the row term from, as FlashAttention does:
    ``rowsum(dO * out)`` in place of ``rowsum(P * dP)`` (equal in exact arithmetic for the exact out). Then
    dP's rounding no longer cancels in ``dP - D``, and out's own rounding enters D: the error of
    FlashAttention's formula in this precision.
    """
    xp = _array_module(xp)
    options = _naive_options(scale, causal, window, softcap, alibi_slopes, segment_ids, block_ids, bias, dtype, mask,
                             dropout_p, dropout_mask)
    dims, q, k, v = _naive_inputs(q, k, v, dtype, xp)
    dout = round_to_dtype(dout, dtype, xp)
    _check_shape("dout", dout, (dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v),
                 "(B, Sq, H, Dv)")
    dout = dout.transpose(0, 2, 1, 3)
    if dlse is not None:
        dlse = _as_float(dlse, xp, np.float32)
        _check_shape("dlse", dlse, (dims.batch, dims.heads, dims.seqlen_q), "(B, H, Sq)")
    scale = np.float32(_default_scale(scale, dims))

    def transposed(x):
        return x.transpose(0, 1, 3, 2)

    def to_bshd(x):
        return x.transpose(0, 2, 1, 3)

    with _quiet(xp):
        probs, _, raw = _naive_probabilities(q, k, dims, options, xp)
        keep_scale = _naive_keep_scale(options, dims, xp)
        dropped = probs if keep_scale is None else probs * keep_scale
        dv = xp.matmul(transposed(round_to_dtype(dropped, dtype, xp)), dout)
        dprobs = xp.matmul(dout, transposed(v))
        if keep_scale is not None:
            dprobs = dprobs * keep_scale
        if out is None:
            row_term = xp.sum(probs * dprobs, axis=-1, keepdims=True)
        else:
            stored = round_to_dtype(out, dtype, xp)
            _check_shape("out", stored, (dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v), "(B, Sq, H, Dv)")
            row_term = xp.sum(dout * stored.transpose(0, 2, 1, 3), axis=-1, keepdims=True)
        dscores = dprobs - row_term
        if dlse is not None:
            dscores = dscores + dlse[..., None]
        dscores = probs * dscores
        dbias = None
        if bias is not None:
            dbias = round_to_dtype(_reduce_to_shape(dscores, tuple(bias.shape), dims), dtype, xp)
        if options["softcap"] is not None:
            dscores = dscores * _softcap_derivative(raw, np.float32(options["softcap"]), xp)
        dscores = round_to_dtype(dscores, dtype, xp)
        dq = xp.matmul(dscores, k) * scale
        dk = xp.matmul(transposed(dscores), q) * scale
    grads = {
        "dq": round_to_dtype(to_bshd(dq), dtype, xp),
        "dk": round_to_dtype(_sum_kv_groups(to_bshd(dk), dims), dtype, xp),
        "dv": round_to_dtype(_sum_kv_groups(to_bshd(dv), dims), dtype, xp),
    }
    if dbias is not None:
        grads["dbias"] = dbias
    return grads


# ----------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------

def relative_error(actual, expected, xp=None) -> float:
    """``||actual - expected|| / max(||expected||, tiny)`` in float64 (Frobenius norms).

    Entries where both are the same infinity (e.g. lse = -inf on fully masked rows) count as equal;
    any other non-finite value in ``actual`` (or an infinity in ``expected`` that ``actual`` misses)
    makes the error ``inf``. Shapes must match exactly.
    """
    xp = _array_module(xp)
    actual = _as_float(actual, xp, np.float64)
    expected = _as_float(expected, xp, np.float64)
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"actual has shape {tuple(actual.shape)}, expected has shape "
                         f"{tuple(expected.shape)}")
    same_infinity = xp.isinf(expected) & (actual == expected)
    actual = xp.where(same_infinity, 0.0, actual)
    expected = xp.where(same_infinity, 0.0, expected)
    if not bool(xp.all(xp.isfinite(actual))) or not bool(xp.all(xp.isfinite(expected))):
        return math.inf
    with _quiet(xp):
        diff = float(xp.sqrt(xp.sum((actual - expected) ** 2)))
        norm = float(xp.sqrt(xp.sum(expected ** 2)))
    return diff / max(norm, np.finfo(np.float64).tiny)
