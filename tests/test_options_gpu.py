"""Attention options on a GPU: sliding window, softcap, ALiBi, segment ids, block ids and an additive bias
(with dbias), alone and combined, forward and backward against the float64 reference (gpu_utils' rule,
NaN-poisoned buffers).

- ``test_options``: every option alone and the pairs models use (window + causal, softcap + ALiBi,
  segment ids + causal, block ids + window, segment + block ids, softcap + segment ids, ALiBi + window,
  ...) plus everything at once, x fp16 / bf16 / fp32, over odd shapes (Sq, Sk not multiples of 64,
  Sq != Sk both ways, GQA 6/2, MQA, head dims 40 .. 256, Dv != D once), some with dlse and some
  deterministic; two cases at ~1000 tokens.
- Sorted ids (the kernels test each row's range of keys) against ids sorted only within 64-query / 128-key
  blocks of one batch row (the pre-pass must see the descents and keep reading ids there), past 256 rows.
- Rows with nothing visible (ids found only in q, a zero-width window with Sq > Sk, block ids below
  every key's, ids that never match): out exactly 0, lse -inf, dq 0, dk = dv = 0 for keys nobody sees,
  never NaN, with dlse too.
- deterministic=True backward bit-identical across runs with options; the ids and slopes arrays are
  not written; ``cuflash.attention`` and a ``backward_workspace`` computed with the options agree
  bit for bit with the plain calls.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import gpu_utils as gu  # noqa: E402
from gpu_utils import poisoned_allocations  # noqa: E402,F401  (autouse: CuPy allocations start as NaN)
from gpu_utils import Problem  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session", autouse=True)
def _precompiled(request):
    gu.announce_precompile(request.config)


# --------------------------------------------------------------------------------------------
# Each option alone, the common pairs, everything at once
# --------------------------------------------------------------------------------------------

#: name -> Problem fields. Softcaps below the logits' size (std ~1 at the default scale) so tanh bends.
OPTION_SETS = {
    "window": dict(window=(37, 5)),
    "window-left": dict(window=(20, None)),
    "window-right": dict(window=(None, 11)),
    "window+causal": dict(causal=True, window=(33, None)),
    "softcap": dict(softcap=2.0),
    "softcap-saturated": dict(softcap=5.0, scale=0.5),  # logits of std ~4 .. 8 against a cap of 5
    "alibi": dict(alibi="h"),
    "alibi-batch+causal": dict(alibi="bh", causal=True),
    "segments": dict(segments="docs"),
    "segments+causal": dict(segments="docs", causal=True),
    "segments-random": dict(segments="random"),
    "blocks": dict(blocks="blocks"),
    "blocks+window": dict(blocks="random", window=(40, 8)),
    "segments+blocks": dict(segments="docs", blocks="blocks"),
    "softcap+segments": dict(softcap=3.0, segments="docs", causal=True),
    "softcap+alibi": dict(softcap=4.0, alibi="bh"),
    "alibi+window": dict(alibi="h", window=(25, 25)),
    "everything": dict(causal=True, window=(20, None), softcap=3.0, alibi="h", segments="docs",
                       blocks="random"),
}
#: (B, Sq, Sk, H, Hkv, D, Dv): odd lengths both ways, GQA 6/2, MQA, MHA, head dims 40 .. 256, Dv != D.
SHAPES = (
    (2, 77, 77, 6, 2, 64, None),
    (2, 100, 163, 4, 1, 128, None),
    (1, 163, 100, 6, 2, 40, None),
    (2, 130, 95, 2, 2, 256, None),
    (1, 91, 200, 6, 6, 96, None),
    (2, 129, 65, 4, 2, 128, 64),
)
DTYPES = ("fp16", "bf16", "fp32")


def _option_problems():
    problems = []
    for index, (name, fields) in enumerate(OPTION_SETS.items()):
        for offset, dtype in enumerate(DTYPES):
            b, sq, sk, h, hkv, d, dv = SHAPES[(index + 2 * offset) % len(SHAPES)]
            problems.append(Problem(dtype, B=b, Sq=sq, Sk=sk, H=h, Hkv=hkv, D=d, Dv=dv,
                                    deterministic=(index + offset) % 2 == 1,
                                    dlse=(index + offset) % 3 == 0, **fields))
    # ~1000 tokens: a long sliding window with ALiBi (GQA), packed documents with a softcap (MQA)
    problems.append(Problem("bf16", B=1, Sq=1000, Sk=1000, H=8, Hkv=2, D=128, causal=True,
                            window=(256, None), alibi="h"))
    problems.append(Problem("fp16", B=1, Sq=777, Sk=1000, H=4, Hkv=1, D=64, causal=True,
                            softcap=3.0, segments="docs", deterministic=True))
    return problems


OPTION_PROBLEMS = _option_problems()

#: The additive bias: every broadcast form (gpu_utils.BIAS_KINDS), -inf entries and rows, values of +-30,
#: and with the other options. Deterministic with a broadcast bias: the forms over the batch / heads ("heads",
#: "kv", "shared") order their dbias adds (dbias_order.cuh) without a mask or causal (under one they raise,
#: below); key biases sum in per-thread partials, biases constant along the keys take dlse (cuflash/dbias.py).
BIAS_PROBLEMS = []
for _i, (_kind, _fields) in enumerate((
        ("full", dict()), ("full", dict(causal=True, deterministic=True)), ("heads", dict(dlse=True)),
        ("kv", dict(causal=True)), ("keys", dict()), ("rows", dict(dlse=True)),
        ("expanded", dict(deterministic=True)), ("neginf", dict(dlse=True, deterministic=True)),
        ("large", dict(causal=True)), ("full", dict(softcap=3.0, alibi="bh")),
        ("full", dict(window=(40, 6), segments="docs", deterministic=True)), ("heads", dict(blocks="blocks")),
        ("heads", dict(deterministic=True)), ("kv", dict(causal=True, deterministic=True)),
        ("shared", dict(causal=True, deterministic=True)), ("shared", dict(dlse=True)))):
    for _offset, _dtype in enumerate(DTYPES):
        _b, _sq, _sk, _h, _hkv, _d, _dv = SHAPES[(_i + 2 * _offset) % len(SHAPES)]
        BIAS_PROBLEMS.append(Problem(_dtype, B=_b, Sq=_sq, Sk=_sk, H=_h, Hkv=_hkv, D=_d, Dv=_dv, bias=_kind,
                                     **_fields))
BIAS_PROBLEMS.append(Problem("bf16", B=2, Sq=1024, Sk=1024, H=4, Hkv=4, D=128, bias="full", causal=True))
BIAS_PROBLEMS.append(Problem("fp16", B=1, Sq=700, Sk=900, H=8, Hkv=2, D=64, bias="kv", window=(200, 0)))
# A bias broadcast over the queries: each warp sums a step's queries before its one add per key
# (BiasView::add_grad_over_queries), on every dK/dV mainloop: WS D128 / D64, mma.sync D96 and with softcap,
# the wgmma one with a bool mask, fp32 SIMT; query counts that end inside a step.
BIAS_PROBLEMS += [
    Problem("bf16", B=3, Sq=333, Sk=517, H=8, Hkv=2, D=128, bias="keyheads", causal=True),
    Problem("fp16", B=2, Sq=1000, Sk=1000, H=4, Hkv=4, D=64, bias="keyheads"),
    Problem("bf16", B=2, Sq=190, Sk=257, H=6, Hkv=3, D=96, bias="keys", softcap=5.0),
    Problem("bf16", B=2, Sq=129, Sk=200, H=4, Hkv=1, D=128, bias="keys", mask="tiles"),
    Problem("fp32", B=2, Sq=77, Sk=140, H=4, Hkv=2, D=64, bias="keyheads", causal=True),
]
# A bias constant along the keys: dbias = dlse where the row sees a key (cuflash/dbias.py), rows that see
# nothing (a bool mask's all-False rows) included; one scalar for everything.
BIAS_PROBLEMS += [
    Problem("bf16", B=2, Sq=190, Sk=257, H=6, Hkv=3, D=128, bias="rows", mask="rows", dlse=True),
    Problem("fp16", B=2, Sq=129, Sk=77, H=4, Hkv=2, D=64, bias="scalar", causal=True, dlse=True),
    Problem("fp32", B=1, Sq=100, Sk=130, H=3, Hkv=1, D=64, bias="scalar", window=(20, 5), dlse=True),
]
# bias_grad=False: dq, dk, dv as with dbias, none written (a full-shape bias's stores and a broadcast one's
# atomics both skipped), the warp-specialized and mma.sync dK/dV kernels and the SIMT fp32 one.
BIAS_PROBLEMS += [
    Problem("bf16", B=2, Sq=200, Sk=333, H=4, Hkv=2, D=128, bias="full", bias_grad=False, causal=True),
    Problem("fp16", B=2, Sq=257, Sk=190, H=6, Hkv=2, D=64, bias="heads", bias_grad=False, softcap=3.0),
    Problem("bf16", B=3, Sq=129, Sk=250, H=4, Hkv=1, D=256, bias="keys", bias_grad=False),
    Problem("fp32", B=2, Sq=100, Sk=140, H=4, Hkv=2, D=64, bias="neginf", bias_grad=False, causal=True),
]


@pytest.mark.parametrize("p", BIAS_PROBLEMS, ids=gu.problem_ids(BIAS_PROBLEMS))
def test_bias(p):
    gu.check_attention(p)


#: The bool mask: every broadcast form (gpu_utils.MASK_KINDS: per batch, per head, per kv head, key padding),
#: tiles all True / all False / mixed (skipped and full tiles), rows that see nothing, and with the other
#: options (causal, window, segment ids, bias, softcap).
MASK_PROBLEMS = []
for _i, (_kind, _fields) in enumerate((
        ("random", dict()), ("tiles", dict(deterministic=True)), ("heads", dict(dlse=True)),
        ("kv", dict(causal=True)), ("keys", dict(deterministic=True)), ("rows", dict(dlse=True)),
        ("tiles", dict(causal=True, segments="docs")), ("random", dict(window=(50, 10), softcap=3.0)),
        ("tiles", dict(bias="full", deterministic=True)), ("heads", dict(blocks="blocks", alibi="h")))):
    for _offset, _dtype in enumerate(DTYPES):
        _b, _sq, _sk, _h, _hkv, _d, _dv = SHAPES[(_i + 2 * _offset) % len(SHAPES)]
        MASK_PROBLEMS.append(Problem(_dtype, B=_b, Sq=_sq, Sk=_sk, H=_h, Hkv=_hkv, D=_d, Dv=_dv, mask=_kind,
                                     **_fields))
MASK_PROBLEMS.append(Problem("bf16", B=2, Sq=1000, Sk=1100, H=4, Hkv=2, D=128, mask="tiles", causal=True))
MASK_PROBLEMS.append(Problem("fp16", B=1, Sq=777, Sk=900, H=6, Hkv=2, D=64, mask="kv", deterministic=True))


@pytest.mark.parametrize("p", MASK_PROBLEMS, ids=gu.problem_ids(MASK_PROBLEMS))
def test_bool_mask(p):
    gu.check_attention(p)


def test_bool_mask_all_false_and_all_true(monkeypatch):
    """A mask with nothing visible: out 0, lse -inf, every gradient 0; an all-True mask: bit-identical to
    segment ids that always match (the same general-mask kernel, the same full / partial tiles; both on the
    mma.sync mainloop, which serves either kind, where sm_90a would give the ids the warp-specialized one, and the
    deterministic dQ from the dQ kernel for both, where sm_90a would order the ids' adds in the dK/dV kernel)."""
    from cuflash import api, launch
    from cuflash.kernels import forward

    monkeypatch.setattr(forward, "default_mainloop", lambda *args, **kwargs: forward.MAINLOOP_SM80)
    # a plan cache of its own for the test (the patched choice must neither read nor leave cached plans)
    monkeypatch.setattr(launch, "forward_plan", functools.lru_cache(maxsize=64)(launch.forward_plan.__wrapped__))
    monkeypatch.setattr(api, "_forward_plans", {})
    monkeypatch.setattr(api, "_backward_plans", {})
    gu.dq_kernel_plans(monkeypatch)  # the ids' deterministic dQ from the dQ kernel too, as the mask's
    p = Problem("bf16", B=2, Sq=130, Sk=200, H=4, Hkv=2, D=64, causal=True, deterministic=True)
    x = gu.make_inputs(p)
    none = cupy.zeros((p.B, 1, p.Sq, p.Sk), dtype=bool)
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, causal=True, mask=none)
    grads = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, causal=True, mask=none, deterministic=True)
    assert bool(cupy.all(out.astype(cupy.float32) == 0)) and bool(cupy.all(cupy.isneginf(lse)))
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert bool(cupy.all(g.astype(cupy.float32) == 0)), f"{name} is not 0 where nothing is visible"
    every = cupy.ones((1, 1, p.Sq, p.Sk), dtype=bool)
    ids = (cupy.zeros((p.B, p.Sq), cupy.int32), cupy.zeros((p.B, p.Sk), cupy.int32))
    a = cuflash.attention_forward(x.q, x.k, x.v, causal=True, mask=every)
    b = cuflash.attention_forward(x.q, x.k, x.v, causal=True, segment_ids=ids)
    assert gu.bit_identical(a[0], b[0]) and gu.bit_identical(a[1], b[1])
    ga = cuflash.attention_backward(x.dout, x.q, x.k, x.v, *a, causal=True, mask=every, deterministic=True)
    gb = cuflash.attention_backward(x.dout, x.q, x.k, x.v, *b, causal=True, segment_ids=ids, deterministic=True)
    for name, u, w in zip(("dq", "dk", "dv"), ga, gb, strict=True):
        assert gu.bit_identical(u, w), f"{name}: an all-True mask differs from always-matching segment ids"


def test_bias_backward_allocates_dbias_and_refuses_dbias_without_a_bias():
    """Without a dbias buffer the backward allocates one equal to the buffered call's result; dbias= without
    bias is refused."""
    p = Problem("bf16", B=2, Sq=65, Sk=77, H=4, Hkv=2, D=64, bias="shared", segments="docs")
    x = gu.make_inputs(p)
    options = gu.option_kwargs(p, x)
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, **options)
    grads = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, **options)
    assert len(grads) == 4 and grads[3].shape == x.bias.shape and grads[3].dtype == x.bias.dtype
    with pytest.raises(ValueError, match="dbias"):
        cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, dbias=cupy.empty_like(x.bias))
    full = Problem("fp16", B=1, Sq=70, Sk=90, H=2, Hkv=1, D=64, bias="full", causal=True, deterministic=True)
    y = gu.make_inputs(full)
    out, lse = cuflash.attention_forward(y.q, y.k, y.v, bias=y.bias, causal=True)
    a = cuflash.attention_backward(y.dout, y.q, y.k, y.v, out, lse, bias=y.bias, causal=True, deterministic=True)
    b = cuflash.attention_backward(y.dout, y.q, y.k, y.v, out, lse, bias=y.bias, causal=True, deterministic=True,
                                   dbias=gu.nan_fill(cupy.empty_like(y.bias)))
    for name, u, w in zip(("dq", "dk", "dv", "dbias"), a, b, strict=True):
        assert gu.bit_identical(u, w), f"{name}: the self-allocating call differs from the buffered one"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_broadcast_dbias_into_every_buffer_layout(dtype):
    """A broadcast bias's fp32 sums reach dbias the same way whatever buffer holds it: the conversion kernel
    (a dbias cuflash allocates, or a contiguous 16-byte aligned dbias=; its element count not a multiple of 8,
    so its last elements take the kernel's tail), CuPy's cast (a strided or misaligned dbias=), and for fp32
    the sums made in dbias itself. Deterministic (ordered adds), so the sums repeat bit for bit; the cast may
    round otherwise than the kernel only by an ulp. (Their values against float64: BIAS_PROBLEMS.)"""
    p = Problem(dtype, B=2, Sq=67, Sk=93, H=6, Hkv=2, D=64, bias="heads", causal=True, deterministic=True)
    x = gu.make_inputs(p)
    assert x.bias.size % 8 != 0
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, bias=x.bias, causal=True)

    def dbias_into(buffer):
        return cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, bias=x.bias, causal=True,
                                          deterministic=True, dbias=buffer)[3]

    own = dbias_into(None)
    aligned = gu.nan_fill(cupy.empty_like(x.bias))
    assert gu.bit_identical(dbias_into(aligned), own)
    wide = gu.nan_fill(cupy.empty(x.bias.shape[:3] + (x.bias.shape[3] + 5,), dtype=x.bias.dtype))
    strided = dbias_into(wide[..., :x.bias.shape[3]])
    flat = gu.nan_fill(cupy.empty(x.bias.size + 1, dtype=x.bias.dtype))
    misaligned = dbias_into(flat[1:].reshape(x.bias.shape))
    expected = own.astype(cupy.float32)
    for name, got in (("strided", strided), ("misaligned", misaligned)):
        diff = cupy.abs(got.astype(cupy.float32) - expected)
        assert bool(cupy.all(diff <= cupy.abs(expected) * 2.0 ** -7)), f"{name} dbias= differs beyond an ulp"
    assert not bool(cupy.any(cupy.isnan(own.astype(cupy.float32))))


@pytest.mark.parametrize("kind,D,causal", [("full", 128, True), ("heads", 128, False), ("shared", 64, False)])
def test_no_dbias_leaves_the_other_gradients_alone(kind, D, causal):
    """bias_grad=False changes only whether dbias is made: dq, dk, dv are bit-identical to those of a
    deterministic backward that makes it (a full-shape bias's tile stores, or a broadcast one's ordered adds,
    skipped), and a repeated call takes the cached path even for a broadcast bias."""
    from cuflash import api

    p = Problem("bf16", B=2, Sq=190, Sk=257, H=4, Hkv=2, D=D, bias=kind, causal=causal)
    x = gu.make_inputs(p)
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, bias=x.bias, causal=causal)

    def backward(**kwargs):
        return cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, bias=x.bias, causal=causal,
                                          deterministic=True, **kwargs)

    made = backward()
    api._backward_plans.clear()
    skipped = backward(bias_grad=False)
    assert len(made) == 4 and len(skipped) == 3 and len(api._backward_plans) == 1
    again = backward(bias_grad=False)
    for name, a, b, c in zip(("dq", "dk", "dv"), made, skipped, again, strict=False):
        assert gu.bit_identical(a, b), f"{name}: bias_grad=False changed it"
        assert gu.bit_identical(b, c), f"{name}: the cached call differs"


@pytest.mark.parametrize("kind,causal", [("full", False), ("full", True), ("heads", False)])
def test_repeated_backward_with_a_bias(kind, causal):
    """The backward with a bias, called again with other bias values (the same shapes), takes the cached path: a
    full-shape bias's dbias is allocated (or zeroed first where causal skips tiles), a broadcast bias gets a fresh
    zeroed fp32 accumulator and its conversion. The second call's gradients match a fresh validating call's (bit
    for bit where deterministic) and differ from the first call's."""
    from cuflash import api

    p = Problem("bf16", B=2, Sq=130, Sk=136, H=4, Hkv=2, D=128, bias=kind, causal=causal)
    x, y = gu.make_inputs(p), gu.make_inputs(p, seed=p.seed + 1)

    def grads(bias):
        out, lse = cuflash.attention_forward(x.q, x.k, x.v, bias=bias, causal=causal)
        return cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, bias=bias, causal=causal,
                                          deterministic=kind == "full")

    api._backward_plans.clear()
    first = grads(x.bias)
    second = grads(y.bias)
    assert len(api._backward_plans) == 1
    api._backward_plans.clear()
    fresh = grads(y.bias)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), second, fresh, strict=True):
        assert gu.bit_identical(a, b) if kind == "full" else bool(cupy.allclose(a, b, rtol=1e-2, atol=1e-2)), name
    assert not gu.bit_identical(first[3], second[3])


@pytest.mark.parametrize("p", OPTION_PROBLEMS, ids=gu.problem_ids(OPTION_PROBLEMS))
def test_options(p):
    gu.check_attention(p)


# --------------------------------------------------------------------------------------------
# Sorted ids (the kernels test each row's range of keys) and unsorted ones (they read the ids)
# --------------------------------------------------------------------------------------------

#: Where the pre-pass finds a batch row's ids sorted, the partial tiles compare each score against its row's
#: (or key's) range; elsewhere they read the ids. "restart" ids are sorted inside every 64-query / 128-key
#: block but not across (batch row 0 only): a missed descent would show as keys seen or hidden wrongly.
#: Past 256 rows, so the lists have several blocks and the descents fall on their edges; Sq != Sk both ways.
ID_RANGE_PROBLEMS = (
    Problem("bf16", B=2, Sq=300, Sk=333, H=4, Hkv=2, D=128, segments="restart", causal=True),
    Problem("fp16", B=2, Sq=333, Sk=300, H=4, Hkv=1, D=64, blocks="restart", window=(70, None), dlse=True),
    Problem("fp32", B=2, Sq=257, Sk=390, H=2, Hkv=2, D=128, segments="restart", blocks="restart"),
    Problem("bf16", B=2, Sq=300, Sk=270, H=2, Hkv=2, D=96, segments="restart", deterministic=True),
    Problem("bf16", B=3, Sq=520, Sk=520, H=4, Hkv=4, D=128, segments="docs", causal=True, deterministic=True),
    Problem("bf16", B=2, Sq=400, Sk=700, H=4, Hkv=2, D=64, segments="docs", blocks="blocks", window=(100, 30)),
    Problem("fp16", B=2, Sq=700, Sk=400, H=2, Hkv=1, D=256, blocks="blocks", causal=True, dlse=True),
    Problem("bf16", B=1, Sq=600, Sk=900, H=4, Hkv=2, D=128, window=(200, 0), softcap=3.0),
)


@pytest.mark.parametrize("p", ID_RANGE_PROBLEMS, ids=gu.problem_ids(ID_RANGE_PROBLEMS))
def test_sorted_and_unsorted_ids(p):
    x = gu.make_inputs(p)
    if "restart" in (p.segments, p.blocks):  # the premise: row 0's ids descend, row 1's do not
        for ids in (x.segment_ids, x.block_ids):
            if ids is not None:
                steps = [cupy.diff(side, axis=1) for side in ids]
                assert all(bool((d[0] < 0).any()) and not bool((d[1] < 0).any()) for d in steps)
    gu.check_attention(p, inputs=x)


# --------------------------------------------------------------------------------------------
# Rows (and keys) with nothing visible
# --------------------------------------------------------------------------------------------

def _disjoint_ids(p: Problem, x: gu.Inputs) -> gu.Inputs:
    """Segment ids that never match: every row sees nothing, every gradient is 0."""
    q_ids = cupy.zeros((p.B, p.Sq), dtype=cupy.int32)
    k_ids = cupy.ones((p.B, p.Sk), dtype=cupy.int32)
    return dataclasses.replace(x, segment_ids=(q_ids, k_ids))


def _low_block_rows(p: Problem, x: gu.Inputs) -> gu.Inputs:
    """Block ids aligned as usual, but the first third of the query rows below every key's block id."""
    q_ids, k_ids = (ids.copy() for ids in x.block_ids)
    q_ids[:, : p.Sq // 3] = k_ids.min() - 1
    return dataclasses.replace(x, block_ids=(q_ids, k_ids))


# (problem, how its inputs are changed after drawing, or None)
EMPTY_CASES = (
    # ids found only in q (a run of rows per batch), with dlse: those rows see nothing
    (Problem("bf16", B=2, Sq=150, Sk=130, H=6, Hkv=2, D=64, segments="qonly", dlse=True), None),
    (Problem("fp32", B=2, Sq=90, Sk=120, H=4, Hkv=1, D=40, segments="qonly", causal=True,
             deterministic=True), None),
    # zero-width window with Sq > Sk: rows i < Sq - Sk see nothing, every other row exactly one key
    (Problem("fp16", B=2, Sq=200, Sk=70, H=4, Hkv=2, D=128, window=(0, 0), dlse=True), None),
    # the same with Sq < Sk: keys j < Sk - Sq are seen by nobody
    (Problem("bf16", B=1, Sq=70, Sk=200, H=4, Hkv=4, D=64, window=(0, 0), softcap=2.0), None),
    # block ids below every key's block (plus ALiBi, which must not leak into hidden rows)
    (Problem("fp16", B=2, Sq=99, Sk=99, H=6, Hkv=2, D=64, blocks="blocks", alibi="bh", dlse=True),
     _low_block_rows),
    # nothing visible anywhere
    (Problem("bf16", B=2, Sq=65, Sk=130, H=2, Hkv=1, D=64, segments="docs", dlse=True,
             deterministic=True), _disjoint_ids),
)


@pytest.mark.parametrize("p,change", EMPTY_CASES, ids=[p.id for p, _ in EMPTY_CASES])
def test_rows_and_keys_that_see_nothing(p, change):
    """Out 0, lse -inf and dq 0 for rows that see no key; dk = dv = 0 for keys no row sees; the rest
    held to the usual rule; never NaN."""
    x = gu.make_inputs(p)
    if change is not None:
        x = change(p, x)
    r = gu.check_attention(p, inputs=x)
    visible = gu.visibility(p, x)
    empty_rows = ~visible.any(axis=2)  # (B, Sq)
    unseen_keys = ~visible.any(axis=1)  # (B, Sk)
    assert bool(empty_rows.any() or unseen_keys.any()), f"{p.id}: every row sees a key, every key is seen"
    out, lse, dq = gu.to_f64(r.out), gu.to_f64(r.lse), gu.to_f64(r.dq)
    assert bool(cupy.all(out[empty_rows] == 0)), f"{p.id}: out of rows that see no key is not 0"
    assert bool(cupy.all(dq[empty_rows] == 0)), f"{p.id}: dq of rows that see no key is not 0"
    lse_rows = lse.transpose(0, 2, 1)  # (B, Sq, H)
    assert bool(cupy.all(cupy.isneginf(lse_rows[empty_rows]))), f"{p.id}: lse of empty rows not -inf"
    assert bool(cupy.all(cupy.isfinite(lse_rows[~empty_rows]))), f"{p.id}: lse of seeing rows not finite"
    if bool(unseen_keys.any()):
        for name in ("dk", "dv"):
            grad = gu.to_f64(getattr(r, name))
            assert bool(cupy.all(grad[unseen_keys] == 0)), f"{p.id}: {name} of keys nobody sees is not 0"


# --------------------------------------------------------------------------------------------
# Determinism, inputs left alone, the other entry points
# --------------------------------------------------------------------------------------------

DETERMINISM_PROBLEMS = (
    Problem("bf16", B=2, Sq=300, Sk=300, H=6, Hkv=2, D=128, causal=True, window=(64, None),
            segments="docs", alibi="bh", deterministic=True, dlse=True),
    Problem("fp16", B=1, Sq=200, Sk=333, H=4, Hkv=1, D=64, softcap=3.0, blocks="blocks",
            deterministic=True),
    Problem("fp32", B=2, Sq=150, Sk=150, H=4, Hkv=2, D=64, window=(20, 20), segments="random",
            softcap=2.0, deterministic=True),
    Problem("bf16", B=2, Sq=257, Sk=190, H=4, Hkv=2, D=128, causal=True, bias="full", softcap=4.0,
            deterministic=True, dlse=True),
    Problem("fp32", B=1, Sq=100, Sk=130, H=3, Hkv=1, D=64, bias="expanded", deterministic=True),
    # Broadcast biases, their dbias adds taking turns (dbias_order.cuh): over the batch (the warp-specialized
    # D128 dK/dV, its dQ adds ordered too, causal and unmasked), over each GQA group with a softcap, over the
    # batch and every head (D256; an MQA group a dK/dV CTA may walk several heads of; the SIMT fp32 kernels).
    Problem("bf16", B=3, Sq=300, Sk=300, H=4, Hkv=2, D=128, causal=True, bias="heads", deterministic=True),
    Problem("bf16", B=2, Sq=333, Sk=290, H=4, Hkv=4, D=128, bias="shared", deterministic=True),
    Problem("fp16", B=2, Sq=257, Sk=190, H=6, Hkv=2, D=64, bias="kv", softcap=3.0, deterministic=True),
    Problem("bf16", B=2, Sq=200, Sk=333, H=4, Hkv=1, D=256, causal=True, bias="shared", deterministic=True),
    Problem("bf16", B=2, Sq=256, Sk=256, H=8, Hkv=1, D=64, bias="shared", deterministic=True, dlse=True),
    Problem("fp32", B=2, Sq=130, Sk=100, H=4, Hkv=2, D=64, bias="shared", deterministic=True),
    # Key biases: each dK/dV thread's sums in partials only it writes (bias.cuh add_grad_over_queries), under any
    # mask: the warp-specialized D128 (causal; a window), mma.sync D64 with ids and a softcap and D96 with a bool mask,
    # D256, an MQA group whose heads one CTA may walk, the SIMT fp32 kernels (16 query threads per key).
    Problem("bf16", B=3, Sq=300, Sk=300, H=4, Hkv=2, D=128, causal=True, bias="keys", deterministic=True),
    Problem("bf16", B=2, Sq=333, Sk=290, H=4, Hkv=4, D=128, bias="keyheads", window=(50, 10), deterministic=True),
    Problem("fp16", B=2, Sq=257, Sk=190, H=6, Hkv=2, D=64, bias="keys", softcap=3.0, segments="docs",
            deterministic=True),
    Problem("bf16", B=2, Sq=190, Sk=257, H=6, Hkv=3, D=96, bias="keyheads", mask="tiles", deterministic=True),
    Problem("bf16", B=2, Sq=200, Sk=333, H=4, Hkv=1, D=256, causal=True, bias="keyheads", deterministic=True),
    Problem("bf16", B=2, Sq=256, Sk=256, H=8, Hkv=1, D=64, bias="keyheads", deterministic=True, dlse=True),
    Problem("fp32", B=2, Sq=130, Sk=100, H=4, Hkv=2, D=64, bias="keys", causal=True, deterministic=True),
    # Biases broadcast over batch / heads under a window or dropout (the same tiles for every batch row and head,
    # so the turns order them): the warp-specialized D128, mma.sync D64 with a softcap, SIMT fp32.
    Problem("bf16", B=3, Sq=300, Sk=300, H=4, Hkv=2, D=128, causal=True, bias="heads", window=(64, None),
            deterministic=True),
    Problem("fp16", B=2, Sq=257, Sk=190, H=6, Hkv=2, D=64, bias="kv", window=(40, 6), softcap=3.0,
            deterministic=True),
    Problem("bf16", B=2, Sq=200, Sk=333, H=4, Hkv=2, D=128, bias="shared", dropout=0.2, deterministic=True),
    Problem("fp32", B=2, Sq=130, Sk=100, H=4, Hkv=2, D=64, bias="shared", window=(20, 20), deterministic=True),
    # ... and under ids or a bool mask, whose dK / dV lists are then the union over each dbias slice's contributors
    # (block_lists.cu, union_lists; a batch row's own skipped tiles visited as partial ones): documents on the
    # warp-specialized D128 (a bias shared by the batch) and on mma.sync D64 (over every head too), block ids + a
    # window on SIMT fp32, a bool mask per batch row and kv head (D64; the union over both), and one per batch row
    # with documents (D128, causal, dropout).
    Problem("bf16", B=3, Sq=300, Sk=333, H=4, Hkv=2, D=128, bias="heads", segments="docs", deterministic=True),
    Problem("fp16", B=2, Sq=257, Sk=190, H=6, Hkv=2, D=64, bias="shared", segments="restart", softcap=3.0,
            deterministic=True, dlse=True),
    Problem("fp32", B=3, Sq=130, Sk=100, H=4, Hkv=2, D=64, bias="heads", blocks="random", window=(30, 10),
            deterministic=True),
    Problem("bf16", B=2, Sq=190, Sk=257, H=4, Hkv=2, D=64, bias="shared", mask="kv", deterministic=True),
    Problem("bf16", B=2, Sq=300, Sk=300, H=4, Hkv=2, D=128, causal=True, bias="shared", mask="tiles",
            segments="docs", dropout=0.2, deterministic=True),
    # Biases constant along the keys (dbias from dlse), with a window and ids.
    Problem("bf16", B=2, Sq=300, Sk=333, H=4, Hkv=2, D=128, bias="rows", window=(64, 0), deterministic=True,
            dlse=True),
    Problem("fp32", B=2, Sq=150, Sk=150, H=4, Hkv=2, D=64, bias="scalar", segments="random", deterministic=True,
            dlse=True),
    # Ids and windows without a bias on the warp-specialized D64 / D128 dK/dV kernels: their dQ adds ordered, ranked
    # by the query blocks' lists (causal documents, a causal window with random block ids, unsorted random segment
    # ids, whose tiles are all partial, a two-sided window; GQA, Sq != Sk, odd lengths).
    Problem("bf16", B=3, Sq=300, Sk=333, H=4, Hkv=2, D=128, causal=True, segments="docs", deterministic=True,
            dlse=True),
    Problem("fp16", B=2, Sq=257, Sk=190, H=6, Hkv=2, D=64, causal=True, window=(64, 0), blocks="random",
            deterministic=True),
    Problem("bf16", B=2, Sq=333, Sk=333, H=4, Hkv=4, D=128, segments="random", deterministic=True),
    Problem("bf16", B=2, Sq=200, Sk=333, H=6, Hkv=3, D=64, window=(40, 40), deterministic=True, dlse=True),
    # Biases without a gradient (bias_grad=False) are deterministic in every form; the WS D128 kernel, SIMT fp32, mma.sync D64.
    Problem("bf16", B=2, Sq=300, Sk=333, H=4, Hkv=2, D=128, causal=True, bias="keys", bias_grad=False,
            deterministic=True),
    Problem("bf16", B=2, Sq=257, Sk=300, H=6, Hkv=2, D=64, window=(50, 10), segments="docs", bias="shared",
            bias_grad=False, deterministic=True, dlse=True),
    Problem("fp32", B=2, Sq=130, Sk=100, H=4, Hkv=2, D=64, bias="rows", bias_grad=False, deterministic=True),
)
RUNS = 3


@pytest.mark.parametrize("p", DETERMINISM_PROBLEMS, ids=gu.problem_ids(DETERMINISM_PROBLEMS))
def test_deterministic_backward_with_options(p):
    """deterministic=True with options: every output bit-identical across runs (and correct)."""
    gu.check_deterministic(p, RUNS)


def test_ids_and_slopes_are_not_modified():
    """Forward and backward read alibi_slopes, segment_ids, block_ids and bias without writing them."""
    p = Problem("bf16", B=2, Sq=129, Sk=200, H=6, Hkv=2, D=64, causal=True, alibi="bh",
                segments="docs", blocks="random", bias="kv")
    x = gu.make_inputs(p)
    arrays = {"alibi_slopes": x.alibi_slopes, "segment_ids[0]": x.segment_ids[0],
              "segment_ids[1]": x.segment_ids[1], "block_ids[0]": x.block_ids[0],
              "block_ids[1]": x.block_ids[1], "bias": x.bias}
    before = {name: a.copy() for name, a in arrays.items()}
    gu.run_cuflash(p, x)
    cupy.cuda.Device().synchronize()
    for name, a in arrays.items():
        assert gu.bit_identical(a, before[name]), f"{name} was modified"


def test_attention_wrapper_and_workspace_with_options():
    """cuflash.attention with options equals attention_forward bit for bit; a backward into the
    buffers backward_workspace sized for these options equals the self-allocating backward."""
    p = Problem("bf16", B=2, Sq=129, Sk=127, H=6, Hkv=2, D=64, causal=True, window=(30, None),
                softcap=3.0, alibi="h", segments="docs", blocks="blocks", deterministic=True)
    x = gu.make_inputs(p)
    options = gu.option_kwargs(p, x)
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, causal=True, **options)
    both = cuflash.attention(x.q, x.k, x.v, causal=True, return_lse=True, **options)
    assert gu.bit_identical(cupy.asarray(both[0]), out) and gu.bit_identical(cupy.asarray(both[1]), lse)
    assert gu.bit_identical(cupy.asarray(cuflash.attention(x.q, x.k, x.v, causal=True, **options)), out)

    cuflash.prepare(x.q, x.k, x.v, causal=True, deterministic=True, **options)
    shapes = cuflash.backward_workspace(x.q, x.k, x.v, causal=True, deterministic=True, **options)
    workspace = {name: gu.nan_fill(cupy.empty(shape, dtype=cupy.float32))
                 for name, shape in shapes.items()}
    grads = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, causal=True,
                                       deterministic=True, **options)
    with_workspace = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, causal=True,
                                                deterministic=True, workspace=workspace, **options)
    for name, a, b in zip(("dq", "dk", "dv"), grads, with_workspace, strict=True):
        assert gu.bit_identical(a, b), f"{name} with the workspace differs from the plain call's"
    # and both are right (the workspace one equals the plain one bit for bit)
    e = gu.expected_for(p, x)
    report = gu.Report(f"{p.id} via attention / backward_workspace")
    gu.check_forward(report, p, gu.Result(out, lse), e)
    gu.check_backward(report, p, x, gu.Result(out, lse, *grads), e)
    report.check()

