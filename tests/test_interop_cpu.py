"""The interop adapters on the CPU: import hygiene, fake (meta) shapes, and the adapters' plumbing.

The plumbing tests swap the core for a float64 NumPy reference (``FakeCore``) that reads and writes the
buffers the adapters hand it, so custom_vjp / vmap / jit / shard_map in JAX and autograd / opcheck /
torch.compile in torch are exercised end to end with no GPU; ``test_interop_*_gpu.py`` run the kernels.
"""
import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cuflash
from cuflash import reference


def _run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a clean sys.modules), failing the test with its output on error."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# ---------------------------------------------------------------------------------------------------------
# Imports


def test_interop_package_imports_no_framework():
    _run_python("""
        import sys
        import cuflash, cuflash.interop
        assert "jax" not in sys.modules and "torch" not in sys.modules, sorted(
            m for m in sys.modules if m.split(".")[0] in ("jax", "torch"))
    """)


def test_jax_adapter_does_not_import_torch():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    _run_python("""
        import sys
        import cuflash.interop.jax as cfj
        assert callable(cfj.attention) and callable(cfj.attention_sharded)
        assert "torch" not in sys.modules
    """)


# ---------------------------------------------------------------------------------------------------------
# A float64 NumPy core that works on whatever the adapters pass: XLA CPU buffers or CPU torch tensors.


def _np(x) -> np.ndarray:
    """A NumPy view of a buffer (writes go through)."""
    if hasattr(x, "numpy") and hasattr(x, "data_ptr"):  # a torch tensor
        import torch

        x = x.detach()  # shares the storage: writes still go through
        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if hasattr(x, "__dlpack_device__"):
        assert x.__dlpack_device__()[0] == 1, "the NumPy core got a device buffer: pin JAX to the CPU (jax_cpu)"
    return np.asarray(x)


def _f64(x):
    return None if x is None else _np(x).astype(np.float64)


def reference_forward(q, k, v, *, scale=None, causal=False, bias=None):
    """float64 attention: out (B,Sq,H,Dv), lse (B,H,Sq), and the probabilities and expanded k/v."""
    _, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k = np.repeat(k, heads // kv_heads, axis=2)
    v = np.repeat(v, heads // kv_heads, axis=2)
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
        s = s + bias
    if causal:  # bottom-right aligned
        visible = np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + seq_k - seq_q
        s = np.where(visible, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(s - row_max)
    row_sum = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(row_sum))[..., 0]
    p = p / np.where(row_sum > 0, row_sum, 1.0)
    return np.einsum("bhqk,bkhd->bqhd", p, v), lse, p, k, v, scale


def reference_backward(dout, q, k, v, out, *, dlse=None, scale=None, causal=False, bias=None):
    kv_heads = k.shape[2]
    _, _, p, k_full, v_full, scale = reference_forward(q, k, v, scale=scale, causal=causal, bias=bias)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, v_full)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = p * (dp - delta + (0.0 if dlse is None else dlse[..., None]))
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, k_full)

    def per_kv_head(x):  # sum the query heads of each group
        b, s, h, d = x.shape
        return x.reshape(b, s, kv_heads, h // kv_heads, d).sum(3)

    dk = per_kv_head(scale * np.einsum("bhqk,bqhd->bkhd", ds, q))
    dv = per_kv_head(np.einsum("bhqk,bqhd->bkhd", p, dout))
    return dq, dk, dv, ds


# The core's options the adapters forward: every one the FakeCore computes (through cuflash.reference);
# the array-valued ones, and the pairs of arrays, are buffers the core reads.
CORE_OPTIONS = ("window", "softcap", "bias", "alibi_slopes", "segment_ids", "block_ids")


def _host(value):
    """An option's value as the core saw it: buffers as NumPy copies, pairs as tuples, constants as they are."""
    if isinstance(value, (tuple, list)):
        return tuple(_host(item) for item in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _np(value).copy()


def _meta(value):
    """An option's value as a metadata-only entry point (prepare, backward_workspace) may read it:
    (shape, dtype) of arrays, which are tracers or fake tensors there."""
    if isinstance(value, (tuple, list)):
        return tuple(_meta(item) for item in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), str(value.dtype).replace("torch.", "")
    return value


class FakeCore:
    """Stands in for cuflash's attention_forward / attention_backward / prepare / backward_workspace,
    computing with the float64 ``cuflash.reference``. ``calls`` logs (entry point, q's shape, ...);
    ``options`` logs (entry point, the options it got: arrays as NumPy copies, or (shape, dtype) where
    only metadata is promised)."""

    def __init__(self):
        self.calls = []
        self.options = []

    @staticmethod
    def _check_options(options):  # like the core: unknown keywords are an error
        unknown = set(options) - set(CORE_OPTIONS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")

    def options_of(self, kind: str) -> list:
        return [options for name, options in self.options if name == kind]

    def prepare(self, q, k, v, *, causal=False, deterministic=False, backward=True, scale=None, **options):
        self._check_options(options)
        self.calls.append(("prepare", tuple(q.shape), backward))
        self.options.append(("prepare", {"causal": causal, "backward": backward,
                                         **{n: _meta(x) for n, x in options.items()}}))

    @staticmethod
    def _workspace(q):
        batch, seq_q, heads, head_dim = q.shape
        # One scratch that scales with the batch and one that does not: both must reach the backward whole.
        return {"dq_accum": (batch, seq_q, heads, head_dim), "semaphores": (heads, 3)}

    def backward_workspace(self, q, k, v, *, causal=False, deterministic=False, scale=None, **options):
        self._check_options(options)
        self.options.append(("backward_workspace", {"causal": causal,
                                                    **{n: _meta(x) for n, x in options.items()}}))
        return self._workspace(q)

    def attention_forward(self, q, k, v, *, out, lse, scale=None, causal=False, deterministic=False,
                          stream=None, **options):
        self._check_options(options)
        options = {name: _host(value) for name, value in options.items()}
        self.calls.append(("forward", tuple(q.shape)))
        self.options.append(("forward", {"scale": scale, "causal": causal, **options}))
        result, row_lse = reference.attention_forward(_f64(q), _f64(k), _f64(v), scale=scale, causal=causal,
                                                      **options)
        _np(out)[...] = result
        _np(lse)[...] = row_lse

    def attention_backward(self, dout, q, k, v, out, lse, *, dlse=None, dq, dk, dv, workspace, scale=None,
                           causal=False, deterministic=False, dbias=None, bias_grad=True, stream=None, **options):
        self._check_options(options)
        options = {name: _host(value) for name, value in options.items()}
        self.calls.append(("backward", tuple(q.shape), dlse is not None))
        self.options.append(("backward", {"scale": scale, "causal": causal, **options,
                                          **({} if bias_grad else {"bias_grad": False})}))
        assert {name: _np(w).shape for name, w in workspace.items()} == self._workspace(q)
        assert all(_np(w).dtype == np.float32 for w in workspace.values())
        grads = reference.attention_backward(_f64(dout), _f64(q), _f64(k), _f64(v), dlse=_f64(dlse),
                                             scale=scale, causal=causal, **options)
        assert (dbias is None) == ("dbias" not in grads or not bias_grad)
        for buffer, name in ((dq, "dq"), (dk, "dk"), (dv, "dv"), (dbias, "dbias")):
            if buffer is not None:
                _np(buffer)[...] = grads[name]

    def install(self, monkeypatch):
        for name in ("prepare", "backward_workspace", "attention_forward", "attention_backward"):
            monkeypatch.setattr(cuflash, name, getattr(self, name))
        return self


# ---------------------------------------------------------------------------------------------------------
# JAX plumbing


def _jax_reference(q, k, v, *, scale=None, causal=False, bias=None):
    """Pure-JAX attention with lse, differentiated by JAX itself."""
    import jax
    import jax.numpy as jnp

    _, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k = jnp.repeat(k, heads // kv_heads, axis=2)
    v = jnp.repeat(v, heads // kv_heads, axis=2)
    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
        s = s + bias
    if causal:
        visible = jnp.arange(seq_k)[None, :] <= jnp.arange(seq_q)[:, None] + seq_k - seq_q
        s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), lse


@pytest.fixture
def jax_cpu():
    """JAX pinned to its CPU device for the test, whatever the default backend (a GPU where there is
    one): arrays made in the test and the jitted computations on them then run on the CPU, so the
    callbacks hand the NumPy core CPU buffers (``np.asarray`` on a GPU buffer raises)."""
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        assert jax.numpy.zeros(()).devices() == {cpu}
        yield cpu


@pytest.fixture
def jax_core(jax_cpu, monkeypatch):
    import cuflash.interop.jax as cfj

    for cache in (cfj._attention_fn, cfj._forward_op, cfj._backward_op):
        cache.cache_clear()
    return FakeCore().install(monkeypatch)


def _qkv(seed=0, batch=2, seq_q=5, seq_k=7, heads=4, kv_heads=2, head_dim=8, head_dim_v=None):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shapes = ((batch, seq_q, heads, head_dim), (batch, seq_k, kv_heads, head_dim),
              (batch, seq_k, kv_heads, head_dim_v or head_dim))
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_forward_and_grads_match_jax(jax_core, causal):
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv(head_dim_v=16)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 4, 16)), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) * w)

    ours = jax.jit(jax.value_and_grad(lambda *a: loss(lambda *b: cfj.attention(*b, causal=causal), *a),
                                      argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.value_and_grad(lambda *a: loss(lambda *b: _jax_reference(*b, causal=causal)[0], *a),
                                argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        _close(a, b)
    # Eagerly too, against jax's own attention (top-left causal alignment: equal lengths here).
    q2, k2, v2 = _qkv(seq_q=6, seq_k=6)
    _close(cfj.attention(q2, k2, v2, causal=causal, scale=0.3),
           jax.nn.dot_product_attention(q2, k2, v2, is_causal=causal, scale=0.3, implementation="xla"))


def test_jax_lse_cotangent_reaches_backward(jax_core):
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv()
    rng = np.random.default_rng(2)
    w_out = jnp.asarray(rng.standard_normal((2, 5, 4, 8)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((2, 4, 5)), jnp.float32)

    def loss(attend, q, k, v):
        out, lse = attend(q, k, v)
        return jnp.sum(out * w_out) + jnp.sum(jnp.sin(lse) * w_lse)

    def ours_attend(q, k, v):
        return cfj.attention(q, k, v, causal=True, return_lse=True, scale=0.3)

    def their_attend(q, k, v):
        return _jax_reference(q, k, v, causal=True, scale=0.3)

    ours = jax.jit(jax.grad(lambda *a: loss(ours_attend, *a), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.grad(lambda *a: loss(their_attend, *a), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):
        _close(a, b)
    assert ("backward", (2, 5, 4, 8), True) in jax_core.calls


def test_jax_unused_outputs_are_symbolic_zeros(jax_core):
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv()
    # lse returned but unused: the backward gets no dlse.
    g = jax.grad(lambda q: jnp.sum(cfj.attention(q, k, v, return_lse=True)[0]))(q)
    _close(g, jax.grad(lambda q: jnp.sum(_jax_reference(q, k, v)[0]))(q))
    assert jax_core.calls[-1] == ("backward", (2, 5, 4, 8), False)
    # Only lse used: dout is zeros, dlse carries everything.
    g = jax.grad(lambda q: jnp.sum(cfj.attention(q, k, v, return_lse=True)[1] ** 2))(q)
    _close(g, jax.grad(lambda q: jnp.sum(_jax_reference(q, k, v)[1] ** 2))(q))


def test_jax_vmap_folds_into_batch(jax_core):
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv(batch=6)
    qs, ks, vs = (x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v))
    out = jax.jit(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True)))(qs, ks, vs)
    _close(out.reshape(q.shape[0], *out.shape[2:]), _jax_reference(q, k, v, causal=True)[0])
    assert ("forward", (6, 5, 4, 8)) in jax_core.calls  # one launch over the folded batch, not three

    # Unmapped k, v are shared by every mapped q.
    out = jax.vmap(lambda q: cfj.attention(q, ks[0], vs[0]))(qs)
    for i in range(3):
        _close(out[i], _jax_reference(qs[i], ks[0], vs[0])[0])

    # Gradients through vmap (the backward folds too, workspace shaped for the folded batch), and vmap of grad.
    def loss(q, k, v):
        return jnp.sum(jnp.cos(cfj.attention(q, k, v, causal=True)))

    def ref_loss(q, k, v):
        return jnp.sum(jnp.cos(_jax_reference(q, k, v, causal=True)[0]))

    g = jax.jit(jax.grad(lambda q, k, v: jax.vmap(loss)(q, k, v).sum(), argnums=(0, 1, 2)))(qs, ks, vs)
    for gi, ri in zip(g, jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)):
        _close(gi.reshape(ri.shape), ri)
    g = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(qs, ks, vs)
    for gi, ri in zip(g, jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)):
        _close(gi.reshape(ri.shape), ri)

    # Two mapped axes fold twice.
    q4, k4, v4 = (x.reshape(3, 1, 2, *x.shape[1:]) for x in (q, k, v))
    out = jax.vmap(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True)))(q4, k4, v4)
    _close(out.reshape(q.shape[0], *out.shape[3:]), _jax_reference(q, k, v, causal=True)[0])


def test_jax_traces_once(jax_core):
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv()

    @jax.jit
    def step(q, k, v):
        return jax.value_and_grad(lambda q: jnp.sum(cfj.attention(q, k, v, causal=True) ** 2))(q)

    step(q, k, v)
    traced = [c for c in jax_core.calls if c[0] == "prepare"]
    assert {c[2] for c in traced} == {False, True}  # forward and backward kernels prepared while tracing
    for _ in range(2):
        step(q, k, v)
    assert step._cache_size() == 1
    assert [c for c in jax_core.calls if c[0] == "prepare"] == traced  # no retrace
    assert sum(c[0] == "forward" for c in jax_core.calls) == 3
    # Eager calls reuse the same jitted function: one per (options, return_lse).
    cfj.attention(q, k, v, causal=True)
    cfj.attention(q, k, v, causal=True)
    assert cfj._attention_fn.cache_info().currsize == 1


def test_jax_array_options_are_operands(jax_core):
    """An array option (bias) is a traced operand with a gradient; under vmap it maps element by element."""
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv()
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 5, 7)), jnp.float32)

    def loss(attend, q, bias):
        return jnp.sum(jnp.cos(attend(q, k, v, bias=bias)))

    ours = jax.jit(jax.grad(lambda q, b: loss(cfj.attention, q, b), argnums=(0, 1)))(q, bias)
    theirs = jax.grad(lambda q, b: loss(lambda *a, **o: _jax_reference(*a, **o)[0], q, b), argnums=(0, 1))(q, bias)
    for a, b in zip(ours, theirs):
        _close(a, b)

    out = jax.vmap(lambda b: cfj.attention(q, k, v, bias=b))(jnp.stack([bias, 2 * bias]))
    _close(out[1], _jax_reference(q, k, v, bias=2 * bias)[0])

    with pytest.raises(TypeError, match="hashable"):
        cfj.attention(q, k, v, window=[{}, None])


def test_jax_bias_gradient_only_where_differentiated(jax_core):
    """A bias that is not differentiated (not an argnum, or stop_gradient-ed) gets bias_grad=False in the core's
    backward, so no dbias work; a differentiated one gets dbias. q's gradient is the same either way."""
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv()
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, 5, 7)), jnp.float32)

    def loss(attend, q, bias):
        return jnp.sum(jnp.cos(attend(q, k, v, bias=bias, causal=True)))

    reference = lambda *a, **o: _jax_reference(*a, **o)[0]
    expected_dq, expected_dbias = jax.grad(lambda q, b: loss(reference, q, b), argnums=(0, 1))(q, bias)

    dq = jax.jit(jax.grad(lambda q, b: loss(cfj.attention, q, b)))(q, bias)
    _close(dq, expected_dq)
    assert jax_core.options_of("backward")[-1]["bias_grad"] is False

    dq, dbias = jax.jit(jax.grad(lambda q, b: loss(cfj.attention, q, b), argnums=(0, 1)))(q, bias)
    _close(dq, expected_dq)
    _close(dbias, expected_dbias)
    assert "bias_grad" not in jax_core.options_of("backward")[-1]

    stopped = jax.grad(lambda q, b: loss(cfj.attention, q, jax.lax.stop_gradient(b)), argnums=(0, 1))(q, bias)
    _close(stopped[0], expected_dq)
    assert not np.any(np.asarray(stopped[1]))
    assert jax_core.options_of("backward")[-1]["bias_grad"] is False


def _option_arrays(batch=2, seq_q=5, seq_k=7, heads=4, seed=4):
    """NumPy values for the array options: slopes (H,) and (B, H), segment and block ids (sorted, so that
    documents and blocks are runs, with rows that see no key under some combinations)."""
    rng = np.random.default_rng(seed)

    def ids(seq):
        return np.sort(rng.integers(0, 3, (batch, seq)), axis=1).astype(np.int32)

    return {
        "slopes": rng.uniform(0.1, 1.0, heads).astype(np.float32),
        "batch_slopes": rng.uniform(0.1, 1.0, (batch, heads)).astype(np.float32),
        "segment_ids": (ids(seq_q), ids(seq_k)),
        "block_ids": (ids(seq_q), ids(seq_k)),
    }


# Option sets the adapters must forward, by name: static ones as values, array ones by _option_arrays key.
OPTION_CASES = {
    "window_causal": {"causal": True, "window": (3, None)},
    "window_both": {"window": (2, 1)},
    "softcap_alibi": {"softcap": 2.5, "alibi_slopes": "slopes"},
    "batch_alibi": {"alibi_slopes": "batch_slopes", "window": (None, 0)},
    "segment_ids": {"segment_ids": "segment_ids"},
    "block_ids": {"block_ids": "block_ids", "scale": 0.4},
    "everything": {"causal": True, "window": (4, None), "softcap": 3.0, "alibi_slopes": "batch_slopes",
                   "segment_ids": "segment_ids", "block_ids": "block_ids"},
}


def _case_options(case: str, arrays: dict, to_array) -> dict:
    """The options of OPTION_CASES[case], array values made with ``to_array`` (pairs stay pairs)."""
    options = {}
    for name, value in OPTION_CASES[case].items():
        if isinstance(value, str):
            value = arrays[value]
            value = tuple(to_array(x) for x in value) if isinstance(value, tuple) else to_array(value)
        options[name] = value
    return options


def _assert_options_equal(seen: dict, expected: dict):
    """The options a core entry point got (``_host`` form) against the ones the test passed."""
    expected = {name: _host(value) for name, value in expected.items() if name != "causal"}
    assert set(seen) - {"scale", "causal"} == set(expected) - {"scale"}, (sorted(seen), sorted(expected))
    for name, value in expected.items():
        got = seen[name]
        if isinstance(value, tuple) and value and isinstance(value[0], np.ndarray):
            assert len(got) == len(value)
            for g, e in zip(got, value):
                np.testing.assert_array_equal(g, e)
                assert g.dtype == e.dtype
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got, value)
            assert got.dtype == value.dtype
        else:
            assert got == value and type(got) is type(value), (name, got, value)


def _reference_out_and_grads(q, k, v, dout, options):
    """float64 out and (dq, dk, dv) of cuflash.reference for options that may hold framework arrays."""
    host = {name: _host(value) for name, value in options.items()}
    f64 = [_f64(x) for x in (q, k, v)]
    out, _ = reference.attention_forward(*f64, **host)
    grads = reference.attention_backward(_f64(dout), *f64, **host)
    return out, (grads["dq"], grads["dk"], grads["dv"])


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_jax_options_reach_the_core(jax_core, case):
    """window / softcap static, alibi_slopes / segment_ids / block_ids operands: each reaches prepare,
    backward_workspace, the forward and the backward with its value, under jit and grad; the arrays get
    zero cotangents."""
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    q, k, v = _qkv()
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 4, 8)), jnp.float32)
    options = _case_options(case, _option_arrays(), jnp.asarray)
    arrays = {n: x for n, x in options.items() if n in ("alibi_slopes", "segment_ids", "block_ids")}
    static = {n: x for n, x in options.items() if n not in arrays}

    def loss(q, k, v, arrays):
        return jnp.sum(cfj.attention(q, k, v, **static, **arrays) * w)

    out = jax.jit(lambda q, k, v, arrays: cfj.attention(q, k, v, **static, **arrays))(q, k, v, arrays)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, arrays)
    ref_out, ref_grads = _reference_out_and_grads(q, k, v, w, options)
    _close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        _close(g, r)

    for kind in ("forward", "backward"):
        seen = jax_core.options_of(kind)
        assert seen, kind
        for each in seen:
            _assert_options_equal(each, options)
    meta = {n: _meta(x) for n, x in arrays.items()}
    for kind in ("prepare", "backward_workspace"):
        for each in jax_core.options_of(kind):
            assert {n: each[n] for n in meta} == meta
            assert {n: each[n] for n in static if n != "scale"} == {n: x for n, x in static.items() if n != "scale"}
    assert {each["backward"] for each in jax_core.options_of("prepare")} == {False, True}

    if "alibi_slopes" in arrays:  # differentiable dtype, but no gradient: a zero cotangent
        d_slopes = jax.grad(lambda s: loss(q, k, v, {**arrays, "alibi_slopes": s}))(arrays["alibi_slopes"])
        assert d_slopes.shape == arrays["alibi_slopes"].shape and not np.any(np.asarray(d_slopes))


def test_jax_vmap_folds_array_options_into_batch(jax_core):
    """vmap with slopes and ids, mapped or not: one launch over the folded batch, each element attending
    with its own ids and slopes; gradients through the vmap fold the same way."""
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    n, batch, heads = 3, 2, 4
    q, k, v = _qkv(batch=n * batch)
    qs, ks, vs = (x.reshape(n, batch, *x.shape[1:]) for x in (q, k, v))
    per = [_option_arrays(seed=10 + i) for i in range(n)]  # the options of each element of the mapped axis

    def stack(key, j=None):  # the mapped-axis stack of one option (or of one half of a pair)
        return jnp.asarray(np.stack([p[key] if j is None else p[key][j] for p in per]))


    cases = {  # name: (options of element i, vmapped options, their in_axes)
        "shared (H,) slopes": (lambda i: {"alibi_slopes": per[0]["slopes"]},
                               {"alibi_slopes": jnp.asarray(per[0]["slopes"])}, {"alibi_slopes": None}),
        "mapped (H,) slopes": (lambda i: {"alibi_slopes": per[i]["slopes"]},
                               {"alibi_slopes": stack("slopes")}, {"alibi_slopes": 0}),
        "shared (B, H) slopes": (lambda i: {"alibi_slopes": per[0]["batch_slopes"]},
                                 {"alibi_slopes": jnp.asarray(per[0]["batch_slopes"])}, {"alibi_slopes": None}),
        "mapped (B, H) slopes, mapped segment ids": (
            lambda i: {"alibi_slopes": per[i]["batch_slopes"], "segment_ids": per[i]["segment_ids"]},
            {"alibi_slopes": stack("batch_slopes"),
             "segment_ids": (stack("segment_ids", 0), stack("segment_ids", 1))},
            {"alibi_slopes": 0, "segment_ids": (0, 0)}),
        "shared segment ids": (lambda i: {"segment_ids": per[0]["segment_ids"]},
                               {"segment_ids": tuple(jnp.asarray(x) for x in per[0]["segment_ids"])},
                               {"segment_ids": None}),
        "mapped q block ids, shared k block ids": (
            lambda i: {"block_ids": (per[i]["block_ids"][0], per[0]["block_ids"][1])},
            {"block_ids": (stack("block_ids", 0), jnp.asarray(per[0]["block_ids"][1]))},
            {"block_ids": (0, None)}),
    }
    for name, (element_options, arrays, axes) in cases.items():
        jax_core.calls.clear()
        jax_core.options.clear()
        attend = jax.jit(jax.vmap(lambda q, k, v, arrays: cfj.attention(q, k, v, causal=True, **arrays),
                                  in_axes=(0, 0, 0, axes)))
        out = attend(qs, ks, vs, arrays)
        assert [c for c in jax_core.calls if c[0] == "forward"] == [("forward", (n * batch, 5, 4, 8))], name
        slopes = jax_core.options_of("forward")[0].get("alibi_slopes")
        if slopes is not None:  # shared (H,) slopes stay (H,); others follow the folded batch
            assert slopes.shape == ((heads,) if name == "shared (H,) slopes" else (n * batch, heads)), name

        def loss(q, arrays):
            return jnp.sum(jnp.cos(jax.vmap(lambda q, k, v, arrays: cfj.attention(q, k, v, causal=True, **arrays),
                                            in_axes=(0, 0, 0, axes))(q, ks, vs, arrays)))

        dq = jax.jit(jax.grad(loss))(qs, arrays)
        assert ("backward", (n * batch, 5, 4, 8), False) in jax_core.calls, name
        for i in range(n):
            options = {"causal": True, **element_options(i)}
            dout = -np.sin(_reference_out_and_grads(qs[i], ks[i], vs[i], np.zeros((batch, 5, 4, 8)), options)[0])
            ref_out, ref_grads = _reference_out_and_grads(qs[i], ks[i], vs[i], dout, options)
            _close(out[i], ref_out)
            _close(dq[i], ref_grads[0])

    # With bias too, vmap maps one element at a time (bias's batch dim cannot follow the fold).
    jax_core.calls.clear()
    bias = jnp.zeros((batch, 4, 5, 7), jnp.float32)
    jax.vmap(lambda q: cfj.attention(q, ks[0], vs[0], bias=bias, alibi_slopes=jnp.asarray(per[0]["slopes"])))(qs)
    assert [c for c in jax_core.calls if c[0] == "forward"] == [("forward", (batch, 5, 4, 8))] * n


def test_jax_shard_map_over_two_cpu_devices():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    _run_python(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("interop_cpu", {__file__!r})
        tests = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests)
        tests.check_shard_map()
    """, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"})


def check_shard_map():
    """Run in a process with two CPU devices (see the test above)."""
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cfj

    assert jax.device_count() == 2
    core = FakeCore()
    for name in ("prepare", "backward_workspace", "attention_forward", "attention_backward"):
        setattr(cuflash, name, getattr(core, name))
    mesh = jax.make_mesh((2,), ("data",))
    batch_sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    q0, k0, v0 = _qkv(batch=4)  # the reference runs on these, unsharded
    q, k, v = jax.device_put((q0, k0, v0), batch_sharded)
    sharded = cfj.attention_sharded(mesh, "data", causal=True, return_lse=True)
    out, lse = jax.jit(sharded)(q, k, v)
    ref_out, ref_lse = _jax_reference(q0, k0, v0, causal=True)
    _close(out, ref_out)
    _close(lse, ref_lse)
    assert len(out.sharding.device_set) == 2
    assert ("forward", (2, 5, 4, 8)) in core.calls  # each device saw its half of the batch

    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.cos(sharded(q, k, v)[0])), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda q, k, v: jnp.sum(jnp.cos(_jax_reference(q, k, v, causal=True)[0])),
                   argnums=(0, 1, 2))(q0, k0, v0)
    for a, b in zip(grads, ref):
        _close(a, b)

    # A shard_map of the user's own, with its default varying-axes checks, differentiates too.
    spec = jax.sharding.PartitionSpec("data")
    own = jax.shard_map(lambda q, k, v: cfj.attention(q, k, v, causal=True), mesh=mesh,
                        in_specs=(spec, spec, spec), out_specs=spec)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.cos(own(q, k, v))), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grads, ref):
        _close(a, b)


# ---------------------------------------------------------------------------------------------------------
# torch: fake (meta) implementations, then the plumbing with the NumPy core on CPU tensors


@pytest.fixture
def cft():
    pytest.importorskip("torch")
    import cuflash.interop.torch as cft

    return cft


def test_torch_fake_shapes_on_meta(cft):
    import torch

    q = torch.empty(2, 5, 4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 7, 2, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(2, 7, 2, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    ids = (torch.empty(2, 5, dtype=torch.int32, device="meta"), torch.empty(2, 7, dtype=torch.int32, device="meta"))
    out, lse = cft.attention(q, k, v, return_lse=True, causal=True, window=(3, None), softcap=4.0,
                             alibi_slopes=torch.empty(4, device="meta"), segment_ids=ids, block_ids=ids)
    assert (out.shape, out.dtype, out.device.type) == ((2, 5, 4, 8), torch.bfloat16, "meta")
    assert (lse.shape, lse.dtype) == ((2, 4, 5), torch.float32)
    (out.sum() + lse.sum()).backward()
    for x in (q, k, v):
        assert (x.grad.shape, x.grad.dtype) == (x.shape, x.dtype)


def test_torch_fake_under_fake_tensor_mode(cft):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 9, 8, 64, dtype=torch.float16)
        kv = torch.empty(3, 11, 1, 64, dtype=torch.float16)
        out, lse = torch.ops.cuflash.attention_fwd(q, kv, kv, *cft._op_options({"causal": True}))
        grads = torch.ops.cuflash.attention_bwd(out, q, kv, kv, out, lse, lse, *cft._op_options({}))
    assert out.shape == (3, 9, 8, 64) and lse.shape == (3, 8, 9)
    assert [tuple(g.shape) for g in grads] == [(3, 9, 8, 64), (3, 11, 1, 64), (3, 11, 1, 64)]


def test_torch_options_map_onto_the_ops(cft):
    import torch

    flat = cft._op_options({"causal": True, "window": (None, 4), "scale": 0.5})
    assert cft._core_options(flat) == {"causal": True, "window": (None, 4), "scale": 0.5}
    assert cft._core_options(cft._op_options({})) == {}
    assert cft._op_options({}) is cft._DEFAULT_OP_OPTIONS  # the no-option path builds nothing
    # Pairs of tensors take two Tensor? slots and come back to the core as pairs; slopes as they are.
    q_ids, k_ids, slopes = torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, 7, dtype=torch.int32), torch.ones(4)
    flat = cft._op_options({"segment_ids": (q_ids, k_ids), "block_ids": [k_ids, q_ids], "alibi_slopes": slopes,
                            "softcap": 5.0, "window": (2, None)})
    core = cft._core_options(flat)
    assert set(core) == {"segment_ids", "block_ids", "alibi_slopes", "softcap", "window"}
    assert core["segment_ids"][0] is q_ids and core["segment_ids"][1] is k_ids
    assert core["block_ids"][0] is k_ids and core["block_ids"][1] is q_ids
    assert core["alibi_slopes"] is slopes and core["softcap"] == 5.0 and core["window"] == (2, None)
    assert cft._core_options(cft._op_options({"window": (None, None)})) == {}
    with pytest.raises(TypeError, match="window must be a pair"):
        cft._op_options({"window": 3})
    with pytest.raises(TypeError, match="unknown option 'casual'"):
        cft.attention(torch.empty(0), torch.empty(0), torch.empty(0), casual=True)


@pytest.fixture
def torch_core(cft, monkeypatch):
    cft._WORKSPACE_SHAPES.clear()
    yield FakeCore().install(monkeypatch)
    cft._WORKSPACE_SHAPES.clear()


def _torch_qkv(dtype, seed=0, requires_grad=True):
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 16))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad) for s in shapes]


def _torch_reference(q, k, v, causal=False, scale=None):
    import torch

    out, lse, *_ = reference_forward(*(x.detach().double().numpy() for x in (q, k, v)), causal=causal,
                                     scale=scale)
    return torch.from_numpy(out), torch.from_numpy(lse)


def test_torch_autograd_with_lse(cft, torch_core):
    import torch

    q, k, v = _torch_qkv(torch.float32)
    out, lse = cft.attention(q, k, v, causal=True, return_lse=True, scale=0.7)
    ref_out, ref_lse = _torch_reference(q, k, v, causal=True, scale=0.7)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)

    # lse.sum() hands an expanded (stride 0) gradient; out's is dense.
    w = torch.randn(out.shape, dtype=torch.float32)
    ((out * w).sum() + lse.sum()).backward()
    dout = w.double().numpy()
    dlse = np.ones(lse.shape)
    dq, dk, dv, _ = reference_backward(dout, *(x.detach().double().numpy() for x in (q, k, v)),
                                       out.detach().double().numpy(), dlse=dlse, causal=True, scale=0.7)
    for x, expected in zip((q, k, v), (dq, dk, dv)):
        torch.testing.assert_close(x.grad.double(), torch.from_numpy(expected), rtol=1e-5, atol=1e-5)

    # return_lse=False: the unused lse gradient arrives as None, so no dlse term.
    cft.attention(q, k, v).sum().backward()
    assert torch_core.calls[-1] == ("backward", (2, 5, 4, 8), False)


def test_torch_opcheck(cft, torch_core):
    import torch

    q, k, v = _torch_qkv(torch.float32)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (q, k, v, *cft._op_options({"causal": True})))
    with torch.no_grad():
        out, lse = cft.attention(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse),
                           *cft._op_options({})))


def test_torch_bias_gradient_only_where_required(cft, torch_core):
    """A bias with requires_grad=False gets bias_grad=False in the core's backward (no dbias work) and no
    .grad; one that requires grad gets dbias. Eager, torch.compile and opcheck agree."""
    import torch

    q, k, v = _torch_qkv(torch.float32)
    bias = torch.randn(2, 4, 5, 7, dtype=torch.float32, generator=torch.Generator().manual_seed(6))
    w = torch.randn(2, 5, 4, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(7))
    out = cft.attention(q, k, v, bias=bias, causal=True)
    dq, dk, dv, ds = reference_backward(w.double().numpy(), *(x.detach().double().numpy() for x in (q, k, v)),
                                        out.detach().double().numpy(), causal=True, bias=bias.double().numpy())

    def check_q(x):
        torch.testing.assert_close(x.double(), torch.from_numpy(dq), rtol=1e-5, atol=1e-5)

    (out * w).sum().backward()
    check_q(q.grad)
    assert torch_core.options_of("backward")[-1]["bias_grad"] is False and bias.grad is None

    q.grad = None
    bias.requires_grad_(True)
    (cft.attention(q, k, v, bias=bias, causal=True) * w).sum().backward()
    check_q(q.grad)
    torch.testing.assert_close(bias.grad.double(), torch.from_numpy(ds), rtol=1e-5, atol=1e-5)
    assert "bias_grad" not in torch_core.options_of("backward")[-1]

    def step(q, bias):
        return (cft.attention(q, k, v, bias=bias, causal=True) * w).sum()

    for needs in (False, True):
        q.grad = None
        b = bias.detach().requires_grad_(needs)
        torch.compile(step, fullgraph=True, backend="aot_eager")(q, b).backward()
        check_q(q.grad)
        assert ("bias_grad" not in torch_core.options_of("backward")[-1]) == needs
        assert (b.grad is not None) == needs

    with torch.no_grad():
        out, lse = cft.attention(q, k, v, bias=bias, return_lse=True)
    options = cft._op_options({"bias": bias.detach()})
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, *options)
    for needs in (False, True):
        torch.library.opcheck(torch.ops.cuflash.attention_bwd.default, args, {"bias_grad": needs})
        grads = torch.ops.cuflash.attention_bwd(*args, bias_grad=needs)
        assert len(grads) == 3 + needs


def _assert_compiled_matches_eager(step, q, k, v):
    """``step(q, k, v) -> (loss, out)`` under torch.compile(fullgraph=True): out and q / k / v grads equal eager's."""
    import torch

    loss, out = step(q, k, v)
    loss.backward()
    eager = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    loss_c, out_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    loss_c.backward()
    torch.testing.assert_close(out_c, out)
    for x, g in zip((q, k, v), eager):
        torch.testing.assert_close(x.grad, g)


def test_torch_compile_fullgraph_matches_eager(cft, torch_core):
    import torch

    def step(q, k, v):
        out, lse = cft.attention(q, k, v, causal=True, return_lse=True)
        return (out.square().sum() + lse.sum()), out

    _assert_compiled_matches_eager(step, *_torch_qkv(torch.float32))


def _torch_case(case: str) -> dict:
    import torch

    return _case_options(case, _option_arrays(), torch.from_numpy)


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_torch_options_reach_the_core(cft, torch_core, case):
    """Each option reaches the forward, backward_workspace and the backward with its value (tensors as the
    tensors given), through autograd; slopes that require grad get none."""
    import torch

    q, k, v = _torch_qkv(torch.float32)
    options = _torch_case(case)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = options["alibi_slopes"].clone().requires_grad_()
    out, lse = cft.attention(q, k, v, return_lse=True, **options)
    w = torch.randn(out.shape, dtype=torch.float32, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()

    ref_out, ref_grads = _reference_out_and_grads(q, k, v, w, options)
    torch.testing.assert_close(out.double(), torch.from_numpy(ref_out), rtol=1e-5, atol=1e-5)
    for x, expected in zip((q, k, v), ref_grads):
        torch.testing.assert_close(x.grad.double(), torch.from_numpy(expected), rtol=1e-5, atol=1e-5)
    if "alibi_slopes" in options:
        assert options["alibi_slopes"].grad is None

    for kind in ("forward", "backward"):
        (seen,) = torch_core.options_of(kind)
        _assert_options_equal(seen, options)
    (workspace,) = torch_core.options_of("backward_workspace")
    assert {n: workspace[n] for n in workspace if n != "causal"} == {
        n: _meta(x) for n, x in options.items() if n not in ("causal", "scale")}


def test_torch_options_under_compile_and_opcheck(cft, torch_core):
    """Every option at once through torch.compile(fullgraph=True) (forward and backward) and opcheck."""
    import torch

    options = _torch_case("everything")

    def step(q, k, v):
        out, lse = cft.attention(q, k, v, return_lse=True, **options)
        return out.square().sum() + lse.clamp(min=-1e4).sum(), out

    q, k, v = _torch_qkv(torch.float32)
    _assert_compiled_matches_eager(step, q, k, v)
    for each in torch_core.options_of("forward") + torch_core.options_of("backward"):
        _assert_options_equal(each, options)

    op_options = cft._op_options(options)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (q, k, v, *op_options))
    with torch.no_grad():
        out, lse = cft.attention(q, k, v, return_lse=True, **options)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, *op_options))


# ---------------------------------------------------------------------------------------------------------
# torch: the eager varlen and KV-cache paths (no custom-op dispatch) against the ops' path


class FakeVarlenCore:
    """cuflash's varlen entry points on CPU tensors, computed with the float64 reference; ``calls`` logs them."""

    def __init__(self):
        self.calls = []

    def varlen_backward_workspace(self, q, k, v, cu_q, cu_k, max_q, max_k, **options):
        return {"dq_accum": (q.shape[0], q.shape[1], q.shape[2])}

    def varlen_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, out, lse, stream=None,
                                 deterministic=False, **options):
        self.calls.append("forward")
        o, l = reference.varlen_attention_forward(_f64(q), _f64(k), _f64(v), _np(cu_q), _np(cu_k), max_seqlen_q=max_q,
                                                  max_seqlen_k=max_k, **options)
        _np(out)[...] = o
        _np(lse)[...] = l

    def varlen_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse=None, dq, dk, dv,
                                  workspace, stream=None, deterministic=False, **options):
        self.calls.append("backward")
        assert {n: tuple(w.shape) for n, w in workspace.items()} == {"dq_accum": tuple(q.shape)}
        grads = reference.varlen_attention_backward(_f64(dout), _f64(q), _f64(k), _f64(v), _np(cu_q), _np(cu_k),
                                                    dlse=_f64(dlse), max_seqlen_q=max_q, max_seqlen_k=max_k, **options)
        for buffer, name in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
            _np(buffer)[...] = grads[name]


def test_torch_varlen_eager_path_skips_the_op_dispatch(cft, monkeypatch):
    """An eager varlen call runs the ops' implementations through an autograd.Function (no custom-op dispatch,
    which costs ~3x the adapter's own host time): gradients as the float64 reference's and as the ops' path's
    (under torch.compile), the op itself never called eagerly; without grad, no autograd node at all."""
    import torch

    core = FakeVarlenCore()
    for name in ("varlen_backward_workspace", "varlen_attention_forward", "varlen_attention_backward"):
        monkeypatch.setattr(cuflash, name, getattr(core, name))
    monkeypatch.setattr(cft, "_WORKSPACE_SHAPES", {})
    g = torch.Generator().manual_seed(3)
    cu_q, cu_k = torch.tensor([0, 5, 5, 12], dtype=torch.int32), torch.tensor([0, 7, 9, 13], dtype=torch.int32)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64).float().requires_grad_()
               for shape in ((12, 4, 8), (13, 2, 8), (13, 2, 16)))
    w = torch.randn((12, 4, 16), generator=g)
    options = dict(causal=True, window=(4, None), softcap=3.0)

    def step(q, k, v):
        out, lse = cft.varlen_attention(q, k, v, cu_q, cu_k, 7, 7, return_lse=True, **options)
        return (out * w).sum() + lse.sum(), out

    dispatched = []
    real_op = cft._VARLEN_FORWARD
    monkeypatch.setattr(cft, "_VARLEN_FORWARD", lambda *a: dispatched.append(1) or real_op(*a))
    loss, out = step(q, k, v)
    loss.backward()
    assert not dispatched and type(out.grad_fn).__name__ == "_EagerVarlenBackward"
    assert core.calls == ["forward", "backward"]
    ref_out, _ = reference.varlen_attention_forward(*(_f64(x) for x in (q, k, v)), cu_q.numpy(), cu_k.numpy(),
                                                    **options)
    ref = reference.varlen_attention_backward(w.double().numpy(), *(_f64(x) for x in (q, k, v)), cu_q.numpy(),
                                              cu_k.numpy(), dlse=np.ones((4, 12)), **options)
    torch.testing.assert_close(out.double(), torch.from_numpy(ref_out), rtol=1e-5, atol=1e-5)
    eager = [x.grad.clone() for x in (q, k, v)]
    for x, name in zip((q, k, v), ("dq", "dk", "dv")):
        torch.testing.assert_close(x.grad.double(), torch.from_numpy(ref[name]), rtol=1e-5, atol=1e-5)
        x.grad = None

    loss_c, out_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    loss_c.backward()
    assert dispatched  # traced through the op
    torch.testing.assert_close(out_c, out)
    for x, grad in zip((q, k, v), eager):
        torch.testing.assert_close(x.grad, grad)

    with torch.no_grad():
        plain = cft.varlen_attention(q, k, v, cu_q, cu_k, 7, 7, **options)
    assert plain.grad_fn is None and torch.equal(plain, out.detach())


def test_torch_kvcache_eager_path_bumps_the_caches_versions(cft, monkeypatch):
    """An eager KV-cache call runs the op's implementation directly and, as the op's dispatch would, bumps the
    caches' version counters (autograd then refuses a backward through a cache it saved before the append);
    inputs that require grad go through the op."""
    import torch

    calls = []

    def fake(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, out, lse, **kwargs):
        calls.append(kwargs.get("causal"))
        out.fill_(1.0)
        lse.fill_(0.0)

    monkeypatch.setattr(cuflash, "attention_with_kvcache", fake)
    monkeypatch.setattr(cuflash, "kvcache_workspace", lambda *a, **kw: {})
    monkeypatch.setattr(cft, "_KVCACHE_WORKSPACE", {})
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    dispatched = []
    real_op = cft._KVCACHE
    monkeypatch.setattr(cft, "_KVCACHE", lambda *a: dispatched.append(1) or real_op(*a))

    versions = (k_cache._version, v_cache._version)
    out = cft.attention_with_kvcache(q, k_cache, v_cache, lengths, causal=True)
    assert calls == [True] and not dispatched and bool((out == 1).all())
    assert (k_cache._version, v_cache._version) == (versions[0] + 1, versions[1] + 1)

    cft.attention_with_kvcache(q.requires_grad_(), k_cache, v_cache, lengths, causal=True)
    assert dispatched and calls == [True, True]
