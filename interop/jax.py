"""cuflash attention as a differentiable JAX op.

    import jax, jax.numpy as jnp
    import cuflash.interop.jax as cfj

    # q (batch, seq_q, heads, head_dim), k / v (batch, seq_k, kv_heads, head_dim): bf16, fp16 or fp32 on a GPU
    out = cfj.attention(q, k, v, causal=True)

    @jax.jit
    def loss_and_grads(q, k, v):
        loss = lambda q, k, v: cfj.attention(q, k, v, causal=True).astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

How it runs. ``attention`` is a ``jax.custom_vjp`` whose forward and backward are
``jax.experimental.buffer_callback`` calls: inside ``jax.jit`` XLA allocates every output (out, lse, dq, dk,
dv) and the backward's scratch (declared as extra outputs of the backward callback, shapes from
``cuflash.backward_workspace``), then calls back into Python with its device buffers and its CUDA stream,
and cuflash launches its kernels on that stream into those buffers: no host round trip, no copy, no CuPy
allocation. Kernels are compiled while JAX traces (``cuflash.prepare``), so shape and option errors surface
at trace time and a compiled step only launches.

Options (``scale``, ``causal``, ``deterministic`` ... see ``cuflash.attention``) are static: a new value
traces a new function, like a ``static_argnames`` of ``jax.jit``. Options whose values are arrays (``bias``,
``mask``, ``segment_ids`` ...) are traced operands of the callbacks; ``bias`` gets its gradient from the
core's ``dbias`` (``_GRADIENT_NAMES``) where it is differentiated, the others get none. A bias that is not
(an additive mask, a constant or ``stop_gradient``-ed bias) costs the backward no dbias work: the backward
then calls the core with ``bias_grad=False``.

Dropout (``dropout_p``, ``seed``): an int seed is static (a new value traces again); for a seed that changes
every step pass it as an array, e.g. ``jax.random.key_data(key)`` (two uint32), a traced operand the kernels
read on the device.

``return_lse=True`` also returns ``lse (batch, heads, seq_q)`` float32, and a cotangent flowing into it
reaches the backward as ``dlse`` (what ring / context-parallel attention needs to merge partial results).

``jax.vmap`` over leading axes folds the mapped axis into the batch (one launch, not a loop), the array
options with a batch dim included: ``segment_ids`` / ``block_ids`` ``(batch, seq)`` and ``alibi_slopes``
``(heads,)`` or ``(batch, heads)`` fold like q (an unmapped ``(heads,)`` slope array stays shared; a mapped
one gives each element its own slopes). With ``bias`` or ``mask`` it maps one element at a time, since
their broadcastable batch dim could not follow the fold.

Data-parallel over devices with ``shard_map`` (each device runs cuflash on its own batch shard):

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    batch_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    q, k, v = jax.device_put((q, k, v), batch_split)
    out = jax.jit(cfj.attention_sharded(mesh, "data", causal=True))(q, k, v)   # out split the same way

``attention`` itself also works inside a ``shard_map`` of your own (its results carry the inputs'
varying-axes type, so ``check_vma`` holds).

Packed variable-length sequences (``cuflash.varlen_attention``), differentiable the same way:

    out = cfj.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

with q ``(total_q, heads, head_dim)``, k / v ``(total_k, kv_heads, head_dim)``, the offsets int32
``(batch + 1,)`` arrays (traced operands) and the longest lengths static ints (they fix the grid).

KV-cache decoding (``cuflash.attention_with_kvcache``), functional: the updated caches come back as results,
aliased to the cache arguments (XLA writes them in place when the caller donates them, e.g.
``jax.jit(step, donate_argnums=(1, 2))``; otherwise it copies the caches first):

    out, k_cache, v_cache = cfj.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                       causal=True)
"""
from __future__ import annotations

import functools
from typing import Any

import cupy
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.experimental.buffer_callback import buffer_callback

import cuflash
from cuflash.interop import _cupy_stream

__all__ = ["attention", "attention_sharded", "attention_with_kvcache", "varlen_attention"]

# Array options with a gradient, and the name of the core's backward output (and keyword) that holds it.
_GRADIENT_NAMES = {"bias": "dbias"}
# Array options whose batch dim follows a vmapped axis folded into the batch (see _fold_arrays); none has a
# gradient. Any other array option (bias, mask) makes vmap map one element at a time.
_FOLDABLE = frozenset({"alibi_slopes", "segment_ids", "block_ids"})

_DLPACK_CUDA = 2  # DLPack's kDLCUDA device type


def attention(q, k, v, *, return_lse: bool = False, **options):
    """Exact attention ``softmax(scale * q @ k^T) @ v`` with cuflash's kernels, differentiable in JAX.

    Args:
      q: ``(batch, seq_q, heads, head_dim)``; k: ``(batch, seq_k, kv_heads, head_dim)``;
        v: ``(batch, seq_k, kv_heads, head_dim_v)``; one dtype among bfloat16, float16, float32;
        ``heads % kv_heads == 0`` (grouped-query attention).
      return_lse: also return ``lse (batch, heads, seq_q)`` float32, differentiable.
      **options: as for ``cuflash.attention`` (``scale``, ``causal``, ``deterministic`` ...). Values that are
        not arrays are static (hashable): ``window=(left, right)`` (ints or None), ``softcap``. Array values
        are traced operands: ``alibi_slopes`` ``(heads,)`` or ``(batch, heads)`` float32,
        ``segment_ids`` / ``block_ids`` pairs ``(q_ids (batch, seq_q), k_ids (batch, seq_k))`` int32; they
        get no gradient (a zero cotangent).

    Returns:
      ``out (batch, seq_q, heads, head_dim_v)`` in q's dtype, or ``(out, lse)``.
    """
    static, arrays = _split_options(options)
    return _attention_fn(static, bool(return_lse))(q, k, v, arrays)


def attention_sharded(mesh, axis_name: str = "data", *, return_lse: bool = False, **options):
    """``attention`` data-parallel over ``mesh``: batch-sharded q, k, v; each device runs its shard.

    Returns a function ``(q, k, v) -> out`` (or ``(out, lse)``) built with ``shard_map``: q, k, v come, and
    the results go, split along their batch dim over the mesh axis ``axis_name``, e.g. placed with
    ``jax.device_put(x, NamedSharding(mesh, PartitionSpec(axis_name)))``; the batch must divide by the axis
    size. Jit it, or call it inside a jitted step. Options must be static here (no array options).
    """
    static, arrays = _split_options(options)
    if arrays:
        raise TypeError(
            f"attention_sharded takes static options only, got array options {sorted(arrays)}; "
            "call attention inside your own shard_map with the arrays' partition specs"
        )
    spec = jax.sharding.PartitionSpec(axis_name)  # the batch dim leads q, k, v, out and lse alike
    per_shard = functools.partial(attention, return_lse=return_lse, **options)
    return _shard_map(per_shard, mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec) if return_lse else spec)


def _shard_map(f, mesh, in_specs, out_specs):
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is not None:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs)


# ---------------------------------------------------------------------------------------------------------
# Options: static ones key the caches below; array ones are operands.


def _split_options(options: dict) -> tuple[tuple, dict]:
    static, arrays = [], {}
    for name, value in options.items():
        if any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(value)):
            arrays[name] = value
        else:
            static.append((name, _hashable(name, value)))
    return tuple(sorted(static)), arrays


def _hashable(name: str, value: Any):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(name, item) for item in value)
    if isinstance(value, np.generic):
        return value.item()
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"option {name}={value!r} must be an array or a hashable constant (it is static under jit)"
        ) from None
    return value


# ---------------------------------------------------------------------------------------------------------
# The differentiable function: one per (static options, return_lse), built once so that jit caches hold.


@functools.lru_cache(maxsize=None)
def _attention_fn(static: tuple, return_lse: bool):
    forward = _forward_op(static)

    @jax.custom_vjp
    def attention_vjp(q, k, v, arrays):
        out, lse = forward(q, k, v, arrays)
        return (out, lse) if return_lse else out

    def attention_fwd(q, k, v, arrays):
        # symbolic_zeros=True hands primals wrapped in CustomVJPPrimal, which say whether they are differentiated.
        wanted = {name: None for name in _GRADIENT_NAMES if name in arrays and arrays[name].perturbed}
        q, k, v, arrays = jax.tree.map(
            lambda p: p.value, (q, k, v, arrays), is_leaf=lambda x: isinstance(x, CustomVJPPrimal)
        )
        out, lse = forward(q, k, v, arrays)
        # `wanted` holds no arrays: its keys (the tree structure) carry which gradients the backward makes.
        return ((out, lse) if return_lse else out), (q, k, v, out, lse, arrays, wanted)

    def attention_bwd(residuals, cotangent):
        q, k, v, out, lse, arrays, wanted = residuals
        backward = _backward_op(static, tuple(sorted(wanted)))
        dout, dlse = cotangent if return_lse else (cotangent, None)
        if isinstance(dout, SymbolicZero):  # only lse is used downstream
            dout = jnp.zeros(dout.shape, dout.dtype)
        if isinstance(dlse, SymbolicZero):  # lse returned but unused: the plain backward, no dlse term
            dlse = None
        grads = backward(dout, q, k, v, out, lse, dlse, arrays)
        d_arrays = {name: grads[_GRADIENT_NAMES[name]] if name in wanted else None for name in arrays}
        return grads["dq"], grads["dk"], grads["dv"], d_arrays

    attention_vjp.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    # Jitted so that an eager call is one cached executable; under an outer jit it inlines.
    return jax.jit(attention_vjp)


# ---------------------------------------------------------------------------------------------------------
# Packed variable-length sequences: the same structure, the offsets as traced operands, the longest lengths
# static. No vmap rule (a mapped axis has no batch to fold into).


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     return_lse: bool = False, **options):
    """Attention over packed variable-length sequences (``cuflash.varlen_attention``), differentiable in JAX.

    Args:
      q: ``(total_q, heads, head_dim)``; k, v: ``(total_k, kv_heads, head_dim[_v])``: the sequences back to
        back; cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` row offsets (traced); max_seqlen_q,
        max_seqlen_k: ints >= every sequence's length (static: they fix the grid).
      return_lse: also return ``lse (heads, total_q)`` float32, differentiable.
      **options: ``scale``, ``causal``, ``window``, ``softcap`` (static), ``alibi_slopes`` ``(heads,)`` or
        ``(batch, heads)`` (an array: traced, no gradient), ``deterministic``.

    Returns:
      ``out (total_q, heads, head_dim_v)`` in q's dtype, or ``(out, lse)``. Rows outside every sequence
      get out 0 (and lse -inf); the offsets get no gradient.
    """
    static, arrays = _split_options(options)
    lengths = (int(max_seqlen_q), int(max_seqlen_k))
    return _varlen_fn(static, lengths, bool(return_lse))(q, k, v, cu_seqlens_q, cu_seqlens_k, arrays)


@functools.lru_cache(maxsize=None)
def _varlen_fn(static: tuple, lengths: tuple, return_lse: bool):
    options = dict(static)
    max_q, max_k = lengths
    forward_cb = functools.partial(_varlen_forward_callback, options, lengths)
    backward_cb = functools.partial(_varlen_backward_callback, options, lengths)

    def forward(q, k, v, cu_q, cu_k, arrays):
        cuflash.varlen_prepare(q, k, v, cu_q, cu_k, max_q, max_k, backward=False, **options, **arrays)
        result = (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v.shape[-1]), q.dtype),
                  jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32))
        args = (q, k, v, cu_q, cu_k, arrays)
        return _vary_like(buffer_callback(forward_cb, result)(*args), args)

    def backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, arrays):
        cuflash.varlen_prepare(q, k, v, cu_q, cu_k, max_q, max_k, backward=True, **options, **arrays)
        grads = {"dq": _like(q), "dk": _like(k), "dv": _like(v)}
        workspace = {
            name: jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
            for name, shape in cuflash.varlen_backward_workspace(q, k, v, cu_q, cu_k, max_q, max_k, **options,
                                                                 **arrays).items()
        }
        args = (dout, q, k, v, out, lse, dlse, cu_q, cu_k, arrays)
        grads, _ = buffer_callback(backward_cb, (grads, workspace))(*args)
        return _vary_like(grads, args)

    @jax.custom_vjp
    def varlen_vjp(q, k, v, cu_q, cu_k, arrays):
        out, lse = forward(q, k, v, cu_q, cu_k, arrays)
        return (out, lse) if return_lse else out

    def varlen_fwd(q, k, v, cu_q, cu_k, arrays):
        q, k, v, cu_q, cu_k, arrays = jax.tree.map(
            lambda p: p.value, (q, k, v, cu_q, cu_k, arrays), is_leaf=lambda x: isinstance(x, CustomVJPPrimal)
        )
        out, lse = forward(q, k, v, cu_q, cu_k, arrays)
        return ((out, lse) if return_lse else out), (q, k, v, out, lse, cu_q, cu_k, arrays)

    def varlen_bwd(residuals, cotangent):
        q, k, v, out, lse, cu_q, cu_k, arrays = residuals
        dout, dlse = cotangent if return_lse else (cotangent, None)
        if isinstance(dout, SymbolicZero):
            dout = jnp.zeros(dout.shape, dout.dtype)
        if isinstance(dlse, SymbolicZero):
            dlse = None
        grads = backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, arrays)
        return grads["dq"], grads["dk"], grads["dv"], None, None, {name: None for name in arrays}

    varlen_vjp.defvjp(varlen_fwd, varlen_bwd, symbolic_zeros=True)
    return jax.jit(varlen_vjp)


# ---------------------------------------------------------------------------------------------------------
# KV cache: one buffer_callback whose results alias the caches (inputs 1 and 2 -> outputs 2 and 3), with the
# split-KV buffers as extra outputs. No gradient (an inference op).


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, block_table=None,
                           num_splits=None, return_lse: bool = False, **options):
    """Attention over a KV cache after appending ``k_new`` / ``v_new`` (``cuflash.attention_with_kvcache``).

    Args:
      q: ``(batch, seq_q, heads, head_dim)``; k_cache / v_cache: dense ``(batch, capacity, kv_heads, head_dim)``
        or paged ``(num_pages, page_size, kv_heads, head_dim)`` with block_table ``(batch, max_pages)`` int32;
        cache_seqlens: int32 ``(batch,)`` (or an int): tokens already cached; k_new / v_new:
        ``(batch, seq_new, kv_heads, head_dim)`` or None. Arrays are traced operands.
      num_splits: split-KV factor, static (None: a heuristic).
      return_lse: also return ``lse (batch, heads, seq_q)`` float32.
      **options: ``scale``, ``causal``, ``window``, ``softcap`` (static), ``alibi_slopes`` (an array).

    Returns:
      ``(out, k_cache, v_cache)`` or ``(out, lse, k_cache, v_cache)``: the caches with k_new / v_new written at
      ``cache_seqlens[b]`` onwards (cache_seqlens itself is not advanced).
    """
    static, arrays = _split_options(options)
    if not isinstance(cache_seqlens, jax.Array) and np.ndim(cache_seqlens) == 0:
        cache_seqlens = jnp.full((q.shape[0],), int(cache_seqlens), dtype=jnp.int32)
    out, lse, k_cache, v_cache = _kvcache_fn(static, num_splits)(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                                 block_table, arrays)
    return (out, lse, k_cache, v_cache) if return_lse else (out, k_cache, v_cache)


@functools.lru_cache(maxsize=None)
def _kvcache_fn(static: tuple, num_splits):
    options = dict(static)
    callback = functools.partial(_kvcache_callback, options, num_splits)

    def kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, arrays):
        cuflash.prepare_kvcache(q, k_cache, v_cache, block_table=block_table, k_new=k_new, num_splits=num_splits,
                                **options, **arrays)
        workspace = {name: jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
                     for name, shape in cuflash.kvcache_workspace(q, k_cache, v_cache, block_table=block_table,
                                                                  num_splits=num_splits, **options,
                                                                  **arrays).items()}
        batch, seq_q, heads, _ = q.shape
        result = (jax.ShapeDtypeStruct((batch, seq_q, heads, v_cache.shape[-1]), q.dtype),
                  jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32), _like(k_cache), _like(v_cache), workspace)
        args = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, arrays)
        # Flat operands: q 0, k_cache 1, v_cache 2; flat results: out 0, lse 1, k_cache 2, v_cache 3.
        out, lse, k_out, v_out, _ = buffer_callback(callback, result, input_output_aliases={1: 2, 2: 3})(*args)
        return _vary_like((out, lse, k_out, v_out), args)

    return jax.jit(kvcache)


def _kvcache_callback(options, num_splits, ctx, outputs, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                      block_table, arrays):
    out, lse, k_out, v_out, workspace = outputs  # k_out / v_out alias k_cache / v_cache: append into them
    _launch(cuflash.attention_with_kvcache, ctx, q, k_out, v_out, cache_seqlens, k_new, v_new,
            block_table=block_table, num_splits=num_splits, out=out, lse=lse, workspace=workspace or None,
            **options, **arrays)


# ---------------------------------------------------------------------------------------------------------
# The two ops: buffer_callback into the core, with a vmap rule that folds the mapped axis into the batch.


@functools.lru_cache(maxsize=None)
def _forward_op(static: tuple):
    options = dict(static)
    callback = functools.partial(_forward_callback, options)  # one object per options: stable jit params

    @custom_vmap
    def forward(q, k, v, arrays):
        _check_rank(q=q, k=k, v=v)
        cuflash.prepare(q, k, v, backward=False, **options, **arrays)
        batch, seq_q, heads, _ = q.shape
        result = (
            jax.ShapeDtypeStruct((batch, seq_q, heads, v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32),
        )
        return _vary_like(buffer_callback(callback, result)(q, k, v, arrays), (q, k, v, arrays))

    @forward.def_vmap
    def forward_vmap(axis_size, in_batched, q, k, v, arrays):
        if not _foldable(arrays):
            return _map_over_axis(forward, in_batched, (q, k, v, arrays)), (True, True)
        q, k, v = (_fold(x, b, axis_size) for x, b in zip((q, k, v), in_batched[:3]))
        arrays = _fold_arrays(arrays, in_batched[3], axis_size, q.shape[0] // axis_size)
        out, lse = forward(q, k, v, arrays)
        return (_unfold(out, axis_size), _unfold(lse, axis_size)), (True, True)

    return forward


@functools.lru_cache(maxsize=None)
def _backward_op(static: tuple, wanted: tuple = tuple(_GRADIENT_NAMES)):
    """The backward of ``static``'s options, making the gradients of the array options named in ``wanted``
    (those given; a bias left out gets ``bias_grad=False``)."""
    options = dict(static)
    callback = functools.partial(_backward_callback, options, wanted)

    @custom_vmap
    def backward(dout, q, k, v, out, lse, dlse, arrays):
        cuflash.prepare(q, k, v, backward=True, **options, **arrays)
        grads = {"dq": _like(q), "dk": _like(k), "dv": _like(v)}
        grads.update({grad: _like(arrays[name]) for name, grad in _GRADIENT_NAMES.items()
                      if name in arrays and name in wanted})
        workspace = {
            name: jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
            for name, shape in cuflash.backward_workspace(q, k, v, **options, **arrays).items()
        }
        args = (dout, q, k, v, out, lse, dlse, arrays)
        grads, _ = buffer_callback(callback, (grads, workspace))(*args)
        return _vary_like(grads, args)

    @backward.def_vmap
    def backward_vmap(axis_size, in_batched, dout, q, k, v, out, lse, dlse, arrays):
        args = (dout, q, k, v, out, lse, dlse, arrays)
        if not _foldable(arrays):
            grads = _map_over_axis(backward, in_batched, args)
        else:
            folded = [None if x is None else _fold(x, b, axis_size) for x, b in zip(args[:-1], in_batched[:-1])]
            arrays = _fold_arrays(arrays, in_batched[-1], axis_size, folded[1].shape[0] // axis_size)
            grads = {name: _unfold(g, axis_size) for name, g in backward(*folded, arrays).items()}
        return grads, {name: True for name in grads}

    return backward


def _vary_like(results, inputs):
    """Inside ``shard_map``, type ``results`` as varying over the manual axes the inputs vary over.

    ``buffer_callback`` types its results as invariant, but they are per-shard values; without this,
    ``shard_map``'s ``check_vma`` (and custom_vjp's check that cotangents match their primals) rejects them.
    """
    axes = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(inputs)))
    if not axes:
        return results

    def vary(result):
        missing = tuple(axes - _varying_axes(result))
        if not missing:
            return result
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(result, missing, to="varying")
        return jax.lax.pvary(result, missing)  # jax < 0.8.2

    return jax.tree.map(vary, results)


def _varying_axes(x) -> frozenset:
    """The shard_map axes ``x`` varies over (empty outside shard_map, or with its checks off)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax 0.6.1 - 0.9


def _like(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _check_rank(**arrays):
    for name, x in arrays.items():
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(x.shape)}")


def _fold(x, batched: bool, axis_size: int):
    """(axis_size, batch, ...) -> (axis_size * batch, ...), broadcasting an unmapped x first."""
    if not batched:
        x = jnp.broadcast_to(x, (axis_size, *x.shape))
    return x.reshape(axis_size * x.shape[1], *x.shape[2:])


def _unfold(y, axis_size: int):
    return y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])


def _foldable(arrays: dict) -> bool:
    """Whether every array option can follow q's batch through a fold (no options: trivially)."""
    return _FOLDABLE.issuperset(arrays)


def _fold_arrays(arrays: dict, batched: dict, axis_size: int, batch: int) -> dict:
    """The array options of a vmapped call folded like q: ``(axis_size, batch, ...) -> (axis_size * batch,
    ...)``; ``batch`` is the batch of one element of the mapped axis."""
    folded = {}
    for name, value in arrays.items():
        if name == "alibi_slopes":
            folded[name] = _fold_slopes(value, batched[name], axis_size, batch)
        else:  # segment_ids / block_ids: a pair (q_ids (batch, seq_q), k_ids (batch, seq_k))
            folded[name] = tuple(None if x is None else _fold(x, b, axis_size)
                                 for x, b in zip(value, batched[name]))
    return folded


def _fold_slopes(slopes, batched: bool, axis_size: int, batch: int):
    """ALiBi slopes, ``(heads,)`` (shared by the batch) or ``(batch, heads)``, for the folded batch."""
    if not batched:
        # Unmapped (heads,) slopes are shared by every element of the folded batch as they stand.
        return slopes if slopes.ndim == 1 else _fold(slopes, False, axis_size)
    if slopes.ndim == 2:  # (axis_size, heads): each element of the mapped axis has its own slopes
        slopes = jnp.broadcast_to(slopes[:, None], (axis_size, batch, slopes.shape[-1]))
    return slopes.reshape(axis_size * batch, slopes.shape[-1])


def _map_over_axis(op, in_batched, args):
    """``op`` on one element of the mapped axis at a time; unmapped args are shared, not broadcast."""
    leaves, tree = jax.tree.flatten(args)
    mapped_flags = jax.tree.leaves(in_batched)
    mapped = [x for x, is_mapped in zip(leaves, mapped_flags) if is_mapped]

    def one(mapped_slice):
        slices = iter(mapped_slice)
        return op(*jax.tree.unflatten(tree, [next(slices) if m else x for x, m in zip(leaves, mapped_flags)]))

    return jax.lax.map(one, mapped)


# ---------------------------------------------------------------------------------------------------------
# Callbacks: run by XLA at execution time with its device buffers (DLPack) and its stream.


def _forward_callback(options, ctx, outputs, q, k, v, arrays):
    out, lse = outputs
    _launch(cuflash.attention_forward, ctx, q, k, v, out=out, lse=lse, **options, **arrays)


def _backward_callback(options, wanted, ctx, outputs, dout, q, k, v, out, lse, dlse, arrays):
    grads, workspace = outputs  # grads: dq, dk, dv (and dbias): the core's own keyword names
    skip = {"bias_grad": False} if "bias" in arrays and "bias" not in wanted else {}
    _launch(
        cuflash.attention_backward, ctx, dout, q, k, v, out, lse,
        dlse=dlse, workspace=workspace, **grads, **options, **arrays, **skip,
    )


def _varlen_forward_callback(options, lengths, ctx, outputs, q, k, v, cu_q, cu_k, arrays):
    out, lse = outputs
    _launch(cuflash.varlen_attention_forward, ctx, q, k, v, cu_q, cu_k, *lengths, out=out, lse=lse, **options,
            **arrays)


def _varlen_backward_callback(options, lengths, ctx, outputs, dout, q, k, v, out, lse, dlse, cu_q, cu_k, arrays):
    grads, workspace = outputs
    _launch(
        cuflash.varlen_attention_backward, ctx, dout, q, k, v, out, lse, cu_q, cu_k, *lengths,
        dlse=dlse, workspace=workspace, **grads, **options, **arrays,
    )


def _launch(core_fn, ctx, *args, **kwargs):
    """Call the core on XLA's stream with XLA's buffers. The core keys its cached launch plans on the
    buffers' shapes, dtypes and pointer alignment, so from the second execution on a callback only reads
    pointers, patches them into a pre-packed parameter block and launches."""
    device_type, device_id = args[0].__dlpack_device__()  # every array shares one device
    if device_type != _DLPACK_CUDA:
        core_fn(*args, **kwargs)  # JAX on the CPU: the core names the problem
        return
    stream_ptr = ctx.stream
    if callable(stream_ptr):  # a method before jax 0.7
        stream_ptr = stream_ptr()
    if cupy.cuda.runtime.getDevice() == device_id:
        core_fn(*args, stream=stream_ptr, **kwargs)
        return
    with cupy.cuda.Device(device_id):
        with _cupy_stream(device_id, stream_ptr):
            core_fn(*args, stream=stream_ptr, **kwargs)
