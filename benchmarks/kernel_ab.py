"""Per-kernel GPU time of two or more source trees on the same cells, measured by ncu: the A/B tool for kernel
changes whose effect is a few percent.

Wall-clock A/B (benchmarks/tree_ab.py) moves by 5% between rounds of identical SASS and by up to 20% on the
bias backward (session 14, H100: the clocks under SW power capping); the kernel durations ncu reports with
``--clock-control none`` repeat within ~0.5%. For each tree and cell this runs

    ncu --clock-control none --metrics gpu__time_duration.sum -k regex:KERNELS \\
        python3 benchmarks/profile_cell.py CELL --warmup W --calls N [--deterministic] [--forward-only]

in the tree (its own package first on the path, so its kernels compile from its own cuda_src) and prints each
kernel's median duration over the profiled launches (warm-up launches dropped), with the ratio to the first
tree. CELL is a bench cell or a features case (see profile_cell.py).

    python3 benchmarks/kernel_ab.py base=scratch/base new=. --cells D128-S4k-full,doc \\
        [--kernels dkdv|dq_kernel] [--calls 3] [--deterministic] [--forward-only]

Compile first (the warm-up call compiles one kernel at a time): `benchmarks/tree_ab.py --precompile` per tree,
or a shared CUFLASH_CACHE_DIR that already holds them.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def short_name(kernel: str) -> str:
    """``void cuflash::flash_bwd_dkdv_kernel<__nv_bfloat16, 128, ...>(cuflash::AttnParams)`` -> ``flash_bwd_dkdv_kernel<128, ...>``."""
    name = re.sub(r"^void\s+", "", kernel).replace("(int)", "").replace("(bool)", "")
    name = re.sub(r"\([^()]*\)$", "", name).replace("cuflash::", "")
    return re.sub(r"<(__nv_bfloat16|__half|float), ", "<", name)


def profile(tree: Path, cell: str, args) -> dict:
    """{kernel: [durations in us of the profiled launches]} of one cell in one tree."""
    launches = args.warmup + args.calls
    cmd = ["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base",
           "-k", f"regex:{args.kernels}", sys.executable, str(tree / "benchmarks" / "profile_cell.py"), cell,
           "--warmup", str(args.warmup), "--calls", str(args.calls)]
    if args.deterministic:
        cmd.append("--deterministic")
    if args.forward_only:
        cmd.append("--forward-only")
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    rows = [line for line in run.stdout.splitlines() if line.startswith('"')]
    if run.returncode != 0 or not rows:
        tail = (run.stdout + run.stderr)[-1500:]
        raise RuntimeError(f"ncu on {cell} in {tree} failed (exit {run.returncode}):\n{tail}")
    times: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(row.get("Metric Unit", "nsecond"), 1e-3)
        times.setdefault(short_name(row["Kernel Name"]), []).append(value * scale)
    # every kernel launches once per call: drop the warm-up calls' launches
    return {k: v[-args.calls:] if len(v) == launches else v for k, v in times.items()}


def _counterpart(kernel: str, result: dict, reference: dict):
    """The one kernel of ``result`` in ``kernel``'s family (the name before its template arguments) that the
    reference tree did not launch, or None."""
    family = kernel.split("<")[0]
    others = [k for k in result if k.split("<")[0] == family and k not in reference]
    return others[0] if len(others) == 1 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="LABEL=PATH, the first is the reference")
    ap.add_argument("--cells", required=True, help="comma-separated bench cells or features cases")
    ap.add_argument("--kernels", default="flash_", help="regex of the kernel names to time (default: all)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--forward-only", action="store_true")
    args = ap.parse_args()
    trees = []
    for item in args.trees:
        label, sep, path = item.partition("=")
        if not sep or not Path(path, "cuflash").is_dir():
            print(f"tree {item!r}: expected LABEL=PATH of a source tree", file=sys.stderr)
            return 2
        trees.append((label, Path(path).resolve()))
    labels = [label for label, _ in trees]
    print(f"{'cell':34s} {'kernel':58s} " + " ".join(f"{label:>10s}" for label in labels) +
          "".join(f" {label + '/' + labels[0]:>10s}" for label in labels[1:]), flush=True)
    for cell in args.cells.split(","):
        results = [profile(path, cell, args) for _, path in trees]
        seen = [set() for _ in results]  # each tree's kernels printed
        for kernel in results[0]:
            # A tree whose variant of this kernel has other template arguments (a tile or mainloop change): its
            # one kernel of the same family that the reference lacks, named below the line.
            matched = [kernel if kernel in r else _counterpart(kernel, r, results[0]) for r in results]
            medians = [statistics.median(r[k]) if k is not None else float("nan") for r, k in zip(results, matched)]
            line = f"{cell:34s} {kernel[:58]:58s} " + " ".join(f"{m:10.1f}" for m in medians)
            line += "".join(f" {m / medians[0]:10.3f}" for m in medians[1:])
            print(line, flush=True)
            for (label, _), k in zip(trees[1:], matched[1:]):
                if k is not None and k != kernel:
                    print(f"{'':34s}   {label}: {k[:80]}", flush=True)
            for i, k in enumerate(matched):
                if k is not None:
                    seen[i].add(k)
        # Kernels only some later tree launches (a plan that adds one), then each tree's sum of every kernel timed.
        for i, result in enumerate(results[1:], 1):
            for kernel in result:
                if kernel in seen[i]:
                    continue
                medians = [statistics.median(r[kernel]) if kernel in r else float("nan") for r in results]
                line = f"{cell:34s} {kernel[:58]:58s} " + " ".join(f"{m:10.1f}" for m in medians)
                print(line + "".join(f" {m / medians[0]:10.3f}" for m in medians[1:]), flush=True)
                seen[i].add(kernel)
        totals = [sum(statistics.median(v) for v in r.values()) for r in results]
        line = f"{cell:34s} {'(sum of the kernels above)':58s} " + " ".join(f"{m:10.1f}" for m in totals)
        print(line + "".join(f" {m / totals[0]:10.3f}" for m in totals[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
