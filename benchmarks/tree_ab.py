"""One tree's forward and backward times on bench cells, for A/B runs of two or more source trees on one GPU.

Run it once per tree, each in its own process, with that tree first on the path (the kernels compile from the
tree's own cuda_src):

    for t in base new; do (cd $t && PYTHONPATH=. python3 benchmarks/tree_ab.py $t D128-S4k-full D64-S4k-full); done

Alternate which tree runs first from round to round, and run nothing else on the machine: on an H200 (session 27,
benchmarks/RESULTS.md) the second process of a pair read up to ~10% slower on the S1k cells than the first with
the same kernels (none at S4k), and rounds beside a test run on the other GPU moved by as much. Each process first
keeps the GPU busy for --warmup seconds: on a freshly started machine (session 50) the first rounds read 2-7% slow.

    for r in 1 2 3 4; do
      [ $((r % 2)) = 1 ] && order="base new" || order="new base"
      for t in $order; do (cd $t && PYTHONPATH=. python3 benchmarks/tree_ab.py $t D128-S1k-full D64-S4k-full); done
    done

Per cell (`python -m cuflash bench --list` names them; bf16 inputs seeded per cell, so every tree sees the same
ones): median GPU time of the forward, the default backward and the deterministic backward (CUDA events, 20
calls after a warm-up), their TFLOPS (forward 4 B H S^2 D, halved when causal; backward 2.5x that; forward +
default backward 3.5x), and, from the second tree on, the largest difference of out / dq / dk / dv from the
first tree's (saved under --ref-dir): 0 where the kernels compute the same sums in the same order, float
rounding where only the atomic dQ adds reorder. ``--precompile`` compiles a tree's kernels for the cells first
(on every core; the timed rounds would otherwise compile them one at a time).
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
from forward_mainloops import median_ms  # noqa: E402  (CUDA-event median of `reps` calls after a warm-up)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("label", help="the tree's name in the output")
    ap.add_argument("cells", nargs="+")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--forward-only", action="store_true",
                    help="time and compare the forward alone (with --precompile: compile its kernels alone)")
    ap.add_argument("--ref-dir", default="/tmp/cuflash-tree-ab", help="where the first tree's outputs are kept")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of bf16 matmuls before the first cell, so that the GPU's clocks are up (session 50: "
                         "on a freshly started H200 the first tree's process read 2-7%% slow without it)")
    ap.add_argument("--precompile", action="store_true",
                    help="only compile the cells' kernels (this tree's plans: forward, both backward modes, sm_90a "
                         "with 132 SMs) on every core, then exit: run it per tree before the timed rounds")
    args = ap.parse_args()
    cells = {c.name: c for c in bench.all_cells()}
    unknown = [n for n in args.cells if n not in cells]
    if unknown:
        print(f"no cell named {unknown}; see python -m cuflash bench --list", file=sys.stderr)
        return 2
    if args.precompile:
        return precompile([cells[n] for n in args.cells], args.forward_only)
    import cupy as cp

    import cuflash

    os.makedirs(args.ref_dir, exist_ok=True)
    warm_up(cp, args.warmup)
    for name in args.cells:
        c = cells[name]
        x = bench.make_inputs(c, None)
        q, k, v, do = x.cq, x.ck, x.cv, x.cdout
        out, lse = cuflash.attention_forward(q, k, v, causal=c.causal)
        fwd = median_ms(lambda: cuflash.attention_forward(q, k, v, causal=c.causal), args.reps)
        flops = c.flops("fwd")
        arrays = {"o": cp.asnumpy(out.astype(cp.float32))}
        if not args.forward_only:
            bwd = {det: median_ms(lambda det=det: cuflash.attention_backward(do, q, k, v, out, lse, causal=c.causal,
                                                                             deterministic=det), args.reps)
                   for det in (False, True)}
            dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, causal=c.causal)
            arrays.update({n: cp.asnumpy(a.astype(cp.float32)) for n, a in (("dq", dq), ("dk", dk), ("dv", dv))})
        ref = Path(args.ref_dir) / (name.replace("/", "_") + ".npz")
        diff = ""
        if ref.exists():
            first = np.load(ref)
            diff = " " + " ".join(f"{n}:{np.abs(arrays[n] - first[n]).max():.2e}" for n in arrays if n in first)
        else:
            np.savez(ref, **arrays)
        if args.forward_only:
            print(f"{args.label:6s} {name:28s} fwd {fwd:7.3f} ms {flops / fwd / 1e9:6.1f} TF{diff}", flush=True)
            continue
        print(f"{args.label:6s} {name:28s} fwd {fwd:7.3f} ms {flops / fwd / 1e9:6.1f} TF | bwd {bwd[False]:7.3f} ms "
              f"{2.5 * flops / bwd[False] / 1e9:6.1f} TF | det {bwd[True]:7.3f} ms {2.5 * flops / bwd[True] / 1e9:6.1f} TF"
              f" | f+b {3.5 * flops / (fwd + bwd[False]) / 1e9:6.1f} TF{diff}", flush=True)
    return 0


def warm_up(cp, seconds: float) -> None:
    """Keep the GPU busy with 4096^2 bf16-sized matmuls (float16 in CuPy) for about ``seconds``."""
    import time

    if seconds <= 0:
        return
    a = cp.ones((4096, 4096), dtype=cp.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        cp.cuda.Device().synchronize()


def precompile(cells, forward_only: bool = False) -> int:
    from cuflash import build, kernels

    variants = {}
    for c in cells:
        shape = kernels.ProblemShape(c.B, c.S, c.S, c.H, c.Hkv, c.D, c.D, "bfloat16", c.causal)
        plans = [kernels.plan_forward(shape, 90, 132)]
        if not forward_only:
            plans += [kernels.plan_backward(shape, 90, d, 132) for d in (False, True)]
        for plan in plans:
            for launch in plan.launches:
                variants[build.render_name(launch.variant)] = launch.variant
    results = build.precompile("sm_90a", variants=list(variants.values()), workers=os.cpu_count())
    print(f"{len(results)} kernels compiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
