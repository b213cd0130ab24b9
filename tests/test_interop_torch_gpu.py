"""cuflash.interop.torch on a GPU: autograd, opcheck, torch.compile, CUDA graphs, streams, no copies.

Results are judged by the normwise relative error against the float64 ``cuflash.reference``; the
compiled, graph-replayed and side-stream runs must equal eager runs bit for bit (deterministic=True).
"""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.interop.torch as cft  # noqa: E402
from cuflash import reference  # noqa: E402

pytestmark = pytest.mark.gpu

# Normwise relative error allowed against float64, by dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _torch_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")


def _inputs(dtype, *, batch=2, seq_q=128, seq_k=96, heads=4, kv_heads=2, head_dim=64, seed=0,
            requires_grad=True):
    """q, k, v (leaves) and a gradient for out, drawn on the host from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq_q, heads, head_dim), (batch, seq_k, kv_heads, head_dim),
              (batch, seq_k, kv_heads, head_dim), (batch, seq_q, heads, head_dim)]
    arrays = [torch.randn(s, generator=g).to("cuda", dtype) for s in shapes]
    return [x.requires_grad_(requires_grad) for x in arrays[:3]] + arrays[3:]


def _f64(t) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _error(actual, expected) -> float:
    return reference.relative_error(_f64(actual), expected)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_autograd_matches_reference(dtype, causal):
    q, k, v, dout = _inputs(dtype)  # GQA 4/2, Sq != Sk (bottom-right causal)
    out, lse = cft.attention(q, k, v, causal=causal, return_lse=True)
    dlse = torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))

    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref_out, ref_lse = reference.attention_forward(q64, k64, v64, causal=causal)
    ref = reference.attention_backward(_f64(dout), q64, k64, v64, dlse=_f64(dlse), causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert _error(out, ref_out) < TOLERANCE[dtype]
    assert _error(lse, ref_lse) < LSE_TOLERANCE
    for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
        assert x.grad.dtype == dtype
        assert _error(x.grad, ref[name]) < TOLERANCE[dtype], name


def test_opcheck():
    q, k, v, dout = _inputs(torch.float16, batch=1, seq_q=32, seq_k=48)
    options = cft._op_options({"causal": True})
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (q, k, v, *options))
    with torch.no_grad():
        out, lse = cft.attention(q, k, v, causal=True, return_lse=True)
    q, k, v = (x.detach() for x in (q, k, v))
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (dout, q, k, v, out, lse, torch.randn_like(lse), *options))
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default, (dout, q, k, v, out, lse, None, *options))


def _step(q, k, v, w):
    out, lse = cft.attention(q, k, v, causal=True, return_lse=True, deterministic=True)
    return (out.float() * w).sum() + lse.sum(), out


def test_compile_fullgraph_matches_eager():
    q, k, v, dout = _inputs(torch.bfloat16, seq_q=64, seq_k=80)
    w = dout.float()
    loss, out = _step(q, k, v, w)
    loss.backward()
    eager = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None

    loss_c, out_c = torch.compile(_step, fullgraph=True)(q, k, v, w)
    loss_c.backward()
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)
    torch.testing.assert_close(loss_c, loss)  # the sum itself may be reduced in another order
    for x, g in zip((q, k, v), eager):
        torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


def test_cuda_graph_replays_forward_and_backward():
    q, k, v, dout = _inputs(torch.bfloat16, seq_q=64, seq_k=64)
    static_dout = dout.clone()

    def run():
        out = cft.attention(q, k, v, causal=True, deterministic=True)
        out.backward(static_dout)
        return out

    # Warm up on a side stream (compiles and loads the kernels, caches the workspace shapes).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for x in (q, k, v):
                x.grad = None
            run()
    torch.cuda.current_stream().wait_stream(side)
    for x in (q, k, v):
        x.grad = None

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()

    q2, k2, v2, dout2 = _inputs(torch.bfloat16, seq_q=64, seq_k=64, seed=1)
    with torch.no_grad():
        for static, new in zip((q, k, v, static_dout), (q2, k2, v2, dout2)):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()

    expected = cft.attention(q2, k2, v2, causal=True, deterministic=True)
    expected.backward(dout2)
    assert torch.equal(static_out, expected)
    for static, new in zip((q, k, v), (q2, k2, v2)):
        assert torch.equal(static.grad, new.grad)


def test_side_stream_is_ordered_without_extra_sync(monkeypatch):
    q, k, v, dout = _inputs(torch.float16)
    expected = cft.attention(q, k, v, causal=True, deterministic=True)
    expected.backward(dout)
    expected_grads = [x.grad for x in (q, k, v)]
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # q, k, v, dout were made on the default stream

    waits = []  # torch's DLPack export makes a stream wait on an event when streams differ
    wait_event = torch.cuda.Stream.wait_event
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda s, e: (waits.append(s), wait_event(s, e))[1])

    torch.cuda.set_sync_debug_mode("error")  # any host sync inside torch raises
    try:
        with torch.cuda.stream(side):
            # Fresh leaves made on the side stream, so autograd's own AccumulateGrad nodes live there
            # too (leaves from the default stream make torch itself insert waits).
            # dout too: a gradient from another stream makes autograd insert its own (legitimate) wait.
            leaves = [torch.zeros_like(x).requires_grad_() for x in (q, k, v)]
            dout_side = torch.zeros_like(dout)
            with torch.no_grad():
                torch.cuda._sleep(100_000_000)  # keep the side stream busy: a launch elsewhere reads zeros
                for leaf, x in zip(leaves, (q, k, v)):
                    leaf.copy_(x)
                dout_side.copy_(dout)
            q_side, k_side, v_side = leaves
            out = cft.attention(q_side, k_side, v_side, causal=True, deterministic=True)
            out.backward(dout_side)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    assert not waits
    assert torch.equal(out, expected)
    for leaf, grad in zip(leaves, expected_grads):
        assert torch.equal(leaf.grad, grad)


def test_no_copy(monkeypatch):
    """Strided (bhsd viewed as bshd) inputs reach the kernel at their own address; out is torch's."""
    bhsd = [torch.randn(2, h, 64, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2)]
    q, k, v = (x.transpose(1, 2) for x in bhsd)
    assert cupy.from_dlpack(q).data.ptr == q.data_ptr()

    seen = {}
    forward = cuflash.attention_forward

    def spy(q_, k_, v_, *, out, lse, **options):
        # The adapter hands the core the tensors themselves; the core reads their pointers and strides.
        seen["q"] = q_.data_ptr()
        seen["q_strides"] = q_.stride()
        seen["out"] = out.data_ptr()
        result = forward(q_, k_, v_, out=out, lse=lse, **options)
        assert result[0] is out and result[1] is lse  # the core returns the buffers it was given
        seen["returned"] = result[0].data_ptr()
        return result

    monkeypatch.setattr(cuflash, "attention_forward", spy)
    out = cft.attention(q, k, v)
    assert seen["q"] == q.data_ptr()
    assert seen["q_strides"] == q.stride()  # the strided view itself, not a copy
    assert seen["returned"] == seen["out"] == out.data_ptr()

    # The core itself, given torch buffers, writes them in place (twice: the second call is a cache hit).
    out_t = torch.empty(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16)
    lse_t = torch.empty(2, 4, 64, device="cuda", dtype=torch.float32)
    for _ in range(2):
        out_t.zero_()
        o, row_lse = forward(q, k, v, out=out_t, lse=lse_t, stream=torch.cuda.current_stream().cuda_stream)
        assert o is out_t and row_lse is lse_t
        assert torch.equal(out_t, out)


def _poison_torch_cache():
    """Fill blocks of torch's caching allocator with 0xFF bytes (NaN in every float format) and hand
    them back to its cache, so the next torch.empty of a similar size returns poisoned memory (a fresh
    cudaMalloc is often zero, which hides a kernel that leaves part of an output unwritten)."""
    blocks = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (512, 4096, 1 << 16, 1 << 20, 1 << 22)
              for _ in range(8)]
    for block in blocks:
        block.fill_(0xFF)
    torch.cuda.synchronize()
    del blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_rows_that_see_no_key_on_reused_memory(dtype):
    """Issue 9's report: B=1, Sq=777, Sk=1, H=Hkv=4, D=24, causal (every row but the last sees no key),
    through the torch adapter on memory torch's cache hands back used. Every gradient finite and
    right; the rows that see no key get dq = 0."""
    q, k, v, dout = _inputs(dtype, batch=1, seq_q=777, seq_k=1, heads=4, kv_heads=4, head_dim=24, seed=9)
    _poison_torch_cache()
    out = cft.attention(q, k, v, causal=True)
    _poison_torch_cache()
    out.backward(dout)
    torch.cuda.synchronize()
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    ref_out, _ = reference.attention_forward(q64, k64, v64, causal=True)
    ref = reference.attention_backward(_f64(dout), q64, k64, v64, causal=True)
    assert _error(out, ref_out) < TOLERANCE[dtype]
    for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
        assert bool(torch.isfinite(x.grad).all()), f"{name} has non-finite entries"
        scale = float(np.abs(ref[name]).max()) + 1.0
        assert float((x.grad.double().cpu() - torch.from_numpy(ref[name])).abs().max()) < 1e-2 * scale, name
    assert bool((q.grad[:, :776] == 0).all()), "dq of rows that see no key is not 0"


def _option_cases(batch, seq_q, seq_k, heads, seed=3):
    """window + causal, softcap + ALiBi, segment ids, block ids (the cases of test_interop_jax_gpu.py,
    so the two share compiled kernels; the slopes here are per batch element, (B, H))."""
    rng = np.random.default_rng(seed)

    def ids(seq):  # sorted: documents / blocks are runs; some query rows see no key
        return torch.from_numpy(np.sort(rng.integers(0, 3, (batch, seq)), axis=1).astype(np.int32)).cuda()

    slopes = 2.0 ** -np.arange(1, heads + 1, dtype=np.float32)
    slopes = np.stack([slopes, slopes[::-1]])[:batch].copy()
    return {
        "window_causal": {"causal": True, "window": (16, None)},
        "softcap_alibi": {"softcap": 2.0, "alibi_slopes": torch.from_numpy(slopes).cuda()},
        "segment_ids": {"segment_ids": (ids(seq_q), ids(seq_k))},
        "block_ids": {"block_ids": (ids(seq_q), ids(seq_k))},
    }


def _host_options(options: dict) -> dict:
    def host(x):
        if isinstance(x, tuple):
            return tuple(host(item) for item in x)
        return x.cpu().numpy() if isinstance(x, torch.Tensor) else x

    return {name: host(value) for name, value in options.items()}


def test_options_under_compile_fullgraph():
    """window, softcap, alibi_slopes, segment_ids and block_ids in one torch.compile(fullgraph=True) step
    (forward and backward of each case, on leaves of its own), bf16 at odd sizes, against float64."""
    q, k, v, dout = _inputs(torch.bfloat16, batch=2, seq_q=37, seq_k=53, heads=4, kv_heads=2, head_dim=40,
                            seed=4, requires_grad=False)
    cases = _option_cases(2, 37, 53, 4)
    leaves = {name: [x.clone().requires_grad_() for x in (q, k, v)] for name in cases}

    def step(leaves, dout):
        outs, loss = {}, 0
        for name, (q_, k_, v_) in leaves.items():
            outs[name] = cft.attention(q_, k_, v_, **cases[name])
            loss = loss + (outs[name].float() * dout.float()).sum()
        return loss, outs

    loss, outs = torch.compile(step, fullgraph=True)(leaves, dout)
    loss.backward()
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    for name, options in cases.items():
        options = _host_options(options)
        ref_out, _ = reference.attention_forward(q64, k64, v64, **options)
        ref = reference.attention_backward(_f64(dout), q64, k64, v64, **options)
        assert outs[name].dtype == torch.bfloat16
        assert _error(outs[name], ref_out) < TOLERANCE[torch.bfloat16], name
        for grad_name, x in zip(("dq", "dk", "dv"), leaves[name]):
            assert x.grad.dtype == torch.bfloat16
            assert bool(torch.isfinite(x.grad).all()), (name, grad_name)
            assert _error(x.grad, ref[grad_name]) < TOLERANCE[torch.bfloat16], (name, grad_name)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("kind", ["full", "heads", "expanded"])
def test_bias_gets_its_gradient(kind, compiled):
    """A learnable bias through autograd (eagerly and under torch.compile(fullgraph=True)): a full
    (B, H, Sq, Sk) leaf, a (1, H, Sq, Sk) leaf the kernels sum over the batch, and a (1, H, Sq, Sk) leaf
    expanded to the full shape (stride 0: torch's expand backward sums the full dbias); bf16, causal,
    GQA, odd sizes, against float64."""
    batch, seq_q, seq_k, heads = 2, 37, 53, 4
    q, k, v, dout = _inputs(torch.bfloat16, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=2,
                            head_dim=40, seed=11)
    g = torch.Generator().manual_seed(12)
    shape = (batch, heads, seq_q, seq_k) if kind == "full" else (1, heads, seq_q, seq_k)
    leaf = torch.randn(shape, generator=g).to("cuda", torch.bfloat16).requires_grad_()

    def step(q, k, v, leaf):
        bias = leaf.expand(batch, heads, seq_q, seq_k) if kind == "expanded" else leaf
        return cft.attention(q, k, v, causal=True, bias=bias)

    out = (torch.compile(step, fullgraph=True) if compiled else step)(q, k, v, leaf)
    out.backward(dout)
    q64, k64, v64, bias64 = (_f64(x) for x in (q, k, v, leaf))
    ref_out, _ = reference.attention_forward(q64, k64, v64, causal=True, bias=bias64)
    ref = reference.attention_backward(_f64(dout), q64, k64, v64, causal=True, bias=bias64)
    assert _error(out, ref_out) < TOLERANCE[torch.bfloat16]
    for name, x in zip(("dq", "dk", "dv", "dbias"), (q, k, v, leaf)):
        assert x.grad is not None and x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape, name
        assert bool(torch.isfinite(x.grad).all()), name
        assert _error(x.grad, ref[name]) < TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_a_bias_without_grad_is_a_constant(compiled):
    """An additive key-padding mask (B, 1, 1, Sk) with -inf keys and requires_grad=False, deterministic=True (which
    would refuse to order its dbias adds): the backward makes no dbias (bias_grad=False), q / k / v grads match
    float64 and repeat bit for bit, the bias gets no .grad; bf16, causal, GQA, odd sizes."""
    batch, seq_q, seq_k, heads = 2, 37, 53, 4
    q, k, v, dout = _inputs(torch.bfloat16, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=2,
                            head_dim=40, seed=21)
    g = torch.Generator().manual_seed(22)
    bias = torch.randn((batch, 1, 1, seq_k), generator=g)
    bias[0, 0, 0, 40:] = float("-inf")  # padded keys of batch row 0
    bias = bias.to("cuda", torch.bfloat16)

    def step(q, k, v):
        return cft.attention(q, k, v, causal=True, bias=bias, deterministic=True)

    run = torch.compile(step, fullgraph=True) if compiled else step
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        out = run(q, k, v)
        out.backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    assert bias.grad is None
    q64, k64, v64, bias64 = (_f64(x) for x in (q, k, v, bias))
    ref = reference.attention_backward(_f64(dout), q64, k64, v64, causal=True, bias=bias64)
    for name, first, second in zip(("dq", "dk", "dv"), *grads):
        assert bool(torch.isfinite(first).all()), name
        assert _error(first, ref[name]) < TOLERANCE[torch.bfloat16], name
        assert torch.equal(first.view(torch.int16), second.view(torch.int16)), name


def test_bool_mask_under_compile():
    """A per-kv-head bool mask (no gradient) through torch.compile(fullgraph=True), bf16, against float64."""
    batch, seq_q, seq_k, heads = 2, 37, 53, 4
    q, k, v, dout = _inputs(torch.bfloat16, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=2,
                            head_dim=40, seed=15)
    g = torch.Generator().manual_seed(16)
    mask = (torch.rand((batch, 2, seq_q, seq_k), generator=g) < 0.7).cuda()
    mask[:, :, 5, :] = False  # a row that sees nothing
    out = torch.compile(lambda q, k, v: cft.attention(q, k, v, mask=mask), fullgraph=True)(q, k, v)
    out.backward(dout)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    m = mask.cpu().numpy()
    ref_out, _ = reference.attention_forward(q64, k64, v64, mask=m)
    ref = reference.attention_backward(_f64(dout), q64, k64, v64, mask=m)
    assert _error(out, ref_out) < TOLERANCE[torch.bfloat16]
    assert bool((out[:, 5] == 0).all())
    for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
        assert bool(torch.isfinite(x.grad).all()), name
        assert _error(x.grad, ref[name]) < TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_varlen_gets_gradients(compiled):
    """Packed sequences (lengths 0, 1, 37, 130; Sq != Sk; ALiBi per sequence) through autograd, eagerly and
    under torch.compile(fullgraph=True), bf16, causal, GQA, against the float64 varlen reference."""
    lens_q, lens_k = (37, 0, 1, 130), (50, 3, 1, 100)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(21)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = (torch.randn(shape, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for shape in ((tq, 4, 64), (tk, 2, 64), (tk, 2, 64)))
    dout = torch.randn((tq, 4, 64), generator=g).to("cuda", torch.bfloat16)
    slopes = torch.rand((4, 4), generator=g).cuda() * 0.3

    def step(q, k, v):
        return cft.varlen_attention(q, k, v, cu_q, cu_k, 130, 100, causal=True, alibi_slopes=slopes)

    out = (torch.compile(step, fullgraph=True) if compiled else step)(q, k, v)
    out.backward(dout)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    options = dict(causal=True, alibi_slopes=slopes.cpu().numpy())
    cu = (cu_q.cpu().numpy(), cu_k.cpu().numpy())
    ref_out, _ = reference.varlen_attention_forward(q64, k64, v64, *cu, **options)
    ref = reference.varlen_attention_backward(_f64(dout), q64, k64, v64, *cu, **options)
    assert _error(out, ref_out) < TOLERANCE[torch.bfloat16]
    for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
        assert x.grad is not None and x.grad.shape == x.shape and bool(torch.isfinite(x.grad).all()), name
        assert _error(x.grad, ref[name]) < TOLERANCE[torch.bfloat16], name


def test_dropout_through_autograd_reuses_the_forward_seed():
    """dropout_p without a seed: the adapter draws one from torch's generator (torch.manual_seed reproduces
    it) and the backward regenerates the same mask; with an explicit seed the gradients equal the core's."""
    q, k, v, dout = _inputs(torch.bfloat16, batch=2, seq_q=70, seq_k=90, heads=4, kv_heads=2, head_dim=64, seed=31)

    def grads_of(**options):
        for x in (q, k, v):
            x.grad = None
        out = cft.attention(q, k, v, causal=True, deterministic=True, **options)
        out.backward(dout)
        return [out.detach().clone()] + [x.grad.clone() for x in (q, k, v)]

    torch.manual_seed(5)
    first = grads_of(dropout_p=0.3)
    torch.manual_seed(5)
    again = grads_of(dropout_p=0.3)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    explicit = grads_of(dropout_p=0.3, seed=1234)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    out, lse = torch.empty_like(qd), qd.new_empty((2, 4, 70), dtype=torch.float32)
    cuflash.attention_forward(qd, kd, vd, causal=True, dropout_p=0.3, seed=1234, out=out, lse=lse,
                              stream=torch.cuda.current_stream().cuda_stream)
    core = [torch.empty_like(x) for x in (qd, kd, vd)]
    cuflash.attention_backward(dout, qd, kd, vd, out, lse, causal=True, deterministic=True, dropout_p=0.3, seed=1234,
                               dq=core[0], dk=core[1], dv=core[2], stream=torch.cuda.current_stream().cuda_stream)
    assert torch.equal(explicit[0], out)
    for got, want in zip(explicit[1:], core):
        assert torch.equal(got, want)
    compiled = torch.compile(lambda q, k, v: cft.attention(q, k, v, causal=True, dropout_p=0.3, seed=1234),
                             fullgraph=True)(q, k, v)
    assert torch.equal(compiled, explicit[0])


def _kvcache_inputs(seed=4, B=3, L=256, H=8, Hkv=2, D=64, snew=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((B, snew, H, D), generator=g).to("cuda", torch.bfloat16)
    k_cache, v_cache = (torch.randn((B, L, Hkv, D), generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn((B, snew, Hkv, D), generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([0, 17, L - snew], dtype=torch.int32, device="cuda")[:B]
    return q, k_cache, v_cache, k_new, v_new, lengths


def _kvcache_reference(q, k_cache, v_cache, k_new, v_new, lengths, **options):
    """Per batch: the float64 reference over the cache after the append (also checks the append)."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b]) + k_new.shape[1]
        k = torch.cat([k_cache[b, :int(lengths[b])], k_new[b]])[None]
        v = torch.cat([v_cache[b, :int(lengths[b])], v_new[b]])[None]
        outs.append(reference.attention_forward(_f64(q[b:b + 1]), _f64(k), _f64(v), **options)[0])
        assert n <= k_cache.shape[1]
    return np.concatenate(outs)


@pytest.mark.parametrize("mode", ["eager", "compiled", "graph"])
def test_kvcache_op_appends_and_attends(mode):
    """cft.attention_with_kvcache: eagerly, under torch.compile(fullgraph=True) and replayed from a CUDA graph
    (captured after one warm-up call, lengths and q changed in place before the replay): the caches hold the
    appended tokens and out matches the float64 reference over them."""
    q, k_cache, v_cache, k_new, v_new, lengths = _kvcache_inputs()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    options = dict(causal=True, window=(50, None), softcap=30.0)

    def step(q, k_cache, v_cache, k_new, v_new, lengths):
        return cft.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, num_splits=2, **options)

    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(q, k_cache.clone(), v_cache.clone(), k_new, v_new, lengths)  # compiles, loads, sizes the workspace
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        static_q, static_lengths = q.clone(), torch.zeros_like(lengths)
        with torch.cuda.graph(graph):
            out = step(static_q, k_cache, v_cache, k_new, v_new, static_lengths)
        k_cache.copy_(before_k), v_cache.copy_(before_v)  # the capture ran nothing; keep the caches pristine anyway
        static_q.copy_(q), static_lengths.copy_(lengths)
        graph.replay()
    else:
        fn = torch.compile(step, fullgraph=True) if mode == "compiled" else step
        out = fn(q, k_cache, v_cache, k_new, v_new, lengths)
    torch.cuda.synchronize()
    for b in range(q.shape[0]):
        n0, n1 = int(lengths[b]), int(lengths[b]) + k_new.shape[1]
        assert torch.equal(k_cache[b, n0:n1], k_new[b]) and torch.equal(v_cache[b, n0:n1], v_new[b])
        assert torch.equal(k_cache[b, :n0], before_k[b, :n0]) and torch.equal(k_cache[b, n1:], before_k[b, n1:])
    ref = _kvcache_reference(q, before_k, before_v, k_new, v_new, lengths, **options)
    assert out.shape == q.shape and _error(out, ref) < TOLERANCE[torch.bfloat16]


_AUTOGRAD_THREAD_SCRIPT = """
import sys
import torch
import cuflash.interop.torch as cft
T = sys.modules["cuflash.interop.torch"]
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, dout = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
opts = T._op_options({})
for _ in range(3):  # without autograd, on this thread: torch's cache then holds every buffer the backward takes
    out, lse = T._attention_fwd(q, k, v, *opts)
    T._attention_bwd(dout, q, k, v, out, lse, None, *opts)
expected = T._attention_bwd(dout, q, k, v, out, lse, None, *opts)[0]
qg = q.detach().requires_grad_()
cft.attention(qg, k, v).backward(dout)  # the first CUDA work of autograd's worker thread
torch.cuda.synchronize()
print("max difference", float((qg.grad.float() - expected.float()).abs().max()))
"""


def test_backward_on_a_fresh_autograd_thread():
    """A fresh process whose first backward runs on autograd's worker thread with every buffer from torch's
    cache: that thread had no CUDA context current and the launch failed (CUDA_ERROR_INVALID_CONTEXT, H100,
    session 19) until cuflash bound the device's context itself (cuflash.launch.ensure_context). Its dq must
    match the same backward called without autograd (the atomic dQ adds may order differently)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _AUTOGRAD_THREAD_SCRIPT], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    difference = float(done.stdout.split("max difference")[-1])
    assert difference < 2e-2, done.stdout
