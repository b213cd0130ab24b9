"""KV-cache attention on a GPU (``cuflash.attention_with_kvcache``).

Each case fills a cache with random keys (never zeros), appends ``k_new`` / ``v_new`` at ragged
``cache_seqlens`` (0, 1, odd, a full cache), runs into NaN-poisoned ``out`` / ``lse`` (and, through the
poisoning allocator, NaN-poisoned split-KV scratch), then:

- the cache: the appended rows hold k_new / v_new bit for bit, every other row (and every page the table does
  not name) is untouched;
- each batch against the float64 reference over its first ``cache_seqlens[b] + Snew`` keys, through the
  batched tests' rule (gpu_utils: a batch of one, rounding and naive baselines); a batch with no key: out 0,
  lse -inf exactly;
- paged against dense on the same keys: bit for bit (page sizes 1, 13, 16, 128, 256: per-row gathers and
  whole-page tiles);
- split-KV (forced and heuristic) against no split: both against the reference, and close to each other;
- lengths as host data, on the GPU, or one int; GQA groups of 1 to 16 heads; causal, window, softcap, ALiBi;
  fp16, bf16 and float32 (its own SIMT kernel: every case kind above again, and paged = dense bit for bit).
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
    cached: tuple  # cache_seqlens, one per batch
    capacity: int  # keys per sequence the cache holds (dense L, or max_pages * page_size)
    Sq: int
    H: int
    Hkv: int
    D: int
    Dv: int | None = None
    snew: int = 0  # appended tokens (k_new / v_new); 0: none
    page_size: int | None = None  # None: dense
    causal: bool = False
    window: tuple | None = None
    softcap: float | None = None
    alibi: str | None = None  # "h" (H,), "bh" (B, H)
    num_splits: int | None = 1
    lengths: str = "device"  # "device", "host", "int" (cached must be all equal)

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    @property
    def B(self) -> int:
        return len(self.cached)

    @property
    def id(self) -> str:
        parts = [self.dtype, f"D{self.D}" + ("" if self.Dv in (None, self.D) else f"v{self.Dv}"),
                 f"B{self.B}", f"L{self.capacity}", f"q{self.Sq}", f"new{self.snew}", f"h{self.H}kv{self.Hkv}",
                 "dense" if self.page_size is None else f"page{self.page_size}", f"split{self.num_splits}",
                 "causal" if self.causal else "full", self.lengths]
        if self.window is not None:
            parts.append("win" + "_".join("inf" if w is None else str(w) for w in self.window))
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi is not None:
            parts.append(f"alibi{self.alibi}")
        return "-".join(parts)


CASES = [
    # decoding: one new token per sequence, ragged caches (empty, one key, odd, full)
    Case("bf16", (0, 1, 17, 300, 1024 - 1), 1024, 1, 32, 8, 128, snew=1, num_splits=None),
    Case("fp16", (0, 1, 17, 300, 1023), 1024, 1, 32, 8, 128, snew=1, page_size=16, causal=True, num_splits=3),
    Case("bf16", (5, 700, 64), 768, 1, 8, 8, 64, snew=1, page_size=1, lengths="host"),
    Case("bf16", (129, 2), 520, 1, 16, 1, 256, snew=1, page_size=13, num_splits=None, softcap=20.0, alibi="bh"),
    # chunked prefill: several new tokens, causal bottom-right, queries != appended tokens
    Case("fp16", (0, 33, 400), 640, 77, 8, 2, 96, snew=77, causal=True, page_size=128),
    Case("bf16", (250, 0, 31), 384, 5, 12, 4, 64, Dv=32, snew=5, causal=True, window=(40, 0), alibi="h"),
    Case("bf16", (100, 100), 256, 9, 4, 2, 40, snew=0, window=(None, 3), lengths="int", num_splits=4),
    Case("fp16", (1000, 3), 1280, 64, 4, 4, 128, snew=64, causal=True, page_size=256, num_splits=None),
    # the prefill tile (>= PREFILL_ROWS packed rows per kv head): D128 dense with the heuristic's split, and
    # D128 paged (13-row pages) with softcap + ALiBi (its 32-key variant); lengths that end inside a block
    Case("bf16", (0, 700, 1500), 1800, 200, 16, 4, 128, snew=200, causal=True, num_splits=None),
    Case("fp16", (33, 900), 1300, 100, 8, 2, 128, snew=100, causal=True, page_size=13, softcap=30.0, alibi="h"),
    # the decoding tile's wide panels (D a multiple of 64) at D192: two new tokens, GQA 3, a forced split
    Case("bf16", (3, 999), 1024, 2, 24, 8, 192, snew=2, causal=True, num_splits=2),
    # no appended tokens; a query block bigger than a CTA (Sq x group > 64 rows)
    Case("bf16", (513, 2, 0), 600, 20, 16, 4, 128, causal=True, lengths="host"),
    Case("fp16", (0, 0), 64, 3, 4, 2, 64, snew=0),  # nothing cached: out 0, lse -inf
    # the few-row tile (<= 16 packed rows, the warps splitting each key block) on narrow panels (D96, D80):
    # 2 tokens of a group of 8 with causal + window and the heuristic's split; MHA decode with softcap over
    # 7-row pages, forced split; 16 rows exactly (4 tokens x 4 heads) with ALiBi and a cache shorter than a block
    Case("fp16", (3, 257, 1000), 1100, 2, 16, 2, 96, snew=2, causal=True, window=(300, 0), num_splits=None),
    Case("bf16", (77, 1, 640), 700, 1, 6, 6, 80, snew=1, page_size=7, softcap=15.0, num_splits=2),
    Case("bf16", (5, 40, 301), 320, 4, 8, 2, 128, snew=4, causal=True, alibi="bh", num_splits=None),
    # float32 (the SIMT kernel): decoding with the heuristic's split; a paged D256 MQA group of 16 (one 16-row
    # tile) through 13-row pages (row gathers) with softcap + ALiBi; chunked prefill on the decoding tile (Dv !=
    # D, window); the prefill tile (>= 64 packed rows) over whole 128-row pages and over 16-row pages with a
    # forced split; nothing cached
    Case("fp32", (0, 1, 17, 300, 1023), 1024, 1, 32, 8, 128, snew=1, num_splits=None),
    Case("fp32", (129, 2), 520, 1, 16, 1, 256, snew=1, page_size=13, num_splits=None, softcap=20.0, alibi="bh"),
    Case("fp32", (250, 0, 31), 384, 5, 12, 4, 64, Dv=32, snew=5, causal=True, window=(40, 0), alibi="h"),
    Case("fp32", (0, 700, 1500), 1792, 40, 16, 4, 128, snew=40, causal=True, page_size=128, num_splits=None),
    Case("fp32", (1000, 3), 1280, 20, 8, 1, 96, snew=20, causal=True, page_size=16, num_splits=3, lengths="host"),
    Case("fp32", (0, 0), 64, 3, 4, 2, 64, snew=0),
]


@dataclasses.dataclass
class Cache:
    q: object
    k_dense: np.ndarray  # (B, capacity, Hkv, D) float32 host copy of the keys before the append
    v_dense: np.ndarray
    k_new: object
    v_new: object
    k_cache: object  # what the call takes (dense or paged)
    v_cache: object
    block_table: object
    k_host_cache: np.ndarray  # the call's cache arrays before the call, for the "untouched" check
    v_host_cache: np.ndarray
    alibi: object


def _paged(dense: np.ndarray, page_size: int, table: np.ndarray, num_pages: int, rng) -> np.ndarray:
    b, cap, hkv, d = dense.shape
    pages = rng.standard_normal((num_pages, page_size, hkv, d), dtype=np.float32)  # unnamed pages: junk
    for bi in range(b):
        for i in range(cap // page_size):
            pages[table[bi, i]] = dense[bi, i * page_size:(i + 1) * page_size]
    return pages


def make_cache(c: Case, seed: int, page_size: int | None = None) -> Cache:
    rng = np.random.default_rng(seed)
    dt = gu.DTYPES[c.dtype]
    page_size = c.page_size if page_size is None else page_size
    k_dense = gu.host_normal(rng, (c.B, c.capacity, c.Hkv, c.D))
    v_dense = gu.host_normal(rng, (c.B, c.capacity, c.Hkv, c.dv))
    q = gu.to_device(gu.host_normal(rng, (c.B, c.Sq, c.H, c.D)), dt)
    k_new = v_new = None
    if c.snew:
        k_new = gu.to_device(gu.host_normal(rng, (c.B, c.snew, c.Hkv, c.D)), dt)
        v_new = gu.to_device(gu.host_normal(rng, (c.B, c.snew, c.Hkv, c.dv)), dt)
    alibi = None
    if c.alibi is not None:
        shape = (c.H,) if c.alibi == "h" else (c.B, c.H)
        alibi = cupy.asarray(rng.uniform(0.05, 0.5, size=shape).astype(np.float32))
    table = None
    if page_size is None:
        k_host, v_host = k_dense.astype(dt), v_dense.astype(dt)
    else:
        assert c.capacity % page_size == 0
        max_pages = c.capacity // page_size
        num_pages = c.B * max_pages + 3
        table = rng.permutation(num_pages)[:c.B * max_pages].reshape(c.B, max_pages).astype(np.int32)
        k_host = _paged(k_dense, page_size, table, num_pages, rng).astype(dt)
        v_host = _paged(v_dense, page_size, table, num_pages, rng).astype(dt)
        table = cupy.asarray(table)
    return Cache(q, k_dense, v_dense, k_new, v_new, cupy.asarray(k_host), cupy.asarray(v_host), table, k_host, v_host,
                 alibi)


def _lengths(c: Case):
    if c.lengths == "int":
        assert len(set(c.cached)) == 1
        return c.cached[0]
    if c.lengths == "host":
        return list(c.cached)
    return cupy.asarray(np.array(c.cached, dtype=np.int32))


def _options(c: Case, x: Cache) -> dict:
    options = {}
    if c.window is not None:
        options["window"] = c.window
    if c.softcap is not None:
        options["softcap"] = c.softcap
    if x.alibi is not None:
        options["alibi_slopes"] = x.alibi
    return options


def run(c: Case, x: Cache, num_splits=None) -> gu.Result:
    dt = gu.DTYPES[c.dtype]
    out = gu.nan_buffer((c.B, c.Sq, c.H, c.dv), dt)
    lse = gu.nan_buffer((c.B, c.H, c.Sq), np.float32)
    got_out, got_lse = cuflash.attention_with_kvcache(
        x.q, x.k_cache, x.v_cache, _lengths(c), x.k_new, x.v_new, block_table=x.block_table,
        num_splits=c.num_splits if num_splits is None else num_splits, causal=c.causal, return_lse=True, out=out,
        lse=lse, **_options(c, x))
    assert got_out is out and got_lse is lse
    return gu.Result(out, lse)


def expected_cache(c: Case, x: Cache) -> tuple:
    """The dense keys / values after the append, as the call's dtype (float64 arrays on the GPU)."""
    dt = gu.DTYPES[c.dtype]
    k = x.k_dense.astype(dt).astype(np.float64)
    v = x.v_dense.astype(dt).astype(np.float64)
    if c.snew:
        k_new, v_new = cupy.asnumpy(gu.to_f64(x.k_new)), cupy.asnumpy(gu.to_f64(x.v_new))
        for b, n in enumerate(c.cached):
            k[b, n:n + c.snew] = k_new[b]
            v[b, n:n + c.snew] = v_new[b]
    return cupy.asarray(k), cupy.asarray(v)


def dense_view(c: Case, x: Cache, cache) -> "cupy.ndarray":
    """The call's cache (dense or paged) as (B, capacity, Hkv, D) float64."""
    cache64 = gu.to_f64(cache)
    if x.block_table is None:
        return cache64
    table = x.block_table
    return cache64[table].reshape(c.B, c.capacity, *cache64.shape[2:])


def check_cache(report: gu.Report, c: Case, x: Cache):
    k_want, v_want = expected_cache(c, x)
    for name, cache, want, before in (("k_cache", x.k_cache, k_want, x.k_host_cache),
                                      ("v_cache", x.v_cache, v_want, x.v_host_cache)):
        got = dense_view(c, x, cache)
        bad = got != want
        if bool(cupy.any(bad)):
            report.fail(f"{name}: {int(cupy.count_nonzero(bad))} elements differ from the appended cache "
                        f"(first at {gu.first_bad_index(bad)})")
        if x.block_table is not None:  # pages the table does not name: untouched
            named = set(cupy.asnumpy(x.block_table).ravel().tolist())
            others = [i for i in range(cache.shape[0]) if i not in named]
            if others and not gu.bit_identical(cache[cupy.asarray(others)], cupy.asarray(before[others])):
                report.fail(f"{name}: a page outside the block table changed")


def check_batch(report: gu.Report, c: Case, x: Cache, r: gu.Result, k_all, v_all, b: int):
    n = c.cached[b] + c.snew
    tag = f"batch{b}(keys{n})"
    if n == 0:
        if bool(cupy.any(gu.to_f64(r.out[b]) != 0.0)):
            report.fail(f"{tag}: out is not exactly 0 for a sequence with no key")
        if not bool(cupy.all(cupy.isneginf(r.lse[b]))):
            report.fail(f"{tag}: lse is not -inf for a sequence with no key")
        return
    alibi = None
    if x.alibi is not None:
        alibi = x.alibi if x.alibi.ndim == 1 else x.alibi[b]
    p = gu.Problem(c.dtype, 1, c.Sq, n, c.H, c.Hkv, c.D, c.Dv, causal=c.causal, window=c.window, softcap=c.softcap,
                   alibi=None if alibi is None else "h")
    dt = gu.DTYPES[c.dtype]
    kb = gu.to_device(cupy.asnumpy(k_all[b:b + 1, :n]).astype(np.float32), dt)
    vb = gu.to_device(cupy.asnumpy(v_all[b:b + 1, :n]).astype(np.float32), dt)
    xb = gu.Inputs(x.q[b:b + 1], kb, vb, None, None, alibi_slopes=alibi)
    rb = gu.Result(r.out[b:b + 1], r.lse[b:b + 1])
    e = gu.expected_for(p, xb, backward=False)
    sub = gu.Report(tag)
    gu.check_forward(sub, p, rb, e)
    for line in sub.failures:
        report.fail(f"{tag}: {line}")
    report.note(f"{tag} ok" if not sub.failures else f"{tag} failed")


def _seed(c: Case) -> int:
    return len(c.id) * 7919 + sum(c.cached) + c.Sq


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kvcache_matches_the_reference(case):
    x = make_cache(case, _seed(case))
    r = run(case, x)
    report = gu.Report(case.id)
    gu.check_written(report, "out", r.out)
    gu.check_written(report, "lse", r.lse, allow_neg_inf=True)
    check_cache(report, case, x)
    k_all, v_all = expected_cache(case, x)
    for b in range(case.B):
        check_batch(report, case, x, r, k_all, v_all, b)
    report.check()


@pytest.mark.parametrize("dtype,page_size", [("bf16", 1), ("bf16", 13), ("bf16", 16), ("bf16", 128), ("bf16", 256),
                                             ("fp32", 1), ("fp32", 13), ("fp32", 64)])
def test_paged_equals_dense_bit_for_bit(dtype, page_size):
    capacity = -(-768 // page_size) * page_size
    c = Case(dtype, (0, 1, 255, 511, 765), capacity, 3, 16, 4, 128, snew=3, causal=True, num_splits=1)
    dense = make_cache(c, 21)
    paged = make_cache(c, 21, page_size=page_size)
    r_dense, r_paged = run(c, dense), run(c, paged)
    assert gu.bit_identical(r_dense.out, r_paged.out), "out differs between the paged and the dense cache"
    assert gu.bit_identical(r_dense.lse, r_paged.lse), "lse differs between the paged and the dense cache"
    for split in (4, None):  # split-KV reads the pages the same way
        assert gu.bit_identical(run(c, dense, num_splits=split).out, run(c, paged, num_splits=split).out)


def test_split_equals_no_split_within_rounding():
    c = Case("bf16", (4000, 1, 2500, 3333), 4096, 1, 32, 8, 128, snew=0, num_splits=1)
    x = make_cache(c, 5)
    one = run(c, x)
    for splits in (2, 7, 32, None):
        r = run(c, x, num_splits=splits)
        out_err = float(cupy.max(cupy.abs(gu.to_f64(r.out) - gu.to_f64(one.out))))
        lse_err = float(cupy.max(cupy.abs(r.lse - one.lse)))
        assert out_err <= 2e-2 and lse_err <= 1e-4, (splits, out_err, lse_err)
        report = gu.Report(f"split{splits}")
        k_all, v_all = expected_cache(c, x)
        for b in range(c.B):
            check_batch(report, c, x, r, k_all, v_all, b)
        report.check()


def test_decoding_loop_grows_the_cache():
    """Ten decoding steps, each appending one token and advancing cache_seqlens on the GPU (no host read):
    the last step equals one call over the whole cache."""
    B, H, Hkv, D, L = 3, 8, 2, 64, 96
    rng = np.random.default_rng(2)
    start = np.array([5, 0, 40], dtype=np.int32)
    k_cache = gu.to_device(gu.host_normal(rng, (B, L, Hkv, D)), gu.BF16)
    v_cache = gu.to_device(gu.host_normal(rng, (B, L, Hkv, D)), gu.BF16)
    lengths = cupy.asarray(start)
    for step in range(10):
        q = gu.to_device(gu.host_normal(rng, (B, 1, H, D)), gu.BF16)
        k_new = gu.to_device(gu.host_normal(rng, (B, 1, Hkv, D)), gu.BF16)
        v_new = gu.to_device(gu.host_normal(rng, (B, 1, Hkv, D)), gu.BF16)
        out = cuflash.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, causal=True)
        lengths += 1
    again = cuflash.attention_with_kvcache(q, k_cache, v_cache, lengths, causal=True)
    assert gu.bit_identical(out, again)
    assert cupy.asnumpy(lengths).tolist() == (start + 10).tolist()


def test_bad_arguments_name_themselves():
    B, H, Hkv, D, L = 2, 4, 2, 64, 32
    q = cupy.zeros((B, 1, H, D), dtype=np.float16) + 1
    k = cupy.ones((B, L, Hkv, D), dtype=np.float16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(q, k, k, [L, 40])
    with pytest.raises(ValueError, match="capacity"):
        cuflash.attention_with_kvcache(q, k, k, [L, 0], k[:, :1], k[:, :1])
    with pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(q, k, k, cupy.zeros((3,), cupy.int32))
    with pytest.raises(TypeError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(q, k, k, cupy.zeros((B,), cupy.int64))
    with pytest.raises(ValueError, match="block_table"):
        cuflash.attention_with_kvcache(q, k, k, [1, 1], block_table=[[0, 5], [1, 0]])
    with pytest.raises(ValueError, match="k_new and v_new"):
        cuflash.attention_with_kvcache(q, k, k, [1, 1], k[:, :1])
    with pytest.raises(ValueError, match="bias"):
        cuflash.attention_with_kvcache(q, k, k, [1, 1], bias=cupy.zeros((B, H, 1, L), np.float16))
    with pytest.raises(TypeError, match="share a dtype"):
        cuflash.attention_with_kvcache(q.astype(np.float32), k, k, [1, 1])
    with pytest.raises(TypeError, match="float64"):
        cuflash.attention_with_kvcache(q.astype(np.float64), k.astype(np.float64), k.astype(np.float64), [1, 1])
    with pytest.raises(ValueError, match="num_splits"):
        cuflash.attention_with_kvcache(q, k, k, [1, 1], num_splits=0)
    with pytest.raises(ValueError, match="divide"):
        cuflash.attention_with_kvcache(q[:, :, :3], k, k, [1, 1])
