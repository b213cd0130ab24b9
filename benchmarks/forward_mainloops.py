"""The forward's mainloops side by side on this GPU: each grid cell run through every mainloop the arch
has (mma.sync, the 8-warp wgmma one, the warp-specialized one), in one process, with the outputs compared.

    python benchmarks/forward_mainloops.py [--seqlens 1024 4096 16384] [--dims 64 128 256] [--reps 30]

Per cell: TFLOPS of each mainloop (FLOPs 4 B H S^2 D, halved when causal; B = 16384 / S, H = 2048 / D, bf16),
torch SDPA's cuDNN backend beside them when torch is there, and the largest difference of each output from
the first mainloop's (the kernels differ in tiling only, so this stays at bf16 rounding).
"""
import argparse

import cupy as cp
import ml_dtypes
import numpy as np

from cuflash import build, launch
from cuflash.arrays import describe_cupy
from cuflash.kernels import Launch, Plan, ProblemShape
from cuflash.kernels import forward as fwd

NAMES = {fwd.MAINLOOP_SM80: "mma.sync", fwd.MAINLOOP_SM90: "wgmma", fwd.MAINLOOP_SM90_WS: "wgmma-ws"}


def median_ms(fn, reps: int) -> float:
    fn()
    cp.cuda.Device().synchronize()
    start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def mainloops_for(arch: int, head_dim: int) -> list:
    out = [fwd.MAINLOOP_SM80]
    if arch == 90:
        if head_dim in fwd.WGMMA_BUCKETS:
            out.append(fwd.MAINLOOP_SM90)
        if head_dim in fwd.WS_BUCKETS:
            out.append(fwd.MAINLOOP_SM90_WS)
    return out


def cudnn_ms(q, k, v, causal: bool, reps: int):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        fn()
        torch.cuda.synchronize()
        start, end, times = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    device = cp.cuda.runtime.getDevice()
    arch = int(launch.compute_capability(device))
    stream = cp.cuda.get_current_stream()
    num_sms = launch.multiprocessor_count(device)
    variants = {(d, c, m): fwd.variant("bfloat16", d, int(c), arch, 0, mainloop=m)
                for d in args.dims for c in (False, True) for m in mainloops_for(arch, d)}
    build.precompile(build.arch_of_compute_capability(arch), list(variants.values()))
    print(f"device: {cp.cuda.runtime.getDeviceProperties(device)['name'].decode()}  bf16, TFLOPS (max |diff| vs first)")
    for head_dim in args.dims:
        for seqlen in args.seqlens:
            batch, heads = 16384 // seqlen, 2048 // head_dim
            cp.random.seed(0)
            make = lambda: cp.random.standard_normal((batch, seqlen, heads, head_dim), dtype=cp.float32).astype(ml_dtypes.bfloat16)
            q, k, v = make(), make(), make()
            for causal in (False, True):
                shape = ProblemShape(batch, seqlen, seqlen, heads, heads, head_dim, head_dim, "bfloat16", causal)
                flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1)
                cells, first = [], None
                for m in mainloops_for(arch, head_dim):
                    out = cp.full_like(q, np.nan)
                    lse = cp.full((batch, heads, seqlen), np.nan, cp.float32)
                    descs = [describe_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
                    params = launch.make_params(shape, head_dim ** -0.5, *descs)
                    var = variants[(head_dim, causal, m)]
                    plan = Plan((Launch(var, fwd.grid_for(var.config, shape, num_sms)),))
                    ms = median_ms(lambda: launch.run(plan, params, device, stream), args.reps)
                    o32 = out.astype(cp.float32)
                    nan = bool(cp.isnan(o32).any() | cp.isnan(lse).any())
                    diff = 0.0 if first is None else float(cp.abs(o32 - first).max())
                    first = o32 if first is None else first
                    cells.append(f"{NAMES[m]} {flops / ms / 1e9:.0f} ({diff:.1e}{' NaN' if nan else ''})")
                ref = cudnn_ms(q, k, v, causal, args.reps)
                if ref is not None:
                    cells.append(f"cuDNN {flops / ref / 1e9:.0f}")
                print(f"D{head_dim} S{seqlen} {'causal' if causal else 'full  '}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
