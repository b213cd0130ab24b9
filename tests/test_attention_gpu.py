"""The kernel grid on a GPU: forward and backward against the float64 reference.

The full cross product (3 dtypes x 32 head dims x causal x 3 head layouts x ~12 length pairs) is
~7000 cases; this file covers it with overlapping slices instead, so every pair of factors meets
somewhere while the run stays around a minute once kernels are compiled:

- ``test_head_dims``: every head dim 8..256 x every dtype, at two small odd shapes (one of them
  causal with MQA), deterministic backward on alternate head dims;
- ``test_lengths``: every length pair (1, 17, 127, 129, 1000, Sq != Sk both ways) x every head
  layout (8/8, 8/2, 8/1) x causal, at four (dtype, head dim) points;
- ``test_long``: 2049 tokens only at D 64 / 128 / 256 (and fp32 at 64 / 256);
- determinism (bit-identical backward over 10 runs; forward always), Dv != D, strided inputs and
  outputs, custom scales, the dlse gradient path, and non-default streams.

Every call writes into NaN-poisoned caller buffers (gpu_utils.run_cuflash), so "every element
written" and "no NaN" are checked everywhere; the tolerance rule is gpu_utils' module docstring.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import gpu_utils as gu  # noqa: E402
from gpu_utils import poisoned_allocations  # noqa: E402,F401  (autouse: CuPy allocations start as NaN)
from gpu_utils import Problem  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session", autouse=True)
def _precompiled(request):
    """Pay every kernel's compile once, in parallel, before the first test (not serially inside it)."""
    gu.announce_precompile(request.config)


# --------------------------------------------------------------------------------------------
# Every head dim x dtype
# --------------------------------------------------------------------------------------------

HEAD_DIMS = tuple(range(8, 257, 8))
DTYPES = ("fp16", "bf16", "fp32")


def _head_dim_problems():
    problems = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            det = (d // 8) % 2 == 0
            # small odd shape, MHA, full attention, batch 2
            problems.append(Problem(dtype, B=2, Sq=17, Sk=17, H=2, Hkv=2, D=d, deterministic=det))
            # odd tails on both sides, MQA, causal with Sq < Sk
            problems.append(Problem(dtype, B=1, Sq=67, Sk=129, H=4, Hkv=1, D=d, causal=True,
                                    deterministic=not det))
    return problems


HEAD_DIM_PROBLEMS = _head_dim_problems()


@pytest.mark.parametrize("p", HEAD_DIM_PROBLEMS, ids=gu.problem_ids(HEAD_DIM_PROBLEMS))
def test_head_dims(p):
    gu.check_attention(p)


# --------------------------------------------------------------------------------------------
# Lengths x head layouts x causal
# --------------------------------------------------------------------------------------------

LENGTH_PAIRS = ((1, 1), (17, 17), (127, 127), (129, 129), (1000, 1000),
                (1, 129), (129, 1), (17, 1000), (1000, 17), (127, 129), (129, 127))
HEAD_LAYOUTS = ((8, 8), (8, 2), (8, 1))
# (dtype, head dim): the common tensor-core dims, the fp32 SIMT path, and a D that is not a bucket
DTYPE_DIMS = (("bf16", 128), ("fp16", 64), ("fp32", 32), ("bf16", 232))


def _length_problems():
    problems = []
    for dtype, d in DTYPE_DIMS:
        for index, (sq, sk) in enumerate(LENGTH_PAIRS):
            for h, hkv in HEAD_LAYOUTS:
                for causal in (False, True):
                    problems.append(Problem(dtype, B=2, Sq=sq, Sk=sk, H=h, Hkv=hkv, D=d, causal=causal,
                                            deterministic=index % 2 == 1))
    return problems


LENGTH_PROBLEMS = _length_problems()


@pytest.mark.parametrize("p", LENGTH_PROBLEMS, ids=gu.problem_ids(LENGTH_PROBLEMS))
def test_lengths(p):
    gu.check_attention(p)


# --------------------------------------------------------------------------------------------
# Long sequences (2049 tokens) at the head dims models use
# --------------------------------------------------------------------------------------------

def _long_problems():
    problems = []
    for d in (64, 128, 256):
        for causal in (False, True):
            problems.append(Problem("bf16", B=1, Sq=2049, Sk=2049, H=8, Hkv=2, D=d, causal=causal))
            problems.append(Problem("fp16", B=1, Sq=2049, Sk=1000, H=8, Hkv=1, D=d, causal=causal,
                                    deterministic=True))
            problems.append(Problem("fp16", B=1, Sq=1000, Sk=2049, H=8, Hkv=8, D=d, causal=causal))
    for d in (64, 256):
        for causal in (False, True):
            problems.append(Problem("fp32", B=1, Sq=2049, Sk=2049, H=8, Hkv=2, D=d, causal=causal))
    # The causal dK/dV grid's order (chunked_grid_order, bwd_config.cuh): 12 (head, batch) pairs in chunks of
    # 7 (16 MB of Q and dO at 4100 x 128), so two chunks, the last one partial, over 33 key blocks.
    problems.append(Problem("bf16", B=2, Sq=4100, Sk=4100, H=6, Hkv=3, D=128, causal=True))
    return problems


LONG_PROBLEMS = _long_problems()


@pytest.mark.parametrize("p", LONG_PROBLEMS, ids=gu.problem_ids(LONG_PROBLEMS))
def test_long(p):
    gu.check_attention(p)


# --------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------

DETERMINISM_PROBLEMS = (
    Problem("bf16", B=2, Sq=1000, Sk=1000, H=8, Hkv=2, D=128, causal=True, deterministic=True),
    Problem("fp16", B=1, Sq=129, Sk=1000, H=8, Hkv=1, D=64, deterministic=True),
    Problem("fp32", B=1, Sq=257, Sk=257, H=8, Hkv=2, D=64, causal=True, deterministic=True),
    # The ordered dQ adds on sm_90a (cuflash/dq_order.cuh): more dK/dV CTAs than SMs (4 x 16 x 17 key blocks),
    # causal with Sq != Sk both ways, a sequence that ends inside a query block, MQA.
    Problem("bf16", B=4, Sq=2100, Sk=2100, H=16, Hkv=4, D=128, deterministic=True),
    Problem("bf16", B=2, Sq=700, Sk=1500, H=6, Hkv=2, D=64, causal=True, deterministic=True),
    Problem("fp16", B=2, Sq=1500, Sk=700, H=4, Hkv=1, D=128, causal=True, deterministic=True),
    # Unmasked ordered adds with each head's key blocks staggered (chunked_grid_order, bwd_config.cuh): 32
    # (head, batch) pairs in chunks of 21 (16 MB of Q and dO at 3000 x 64), the last chunk partial.
    Problem("bf16", B=2, Sq=3000, Sk=3000, H=16, Hkv=16, D=64, deterministic=True),
)
RUNS = 10


@pytest.mark.parametrize("p", DETERMINISM_PROBLEMS, ids=gu.problem_ids(DETERMINISM_PROBLEMS))
def test_deterministic_backward_is_bit_identical(p):
    """deterministic=True: dq, dk, dv bit-identical over 10 runs (and still correct)."""
    gu.check_deterministic(p, RUNS)


# --------------------------------------------------------------------------------------------
# dK/dV blocks that accumulate several query heads of a GQA group (the plan's dkdv_heads)
# --------------------------------------------------------------------------------------------

# Every grouping of a 6-head kv group (1, 2, 3 or all 6 query heads per dK/dV block), forced in the plan:
# the plan picks by cost (never more than one head under a causal mask), but every grouping must be right,
# partials and reduce (G < 6) or dK / dV written directly (G = 6), masks and tails included.
GROUPED_HEADS = (
    Problem("bf16", B=2, Sq=333, Sk=333, H=12, Hkv=2, D=128, causal=True),
    Problem("fp16", B=2, Sq=333, Sk=290, H=12, Hkv=2, D=256, deterministic=True),
    Problem("bf16", B=1, Sq=77, Sk=333, H=6, Hkv=1, D=64, causal=True),
    Problem("fp16", B=2, Sq=300, Sk=300, H=6, Hkv=1, D=96, deterministic=True, causal=True),
)


@pytest.mark.parametrize("heads", (1, 2, 3, 6))
@pytest.mark.parametrize("p", GROUPED_HEADS, ids=gu.problem_ids(GROUPED_HEADS))
def test_grouped_heads_per_dkdv_block(p, heads, monkeypatch):
    from cuflash import api, kernels, launch
    from cuflash.kernels import backward

    monkeypatch.setattr(backward, "dkdv_heads", lambda *args, **kwargs: heads)
    launch.backward_plan.cache_clear()
    monkeypatch.setattr(api, "_backward_plans", {})
    try:
        x = gu.make_inputs(p)
        gu.check_attention(p, inputs=x)
        shape = kernels.ProblemShape(p.B, p.Sq, p.Sk, p.H, p.Hkv, p.D, p.D, p.dtype_name, p.causal)
        plan = launch.backward_plan(shape, 0, p.deterministic)
        assert dict(plan.fields)["dkdv_heads"] == heads
        assert ("dk_accum" in plan.scratch_dict()) == (heads != p.H // p.Hkv)
        if p.deterministic:  # bit-identical again, whatever the grouping
            again = gu.run_cuflash(p, x)
            first = gu.run_cuflash(p, x)
            for name in ("dq", "dk", "dv"):
                assert gu.bit_identical(getattr(again, name), getattr(first, name)), name
    finally:
        launch.backward_plan.cache_clear()


# Every forward mainloop of sm_90a on the same problems, whichever one the plans pick: the mma.sync one, the
# 8-warp wgmma one and the warp-specialized one (producer warpgroup, ping-pong consumers). Odd lengths (a
# partial last block on both sides, one block only, Sq != Sk), GQA / MQA, causal with Sq < Sk, a negative
# scale (the producer flips Q's sign), dlse, and the three wgmma head dims. Three have more unmasked tiles
# than an H100 has SMs (140, 160, 136), so CTAs of the persistent grid walk two: with O staged in its own tile
# (D128, D64 with a negative scale) and in Q's (D256); the last two walk causal pairs (480 and 144 units).
MAINLOOP_PROBLEMS = (
    Problem("bf16", B=2, Sq=333, Sk=517, H=6, Hkv=2, D=128, causal=True),
    Problem("fp16", B=1, Sq=129, Sk=1000, H=4, Hkv=1, D=64),
    Problem("bf16", B=2, Sq=77, Sk=65, H=2, Hkv=2, D=256, causal=True),
    Problem("fp16", B=1, Sq=1000, Sk=129, H=3, Hkv=3, D=128, scale=-0.2),
    Problem("bf16", B=1, Sq=17, Sk=17, H=2, Hkv=1, D=256),
    Problem("bf16", B=1, Sq=2000, Sk=2000, H=2, Hkv=2, D=64, causal=True, dlse=True),
    Problem("bf16", B=35, Sq=70, Sk=90, H=4, Hkv=2, D=128),
    Problem("fp16", B=20, Sq=130, Sk=70, H=4, Hkv=4, D=256),
    Problem("bf16", B=34, Sq=33, Sk=40, H=4, Hkv=1, D=64, scale=-0.3),
    # Causal on the persistent grid, CTAs walking pairs of a head's longest and shortest query blocks: 3 query
    # blocks (a pair and a lone middle one) with Sq > Sk (empty tiles), 6 at D64 (192-row tiles) with Sq < Sk.
    Problem("bf16", B=30, Sq=333, Sk=300, H=8, Hkv=2, D=128, causal=True),
    Problem("fp16", B=12, Sq=1000, Sk=1100, H=4, Hkv=4, D=64, causal=True),
)

#: The additive bias on every forward mainloop (the warp-specialized one takes it at D64 / D128 since session 13,
#: its producer copying the staged bias tiles): staged tiles (Sk a multiple of 8) on the persistent grid and under
#: the tile queue (segment ids), direct reads (odd Sk, a key-broadcast bias), -inf entries and rows, softcap.
BIAS_MAINLOOP_PROBLEMS = (
    Problem("bf16", B=3, Sq=300, Sk=264, H=4, Hkv=2, D=128, bias="full"),
    Problem("fp16", B=2, Sq=333, Sk=517, H=6, Hkv=2, D=128, bias="full", causal=True),
    Problem("bf16", B=2, Sq=256, Sk=256, H=8, Hkv=2, D=128, bias="neginf", dlse=True),
    Problem("fp16", B=2, Sq=129, Sk=77, H=4, Hkv=4, D=128, bias="keys", softcap=3.0),
    Problem("bf16", B=2, Sq=200, Sk=136, H=4, Hkv=1, D=64, bias="heads", segments="docs"),
    Problem("bf16", B=1, Sq=1000, Sk=520, H=2, Hkv=2, D=64, bias="full", softcap=3.0, causal=True),
    Problem("fp16", B=4, Sq=65, Sk=300, H=4, Hkv=2, D=64, bias="kv", window=(70, 9)),
)


def own_plan_caches(monkeypatch):
    """Plan caches of the test's own: a patched mainloop choice must neither read nor leave cached plans."""
    from cuflash import api, launch

    for name in ("forward_plan", "backward_plan"):
        monkeypatch.setattr(launch, name, functools.lru_cache(maxsize=64)(getattr(launch, name).__wrapped__))
    monkeypatch.setattr(api, "_forward_plans", {})
    monkeypatch.setattr(api, "_backward_plans", {})


@pytest.mark.parametrize("mainloop", ("sm80", "sm90", "sm90_ws"))
@pytest.mark.parametrize("p", MAINLOOP_PROBLEMS, ids=gu.problem_ids(MAINLOOP_PROBLEMS))
def test_every_forward_mainloop(p, mainloop, monkeypatch):
    import cupy

    from cuflash import kernels, launch
    from cuflash.kernels import forward

    if cupy.cuda.Device(0).compute_capability != "90":
        pytest.skip("the wgmma mainloops need an sm_90 GPU")
    kind = {"sm80": forward.MAINLOOP_SM80, "sm90": forward.MAINLOOP_SM90, "sm90_ws": forward.MAINLOOP_SM90_WS}[mainloop]
    if kind == forward.MAINLOOP_SM90 and p.D not in forward.WGMMA_BUCKETS:
        pytest.skip(f"no 8-warp wgmma tile for D{p.D}")
    monkeypatch.setattr(forward, "default_mainloop", lambda *args, **kwargs: kind)
    own_plan_caches(monkeypatch)
    shape = kernels.ProblemShape(p.B, p.Sq, p.Sk, p.H, p.Hkv, p.D, p.dv, p.dtype_name, p.causal)
    assert launch.forward_plan(shape, 0).launches[-1].variant.config.mainloop == kind
    gu.check_attention(p)


@pytest.mark.parametrize("mainloop", ("sm80", "sm90", "sm90_ws"))
@pytest.mark.parametrize("p", BIAS_MAINLOOP_PROBLEMS, ids=gu.problem_ids(BIAS_MAINLOOP_PROBLEMS))
def test_bias_on_every_forward_mainloop(p, mainloop, monkeypatch):
    test_every_forward_mainloop(p, mainloop, monkeypatch)


def _dkdv_mainloop_or_skip(mainloop: str, bucket: int, mask: int, score_mod: int) -> int:
    """The dK/dV mainloop kind named ("sm80", "sm90", "sm90_ws"); skips the test off sm_90 or where the kind has no
    tile for (bucket, mask, score_mod)."""
    import cupy

    from cuflash.kernels import backward

    if cupy.cuda.Device(0).compute_capability != "90":
        pytest.skip("the wgmma mainloops need an sm_90 GPU")
    kind = {"sm80": backward.MAINLOOP_SM80, "sm90": backward.MAINLOOP_SM90,
            "sm90_ws": backward.MAINLOOP_SM90_WS}[mainloop]
    if kind != backward.MAINLOOP_SM80 and not backward.uses_wgmma(90, bucket, score_mod):
        pytest.skip(f"no wgmma dK/dV tile for D{bucket} with score_mod {score_mod}")
    if kind == backward.MAINLOOP_SM90_WS and not backward.ws_fits(bucket, mask, score_mod):
        pytest.skip(f"no warp-specialized dK/dV mainloop for D{bucket}, mask {mask}, score_mod {score_mod}")
    return kind


# Every dK/dV mainloop of sm_90a on the same problems (the backward of gu.check_attention), whichever one the
# plans pick: mma.sync, wgmma with every thread loading, and the warp-specialized one (a producer warpgroup
# loads and adds dQ from shared tiles; D64 / D128 / D256 without a bool mask or dropout). Both backward modes:
# the deterministic one has no dQ step in the dK/dV kernel.
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("mainloop", ("sm80", "sm90", "sm90_ws"))
@pytest.mark.parametrize("p", MAINLOOP_PROBLEMS, ids=gu.problem_ids(MAINLOOP_PROBLEMS))
def test_every_backward_mainloop(p, mainloop, deterministic, monkeypatch):
    from cuflash import kernels, launch
    from cuflash.kernels import backward

    kind = _dkdv_mainloop_or_skip(mainloop, kernels.head_dim_bucket(max(p.D, p.dv)), int(p.causal), kernels.MOD_NONE)
    monkeypatch.setattr(backward, "dkdv_mainloop", lambda *args, **kwargs: kind)
    # The atomic mode keeps the dK/dV kernel's dQ step even where the default plan runs the dQ kernel instead
    # (D256 on sm_90a: test_d256_backward_runs_the_dq_kernel).
    monkeypatch.setattr(backward, "split_dq", lambda *args, **kwargs: False)
    own_plan_caches(monkeypatch)
    shape = kernels.ProblemShape(p.B, p.Sq, p.Sk, p.H, p.Hkv, p.D, p.dv, p.dtype_name, p.causal)
    dkdv = [item.variant for item in launch.backward_plan(shape, 0, deterministic).launches
            if item.variant.name == "cuflash::flash_bwd_dkdv_kernel"]
    assert dkdv and dkdv[0].config.mainloop == kind
    gu.check_attention(dataclasses.replace(p, deterministic=deterministic))


# A bias on the dK/dV mainloops of sm_90a. On the warp-specialized one's atomic path the producer stages the
# bias in the step's dS tile and the consumers write dS over it ([query][key]): staged and read directly
# (Sk = 517: rows not 16-byte aligned; "rows": stride 0 over the keys), dbias from the tile or per element
# (broadcast biases sum with atomics), -inf rows, ALiBi, the general mask, odd tails, both backward modes.
BIAS_BACKWARD_PROBLEMS = BIAS_MAINLOOP_PROBLEMS[:3] + (
    Problem("bf16", B=2, Sq=333, Sk=517, H=4, Hkv=2, D=128, bias="full"),
    Problem("fp16", B=2, Sq=200, Sk=136, H=4, Hkv=1, D=128, bias="rows", causal=True),
    Problem("bf16", B=1, Sq=300, Sk=640, H=6, Hkv=3, D=128, bias="heads", alibi="h", causal=True),
    Problem("bf16", B=2, Sq=250, Sk=250, H=4, Hkv=4, D=128, bias="large", segments="docs", causal=True),
    Problem("fp16", B=2, Sq=190, Sk=320, H=2, Hkv=1, D=128, bias="expanded", window=(100, 30)),
)


def _bias_backward_kinds(p: Problem) -> tuple:
    """(head-dim bucket, mask kind, score_mod) of a bias problem's dK/dV variant."""
    from cuflash import kernels

    general = p.window is not None or p.segments is not None or p.blocks is not None or p.mask is not None
    mask = kernels.MASK_GENERAL if general else int(p.causal)
    mod = kernels.MOD_BIAS_SOFTCAP if p.softcap else kernels.MOD_BIAS
    return kernels.head_dim_bucket(max(p.D, p.dv)), mask, mod


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("mainloop", ("sm80", "sm90", "sm90_ws"))
@pytest.mark.parametrize("p", BIAS_BACKWARD_PROBLEMS, ids=gu.problem_ids(BIAS_BACKWARD_PROBLEMS))
def test_bias_on_every_backward_mainloop(p, mainloop, deterministic, monkeypatch):
    from cuflash.kernels import backward

    bucket, mask, mod = _bias_backward_kinds(p)
    kind = _dkdv_mainloop_or_skip(mainloop, bucket, mask, mod)
    picked = []

    def pick(arch, bucket_, mask_, mod_, atomic_dq):
        picked.append((bucket_, mask_, mod_))
        return kind

    full = {"heads": p.B == 1, "kv": p.H == p.Hkv, "keys": p.Sq == 1 and p.H == 1, "rows": p.Sk == 1}.get(p.bias, True)
    if deterministic and not full:
        pytest.skip("a broadcast bias's dbias is summed with atomics: deterministic=True refuses it")
    monkeypatch.setattr(backward, "dkdv_mainloop", pick)
    own_plan_caches(monkeypatch)
    gu.check_attention(dataclasses.replace(p, deterministic=deterministic))
    assert (bucket, mask, mod) in picked, picked


#: Head dim 256 without a modifier: on sm_90a both backward modes run the warp-specialized dK/dV kernel without a
#: dQ step and the wgmma dQ kernel (backward.split_dq), whose 128-query blocks see tails of every kind: Sq != Sk
#: both ways, GQA / MQA, the general mask (window, documents, block ids), rows that see no key, dlse, Dv != D.
SPLIT_DQ_PROBLEMS = (
    Problem("bf16", B=2, Sq=333, Sk=290, H=4, Hkv=2, D=256, causal=True),
    Problem("fp16", B=1, Sq=129, Sk=700, H=3, Hkv=1, D=256, dlse=True),
    Problem("bf16", B=2, Sq=300, Sk=300, H=2, Hkv=2, D=256, window=(70, 9)),
    Problem("fp16", B=2, Sq=250, Sk=250, H=2, Hkv=1, D=256, causal=True, segments="docs"),
    Problem("bf16", B=1, Sq=200, Sk=460, H=2, Hkv=2, D=256, blocks="blocks"),
    Problem("bf16", B=1, Sq=77, Sk=1, H=2, Hkv=2, D=248, causal=True),
    Problem("fp16", B=3, Sq=64, Sk=131, H=2, Hkv=1, D=200, Dv=256),
)


@pytest.mark.parametrize("deterministic", (False, True), ids=("default", "deterministic"))
@pytest.mark.parametrize("p", SPLIT_DQ_PROBLEMS, ids=gu.problem_ids(SPLIT_DQ_PROBLEMS))
def test_d256_backward_runs_the_dq_kernel(p, deterministic):
    """Float64 agreement of the split D256 backward in both modes, and on sm_90a its plan: the dK/dV kernel
    without atomics, the wgmma dQ kernel, no dq_accum."""
    import cupy

    from cuflash import kernels, launch
    from cuflash.kernels import backward

    if cupy.cuda.Device(0).compute_capability == "90":
        shape = kernels.ProblemShape(p.B, p.Sq, p.Sk, p.H, p.Hkv, p.D, p.dv, p.dtype_name, p.causal,
                                     general_mask=p.window is not None or p.segments is not None or p.blocks is not None)
        plan = launch.backward_plan(shape, 0, deterministic)
        by_name = {item.variant.name: item.variant for item in plan.launches}
        assert by_name["cuflash::flash_bwd_dq_kernel"].config.mainloop == backward.DQ_MAINLOOP_SM90
        assert not by_name["cuflash::flash_bwd_dkdv_kernel"].config.atomic_dq
        assert "dq_accum" not in dict(plan.scratch)
    gu.check_attention(dataclasses.replace(p, deterministic=deterministic))


@pytest.mark.parametrize("p", [q for q in BIAS_BACKWARD_PROBLEMS if not q.softcap and q.D == 128],
                         ids=gu.problem_ids([q for q in BIAS_BACKWARD_PROBLEMS if not q.softcap and q.D == 128]))
def test_bias_backward_mainloops_agree_bitwise(p, monkeypatch):
    """The warp-specialized dK/dV mainloop computes every P and dS as the 8-warp one does (the same step
    code, the bias read from a differently laid out tile): dK, dV and dbias are bit-identical; dQ differs only
    by the order of its float adds."""
    import cupy

    from cuflash.kernels import backward

    if cupy.cuda.Device(0).compute_capability != "90":
        pytest.skip("the wgmma mainloops need an sm_90 GPU")
    x = gu.make_inputs(p)
    results = {}
    for kind in (backward.MAINLOOP_SM90, backward.MAINLOOP_SM90_WS):
        monkeypatch.setattr(backward, "dkdv_mainloop", lambda *args, kind=kind, **kwargs: kind)
        own_plan_caches(monkeypatch)
        results[kind] = gu.run_cuflash(p, x)
    a, b = results[backward.MAINLOOP_SM90], results[backward.MAINLOOP_SM90_WS]
    for name in ("dk", "dv") + (("dbias",) if p.bias in ("full", "neginf", "large") else ()):
        assert gu.bit_identical(getattr(a, name), getattr(b, name)), f"{p.id}: {name} differs between the mainloops"
    dq_a, dq_b = gu.to_f64(a.dq), gu.to_f64(b.dq)
    assert bool(cupy.all(cupy.isfinite(dq_b))), f"{p.id}: dq not finite"
    assert float(cupy.max(cupy.abs(dq_a - dq_b))) <= 2.0 ** -6 * float(cupy.max(cupy.abs(dq_a))), p.id


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_forward_is_bit_identical(dtype, causal):
    """The forward has no atomics: repeated calls give the same bits."""
    p = Problem(dtype, B=2, Sq=1000, Sk=777, H=8, Hkv=2, D=96, causal=causal)
    x = gu.make_inputs(p)
    first = gu.run_cuflash(p, x, backward=False)
    for run in range(1, RUNS):
        again = gu.run_cuflash(p, x, backward=False)
        assert gu.bit_identical(again.out, first.out), f"{p.id}: out of run {run} differs bitwise"
        assert gu.bit_identical(again.lse, first.lse), f"{p.id}: lse of run {run} differs bitwise"


def test_nondeterministic_backward_agrees_with_deterministic():
    """Both backward modes are correct; they may differ only by float reassociation."""
    p = Problem("bf16", B=2, Sq=1000, Sk=1000, H=8, Hkv=2, D=128, causal=True)
    gu.check_attention(p)
    gu.check_attention(dataclasses.replace(p, deterministic=True))


# --------------------------------------------------------------------------------------------
# Dv != D
# --------------------------------------------------------------------------------------------

DV_PROBLEMS = (
    Problem("bf16", B=2, Sq=129, Sk=127, H=4, Hkv=2, D=128, Dv=64),
    Problem("fp16", B=1, Sq=127, Sk=129, H=4, Hkv=1, D=64, Dv=128, causal=True),
    Problem("fp32", B=2, Sq=129, Sk=127, H=4, Hkv=2, D=40, Dv=72, causal=True),
    Problem("bf16", B=1, Sq=200, Sk=300, H=2, Hkv=2, D=256, Dv=8),
    Problem("bf16", B=1, Sq=300, Sk=200, H=2, Hkv=1, D=8, Dv=256, causal=True),
    Problem("fp32", B=1, Sq=65, Sk=65, H=2, Hkv=1, D=256, Dv=24),
)


@pytest.mark.parametrize("p", DV_PROBLEMS, ids=gu.problem_ids(DV_PROBLEMS))
def test_value_head_dim_differs(p):
    gu.check_attention(p)


# --------------------------------------------------------------------------------------------
# Strided inputs and outputs
# --------------------------------------------------------------------------------------------

STRIDED_PROBLEMS = tuple(
    Problem(dtype, B=2, Sq=129, Sk=200, H=8, Hkv=2, D=d, causal=causal, layout=layout)
    for layout in ("bhsd", "padded")
    for dtype, d, causal in (("bf16", 128, True), ("fp16", 64, False), ("fp32", 96, True))
)


@pytest.mark.parametrize("p", STRIDED_PROBLEMS, ids=gu.problem_ids(STRIDED_PROBLEMS))
def test_strided_inputs(p):
    """(B, H, S, D) arrays viewed as bshd, and rows padded with NaN columns the kernel must not read."""
    gu.check_attention(p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_output_buffers(dtype):
    """out= / dq= / dk= / dv= given as (B, H, S, D) arrays viewed as bshd are written in place."""
    p = Problem(dtype, B=2, Sq=129, Sk=127, H=4, Hkv=2, D=64, causal=True, layout="bhsd")
    gu.check_attention(p, out_layout="bhsd")


# --------------------------------------------------------------------------------------------
# Scale, dlse, streams
# --------------------------------------------------------------------------------------------

# Logits of std scale * sqrt(D) = 0.4 .. 16: from nearly uniform to nearly one-hot (fp32 stops at 8,
# where its backward, like any fp32 FlashAttention, is near the 1e-5 rule's edge).
SCALE_PROBLEMS = tuple(
    Problem(dtype, B=1, Sq=129, Sk=257, H=4, Hkv=2, D=64, causal=causal, scale=scale)
    for dtype in DTYPES
    for scale, causal in ((0.05, False), (0.5, True), (1.0 if dtype == "fp32" else 2.0, False),
                          # a zero or negative scale with masked scores (0 * -inf must not reach the
                          # softmax; a max over raw scores is the wrong one when scale < 0)
                          (0.0, True), (-0.3, True), (-0.3, False))
)


@pytest.mark.parametrize("p", SCALE_PROBLEMS, ids=gu.problem_ids(SCALE_PROBLEMS))
def test_custom_scale(p):
    gu.check_attention(p)


FP32_STANDARD = (
    Problem("fp32", B=2, Sq=129, Sk=127, H=8, Hkv=2, D=64, causal=True),
    Problem("fp32", B=1, Sq=1000, Sk=1000, H=4, Hkv=1, D=128),
    Problem("fp32", B=2, Sq=300, Sk=17, H=4, Hkv=4, D=256, causal=True),
    Problem("fp32", B=1, Sq=2049, Sk=2049, H=2, Hkv=1, D=40, causal=True, deterministic=True),
)


@pytest.mark.parametrize("p", FP32_STANDARD, ids=gu.problem_ids(FP32_STANDARD))
def test_fp32_meets_the_issue_rule(p):
    """The issue's rule, outright: true-fp32 results within 1e-5 relative error of float64."""
    x = gu.make_inputs(p)
    r = gu.run_cuflash(p, x)
    e = gu.expected_for(p, x)
    lse, ref_lse = gu.to_f64(r.lse), e.lse.astype(cupy.float64)
    finite = cupy.isfinite(ref_lse)
    pairs = {"out": (gu.to_f64(r.out), e.out),
             "lse": (cupy.where(finite, lse, 0.0), cupy.where(finite, ref_lse, 0.0)),
             **{n: (gu.to_f64(getattr(r, n)), e.grads[n]) for n in ("dq", "dk", "dv")}}
    errors = {n: gu.norm(a - b) / gu.norm(b) for n, (a, b) in pairs.items()}
    assert all(err <= gu.FP32_LIMIT for err in errors.values()), f"{p.id}: {errors}"


DLSE_PROBLEMS = (
    Problem("bf16", B=2, Sq=129, Sk=257, H=8, Hkv=2, D=128, causal=True, dlse=True),
    Problem("fp16", B=1, Sq=300, Sk=300, H=4, Hkv=1, D=64, dlse=True, deterministic=True),
    Problem("fp32", B=2, Sq=129, Sk=127, H=4, Hkv=4, D=64, causal=True, dlse=True),
    Problem("bf16", B=1, Sq=200, Sk=50, H=4, Hkv=2, D=64, causal=True, dlse=True),  # rows see nothing
    Problem("bf16", B=2, Sq=33, Sk=1, H=2, Hkv=1, D=32, dlse=True),  # dS = dlse exactly
)


@pytest.mark.parametrize("p", DLSE_PROBLEMS, ids=gu.problem_ids(DLSE_PROBLEMS))
def test_dlse_gradient(p):
    """A gradient flowing into lse (ring attention) reaches dq and dk: dS = P * (dP - D + dlse)."""
    gu.check_attention(p)


def _slow_writes(stream, dst, src):
    """On ``stream``: enough work to keep the GPU busy for a while, then dst[...] = src. A kernel
    launched on another stream would read dst before the copy lands (and see NaN)."""
    with stream:
        scratch = cupy.ones((64, 1024, 1024), dtype=cupy.float32)
        for _ in range(20):
            scratch = scratch * 1.0001 + 0.5
        gu.bits(dst)[...] = gu.bits(src)  # a bit copy: no dtype-specific kernel needed
    return scratch


@pytest.mark.parametrize("how", ("stream-object", "raw-pointer", "current-stream"))
def test_non_default_stream(how):
    """Work is enqueued on the stream given (or CuPy's current one), ordered after earlier work on it.

    Runs on CuPy's ordinary pool: the poisoning allocator synchronizes the device on every
    allocation, which would let the slow writes finish before cuflash launches and hide a
    misordered launch."""
    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        _check_non_default_stream(how)


def _check_non_default_stream(how):
    p = Problem("bf16", B=2, Sq=257, Sk=300, H=8, Hkv=2, D=128, causal=True)
    x = gu.make_inputs(p)
    stream = cupy.cuda.Stream(non_blocking=True)
    q_late = gu.nan_buffer(x.q.shape, p.np_dtype)
    out = gu.nan_buffer((p.B, p.Sq, p.H, p.dv), p.np_dtype)
    lse = gu.nan_buffer((p.B, p.H, p.Sq), np.float32)
    grads = tuple(gu.nan_buffer(t.shape, p.np_dtype) for t in (x.q, x.k, x.v))
    cupy.cuda.Device().synchronize()

    _slow_writes(stream, q_late, x.q)
    kwargs = dict(scale=p.scale, causal=p.causal)
    if how == "current-stream":
        with stream:
            cuflash.attention_forward(q_late, x.k, x.v, out=out, lse=lse, **kwargs)
            cuflash.attention_backward(x.dout, q_late, x.k, x.v, out, lse, dq=grads[0], dk=grads[1],
                                       dv=grads[2], **kwargs)
    else:
        s = stream if how == "stream-object" else stream.ptr
        cuflash.attention_forward(q_late, x.k, x.v, out=out, lse=lse, stream=s, **kwargs)
        cuflash.attention_backward(x.dout, q_late, x.k, x.v, out, lse, dq=grads[0], dk=grads[1],
                                   dv=grads[2], stream=s, **kwargs)
    stream.synchronize()

    e = gu.expected_for(p, x)
    report = gu.Report(f"{p.id} on a non-blocking stream ({how})")
    result = gu.Result(out, lse, *grads)
    gu.check_forward(report, p, result, e)
    gu.check_backward(report, p, x, result, e)
    report.check()


def test_attention_wrapper_matches_forward():
    """cuflash.attention returns out, or (out, lse) with return_lse, bit-identical to attention_forward."""
    p = Problem("bf16", B=2, Sq=129, Sk=127, H=4, Hkv=2, D=64, causal=True)
    x = gu.make_inputs(p)
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, causal=True)
    only_out = cuflash.attention(x.q, x.k, x.v, causal=True)
    both = cuflash.attention(x.q, x.k, x.v, causal=True, return_lse=True)
    assert gu.bit_identical(cupy.asarray(only_out), out)
    assert gu.bit_identical(cupy.asarray(both[0]), out) and gu.bit_identical(cupy.asarray(both[1]), lse)


def test_calls_from_a_thread_with_no_current_context():
    """A thread with no CUDA context current (torch's autograd worker thread can be one: its backward may
    make no runtime call that binds one, every buffer coming from torch's cache) calls the forward and the
    backward with every buffer given: cuflash binds the device's primary context (launch.ensure_context),
    and the results are bit-identical to the main thread's (deterministic backward). Before the fix the
    driver refused the launch with CUDA_ERROR_INVALID_CONTEXT (H100, session 19)."""
    import threading

    from cupy_backends.cuda.api import driver

    p = Problem("bf16", B=1, Sq=77, Sk=130, H=4, Hkv=2, D=64, causal=True)
    x = gu.make_inputs(p)
    options = {"causal": True}
    out, lse = cuflash.attention_forward(x.q, x.k, x.v, **options)
    grads = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, deterministic=True, **options)
    out2, lse2 = gu.nan_buffer(out.shape, out.dtype), gu.nan_buffer(lse.shape, lse.dtype)
    grads2 = [gu.nan_buffer(g.shape, g.dtype) for g in grads]
    workspace = {name: gu.nan_buffer(shape, cupy.float32)
                 for name, shape in cuflash.backward_workspace(x.q, x.k, x.v, deterministic=True, **options).items()}
    cupy.cuda.Device().synchronize()
    failures = []

    def worker():
        try:
            driver.ctxSetCurrent(0)
            assert driver.ctxGetCurrent() == 0
            cuflash.attention_forward(x.q, x.k, x.v, out=out2, lse=lse2, **options)
            cuflash.attention_backward(x.dout, x.q, x.k, x.v, out2, lse2, deterministic=True, dq=grads2[0],
                                       dk=grads2[1], dv=grads2[2], workspace=workspace, **options)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not failures, failures[0]
    cupy.cuda.Device().synchronize()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out2, lse2, *grads2)):
        assert gu.bit_identical(a, b), name
