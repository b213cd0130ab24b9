"""Property-based fuzzing of forward and backward against the float64 reference (hypothesis).

Each example draws B, Sq, Sk (1..600, mostly small), H and a dividing Hkv, D (a multiple of 8 up to
256), Dv (usually D), dtype, causal, scale (mostly positive, sometimes zero or negative), layout (contiguous, (B,H,S,D) viewed as bshd, or padded
rows), deterministic and an optional dlse; then, each with its own probability and freely combined,
a sliding window, a softcap, ALiBi slopes, segment ids, block ids, an additive bias (its gradient checked
too), a bool mask and dropout (``OPTION_ODDS``). It holds
cuflash to the rule in gpu_utils' docstring, writing into NaN-poisoned buffers.

- Short mode (default): 100 derandomized examples, the same ones every run (~10-20 s).
- Long mode: ``CUFLASH_FUZZ_EXAMPLES=10000 python -m pytest tests/test_fuzz_gpu.py`` draws that many
  fresh random examples. At the end the number of cases run is printed and, when
  ``CUFLASH_FUZZ_REPORT`` names a file, written there as JSON.
"""
from __future__ import annotations

import collections
import json
import os
import time

import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gpu_utils as gu  # noqa: E402
from gpu_utils import poisoned_allocations  # noqa: E402,F401  (autouse: CuPy allocations start as NaN)
from gpu_utils import Problem  # noqa: E402

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_FUZZ_EXAMPLES") or 0)
LONG_MODE = EXAMPLES > 0
SHORT_EXAMPLES = 100

_stats = {"cases": 0, "failed": 0, "failures": [], "by_dtype": collections.Counter(),
          "by_option": collections.Counter(),
          "seconds": 0.0}
_OPTIONS = ("window", "softcap", "alibi", "segments", "blocks", "bias", "mask", "dropout")


@pytest.fixture(scope="session", autouse=True)
def _fuzz_session(request):
    """Compile kernels up front; afterwards print (and optionally write) how many cases ran."""
    gu.announce_precompile(request.config)
    yield
    summary = {
        "mode": "long" if LONG_MODE else "short",
        "max_examples": EXAMPLES or SHORT_EXAMPLES,
        "cases": _stats["cases"],
        "failed_cases": _stats["failed"],
        "failures": _stats["failures"],
        "by_dtype": dict(_stats["by_dtype"]),
        "by_option": dict(_stats["by_option"]),
        "seconds": round(_stats["seconds"], 1),
    }
    gu.report_line(request.config, f"\ncuflash fuzz: {summary['cases']} cases run "
                                   f"({summary['failed_cases']} failed, {summary['mode']} mode, "
                                   f"{summary['seconds']} s) {summary['by_dtype']} "
                                   f"options: {summary['by_option']}")
    path = os.environ.get("CUFLASH_FUZZ_REPORT")
    if path:
        with open(path, "w") as handle:
            json.dump(summary, handle, indent=2)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


# Mostly short sequences (fast, and where the tail-tile bugs live), sometimes up to 600.
LENGTHS = st.one_of(st.integers(1, 40), st.integers(1, 160), st.integers(1, 600))


#: Each option is on in about 1 in N examples, independently (about a quarter of the examples use
#: none, the short mode's 100 included; the session summary prints how many used each).
OPTION_ODDS = {"window": 4, "softcap": 4, "alibi": 4, "segments": 4, "blocks": 5, "bias": 4, "mask": 5, "dropout": 5}
#: Bias kinds: every kind in both modes. deterministic=True sums a bias with one element per score in place, key
#: biases and biases constant along the keys in fixed orders (cuflash/dbias.py), and biases broadcast over the
#: batch / heads by turns (dbias_order.cuh) under any mask (with ids or a bool mask over the union of the
#: contributors' tiles, block_lists.cu).
BIAS_ANY = ("full", "heads", "kv", "shared", "keys", "keyheads", "rows", "scalar", "expanded", "neginf", "large")
# A window side: unbounded, narrow (0 included: a row may see a single key, or none), or wide.
WINDOW_SIDES = st.one_of(st.none(), st.integers(0, 40), st.integers(0, 600))


def _maybe(draw, name: str, strategy):
    """``strategy``'s value in about 1 of OPTION_ODDS[name] examples, else None (shrinks to None)."""
    odds = OPTION_ODDS[name]
    return draw(strategy) if draw(st.integers(0, odds - 1)) == odds - 1 else None


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(("bf16", "fp16", "fp32")))
    heads = draw(st.sampled_from((1, 2, 3, 4, 6, 8)))
    kv_heads = draw(st.sampled_from(_divisors(heads)))
    head_dim = 8 * draw(st.integers(1, 32))
    head_dim_v = head_dim if draw(st.integers(0, 4)) else 8 * draw(st.integers(1, 32))
    # scale = factor / sqrt(D): logits of std `factor`, from nearly uniform to peaked softmax rows
    # (sometimes zero or negative: the API takes any finite scale, and masked scores must stay hidden)
    factor = draw(st.one_of(st.none(), st.floats(0.1, 2.5), st.floats(0.1, 2.5), st.floats(0.1, 2.5),
                            st.floats(-2.5, -0.1), st.just(0.0)))
    scale = None if factor is None else round(factor / head_dim ** 0.5, 4)
    deterministic = draw(st.booleans())
    window = _maybe(draw, "window", st.tuples(WINDOW_SIDES, WINDOW_SIDES))
    # caps from strongly bending (logits of std ~1 .. 2.5) to nearly the identity
    softcap = _maybe(draw, "softcap", st.floats(0.5, 50.0).map(lambda c: round(c, 2)))
    alibi = _maybe(draw, "alibi", st.sampled_from(gu.ALIBI_KINDS))
    segments = _maybe(draw, "segments", st.sampled_from(tuple(gu.SEGMENT_KINDS)))
    blocks = _maybe(draw, "blocks", st.sampled_from(tuple(gu.BLOCK_KINDS)))
    mask = _maybe(draw, "mask", st.sampled_from(tuple(gu.MASK_KINDS)))
    dropout = _maybe(draw, "dropout", st.sampled_from((0.05, 0.2, 0.5, 0.85)))
    bias_grad = draw(st.integers(0, 3)) != 0
    return Problem(
        dtype,
        B=draw(st.integers(1, 3)),
        Sq=draw(LENGTHS),
        Sk=draw(LENGTHS),
        H=heads,
        Hkv=kv_heads,
        D=head_dim,
        Dv=None if head_dim_v == head_dim else head_dim_v,
        causal=draw(st.booleans()),
        scale=scale,
        layout=draw(st.sampled_from(("bshd", "bshd", "bshd", "bhsd", "padded"))),
        deterministic=deterministic,
        dlse=draw(st.integers(0, 4)) == 0,
        window=window,
        softcap=softcap,
        alibi=alibi,
        segments=segments,
        blocks=blocks,
        bias=_maybe(draw, "bias", st.sampled_from(BIAS_ANY)),
        bias_grad=bias_grad,
        mask=mask,
        dropout=dropout,
    )


@settings(
    max_examples=EXAMPLES or SHORT_EXAMPLES,
    derandomize=not LONG_MODE,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
@given(p=problems())
def test_fuzz_against_reference(p):
    note(f"problem: {p.id}")
    _stats["cases"] += 1
    _stats["by_dtype"][p.dtype] += 1
    _stats["by_option"].update(name for name in _OPTIONS if getattr(p, name) is not None)
    start = time.perf_counter()
    try:
        gu.check_attention(p)
    except KeyboardInterrupt:  # a time limit (timeout -s INT), not a failure of this case
        raise
    except BaseException as exc:
        _stats["failed"] += 1
        if len(_stats["failures"]) < 50:  # every failing example, the shrinker's too: the first is the drawn one
            first = (str(exc).splitlines()[1:2] or [type(exc).__name__])[0].strip()  # the report's first failure
            _stats["failures"].append(f"{p.id}: {first}")
        raise
    finally:
        _stats["seconds"] += time.perf_counter() - start
