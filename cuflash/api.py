"""The public entry points: validate at the boundary, allocate what the caller did not, launch.

Host time. The first call with a given key (every array's type, shape, strides, dtype, device and base
pointer alignment, plus the options) validates everything, plans and loads its kernels, and stores a
:class:`~cuflash.launch.CallPlan` under that key; a later call with the same key only reads the arrays'
pointers, allocates the outputs it must and launches (the ``_hit_*`` functions). A key holds everything
a check reads, so a cache hit can never skip a check whose outcome could differ.
"""
from __future__ import annotations

import contextlib

from . import launch, validation
from .arrays import TensorDesc, array_key, describe, dtype_name, require_cuda, resolve_stream
from . import dbias as dbias_sums
from .kernels import ProblemShape

#: At most this many call plans per entry point; past it the cache starts over (a workload with that
#: many distinct shapes is paying for planning anyway).
MAX_CACHED_PLANS = 4096
_forward_plans: dict = {}
_backward_plans: dict = {}
_SCRATCH_FIELDS = launch.SCRATCH_FIELDS  # dq_accum, dk_accum, dv_accum, softmax_d, lse_log2, kv_blocks, q_blocks
#: The score options' arrays, in POINTER_FIELDS order: (option, index in its pair or None).
_OPTION_ARRAYS = (("segment_ids", 0), ("segment_ids", 1), ("block_ids", 0), ("block_ids", 1), ("alibi_slopes", None))


def _enter_device(stack: contextlib.ExitStack, device_id: int, stream, given_stream):
    """Make ``device_id`` current for allocations and launches (a no-op when it already is); with no
    ``stream=`` given, the work goes on that device's current stream. Returns ``(stream, switched)``."""
    import cupy

    if launch.current_device() != device_id:
        stack.enter_context(cupy.cuda.Device(device_id))
        if given_stream is None:
            stream = cupy.cuda.get_current_stream()
            stack.enter_context(stream)
        return stream, True
    return stream, False


def _enter_call(stack: contextlib.ExitStack, q, k, v, *, causal, scale, stream, options, arrays=(), packed=None):
    """The start every entry point shares: refuse planned options and non-GPU arrays (before touching
    CUDA), make the stream current, describe and validate q/k/v and the score options, switch to their
    device. ``packed``: a :class:`cuflash.varlen.PackedSequences` for the varlen entry points (packed
    q/k/v and their offsets), None for the batched layout. Returns ``(qd, kd, vd, shape, scale, opts,
    stream, switched)``."""
    validation.reject_planned(options)
    if packed is not None:
        packed.reject_unsupported(options)
    for name, x in (("q", q), ("k", k), ("v", v)) + tuple(arrays):
        require_cuda(x, name)
    launch.current_device()  # a clear error where there is no usable GPU
    given_stream, stream = stream, resolve_stream(stream)
    stack.enter_context(stream)
    qd, kd, vd = describe(q, "q"), describe(k, "k"), describe(v, "v")
    if packed is None:
        shape = validation.check_qkv(qd, kd, vd, causal=causal)
    else:
        shape = packed.check(qd, kd, vd, causal=causal)
    scale = validation.check_scale(scale, shape.head_dim)
    shape, opts = validation.check_score_options(shape, options, describe, qd.device)
    stream, switched = _enter_device(stack, qd.device, stream, given_stream)
    return qd, kd, vd, shape, scale, opts, stream, switched


def _buffer(given, name: str, shape: tuple, dtype: str, device: int, *, rows_only=False, fill=None):
    """Describe a caller-provided buffer after checking it, or allocate one."""
    import cupy

    if given is None:
        arr = cupy.empty(shape, dtype=_np_dtype(dtype))
        if fill is not None:
            arr.fill(fill)
        return describe(arr, name)
    t = describe(given, name)
    validation.check_buffer(t, shape, dtype, device, rows_contiguous_only=rows_only)
    if fill is not None:
        t.array.fill(fill)
    return t


def _np_dtype(name: str):
    import numpy as np

    from .arrays import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _has_work(shape: ProblemShape) -> bool:
    return shape.batch * shape.num_heads * shape.seqlen_q > 0


def _options_key(scale, causal, deterministic=False) -> tuple:
    """The options' part of a key: ``scale`` by type and value (``check_scale`` is a function of both),
    ``causal`` and ``deterministic`` as the bools the slow path makes of them."""
    return type(scale), scale, bool(causal), bool(deterministic)


def _score_options_key(options: dict) -> tuple:
    """``(key, pointers)`` of the score options: ``key`` holds everything their validation reads (types
    and values of window / softcap, each array's key, each pair's type and length), ``pointers`` the five
    option-array pointers in POINTER_FIELDS order (0 where absent), then, when a bias or a bool mask is
    given, a pair (bias, mask) of the fields after the lists (the callers fill in dbias and dbias_accum).
    Raises (anything) for options the keys do not cover (planned or unknown ones, unreadable arrays): the
    validating path then decides."""
    if not options:
        return None, None
    if not set(options) <= set(validation.SCORE_OPTIONS):
        raise KeyError("not a cached score option")
    if options.get("dropout_p"):  # a new seed every step: each dropout call is validated (not cached)
        raise KeyError("dropout is not cached")
    window = options.get("window")
    window_key = None if window is None else (type(window), len(window), *((type(w), w) for w in window))
    softcap = options.get("softcap")
    keys, pointers = [window_key, (type(softcap), softcap)], []
    for name, index in _OPTION_ARRAYS:
        x = options.get(name)
        if x is not None and index is not None:
            if index == 0:
                keys.append((type(x), len(x)))
            x = x[index]
        kx, px = array_key(x)
        keys.append(kx)
        pointers.append(px)
    bias, mask = options.get("bias"), options.get("mask")
    if bias is not None or mask is not None:
        (kb, pb), (km, pm) = array_key(bias), array_key(mask)
        keys += [kb, km]
        pointers.append((pb, pm))  # the tail, after the lists (_hit_forward / _hit_backward)
    return tuple(keys), pointers


def _carve(plan: launch.CallPlan, stream) -> tuple:
    """One allocation holding every scratch buffer of ``plan``: ``(owner, {field: pointer})``."""
    if not plan.scratch_bytes:
        return None, {}
    (owner,) = _allocate([((plan.scratch_bytes,), "uint8")], stream)
    base = owner.data.ptr
    return owner, {field: base + plan.scratch_offsets[i]
                   for field, i in zip(_SCRATCH_FIELDS, plan.scratch_slots) if i is not None}


def _stream_ptr(stream) -> int:
    """The raw handle of ``stream=`` (resolve_stream's rules, without building a stream object)."""
    if type(stream) is int:
        return stream
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return resolve_stream(stream).ptr


def _remember(cache: dict, key, plan: launch.CallPlan) -> None:
    if len(cache) >= MAX_CACHED_PLANS:
        cache.clear()
    cache[key] = plan


def _allocate(specs, stream) -> list:
    """CuPy arrays for the ``(shape, dtype)`` specs, from the pool of the launch stream (CuPy's pool is
    stream-ordered: memory freed after the launch is reused only by work ordered behind it)."""
    import cupy

    with _on_stream(stream):
        return [cupy.empty(shape, dtype) for shape, dtype in specs]


def _on_stream(stream):
    """A context making ``stream=`` CuPy's current stream (nothing to do for None: it already is)."""
    return contextlib.nullcontext() if stream is None else resolve_stream(stream)


# ---------------------------------------------------------------------------------------------------------
# Forward


def attention_forward(q, k, v, *, scale=None, causal=False, deterministic=False, out=None, lse=None,
                      stream=None, **options):
    """Exact attention forward. Returns ``(out, lse)``: CuPy arrays, or the ``out`` / ``lse`` given.

    q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``: any ``__dlpack__`` CUDA arrays
    (float16, bfloat16, float32) whose last dim is contiguous; ``H % Hkv == 0``. ``out`` ``(B, Sq, H, Dv)``
    and ``lse`` ``(B, H, Sq)`` float32 may be given as caller-allocated buffers (written in place).
    ``lse`` is the natural-log sum of exponentials of the scaled scores, ``-inf`` for a row that sees no
    key (whose output is 0). ``deterministic`` is accepted for symmetry: the forward always is.
    """
    try:
        key, pointers, option_pointers = _forward_key(q, k, v, out, lse, scale, causal, options)
        plan = _forward_plans.get(key)
    except Exception:  # an array (or option) the keys cannot read: the validating path names it
        key = plan = None
    if plan is not None and launch.current_device() == plan.device:
        return _hit_forward(plan, pointers, out, lse, stream, option_pointers)
    return _forward(q, k, v, scale, causal, out, lse, stream, options, key)


def _forward_key(q, k, v, out, lse, scale, causal, options) -> tuple:
    """``(key, pointers of q, k, v, out, lse, option pointers)`` of a forward call; raises (anything) for what the
    keys cannot read."""
    (kq, pq), (kk, pk), (kv, pv) = array_key(q), array_key(k), array_key(v)
    (ko, po), (kl, pl) = array_key(out), array_key(lse)
    option_key, option_pointers = _score_options_key(options) if options else (None, None)
    return (kq, kk, kv, ko, kl, _options_key(scale, causal), option_key), [pq, pk, pv, po, pl], option_pointers


def _hit_forward(plan: launch.CallPlan, pointers: list, out, lse, stream, option_pointers=None, packed=None):
    """A cached forward: allocate what the caller did not give, patch the pointers in, launch.
    ``pointers``: q, k, v, out, lse (0 where not given); ``option_pointers``: the score options' arrays
    (None without options), after which the general mask's lists are carved from the pool; ``packed``: the
    packed sequences' offsets (cu_seqlens_q, cu_seqlens_k pointers), after every other field."""
    if out is None and lse is None:
        out, lse = _allocate(plan.outputs, stream)
        pointers[3], pointers[4] = out.data.ptr, lse.data.ptr
    elif out is None:
        (out,) = _allocate(plan.outputs[:1], stream)
        pointers[3] = out.data.ptr
    elif lse is None:
        (lse,) = _allocate(plan.outputs[1:], stream)
        pointers[4] = lse.data.ptr
    owner = None
    if option_pointers is not None or packed is not None:  # packed calls run the general mask: lists even without
        owner, lists = _carve(plan, stream)
        tail = option_pointers[5:] if option_pointers is not None else ()
        pointers += [0] * (launch.PLAIN_POINTERS - 5) + (option_pointers[:5] if option_pointers is not None else [0] * 5)
        pointers += [lists.get("kv_blocks", 0), lists.get("q_blocks", 0)]
        if tail:  # bias, dbias, dbias_accum, mask
            pointers += [tail[0][0], 0, 0, tail[0][1]]
    if packed is not None:
        pointers += [0] * (launch.BIAS_MASK_POINTERS - len(pointers)) + list(packed)
    plan.launch(pointers, _stream_ptr(stream))
    del owner  # the pool is stream-ordered: the lists are reused only by work behind these launches
    return out, lse


def _forward(q, k, v, scale, causal, out, lse, stream, options, key, packed=None):
    """The validating forward; stores a CallPlan under ``key`` (when not None) for the next call.
    ``packed``: see :func:`_enter_call`."""
    with contextlib.ExitStack() as stack:
        qd, kd, vd, shape, scale, opts, stream, switched = _enter_call(
            stack, q, k, v, causal=causal, scale=scale, stream=stream, options=options, packed=packed)
        # No key anywhere (or, packed, no query row in any sequence): every row is out 0, lse -inf.
        no_keys = shape.seqlen_k == 0 or (shape.packed and not _has_work(shape))
        out_d = _buffer(out, "out", validation.out_shape(shape), shape.dtype, qd.device,
                        fill=0 if no_keys else None)
        lse_d = _buffer(lse, "lse", validation.lse_shape(shape), "float32", qd.device, rows_only=True,
                        fill=float("-inf") if no_keys else None)
        if _has_work(shape) and not no_keys:
            outputs = ((out_d.shape, _np_dtype(shape.dtype)), (lse_d.shape, _np_dtype("float32")))
            forward_plan = launch.forward_plan(shape, qd.device)
            # The general mask's block lists (the only forward scratch); `owners` keeps them alive until
            # the launches are enqueued (CuPy's pool is stream-ordered).
            scratch, owners = _scratch(forward_plan, None, qd.device)
            params = launch.make_params(shape, scale, qd, kd, vd, out_d, lse_d, scratch=scratch,
                                        fields=(*forward_plan.fields, *opts.params(shape.causal).items(),
                                                *(packed.fields if packed is not None else ())))
            pointers = (qd.ptr, kd.ptr, vd.ptr, out_d.ptr, lse_d.ptr)
            if options or packed is not None:  # the hit path patches the option arrays and the lists as well
                count = _pointer_count(opts, packed)
                pointers += (0,) * (launch.PLAIN_POINTERS - 5) + tuple(
                    int(params[0][field]) for field in launch.POINTER_FIELDS[launch.PLAIN_POINTERS:count])
            qkv = None if packed is not None else tuple((t.shape, t.strides, t.itemsize) for t in (qd, kd, vd))
            plan = launch.CallPlan(forward_plan, qd.device, params, len(pointers), outputs, bias=opts.bias_layout(),
                                   qkv=qkv)
            plan.launch(pointers, stream.ptr)
            del owners
            if key is not None and not switched:
                _remember(_forward_plans, key, plan)
    return (out_d.array if out is None else out), (lse_d.array if lse is None else lse)


def _pointer_count(opts, packed) -> int:
    """How many pointer fields a cached call patches: through the option arrays and the lists, through the bias
    and the mask where either is given, through the packed sequences' offsets for a varlen call."""
    if packed is not None:
        return launch.PACKED_POINTERS
    return launch.BIAS_MASK_POINTERS if opts.bias is not None or opts.mask is not None else launch.OPTION_POINTERS


def attention(q, k, v, *, scale=None, causal=False, deterministic=False, return_lse=False, out=None,
              lse=None, stream=None, **options):
    """Exact attention ``softmax(scale * q k^T) v`` (see :func:`attention_forward` for the arguments).

    Returns ``out``, or ``(out, lse)`` when ``return_lse=True``. For gradients use the JAX or torch
    adapters (``cuflash.interop``), or :func:`attention_forward` / :func:`attention_backward`.
    """
    out, lse = attention_forward(q, k, v, scale=scale, causal=causal, deterministic=deterministic,
                                 out=out, lse=lse, stream=stream, **options)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------------------
# Backward


def attention_backward(dout, q, k, v, out, lse, *, dlse=None, scale=None, causal=False,
                       deterministic=False, dq=None, dk=None, dv=None, dbias=None, bias_grad=True, workspace=None,
                       stream=None, **options):
    """Gradients of attention. Returns ``(dq, dk, dv)``, each in its input's shape and dtype (CuPy
    arrays, or the ``dq`` / ``dk`` / ``dv`` given), and ``dbias`` fourth (in the bias's own shape and
    dtype, summed over its broadcast dims; or the ``dbias`` buffer given) when ``bias`` is an option.
    ``bias_grad=False``: the bias is a constant (an additive mask, a frozen bias): dbias is neither computed
    nor returned, which saves its stores (or, for a broadcast bias, its float atomics) and lets
    ``deterministic=True`` take any broadcast bias.

    ``out`` and ``lse`` are :func:`attention_forward`'s results for the same inputs and options.
    ``dlse`` ``(B, H, Sq)`` float32 is the gradient flowing into ``lse`` (ring / context-parallel
    attention). ``deterministic=True`` makes dq/dk/dv bit-identical across runs (no float atomics).
    ``workspace``: a dict of caller-allocated contiguous float32 buffers with the shapes
    :func:`backward_workspace` returns (frameworks pass their own memory; default: CuPy's pool).
    """
    try:
        key, pointers, scratch, option_pointers, dbias_ptr = _backward_key(
            dout, q, k, v, out, lse, dlse, dq, dk, dv, workspace, scale, causal, deterministic, options, dbias,
            bias_grad)
        plan = _backward_plans.get(key)
    except Exception:  # an array (or option) the keys cannot read: the validating path names it
        key = plan = None
    if plan is not None and launch.current_device() == plan.device:
        return _hit_backward(plan, pointers, scratch, dq, dk, dv, stream, option_pointers, dbias, dbias_ptr, lse, dlse)
    return _backward(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, dq, dk, dv, workspace,
                     stream, options, key, dbias, bias_grad=bias_grad)


def _backward_key(dout, q, k, v, out, lse, dlse, dq, dk, dv, workspace, scale, causal, deterministic, options,
                  dbias=None, bias_grad=True) -> tuple:
    """``(key, pointers of q, k, v, out, lse, dout, dq, dk, dv, dlse, the workspace's pointers by name or None,
    option pointers, dbias pointer)`` of a backward call; raises (anything) for what the keys cannot read."""
    keys, pointers = [], []
    for x in (q, k, v, out, lse, dout, dq, dk, dv, dlse):
        kx, px = array_key(x)
        keys.append(kx)
        pointers.append(px)
    scratch = None
    if workspace is not None:
        scratch = {}
        for name, buffer in workspace.items():
            kx, scratch[name] = array_key(buffer)
            keys.append((name, kx))
    keys.append(_options_key(scale, causal, deterministic))
    option_key, option_pointers = _score_options_key(options) if options else (None, None)
    dbias_key, dbias_ptr = array_key(dbias)
    key = (workspace is None, *keys, option_key, dbias_key, bool(bias_grad))
    return key, pointers, scratch, option_pointers, dbias_ptr


def _hit_backward(plan: launch.CallPlan, pointers: list, scratch, dq, dk, dv, stream, option_pointers=None,
                  dbias=None, dbias_ptr=0, lse=None, dlse=None, packed=None):
    """A cached backward. ``pointers``: q, k, v, out, lse, dout, dq, dk, dv, dlse (0 where absent);
    ``scratch``: the workspace's pointers by name, or None to carve one CuPy allocation;
    ``option_pointers``: the score options' arrays (None without options); ``packed``: the packed sequences'
    offsets (cu_seqlens_q, cu_seqlens_k pointers). A plan with a bias takes
    ``dbias`` (its pointer ``dbias_ptr``) or allocates one like the validating call did: a full-shape bias's
    dK/dV kernels store each element once (zeroed first where a mask skips tiles); a broadcast one's sum
    into a fresh zeroed fp32 accumulator (or an fp32 dbias itself), converted into dbias after the launch."""
    grads = [dq, dk, dv] + ([dbias] if plan.dbias is not None else [])
    missing = [i for i, g in enumerate(grads) if g is None]
    owner = None
    if missing or (scratch is None and plan.scratch_bytes):
        specs = [(plan.outputs + (plan.dbias[:2] if plan.dbias else None,))[i] for i in missing]
        if scratch is None and plan.scratch_bytes:
            specs.append(((plan.scratch_bytes,), "uint8"))
        made = _allocate(specs, stream)
        for i, array in zip(missing, made):
            grads[i] = array
            if i < 3:
                pointers[6 + i] = array.data.ptr
            else:
                dbias_ptr = array.data.ptr
        if scratch is None and plan.scratch_bytes:
            owner = made[-1]  # alive until the launches are enqueued (the pool is stream-ordered)
    if scratch is None:
        base = 0 if owner is None else owner.data.ptr
        scratch_pointers = [base + plan.scratch_offsets[i] if i is not None else 0 for i in plan.scratch_slots]
    else:
        scratch_pointers = [scratch[field] if i is not None else 0 for field, i in zip(_SCRATCH_FIELDS,
                                                                                      plan.scratch_slots)]
    sums = dbias_d = None
    accum_ptr = 0
    if plan.dbias is not None and (plan.dbias[2] or plan.dbias_sums is not None):
        dbias_d = describe(grads[3], "dbias")  # a CuPy view of any caller's array (torch, JAX, CuPy)
        with _on_stream(stream):
            if plan.dbias_sums is None:  # tiles a mask skips are never visited: their dbias is 0
                dbias_d.array.fill(0)
            else:  # a broadcast bias: its fp32 sums (dbias.Sums)
                sums = plan.dbias_sums.buffer(dbias_d)
                accum_ptr, dbias_ptr = (0 if sums is None else sums.data.ptr), 0
    block = (*pointers[:9], *scratch_pointers[:5], pointers[9])
    if option_pointers is not None:
        block += (*option_pointers[:5], *scratch_pointers[5:])
        if len(option_pointers) > 5:  # bias, dbias, dbias_accum, bool mask
            block += (option_pointers[5][0], dbias_ptr, accum_ptr, option_pointers[5][1])
    elif packed is not None:  # the general mask's lists, which packed calls run without options too
        block += (0,) * 5 + tuple(scratch_pointers[5:])
    if packed is not None:
        block += (0,) * (launch.BIAS_MASK_POINTERS - len(block)) + tuple(packed)
    stream_ptr = _stream_ptr(stream)
    plan.launch(block, stream_ptr)
    del owner
    if plan.dbias_sums is not None:
        with _on_stream(stream):
            plan.dbias_sums.finish(sums, dbias_d, plan.device, stream_ptr, lse, dlse)
    return tuple(grads)


def _backward(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, dq, dk, dv, workspace, stream,
              options, key, dbias=None, packed=None, bias_grad=True):
    """The validating backward; stores a CallPlan under ``key`` (when not None) for the next call.
    ``packed``: see :func:`_enter_call`."""
    with contextlib.ExitStack() as stack:
        qd, kd, vd, shape, scale, opts, stream, switched = _enter_call(
            stack, q, k, v, causal=causal, scale=scale, stream=stream, options=options,
            arrays=(("dout", dout), ("out", out), ("lse", lse)), packed=packed)
        dev, dtype = qd.device, shape.dtype
        o_shape, l_shape = validation.out_shape(shape), validation.lse_shape(shape)
        out_d, dout_d = describe(out, "out"), describe(dout, "dout")
        validation.check_buffer(out_d, o_shape, dtype, dev)
        validation.check_buffer(dout_d, o_shape, dtype, dev)
        lse_d = describe(lse, "lse")
        validation.check_buffer(lse_d, l_shape, "float32", dev, rows_contiguous_only=True)
        dlse_d = None
        if dlse is not None:
            dlse_d = describe(dlse, "dlse")
            validation.check_buffer(dlse_d, l_shape, "float32", dev, rows_contiguous_only=True)
        no_work = not _has_work(shape) or shape.seqlen_k == 0
        zero = 0 if no_work else None
        dq_d = _buffer(dq, "dq", qd.shape, dtype, dev, fill=zero)
        dk_d = _buffer(dk, "dk", kd.shape, dtype, dev, fill=zero)
        dv_d = _buffer(dv, "dv", vd.shape, dtype, dev, fill=zero)
        if dbias is not None and opts.bias is None:
            raise ValueError("dbias= was given but bias was not: pass the forward's bias")
        if dbias is not None and not bias_grad:
            raise ValueError("dbias= was given with bias_grad=False: pass one or the other")
        with_dbias = opts.bias is not None and bool(bias_grad)
        plan = None if no_work else launch.backward_plan(shape, dev, bool(deterministic))
        bias_fields, dbias_d, sums, sums_buffer = (
            _dbias_buffers(opts, shape, dbias, dev, deterministic, no_work, plan) if with_dbias
            else ((), None, None, None))
        if not no_work:
            # `owners` keeps freshly allocated scratch alive until the launches are enqueued; after
            # that CuPy's stream-ordered pool may reuse it only for work ordered behind them.
            scratch, owners = _scratch(plan, workspace, dev)
            params = launch.make_params(shape, scale, qd, kd, vd, out_d, lse_d, dout=dout_d, dq=dq_d,
                                        dk=dk_d, dv=dv_d, dlse=dlse_d, scratch=scratch,
                                        fields=(*plan.fields, *opts.params(shape.causal).items(), *bias_fields,
                                                *(packed.fields if packed is not None else ())))
            np_dtype = _np_dtype(dtype)
            outputs = ((qd.shape, np_dtype), (kd.shape, np_dtype), (vd.shape, np_dtype))
            pointers = (qd.ptr, kd.ptr, vd.ptr, out_d.ptr, lse_d.ptr, dout_d.ptr, dq_d.ptr, dk_d.ptr, dv_d.ptr,
                        *(scratch.get(field, 0) for field in _SCRATCH_FIELDS[:5]), 0 if dlse_d is None else dlse_d.ptr)
            if options or packed is not None:  # the hit path patches the option arrays and the lists as well
                count = _pointer_count(opts, packed)
                pointers += tuple(int(params[0][field])
                                  for field in launch.POINTER_FIELDS[launch.PLAIN_POINTERS:count])
            qkv = None if packed is not None else tuple((t.shape, t.strides, t.itemsize)
                                                        for t in (qd, kd, vd, dout_d))
            call = launch.CallPlan(plan, dev, params, len(pointers), outputs, bias=opts.bias_layout(), qkv=qkv)
            call.launch(pointers, stream.ptr)
            del owners
            if sums is not None:  # a broadcast bias: its sums into dbias
                sums.finish(sums_buffer, dbias_d, dev, stream.ptr, lse, dlse)
            if with_dbias:  # what a hit allocates when dbias= is not given, and whether it zeroes it (a full-shape
                # bias's tiles that a mask skips are never visited, as _dbias_buffers does); a broadcast bias's sums
                call.dbias = (tuple(opts.bias.shape), np_dtype, shape.mask_kind != 0 and sums is None)
                call.dbias_sums = sums
            if key is not None and not switched:
                _remember(_backward_plans, key, call)
    grads = tuple(d.array if given is None else given for d, given in ((dq_d, dq), (dk_d, dk), (dv_d, dv)))
    if with_dbias:
        grads += (dbias_d.array if dbias is None else dbias,)
    return grads


def _dbias_buffers(opts, shape: ProblemShape, dbias, device: int, deterministic: bool, no_work: bool,
                   plan=None) -> tuple:
    """``(params fields, dbias description, dbias.Sums or None, its fp32 buffer or None)`` for a backward with a
    bias. A bias with an element per (b, h, i, j) gets its gradient stored by the dK/dV kernels, each element
    once (zero-filled first where a mask skips tiles). A broadcast bias's gradient is summed over its broadcast
    dims (never through a dense (B, H, Sq, Sk) temporary) as :func:`cuflash.dbias.plan_sums` says."""
    import cupy

    if opts.bias is None:
        return (), None, None, None
    bias = opts.bias
    full = opts.bias_is_full(shape)
    if dbias is None:
        dbias_d = describe(cupy.empty(bias.shape, dtype=_np_dtype(shape.dtype)), "dbias")
    else:
        dbias_d = describe(dbias, "dbias")
        if tuple(dbias_d.shape) != tuple(bias.shape):
            raise ValueError(f"dbias must have bias's shape {tuple(bias.shape)}, got {tuple(dbias_d.shape)}")
        if dbias_d.dtype != shape.dtype:
            raise TypeError(f"dbias must have dtype {shape.dtype}, got {dbias_d.dtype}")
        if dbias_d.device != device:
            raise ValueError(f"dbias is on CUDA device {dbias_d.device} but q is on device {device}")
        if any(st < 0 for st in dbias_d.strides) or dbias_d.ptr % dbias_d.itemsize:
            raise ValueError(f"dbias must have non-negative strides and an element-aligned base pointer")
    if no_work:
        dbias_d.array.fill(0)
        return (), dbias_d, None, None
    if full:
        if shape.mask_kind != 0:  # tiles the mask skips are never visited: their dbias is 0
            dbias_d.array.fill(0)
        st = dbias_d.strides
        fields = dict(dbias=dbias_d.ptr, dbias_batch_stride=st[0], dbias_head_stride=st[1], dbias_row_stride=st[2],
                      dbias_col_stride=st[3])
        return tuple(fields.items()), dbias_d, None, None
    sums = dbias_sums.plan_sums(opts, shape, deterministic, plan, dbias_d)
    buffer = sums.buffer(dbias_d)
    return tuple(sums.fields(buffer).items()), dbias_d, sums, buffer


def _scratch(plan, workspace, device: int, shapes_from: str = "cuflash.backward_workspace") -> tuple:
    """Pointers of the plan's fp32 scratch buffers, from ``workspace`` or freshly allocated, and the
    arrays that own them (which the caller must keep alive until its launches are enqueued).
    ``shapes_from``: the function that tells a caller the workspace's shapes (for the error message)."""
    import cupy

    pointers, owners = {}, []
    for field, shape in plan.scratch:
        if workspace is None:
            owners.append(cupy.empty(shape, dtype=cupy.float32))  # 4-byte elements (int32 for the lists)
            pointers[field] = owners[-1].data.ptr
            continue
        if field not in workspace:
            raise ValueError(f"workspace lacks the buffer {field!r} (see {shapes_from})")
        t = describe(workspace[field], f"workspace[{field!r}]")
        validation.check_buffer(t, shape, "float32", device, rows_contiguous_only=True)
        contiguous = all(s == e for s, e in zip(t.strides, _contiguous_strides(shape)))
        if not contiguous:
            raise ValueError(f"workspace[{field!r}] must be contiguous, got strides {t.strides}")
        validation.check_aligned_base(t)  # the dK/dV kernels add dq_accum rows by 16-byte bulk copies
        pointers[field] = t.ptr
        owners.append(t.array)
    return pointers, owners


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------------------
# Metadata-only entry points (shapes and dtypes: tracers, fake tensors, ...)

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "uint32": 4, "int64": 8,
             "uint64": 8, "bool": 1, "int8": 1, "uint8": 1}


def _meta_desc(x, name: str) -> TensorDesc:
    """A description of anything with ``.shape`` and ``.dtype``, laid out as a fresh contiguous array
    (so that only the checks metadata can answer may fail)."""
    shape = tuple(int(n) for n in x.shape)
    dtype = dtype_name(x.dtype)
    return TensorDesc(name, shape, _contiguous_strides(shape), dtype, _ITEMSIZE.get(dtype, 1), 0, 0)


def _shape_from_meta(q, k, v, causal: bool, options: dict) -> ProblemShape:
    """The problem shape of metadata-only q/k/v (and option arrays), through the same checks as a real
    call."""
    shape = validation.check_qkv(_meta_desc(q, "q"), _meta_desc(k, "k"), _meta_desc(v, "v"), causal=causal)
    return validation.check_score_options(shape, options, _meta_desc, 0)[0]


def backward_workspace(q, k, v, *, causal=False, deterministic=False, scale=None, **options) -> dict:
    """Shapes of the float32 scratch buffers :func:`attention_backward` needs, by name.

    ``q``/``k``/``v`` may be anything with ``.shape`` and ``.dtype``; the current device's arch is used.
    ``scale`` does not change the plan and is accepted so callers can pass one option set everywhere.
    """
    validation.reject_planned(options)
    shape = _shape_from_meta(q, k, v, causal, options)
    if not _has_work(shape) or shape.seqlen_k == 0:
        return {}
    return launch.backward_plan(shape, launch.current_device(), bool(deterministic)).scratch_dict()


def prepare(q, k, v, *, causal=False, deterministic=False, backward=True, scale=None, **options) -> None:
    """Compile and load every kernel a call with these shapes launches (e.g. before a CUDA-graph
    capture, where compiling is not allowed). ``q``/``k``/``v`` need only ``.shape`` and ``.dtype``."""
    validation.reject_planned(options)
    load_kernels(_shape_from_meta(q, k, v, causal, options), backward, deterministic)


def load_kernels(shape: ProblemShape, backward: bool, deterministic: bool) -> None:
    """Compile and load every kernel of the forward (and backward) plan of ``shape`` on the current device."""
    from . import build

    device = launch.current_device()
    plans = [launch.forward_plan(shape, device)]
    if backward:
        plans.append(launch.backward_plan(shape, device, bool(deterministic)))
    cc = launch.compute_capability(device)
    for plan in plans:
        for item in plan.launches:
            build.get_kernel(item.variant, device, cc, item.smem_bytes)
