"""KV-cache attention (decoding and chunked prefill): :func:`attention_with_kvcache`.

FlashAttention's ``flash_attn_with_kvcache`` semantics. The cache is dense, ``k_cache (B, L, Hkv, D)``, or paged,
``k_cache (num_pages, page_size, Hkv, D)`` with ``block_table (B, max_pages)`` int32 (key j of batch b is row
``j % page_size`` of page ``block_table[b, j // page_size]``; any page size, 1 included). ``cache_seqlens (B,)``
int32 counts the tokens already cached; ``k_new`` / ``v_new (B, Snew, Hkv, D)`` are written into the cache in
place at positions ``cache_seqlens[b] ... + Snew - 1``, then ``q (B, Sq, H, D)`` attends to the first
``cache_seqlens[b] + Snew`` keys (causal and window bottom-right aligned). ``cache_seqlens`` itself is not
advanced: the caller owns it.

Lengths and block tables given as host data (ints, lists, NumPy arrays, CPU tensors) are checked in full
(lengths against the capacity, page ids against the pages) and copied to the GPU; on the GPU they are checked
for shape, dtype and device only (no host synchronization, so a serving loop can be captured in a CUDA graph),
and the kernels clamp them: a length past the capacity or a page id out of range never reads or writes outside
the cache, but the result is then unspecified.

Kernels: cuda_src/flash_kvcache.cu (fp16 and bf16, tensor cores) and cuda_src/flash_kvcache_simt.cu (float32,
FFMA only); plans in cuflash/kernels/kvcache.py.
"""
from __future__ import annotations

import contextlib
import numbers

import numpy as np

from . import launch, validation
from .arrays import TensorDesc, array_key, describe, require_cuda, resolve_stream
from .kernels import ProblemShape, head_dim_bucket
from .kernels import kvcache as plans
from .varlen import _on_gpu

#: Score options the KV-cache kernel implements; the others raise naming themselves.
OPTIONS = ("window", "softcap", "alibi_slopes")


def _reject_options(options: dict) -> None:
    validation.reject_planned(options)
    for name in validation.SCORE_OPTIONS:
        if name not in (*OPTIONS, "dropout_p", "seed") and options.get(name) is not None:
            raise ValueError(f"{name} is not supported by attention_with_kvcache (it takes window, softcap and "
                             f"alibi_slopes); use cuflash.attention on the gathered keys for it")
    if options.get("dropout_p"):
        raise ValueError("dropout_p is not supported by attention_with_kvcache (an inference entry point)")


def _int_array(x, name: str, shape: tuple, device: int, what: str):
    """A host or device int32 array of ``shape``: ``(TensorDesc, host values or None, owner)``."""
    if not _on_gpu(x):
        host = np.asarray(x)
        if host.dtype.kind not in "iu" or host.dtype == np.uint64 and host.size and host.max() >= 2**63:
            raise TypeError(f"{name} must hold integers (int32), got dtype {host.dtype}")
        if host.shape != shape:
            raise ValueError(f"{name} must have shape {shape} {what}, got {tuple(host.shape)}")
        host = host.astype(np.int64)
        import cupy

        with cupy.cuda.Device(device):
            owner = cupy.asarray(host.astype(np.int32))
        return describe(owner, name), host, owner
    require_cuda(x, name)
    t = describe(x, name)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}, got {tuple(t.shape)}")
    if t.dtype != "int32":
        raise TypeError(f"{name} must have dtype int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on CUDA device {t.device} but q is on device {device}")
    if t.shape and t.shape[-1] > 1 and t.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.strides}")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{name} has negative strides {t.strides}; pass a copy")
    return t, None, None


def _check_cache_tensor(t: TensorDesc, q: TensorDesc, heads_k: int | None, dim: int | None, rows: str) -> None:
    validation._check_dtype(t)
    if t.ndim != 4:
        raise ValueError(f"{t.name} must have 4 dimensions {rows}, got shape {t.shape}")
    if t.dtype != q.dtype:
        raise TypeError(f"{t.name} has dtype {t.dtype} but q has {q.dtype}; they must share a dtype")
    if t.device != q.device:
        raise ValueError(f"{t.name} is on CUDA device {t.device} but q is on device {q.device}")
    if heads_k is not None and t.shape[2] != heads_k:
        raise ValueError(f"{t.name} has {t.shape[2]} kv heads but k_cache has {heads_k}")
    if dim is not None and t.shape[3] != dim:
        raise ValueError(f"{t.name} has head dim {t.shape[3]}, expected {dim}")
    validation._check_loadable(t)


class KvCall:
    """The checked arguments of one call: descriptions, the problem sizes and the parameter-block fields."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits, causal, options):
        _reject_options(options)
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            require_cuda(x, name)
        qd, kd, vd = describe(q, "q"), describe(k_cache, "k_cache"), describe(v_cache, "v_cache")
        validation._check_dtype(qd)
        if qd.ndim != 4:
            raise ValueError(f"q must have 4 dimensions (batch, seq_q, heads, head_dim), got shape {qd.shape}")
        if qd.dtype not in plans.DTYPES:
            raise TypeError(f"attention_with_kvcache takes float16, bfloat16 or float32, got q of dtype {qd.dtype}")
        validation._check_loadable(qd)
        validation._check_head_dim(qd, "head dim")
        batch, seqlen_q, num_heads, head_dim = qd.shape
        paged = block_table is not None
        rows = "(num_pages, page_size, kv_heads, head_dim)" if paged else "(batch, capacity, kv_heads, head_dim)"
        _check_cache_tensor(kd, qd, None, head_dim, rows)
        _check_cache_tensor(vd, qd, kd.shape[2], None, rows)
        validation._check_head_dim(vd, "head dim (Dv)")
        if vd.shape[:2] != kd.shape[:2]:
            raise ValueError(f"v_cache has shape {vd.shape} but k_cache has {kd.shape}: their first two dims must match")
        num_heads_k = kd.shape[2]
        if num_heads_k < 1 or num_heads % num_heads_k:
            raise ValueError(f"k_cache has {num_heads_k} heads, which does not divide q's {num_heads} heads")
        if batch > validation.MAX_GRID_YZ or num_heads_k > validation.MAX_GRID_YZ:
            raise ValueError(f"batch {batch} and {num_heads_k} kv heads must each be at most {validation.MAX_GRID_YZ}")
        device = qd.device
        self.owners = []
        fields = {}
        if paged:
            num_pages, page_size = kd.shape[0], kd.shape[1]
            if page_size < 1 or num_pages < 1:
                raise ValueError(f"k_cache has {num_pages} pages of {page_size} rows; a paged cache needs at least "
                                 f"one page of at least one row")
            if block_table is None or (hasattr(block_table, "shape") and len(block_table.shape) != 2):
                raise ValueError("block_table must be a 2-D int32 array (batch, max_pages)")
            max_pages = int(np.shape(block_table)[1]) if not hasattr(block_table, "shape") else int(block_table.shape[1])
            bt, bt_host, owner = _int_array(block_table, "block_table", (batch, max_pages), device,
                                            "(batch, max_pages)")
            if bt_host is not None and bt_host.size and (bt_host.min() < 0 or bt_host.max() >= num_pages):
                bad = int(bt_host.min() if bt_host.min() < 0 else bt_host.max())
                raise ValueError(f"block_table holds page id {bad}, outside the cache's {num_pages} pages")
            self.owners.append(owner)
            capacity = max_pages * page_size
            fields.update(block_table=bt.ptr, block_table_batch_stride=bt.strides[0],
                          page_size=page_size, num_pages=num_pages)
        else:
            if kd.shape[0] != batch:
                raise ValueError(f"k_cache has batch {kd.shape[0]} but q has {batch} (a dense cache is (batch, "
                                 f"capacity, kv_heads, head_dim); pass block_table for a paged one)")
            capacity = kd.shape[1]
        if capacity >= 2**31:
            raise ValueError(f"the cache holds {capacity} keys per sequence; at most {2**31 - 1} are supported")
        seqlen_new = 0
        if (k_new is None) != (v_new is None):
            raise ValueError("k_new and v_new must be given together")
        if k_new is not None:
            require_cuda(k_new, "k_new")
            require_cuda(v_new, "v_new")
            knd, vnd = describe(k_new, "k_new"), describe(v_new, "v_new")
            for t, dim in ((knd, head_dim), (vnd, vd.shape[3])):
                _check_cache_tensor(t, qd, num_heads_k, dim, "(batch, seq_new, kv_heads, head_dim)")
                if t.shape[0] != batch:
                    raise ValueError(f"{t.name} has batch {t.shape[0]} but q has {batch}")
            if vnd.shape[1] != knd.shape[1]:
                raise ValueError(f"v_new has {vnd.shape[1]} tokens but k_new has {knd.shape[1]}")
            seqlen_new = knd.shape[1]
            if seqlen_new > capacity:
                raise ValueError(f"k_new has {seqlen_new} tokens but the cache holds only {capacity} per sequence")
            for t, prefix in ((knd, "knew"), (vnd, "vnew")):
                fields[t.name] = t.ptr
                fields[f"{prefix}_batch_stride"], fields[f"{prefix}_row_stride"], fields[f"{prefix}_head_stride"] = \
                    t.strides[:3]
        if cache_seqlens is None:
            raise TypeError("cache_seqlens is required: an int32 array (batch,) of tokens already cached (or an int)")
        if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
            cache_seqlens = np.full((batch,), int(cache_seqlens), dtype=np.int64)
        cs, cs_host, owner = _int_array(cache_seqlens, "cache_seqlens", (batch,), device, "(batch,)")
        self.owners.append(owner)
        if cs_host is not None and batch:
            if cs_host.min() < 0:
                raise ValueError(f"cache_seqlens holds {int(cs_host.min())}; lengths must be >= 0")
            if cs_host.max() + seqlen_new > capacity:
                at = int(np.argmax(cs_host))
                raise ValueError(f"cache_seqlens[{at}] = {int(cs_host[at])} plus {seqlen_new} new tokens exceeds the "
                                 f"cache's capacity of {capacity} keys per sequence")
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                       or num_splits < 1):
            raise ValueError(f"num_splits must be None (a heuristic picks) or an int >= 1, got {num_splits!r}")
        fields.update(cache_seqlens=cs.ptr, seqlen_new=seqlen_new, kv_capacity=capacity)

        self.q, self.k, self.v = qd, kd, vd
        self.shape = ProblemShape(batch, seqlen_q, capacity, num_heads, num_heads_k, head_dim, vd.shape[3], qd.dtype,
                                  bool(causal))
        self.shape, self.opts = validation.check_score_options(self.shape, options, describe, device)
        # Plans use the capacity, never the lengths (which the host may not have): kvcache_workspace answers from
        # shapes alone, and a call planned from lengths could want a different split.
        self.capacity, self.append, self.num_splits, self.fields = capacity, seqlen_new > 0, num_splits, fields
        self.device, self.paged = device, paged

    def window_fields(self) -> dict:
        """The window (causal folded in) and the score options' fields; the kernel always reads the window."""
        values = self.opts.params(self.shape.causal) or {}
        left, right = (validation.UNBOUNDED_WINDOW if w is None else min(int(w), validation.UNBOUNDED_WINDOW)
                       for w in self.opts.window)
        values["window_left"], values["window_right"] = left, (min(right, 0) if self.shape.causal else right)
        return values


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, k_new=None, v_new=None, *, block_table=None,
                           num_splits=None, scale=None, causal=False, return_lse=False, out=None, lse=None,
                           workspace=None, stream=None, **options):
    """Attention of ``q`` over a KV cache, after appending ``k_new`` / ``v_new`` to it in place.

    ``q (B, Sq, H, D)``; ``k_cache`` / ``v_cache`` dense ``(B, L, Hkv, D)`` / ``(B, L, Hkv, Dv)`` or paged
    ``(num_pages, page_size, Hkv, D)`` with ``block_table (B, max_pages)`` int32; ``cache_seqlens (B,)`` int32
    (or an int for every batch): tokens already in the cache; ``k_new`` / ``v_new (B, Snew, Hkv, D)``: tokens
    to append (decoding: Snew = 1; chunked prefill: more), written at ``cache_seqlens[b]`` onwards. Batch b
    attends to its first ``cache_seqlens[b] + Snew`` keys; ``causal`` / ``window`` are bottom-right aligned
    (the last query row sees the last key). ``softcap``, ``alibi_slopes (H,)`` or ``(B, H)`` and ``scale`` as
    for :func:`cuflash.attention`. The query heads of a GQA group share each read of the cache.
    ``num_splits``: split-KV factor (None: a heuristic that fills the GPU when B x Hkv cannot; 1: no split).

    Returns ``out (B, Sq, H, Dv)``, or ``(out, lse (B, H, Sq))`` with ``return_lse=True``; ``out`` / ``lse``
    may be given as buffers. A row that sees no key gets out 0 and lse -inf. ``workspace``: the split-KV
    buffers by name, shapes from :func:`kvcache_workspace` (default: CuPy's pool).
    """
    try:
        key, pointers = _call_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits, scale,
                                  causal, out, lse, workspace, options)
        cached = _plans.get(key)
    except Exception:  # an argument the keys cannot read (host lengths, an int): the validating path
        key = cached = None
    if cached is not None and launch.current_device() == cached.call.device:
        out, lse = _hit(cached, pointers, out, lse, stream, carve=workspace is None)
        return (out, lse) if return_lse else out
    _reject_options(options)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):  # before touching CUDA
        require_cuda(x, name)
    with contextlib.ExitStack() as stack:
        given_stream, stream = stream, resolve_stream(stream)
        stack.enter_context(stream)
        launch.current_device()
        call = KvCall(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits, causal, options)
        shape = call.shape
        from .api import _buffer, _enter_device

        scale = validation.check_scale(scale, shape.head_dim)
        stream, switched = _enter_device(stack, call.device, stream, given_stream)
        out_d = _buffer(out, "out", validation.out_shape(shape), shape.dtype, call.device)
        lse_d = _buffer(lse, "lse", validation.lse_shape(shape), "float32", call.device, rows_only=True)
        if shape.batch and shape.num_heads_k:
            plan = _launch(call, scale, out_d, lse_d, workspace, stream)
            if key is not None and not switched:
                from .api import _remember

                _remember(_plans, key, plan)
    out = out_d.array if out is None else out
    if return_lse:
        return out, (lse_d.array if lse is None else lse)
    return out


# ---------------------------------------------------------------------------------------------------------
# Host time. A decoding loop calls with the same shapes every step: the first call with a key (every array's
# type, shape, strides, dtype, device and alignment; the options' values) validates, plans and packs the
# parameter block; a later one patches the arrays' pointers in (a workspace's too) and launches (cuflash.api does
# the same). Calls with host lengths or tables always validate.

_plans: dict = {}
#: The pointer fields a call patches, by argument, in launch.POINTER_FIELDS order.
_FIELD_INDEX = {name: i for i, name in enumerate(launch.POINTER_FIELDS)}
#: The split-KV buffers a workspace holds (kvcache_workspace's names, pointer fields of their own).
_WORKSPACE_FIELDS = ("o_accum", "lse_accum")


class _Cached:
    """A validated call: its launches and parameter block (``call``, whose scratch layout carves the split-KV
    buffers from one allocation) and the pointers it launched with."""

    __slots__ = ("call", "pointers")

    def __init__(self, call: launch.CallPlan, pointers: list):
        self.call, self.pointers = call, tuple(pointers)


def _call_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits, scale, causal, out, lse,
              workspace, options) -> tuple:
    """``(key, {pointer field: pointer})``; raises for anything the key does not cover."""
    from .api import _options_key, _score_options_key

    if not set(options) <= set(OPTIONS):
        raise KeyError("not cached")
    keys, pointers = [], {}
    for field, x in (("q", q), ("k", k_cache), ("v", v_cache), ("o", out), ("lse", lse),
                     ("cache_seqlens", cache_seqlens), ("k_new", k_new), ("v_new", v_new),
                     ("block_table", block_table)):
        kx, px = array_key(x)
        keys.append(kx)
        pointers[field] = px
    if keys[5] is None or not _on_gpu(cache_seqlens) or (block_table is not None and not _on_gpu(block_table)):
        raise KeyError("lengths and tables given as host data are checked and copied every call")
    option_key, option_pointers = _score_options_key(options) if options else (None, [0] * 5)
    pointers["alibi_slopes"] = option_pointers[4]
    workspace_key = None
    if workspace is not None:  # the split-KV buffers, patched like the arrays (other names: validated every call)
        if type(workspace) is not dict or not set(workspace) <= set(_WORKSPACE_FIELDS):
            raise KeyError("not cached")
        workspace_key = []
        for name in sorted(workspace):
            kx, pointers[name] = array_key(workspace[name])
            workspace_key.append((name, kx))
        workspace_key = tuple(workspace_key)
    key = (*keys, option_key, _options_key(scale, causal), type(num_splits), num_splits, workspace_key)
    return key, pointers


def _hit(cached: _Cached, given: dict, out, lse, stream, carve: bool = True) -> tuple:
    """A cached call: patch the given arrays' pointers in, allocate the outputs not given and (``carve``: no
    workspace given) the split-KV buffers, launch."""
    from .api import _allocate, _stream_ptr

    call = cached.call
    pointers = list(cached.pointers)
    for field, ptr in given.items():
        pointers[_FIELD_INDEX[field]] = ptr
    carve = carve and call.scratch_bytes
    specs = [spec for spec, buffer in zip(call.outputs, (out, lse)) if buffer is None]
    if carve:
        specs.append(((call.scratch_bytes,), "uint8"))
    made = _allocate(specs, stream)
    if out is None:
        out = made.pop(0)
        pointers[_FIELD_INDEX["o"]] = out.data.ptr
    if lse is None:
        lse = made.pop(0)
        pointers[_FIELD_INDEX["lse"]] = lse.data.ptr
    if carve:
        for (field, _), offset in zip(call.scratch, call.scratch_offsets):
            pointers[_FIELD_INDEX[field]] = made[0].data.ptr + offset
    call.launch(pointers, _stream_ptr(stream))
    del made  # stream-ordered pool: the scratch is reused only behind these launches
    return out, lse


def _plan(dtype: str, batch: int, seqlen_q: int, num_heads: int, num_heads_k: int, head_dim: int, head_dim_v: int,
          score_mod: int, capacity: int, append: bool, num_splits, device: int, paged: bool) -> plans.KvPlan:
    bucket = head_dim_bucket(max(head_dim, head_dim_v))
    plan = plans.plan(dtype, batch, seqlen_q, num_heads, num_heads_k, bucket, head_dim_v, score_mod, capacity, append,
                      num_splits, int(launch.compute_capability(device)), launch.multiprocessor_count(device), paged)
    if seqlen_q == 0:  # nothing to attend from: only the append runs
        plan = plans.KvPlan(plan.launches[:1] if append else (), 1, None, None)
    return plan


def _launch(call: KvCall, scale: float, out_d: TensorDesc, lse_d: TensorDesc, workspace, stream) -> "_Cached":
    """Launch the call's kernels; returns what a later call with the same key needs (:func:`_hit`)."""
    from .api import _np_dtype, _scratch

    shape, device = call.shape, call.device
    plan = _plan(shape.dtype, shape.batch, shape.seqlen_q, shape.num_heads, shape.num_heads_k, shape.head_dim,
                 shape.head_dim_v, shape.score_mod, call.capacity, call.append, call.num_splits, device, call.paged)
    fields = dict(call.fields, num_splits=plan.num_splits, **call.window_fields())
    pointers, owners = _scratch(plan, workspace, device, "cuflash.kvcache_workspace")
    fields.update(pointers)
    params = launch.make_params(shape, scale, call.q, call.k, call.v, out_d, lse_d, fields=tuple(fields.items()))
    pointers = [int(params[0][field]) for field in launch.POINTER_FIELDS]
    outputs = ((out_d.shape, _np_dtype(shape.dtype)), (lse_d.shape, _np_dtype("float32")))
    call_plan = launch.CallPlan(plan, device, params, len(pointers), outputs)
    call_plan.launch(pointers, stream.ptr)
    del owners  # CuPy's pool is stream-ordered: reused only by work behind these launches
    return _Cached(call_plan, pointers)


def _meta(q, k_cache, v_cache, block_table, options) -> tuple:
    """(dtype, batch, Sq, H, Hkv, D, Dv, score mod, capacity) from ``.shape`` / ``.dtype`` alone (``scale`` and
    ``causal`` do not change the plan)."""
    options = {name: value for name, value in options.items() if name not in ("scale", "causal")}
    _reject_options(options)
    dtype = _dtype_of(q)
    if dtype not in plans.DTYPES:
        raise TypeError(f"attention_with_kvcache takes float16, bfloat16 or float32, got q of dtype {dtype}")
    batch, seqlen_q, num_heads, head_dim = (int(n) for n in q.shape)
    capacity = int(k_cache.shape[1]) * (1 if block_table is None else int(block_table.shape[1]))
    score_mod = 1 if options.get("softcap") or options.get("alibi_slopes") is not None else 0
    return (dtype, batch, seqlen_q, num_heads, int(k_cache.shape[2]), head_dim, int(v_cache.shape[-1]), score_mod,
            capacity)


def kvcache_workspace(q, k_cache, v_cache, *, block_table=None, num_splits=None, **options) -> dict:
    """Shapes of the float32 split-KV buffers :func:`attention_with_kvcache` needs for these shapes, by name
    (``o_accum``, ``lse_accum``; empty when the call does not split), for frameworks that allocate them and pass
    them as ``workspace=``. Needs ``.shape`` / ``.dtype`` only; the current device's SM count enters the
    split heuristic."""
    meta = _meta(q, k_cache, v_cache, block_table, options)
    plan = _plan(*meta[:8], meta[8], False, num_splits, launch.current_device(), block_table is not None)
    return {} if plan.o_accum is None else {"o_accum": plan.o_accum, "lse_accum": plan.lse_accum}


def prepare_kvcache(q, k_cache, v_cache, *, block_table=None, k_new=None, num_splits=None, **options) -> None:
    """Compile and load the kernels :func:`attention_with_kvcache` launches for these shapes (e.g. before a
    CUDA-graph capture). Needs ``.shape`` / ``.dtype`` only."""
    from . import build

    meta = _meta(q, k_cache, v_cache, block_table, options)
    device = launch.current_device()
    plan = _plan(*meta[:8], meta[8], k_new is not None, num_splits, device, block_table is not None)
    cc = launch.compute_capability(device)
    for item in plan.launches:
        build.get_kernel(item.variant, device, cc, item.smem_bytes)


def _dtype_of(x) -> str:
    from .arrays import dtype_name

    return dtype_name(x.dtype)
