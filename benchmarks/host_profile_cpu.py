"""Host (Python) time per call of the core's entry points with no GPU: a profiler's view of the hot path.

Runs cuflash against the stand-in GPU of ``tests/fake_gpu.py`` (CuPy arrays over made-up addresses,
a recording ``cuLaunchKernel`` that does nothing, allocations that are plain CuPy array objects), so
what it times is cuflash's own Python work per call, with no CUDA driver or allocator time. Real
calls add those (a few µs per launch and per CuPy allocation); ``host_overhead.py`` on a GPU measures
the whole.

    python benchmarks/host_profile_cpu.py            # median µs per call of each entry point
    python benchmarks/host_profile_cpu.py --profile  # plus a cProfile of the cached calls
"""
import argparse
import cProfile
import pathlib
import pstats
import statistics
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]  # this checkout's cuflash, and the fakes

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from fake_gpu import FakeGPU  # noqa: E402

N, REPEATS = 2000, 7


def median_us(fn) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(N):
            fn()
        times.append((time.perf_counter() - start) / N * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each cached call")
    args = parser.parse_args()

    gpu = FakeGPU().install(setattr)
    gpu.record = False
    bf16 = ml_dtypes.bfloat16
    q, k, v = (gpu.array((1, 128, 1, 64), bf16) for _ in range(3))
    out, lse = cuflash.attention_forward(q, k, v)
    dout = gpu.array(out.shape, bf16)
    stream = 0x5000
    calls = {
        "attention_forward": lambda: cuflash.attention_forward(q, k, v),
        "attention_forward(out=, lse=)": lambda: cuflash.attention_forward(q, k, v, out=out, lse=lse),
        "attention_forward(out=, lse=, stream=int)":
            lambda: cuflash.attention_forward(q, k, v, out=out, lse=lse, stream=stream),
        "attention_backward": lambda: cuflash.attention_backward(dout, q, k, v, out, lse),
    }
    # Packed sequences (offsets on the GPU, both longest lengths given: cached) and a split decoding step that
    # passes its workspace, as the torch adapter does (cached, the buffers patched in).
    pq, pk, pv, pdo = (gpu.array((300, 4, 64), bf16) for _ in range(4))
    cu = gpu.array((4,), np.int32)
    pout, plse = cuflash.varlen_attention_forward(pq, pk, pv, cu, cu, 128, 128, causal=True)
    calls["varlen_attention_forward"] = lambda: cuflash.varlen_attention_forward(pq, pk, pv, cu, cu, 128, 128,
                                                                                 causal=True, out=pout, lse=plse)
    calls["varlen_attention_backward"] = lambda: cuflash.varlen_attention_backward(pdo, pq, pk, pv, pout, plse, cu,
                                                                                   cu, 128, 128, causal=True)
    dq_, kc, vc = gpu.array((1, 1, 32, 128), bf16), gpu.array((1, 65536, 8, 128), bf16), gpu.array((1, 65536, 8, 128), bf16)
    lengths = gpu.array((1,), np.int32)
    workspace = {name: gpu.array(shape, np.float32)
                 for name, shape in cuflash.kvcache_workspace(dq_, kc, vc, causal=True).items()}
    calls["attention_with_kvcache(workspace=, split)"] = lambda: cuflash.attention_with_kvcache(
        dq_, kc, vc, lengths, causal=True, workspace=workspace)
    print(f"{'core entry point (fake GPU: Python time only)':<52} median µs/call")
    for name, fn in calls.items():
        print(f"{name:<52} {median_us(fn):10.1f}")
    if args.profile:
        for name, fn in calls.items():
            print(f"\n--- {name}")
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(N):
                fn()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
