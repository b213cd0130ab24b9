"""One bench cell's cuflash calls, for a profiler: warm-up calls first (compiles, plans, caches), then the
profiled ones, each kernel once per call. With ncu, skip the warm-up launches:

    ncu --clock-control none --kernel-name regex:flash_bwd_dkdv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python3 benchmarks/profile_cell.py D128-S4k-full

    python3 benchmarks/profile_cell.py CELL [--warmup 2] [--calls 1] [--deterministic] [--forward-only]
(`python -m cuflash bench --list` names the cells.)
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
    if not cells:
        print(f"no cell named {args.cell!r}; see python -m cuflash bench --list", file=sys.stderr)
        return 2
    import cupy

    import cuflash

    cell = cells[0]
    x = bench.make_inputs(cell, None)
    q, k, v, dout = x.cq, x.ck, x.cv, x.cdout

    def call():
        out, lse = cuflash.attention_forward(q, k, v, causal=cell.causal)
        if not args.forward_only:
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=cell.causal, deterministic=args.deterministic)

    for _ in range(args.warmup + args.calls):
        call()
    cupy.cuda.Device().synchronize()
    print(f"{cell.name}: {args.warmup} warm-up + {args.calls} profiled calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
