"""The bias loaded by TMA on sm_90a (cuflash/tma.py, cuda_src/cuflash/tma_sm90.cuh).

Where the bias has 16-byte rows of contiguous keys (and is not broadcast over queries or keys), the
warp-specialized forward and dK/dV kernels load its staged tiles by TMA from a tensor map the launch passes.
These problems are the ones that take that path (keys a multiple of 8, 16-bit, head dims 64 / 128): odd query
counts and key counts off the 64-key box edge (zeros past Sq / Sk), every broadcast form a map can describe,
-inf and +-30 entries, with softcap / ALiBi and with the general mask, against float64. Then what the map adds:
a strided bias view, a cached call with another bias buffer, and bit-identity with the cp.async copies.
"""
from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import gpu_utils as gu  # noqa: E402
from gpu_utils import poisoned_allocations  # noqa: E402,F401  (autouse: CuPy allocations start as NaN)
from gpu_utils import Problem  # noqa: E402

from cuflash import api, tma  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session", autouse=True)
def _precompiled(request):
    gu.announce_precompile(request.config)


@pytest.fixture(autouse=True)
def _hopper():
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("TMA loads run on the sm_90a kernels")
    assert tma._encoder() is not None, "the driver's cuTensorMapEncodeTiled could not be loaded"


def _uses_tma(bias) -> bool:
    strides = [st // bias.itemsize if n > 1 else 0 for n, st in zip(bias.shape, bias.strides)]
    return tma.bias_map(bias.shape, strides, bias.itemsize, bias.data.ptr) is not None


TMA_PROBLEMS = [
    Problem("bf16", B=2, Sq=77, Sk=200, H=4, Hkv=2, D=128, bias="full"),
    Problem("fp16", B=2, Sq=130, Sk=136, H=4, Hkv=2, D=64, bias="full", causal=True, deterministic=True),
    Problem("bf16", B=2, Sq=65, Sk=264, H=6, Hkv=2, D=128, bias="heads", dlse=True),
    Problem("fp16", B=1, Sq=200, Sk=96, H=6, Hkv=3, D=64, bias="kv", causal=True),
    Problem("bf16", B=2, Sq=100, Sk=160, H=4, Hkv=4, D=128, bias="expanded", deterministic=True),
    Problem("bf16", B=1, Sq=129, Sk=256, H=4, Hkv=1, D=128, bias="neginf", deterministic=True),
    Problem("fp16", B=2, Sq=99, Sk=128, H=2, Hkv=1, D=64, bias="large", causal=True),
    Problem("bf16", B=1, Sq=150, Sk=200, H=4, Hkv=2, D=128, bias="full", softcap=3.0, alibi="bh"),
    Problem("bf16", B=2, Sq=140, Sk=176, H=4, Hkv=2, D=64, bias="full", window=(40, 6), segments="docs"),
    Problem("fp16", B=1, Sq=300, Sk=512, H=4, Hkv=2, D=128, bias="heads", blocks="blocks"),
    Problem("bf16", B=2, Sq=1000, Sk=1024, H=4, Hkv=2, D=128, bias="full", causal=True),
]


def _fresh_deterministic_call(p, x):
    """Forward and deterministic backward of ``x`` through new plans: (the backward's CallPlan, outputs)."""
    kwargs = dict(gu.option_kwargs(p, x), causal=p.causal, scale=p.softmax_scale)
    api._forward_plans.clear()
    api._backward_plans.clear()
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, **kwargs)
    grads = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, deterministic=True, **kwargs)
    return next(iter(api._backward_plans.values()), None), (out, lse, *grads)


@pytest.mark.parametrize("p", TMA_PROBLEMS, ids=gu.problem_ids(TMA_PROBLEMS))
def test_tma_bias_against_float64(p):
    x = gu.make_inputs(p)
    assert _uses_tma(x.bias), "this problem was meant to take the TMA path"
    gu.check_attention(p, inputs=x)


def test_strided_bias_view_reads_only_its_own_elements():
    """A bias whose rows are a view into wider rows (NaN between them) loads by TMA with its row stride."""
    p = Problem("bf16", B=2, Sq=90, Sk=136, H=4, Hkv=2, D=128, bias="full", dlse=True)
    x = gu.make_inputs(p)
    wide = gu.nan_fill(cupy.empty((p.B, p.H, p.Sq, p.Sk + 24), dtype=x.bias.dtype))
    wide[..., :p.Sk] = x.bias
    x.bias = wide[..., :p.Sk]
    assert _uses_tma(x.bias)
    gu.check_attention(p, inputs=x)


def test_a_cached_forward_with_another_bias_loads_that_bias():
    """The second call hits the plan cache with a different bias buffer: its output must be what a fresh,
    validating call gives for that bias (the launch re-encodes the map), and not the first call's."""
    p = Problem("bf16", B=2, Sq=200, Sk=256, H=4, Hkv=2, D=128, bias="full")
    x = gu.make_inputs(p)
    y = gu.make_inputs(p, seed=p.seed + 1)
    api._forward_plans.clear()
    out1, _ = cuflash.attention_forward(x.q, x.k, x.v, bias=x.bias)
    out2, _ = cuflash.attention_forward(x.q, x.k, x.v, bias=y.bias)  # a hit
    assert len(api._forward_plans) == 1
    api._forward_plans.clear()
    fresh, _ = cuflash.attention_forward(x.q, x.k, x.v, bias=y.bias)
    assert gu.bit_identical(out2, fresh)
    assert not gu.bit_identical(out1, out2)


@pytest.mark.parametrize("p", [TMA_PROBLEMS[0], TMA_PROBLEMS[1], TMA_PROBLEMS[8]],
                         ids=gu.problem_ids([TMA_PROBLEMS[0], TMA_PROBLEMS[1], TMA_PROBLEMS[8]]))
def test_tma_and_cp_async_copies_give_identical_bits(p, monkeypatch):
    """The same staged tiles either way: forward and backward outputs bit for bit."""
    x = gu.make_inputs(p)
    _, with_tma = _fresh_deterministic_call(p, x)
    monkeypatch.setattr(tma, "_encode", lambda *args: None)  # the driver "refuses": cp.async copies
    assert not _uses_tma(x.bias)
    _, without = _fresh_deterministic_call(p, x)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), with_tma, without, strict=True):
        assert gu.bit_identical(a, b), f"{name} differs between the TMA and the cp.async bias loads"


QKV_PROBLEMS = [
    Problem("bf16", B=2, Sq=300, Sk=277, H=4, Hkv=2, D=128, causal=True),
    Problem("fp16", B=1, Sq=1000, Sk=1000, H=2, Hkv=1, D=64),
    Problem("bf16", B=2, Sq=130, Sk=200, H=2, Hkv=2, D=256, causal=True),
    Problem("bf16", B=1, Sq=150, Sk=170, H=4, Hkv=2, D=112, window=(40, 6)),
    Problem("fp16", B=2, Sq=70, Sk=129, H=2, Hkv=1, D=40, causal=True),
    Problem("fp16", B=2, Sq=90, Sk=136, H=4, Hkv=2, D=128, bias="full", softcap=3.0),
    # Long unmasked and causal D256 heads (forward.D256_WIDE_MIN_KEYS): 80-key tiles, whose K / V boxes are whole
    # tiles; 8269 keys end 29 into the last tile, 8192 exactly 32 into it; D232 (the 256 bucket: D200 would be 224's,
    # which is not warp-specialized) leaves zero columns past D; causal with 300 queries against 8269 keys (the
    # diagonal crosses the last four key tiles, bottom-right aligned). test_plans checks that these plan that tile.
    Problem("bf16", B=1, Sq=190, Sk=8269, H=2, Hkv=1, D=256),
    Problem("fp16", B=2, Sq=70, Sk=8192, H=2, Hkv=2, D=232),
    Problem("bf16", B=1, Sq=300, Sk=8269, H=2, Hkv=1, D=256, causal=True),
]


@pytest.mark.parametrize("p", QKV_PROBLEMS, ids=gu.problem_ids(QKV_PROBLEMS))
def test_qkv_by_tma_against_float64_and_cp_async(p, monkeypatch):
    """The warp-specialized forward's Q / K / V by TMA (odd lengths: zero rows past S; D112 in the 128 bucket and
    D40 in the 64 one: zero columns past D) against float64, then bit for bit against the cp.async copies. (D96
    has a tile of its own, not warp-specialized: session 22's run of this test took it and found no map.)"""
    x = gu.make_inputs(p)
    api._forward_plans.clear()
    gu.check_attention(p, inputs=x, backward=False)
    kwargs = dict(gu.option_kwargs(p, x), causal=p.causal, scale=p.softmax_scale)
    api._forward_plans.clear()
    with_tma = cuflash.attention_forward(x.q, x.k, x.v, **kwargs)
    plan = next(iter(api._forward_plans.values()))
    assert plan._qkv_maps is not None, "this problem was meant to load Q / K / V by TMA"
    monkeypatch.setattr(tma, "_encode", lambda *args: None)
    api._forward_plans.clear()
    without = cuflash.attention_forward(x.q, x.k, x.v, **kwargs)
    assert next(iter(api._forward_plans.values()))._qkv_maps is None
    for name, a, b in zip(("out", "lse"), with_tma, without, strict=True):
        assert gu.bit_identical(a, b), f"{name} differs between TMA and cp.async loads of Q / K / V"


DQ_WRITER_PROBLEMS = [
    Problem("bf16", B=2, Sq=300, Sk=277, H=4, Hkv=2, D=128, causal=True, deterministic=True),
    Problem("fp16", B=1, Sq=1000, Sk=1000, H=2, Hkv=1, D=64, deterministic=True),
    Problem("bf16", B=2, Sq=513, Sk=700, H=3, Hkv=3, D=128, deterministic=True),
    Problem("bf16", B=1, Sq=200, Sk=136, H=4, Hkv=2, D=128, bias="full", deterministic=True),
]


@pytest.mark.parametrize("p", DQ_WRITER_PROBLEMS, ids=gu.problem_ids(DQ_WRITER_PROBLEMS))
def test_deterministic_dq_adds_same_bits_on_their_own_warp(p, monkeypatch):
    """The deterministic backward's ordered dQ adds run on a warp of their own where Q / dO come by TMA
    (dkdv_mainloop_sm90_ws.cuh, dq_writer_warp) and on the load thread where they come by cp.async: the same adds
    in the same order, so every gradient bit for bit; against float64 first."""
    x = gu.make_inputs(p)
    gu.check_attention(p, inputs=x)
    plan, own_warp = _fresh_deterministic_call(p, x)
    assert plan is not None and plan._qkv_maps is not None, "this problem was meant to load Q / dO by TMA"
    monkeypatch.setattr(tma, "_encode", lambda *args: None)  # the driver "refuses": cp.async, adds on the load thread
    _, load_thread = _fresh_deterministic_call(p, x)
    names = ("out", "lse", "dq", "dk", "dv", "dbias")
    for name, a, b in zip(names, own_warp, load_thread):
        assert gu.bit_identical(a, b), f"{name} differs between the dQ adds on their own warp and on the load thread"


FIRST_STORE_PROBLEMS = [
    # Causal with more queries than keys (bottom-right aligned): the first 270 rows, four whole 64-row blocks, see no
    # key, so no dQ add reaches them and the convert must write their zeros itself.
    Problem("bf16", B=2, Sq=400, Sk=130, H=4, Hkv=2, D=128, causal=True),
    Problem("fp16", B=1, Sq=700, Sk=200, H=2, Hkv=1, D=64, causal=True),  # D64: 128-row blocks
    Problem("bf16", B=2, Sq=400, Sk=130, H=4, Hkv=2, D=128, causal=True, deterministic=True),
    # A run of query rows whose id no key has (whole blocks skipped by the key blocks' lists), odd lengths.
    Problem("bf16", B=2, Sq=701, Sk=650, H=3, Hkv=1, D=128, segments="qonly"),
    Problem("fp16", B=2, Sq=333, Sk=301, H=4, Hkv=2, D=64, window=(50, 0)),
    # Many key blocks adding into each query block (the waits for the first store), a bias by TMA beside them.
    Problem("bf16", B=2, Sq=257, Sk=1500, H=4, Hkv=1, D=64),
    Problem("fp16", B=2, Sq=190, Sk=1000, H=4, Hkv=2, D=128, bias="full"),
]


@pytest.mark.parametrize("p", FIRST_STORE_PROBLEMS, ids=gu.problem_ids(FIRST_STORE_PROBLEMS))
def test_first_dq_stores_against_float64(p):
    """Where the warp-specialized dK/dV kernel finds Q / dO by TMA, the pre-pass leaves dq_accum (NaN-poisoned
    here) unzeroed (cuda_src/cuflash/dq_order.cuh, first_store): each query block's first dQ add stores instead, the
    default backward's other adds wait until that store is complete, and the convert writes zeros where no add
    came. Against float64 (no NaN: every element written), with the plan checked to take that path."""
    import numpy as np
    from cuflash.params import params_dtype

    x = gu.make_inputs(p)
    api._backward_plans.clear()
    gu.check_attention(p, inputs=x)
    plans = list(api._backward_plans.values())
    assert len(plans) == 1 and plans[0]._qkv_maps is not None, "this problem was meant to load Q / dO by TMA"
    fields = np.frombuffer(plans[0].params, dtype=params_dtype())[0]
    assert fields["dq_order_offset"] != 0 and fields["dq_ordered"] == int(p.deterministic)
