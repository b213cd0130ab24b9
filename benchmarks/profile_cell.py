"""One bench cell's cuflash calls, for a profiler: warm-up calls first (compiles, plans, caches), then the
profiled ones, each kernel once per call. With ncu, skip the warm-up launches:

    ncu --clock-control none --kernel-name regex:flash_bwd_dkdv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python3 benchmarks/profile_cell.py D128-S4k-full

    python3 benchmarks/profile_cell.py CELL [--warmup 2] [--calls 1] [--deterministic] [--forward-only]
(`python -m cuflash bench --list` names the cells.) CELL may also be a features case (benchmarks/features.py:
its name or a regex of it, e.g. ``doc``, ``window``, ``bias``), run with that case's options (ids, window,
bias: random normal, seed 7).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cell")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--forward-only", action="store_true")
    args = ap.parse_args()
    cells = [c for c in bench.all_cells() if c.name == args.cell]
    import cupy

    import cuflash

    if cells:
        cell = cells[0]
        x = bench.make_inputs(cell, None)
        q, k, v, dout = x.cq, x.ck, x.cv, x.cdout
        name, options = cell.name, {"causal": cell.causal}
    else:
        feature = _feature_case(args.cell)
        if feature is None:
            print(f"no cell or features case named {args.cell!r}; see python -m cuflash bench --list",
                  file=sys.stderr)
            return 2
        name, (q, k, v, dout), options = feature

    def call():
        out, lse = cuflash.attention_forward(q, k, v, **options)
        if not args.forward_only:
            cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=args.deterministic, **options)

    for _ in range(args.warmup + args.calls):
        call()
    cupy.cuda.Device().synchronize()
    print(f"{name}: {args.warmup} warm-up + {args.calls} profiled calls")
    return 0


def _feature_case(pattern: str):
    """(name, (q, k, v, dout), options) of the first features case matching ``pattern``, bf16, or None."""
    import cupy
    import ml_dtypes
    import numpy as np

    import features

    matches = features.select_cases(pattern)
    if not matches:
        return None
    case = matches[0]
    rng = np.random.default_rng(7)
    bf16 = cupy.dtype(ml_dtypes.bfloat16)

    def normal(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(bf16)

    q, dout = normal(case.B, case.S, case.H, case.D), normal(case.B, case.S, case.H, case.D)
    k, v = normal(case.B, case.S, case.Hkv, case.D), normal(case.B, case.S, case.Hkv, case.D)
    segment, block = features.host_ids(case)
    ids = [None if a is None else cupy.asarray(np.ascontiguousarray(a)) for a in (segment, block)]
    bias = normal(case.B, case.H, case.S, case.S) if case.bias else None
    return case.name, (q, k, v, dout), features.cuflash_options(case, *ids, bias=bias)


if __name__ == "__main__":
    sys.exit(main())
