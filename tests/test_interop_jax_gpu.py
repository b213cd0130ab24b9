"""cuflash.interop.jax on a GPU: the kernels inside jit, grad, vmap and shard_map.

Forward and gradients are judged by the normwise relative error against
``jax.nn.dot_product_attention(implementation="xla")`` on float32-upcast inputs (fp16 / bf16), or the
float64 ``cuflash.reference`` (fp32, and whenever lse or Sq != Sk is involved: jax's own causal mask is
top-left aligned).
"""
import os

import numpy as np
import pytest

# JAX grabs 75% of the GPU at start by default; the other GPU tests in this process use CuPy's pool.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

cupy = pytest.importorskip("cupy")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cfj  # noqa: E402
from cuflash import reference  # noqa: E402

pytestmark = pytest.mark.gpu

# Normwise relative error allowed, by dtype: fp32 against float64, fp16 / bf16 against fp32 math.
TOLERANCE = {jnp.float32: 1e-5, jnp.float16: 5e-3, jnp.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _jax_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("jax has no GPU backend here")


def _inputs(dtype, *, batch=2, seq_q=128, seq_k=128, heads=4, kv_heads=2, head_dim=64, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq_q, heads, head_dim), (batch, seq_k, kv_heads, head_dim),
              (batch, seq_k, kv_heads, head_dim), (batch, seq_q, heads, head_dim)]
    return [jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype) for s in shapes]


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _error(actual, expected) -> float:
    return reference.relative_error(_f64(actual), _f64(expected))


def _xla_attention(q, k, v, causal):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "fp16", "fp32"])
def test_forward_and_grads_in_jit(dtype, causal):
    q, k, v, w = _inputs(dtype)  # GQA: 4 query heads over 2 kv heads

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))

    ours = jax.jit(jax.value_and_grad(lambda *a: loss(lambda *b: cfj.attention(*b, causal=causal), *a),
                                      argnums=(0, 1, 2)))
    out = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=causal))(q, k, v)
    _, grads = ours(q, k, v)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)

    if dtype == jnp.float32:  # against float64
        ref_out, _ = reference.attention_forward(*(_f64(x) for x in (q, k, v)), causal=causal)
        ref = reference.attention_backward(_f64(w), *(_f64(x) for x in (q, k, v)), causal=causal)
        ref_grads = (ref["dq"], ref["dk"], ref["dv"])
    else:  # against XLA's attention on the same values upcast to float32
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        with jax.default_matmul_precision("highest"):
            ref_out = _xla_attention(*up, causal)
            ref_grads = jax.grad(lambda *a: loss(lambda *b: _xla_attention(*b, causal), *a),
                                 argnums=(0, 1, 2))(*up)
    tol = TOLERANCE[dtype]
    assert _error(out, ref_out) < tol
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _error(g, r) < tol, name


def test_lse_cotangent_matches_reference():
    """return_lse=True with a nonzero cotangent into lse (the dlse path), Sq != Sk causal, GQA."""
    q, k, v, w = _inputs(jnp.float32, seq_q=64, seq_k=96, heads=4, kv_heads=1)
    u = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 64), dtype=np.float32))

    def loss(q, k, v):
        out, lse = cfj.attention(q, k, v, causal=True, return_lse=True, scale=0.2)
        return jnp.sum(out * w) + jnp.sum(lse * u)

    (out, lse), grads = jax.jit(lambda q, k, v: (
        cfj.attention(q, k, v, causal=True, return_lse=True, scale=0.2),
        jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref_out, ref_lse = reference.attention_forward(q64, k64, v64, causal=True, scale=0.2)
    ref = reference.attention_backward(_f64(w), q64, k64, v64, dlse=_f64(u), causal=True, scale=0.2)
    assert _error(out, ref_out) < 1e-5
    assert _error(lse, ref_lse) < 1e-5
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert _error(g, ref[name]) < 1e-5, name


def test_train_step_under_transfer_guard():
    """A jitted step (projections, attention, loss, SGD) moves nothing between host and device."""
    rng = np.random.default_rng(2)
    x = jax.device_put(jnp.asarray(rng.standard_normal((2, 64, 128), dtype=np.float32)).astype(jnp.bfloat16))
    params = jax.device_put({name: jnp.asarray(rng.standard_normal((128, 128), dtype=np.float32) * 0.05)
                             for name in ("wq", "wk", "wv")})

    def loss_fn(params, x):
        def heads(w):
            return (x @ w.astype(x.dtype)).reshape(2, 64, 4, 32)

        out = cfj.attention(heads(params["wq"]), heads(params["wk"]), heads(params["wv"]), causal=True)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    @jax.jit
    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params, _ = step(params, x)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            params, loss = step(params, x)
    assert np.isfinite(float(loss))


def test_vmap_and_grad_of_jit():
    q, k, v, _ = _inputs(jnp.bfloat16, batch=6, seq_q=64, seq_k=64)
    qs, ks, vs = (x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v))
    attend = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True))

    mapped = jax.vmap(attend)(qs, ks, vs)
    whole = attend(q, k, v)
    np.testing.assert_array_equal(_f64(mapped.reshape(whole.shape)), _f64(whole))  # the fold is exact

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

    g_mapped = jax.vmap(jax.grad(jax.jit(loss)))(qs, ks, vs)
    g_whole = jax.grad(jax.jit(loss))(q, k, v)
    assert _error(g_mapped.reshape(q.shape), g_whole) < 1e-2  # dq accumulates in a different order


def test_no_recompile_no_leak():
    q, k, v, _ = _inputs(jnp.float16, seq_q=64, seq_k=64)
    traces = []

    @jax.jit
    def step(q, k, v):
        traces.append(1)
        return jax.value_and_grad(lambda q: jnp.sum(cfj.attention(q, k, v).astype(jnp.float32)))(q)

    jax.block_until_ready(step(q, k, v))
    jax.block_until_ready(cfj.attention(q, k, v))
    live = len(jax.live_arrays())
    for _ in range(5):
        jax.block_until_ready(step(q, k, v))
        jax.block_until_ready(cfj.attention(q, k, v))  # eager calls reuse one cached jitted function
    assert len(traces) == 1 and step._cache_size() == 1
    assert len(jax.live_arrays()) <= live  # nothing accumulates (the baseline may hold a transient result)


def test_no_copy_and_xla_stream(monkeypatch):
    """The core sees q's own device memory and writes XLA's output buffer directly, on XLA's stream."""
    seen = {}
    forward = cuflash.attention_forward

    def spy(q, k, v, *, out, lse, stream, **options):
        seen["q"] = cupy.from_dlpack(q).data.ptr
        seen["out"] = out.__cuda_array_interface__["data"][0]
        seen["stream"] = stream
        result, _ = forward(q, k, v, out=out, lse=lse, stream=stream, **options)
        assert result is out  # the core returns the buffers it was given
        seen["returned"] = result.__cuda_array_interface__["data"][0]
        return result, _

    monkeypatch.setattr(cuflash, "attention_forward", spy)
    q, k, v, _ = _inputs(jnp.bfloat16, seq_q=64, seq_k=64)
    out = jax.block_until_ready(cfj.attention(q, k, v))
    assert seen["q"] == q.unsafe_buffer_pointer()
    assert seen["returned"] == seen["out"] == out.unsafe_buffer_pointer()
    assert isinstance(seen["stream"], int)


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v, w = _inputs(jnp.bfloat16, seq_q=96, seq_k=96)
    def loss(q, k, v):
        return jnp.sum((cfj.attention(q, k, v, deterministic=True) * w).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in grad(q, k, v)]
    for _ in range(3):
        for a, b in zip(first, grad(q, k, v)):
            np.testing.assert_array_equal(a.view(np.uint16), np.asarray(b).view(np.uint16))


def test_attention_sharded_matches_unsharded():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    q, k, v, _ = _inputs(jnp.bfloat16, batch=2 * jax.device_count(), seq_q=64, seq_k=64)
    batch_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    qs, ks, vs = jax.device_put((q, k, v), batch_split)
    sharded = jax.jit(cfj.attention_sharded(mesh, "data", causal=True))
    np.testing.assert_array_equal(_f64(sharded(qs, ks, vs)), _f64(cfj.attention(q, k, v, causal=True)))
    grads = jax.jit(jax.grad(lambda q: jnp.sum(sharded(q, ks, vs).astype(jnp.float32))))(qs)
    assert grads.shape == q.shape and bool(jnp.all(jnp.isfinite(grads.astype(jnp.float32))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_rows_that_see_no_key_in_jit(dtype):
    """Issue 9's report: B=1, Sq=777, Sk=1, H=Hkv=4, D=24, causal (every row but the last sees no key),
    inside jit where XLA allocates every output and scratch buffer from memory it reuses. A poisoned
    step runs first, so the buffers the gradient step gets have held NaN."""
    q, k, v, w = _inputs(dtype, batch=1, seq_q=777, seq_k=1, heads=4, kv_heads=4, head_dim=24, seed=9)

    @jax.jit
    def poison(x):  # buffers of the same sizes as the step's, filled with NaN, then freed
        return [jnp.full(s.shape, jnp.nan, jnp.float32) + x for s in (q, k, v, w, q, k, v)]

    @jax.jit
    def step(q, k, v, w):
        def loss(q, k, v):
            return (cfj.attention(q, k, v, causal=True).astype(jnp.float32) * w.astype(jnp.float32)).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    jax.block_until_ready(poison(jnp.float32(0)))
    grads = jax.block_until_ready(step(q, k, v, w))
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref = reference.attention_backward(_f64(w), q64, k64, v64, causal=True)
    for name, g in zip(("dq", "dk", "dv"), grads):
        g64 = _f64(g)
        assert np.isfinite(g64).all(), f"{name} has non-finite entries"
        assert np.abs(g64 - ref[name]).max() < 1e-2 * (np.abs(ref[name]).max() + 1.0), name
    assert (_f64(grads[0])[:, :776] == 0).all(), "dq of rows that see no key is not 0"


def _option_cases(batch, seq_q, seq_k, heads, seed=3):
    """window + causal, softcap + ALiBi, segment ids, block ids: NumPy values for the array options
    (the same cases as test_interop_torch_gpu.py, so the two share compiled kernels)."""
    rng = np.random.default_rng(seed)

    def ids(seq):  # sorted: documents / blocks are runs; some query rows see no key
        return np.sort(rng.integers(0, 3, (batch, seq)), axis=1).astype(np.int32)

    return {
        "window_causal": {"causal": True, "window": (16, None)},
        "softcap_alibi": {"softcap": 2.0, "alibi_slopes": 2.0 ** -np.arange(1, heads + 1, dtype=np.float32)},
        "segment_ids": {"segment_ids": (ids(seq_q), ids(seq_k))},
        "block_ids": {"block_ids": (ids(seq_q), ids(seq_k))},
    }


def test_options_forward_and_grads_in_jit():
    """window, softcap, alibi_slopes, segment_ids and block_ids through one jitted step (forward and
    gradients of each case), bf16 at odd sizes, against the float64 reference."""
    shape = dict(batch=2, seq_q=37, seq_k=53, heads=4, kv_heads=2, head_dim=40)
    q, k, v, w = _inputs(jnp.bfloat16, **shape, seed=4)
    cases = _option_cases(2, 37, 53, 4)
    static = {name: {n: x for n, x in opts.items() if not _is_array_option(x)} for name, opts in cases.items()}
    arrays = {name: {n: jax.tree.map(jnp.asarray, x) for n, x in opts.items() if _is_array_option(x)}
              for name, opts in cases.items()}

    @jax.jit
    def step(q, k, v, w, arrays):
        results = {}
        for name in cases:
            def loss(q, k, v):
                out = cfj.attention(q, k, v, **static[name], **arrays[name])
                return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            results[name] = (out, grads)
        return results

    results = step(q, k, v, w, arrays)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    for name, options in cases.items():
        out, grads = results[name]
        ref_out, _ = reference.attention_forward(q64, k64, v64, **options)
        ref = reference.attention_backward(_f64(w), q64, k64, v64, **options)
        assert out.dtype == jnp.bfloat16
        assert _error(out, ref_out) < TOLERANCE[jnp.bfloat16], name
        for grad_name, g in zip(("dq", "dk", "dv"), grads):
            assert g.dtype == jnp.bfloat16
            assert np.isfinite(_f64(g)).all(), (name, grad_name)
            assert _error(g, ref[grad_name]) < TOLERANCE[jnp.bfloat16], (name, grad_name)


def _is_array_option(value) -> bool:
    return isinstance(value, np.ndarray) or (isinstance(value, tuple) and isinstance(value[0], np.ndarray))


@pytest.mark.parametrize("kind", ["full", "heads"])
def test_bias_gets_its_gradient_in_jit(kind):
    """A learnable bias under jit(grad): full (B, H, Sq, Sk), or (1, H, Sq, Sk) summed over the batch by
    the kernels; bf16, causal, GQA, odd sizes, against float64."""
    batch, seq_q, seq_k, heads = 2, 37, 53, 4
    q, k, v, w = _inputs(jnp.bfloat16, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=2,
                         head_dim=40, seed=13)
    shape = (batch, heads, seq_q, seq_k) if kind == "full" else (1, heads, seq_q, seq_k)
    bias = jnp.asarray(np.random.default_rng(14).standard_normal(shape, dtype=np.float32)).astype(jnp.bfloat16)

    @jax.jit
    def step(q, k, v, bias):
        def loss(q, k, v, bias):
            out = cfj.attention(q, k, v, causal=True, bias=bias)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)

    (_, out), grads = step(q, k, v, bias)
    q64, k64, v64, b64 = (_f64(x) for x in (q, k, v, bias))
    ref_out, _ = reference.attention_forward(q64, k64, v64, causal=True, bias=b64)
    ref = reference.attention_backward(_f64(w), q64, k64, v64, causal=True, bias=b64)
    assert _error(out, ref_out) < TOLERANCE[jnp.bfloat16]
    for name, g, x in zip(("dq", "dk", "dv", "dbias"), grads, (q, k, v, bias)):
        assert g.dtype == jnp.bfloat16 and g.shape == x.shape, name
        assert np.isfinite(_f64(g)).all(), name
        assert _error(g, ref[name]) < TOLERANCE[jnp.bfloat16], name


def test_a_bias_not_differentiated_is_a_constant():
    """jit(grad) over q, k, v only, with a (1, 1, Sq, Sk) bias and deterministic=True under a window (whose dbias adds
    could not be ordered): the backward makes no dbias (bias_grad=False); grads match float64 and repeat bit for
    bit; bf16, GQA, odd sizes."""
    batch, seq_q, seq_k, heads = 2, 37, 53, 4
    q, k, v, w = _inputs(jnp.bfloat16, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=2,
                         head_dim=40, seed=23)
    bias = jnp.asarray(np.random.default_rng(24).standard_normal((1, 1, seq_q, seq_k),
                                                                dtype=np.float32)).astype(jnp.bfloat16)

    @jax.jit
    def step(q, k, v, bias):
        def loss(q, k, v):
            out = cfj.attention(q, k, v, window=(9, 3), bias=bias, deterministic=True)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    first, second = step(q, k, v, bias), step(q, k, v, bias)
    q64, k64, v64, b64 = (_f64(x) for x in (q, k, v, bias))
    ref = reference.attention_backward(_f64(w), q64, k64, v64, window=(9, 3), bias=b64)
    for name, g, again in zip(("dq", "dk", "dv"), first, second):
        assert np.isfinite(_f64(g)).all(), name
        assert _error(g, ref[name]) < TOLERANCE[jnp.bfloat16], name
        assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(again).view(np.uint16)), name


def test_bool_mask_in_jit():
    """A (B, 1, Sq, Sk) bool mask as a traced operand under jit(grad), bf16, against float64."""
    batch, seq_q, seq_k, heads = 2, 37, 53, 4
    q, k, v, w = _inputs(jnp.bfloat16, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=2,
                         head_dim=40, seed=17)
    mask_np = np.random.default_rng(18).random((batch, 1, seq_q, seq_k)) < 0.6
    mask = jnp.asarray(mask_np)

    @jax.jit
    def step(q, k, v, mask):
        def loss(q, k, v):
            out = cfj.attention(q, k, v, causal=True, mask=mask)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, out), grads = step(q, k, v, mask)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref_out, _ = reference.attention_forward(q64, k64, v64, causal=True, mask=mask_np)
    ref = reference.attention_backward(_f64(w), q64, k64, v64, causal=True, mask=mask_np)
    assert _error(out, ref_out) < TOLERANCE[jnp.bfloat16]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert np.isfinite(_f64(g)).all(), name
        assert _error(g, ref[name]) < TOLERANCE[jnp.bfloat16], name


def test_varlen_grads_in_jit():
    """Packed sequences (lengths 0, 1, 37, 130; Sq != Sk) through jit(grad), bf16, causal, GQA, a window and
    the lse cotangent, against the float64 varlen reference."""
    lens_q, lens_k = (37, 0, 1, 130), (50, 3, 1, 100)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    rng = np.random.default_rng(22)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)
               for s in ((tq, 4, 64), (tk, 2, 64), (tk, 2, 64)))
    dout = jnp.asarray(rng.standard_normal((tq, 4, 64), dtype=np.float32), jnp.bfloat16)
    options = dict(causal=True, window=(50, None))

    @jax.jit
    def run(q, k, v, cu_q, cu_k):
        def loss(q, k, v):
            out = cfj.varlen_attention(q, k, v, cu_q, cu_k, 130, 100, **options)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    _, grads = run(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    out = cfj.varlen_attention(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), 130, 100, **options)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref_out, _ = reference.varlen_attention_forward(q64, k64, v64, cu_q, cu_k, **options)
    ref = reference.varlen_attention_backward(_f64(dout), q64, k64, v64, cu_q, cu_k, **options)
    assert _error(out, ref_out) < TOLERANCE[jnp.bfloat16]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert bool(jnp.isfinite(g.astype(jnp.float32)).all()), name
        assert _error(g, ref[name]) < TOLERANCE[jnp.bfloat16], name


def test_dropout_seed_as_a_traced_array_in_jit():
    """A seed that changes every step is an operand (a JAX key's data): jit does not retrace for a new seed,
    and the results equal the core's with the same 64-bit seed."""
    q, k, v, dout = _inputs(jnp.bfloat16, batch=2, seq_q=64, seq_k=96, seed=17)
    traces = []

    @jax.jit
    def step(q, k, v, seed):
        traces.append(1)

        def loss(q, k, v):
            out = cfj.attention(q, k, v, causal=True, dropout_p=0.2, seed=seed, deterministic=True)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    seeds = [jax.random.key_data(jax.random.key(s)) for s in (1, 2)]
    (_, out1), grads1 = step(q, k, v, seeds[0])
    (_, out2), _ = step(q, k, v, seeds[1])
    assert len(traces) == 1, "a new seed array retraced the step"
    assert not bool(jnp.array_equal(out1, out2))
    words = np.asarray(seeds[0]).astype(np.uint64)
    seed_int = int(words[0]) | (int(words[1]) << 32)
    cq, ck, cv, cdo = (cupy.asarray(np.asarray(x.astype(jnp.float32))).astype(cupy.float32) for x in (q, k, v, dout))
    out, lse = cuflash.attention_forward(cq, ck, cv, causal=True, dropout_p=0.2, seed=seed_int)
    ref = reference.relative_error(_f64(out1), cupy.asnumpy(out).astype(np.float64))
    assert ref < TOLERANCE[jnp.bfloat16]


def test_kvcache_returns_the_updated_caches_in_jit():
    """cfj.attention_with_kvcache under jit with the caches donated: out against the float64 reference over the
    appended cache, the returned caches hold k_new / v_new at the lengths, and the paged form agrees bit for bit."""
    B, L, H, Hkv, D, snew, page = 3, 128, 8, 2, 64, 3, 16
    rng = np.random.default_rng(8)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(jnp.bfloat16)  # noqa: E731
    q, k_cache, v_cache = draw(B, snew, H, D), draw(B, L, Hkv, D), draw(B, L, Hkv, D)
    k_new, v_new = draw(B, snew, Hkv, D), draw(B, snew, Hkv, D)
    lengths = jnp.asarray([0, 40, L - snew], jnp.int32)
    k_host, v_host = np.asarray(k_cache.astype(jnp.float32)), np.asarray(v_cache.astype(jnp.float32))
    table = jnp.asarray(rng.permutation(B * L // page).reshape(B, L // page), jnp.int32)
    k_paged = jnp.zeros((B * L // page, page, Hkv, D), jnp.bfloat16).at[table.reshape(-1)].set(
        k_cache.reshape(-1, page, Hkv, D))
    v_paged = jnp.zeros((B * L // page, page, Hkv, D), jnp.bfloat16).at[table.reshape(-1)].set(
        v_cache.reshape(-1, page, Hkv, D))

    step = jax.jit(lambda q, kc, vc, kn, vn, n: cfj.attention_with_kvcache(q, kc, vc, n, kn, vn, causal=True),
                   donate_argnums=(1, 2))
    out, k2, v2 = step(q, k_cache, v_cache, k_new, v_new, lengths)
    paged = jax.jit(lambda q, kc, vc, kn, vn, n, t: cfj.attention_with_kvcache(q, kc, vc, n, kn, vn, block_table=t,
                                                                               causal=True))
    out_p, kp2, _ = paged(q, k_paged, v_paged, k_new, v_new, lengths, table)
    assert bool(jnp.all(out == out_p)), "paged and dense differ"
    k2_host = np.asarray(k2.astype(jnp.float32))
    for b, n in enumerate(np.asarray(lengths)):
        want_k = k_host[b].copy()
        want_k[n:n + snew] = np.asarray(k_new[b].astype(jnp.float32))
        assert np.array_equal(k2_host[b], want_k)
        want_v = v_host[b].copy()
        want_v[n:n + snew] = np.asarray(v_new[b].astype(jnp.float32))
        ref, _ = reference.attention_forward(_f64(q[b:b + 1]), want_k[None, :n + snew].astype(np.float64),
                                             want_v[None, :n + snew].astype(np.float64), causal=True)
        assert _error(out[b:b + 1], ref) < TOLERANCE[jnp.bfloat16]
    assert np.array_equal(np.asarray(kp2[table].reshape(B, L, Hkv, D).astype(jnp.float32)), k2_host)
