"""One bench cell's cuflash calls, for a profiler: warm-up calls first (compiles, plans, caches), then the
profiled ones, each kernel once per call. With ncu, skip the warm-up launches:

    ncu --clock-control none --kernel-name regex:flash_bwd_dkdv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python3 benchmarks/profile_cell.py D128-S4k-full

    python3 benchmarks/profile_cell.py CELL [--warmup 2] [--calls 1] [--deterministic] [--forward-only]
(`python -m cuflash bench --list` names the cells.) CELL may also be a features case (benchmarks/features.py:
its name or a regex of it, e.g. ``doc``, ``window``, ``bias``), run with the inputs and options the features
bench gives cuflash.
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
    """(name, (q, k, v, dout), options) of the first features case matching ``pattern``: the inputs, ids and
    bias the features bench gives cuflash (bench.make_inputs, features.CaseData), or None."""
    import features

    matches = features.select_cases(pattern)
    if not matches:
        return None
    case = matches[0]
    x = bench.make_inputs(case, None)
    data = features.CaseData(case, x, None)
    options = features.cuflash_options(case, *data.cupy_ids(), bias=data.bias() if case.bias else None)
    return case.name, (x.cq, x.ck, x.cv, x.cdout), options

if __name__ == "__main__":
    sys.exit(main())
