"""Shared helpers for the GPU tests: inputs, poisoned output buffers, the float64 oracle and the
tolerance rule every kernel result is judged by.

The rule (one place, used by every GPU test):

- Each quantity (out, lse, dq, dk, dv) is compared with :mod:`cuflash.reference` run in float64 on
  the GPU (``xp=cupy``) by its normwise relative error ``||actual - expected|| / ||expected||``.
- The baseline is the error that cannot be blamed on the kernel, the largest of:
  * rounding: the exact result merely rounded to the output dtype;
  * naive: ``reference.naive_forward`` / ``naive_backward``, what a plain framework gets in the same
    precision (fp32 math, P and dS rounded to the dtype);
  * stored residuals (backward only): the exact gradient given the ``out`` and ``lse`` the forward
    stored, which ``attention_backward(dout, q, k, v, out, lse)`` must use by contract.
    FlashAttention computes ``D = rowsum(dO * out)`` from the rounded out and ``P = exp(s - lse)``
    from the fp32 lse; with a peaked softmax ``dP - D`` cancels and that rounding shows in dq/dk.
    It is the reference backward with ``dout * c`` and ``dlse' = c * (dlse - rowsum(dO * (out -
    out_exact)))``, ``c = exp(lse_exact - lse)``: exact arithmetic on the stored residuals.
  * flash (backward only): the naive model with FlashAttention's row term, ``D = rowsum(dO * out)`` from
    the stored out (``naive_backward(out=...)``): that formula's error in the same precision, where dP's
    rounding no longer cancels in ``dP - D``. It matters on small, cancelling float32 problems (the long
    fuzz of session 51: D256, dropout 0.85, one query row against two keys).
  The baselines are computed lazily, cheapest first, only while the kernel's error exceeds the
  tolerance they give.
- A kernel passes when ``error <= 2 * baseline + floor`` with ``floor`` = 1e-3 for fp16/bf16 (1e-5 for
  their fp32 lse) and 2e-6 for fp32. For fp32 that is the issue's "relative error <= 1e-5 against
  float64" whenever the baseline is below 4e-6, which holds for every well-conditioned problem;
  ``test_fp32_meets_the_issue_rule`` also asserts 1e-5 outright on standard fp32 problems.
- A query row that sees exactly one key (every row when ``Sk == 1``; causal row ``Sq - Sk``) has an
  exactly one-hot softmax, so its exact dq and its share of dk are 0 (the reference cancels
  ``dP - rowsum(P dP)`` exactly) while any algorithm computing ``rowsum(dO * O)`` separately, as
  FlashAttention does, leaves fp32 rounding noise. dq and dk get an absolute allowance of
  ``1e-5 * N`` on top, N = scale * |dO| * |v| * |k or q| (rms row norms, times sqrt(such rows)): the
  size the terms of those sums have. Real bugs are O(N); the noise is ~1e-7 N. Where the exact answer
  is 0 as a whole, the baselines count by their absolute error: 2x the stored residuals' error is then
  allowed too. With dropout that is the one that matters: a kept one-key row's out is v / (1 - p),
  which fp16 / bf16 round, so ``dP - D`` leaves the output's rounding (~2^-9 N in bf16), not fp32 noise.
- lse must be -inf exactly where the reference's is, finite elsewhere, never NaN.

Every run passes NaN-poisoned ``out=``/``lse=``/``dq=``/``dk=``/``dv=`` buffers, so an element a
kernel forgets to write shows up as NaN, and "no NaN anywhere" is the same check.

Inputs are drawn on the host (numpy, seeded from the case id) and copied over, never zeros; nothing
here needs cuRAND or a bfloat16 cast kernel in CuPy (bf16 <-> f32 goes through the bits).

Options beyond scale and causal (``Problem.window``, ``softcap``, ``alibi``, ``segments``,
``blocks``; all off by default, and then a problem's id and inputs are what they always were) go to
cuflash, to the float64 reference and to the naive model alike. ALiBi slopes and segment / block
ids are drawn with the other inputs (``make_inputs``; ``SEGMENT_KINDS`` / ``BLOCK_KINDS`` say how).
With masks beyond causal, the rows that see exactly one key are counted from the masks themselves.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
import zlib

import numpy as np

import ml_dtypes
import pytest

try:
    import cupy
except ImportError:  # the GPU tests importorskip cupy before importing this module
    cupy = None

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"fp16": np.dtype(np.float16), "bf16": BF16, "fp32": np.dtype(np.float32)}
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

#: Tolerance floors (see the module docstring).
FLOOR = {"fp16": 1e-3, "bf16": 1e-3, "fp32": 2e-6}
LSE_FLOOR = {"fp16": 1e-5, "bf16": 1e-5, "fp32": 2e-6}
#: The issue's rule for true-fp32 kernels: relative error <= 1e-5 against float64.
FP32_LIMIT = 1e-5
#: CUFLASH_TEST_ALL_BASELINES=1 evaluates every baseline even when the first already admits the
#: error (slower; shows the real margins in failure reports).
EAGER_BASELINES = os.environ.get("CUFLASH_TEST_ALL_BASELINES", "0") == "1"
#: Absolute allowance for dq/dk, in units of the natural scale N, from rows that see one key.
CANCELLATION_ALLOWANCE = 1e-5

#: How ``Problem.segments`` draws ``segment_ids``. Positions are bottom-right aligned: q's ids are the
#: last Sq and k's the last Sk entries of one length-max(Sq, Sk) sequence, as causal and window align.
SEGMENT_KINDS = {
    "docs": "sorted document ids (packed documents of random lengths), aligned",
    "random": "unsorted ids 0..3 drawn independently for q and k",
    "qonly": "docs, plus a run of query rows whose id no key has (those rows see nothing)",
    "restart": "docs, but batch row 0's ids restart every 64 queries / 128 keys (sorted within each such "
               "block, not across: each id's rows and keys are several runs)",
}
#: How ``Problem.blocks`` draws ``block_ids`` (attend iff k_id <= q_id).
BLOCK_KINDS = {
    "blocks": "nondecreasing block ids (blocks of random lengths), aligned: block-causal attention",
    "random": "unsorted ids 0..4 drawn independently for q and k",
    "restart": "nondecreasing block ids, but batch row 0's restart every 64 queries / 128 keys",
}
#: ``Problem.alibi``: slopes of shape (H,) (the ALiBi paper's geometric ones) or (B, H) (random).
ALIBI_KINDS = ("h", "bh")
#: How ``Problem.bias`` draws the additive bias (standard normal values in the input dtype unless said).
BIAS_KINDS = {
    "full": "(B, H, Sq, Sk): one element per score, dbias stored directly",
    "heads": "(1, H, Sq, Sk): shared by the batch, dbias summed over it",
    "kv": "(B, Hkv, Sq, Sk): one per kv head, dbias summed over each GQA group",
    "shared": "(1, 1, Sq, Sk): one for every batch row and head, dbias summed over both",
    "keys": "(B, 1, 1, Sk): a key-padding bias with some -inf keys",
    "keyheads": "(1, Hkv, 1, Sk): a learnable key bias per kv head, shared by the batch (dbias summed over it, "
                "each GQA group and the queries)",
    "rows": "(B, H, Sq, 1): one value per query row (cancels in the softmax: dbias = dlse where the row sees "
            "a key)",
    "scalar": "(1, 1, 1, 1): one value for every score (dbias = dlse summed over the rows that see a key)",
    "expanded": "(1, H, Sq, Sk) broadcast_to (B, H, Sq, Sk): stride 0 over the batch, dbias full-shaped",
    "neginf": "(B, H, Sq, Sk) with ~15% -inf entries and some whole rows of -inf",
    "large": "(B, H, Sq, Sk) with values of +-30",
}
#: How ``Problem.mask`` draws the bool mask (True = attend).
MASK_KINDS = {
    "random": "(B, 1, Sq, Sk), each pair visible with probability 0.7 (every tile partial)",
    "tiles": "(B, 1, Sq, Sk), 64 x 64 tiles all True, all False or random (tile skipping and full tiles)",
    "heads": "(1, H, Sq, Sk) random per head (per-head block lists)",
    "kv": "(B, Hkv, Sq, Sk) tiles per kv head",
    "keys": "(B, 1, 1, Sk) key padding: a random tail of keys hidden",
    "rows": "(B, 1, Sq, Sk) random, with some query rows all False (they see nothing)",
}

# NaN bit patterns used to poison buffers (quiet NaN of each format).
_NAN_BITS = {2: (np.uint16, 0x7E00), 4: (np.uint32, 0x7FC00000)}
_BF16_NAN_BITS = 0x7FC0


# --------------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call: sizes, dtype and options. ``id`` is the readable test id."""

    dtype: str  # "fp16", "bf16" or "fp32"
    B: int
    Sq: int
    Sk: int
    H: int
    Hkv: int
    D: int
    Dv: int | None = None  # None: same as D
    causal: bool = False
    scale: float | None = None
    layout: str = "bshd"  # "bshd" contiguous, "bhsd" (B,H,S,D) viewed as bshd, "padded" rows
    deterministic: bool = False
    dlse: bool = False  # backward also gets a random gradient flowing into lse
    window: tuple | None = None  # (left, right) sliding window, a side None = unbounded; None = off
    softcap: float | None = None
    alibi: str | None = None  # ALIBI_KINDS: slopes (H,) or (B, H); None = off
    segments: str | None = None  # SEGMENT_KINDS: how segment_ids are drawn; None = off
    blocks: str | None = None  # BLOCK_KINDS: how block_ids are drawn; None = off
    bias: str | None = None  # BIAS_KINDS: how the additive bias is drawn; None = off
    bias_grad: bool = True  # False: the backward makes no dbias (attention_backward(bias_grad=False))
    mask: str | None = None  # MASK_KINDS: how the bool mask is drawn; None = off
    dropout: float | None = None  # dropout_p (the seed comes from the problem's id); None = off

    def __post_init__(self):
        for name, value, kinds in (("alibi", self.alibi, ALIBI_KINDS), ("bias", self.bias, BIAS_KINDS),
                                   ("mask", self.mask, MASK_KINDS),
                                   ("segments", self.segments, SEGMENT_KINDS),
                                   ("blocks", self.blocks, BLOCK_KINDS)):
            if value is not None and value not in kinds:
                raise ValueError(f"Problem.{name} must be None or one of {tuple(kinds)}, got {value!r}")
        if self.window is not None:
            if len(self.window) != 2:
                raise ValueError(f"Problem.window must be None or (left, right), got {self.window!r}")
            object.__setattr__(self, "window", tuple(self.window))  # hashable, whatever was passed

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    @property
    def np_dtype(self):
        return DTYPES[self.dtype]

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.D) if self.scale is None else float(self.scale)

    @property
    def id(self) -> str:
        parts = [self.dtype, f"D{self.D}" if self.Dv in (None, self.D) else f"D{self.D}v{self.Dv}",
                 f"B{self.B}", f"q{self.Sq}", f"k{self.Sk}", f"h{self.H}kv{self.Hkv}",
                 "causal" if self.causal else "full"]
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.layout != "bshd":
            parts.append(self.layout)
        if self.deterministic:
            parts.append("det")
        if self.dlse:
            parts.append("dlse")
        if self.window is not None:
            parts.append("win" + "_".join("inf" if side is None else str(side) for side in self.window))
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi is not None:
            parts.append("alibi" if self.alibi == "h" else "alibiBH")
        if self.segments is not None:
            parts.append(f"seg{self.segments}")
        if self.blocks is not None:
            parts.append(f"blk{self.blocks}")
        if self.bias is not None:
            parts.append(f"bias{self.bias}" + ("" if self.bias_grad else "-nograd"))
        if self.mask is not None:
            parts.append(f"mask{self.mask}")
        if self.dropout is not None:
            parts.append(f"drop{self.dropout:g}")
        return "-".join(parts)

    @property
    def dropout_seed(self) -> int:
        """A 64-bit seed of the problem (both halves nonzero, so both Philox key words matter)."""
        return (self.seed << 32) | (zlib.crc32(b"dropout" + self.id.encode()) | 1)

    def __str__(self) -> str:  # hypothesis and assertion messages print this
        return self.id

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


class PoisoningAllocator:
    """A CuPy allocator whose every allocation comes back filled with 0xFF bytes: NaN in fp16, bf16 and
    fp32. Installed around the GPU tests (:func:`poisoned_allocations`), it poisons what cuflash
    allocates itself (outputs, lse, the backward's fp32 scratch), so a kernel that leaves any of it
    unwritten, or reads scratch it did not initialize, shows NaN instead of whatever a fresh
    allocation happened to hold (fresh device memory is often zero, which hides such bugs).

    The fill is synchronous (memset, then a device synchronize), so it is ordered before any launch
    on any stream. Allocations made while a stream is being captured into a CUDA graph are not
    filled (a synchronize would break the capture).
    """

    FILL = 0xFF

    def __init__(self):
        self.pool = cupy.cuda.MemoryPool()
        self.allocations = 0

    def __call__(self, size: int):
        mem = self.pool.malloc(size)
        stream = cupy.cuda.get_current_stream()
        capturing = stream.ptr != 0 and cupy.cuda.runtime.streamIsCapturing(stream.ptr)
        if size and not capturing:
            cupy.cuda.runtime.memset(mem.ptr, self.FILL, size)
            cupy.cuda.runtime.deviceSynchronize()
            self.allocations += 1
        return mem


@pytest.fixture(scope="module", autouse=True)
def poisoned_allocations():
    """Module-scoped (hypothesis refuses function-scoped fixtures): every CuPy allocation in the
    module's tests, cuflash's own included, starts as NaN. Import it into a test module to use it."""
    allocator = PoisoningAllocator()
    with cupy.cuda.using_allocator(allocator):
        yield allocator
    allocator.pool.free_all_blocks()


def problem_ids(problems) -> list:
    return [p.id for p in problems]


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------

def host_normal(rng, shape, scale=1.0, shift=0.0) -> np.ndarray:
    """Standard-normal float32 on the host (never an all-zero array)."""
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale) + np.float32(shift))


def to_device(host: np.ndarray, dtype) -> "cupy.ndarray":
    """Host float array -> CuPy array of ``dtype`` (the cast happens on the host; ml_dtypes does bf16)."""
    return cupy.asarray(np.ascontiguousarray(host.astype(dtype)))


def layout_view(host_bshd: np.ndarray, dtype, layout: str, pad_value=np.nan) -> "cupy.ndarray":
    """A (B, S, H, D) device array of ``dtype`` holding ``host_bshd``, in the memory layout asked:

    - ``bshd``: contiguous;
    - ``bhsd``: a contiguous (B, H, S, D) array transposed to a bshd view (strides free, last dim 1);
    - ``padded``: a (B, S, H, D + 8) array sliced to D; the 8 extra columns hold NaN, so a kernel that
      reads past D poisons its result (the row stride stays a multiple of 16 bytes).
    """
    if layout == "bshd":
        return to_device(host_bshd, dtype)
    if layout == "bhsd":
        return to_device(host_bshd.transpose(0, 2, 1, 3), dtype).transpose(0, 2, 1, 3)
    if layout == "padded":
        b, s, h, d = host_bshd.shape
        wide = np.full((b, s, h, d + 8), pad_value, dtype=np.float32)
        wide[..., :d] = host_bshd
        return to_device(wide, dtype)[..., :d]
    raise ValueError(f"unknown layout {layout!r}")


def _uint_view(x):
    """x viewed as unsigned ints of its item size (same strides), for bit-level fills and compares."""
    return x.view({2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.dtype.itemsize])


def bits(x):
    """The raw bits of an array, for bit-identical comparisons (-0.0 != 0.0, NaN == same NaN)."""
    return _uint_view(x)


def bit_identical(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(cupy.all(bits(a) == bits(b)))


def dq_kernel_plans(monkeypatch) -> None:
    """For the rest of a test, the deterministic backward under a general mask takes the dQ kernel, as packed
    sequences and a bool mask do, instead of the ordered dQ adds of the batched window / ids (sm_90a,
    cuflash/kernels/backward.py ordered_dq_fits): their dq sums in another order, so tests that compare those
    kinds bit for bit put them on one plan. Plan caches of the test's own, so no patched plan outlives it."""
    from cuflash import api, launch
    from cuflash.kernels import backward, is_general

    fits = backward.ordered_dq_fits
    monkeypatch.setattr(backward, "ordered_dq_fits",
                        lambda arch, bucket, mask, mod: fits(arch, bucket, mask, mod) and not is_general(mask))
    monkeypatch.setattr(launch, "backward_plan", functools.lru_cache(maxsize=64)(launch.backward_plan.__wrapped__))
    monkeypatch.setattr(api, "_backward_plans", {})


def nan_fill(buf):
    """Fill ``buf`` (any strides) with a quiet NaN of its dtype, in place; returns it."""
    if buf.dtype == BF16:
        _uint_view(buf).fill(_BF16_NAN_BITS)
    else:
        kind, pattern = _NAN_BITS[buf.dtype.itemsize]
        _uint_view(buf).fill(kind(pattern))
    return buf


def nan_buffer(shape, dtype, layout: str = "bshd"):
    """A NaN-poisoned output buffer of ``shape`` (bshd order); ``layout="bhsd"`` gives a strided view."""
    if layout == "bhsd" and len(shape) == 4:
        b, s, h, d = shape
        return nan_fill(cupy.empty((b, h, s, d), dtype=dtype)).transpose(0, 2, 1, 3)
    return nan_fill(cupy.empty(shape, dtype=dtype))


def to_f64(x):
    """Any float CuPy array (bf16 included, any strides) -> contiguous float64, exactly."""
    x = cupy.asarray(x)
    if x.dtype == BF16:
        widened = x.view(cupy.uint16).astype(cupy.uint32) << cupy.uint32(16)
        return widened.view(cupy.float32).astype(cupy.float64)
    return x.astype(cupy.float64)


def round_f64_to(x64, dtype):
    """float64 values rounded to ``dtype`` (returned as float64): the best any kernel can store."""
    from cuflash import reference

    name = {np.dtype(np.float16): "float16", BF16: "bfloat16"}.get(np.dtype(dtype), "float32")
    return reference.round_to_dtype(x64, name, xp=cupy).astype(cupy.float64)


def norm(x64) -> float:
    return float(cupy.sqrt(cupy.sum(x64 * x64)))


def rms_row_norm(x64) -> float:
    """sqrt(mean over rows of ||row||^2), rows being every index but the last."""
    rows = max(1, x64.size // max(1, x64.shape[-1]))
    return math.sqrt(float(cupy.sum(x64 * x64)) / rows)


# --------------------------------------------------------------------------------------------
# Inputs and runs
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    q: object
    k: object
    v: object
    dout: object
    dlse: object  # (B, H, Sq) float32 or None
    alibi_slopes: object = None  # (H,) or (B, H) float32, or None
    segment_ids: object = None  # (q_ids (B, Sq), k_ids (B, Sk)) int32, or None
    block_ids: object = None  # (q_ids (B, Sq), k_ids (B, Sk)) int32, or None
    bias: object = None  # broadcastable to (B, H, Sq, Sk) in the input dtype, or None
    mask: object = None  # bool, broadcastable to (B, H, Sq, Sk), or None


def make_inputs(p: Problem, seed: int | None = None) -> Inputs:
    """Random normal inputs for ``p`` in its dtype and layout, seeded from its id by default, plus
    its ALiBi slopes and segment / block ids (from a second stream of the same seed)."""
    seed = p.seed if seed is None else seed
    rng = np.random.default_rng(seed)
    dt = p.np_dtype
    q = layout_view(host_normal(rng, (p.B, p.Sq, p.H, p.D)), dt, p.layout)
    k = layout_view(host_normal(rng, (p.B, p.Sk, p.Hkv, p.D)), dt, p.layout)
    v = layout_view(host_normal(rng, (p.B, p.Sk, p.Hkv, p.dv)), dt, p.layout)
    dout = layout_view(host_normal(rng, (p.B, p.Sq, p.H, p.dv)), dt, p.layout)
    dlse = cupy.asarray(host_normal(rng, (p.B, p.H, p.Sq))) if p.dlse else None
    x = Inputs(q, k, v, dout, dlse)
    if p.alibi is not None or p.segments is not None or p.blocks is not None:
        option_rng = np.random.default_rng([seed, 1])
        if p.alibi is not None:
            x.alibi_slopes = cupy.asarray(draw_alibi_slopes(option_rng, p))
        if p.segments is not None:
            x.segment_ids = tuple(cupy.asarray(ids) for ids in draw_segment_ids(option_rng, p))
        if p.blocks is not None:
            x.block_ids = tuple(cupy.asarray(ids) for ids in draw_block_ids(option_rng, p))
    if p.bias is not None:
        x.bias = draw_bias(np.random.default_rng([seed, 2]), p)
    if p.mask is not None:
        x.mask = cupy.asarray(draw_mask(np.random.default_rng([seed, 3]), p))
    return x


def draw_mask(rng, p: Problem) -> np.ndarray:
    """The bool mask of ``p`` (MASK_KINDS[p.mask]) on the host."""
    if p.mask == "keys":
        keep = np.ones((p.B, 1, 1, p.Sk), bool)
        for b in range(p.B):
            keep[b, ..., int(rng.integers(max(1, p.Sk // 2), p.Sk + 1)):] = False
        return keep
    heads = {"heads": p.H, "kv": p.Hkv}.get(p.mask, 1)
    shape = (1 if p.mask == "heads" else p.B, heads, p.Sq, p.Sk)
    if p.mask in ("tiles", "kv"):
        tiles = rng.integers(0, 3, (shape[0], heads, -(-p.Sq // 64), -(-p.Sk // 64)))
        kind = np.repeat(np.repeat(tiles, 64, axis=2), 64, axis=3)[:, :, :p.Sq, :p.Sk]
        return np.where(kind == 2, rng.random(shape) < 0.5, kind == 1)
    mask = rng.random(shape) < 0.7
    if p.mask == "rows" and p.Sq:
        mask[:, :, rng.random(p.Sq) < 0.15, :] = False
    return mask


def draw_bias(rng, p: Problem):
    """The bias of ``p`` (BIAS_KINDS[p.bias]) on the device, in the input dtype."""
    full = (p.B, p.H, p.Sq, p.Sk)
    shape = {"heads": (1, p.H, p.Sq, p.Sk), "kv": (p.B, p.Hkv, p.Sq, p.Sk), "shared": (1, 1, p.Sq, p.Sk),
             "keys": (p.B, 1, 1, p.Sk), "keyheads": (1, p.Hkv, 1, p.Sk),
             "rows": (p.B, p.H, p.Sq, 1), "scalar": (1, 1, 1, 1), "expanded": (1, p.H, p.Sq, p.Sk)}.get(p.bias, full)
    host = rng.standard_normal(shape)
    if p.bias == "keys" and p.Sk > 1:
        host[..., rng.random(p.Sk) < 0.2] = -np.inf
    if p.bias == "neginf":
        host[rng.random(shape) < 0.15] = -np.inf
        if p.Sq:
            host[:, :, rng.random(p.Sq) < 0.1, :] = -np.inf
    if p.bias == "large":
        host = 30.0 * np.sign(host)
    bias = to_device(host, p.np_dtype)
    if p.bias == "expanded":
        bias = cupy.broadcast_to(bias, full)
    return bias


def draw_alibi_slopes(rng, p: Problem) -> np.ndarray:
    """float32 slopes: (H,) the ALiBi paper's 2^(-8 (h + 1) / H), or (B, H) uniform in [0, 1)."""
    if p.alibi == "h":
        return np.exp2(-8.0 * np.arange(1, p.H + 1) / p.H).astype(np.float32)
    return rng.uniform(0.0, 1.0, (p.B, p.H)).astype(np.float32)


def _aligned(ids: np.ndarray, p: Problem) -> tuple:
    """(q_ids, k_ids) from (B, max(Sq, Sk)) ids over aligned positions: the last Sq and last Sk."""
    length = ids.shape[1]
    return (np.ascontiguousarray(ids[:, length - p.Sq:], dtype=np.int32),
            np.ascontiguousarray(ids[:, length - p.Sk:], dtype=np.int32))


def draw_sorted_ids(rng, batch: int, length: int, max_runs: int = 6) -> np.ndarray:
    """(batch, length) nondecreasing int32 ids: 2..max_runs runs of random lengths per row (one when
    length is 1), numbered from a random start and sometimes skipping a number."""
    rows = []
    for _ in range(batch):
        runs = int(rng.integers(min(2, length), min(max_runs, length) + 1)) if length else 0
        starts = np.zeros(length, np.int64)
        if runs > 1:
            starts[rng.choice(np.arange(1, length), runs - 1, replace=False)] = 1
        steps = starts * rng.integers(1, 3, length)  # a step of 2 leaves an id out
        rows.append(int(rng.integers(0, 3)) + np.cumsum(steps))
    return np.stack(rows).astype(np.int32) if rows else np.zeros((0, length), np.int32)


def _restarting(rng, p: Problem, q_ids: np.ndarray, k_ids: np.ndarray) -> tuple:
    """Batch row 0 replaced by one short sorted run of ids repeated: every 64 queries and, each id twice,
    every 128 keys. The ids are sorted within those blocks (the mask's pre-pass tiles are 16 .. 128 rows, so
    every descent falls on a tile edge), not across them: the kernels must notice (block_lists.cu's
    sortedness test) and keep reading ids there, while the other rows stay sorted."""
    if p.B:
        base = draw_sorted_ids(rng, 1, 64)[0]
        q_ids[0] = base[np.arange(p.Sq) % 64]
        k_ids[0] = base[(np.arange(p.Sk) % 128) // 2]
    return q_ids, k_ids


def draw_segment_ids(rng, p: Problem) -> tuple:
    """int32 (q_ids (B, Sq), k_ids (B, Sk)) drawn as SEGMENT_KINDS[p.segments] says."""
    if p.segments == "random":
        return (rng.integers(0, 4, (p.B, p.Sq)).astype(np.int32),
                rng.integers(0, 4, (p.B, p.Sk)).astype(np.int32))
    q_ids, k_ids = _aligned(draw_sorted_ids(rng, p.B, max(p.Sq, p.Sk)), p)
    if p.segments == "qonly" and p.Sq:
        run = max(1, p.Sq // 5)
        for b in range(p.B):
            start = int(rng.integers(0, p.Sq - run + 1))
            q_ids[b, start:start + run] = int(k_ids.max(initial=0)) + 1000  # an id no key has
    if p.segments == "restart":
        return _restarting(rng, p, q_ids, k_ids)
    return q_ids, k_ids


def draw_block_ids(rng, p: Problem) -> tuple:
    """int32 (q_ids (B, Sq), k_ids (B, Sk)) drawn as BLOCK_KINDS[p.blocks] says."""
    if p.blocks == "random":
        return (rng.integers(0, 5, (p.B, p.Sq)).astype(np.int32),
                rng.integers(0, 5, (p.B, p.Sk)).astype(np.int32))
    q_ids, k_ids = _aligned(draw_sorted_ids(rng, p.B, max(p.Sq, p.Sk)), p)
    return _restarting(rng, p, q_ids, k_ids) if p.blocks == "restart" else (q_ids, k_ids)


def option_kwargs(p: Problem, x: Inputs) -> dict:
    """The options beyond scale and causal that ``p`` turns on, as keyword arguments (those that are
    off are left out, so a plain problem makes exactly the call it always made)."""
    options = {}
    if p.window is not None:
        options["window"] = tuple(p.window)
    if p.softcap is not None:
        options["softcap"] = p.softcap
    for name in ("alibi_slopes", "segment_ids", "block_ids", "bias", "mask"):
        if getattr(x, name) is not None:
            options[name] = getattr(x, name)
    if p.dropout is not None:
        options["dropout_p"], options["seed"] = p.dropout, p.dropout_seed
    return options


def reference_options(p: Problem, x: Inputs) -> dict:
    """option_kwargs for cuflash.reference: the seed becomes the keep-mask the kernels draw from it."""
    options = option_kwargs(p, x)
    if p.dropout is not None:
        from cuflash import reference

        options["dropout_mask"] = reference.dropout_keep_mask(options.pop("seed"), p.dropout, p.B, p.H, p.Sq, p.Sk,
                                                              xp=cupy)
    return options


def visibility(p: Problem, x: Inputs):
    """(B, Sq, Sk) bool: which key each query row sees under causal, window and ids (straight from
    the API's wording: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, ...);
    (B, mask heads, Sq, Sk) with a bool mask."""
    diagonal = cupy.arange(p.Sq)[:, None] + (p.Sk - p.Sq)  # query i's aligned position
    j = cupy.arange(p.Sk)[None, :]
    visible = cupy.ones((p.B, p.Sq, p.Sk), dtype=bool)
    left, right = (None, None) if p.window is None else p.window
    if p.causal:
        visible &= (j <= diagonal)[None]
    if left is not None:
        visible &= (j >= diagonal - left)[None]
    if right is not None:
        visible &= (j <= diagonal + right)[None]
    if x.segment_ids is not None:
        visible &= x.segment_ids[0][:, :, None] == x.segment_ids[1][:, None, :]
    if x.block_ids is not None:
        visible &= x.block_ids[1][:, None, :] <= x.block_ids[0][:, :, None]
    if x.mask is not None:  # (B, mask heads, Sq, Sk): the mask's head dim is kept
        visible = visible[:, None] & x.mask
    return visible


@dataclasses.dataclass
class Result:
    out: object
    lse: object
    dq: object = None
    dk: object = None
    dv: object = None
    dbias: object = None


def run_cuflash(p: Problem, x: Inputs, *, backward: bool = True, stream=None,
                out_layout: str = "bshd") -> Result:
    """Forward (and backward) through cuflash into NaN-poisoned caller buffers.

    Returns the buffers themselves (so an element the kernel never wrote is still NaN), after
    checking that the arrays cuflash returned have the documented shapes and dtypes.
    """
    import cuflash

    out = nan_buffer((p.B, p.Sq, p.H, p.dv), p.np_dtype, out_layout)
    lse = nan_buffer((p.B, p.H, p.Sq), np.float32)
    dq = dk = dv = None
    if backward:
        dq = nan_buffer(x.q.shape, p.np_dtype, out_layout)
        dk = nan_buffer(x.k.shape, p.np_dtype, out_layout)
        dv = nan_buffer(x.v.shape, p.np_dtype, out_layout)
    if stream is not None:  # the poison fills ran on the current stream; `stream` may not wait for it
        cupy.cuda.get_current_stream().synchronize()
    options = option_kwargs(p, x)
    got_out, got_lse = cuflash.attention_forward(
        x.q, x.k, x.v, scale=p.scale, causal=p.causal, out=out, lse=lse, stream=stream, **options)
    _check_returned("out", got_out, out)
    _check_returned("lse", got_lse, lse)
    result = Result(out, lse)
    if not backward:
        return result
    extra = {}
    names, buffers = ("dq", "dk", "dv"), [dq, dk, dv]
    if x.bias is not None and not p.bias_grad:
        extra["bias_grad"] = False
    elif x.bias is not None:
        extra["dbias"] = nan_buffer(x.bias.shape, p.np_dtype)
        names, buffers = names + ("dbias",), buffers + [extra["dbias"]]
        if stream is not None:
            cupy.cuda.get_current_stream().synchronize()
    grads = cuflash.attention_backward(
        x.dout, x.q, x.k, x.v, out, lse, dlse=x.dlse, scale=p.scale, causal=p.causal,
        deterministic=p.deterministic, dq=dq, dk=dk, dv=dv, stream=stream, **extra, **options)
    assert len(grads) == len(names), f"attention_backward returned {len(grads)} arrays, expected {names}"
    for name, got, buf in zip(names, grads, buffers, strict=True):
        _check_returned(name, got, buf)
    result.dq, result.dk, result.dv = dq, dk, dv
    result.dbias = extra.get("dbias")
    return result


def _check_returned(name, got, buf):
    assert tuple(got.shape) == tuple(buf.shape), f"{name}: returned shape {got.shape}, expected {buf.shape}"
    assert np.dtype(got.dtype) == np.dtype(buf.dtype), f"{name}: returned dtype {got.dtype}, expected {buf.dtype}"


# --------------------------------------------------------------------------------------------
# The oracle and the rule
# --------------------------------------------------------------------------------------------

class Expected:
    """float64 reference results (computed now) and the same-precision naive baseline (computed on
    first use only: most comparisons pass against the rounding baseline alone, which is cheaper)."""

    def __init__(self, p: Problem, x: Inputs, *, backward: bool = True):
        from cuflash import reference

        self._reference = reference
        self._p = p
        self._options = reference_options(p, x)
        self._q, self._k, self._v = to_f64(x.q), to_f64(x.k), to_f64(x.v)
        self.out, self.lse = reference.attention_forward(
            self._q, self._k, self._v, scale=p.softmax_scale, causal=p.causal, xp=cupy,
            **self._options)
        self.grads = None
        self._dout = self._dlse = None
        self._naive_fwd = self._naive_bwd = self._residual = self._flash_bwd = None
        if backward:
            self._dout = to_f64(x.dout)
            self._dlse = None if x.dlse is None else x.dlse.astype(cupy.float64)
            self.grads = reference.attention_backward(
                self._dout, self._q, self._k, self._v, dlse=self._dlse, scale=p.softmax_scale,
                causal=p.causal, xp=cupy, **self._options)

    def naive_forward(self):
        if self._naive_fwd is None:
            self._naive_fwd = self._reference.naive_forward(
                self._q, self._k, self._v, dtype=self._p.dtype_name, scale=self._p.softmax_scale,
                causal=self._p.causal, xp=cupy, **self._options)
        return self._naive_fwd

    def residual_grads(self, out, lse):
        """The exact gradient given the stored (rounded) ``out`` and ``lse`` (module docstring)."""
        if self._residual is None:
            out64, lse64 = to_f64(out), to_f64(lse)
            ref_lse = self.lse.astype(cupy.float64)
            both = cupy.isfinite(ref_lse) & cupy.isfinite(lse64)
            # c rescales each row's P; clipped so a wrong lse (failed on its own) cannot blow it up
            c = cupy.clip(cupy.exp(cupy.where(both, ref_lse - lse64, 0.0)), 0.5, 2.0)
            shift = cupy.sum(self._dout * (out64 - self.out), axis=-1).transpose(0, 2, 1)  # (B, H, Sq)
            dlse = -shift if self._dlse is None else self._dlse - shift
            self._residual = self._reference.attention_backward(
                self._dout * c.transpose(0, 2, 1)[..., None], self._q, self._k, self._v,
                dlse=c * dlse, scale=self._p.softmax_scale, causal=self._p.causal, xp=cupy,
                **self._options)
        return self._residual

    def _naive_backward(self, out=None):
        return self._reference.naive_backward(
            self._dout, self._q, self._k, self._v, dtype=self._p.dtype_name, scale=self._p.softmax_scale,
            causal=self._p.causal, dlse=self._dlse, out=None if out is None else to_f64(out), xp=cupy,
            **self._options)

    def naive_grads(self):
        if self._naive_bwd is None:
            self._naive_bwd = self._naive_backward()
        return self._naive_bwd

    def flash_grads(self, out):
        """The naive model with FlashAttention's row term, D = rowsum(dO * out) from the stored ``out``."""
        if self._flash_bwd is None:
            self._flash_bwd = self._naive_backward(out)
        return self._flash_bwd


def expected_for(p: Problem, x: Inputs, *, backward: bool = True) -> Expected:
    """float64 reference (and, lazily, the naive baseline), computed on the GPU."""
    return Expected(p, x, backward=backward)


class Report:
    """Collects every comparison of one case, then fails once listing all that went wrong."""

    def __init__(self, context: str):
        self.context = context
        self.lines, self.failures = [], []

    def fail(self, message: str):
        self.failures.append(message)

    def note(self, message: str):
        self.lines.append(message)

    def check(self):
        if self.failures:
            detail = "\n  ".join(self.failures + ["-- passed: " + "; ".join(self.lines)])
            raise AssertionError(f"{self.context}:\n  {detail}")


def first_bad_index(mask) -> tuple:
    idx = cupy.argwhere(mask)
    return tuple(int(i) for i in cupy.asnumpy(idx[0])) if idx.shape[0] else ()


def check_written(report: Report, name: str, buf, *, allow_neg_inf: bool = False) -> object:
    """No NaN (unwritten poison or computed NaN) and no infinity (but -inf where allowed)."""
    x = to_f64(buf)
    bad = ~cupy.isfinite(x)
    if allow_neg_inf:
        bad &= ~cupy.isneginf(x)
    count = int(cupy.count_nonzero(bad))
    if count:
        nan = int(cupy.count_nonzero(cupy.isnan(x)))
        report.fail(f"{name}: {count} of {x.size} elements not finite ({nan} NaN: never written or "
                    f"computed NaN), first at index {first_bad_index(bad)}")
    return x


def check_close(report: Report, name: str, actual64, expected64, baselines: dict, dtype_key: str, *,
                floor: float | None = None, allowance: float = 0.0):
    """The tolerance rule for one quantity (float64 arrays on the GPU, same shape).

    ``baselines`` maps a label to a callable returning that baseline's result (same shape); they
    are evaluated in order, each only if the kernel's error still exceeds the tolerance so far.
    """
    expected64 = expected64.astype(cupy.float64)
    exact_norm = norm(expected64)
    denominator = max(exact_norm, 1e-300)
    err_abs = norm(actual64 - expected64)
    err = err_abs / denominator
    # Against an exact 0 a relative error means nothing: the baselines then count absolutely (the stored
    # residuals' one: D = rowsum(dO * out) from the rounded out, which dropout's 1 / (1 - p) makes inexact).
    per = denominator if exact_norm > 0.0 else 1.0
    dtype = DTYPES[dtype_key] if name != "lse" else np.dtype(np.float32)
    errors = {"round": norm(round_f64_to(expected64, dtype) - expected64) / per}
    base_floor = FLOOR[dtype_key] if floor is None else floor

    def allowed():
        if exact_norm == 0.0:
            return 2.0 * max(errors.values()) + allowance
        return (2.0 * max(errors.values()) + base_floor) * denominator + allowance

    for label, compute in baselines.items():
        if err_abs <= allowed() and not EAGER_BASELINES:
            break
        result = compute().astype(cupy.float64)
        finite = bool(cupy.all(cupy.isfinite(result)))
        errors[label] = norm(result - expected64) / per if finite else 0.0
    tol = 2.0 * max(errors.values()) + base_floor
    if exact_norm == 0.0:  # the exact answer is 0 (e.g. dq, dk when Sk == 1)
        summary = f"{name} |err| {err_abs:.3g} (exact answer 0; allowed {allowed():.3g}: " + ", ".join(
            f"{label} |err| {value:.3g}" for label, value in errors.items()) + f", +abs {allowance:.3g})"
    else:
        summary = f"{name} err {err:.3g} (tol {tol:.3g}; " + ", ".join(
            f"{label} {value:.3g}" for label, value in errors.items()) + (
            f"; +abs {allowance:.3g})" if allowance else ")")
    if err_abs <= allowed():
        report.note(summary)
    else:
        report.fail(summary)
    return err


def check_forward(report: Report, p: Problem, r: Result, e: Expected):
    out = check_written(report, "out", r.out)
    lse = check_written(report, "lse", r.lse, allow_neg_inf=True)
    ref_lse = e.lse.astype(cupy.float64)
    empty = cupy.isneginf(ref_lse)
    mismatch = cupy.isneginf(lse) != empty
    if bool(cupy.any(mismatch)):
        report.fail(f"lse: -inf pattern differs from the reference's (rows that see no key) at "
                    f"{int(cupy.count_nonzero(mismatch))} rows, first {first_bad_index(mismatch)}")
    if bool(cupy.all(cupy.isfinite(out))):
        check_close(report, "out", out, e.out, {"naive": lambda: e.naive_forward()[0]}, p.dtype)
    finite = ~empty & cupy.isfinite(lse)
    if bool(cupy.any(finite)) and not bool(cupy.any(mismatch)):
        def naive_lse():
            return cupy.where(finite, e.naive_forward()[1].astype(cupy.float64), 0.0)

        check_close(report, "lse", cupy.where(finite, lse, 0.0), cupy.where(finite, ref_lse, 0.0),
                    {"naive": naive_lse}, p.dtype, floor=LSE_FLOOR[p.dtype])


def one_key_rows(p: Problem, x: Inputs | None = None) -> float:
    """Query rows (per batch and head) that see exactly one key: their softmax is exactly one-hot,
    so their exact dq and their share of dk are 0 while FlashAttention leaves rounding noise.
    With a window or ids (these need ``x``) they are counted from the masks, averaged over the
    batch."""
    if p.window is not None or (x is not None and (x.segment_ids is not None or x.block_ids is not None
                                                   or x.mask is not None)):
        if p.B == 0:
            return 0
        visible = visibility(p, x)
        per = p.B * (visible.shape[1] if visible.ndim == 4 else 1)
        return int(cupy.count_nonzero(visible.sum(axis=-1) == 1)) / per
    if p.Sk == 1:
        return 1 if p.causal else p.Sq
    return 1 if p.causal and p.Sq >= p.Sk else 0  # causal row Sq - Sk sees only key 0


def cancellation_allowance(p: Problem, x: Inputs, rows: float) -> dict:
    """Absolute allowance for dq and dk from ``rows`` one-hot rows per (batch, head):
    CANCELLATION_ALLOWANCE * |scale| * rms|dO| * rms|v| * rms|k or q| * sqrt(rows * B * H); and for dbias,
    which is dS itself (dP - D cancels to rounding noise in those rows): the same without |scale| * rms|k|."""
    if rows == 0:
        return {}
    ds_noise = (CANCELLATION_ALLOWANCE * rms_row_norm(to_f64(x.dout)) * rms_row_norm(to_f64(x.v))
                * math.sqrt(rows * p.B * p.H))
    common = abs(p.softmax_scale) * ds_noise
    return {"dq": common * rms_row_norm(to_f64(x.k)), "dk": common * rms_row_norm(to_f64(x.q)), "dbias": ds_noise}


def check_backward(report: Report, p: Problem, x: Inputs, r: Result, e: Expected, *,
                   degenerate: bool = False, finite_only: tuple = ()):
    """dq, dk, dv against the reference. Rows that see a single key get the cancellation allowance
    on dq and dk (module docstring); ``degenerate=True`` gives it to every row (one-hot softmax
    everywhere, e.g. huge logits). Names in ``finite_only`` (ill-conditioned by construction) are
    only checked to be written and finite."""
    allowances = cancellation_allowance(p, x, p.Sq if degenerate else one_key_rows(p, x))
    for name in ("dq", "dk", "dv") + (("dbias",) if r.dbias is not None else ()):
        got = check_written(report, name, getattr(r, name))
        if name in finite_only or not bool(cupy.all(cupy.isfinite(got))):
            continue
        baselines = {"naive": lambda n=name: e.naive_grads()[n],
                     "stored": lambda n=name: e.residual_grads(r.out, r.lse)[n],
                     "flash": lambda n=name: e.flash_grads(r.out)[n]}
        check_close(report, name, got, e.grads[name], baselines, p.dtype, allowance=allowances.get(name, 0.0))


def check_attention(p: Problem, *, backward: bool = True, inputs: Inputs | None = None,
                    stream=None, out_layout: str = "bshd", degenerate: bool = False,
                    finite_only: tuple = ()) -> Result:
    """Run cuflash on ``p`` into poisoned buffers and hold every output to the rule."""
    x = make_inputs(p) if inputs is None else inputs
    r = run_cuflash(p, x, backward=backward, stream=stream, out_layout=out_layout)
    if stream is not None:
        _as_stream(stream).synchronize()
    e = expected_for(p, x, backward=backward)
    report = Report(p.id)
    check_forward(report, p, r, e)
    if backward:
        check_backward(report, p, x, r, e, degenerate=degenerate, finite_only=finite_only)
    report.check()
    return r


def _as_stream(stream):
    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream)
    return stream


# --------------------------------------------------------------------------------------------
# Session helpers
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def precompile_once() -> str:
    """Compile every kernel variant once per process, in parallel (``cuflash.build.precompile``), so
    tests pay no serial compile time. ``CUFLASH_TEST_PRECOMPILE=0`` skips it (compile on first use); any
    other value but 1 is a regular expression, and only the variants whose rendered name it matches are
    compiled first (as ``python -m cuflash compile --match``): a few selected tests on a fresh machine need not
    wait for all of them (about 5 minutes on 16 cores; three shards each compiling all of them side by side
    ran out a 9-minute budget with no test run, session 34).
    A failure is reported, not raised: the tests of the broken variants fail with the real error."""
    setting = os.environ.get("CUFLASH_TEST_PRECOMPILE", "1")
    if setting == "0":
        return "precompile skipped (CUFLASH_TEST_PRECOMPILE=0)"
    from cuflash import build

    start = time.perf_counter()
    try:
        arch = build.arch_of_compute_capability(build._current_compute_capability())
        results = build.precompile(arch, build.variants_matching(arch, None if setting == "1" else setting))
    except Exception as exc:  # noqa: BLE001 - reported; the affected tests fail with details
        message = f"cuflash.build.precompile() failed after {time.perf_counter() - start:.1f} s: {exc}"
        warnings.warn(message, stacklevel=2)
        return message
    fresh = sum(1 for r in results if not getattr(r, "cached", False))
    return (f"precompiled {len(results)} kernel variants ({fresh} compiled, {len(results) - fresh} "
            f"from the disk cache) in {time.perf_counter() - start:.1f} s")


def announce_precompile(config) -> None:
    """Run :func:`precompile_once` and print its summary the first time any module asks."""
    first = precompile_once.cache_info().currsize == 0
    message = precompile_once()
    if first:
        report_line(config, "\n" + message)


def report_line(config, message: str) -> None:
    """Print a line to the terminal even while pytest captures output."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message)
    else:  # pragma: no cover
        print(message)


def check_deterministic(p: Problem, runs: int) -> None:
    """``p`` (deterministic=True) checked against float64 once, then run ``runs - 1`` more times: every
    output (out, lse, dq, dk, dv, and dbias with a bias) must be bit-identical to the first run's."""
    x = make_inputs(p)
    first = check_attention(p, inputs=x)
    for run in range(1, runs):
        again = run_cuflash(p, x)
        for name in ("out", "lse", "dq", "dk", "dv") + (("dbias",) if first.dbias is not None else ()):
            assert bit_identical(getattr(again, name), getattr(first, name)), (
                f"{p.id}: {name} of run {run} differs bitwise from run 0")
