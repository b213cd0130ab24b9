"""Packed variable-length attention on a GPU (``cuflash.varlen_attention_forward`` / ``_backward``).

Each case packs ragged sequences (lengths 0, 1, odd, a few hundred, > 1024; Sq != Sk per sequence, rows
no sequence covers at the ends), runs forward and backward into NaN-poisoned buffers, and holds every
sequence to the float64 reference through the batched tests' rule (gpu_utils: its slices as a batch of one,
with the naive and stored-residual baselines and the one-key-row allowance). Also:

- sequences with no keys: out exactly 0, lse -inf, dq 0; with no queries: dk = dv = 0 exactly;
- rows outside every sequence: out 0, lse -inf, dq = dk = dv = 0;
- offsets on the GPU with max_seqlen given, on the GPU without (read back), and as host data;
- equal lengths: bit-identical to the batched call on the same rows (forward, deterministic backward);
- deterministic=True: bit-identical across runs;
- many short sequences (the epilogue race of FlashAttention-3's varlen, seed 003).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import gpu_utils as gu  # noqa: E402
from gpu_utils import poisoned_allocations  # noqa: E402,F401  (autouse: CuPy allocations start as NaN)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session", autouse=True)
def _precompiled(request):
    gu.announce_precompile(request.config)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    lens_q: tuple
    lens_k: tuple | None  # None: the same as lens_q
    H: int
    Hkv: int
    D: int
    Dv: int | None = None
    causal: bool = False
    window: tuple | None = None
    softcap: float | None = None
    alibi: str | None = None  # "h": (H,), "bh": (B, H)
    dlse: bool = False
    deterministic: bool = False
    tail_q: int = 0  # packed rows after the last sequence (no sequence covers them)
    tail_k: int = 0
    offsets: str = "device"  # "device" (max_seqlen given), "device-nomax" (read back), "host"
    max_pad: int = 0  # "device": max_seqlen given this much past the longest (the grid's blocks past every sequence)

    @property
    def keys(self) -> tuple:
        return self.lens_q if self.lens_k is None else self.lens_k

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    @property
    def id(self) -> str:
        parts = [self.dtype, f"D{self.D}" + ("" if self.Dv in (None, self.D) else f"v{self.Dv}"),
                 f"h{self.H}kv{self.Hkv}", f"n{len(self.lens_q)}", f"max{max(self.lens_q)}",
                 "causal" if self.causal else "full", self.offsets]
        if self.lens_k is not None:
            parts.append("qk")
        if self.max_pad:
            parts.append(f"pad{self.max_pad}")
        for flag, name in ((self.dlse, "dlse"), (self.deterministic, "det"), (self.tail_q or self.tail_k, "tail")):
            if flag:
                parts.append(name)
        if self.window is not None:
            parts.append("win" + "_".join("inf" if w is None else str(w) for w in self.window))
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi is not None:
            parts.append(f"alibi{self.alibi}")
        return "-".join(parts)


RAGGED_Q = (0, 1, 17, 300, 1025)
RAGGED_K = (5, 1, 40, 300, 1100)
CASES = [
    Case("bf16", RAGGED_Q, RAGGED_K, 4, 2, 64, causal=True, tail_q=3, tail_k=2),
    Case("fp16", RAGGED_Q, RAGGED_K, 6, 1, 128, dlse=True, offsets="host"),
    Case("fp32", (17, 0, 33, 130), (17, 9, 0, 100), 2, 2, 40, causal=True, offsets="device-nomax", tail_q=5),
    Case("bf16", (70, 3, 257, 128), (90, 3, 200, 128), 4, 4, 96, causal=True, window=(40, 8)),
    Case("bf16", RAGGED_Q, None, 4, 2, 128, softcap=3.0, alibi="bh", deterministic=True),
    Case("fp16", (33, 190, 1), (64, 150, 7), 4, 2, 64, Dv=32, window=(None, 11), alibi="h", tail_k=4),
    Case("bf16", (512, 700, 129), None, 8, 2, 128, causal=True, deterministic=True, dlse=True),
    Case("bf16", (1, 300, 64), (1025, 64, 2), 2, 1, 256, causal=True),
    Case("fp32", (9, 64, 0, 200), (31, 64, 5, 180), 3, 1, 64, softcap=2.0, window=(20, None), tail_q=2, tail_k=3),
    Case("fp16", tuple(int(n) for n in np.random.default_rng(3).integers(0, 41, size=64)), None, 4, 2, 64,
         causal=True),
    Case("bf16", (0, 0), (5, 3), 2, 1, 64, tail_q=4, tail_k=1),  # no query row in any sequence
    Case("fp16", (6, 2), (0, 0), 2, 2, 32, causal=True, tail_k=3),  # no key in any sequence
    # max_seqlen far past the longest sequence (a larger one than the packed rows counts as them): most of the grid's
    # query / key blocks lie past every sequence
    Case("bf16", (3, 130, 0, 700, 64), (9, 130, 40, 700, 1), 4, 2, 128, causal=True, max_pad=1500, tail_q=1500,
         tail_k=1500),
    Case("fp16", tuple(int(n) for n in np.random.default_rng(5).integers(0, 300, size=24)), None, 2, 1, 64,
         max_pad=2000, dlse=True),
]


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@dataclasses.dataclass
class Packed:
    q: object
    k: object
    v: object
    dout: object
    dlse: object
    alibi: object
    cu_q: np.ndarray
    cu_k: np.ndarray


def make_packed(c: Case, seed: int) -> Packed:
    rng = np.random.default_rng(seed)
    dt = gu.DTYPES[c.dtype]
    cu_q, cu_k = _cu(c.lens_q), _cu(c.keys)
    tq, tk = int(cu_q[-1]) + c.tail_q, int(cu_k[-1]) + c.tail_k
    q = gu.to_device(gu.host_normal(rng, (tq, c.H, c.D)), dt)
    k = gu.to_device(gu.host_normal(rng, (tk, c.Hkv, c.D)), dt)
    v = gu.to_device(gu.host_normal(rng, (tk, c.Hkv, c.dv)), dt)
    dout = gu.to_device(gu.host_normal(rng, (tq, c.H, c.dv)), dt)
    dlse = cupy.asarray(gu.host_normal(rng, (c.H, tq))) if c.dlse else None
    alibi = None
    if c.alibi is not None:
        shape = (c.H,) if c.alibi == "h" else (len(c.lens_q), c.H)
        alibi = cupy.asarray(rng.uniform(0.05, 0.5, size=shape).astype(np.float32))
    return Packed(q, k, v, dout, dlse, alibi, cu_q, cu_k)


def _options(c: Case, x: Packed) -> dict:
    options = {}
    if c.window is not None:
        options["window"] = c.window
    if c.softcap is not None:
        options["softcap"] = c.softcap
    if x.alibi is not None:
        options["alibi_slopes"] = x.alibi
    return options


def _offsets(c: Case, x: Packed) -> tuple:
    """(cu_q, cu_k, max_q, max_k) as the case passes them."""
    if c.offsets == "host":
        return x.cu_q.tolist(), x.cu_k, None, None
    cu_q, cu_k = cupy.asarray(x.cu_q), cupy.asarray(x.cu_k)
    if c.offsets == "device-nomax":
        return cu_q, cu_k, None, None
    return cu_q, cu_k, max(c.lens_q) + c.max_pad, max(c.keys) + c.max_pad


def run_varlen(c: Case, x: Packed):
    """Forward and backward into NaN-poisoned buffers; returns them."""
    tq, tk = x.q.shape[0], x.k.shape[0]
    dt = gu.DTYPES[c.dtype]
    out = gu.nan_buffer((1, tq, c.H, c.dv), dt)[0]
    lse = gu.nan_buffer((1, c.H, tq), np.float32)[0]
    dq = gu.nan_buffer((1,) + x.q.shape, dt)[0]
    dk = gu.nan_buffer((1,) + x.k.shape, dt)[0]
    dv = gu.nan_buffer((1,) + x.v.shape, dt)[0]
    cu_q, cu_k, max_q, max_k = _offsets(c, x)
    options = _options(c, x)
    got_out, got_lse = cuflash.varlen_attention_forward(x.q, x.k, x.v, cu_q, cu_k, max_q, max_k, causal=c.causal,
                                                        out=out, lse=lse, **options)
    assert got_out is out and got_lse is lse
    grads = cuflash.varlen_attention_backward(x.dout, x.q, x.k, x.v, out, lse, cu_q, cu_k, max_q, max_k,
                                              dlse=x.dlse, causal=c.causal, deterministic=c.deterministic,
                                              dq=dq, dk=dk, dv=dv, **options)
    assert len(grads) == 3 and grads[0] is dq and grads[1] is dk and grads[2] is dv
    return gu.Result(out, lse, dq, dk, dv)


def _exactly(report: gu.Report, name: str, x, value: float):
    x64 = gu.to_f64(x)
    bad = x64 != value
    if bool(cupy.any(bad)):
        report.fail(f"{name}: {int(cupy.count_nonzero(bad))} of {x64.size} elements are not {value} "
                    f"(first at {gu.first_bad_index(bad)})")


def check_sequence(report: gu.Report, c: Case, x: Packed, r: gu.Result, b: int):
    qs, qe, ks, ke = int(x.cu_q[b]), int(x.cu_q[b + 1]), int(x.cu_k[b]), int(x.cu_k[b + 1])
    lq, lk = qe - qs, ke - ks
    tag = f"seq{b}(q{lq},k{lk})"
    if lq == 0:  # keys nobody sees
        _exactly(report, f"{tag} dk", r.dk[ks:ke], 0.0)
        _exactly(report, f"{tag} dv", r.dv[ks:ke], 0.0)
        return
    if lk == 0:  # queries that see nothing
        _exactly(report, f"{tag} out", r.out[qs:qe], 0.0)
        _exactly(report, f"{tag} lse", r.lse[:, qs:qe], -np.inf)
        _exactly(report, f"{tag} dq", r.dq[qs:qe], 0.0)
        return
    alibi = None
    if x.alibi is not None:
        alibi = x.alibi if x.alibi.ndim == 1 else x.alibi[b]
    p = gu.Problem(c.dtype, 1, lq, lk, c.H, c.Hkv, c.D, c.Dv, causal=c.causal, dlse=c.dlse, window=c.window,
                   softcap=c.softcap, alibi=None if alibi is None else "h")
    xb = gu.Inputs(x.q[qs:qe][None], x.k[ks:ke][None], x.v[ks:ke][None], x.dout[qs:qe][None],
                   None if x.dlse is None else x.dlse[:, qs:qe][None], alibi_slopes=alibi)
    rb = gu.Result(r.out[qs:qe][None], r.lse[:, qs:qe][None], r.dq[qs:qe][None], r.dk[ks:ke][None],
                   r.dv[ks:ke][None])
    e = gu.expected_for(p, xb)
    sub = gu.Report(tag)
    gu.check_forward(sub, p, rb, e)
    gu.check_backward(sub, p, xb, rb, e)
    for line in sub.failures:
        report.fail(f"{tag}: {line}")
    report.note(f"{tag} ok" if not sub.failures else f"{tag} failed")


def check_uncovered(report: gu.Report, x: Packed, r: gu.Result):
    q_rows = cupy.asarray(np.r_[0:int(x.cu_q[0]), int(x.cu_q[-1]):x.q.shape[0]])
    k_rows = cupy.asarray(np.r_[0:int(x.cu_k[0]), int(x.cu_k[-1]):x.k.shape[0]])
    if q_rows.size:
        _exactly(report, "uncovered out", r.out[q_rows], 0.0)
        _exactly(report, "uncovered lse", r.lse[:, q_rows], -np.inf)
        _exactly(report, "uncovered dq", r.dq[q_rows], 0.0)
    if k_rows.size:
        _exactly(report, "uncovered dk", r.dk[k_rows], 0.0)
        _exactly(report, "uncovered dv", r.dv[k_rows], 0.0)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_varlen_matches_the_reference(case):
    x = make_packed(case, seed=len(case.id) * 7919 + sum(case.lens_q))
    r = run_varlen(case, x)
    report = gu.Report(case.id)
    for name, buf, neg_inf in (("out", r.out, False), ("lse", r.lse, True), ("dq", r.dq, False),
                               ("dk", r.dk, False), ("dv", r.dv, False)):
        gu.check_written(report, name, buf, allow_neg_inf=neg_inf)
    for b in range(len(case.lens_q)):
        check_sequence(report, case, x, r, b)
    check_uncovered(report, x, r)
    report.check()
    if case.deterministic:  # the same call again: bit for bit
        again = run_varlen(case, x)
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert gu.bit_identical(getattr(r, name), getattr(again, name)), f"{name} differs between two runs"


@pytest.mark.parametrize("dtype,causal", [("bf16", True), ("fp16", False), ("fp32", True)])
def test_equal_lengths_are_bit_identical_to_the_batched_call(dtype, causal, monkeypatch):
    """Packed sequences of one length against the batched call on the same rows, both on the general mask's
    kernels (packed calls run those; an unbounded window puts the batched call there too) and, deterministic,
    both with the dQ kernel (the batched call's sm_90a plan would order its dQ adds instead): same bits."""
    gu.dq_kernel_plans(monkeypatch)
    B, S, H, Hkv, D = 3, 200, 4, 2, 64
    rng = np.random.default_rng(11)
    dt = gu.DTYPES[dtype]
    q, k, v, dout = (gu.to_device(gu.host_normal(rng, (B, S, h, D)), dt) for h in (H, Hkv, Hkv, H))
    general = dict(causal=causal, window=(1 << 20, None))  # the same kernels as the packed call
    out_b, lse_b = cuflash.attention_forward(q, k, v, **general)
    grads_b = cuflash.attention_backward(dout, q, k, v, out_b, lse_b, deterministic=True, **general)
    cu = cupy.asarray(_cu([S] * B))
    flat = [x.reshape(B * S, *x.shape[2:]) for x in (q, k, v, dout)]
    out_v, lse_v = cuflash.varlen_attention_forward(*flat[:3], cu, cu, S, S, causal=causal)
    grads_v = cuflash.varlen_attention_backward(flat[3], *flat[:3], out_v, lse_v, cu, cu, S, S, causal=causal,
                                                deterministic=True)
    assert gu.bit_identical(out_v, out_b.reshape(B * S, H, D))
    assert gu.bit_identical(lse_v, lse_b.transpose(1, 0, 2).reshape(H, B * S))
    for got, want in zip(grads_v, grads_b):
        assert gu.bit_identical(got, want.reshape(B * S, *want.shape[2:]))


def test_varlen_attention_returns_out_and_optionally_lse():
    c = Case("bf16", (10, 20), None, 2, 2, 32, causal=True)
    x = make_packed(c, seed=5)
    cu = cupy.asarray(x.cu_q)
    out = cuflash.varlen_attention(x.q, x.k, x.v, cu, cu, 20, 20, causal=True)
    out2, lse = cuflash.varlen_attention(x.q, x.k, x.v, cu, cu, 20, 20, causal=True, return_lse=True)
    assert gu.bit_identical(out, out2) and lse.shape == (2, 30)


def test_varlen_workspace_matches_the_call():
    c = Case("bf16", (100, 33), None, 8, 2, 128, causal=True)
    x = make_packed(c, seed=9)
    cu = cupy.asarray(x.cu_q)
    out, lse = cuflash.varlen_attention_forward(x.q, x.k, x.v, cu, cu, 100, 100, causal=True)
    shapes = cuflash.varlen_backward_workspace(x.q, x.k, x.v, cu, cu, 100, 100, causal=True, deterministic=True)
    workspace = {name: cupy.empty(shape, cupy.float32) for name, shape in shapes.items()}
    with_ws = cuflash.varlen_attention_backward(x.dout, x.q, x.k, x.v, out, lse, cu, cu, 100, 100, causal=True,
                                                deterministic=True, workspace=workspace)
    without = cuflash.varlen_attention_backward(x.dout, x.q, x.k, x.v, out, lse, cu, cu, 100, 100, causal=True,
                                                deterministic=True)
    for a, b in zip(with_ws, without):
        assert gu.bit_identical(a, b)


@pytest.mark.parametrize("window", [None, (40, 8)])
def test_a_cached_call_reads_its_own_offsets(window, monkeypatch):
    """Calls with one key (shapes, dtypes and longest lengths; offsets on the GPU) after the first are cache hits
    that skip validation: each must read its own offsets, arrays and freshly carved block lists. Three calls,
    the offsets permuted (same totals and maxima), each held to the float64 reference."""
    from cuflash import varlen

    checks = [0]
    original = varlen.PackedSequences.check

    def counting(self, *args, **kwargs):
        checks[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(varlen.PackedSequences, "check", counting)
    lens = [((100, 28, 300), (90, 200, 38)), ((300, 100, 28), (38, 90, 200)), ((28, 300, 100), (200, 38, 90))]
    for i, (lens_q, lens_k) in enumerate(lens):
        case = Case("bf16", lens_q, lens_k, 4, 2, 64, causal=True, window=window, dlse=True)
        x = make_packed(case, seed=100 + i)
        r = run_varlen(case, x)
        report = gu.Report(f"call {i}")
        for b in range(len(case.lens_q)):
            check_sequence(report, case, x, r, b)
        report.check()
        if i == 0:
            after_first = checks[0]
    assert checks[0] == after_first, "a repeated call validated again instead of hitting its plan"
