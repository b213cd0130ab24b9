"""Run every cuflash kernel family once on small shapes, for compute-sanitizer (benchmarks/sanitize.sh).

The cases hit tail tiles (lengths that are not multiples of any block size), GQA and MQA, causal
with rows that see no key, Dv != D, head dims in several buckets (8 .. 256), every dtype (fp32 is
the SIMT path), both backward modes (deterministic or not) and the dlse path: so the forward, the
backward pre-pass, dK/dV, dQ, the dq convert and the GQA reduce kernels all run.

Made for the sanitizer tools:
- CuPy's memory pool is switched off: every array is its own exact-size ``cudaMalloc``, so memcheck
  sees any access past an array's end (inside a pool block it would not), and initcheck sees fresh,
  uninitialized memory for every output and scratch buffer.
- Inputs are drawn on the host and copied in, so every input byte is initialized; outputs are then
  read back in full (a NaN check), so an element a kernel never wrote is an initcheck error.

Exit status: 0 when every output is finite, 1 otherwise. ``--list`` prints the cases and the kernel
variants they launch (needs only a CUDA device for its compute capability).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

# Run from a checkout without installing: the repository root holds the cuflash package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclasses.dataclass(frozen=True)
class Case:
    what: str
    dtype: str  # "float16" | "bfloat16" | "float32"
    B: int
    Sq: int
    Sk: int
    H: int
    Hkv: int
    D: int
    Dv: int
    causal: bool
    deterministic: bool
    dlse: bool
    options: str = ""  # "+"-joined: window, segments, blocks, softcap, alibi, bias, biasheads, biaskeys (a key
    #                    bias (1, Hkv, 1, Sk)), mask, maskheads,
    #                    varlen (B packed sequences of random lengths <= Sq / Sk, uncovered rows after them),
    #                    dropout (dropout_p 0.3 with a fixed seed),
    #                    kvcache (attention_with_kvcache: Sk = the cache's capacity, ragged lengths, Sq new tokens
    #                    appended; + paged: pages of 13 rows; + split: num_splits 3; fp16 / bf16 only)

    def __str__(self) -> str:
        return (f"{self.dtype:8s} B{self.B} q{self.Sq} k{self.Sk} h{self.H}/{self.Hkv} D{self.D}/{self.Dv}"
                f"{' causal' if self.causal else ''}{' det' if self.deterministic else ''}"
                f"{' dlse' if self.dlse else ''}{' ' + self.options if self.options else ''}  ({self.what})")


def cases(quick: bool = False) -> list:
    out = []
    for dtype in ("float16", "bfloat16", "float32"):
        per_dtype = [
            Case("tails, GQA", dtype, 2, 17, 33, 4, 2, 64, 64, False, False, False),
            Case("rows that see no key, MQA, dlse", dtype, 1, 70, 33, 4, 1, 40, 40, True, True, True),
            Case("bucket 160, several blocks", dtype, 1, 130, 129, 2, 2, 136, 136, True, False, False),
            Case("bucket 128 (the hot tile), several blocks, GQA", dtype, 1, 200, 333, 4, 2, 128, 128, True, False, False),
            Case("deterministic, causal, several blocks (the warp-specialized dK/dV mainloop), GQA", dtype, 2, 300, 333, 4,
                 2, 128, 128, True, True, False),
            Case("persistent causal: CTAs walk pairs of a head's longest and shortest query blocks (480 units), Sq > Sk",
                 dtype, 30, 333, 300, 8, 2, 128, 128, True, False, False),
            Case("persistent: more tiles than SMs (140), a CTA walks two, GQA", dtype, 35, 70, 90, 4, 2, 128, 128, False,
                 False, False),
            Case("D 256, MQA, deterministic", dtype, 1, 65, 131, 2, 1, 256, 256, False, True, False),
            Case("D 256 causal, GQA, several blocks: the warp-specialized dK/dV (P^T / dS^T exchanged) and the wgmma "
                 "dQ kernel (three stages)", dtype, 2, 333, 290, 4, 2, 256, 256, True, False, True),
            Case("D 8, Dv 24, one query", dtype, 1, 1, 9, 2, 1, 8, 24, True, False, True),
            Case("general mask: window + documents, GQA, block lists", dtype, 2, 150, 211, 4, 2, 64, 64, True,
                 False, False, "window+segments"),
            Case("window + documents, deterministic, D 128, GQA: the ordered dQ adds under a general mask, ranked by "
                 "the query blocks' lists", dtype, 2, 150, 211, 4, 2, 128, 128, True, True, False, "window+segments"),
            Case("block ids, deterministic, D 64, dlse: the ordered dQ adds under a general mask without causal",
                 dtype, 2, 130, 140, 4, 2, 64, 64, False, True, True, "blocks"),
            Case("general-mask tile queue: 288 tiles on at most the SMs' CTAs, each taking several, documents",
                 dtype, 12, 300, 300, 8, 2, 128, 128, True, False, False, "segments"),
            Case("block ids + softcap + ALiBi, MQA, deterministic", dtype, 1, 97, 300, 4, 1, 128, 128, False,
                 True, True, "blocks+softcap+alibi"),
            Case("many short documents, D 256", dtype, 1, 260, 260, 2, 1, 256, 256, False, False, False,
                 "segments"),
            Case("full bias (staged tiles, dbias stored), D 128, GQA", dtype, 2, 150, 200, 4, 2, 128, 128, True,
                 False, True, "bias"),
            Case("full bias + ALiBi, causal, dlse: staged in the warp-specialized dK/dV's dS tiles", dtype, 1, 200, 264, 2,
                 1, 128, 128, True, False, True, "bias+alibi"),
            Case("full bias, Sk 131 (read directly), causal, deterministic: the warp-specialized dK/dV's ordered dQ adds",
                 dtype, 2, 130, 131, 4, 2, 128, 128, True, True, False, "bias"),
            Case("broadcast bias (dbias atomics) + softcap, odd Sk (read directly)", dtype, 2, 99, 131, 4, 2, 64, 64,
                 False, False, False, "biasheads+softcap"),
            Case("broadcast bias, deterministic: the dbias adds take turns (dbias_order.cuh), D 128, causal", dtype, 3,
                 140, 150, 4, 2, 128, 128, True, True, False, "biasheads"),
            Case("broadcast bias, deterministic, window: the turns under a general mask (every head, the same tiles)",
                 dtype, 3, 150, 170, 4, 2, 128, 128, True, True, False, "biasheads+window"),
            Case("broadcast bias, deterministic, dropout, D 64: the turns on the mma.sync tile", dtype, 2, 99, 131, 4,
                 2, 64, 64, False, True, True, "biasheads+dropout"),
            Case("broadcast bias, deterministic, documents: the turns over the union of the batch rows' lists",
                 dtype, 3, 150, 170, 4, 2, 128, 128, True, True, False, "biasheads+segments"),
            Case("broadcast bias, deterministic, bool mask per kv head, D 64: the lists' union over the heads", dtype,
                 2, 99, 131, 4, 2, 64, 64, False, True, False, "biasheads+maskheads"),
            Case("key bias, deterministic: per-thread partials (add_grad_over_queries), D 128, window", dtype, 2,
                 150, 170, 4, 2, 128, 128, False, True, False, "biaskeys+window"),
            Case("key bias, deterministic, D 64, causal, documents", dtype, 2, 130, 140, 4, 1, 64, 64, True, True,
                 True, "biaskeys+segments"),
            Case("full bias on the persistent warp-specialized forward: 140 tiles, staged bias tiles", dtype, 35, 70,
                 96, 4, 2, 128, 128, False, False, False, "bias"),
            Case("broadcast bias + documents: the tile queue with staged bias tiles, D 64", dtype, 12, 300, 296, 8, 2,
                 64, 64, True, False, False, "biasheads+segments"),
            Case("bool mask per kv head + window, deterministic", dtype, 2, 140, 170, 4, 2, 64, 64, False, True,
                 False, "maskheads+window"),
            Case("bool mask + full bias, D 256", dtype, 1, 90, 120, 2, 1, 256, 256, True, True, False, "mask+bias"),
            Case("varlen: 40 short sequences (the epilogue of many tiny blocks), GQA", dtype, 40, 40, 40, 4, 2, 64, 64,
                 True, False, True, "varlen"),
            Case("varlen: ragged + window, MQA, deterministic", dtype, 5, 300, 260, 4, 1, 128, 128, True, True, False,
                 "varlen+window"),
            Case("dropout, causal, GQA, odd sizes", dtype, 2, 77, 99, 4, 2, 64, 64, True, False, True, "dropout"),
            Case("dropout + bool mask + full bias, D 128, deterministic", dtype, 1, 130, 150, 2, 1, 128, 128, False, True,
                 False, "dropout+mask+bias"),
        ]
        per_dtype += [  # float32: the KV cache's SIMT kernel (flash_kvcache_simt.cu)
            Case("kvcache: decode, GQA 8, split, dense", dtype, 3, 1, 200, 16, 2, 128, 128, True, False, False,
                 "kvcache+split"),
            Case("kvcache: chunked prefill, paged (13 rows), window + ALiBi", dtype, 2, 37, 260, 4, 2, 64, 64,
                 True, False, False, "kvcache+paged+window+alibi"),
            Case("kvcache: decode, paged (13 rows), split, D 256 MQA", dtype, 2, 1, 520, 8, 1, 256, 256, False,
                 False, False, "kvcache+paged+split"),
            Case("kvcache: chunked prefill on the prefill tile (16-bit: 128 rows from 256 per kv head; float32: "
                 "the SIMT forward's), paged (13 rows), GQA",
                 dtype, 2, 130, 390, 4, 2, 128, 128, True, False, False, "kvcache+paged"),
        ]
        out += per_dtype[:2] + [c for c in per_dtype if c.options] if quick else per_dtype
    return out


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _device_array(rng, shape, dtype):
    import cupy

    host = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return cupy.asarray(host)


def _nonfinite(x) -> int:
    """Count of NaN / inf elements (-inf allowed where ``x`` is an lse), read through the bits so no
    bfloat16 cast kernel is needed. Reads every element: an unwritten one is an initcheck error."""
    import cupy

    if x.dtype.itemsize == 2:
        wide = x.view(cupy.uint16).astype(cupy.uint32)
        if x.dtype == np.float16:
            bad = (wide & 0x7C00) == 0x7C00
        else:
            bad = (wide & 0x7F80) == 0x7F80
        return int(cupy.count_nonzero(bad))
    f = x.astype(cupy.float32)
    return int(cupy.count_nonzero(~(cupy.isfinite(f) | cupy.isneginf(f))))


def _options(case: Case, rng) -> dict:
    """The score options of a case, as device arrays (documents / blocks of random lengths)."""
    import cupy

    def runs(n, count):  # nondecreasing ids in `count` runs over n positions
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(count, n) - 1, replace=False)) if n > 1 else []
        return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)

    opts = {}
    for name in filter(None, case.options.split("+")):
        if name == "window":
            opts["window"] = (40, 7)
        elif name == "softcap":
            opts["softcap"] = 5.0
        elif name == "alibi":
            opts["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, (case.B, case.H)).astype(np.float32))
        elif name in ("segments", "blocks"):
            ids = np.stack([runs(case.Sk, 9) for _ in range(case.B)])  # bottom-right: q takes the last Sq
            pair = (cupy.asarray(np.ascontiguousarray(ids[:, case.Sk - case.Sq:]) if case.Sq <= case.Sk
                                 else np.concatenate([np.zeros((case.B, case.Sq - case.Sk), np.int32), ids], 1)),
                    cupy.asarray(ids))
            opts["segment_ids" if name == "segments" else "block_ids"] = pair
        elif name in ("bias", "biasheads", "biaskeys"):
            shape = {"bias": (case.B, case.H, case.Sq, case.Sk), "biasheads": (1, case.H, case.Sq, case.Sk),
                     "biaskeys": (1, case.Hkv, 1, case.Sk)}[name]
            opts["bias"] = _device_array(rng, shape, _dtype(case.dtype))
        elif name in ("mask", "maskheads"):
            shape = (case.B, case.Hkv if name == "maskheads" else 1, case.Sq, case.Sk)
            opts["mask"] = cupy.asarray(rng.random(shape) < 0.6)
        elif name in ("varlen", "kvcache", "paged", "split"):
            pass  # run_varlen_case, run_kvcache_case
        elif name == "dropout":
            opts["dropout_p"], opts["seed"] = 0.3, 0x5EED_0000_1234_ABCD
        else:
            raise ValueError(f"unknown option {name!r} in case {case}")
    return opts


def run_varlen_case(case: Case, seed: int) -> int:
    """Packed sequences: B lengths drawn from [0, Sq] and [0, Sk] (one of each forced to the maximum), 3 q rows
    and 2 k rows after the last sequence that no sequence covers; offsets on the GPU with the longest given."""
    import cupy

    import cuflash

    rng = np.random.default_rng(seed)
    dt = _dtype(case.dtype)
    lens_q, lens_k = rng.integers(0, case.Sq + 1, case.B), rng.integers(0, case.Sk + 1, case.B)
    lens_q[0], lens_k[-1] = case.Sq, case.Sk
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lens_q, lens_k))
    tq, tk = int(lens_q.sum()) + 3, int(lens_k.sum()) + 2
    q = _device_array(rng, (tq, case.H, case.D), dt)
    k = _device_array(rng, (tk, case.Hkv, case.D), dt)
    v = _device_array(rng, (tk, case.Hkv, case.Dv), dt)
    dout = _device_array(rng, (tq, case.H, case.Dv), dt)
    dlse = cupy.asarray(rng.standard_normal((case.H, tq), dtype=np.float32)) if case.dlse else None
    opts = _options(case, rng)
    lengths = (cu_q, cu_k, case.Sq, case.Sk)
    out, lse = cuflash.varlen_attention_forward(q, k, v, *lengths, causal=case.causal, **opts)
    grads = cuflash.varlen_attention_backward(dout, q, k, v, out, lse, *lengths, dlse=dlse, causal=case.causal,
                                              deterministic=case.deterministic, **opts)
    return _count_bad(out, lse, grads)


def run_kvcache_case(case: Case, seed: int) -> int:
    """attention_with_kvcache: a cache of Sk keys per sequence (dense, or pages of 13 rows in a shuffled table
    with spare pages), ragged cache_seqlens on the GPU (0, full minus the new tokens, random), Sq new tokens
    appended, causal as the case says; the caches are checked for NaN too (the append writes them)."""
    import cupy

    import cuflash

    rng = np.random.default_rng(seed)
    dt = _dtype(case.dtype)
    names = set(case.options.split("+"))
    lengths = rng.integers(0, case.Sk - case.Sq + 1, case.B)
    lengths[0], lengths[-1] = 0, case.Sk - case.Sq
    q = _device_array(rng, (case.B, case.Sq, case.H, case.D), dt)
    k_new = _device_array(rng, (case.B, case.Sq, case.Hkv, case.D), dt)
    v_new = _device_array(rng, (case.B, case.Sq, case.Hkv, case.Dv), dt)
    table = None
    if "paged" in names:
        page = 13
        assert case.Sk % page == 0
        pages = case.B * case.Sk // page + 2
        table = cupy.asarray(rng.permutation(pages)[:pages - 2].reshape(case.B, -1).astype(np.int32))
        k = _device_array(rng, (pages, page, case.Hkv, case.D), dt)
        v = _device_array(rng, (pages, page, case.Hkv, case.Dv), dt)
    else:
        k = _device_array(rng, (case.B, case.Sk, case.Hkv, case.D), dt)
        v = _device_array(rng, (case.B, case.Sk, case.Hkv, case.Dv), dt)
    opts = {name: value for name, value in _options(case, rng).items() if name in ("window", "alibi_slopes", "softcap")}
    out, lse = cuflash.attention_with_kvcache(q, k, v, cupy.asarray(lengths.astype(np.int32)), k_new, v_new,
                                              block_table=table, num_splits=3 if "split" in names else 1,
                                              causal=case.causal, return_lse=True, **opts)
    return _count_bad(out, lse, (k, v))


def _count_bad(out, lse, grads) -> int:
    import cupy

    cupy.cuda.Device().synchronize()
    bad = 0
    for name, x in zip(("out", "dq", "dk", "dv", "dbias"), (out, *grads)):
        n = _nonfinite(x)
        if n:
            print(f"  {name}: {n} non-finite elements")
        bad += n
    lse_bad = int(cupy.count_nonzero(cupy.isnan(lse) | cupy.isposinf(lse)))
    if lse_bad:
        print(f"  lse: {lse_bad} NaN / +inf elements")
    return bad + lse_bad


def run_case(case: Case, seed: int) -> int:
    import cupy

    import cuflash

    if "varlen" in case.options.split("+"):
        return run_varlen_case(case, seed)
    if "kvcache" in case.options.split("+"):
        return run_kvcache_case(case, seed)
    rng = np.random.default_rng(seed)
    dt = _dtype(case.dtype)
    q = _device_array(rng, (case.B, case.Sq, case.H, case.D), dt)
    k = _device_array(rng, (case.B, case.Sk, case.Hkv, case.D), dt)
    v = _device_array(rng, (case.B, case.Sk, case.Hkv, case.Dv), dt)
    dout = _device_array(rng, (case.B, case.Sq, case.H, case.Dv), dt)
    dlse = cupy.asarray(rng.standard_normal((case.B, case.H, case.Sq), dtype=np.float32)) if case.dlse else None
    opts = _options(case, rng)
    out, lse = cuflash.attention_forward(q, k, v, causal=case.causal, **opts)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal=case.causal,
                                       deterministic=case.deterministic, **opts)
    return _count_bad(out, lse, grads)


def kernel_names(case_list, arch: int) -> list:
    """The kernel variants the cases launch, from the plans (no launch)."""
    from cuflash import kernels

    names = set()
    for c in case_list:
        names_in = set(filter(None, c.options.split("+")))
        if "kvcache" in names_in:
            from cuflash.kernels import kvcache

            plan = kvcache.plan(c.dtype, c.B, c.Sq, c.H, c.Hkv, kernels.head_dim_bucket(c.D), c.Dv,
                                int("alibi" in names_in), c.Sk, True, 3 if "split" in names_in else 1, arch, 132)
            names.update(launch.variant.name for launch in plan.launches)
            continue
        bias = bool(names_in & {"bias", "biasheads", "biaskeys"})
        mod = (kernels.MOD_BIAS_SOFTCAP if "softcap" in names_in else kernels.MOD_BIAS) if bias else int(
            bool(names_in & {"softcap", "alibi"}))
        shape = kernels.ProblemShape(c.B, c.Sq, c.Sk, c.H, c.Hkv, c.D, c.Dv, c.dtype, c.causal,
                                     general_mask=bool(names_in & {"window", "segments", "blocks", "mask",
                                                                   "maskheads"}),
                                     score_mod=mod, mask_heads=c.Hkv if "maskheads" in names_in else 1,
                                     bool_mask=bool(names_in & {"mask", "maskheads"}),
                                     packed="varlen" in names_in, total_q=c.B * c.Sq, total_k=c.B * c.Sk,
                                     dropout="dropout" in names_in)
        for plan in (kernels.plan_forward(shape, arch), kernels.plan_backward(shape, arch, c.deterministic)):
            for launch in plan.launches:
                names.add(launch.variant.name)
    return sorted(names)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="per dtype: the first two cases and the score-option ones")
    parser.add_argument("--list", action="store_true", help="print the cases and kernels, run nothing")
    parser.add_argument("--keep-pool", action="store_true", help="keep CuPy's memory pool (faster, blinder)")
    parser.add_argument("--cases", metavar="REGEX", help="only the cases whose description matches REGEX")
    parser.add_argument("--dkdv-mainloop", choices=("sm80", "sm90", "sm90_ws"),
                        help="run every dK/dV kernel that can take it on this mainloop (sm_90a; e.g. sm90_ws for the "
                             "warp-specialized one's atomic dQ step, which the plans do not pick)")
    args = parser.parse_args(argv)
    if args.dkdv_mainloop:
        from cuflash.kernels import backward

        forced = {"sm80": backward.MAINLOOP_SM80, "sm90": backward.MAINLOOP_SM90,
                  "sm90_ws": backward.MAINLOOP_SM90_WS}[args.dkdv_mainloop]
        default = backward.dkdv_mainloop

        def pick(arch, bucket, mask, score_mod, atomic_dq):
            kind = default(arch, bucket, mask, score_mod, atomic_dq)
            if kind == backward.MAINLOOP_SM80 or (forced == backward.MAINLOOP_SM90_WS
                                                   and not backward.ws_fits(bucket, mask, score_mod)):
                return kind
            return forced

        backward.dkdv_mainloop = pick

    import cupy

    try:
        have_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device
        have_gpu = False
    chosen = cases(args.quick)
    if args.cases:
        import re

        chosen = [c for c in chosen if re.search(args.cases, str(c))]
    arch = int(cupy.cuda.Device().compute_capability) if have_gpu else 90
    try:
        families = kernel_names(chosen, arch)
    except Exception as exc:  # noqa: BLE001 - plans are informative only
        families = [f"(could not list kernels: {exc})"]
    if not have_gpu and not args.list:
        print("sanitize_driver: needs a CUDA GPU")
        return 1
    if args.list:
        print("\n".join(str(c) for c in chosen))
        print("kernels:", ", ".join(families))
        return 0
    if not args.keep_pool:
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)

    failures = 0
    start = time.perf_counter()
    for index, case in enumerate(chosen):
        t0 = time.perf_counter()
        bad = run_case(case, seed=index)
        if {"varlen", "kvcache"} & set(case.options.split("+")):  # again with the same key: the cached call's pointers
            bad += run_case(case, seed=index)
        print(f"{'FAIL' if bad else 'ok  '} {case}  {time.perf_counter() - t0:.1f} s", flush=True)
        failures += bool(bad)
    print(f"kernels covered: {', '.join(families)}")
    print(f"{len(chosen)} cases, {failures} with non-finite outputs, {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
