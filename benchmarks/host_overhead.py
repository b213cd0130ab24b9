"""Host (Python) time per call of each entry point, against the kernel time of a 1k-token problem.

For each entry point: N back-to-back calls on a tiny problem (B=1, S=128, H=1, D=64: a few µs of GPU
work, so the wall time per call is the host's), synchronized once at the end; the median of REPEATS such
runs (and the fastest) is printed in µs. The first call of each entry point validates, plans and caches
a launch plan; the timed calls are cache hits (see cuflash/api.py). ``benchmarks/host_profile_cpu.py``
profiles the Python part alone on a machine without a GPU.

    python benchmarks/host_overhead.py
"""
import statistics
import time

import cupy
import ml_dtypes
import numpy as np

import cuflash

N = 2000
REPEATS = 5


def per_call_us(fn, sync) -> tuple:
    """(median, min) over REPEATS runs of N calls, µs per call."""
    for _ in range(50):
        fn()
    sync()
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(N):
            fn()
        sync()
        runs.append((time.perf_counter() - start) / N * 1e6)
    return statistics.median(runs), min(runs)


def kernel_ms(fn) -> float:
    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(20):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 20


def main():
    bf16 = ml_dtypes.bfloat16
    rows = []
    tiny = [cupy.random.standard_normal((1, 128, 1, 64), dtype=cupy.float32).astype(bf16) for _ in range(3)]
    sync = cupy.cuda.get_current_stream().synchronize
    out, lse = cuflash.attention_forward(*tiny)
    dout = cupy.random.standard_normal(out.shape, dtype=cupy.float32).astype(bf16)
    rows.append(("cupy  cuflash.attention_forward", per_call_us(lambda: cuflash.attention_forward(*tiny), sync)))
    rows.append(("cupy  cuflash.attention_forward(out=, lse=)",
                 per_call_us(lambda: cuflash.attention_forward(*tiny, out=out, lse=lse), sync)))
    rows.append(("cupy  cuflash.attention_backward",
                 per_call_us(lambda: cuflash.attention_backward(dout, *tiny, out, lse), sync)))
    # With score options: the general mask (its list pre-pass and a pool allocation per call) and the
    # score modifier.
    ids = cupy.zeros((1, 128), dtype=cupy.int32)
    opts = dict(causal=True, window=(64, 0), segment_ids=(ids, ids), softcap=30.0)
    out_o, lse_o = cuflash.attention_forward(*tiny, **opts)
    rows.append(("cupy  attention_forward(window, segment_ids, softcap)",
                 per_call_us(lambda: cuflash.attention_forward(*tiny, **opts), sync)))
    rows.append(("cupy  attention_backward(window, segment_ids, softcap)",
                 per_call_us(lambda: cuflash.attention_backward(dout, *tiny, out_o, lse_o, **opts), sync)))
    # A bias (cached forward; the backward validates each call and makes its dbias) and a bool mask (cached).
    bias = cupy.random.standard_normal((1, 1, 128, 128), dtype=cupy.float32).astype(bf16)
    mask = cupy.ones((1, 1, 128, 128), dtype=bool)
    for name, extra in (("bias", dict(bias=bias)), ("mask", dict(mask=mask))):
        out_x, lse_x = cuflash.attention_forward(*tiny, **extra)
        rows.append((f"cupy  attention_forward({name})",
                     per_call_us(lambda extra=extra: cuflash.attention_forward(*tiny, **extra), sync)))
        rows.append((f"cupy  attention_backward({name})",
                     per_call_us(lambda extra=extra, o=out_x, l=lse_x: cuflash.attention_backward(dout, *tiny, o, l, **extra),
                                 sync)))

    # Packed sequences (offsets on the GPU, both longest lengths: cached) and a split decoding step with its
    # workspace (cached, the buffers patched in).
    packed = [cupy.random.standard_normal((300, 1, 64), dtype=cupy.float32).astype(bf16) for _ in range(3)]
    cu = cupy.asarray([0, 100, 128, 300], dtype=cupy.int32)
    p_out, p_lse = cuflash.varlen_attention_forward(*packed, cu, cu, 172, 172, causal=True)
    rows.append(("cupy  varlen_attention_forward",
                 per_call_us(lambda: cuflash.varlen_attention_forward(*packed, cu, cu, 172, 172, causal=True), sync)))
    rows.append(("cupy  varlen_attention_backward",
                 per_call_us(lambda: cuflash.varlen_attention_backward(packed[0], *packed, p_out, p_lse, cu, cu, 172,
                                                                       172, causal=True), sync)))
    kq = cupy.random.standard_normal((1, 1, 32, 128), dtype=cupy.float32).astype(bf16)
    kc, vc = (cupy.zeros((1, 16384, 8, 128), dtype=bf16) for _ in range(2))
    lengths = cupy.asarray([16000], dtype=cupy.int32)
    workspace = {name: cupy.empty(shape, dtype=cupy.float32)
                 for name, shape in cuflash.kvcache_workspace(kq, kc, vc, causal=True).items()}
    rows.append(("cupy  attention_with_kvcache(workspace=, split)",
                 per_call_us(lambda: cuflash.attention_with_kvcache(kq, kc, vc, lengths, causal=True,
                                                                    workspace=workspace), sync)))

    try:
        import jax
        import jax.numpy as jnp

        import cuflash.interop.jax as cfj

        q = jnp.asarray(np.asarray(tiny[0].get(), dtype=np.float32), dtype=jnp.bfloat16)
        fwd = jax.jit(lambda q, k, v: cfj.attention(q, k, v))
        grad = jax.jit(jax.grad(lambda q, k, v: cfj.attention(q, k, v).astype(jnp.float32).sum()))
        jax.block_until_ready(fwd(q, q, q))
        jax.block_until_ready(grad(q, q, q))
        last = {}

        def run_fwd():
            last["x"] = fwd(q, q, q)

        def run_grad():
            last["x"] = grad(q, q, q)

        rows.append(("jax   jit(cfj.attention)", per_call_us(run_fwd, lambda: jax.block_until_ready(last["x"]))))
        rows.append(("jax   jit(grad(cfj.attention))", per_call_us(run_grad, lambda: jax.block_until_ready(last["x"]))))
    except ImportError as exc:
        rows.append((f"jax   (not measured: {exc})", (float("nan"),) * 2))

    try:
        import torch

        import cuflash.interop.torch as cft

        tq = [torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        tg = [t.clone().requires_grad_() for t in tq]
        rows.append(("torch cft.attention (no grad)", per_call_us(lambda: cft.attention(*tq), torch.cuda.synchronize)))

        def fwd_bwd():
            cft.attention(*tg).sum().backward()

        rows.append(("torch cft.attention + backward", per_call_us(fwd_bwd, torch.cuda.synchronize)))
        tp = [torch.from_dlpack(x).clone().requires_grad_() for x in packed]
        tcu = torch.from_dlpack(cu)

        def varlen_fwd_bwd():
            cft.varlen_attention(*tp, tcu, tcu, 172, 172, causal=True).sum().backward()

        rows.append(("torch cft.varlen_attention + backward", per_call_us(varlen_fwd_bwd, torch.cuda.synchronize)))
        tk = [torch.from_dlpack(x) for x in (kq, kc, vc, lengths)]
        rows.append(("torch cft.attention_with_kvcache (split)",
                     per_call_us(lambda: cft.attention_with_kvcache(*tk, causal=True), torch.cuda.synchronize)))
    except ImportError as exc:
        rows.append((f"torch (not measured: {exc})", (float("nan"),) * 2))

    big = [cupy.random.standard_normal((1, 1024, 16, 128), dtype=cupy.float32).astype(bf16) for _ in range(3)]
    ref_ms = kernel_ms(lambda: cuflash.attention_forward(*big))
    print(f"{'entry point':<56} host µs/call (median of {REPEATS})   min")
    for name, (median, fastest) in rows:
        print(f"{name:<56} {median:10.1f} {fastest:26.1f}")
    print(f"kernel time of a 1k-token forward (B=1, S=1024, H=16, D=128, bf16): {ref_ms * 1e3:.1f} µs")


if __name__ == "__main__":
    main()
