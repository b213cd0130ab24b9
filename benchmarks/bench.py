"""``python -m cuflash bench``: cuflash against every attention implementation installed, in one process.

This file is the benchmark's body; it lives in the source checkout, not in the package (it imports torch,
JAX, flash_attn and matplotlib where installed). ``python -m cuflash bench`` finds and runs it, and so does
``python benchmarks/bench.py``.

Every speed claim is a ratio against peers timed in the same process, on the same GPU, in the same run
(benchmarks/RESULTS.md logs the runs). The grid follows PEERS.md: bf16, 16k tokens per batch
(B = 16384 / S), hidden 2048 (H = 2048 / D), D in {64, 128, 256}, S in {1k, 4k, 16k}, causal and not,
plus GQA (H=32, Hkv=8, D=128, S=4k) and a vision-language-action model's MQA shape (B=2, S=1024, H=8,
Hkv=1, D=256) whose peak memory is also reported.

Peers, each used only when importable (a peer that cannot run a cell shows ``n/a`` and the reason
goes to the JSON file):

- ``torch.nn.functional.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.X)`` for X in
  CUDNN_ATTENTION (cuDNN), FLASH_ATTENTION (FlashAttention-2) and EFFICIENT_ATTENTION, layout
  (B, H, S, D) as views of the same bshd tensors cuflash reads (GQA through ``enable_gqa=True``);
- ``jax.nn.dot_product_attention(..., implementation="cudnn")``, jitted, layout (B, S, N, D);
- FlashAttention-4, ``flash_attn.cute.flash_attn_func`` (layout B, S, H, D).

Timing: CUDA events, warm-up, median of many repeats: ``triton.testing.do_bench(fn, warmup=25,
rep=100, return_mode="median")`` when triton is importable (it also flushes L2 between repeats),
otherwise an equivalent event loop. JAX dispatches on its own stream, so it is timed by wall clock
over back-to-back calls ended by ``block_until_ready`` (median of 5 repeats). Inputs are random
normal, never zeros. cuflash runs on the very torch tensors the peers get, through
``cupy.from_dlpack`` (zero-copy), on torch's current stream. FLOPs: forward ``4 B H S^2 D``, halved
when causal; forward+backward 3.5x the forward.

cuflash's ``deterministic=True`` backward (bit-identical dQ/dK/dV, no float atomics) is timed too, in the
same run and the same way as its default forward+backward, right after it on the same inputs: the
forward+backward table's ``cf-det`` column (its TFLOPS, same FLOP count) and ``det/cf`` (cf-det over
cuflash); in the JSON, ``fwd_bwd_det_*`` keys in each cell's ``cuflash`` entry. ``--no-deterministic``
skips it.

With torch installed, cuflash's forward+backward is also timed through its torch adapter, exactly as a torch
user calls it: ``cuflash.interop.torch.attention(q, k, v, causal=...)`` on ``requires_grad`` tensors, then
``out.backward(dout)`` (the gradients reset to None before each call, as ``zero_grad`` does), on the same
inputs, timed the same way in ``TORCH_ROUNDS`` rounds that alternate with the CuPy path's forward+backward.
The forward+backward table's ``cf-torch`` column (the median round's TFLOPS, same FLOP count) sits next to
cuflash's, and ``torch/cf`` (the median of the rounds' ratios) among the ratios; in the JSON,
``fwd_bwd_torch_*`` keys in each cell's ``cuflash`` entry.

Output: a progress bar, one table (TFLOPS, with cuflash / cuDNN and cuflash / FA2 ratios), and
``bench.json`` + ``bench.png`` in ``--out`` (default ./bench_out). Without a usable GPU, or when cuflash
measured nothing, it says why and exits 1.

``--features`` adds, after the grid, the features table (``benchmarks/features.py``: block-causal,
document-causal, sliding window, learnable bias with its gradient, plain causal; cuflash against
FlexAttention and SDPA with explicit masks, useful TFLOPS = dense FLOPs x visible fraction, the issue's
targets beside them); ``--features-only`` times that table alone (``--cases REGEX`` picks cases). It goes
into ``bench.json`` under ``features``. A features-only run exits 1 only when nothing at all was measured
(cuflash cells that raise NotImplementedError show ``n/i`` while the peers still run).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

TOKENS = 16384
HIDDEN = 2048


def load_features():
    """benchmarks/features.py beside this file (loaded by path: benchmarks/ is no package)."""
    path = Path(__file__).resolve().parent / "features.py"
    name = "cuflash_bench_features"
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


features = load_features()

#: Implementations in table order: (key, short label).
IMPLS = (
    ("cuflash", "cuflash"),
    ("torch-cudnn", "cuDNN"),
    ("torch-fa2", "FA2"),
    ("torch-efficient", "eff"),
    ("jax-cudnn", "jax"),
    ("fa4", "FA4"),
)
MODES = ("fwd", "fwd_bwd")
#: cuflash's forward + ``deterministic=True`` backward: timed after its ``fwd_bwd``, reported beside it.
DET_MODE = "fwd_bwd_det"
#: cuflash's forward+backward through its torch adapter (autograd): timed after its ``fwd_bwd``.
TORCH_MODE = "fwd_bwd_torch"
#: Rounds of the CuPy path's and the torch adapter's forward+backward timed in alternation (torch/cf is the
#: median of the rounds' ratios). One timing of each moved by up to 12% between rounds on an H100 under power
#: capping, on every path alike with the same kernels (session 19: B1 S16k H16 D128 causal, 7.41-8.30 ms through
#: CuPy, the adapter's .backward and autograd.grad, and the ops called without autograd), so a single timing
#: after the CuPy path's read 0.86-0.89 in cells where the adapter adds no GPU work.
TORCH_ROUNDS = 3
#: triton.testing.do_bench budgets (milliseconds of warm-up / of timed repeats).
WARMUP_MS, REP_MS = 25, 100
#: bf16 outputs of two correct kernels differ by ~4e-3 (rounding); more than this is a red flag.
OUTPUT_CHECK_LIMIT = 2e-2
#: Cells of this many tokens or more time with half the repeat budget (each call is long anyway).
LONG_SEQUENCE = 16384


# --------------------------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    B: int
    S: int
    H: int
    Hkv: int
    D: int
    causal: bool
    memory: bool = False  # also report peak memory of forward+backward

    def flops(self, mode: str) -> float:
        fwd = 4.0 * self.B * self.H * self.S * self.S * self.D * (0.5 if self.causal else 1.0)
        return fwd * (3.5 if mode in ("fwd_bwd", DET_MODE, TORCH_MODE) else 1.0)


def _kind(causal: bool) -> str:
    return "causal" if causal else "full"


def all_cells() -> list:
    cells = []
    for d in (64, 128, 256):
        for s in (1024, 4096, 16384):
            for causal in (False, True):
                h = HIDDEN // d
                cells.append(Cell(f"D{d}-S{s // 1024}k-{_kind(causal)}", TOKENS // s, s, h, h, d, causal))
    for causal in (False, True):
        cells.append(Cell(f"GQA32/8-D128-S4k-{_kind(causal)}", 4, 4096, 32, 8, 128, causal))
    for causal in (False, True):
        cells.append(Cell(f"MQA8/1-D256-S1k-B2-{_kind(causal)}", 2, 1024, 8, 1, 256, causal, memory=True))
    return cells


QUICK = ("D128-S4k-causal", "D128-S4k-full", "D64-S1k-full", "D256-S4k-full", "MQA8/1-D256-S1k-B2-full")


def select_cells(quick: bool, patterns: str | None) -> list:
    cells = all_cells()
    if quick:
        cells = [c for c in cells if c.name in QUICK]
    if patterns:
        regexes = [re.compile(p.strip()) for p in patterns.split(",") if p.strip()]
        cells = [c for c in cells if any(r.search(c.name) for r in regexes)]
    return cells


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

def _gpu_problem() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - no driver, no device, ...
        return str(exc).splitlines()[0]
    return None


def _try_import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception:  # noqa: BLE001 - any import failure means "not installed here"
        return None


def _version(module) -> str | None:
    return getattr(module, "__version__", None) if module is not None else None


def _commit() -> str:
    """The checkout's commit; ``CUFLASH_COMMIT`` names it where the tree travels without .git."""
    if os.environ.get("CUFLASH_COMMIT"):
        return os.environ["CUFLASH_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device_info() -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sms": props["multiProcessorCount"],
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "runtime": cupy.cuda.runtime.runtimeGetVersion(),
    }


# --------------------------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------------------------

class Progress:
    """tqdm when installed, else a one-line text bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        tqdm = _try_import("tqdm")
        self._bar = tqdm.tqdm(total=total, unit="run", dynamic_ncols=True) if tqdm else None

    def step(self, label: str):
        self.done += 1
        if self._bar is not None:
            self._bar.set_description_str(label[:48])
            self._bar.update(1)
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label[:48]:48s}")
        sys.stderr.flush()

    def close(self):
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

class Timer:
    """Median milliseconds per call of a CUDA-launching function."""

    def __init__(self):
        self.triton = _try_import("triton.testing")
        self.torch = _try_import("torch")

    def cuda(self, fn, long_call: bool = False) -> float:
        rep = REP_MS // 2 if long_call else REP_MS
        if self.triton is not None:
            return float(self.triton.do_bench(fn, warmup=WARMUP_MS, rep=rep, return_mode="median"))
        return self._events(fn, rep)

    def _events(self, fn, rep_ms: float) -> float:
        """do_bench's method with CuPy events on the current stream (no L2 flush)."""
        import cupy

        fn()
        cupy.cuda.Device().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        estimate = max(cupy.cuda.get_elapsed_time(start, end) / 5, 1e-3)
        for _ in range(max(1, int(WARMUP_MS / estimate))):
            fn()
        repeats = max(3, int(rep_ms / estimate))
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
        for begin, finish in events:
            begin.record()
            fn()
            finish.record()
        events[-1][1].synchronize()
        return statistics.median(cupy.cuda.get_elapsed_time(b, f) for b, f in events)

    @staticmethod
    def wallclock(fn, block) -> float:
        """Median ms per call over 5 repeats of back-to-back calls (for JAX's own streams)."""
        block(fn())
        t0 = time.perf_counter()
        block(fn())
        estimate = time.perf_counter() - t0
        calls = max(1, min(200, int(0.06 / max(estimate, 1e-6))))
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            result = None
            for _ in range(calls):
                result = fn()
            block(result)
            samples.append((time.perf_counter() - t0) / calls * 1e3)
        return statistics.median(samples)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    """bshd bf16 tensors (torch when installed, else CuPy) and their zero-copy CuPy views."""

    q: object
    k: object
    v: object
    dout: object
    cq: object
    ck: object
    cv: object
    cdout: object
    torch: bool


def make_inputs(cell: Cell, torch) -> Inputs:
    import cupy

    shapes = ((cell.B, cell.S, cell.H, cell.D), (cell.B, cell.S, cell.Hkv, cell.D),
              (cell.B, cell.S, cell.Hkv, cell.D), (cell.B, cell.S, cell.H, cell.D))
    if torch is not None:
        gen = torch.Generator(device="cuda").manual_seed(cell.S * 1000 + cell.D)
        tensors = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in shapes]
        views = [cupy.from_dlpack(t) for t in tensors]
        return Inputs(*tensors, *views, torch=True)
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(cell.S * 1000 + cell.D)
    arrays = [cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)) for s in shapes]
    return Inputs(*arrays, *arrays, torch=False)


# --------------------------------------------------------------------------------------------
# Implementations: each returns {"fwd": fn, "fwd_bwd": fn} or raises Unavailable
# --------------------------------------------------------------------------------------------

class Unavailable(Exception):
    """This implementation cannot run this cell (the message says why)."""


def _cuflash(cell: Cell, x: Inputs, torch):
    import cuflash

    stream = torch.cuda.current_stream().cuda_stream if x.torch else None
    q, k, v, dout = x.cq, x.ck, x.cv, x.cdout
    cuflash.prepare(q, k, v, causal=cell.causal, backward=True)
    try:  # a deterministic plan that cannot load makes only the cf-det column n/a
        cuflash.prepare(q, k, v, causal=cell.causal, backward=True, deterministic=True)
        det_problem = None
    except Exception as exc:  # noqa: BLE001
        det_problem = exc

    def fwd():
        return cuflash.attention_forward(q, k, v, causal=cell.causal, stream=stream)

    def backward(deterministic: bool):
        out, lse = cuflash.attention_forward(q, k, v, causal=cell.causal, stream=stream)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=cell.causal,
                                          deterministic=deterministic, stream=stream)

    def fwd_bwd():
        return backward(False)

    def fwd_bwd_det():
        if det_problem is not None:
            raise det_problem
        return backward(True)

    fns = {"fwd": fwd, "fwd_bwd": fwd_bwd, DET_MODE: fwd_bwd_det}
    if x.torch:
        fns[TORCH_MODE] = _cuflash_via_torch(cell, x)
    return fns


def _cuflash_via_torch(cell: Cell, x: Inputs):
    """cuflash's forward+backward as a torch user calls it: the adapter's autograd op, ``.backward(dout)``."""
    try:
        import cuflash.interop.torch as cft
    except Exception as exc:  # noqa: BLE001 - then only the cf-torch column is n/a
        problem = exc

        def unavailable():
            raise problem

        return unavailable
    qg, kg, vg = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))

    def fwd_bwd_torch():
        qg.grad = kg.grad = vg.grad = None  # what zero_grad(set_to_none=True) leaves between steps
        cft.attention(qg, kg, vg, causal=cell.causal).backward(x.dout)
        return qg.grad, kg.grad, vg.grad

    return fwd_bwd_torch


def _sdpa(backend_name: str):
    def make(cell: Cell, x: Inputs, torch):
        if not x.torch:
            raise Unavailable("torch is not installed")
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, backend_name)
        extra = {"enable_gqa": True} if cell.Hkv != cell.H else {}
        q, k, v, dout = (t.transpose(1, 2) for t in (x.q, x.k, x.v, x.dout))  # (B, H, S, D) views
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd():
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=cell.causal, **extra)

        def fwd_bwd():
            with sdpa_kernel(backend):
                out = sdpa(qg, kg, vg, is_causal=cell.causal, **extra)
            return torch.autograd.grad(out, (qg, kg, vg), dout)

        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    return make


def _fa4(cell: Cell, x: Inputs, torch):
    if not x.torch:
        raise Unavailable("torch is not installed")
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"flash_attn.cute is not importable ({type(exc).__name__})") from None
    qg, kg, vg = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))

    def first(result):
        return result[0] if isinstance(result, tuple) else result

    def fwd():
        return first(flash_attn_func(x.q, x.k, x.v, causal=cell.causal))

    def fwd_bwd():
        out = first(flash_attn_func(qg, kg, vg, causal=cell.causal))
        return torch.autograd.grad(out, (qg, kg, vg), x.dout)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


_JAX_FNS: dict = {}


def _jax(cell: Cell, x: Inputs, torch):
    jax = _try_import("jax")
    if jax is None:
        raise Unavailable("jax is not installed")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        raise Unavailable("jax sees no GPU")

    def to_jax(t):
        try:
            return jax.dlpack.from_dlpack(t)
        except Exception:  # noqa: BLE001 - fall back to a device copy through the host
            import cupy

            return jnp.asarray(cupy.asnumpy(cupy.from_dlpack(t) if not hasattr(t, "get") else t))

    q, k, v, dout = (to_jax(t) for t in (x.q, x.k, x.v, x.dout))
    key = (cell.causal,)
    if key not in _JAX_FNS:
        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=cell.causal, implementation="cudnn")

        def forward_backward(q, k, v, do):
            _, pullback = jax.vjp(attend, q, k, v)
            return pullback(do)

        _JAX_FNS[key] = (jax.jit(attend), jax.jit(forward_backward))
    fwd_jit, fb_jit = _JAX_FNS[key]
    return {"fwd": lambda: fwd_jit(q, k, v), "fwd_bwd": lambda: fb_jit(q, k, v, dout),
            "_block": jax.block_until_ready}


MAKERS = {
    "cuflash": _cuflash,
    "torch-cudnn": _sdpa("CUDNN_ATTENTION"),
    "torch-fa2": _sdpa("FLASH_ATTENTION"),
    "torch-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "jax-cudnn": _jax,
    "fa4": _fa4,
}


def _installed_peers(torch, no_peers: bool, only: str | None) -> list:
    if no_peers:
        return []
    wanted = None if not only else {p.strip() for p in only.split(",") if p.strip()}
    peers = []
    if torch is not None:
        peers += ["torch-cudnn", "torch-fa2", "torch-efficient"]
    if _try_import("jax") is not None:
        peers.append("jax-cudnn")
    if torch is not None and _try_import("flash_attn.cute") is not None:
        peers.append("fa4")
    if wanted is not None:
        peers = [p for p in peers if p in wanted or p.split("-", 1)[-1] in wanted]
    return peers


# --------------------------------------------------------------------------------------------
# Measuring one cell
# --------------------------------------------------------------------------------------------

def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _peak_mib(impl: str, fn, torch) -> float | None:
    """Peak extra device memory of one forward+backward call (inputs excluded)."""
    import cupy

    if impl == "cuflash":
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            result = fn()
            cupy.cuda.Device().synchronize()
            del result
        peak = pool.total_bytes()
        pool.free_all_blocks()
        return peak / 2**20
    if impl.startswith("torch") or impl == "fa4":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del result
        return peak / 2**20
    return None


def _relative_difference(a, b) -> float:
    """||a - b|| / ||b|| of two bf16 outputs (any DLPack arrays), in float32 on the GPU."""
    import cupy

    def as32(t):
        t = cupy.from_dlpack(t) if not isinstance(t, cupy.ndarray) else t
        if t.dtype.itemsize == 2 and t.dtype != cupy.float16:  # bfloat16: widen through the bits
            return (t.view(cupy.uint16).astype(cupy.uint32) << cupy.uint32(16)).view(cupy.float32)
        return t.astype(cupy.float32)

    a32, b32 = as32(a), as32(b)
    diff = a32 - b32
    return float(cupy.sqrt(cupy.sum(diff * diff)) / cupy.sqrt(cupy.sum(b32 * b32)))


def modes_of(impl: str, deterministic: bool = True, via_torch: bool = False) -> tuple:
    """The timed configurations of one implementation in one cell, in timing order (``via_torch``: torch
    is installed, so cuflash is also timed through its torch adapter)."""
    if impl != "cuflash":
        return MODES
    return MODES + ((TORCH_MODE,) if via_torch else ()) + ((DET_MODE,) if deterministic else ())


def _time_via_torch(fns: dict, timer, long_call: bool) -> tuple:
    """(ms, torch/cf) of the torch adapter's forward+backward: TORCH_ROUNDS rounds, each timing the CuPy path
    and then the adapter; the median round's ms and the median of the rounds' ratios (CuPy ms / adapter ms)."""
    rounds = []
    for _ in range(TORCH_ROUNDS):
        cupy_ms = timer.cuda(fns["fwd_bwd"], long_call=long_call)
        rounds.append((cupy_ms, timer.cuda(fns[TORCH_MODE], long_call=long_call)))
    ratio = statistics.median(cupy_ms / torch_ms for cupy_ms, torch_ms in rounds)
    return statistics.median(torch_ms for _, torch_ms in rounds), round(ratio, 3)


def _det_difference(fns: dict) -> float:
    """Worst relative difference of dq/dk/dv between cuflash's default and deterministic backward."""
    default, det = fns["fwd_bwd"](), fns[DET_MODE]()
    return max(_relative_difference(a, b) for a, b in zip(det, default, strict=True))


def measure_cell(cell: Cell, impls: list, timer: Timer, torch, progress: Progress,
                 deterministic: bool = True) -> dict:
    via_torch = torch is not None
    x = make_inputs(cell, torch)
    results: dict = {}
    outputs: dict = {}
    for impl in impls:
        entry = results.setdefault(impl, {})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fns = MAKERS[impl](cell, x, torch)
                block = fns.pop("_block", None)
                t0 = time.perf_counter()
                out = fns["fwd"]()
                if block is not None:
                    block(out)
                else:
                    _synchronize(torch)
                entry["first_call_s"] = round(time.perf_counter() - t0, 3)
                outputs[impl] = out[0] if isinstance(out, tuple) else out
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this cell is reported, not fatal
            entry["note"] = "n/a: " + _reason(exc)
            for _ in modes_of(impl, deterministic, via_torch):
                progress.step(f"{cell.name} {impl} n/a")
            continue
        for mode in modes_of(impl, deterministic, via_torch):
            progress.step(f"{cell.name} {impl} {mode}")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if block is not None:
                        ms = timer.wallclock(fns[mode], block)
                    elif mode == TORCH_MODE:
                        ms, entry[f"{TORCH_MODE}_ratio"] = _time_via_torch(fns, timer, cell.S >= LONG_SEQUENCE)
                    else:
                        ms = timer.cuda(fns[mode], long_call=cell.S >= LONG_SEQUENCE)
                entry[f"{mode}_ms"] = round(ms, 4)
                entry[f"{mode}_tflops"] = round(cell.flops(mode) / (ms * 1e-3) / 1e12, 1)
            except Exception as exc:  # noqa: BLE001
                prefix = {DET_MODE: "n/a (deterministic=True): ", TORCH_MODE: "n/a (via torch): "}.get(mode, "n/a: ")
                entry[f"{mode}_note"] = prefix + _reason(exc)
        det, default = entry.get(f"{DET_MODE}_tflops"), entry.get("fwd_bwd_tflops")
        if det is not None and default:
            entry[f"{DET_MODE}_ratio"] = round(det / default, 3)  # the table's det/cf
        via = entry.get(f"{TORCH_MODE}_tflops")
        if via is not None and default and f"{TORCH_MODE}_ratio" not in entry:
            entry[f"{TORCH_MODE}_ratio"] = round(via / default, 3)  # the table's torch/cf
        if det is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    entry[f"{DET_MODE}_grad_difference"] = round(_det_difference(fns), 5)
            except Exception as exc:  # noqa: BLE001
                entry[f"{DET_MODE}_check_note"] = "n/a: " + _reason(exc)
        if cell.memory and block is None:
            try:
                peak = _peak_mib(impl, fns["fwd_bwd"], torch)
                if peak is not None:
                    entry["fwd_bwd_peak_mib"] = round(peak, 1)
            except Exception as exc:  # noqa: BLE001
                entry["memory_note"] = "n/a: " + _reason(exc)
            if det is not None:
                try:
                    entry[f"{DET_MODE}_peak_mib"] = round(_peak_mib(impl, fns[DET_MODE], torch), 1)
                except Exception as exc:  # noqa: BLE001
                    entry[f"{DET_MODE}_memory_note"] = "n/a: " + _reason(exc)
    check = {}
    if "cuflash" in outputs:
        for peer in ("torch-cudnn", "torch-fa2", "torch-efficient", "fa4"):
            if peer in outputs:
                try:
                    peer_out = outputs[peer]
                    if hasattr(peer_out, "transpose") and peer.startswith("torch"):
                        peer_out = peer_out.transpose(1, 2)  # (B, H, S, D) -> bshd
                    check = {"against": peer, "relative_difference": round(
                        _relative_difference(outputs["cuflash"], peer_out.contiguous()), 5)}
                except Exception as exc:  # noqa: BLE001
                    check = {"against": peer, "note": _reason(exc)}
                break
    del x, outputs
    return {**dataclasses.asdict(cell), "flops_fwd": cell.flops("fwd"),
            "flops_fwd_bwd": cell.flops("fwd_bwd"), "results": results, "output_check": check}


def _synchronize(torch):
    if torch is not None:
        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.Device().synchronize()


def _precompile(cells: list, deterministic: bool = True) -> str:
    """Compile the cuflash kernels the cells need, in parallel, before any timing."""
    import cupy

    from cuflash import build, kernels

    arch = int(cupy.cuda.Device().compute_capability)
    variants = set()
    for c in cells:
        shape = kernels.ProblemShape(c.B, c.S, c.S, c.H, c.Hkv, c.D, c.D, "bfloat16", c.causal)
        for plan in (kernels.plan_forward(shape, arch), kernels.plan_backward(shape, arch, False)):
            variants.update(launch.variant for launch in plan.launches)
        if deterministic:
            try:  # a shape without a deterministic plan shows n/a in cf-det, not here
                plan = kernels.plan_backward(shape, arch, True)
                variants.update(launch.variant for launch in plan.launches)
            except Exception:  # noqa: BLE001
                pass
    t0 = time.perf_counter()
    compiled = build.precompile(variants=sorted(variants, key=repr))
    fresh = sum(1 for r in compiled if not getattr(r, "cached", False))
    return f"{len(compiled)} cuflash kernels ready ({fresh} compiled) in {time.perf_counter() - t0:.1f} s"


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _fmt(value, width=7) -> str:
    return f"{value:>{width}.0f}" if isinstance(value, (int, float)) else f"{'n/a':>{width}}"


def _ratio(a, b) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return f"{a / b:>7.2f}x"
    return f"{'-':>8}"


def has_deterministic(report: dict) -> bool:
    """Whether the run timed cuflash's deterministic backward (then the table shows cf-det, det/cf)."""
    return any(key.startswith(DET_MODE) for c in report["cells"] for key in c["results"].get("cuflash", {}))


def has_via_torch(report: dict) -> bool:
    """Whether the run timed cuflash through its torch adapter (then the table shows cf-torch, torch/cf)."""
    return any(key.startswith(TORCH_MODE) for c in report["cells"] for key in c["results"].get("cuflash", {}))


def measured_anything(report: dict) -> bool:
    """Whether cuflash has at least one forward or forward+backward figure in the report."""
    return any(c["results"].get("cuflash", {}).get(f"{mode}_tflops") is not None
               for c in report["cells"] for mode in MODES)


def table(report: dict) -> str:
    impls = report["implementations"]
    labels = dict(IMPLS)
    cudnn = "torch-cudnn" if "torch-cudnn" in impls else ("jax-cudnn" if "jax-cudnn" in impls else None)
    det = has_deterministic(report)
    lines = []
    for mode, title in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
        via = mode == "fwd_bwd" and has_via_torch(report)  # cf-torch right after cuflash, torch/cf after cf/best
        head = f"{'cell (' + title + ', TFLOPS)':34s}"
        for i in impls:
            head += f"{labels[i]:>8s}" + (f"{'cf-torch':>9s}" if via and i == "cuflash" else "")
        head += f"{'cf/cuDNN':>9s}{'cf/FA2':>9s}{'cf/best':>9s}"
        if via:
            head += f"{'torch/cf':>9s}"
        if mode == "fwd_bwd" and det:
            head += f"{'cf-det':>8s}{'det/cf':>9s}"
        if mode == "fwd_bwd" and any(c.get("memory") for c in report["cells"]):
            head += "  peak MiB (cuflash / cuDNN / FA2)"
        lines += [head, "-" * len(head)]
        for c in report["cells"]:
            r = c["results"]
            values = {i: r.get(i, {}).get(f"{mode}_tflops") for i in impls}
            ours_via = r.get("cuflash", {}).get(f"{TORCH_MODE}_tflops")
            row = f"{c['name']:34s}"
            for i in impls:
                row += " " + _fmt(values[i]) + (" " + _fmt(ours_via, 8) if via and i == "cuflash" else "")
            ours = values.get("cuflash")
            peers = [v for i, v in values.items() if i != "cuflash" and isinstance(v, (int, float))]
            row += " " + _ratio(ours, values.get(cudnn) if cudnn else None)
            row += " " + _ratio(ours, values.get("torch-fa2"))
            row += " " + _ratio(ours, max(peers) if peers else None)
            if via:
                row += " " + _ratio(ours_via, ours)
            if mode == "fwd_bwd" and det:
                ours_det = r.get("cuflash", {}).get(f"{DET_MODE}_tflops")
                row += " " + _fmt(ours_det) + " " + _ratio(ours_det, ours)
            if mode == "fwd_bwd" and c.get("memory"):
                mem = [r.get(i, {}).get("fwd_bwd_peak_mib") for i in ("cuflash", "torch-cudnn", "torch-fa2")]
                row += "  " + " / ".join(f"{m:.0f}" if isinstance(m, (int, float)) else "n/a" for m in mem)
            lines.append(row)
        lines.append("")
    notes = sorted({f"{i}: {v}" for c in report["cells"] for i, e in c["results"].items()
                    for k, v in e.items() if k.endswith("note")})
    if notes:
        lines.append("notes (n/a reasons):")
        lines += [f"  {n}" for n in notes[:20]]
        if len(notes) > 20:
            lines.append(f"  ... {len(notes) - 20} more in the JSON")
    checked = [(c["output_check"]["relative_difference"], c["name"], c["output_check"]["against"])
               for c in report["cells"] if "relative_difference" in c.get("output_check", {})]
    if checked:
        worst = max(checked)
        lines.append(f"output check (cuflash forward vs a peer's, relative difference): worst "
                     f"{worst[0]:.2e} in {worst[1]} vs {worst[2]}")
        bad = [f"{name} ({diff:.2e} vs {peer})" for diff, name, peer in checked if diff > OUTPUT_CHECK_LIMIT]
        if bad:
            lines.append(f"WARNING: cuflash's output differs from the peer's by more than {OUTPUT_CHECK_LIMIT} "
                         "in: " + "; ".join(bad))
    grads = [(e[f"{DET_MODE}_grad_difference"], c["name"]) for c in report["cells"]
             for e in [c["results"].get("cuflash", {})] if f"{DET_MODE}_grad_difference" in e]
    if grads:
        worst = max(grads)
        lines.append(f"deterministic check (cuflash dq/dk/dv, deterministic vs default, relative difference): "
                     f"worst {worst[0]:.2e} in {worst[1]}")
        bad = [f"{name} ({diff:.2e})" for diff, name in grads if diff > OUTPUT_CHECK_LIMIT]
        if bad:
            lines.append(f"WARNING: cuflash's deterministic gradients differ from the default ones by more than "
                         f"{OUTPUT_CHECK_LIMIT} in: " + "; ".join(bad))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return "matplotlib is not installed: no PNG written"
    impls = report["implementations"]
    labels = dict(IMPLS)
    cells = report["cells"]
    det = has_deterministic(report)
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.9 * len(cells) + 3), 9), sharex=True)
    for ax, mode, title in zip(axes, MODES, ("forward", "forward + backward"), strict=True):
        # (implementation, key, label, style) per bar; each implementation keeps its colour in both
        # panels, cuflash deterministic sits next to cuflash in a hatched lighter shade of its colour
        series = [(i, f"{mode}_tflops", labels[i], {"color": f"C{n}"}) for n, i in enumerate(impls)]
        if mode == "fwd_bwd" and det:
            series.insert(1, ("cuflash", f"{DET_MODE}_tflops", "cuflash det",
                              {"color": "C0", "alpha": 0.45, "hatch": "//"}))
        if mode == "fwd_bwd" and has_via_torch(report):
            series.insert(1, ("cuflash", f"{TORCH_MODE}_tflops", "cuflash via torch",
                              {"color": "C0", "alpha": 0.7, "hatch": ".."}))
        width = 0.8 / max(1, len(series))
        for index, (impl, key, label, style) in enumerate(series):
            values = [c["results"].get(impl, {}).get(key) or 0.0 for c in cells]
            ax.bar([i + (index - (len(series) - 1) / 2) * width for i in range(len(cells))], values,
                   width, label=label, **style)
        ax.set_ylabel("TFLOPS")
        ax.set_title(f"{title}, bf16 ({report['meta']['device']['name']})")
        ax.grid(axis="y", alpha=0.3)
        if ax is axes[0] or len(series) != len(impls):
            ax.legend(ncol=len(series), fontsize=8)
    axes[1].set_xticks(range(len(cells)))
    axes[1].set_xticklabels([c["name"] for c in cells], rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cuflash bench",
                                     description="TFLOPS of cuflash and every installed peer, same process, same GPU")
    parser.add_argument("--quick", action="store_true",
                        help="5 cells: D128 S4k causal/full, D64 S1k, D256 S4k, and the MQA shape")
    parser.add_argument("--cells", metavar="REGEX[,REGEX...]",
                        help="only cells whose name matches one of these (e.g. 'D128,MQA')")
    parser.add_argument("--no-peers", action="store_true", help="time cuflash alone")
    parser.add_argument("--peers", metavar="NAME[,NAME...]",
                        help="only these peers: cudnn, fa2, efficient, jax-cudnn, fa4 (default: all installed)")
    parser.add_argument("--no-deterministic", action="store_true",
                        help="do not time cuflash's deterministic=True backward (the cf-det, det/cf columns)")
    parser.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png (default ./bench_out)")
    parser.add_argument("--features", action="store_true",
                        help="after the grid, also time the features table (masks, bias; cuflash vs "
                             "FlexAttention and SDPA with explicit masks)")
    parser.add_argument("--features-only", action="store_true",
                        help="time only the features table (no grid)")
    parser.add_argument("--cases", metavar="REGEX[,REGEX...]",
                        help="only feature cases whose name matches one of these (e.g. 'blockcausal,doc')")
    parser.add_argument("--list", action="store_true", help="print the cells (and feature cases) and exit")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    run_grid = not args.features_only
    cells = select_cells(args.quick, args.cells) if run_grid else []
    cases = features.select_cases(args.cases) if (args.features or args.features_only) else []
    if args.list:
        for c in cells:
            print(f"{c.name:34s} B={c.B} S={c.S} H={c.H} Hkv={c.Hkv} D={c.D} causal={c.causal}")
        for c in cases:
            print(f"{c.name:34s} {c.describe()}")
        return 0
    problem = _gpu_problem()
    if problem is not None:
        print(f"cuflash bench needs a CUDA GPU and found no usable one ({problem}): nothing was measured.",
              file=sys.stderr)
        return 1
    if run_grid and not cells:
        print("no cell matches --cells")
        return 2
    if (args.features or args.features_only) and not cases:
        print("no feature case matches --cases")
        return 2

    # JAX must not grab 75% of the GPU before torch and CuPy allocate anything.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    torch = _try_import("torch")
    if torch is not None and not torch.cuda.is_available():
        torch = None
    impls = ["cuflash"] + _installed_peers(torch, args.no_peers, args.peers)
    deterministic = not args.no_deterministic
    start = time.perf_counter()
    timer = Timer()
    measured = []
    if cells:
        try:
            print(_precompile(cells, deterministic), flush=True)
        except Exception as exc:  # noqa: BLE001 - then each cell compiles on first use
            print(f"precompile skipped ({_reason(exc)}); kernels compile on first use", flush=True)
        print(f"timing {len(cells)} cells x {len(impls)} implementations ({', '.join(impls)}) with "
              f"{'triton.testing.do_bench' if timer.triton else 'CUDA events'}"
              f"{', plus cuflash deterministic=True forward+backward' if deterministic else ''}", flush=True)

        progress = Progress(len(cells) * sum(len(modes_of(i, deterministic, torch is not None)) for i in impls))
        for cell in cells:
            measured.append(measure_cell(cell, impls, timer, torch, progress, deterministic))
            _free(torch)
        progress.close()
    feature_report = _measure_features(cases, torch, args, timer) if cases else None

    import cuflash

    modules = {name: _try_import(name) for name in ("cupy", "torch", "jax", "triton", "numpy")}
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": _device_info(),
            "commit": _commit(),
            "cuflash": getattr(cuflash, "__version__", None),
            "versions": {name: _version(m) for name, m in modules.items() if m is not None},
            "python": platform.python_version(),
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "timing": "triton.testing.do_bench median" if timer.triton else "CUDA events median",
            "flops": "fwd 4*B*H*S^2*D (x0.5 causal); fwd+bwd 3.5x fwd",
            "via_torch": ("cuflash fwd_bwd_torch_*: cuflash.interop.torch.attention on requires_grad tensors, "
                          ".backward(dout), timed like fwd_bwd, same FLOPs; fwd_bwd_torch_ratio = via-torch / "
                          "CuPy-path TFLOPS") if torch is not None else "not timed (torch is not installed)",
            "deterministic": ("cuflash fwd_bwd_det_*: forward + attention_backward(deterministic=True), "
                              "timed like fwd_bwd, same FLOPs; fwd_bwd_det_ratio = det / default TFLOPS; "
                              "fwd_bwd_det_grad_difference = worst relative difference of dq/dk/dv vs default")
            if deterministic else "not timed (--no-deterministic)",
            "seconds": round(time.perf_counter() - start, 1),
        },
        "implementations": impls if cells else [],
        "cells": measured,
    }
    if feature_report is not None:
        report["features"] = feature_report
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    print()
    print(f"{report['meta']['device']['name']}, commit {report['meta']['commit']}, {report['meta']['date']}")
    if cells:
        print(table(report))
    if feature_report is not None:
        print(features.table(feature_report))
    wrote = plot(report, out_dir / "bench.png") if cells else "no grid: no PNG written"
    print(f"wrote {out_dir / 'bench.json'}; {wrote}")
    print(f"total {report['meta']['seconds']} s")
    if cells and not measured_anything(report):
        print("cuflash measured nothing (every cell n/a; the notes above say why)", file=sys.stderr)
        return 1
    if not cells and not features.measured_anything(feature_report):
        print("the features table measured nothing (every cell n/a; the notes above say why)", file=sys.stderr)
        return 1
    return 0


def _free(torch):
    """Return cached device memory between cells / cases."""
    _synchronize(torch)
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _measure_features(cases: list, torch, args, timer: Timer) -> dict:
    """The features table's cases, timed like the grid (same Timer); a case that fails entirely (its
    inputs cannot be made, ...) is recorded with a note and the table goes on."""
    impls = ["cuflash"] + features.installed_peers(torch, args.no_peers, args.peers)
    print(f"features: timing {len(cases)} cases x {len(impls)} implementations ({', '.join(impls)}) with "
          f"{'triton.testing.do_bench' if timer.triton else 'CUDA events'}", flush=True)
    progress = Progress(len(cases) * len(impls) * len(features.MODES))
    measured = []
    t0 = time.perf_counter()
    for case in cases:
        try:
            measured.append(features.measure_case(case, impls, timer, torch, progress, make_inputs,
                                                   _relative_difference))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
            note = "n/a: " + _reason(exc)
            entry = {**dataclasses.asdict(case), "description": case.describe(),
                     "visible_fraction": features.visible_fraction(case),
                     "results": {i: {"note": note} for i in impls}, "output_check": {}}
            entry["ratios"] = features.ratios(entry)
            measured.append(entry)
        try:
            _free(torch)
        except Exception:  # noqa: BLE001
            pass
    progress.close()
    return {"meta": {**features.meta(), "seconds": round(time.perf_counter() - t0, 1)},
            "implementations": impls, "cases": measured}


if __name__ == "__main__":
    sys.exit(main())
