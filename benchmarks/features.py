"""The features table of ``python -m cuflash bench --features`` (or ``--features-only``): masks and bias.

Loaded by ``benchmarks/bench.py`` (which owns the timer, the progress bar, the CLI and the JSON file); this
module holds the cases, the masks, the visible fractions, the peers and the table. bf16, like the grid.

Cases (the issue's, with its targets; the peer figures are the issue's H100 numbers, fwd / fwd+bwd):

1. block-causal VLA: B2 S1024 H8 Hkv1 D256, ``block_ids`` with boundaries at 256/512/768 (ids 0..3, the same
   in every batch row), attend iff ``k_id <= q_id``. Target >= 3x FlexAttention (170 / 37).
2. document-causal: B4 S4096 H16 D128, 8 documents of unequal lengths per batch row (a fixed seed),
   ``causal=True`` + ``segment_ids``. Target >= 2x Flex (177 / 147).
3. sliding window 1024 + causal: B4 S4096 H16 D128, ``window=(1024, 0), causal=True``: query i sees key j iff
   ``0 <= i - j <= 1024`` (1025 keys; FlexAttention's ``q_idx - kv_idx <= 1024`` with ``q_idx >= kv_idx``).
   Target >= 1.5x Flex (293 / 267).
4. block-causal: B4 S4096 H16 D128, ``block_ids`` in blocks of 512. Target >= 1.2x Flex (377 / 365).
5. learnable bias with its gradient: B2 H16 S2048 D128, a (B, H, S, S) bf16 ``bias``; the forward+backward
   also returns dbias. Target >= 3x SDPA memory-efficient (124 / 111).
6. plain causal: B4 S4096 H16 D128, the reference row (issue's Flex 353 / 342; no target).

Useful FLOPs: the dense count ``4 B H S^2 D`` (never halved) times the visible fraction, computed exactly on
the host from the very predicate FlexAttention gets as its ``mask_mod`` (fraction 1 for the bias case;
``(S+1)/(2S)`` for plain causal, where the grid's convention says 1/2); forward+backward 3.5x the forward.

Implementations (each cell that cannot run says ``n/a``, or ``n/i`` when cuflash raises NotImplementedError;
the reason goes to the notes and the JSON; a failure never stops the table):

- ``cuflash``: ``attention_forward`` / ``attention_backward`` with the case's options (``block_ids``,
  ``segment_ids``, ``window``, ``causal``, ``bias``), on the same tensors (zero-copy, torch's stream).
- ``flex``: ``torch.compile(flex_attention, dynamic=False)``, the ``BlockMask`` built once per case by
  ``create_block_mask`` outside the timed region, ``enable_gqa=True`` for the MQA case, the bias as a
  ``score_mod`` reading a captured (B, H, S, S) tensor (its gradient requested in forward+backward).
  Layout (B, H, S, D), contiguous copies made once.
- ``sdpa-efficient`` / ``sdpa-cudnn``: ``scaled_dot_product_attention`` under ``sdpa_kernel(EFFICIENT_ATTENTION)``
  / ``sdpa_kernel(CUDNN_ATTENTION)`` with an explicit boolean ``attn_mask`` (B or 1, 1, S, S) built once from
  the same predicate; ``is_causal=True`` for plain causal; the bias case passes the bias as ``attn_mask``
  (requiring grad in forward+backward). GQA/MQA through ``enable_gqa=True``; a backend that refuses it gets
  k/v repeated to H heads (outside the timed region; said in the notes).
"""
from __future__ import annotations

import dataclasses
import re
import time
import warnings

import numpy as np

#: Implementations in table order: (key, short label).
IMPLS = (
    ("cuflash", "cuflash"),
    ("flex", "Flex"),
    ("sdpa-efficient", "SDPA-eff"),
    ("sdpa-cudnn", "SDPA-cuDNN"),
)
MODES = ("fwd", "fwd_bwd")
PEER_LABELS = {"flex": "Flex", "sdpa-efficient": "SDPA-eff", "sdpa-cudnn": "SDPA-cuDNN"}
NOT_IMPLEMENTED = "not implemented"
#: Dynamo's per-function recompile limit (default 8) would send FlexAttention back to eager mode (slow,
#: O(S^2) memory) after a few cases x modes; the features table raises it to this.
RECOMPILE_LIMIT = 64


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int
    S: int
    H: int
    Hkv: int
    D: int
    causal: bool = False
    window: tuple | None = None  # (left, right), cuflash's semantics
    blocks: tuple = ()  # block_ids: the positions where a new block starts (ids 0, 1, ...)
    documents: int = 0  # segment_ids: this many documents per batch row, unequal lengths
    seed: int = 0  # of the document lengths
    bias: bool = False  # a learnable (B, H, S, S) bias, with dbias in forward+backward
    target_peer: str | None = None  # "flex" or "sdpa-efficient"
    target: float | None = None  # cuflash / target_peer at least this (both modes)
    issue: tuple | None = None  # the issue's peer TFLOPS (fwd, fwd_bwd), for information

    def dense_flops(self, mode: str) -> float:
        fwd = 4.0 * self.B * self.H * self.S * self.S * self.D
        return fwd * (3.5 if mode == "fwd_bwd" else 1.0)

    def flops(self, mode: str, fraction: float) -> float:
        """Useful FLOPs: the dense count times the visible fraction."""
        return self.dense_flops(mode) * fraction

    def describe(self) -> str:
        parts = [f"B={self.B} S={self.S} H={self.H} Hkv={self.Hkv} D={self.D}"]
        if self.causal:
            parts.append("causal=True")
        if self.window is not None:
            parts.append(f"window={tuple(self.window)}")
        if self.blocks:
            parts.append(f"block_ids (blocks start at {', '.join(map(str, self.blocks))})")
        if self.documents:
            parts.append(f"segment_ids ({self.documents} documents per row, seed {self.seed})")
        if self.bias:
            parts.append("bias (B, H, S, S) with dbias")
        return ", ".join(parts)


def all_cases() -> list:
    return [
        Case("blockcausal-VLA-B2-S1k-H8/1-D256", 2, 1024, 8, 1, 256, blocks=(256, 512, 768),
             target_peer="flex", target=3.0, issue=(170, 37)),
        Case("doc-causal-8docs-B4-S4k-H16-D128", 4, 4096, 16, 16, 128, causal=True, documents=8, seed=2026,
             target_peer="flex", target=2.0, issue=(177, 147)),
        Case("window1024-causal-B4-S4k-H16-D128", 4, 4096, 16, 16, 128, causal=True, window=(1024, 0),
             target_peer="flex", target=1.5, issue=(293, 267)),
        Case("blockcausal512-B4-S4k-H16-D128", 4, 4096, 16, 16, 128, blocks=tuple(range(512, 4096, 512)),
             target_peer="flex", target=1.2, issue=(377, 365)),
        Case("bias-grad-B2-S2k-H16-D128", 2, 2048, 16, 16, 128, bias=True,
             target_peer="sdpa-efficient", target=3.0, issue=(124, 111)),
        Case("causal-B4-S4k-H16-D128", 4, 4096, 16, 16, 128, causal=True, target_peer="flex", issue=(353, 342)),
    ]


def select_cases(patterns: str | None) -> list:
    cases = all_cases()
    if patterns:
        regexes = [re.compile(p.strip()) for p in patterns.split(",") if p.strip()]
        cases = [c for c in cases if any(r.search(c.name) for r in regexes)]
    return cases


# --------------------------------------------------------------------------------------------
# Ids, predicates, visible fractions (host side, numpy; the same predicate runs on torch for the peers)
# --------------------------------------------------------------------------------------------

def document_lengths(case: Case) -> np.ndarray:
    """(B, documents) int lengths summing to S: cut points drawn from ``case.seed``, redrawn until the
    documents are all at least 128 tokens long and pairwise unequal. Deterministic."""
    rng = np.random.default_rng(case.seed)
    rows = []
    for _ in range(case.B):
        while True:
            cuts = np.sort(rng.choice(np.arange(1, case.S), case.documents - 1, replace=False))
            lengths = np.diff(np.concatenate(([0], cuts, [case.S])))
            if lengths.min() >= 128 and len(set(lengths.tolist())) == case.documents:
                break
        rows.append(lengths)
    return np.array(rows, dtype=np.int64)


def block_lengths(case: Case) -> np.ndarray:
    edges = np.array((0,) + tuple(case.blocks) + (case.S,))
    return np.diff(edges)


def host_ids(case: Case):
    """``(segment_ids, block_ids)``, each a (B, S) int32 numpy array or None (q and k share them: Sq = Sk)."""
    pos = np.arange(case.S)
    segment = block = None
    if case.documents:
        segment = np.stack([np.repeat(np.arange(case.documents), row) for row in document_lengths(case)])
        segment = segment.astype(np.int32)
    if case.blocks:
        row = np.searchsorted(np.array(case.blocks), pos, side="right")
        block = np.broadcast_to(row, (case.B, case.S)).astype(np.int32)
    return segment, block


def mask_mod(case: Case, segment=None, block=None):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for the case, or None when every key is
    visible. Written with ``&``, ``==``, ``<=``, ``-`` and indexing only, so that it runs on torch scalars
    (Flex), torch or numpy broadcast index arrays (SDPA's mask, the host's fraction). ``segment`` / ``block``:
    the (B, S) ids (numpy or torch). Sq = Sk, so bottom-right and top-left alignment agree."""
    left, right = case.window if case.window is not None else (None, None)
    if case.causal:
        right = 0 if right is None else min(right, 0)
    conditions = []
    if right is not None:
        conditions.append(lambda b, h, q, kv: kv - q <= right)
    if left is not None:
        conditions.append(lambda b, h, q, kv: q - kv <= left)
    if case.documents:
        if segment is None:
            raise ValueError(f"{case.name} needs its segment ids")
        conditions.append(lambda b, h, q, kv: segment[b, q] == segment[b, kv])
    if case.blocks:
        if block is None:
            raise ValueError(f"{case.name} needs its block ids")
        conditions.append(lambda b, h, q, kv: block[b, kv] <= block[b, q])
    if not conditions:
        return None

    def mod(b, h, q, kv):
        result = conditions[0](b, h, q, kv)
        for condition in conditions[1:]:
            result = result & condition(b, h, q, kv)
        return result

    return mod


def visible_counts(case: Case, rows: int = 512) -> np.ndarray:
    """(B,) number of visible (query, key) pairs per batch row, from ``mask_mod`` on the host."""
    mod = mask_mod(case, *host_ids(case))
    if mod is None:
        return np.full(case.B, case.S * case.S, dtype=np.int64)
    kv = np.arange(case.S)[None, :]
    counts = np.zeros(case.B, dtype=np.int64)
    for b in range(case.B):
        for start in range(0, case.S, rows):
            q = np.arange(start, min(case.S, start + rows))[:, None]
            counts[b] += int(np.broadcast_to(mod(b, 0, q, kv), (q.shape[0], case.S)).sum())
    return counts


def visible_fraction(case: Case) -> float:
    """Exact fraction of the B x S x S (query, key) pairs that attend (the same for every head)."""
    return float(visible_counts(case).sum()) / (case.B * case.S * case.S)


def closed_form_fraction(case: Case) -> float:
    """The same fraction from the block / document lengths and window arithmetic (a cross-check of
    :func:`visible_fraction`; covers the six cases' kinds)."""
    S = case.S
    if case.bias and not (case.causal or case.window or case.blocks or case.documents):
        return 1.0
    if case.blocks and not (case.causal or case.window or case.documents):
        lengths = block_lengths(case)
        return float((lengths * np.cumsum(lengths)).sum()) / (S * S)
    if case.documents and case.causal and case.window is None and not case.blocks:
        lengths = document_lengths(case)
        return float((lengths * (lengths + 1) // 2).sum()) / (case.B * S * S)
    if case.causal and case.window is not None and case.window[1] in (0, None) and not (case.blocks or case.documents):
        left = case.window[0]
        return (left * (left + 1) / 2 + (S - left) * (left + 1)) / (S * S)
    if case.causal and case.window is None and not (case.blocks or case.documents):
        return S * (S + 1) / 2 / (S * S)
    raise NotImplementedError(f"no closed form for {case.name}")


def cuflash_options(case: Case, segment=None, block=None, bias=None) -> dict:
    """The keyword arguments cuflash gets for the case (ids: (B, S) arrays of any kind, shared by q and k)."""
    options: dict = {"causal": case.causal}
    if case.window is not None:
        options["window"] = tuple(case.window)
    if case.documents:
        options["segment_ids"] = (segment, segment)
    if case.blocks:
        options["block_ids"] = (block, block)
    if case.bias:
        options["bias"] = bias
    return options


# --------------------------------------------------------------------------------------------
# Per-case device data (built once per case, outside every timed region)
# --------------------------------------------------------------------------------------------

class CaseData:
    """Ids, mask and bias of one case on the GPU, made lazily once and shared by the implementations."""

    def __init__(self, case: Case, x, torch):
        self.case, self.x, self.torch = case, x, torch
        self.segment, self.block = host_ids(case)
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def cupy_ids(self):
        import cupy

        return self._get("cupy_ids", lambda: tuple(None if a is None else cupy.asarray(np.ascontiguousarray(a))
                                                   for a in (self.segment, self.block)))

    def torch_ids(self):
        torch = self.torch
        return self._get("torch_ids", lambda: tuple(
            None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to("cuda")
            for a in (self.segment, self.block)))

    def sdpa_mask(self):
        """Boolean (B or 1, 1, S, S) attn_mask (True = attend) from the Flex predicate, or None."""
        def make():
            torch = self.torch
            mod = mask_mod(self.case, *self.torch_ids())
            if mod is None:
                return None
            S = self.case.S
            b = torch.arange(self.case.B, device="cuda")[:, None, None, None]
            q = torch.arange(S, device="cuda")[None, None, :, None]
            kv = torch.arange(S, device="cuda")[None, None, None, :]
            return mod(b, 0, q, kv).contiguous()

        return self._get("sdpa_mask", make)

    def bias(self):
        """The (B, H, S, S) bf16 bias (torch when installed, else CuPy): random normal, no grad."""
        def make():
            c = self.case
            shape = (c.B, c.H, c.S, c.S)
            if self.torch is not None:
                gen = self.torch.Generator(device="cuda").manual_seed(7)
                return self.torch.randn(shape, device="cuda", dtype=self.torch.bfloat16, generator=gen)
            import cupy
            import ml_dtypes

            rng = np.random.default_rng(7)
            return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))

        return self._get("bias", make)


# --------------------------------------------------------------------------------------------
# Implementations: each returns {"fwd": fn, "fwd_bwd": fn} (optionally "_note") or raises
# --------------------------------------------------------------------------------------------

class Unavailable(Exception):
    """This implementation cannot run this case (the message says why)."""


def _cuflash(case: Case, data: CaseData, torch):
    import cupy

    import cuflash

    x = data.x
    stream = torch.cuda.current_stream().cuda_stream if x.torch else None
    q, k, v, dout = x.cq, x.ck, x.cv, x.cdout
    bias = None
    if case.bias:
        bias = data.bias()
        bias = cupy.from_dlpack(bias) if not isinstance(bias, cupy.ndarray) else bias
    options = cuflash_options(case, *data.cupy_ids(), bias=bias)
    try:  # compile ahead where the API knows the options; otherwise the first (untimed) call compiles
        cuflash.prepare(q, k, v, backward=True, **options)
    except Exception:  # noqa: BLE001 - the first call reports what is wrong
        pass

    def fwd():
        return cuflash.attention_forward(q, k, v, stream=stream, **options)

    def fwd_bwd():
        out, lse = cuflash.attention_forward(q, k, v, stream=stream, **options)
        return cuflash.attention_backward(dout, q, k, v, out, lse, stream=stream, **options)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


_FLEX: dict = {}


def _raise_recompile_limit(torch) -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            try:
                setattr(config, name, max(int(getattr(config, name)), RECOMPILE_LIMIT))
            except Exception:  # noqa: BLE001 - a deprecated alias may refuse; the other one holds
                pass


def _flex_attention(torch):
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _raise_recompile_limit(torch)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _flex(case: Case, data: CaseData, torch):
    x = data.x
    if not x.torch:
        raise Unavailable("torch is not installed")
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"torch.nn.attention.flex_attention is not importable ({type(exc).__name__})") from None
    flex = _flex_attention(torch)
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (x.q, x.k, x.v, x.dout))  # (B, H, S, D)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    mod = mask_mod(case, *data.torch_ids())
    block_mask = None
    if mod is not None:
        per_batch = bool(case.documents)  # ids that differ between batch rows
        block_mask = create_block_mask(mod, case.B if per_batch else None, None, case.S, case.S, device="cuda")
    gqa = {"enable_gqa": True} if case.Hkv != case.H else {}
    score_mod = score_mod_grad = None
    bias_g = None
    if case.bias:
        bias = data.bias()
        bias_g = bias.detach().clone().requires_grad_()

        def score_mod(score, b, h, qi, kv):
            return score + bias[b, h, qi, kv]

        def score_mod_grad(score, b, h, qi, kv):
            return score + bias_g[b, h, qi, kv]

    def fwd():
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, **gqa)

    inputs = (qg, kg, vg) + ((bias_g,) if bias_g is not None else ())

    def fwd_bwd():
        out = flex(qg, kg, vg, score_mod=score_mod_grad, block_mask=block_mask, **gqa)
        return torch.autograd.grad(out, inputs, dout)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "_layout": "bhsd"}


def _sdpa(backend_name: str):
    def make(case: Case, data: CaseData, torch):
        x = data.x
        if not x.torch:
            raise Unavailable("torch is not installed")
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, backend_name)
        q, k, v, dout = (t.transpose(1, 2) for t in (x.q, x.k, x.v, x.dout))  # (B, H, S, D) views
        kwargs: dict = {}
        plain_causal = case.causal and case.window is None and not (case.blocks or case.documents)
        if case.bias:
            kwargs["attn_mask"] = data.bias()
        elif plain_causal:
            kwargs["is_causal"] = True
        else:
            kwargs["attn_mask"] = data.sdpa_mask()
        note = None
        if case.Hkv != case.H:
            try:
                with sdpa_kernel(backend):
                    sdpa(q, k, v, enable_gqa=True, **kwargs)
                torch.cuda.synchronize()
                kwargs["enable_gqa"] = True
            except Exception as exc:  # noqa: BLE001 - fall back to k/v repeated to H heads (made once here)
                group = case.H // case.Hkv
                k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
                note = (f"k/v repeated to {case.H} heads outside the timed region (enable_gqa=True refused: "
                        f"{_reason(exc)})")
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        grad_kwargs = dict(kwargs)
        inputs = (qg, kg, vg)
        if case.bias:
            grad_kwargs["attn_mask"] = kwargs["attn_mask"].detach().clone().requires_grad_()
            inputs += (grad_kwargs["attn_mask"],)

        def fwd():
            with sdpa_kernel(backend):
                return sdpa(q, k, v, **kwargs)

        def fwd_bwd():
            with sdpa_kernel(backend):
                out = sdpa(qg, kg, vg, **grad_kwargs)
            return torch.autograd.grad(out, inputs, dout)

        fns = {"fwd": fwd, "fwd_bwd": fwd_bwd, "_layout": "bhsd"}
        if note:
            fns["_note"] = note
        return fns

    return make


MAKERS = {
    "cuflash": _cuflash,
    "flex": _flex,
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
}

#: How each peer is called, for the JSON's meta and the table's footer.
PEER_NOTES = {
    "flex": "FlexAttention under torch.compile(dynamic=False), BlockMask from create_block_mask built once "
            "outside the timed region; enable_gqa=True for GQA/MQA; bias as a score_mod over a captured tensor",
    "sdpa-efficient": "SDPA EFFICIENT_ATTENTION, explicit bool attn_mask (B|1, 1, S, S); is_causal=True for "
                      "plain causal; the bias case: attn_mask=bias (requires_grad in fwd+bwd)",
    "sdpa-cudnn": "SDPA CUDNN_ATTENTION, same arguments as sdpa-efficient",
}


def installed_peers(torch, no_peers: bool, only: str | None) -> list:
    """``flex``, ``sdpa-efficient``, ``sdpa-cudnn`` where torch has them; ``only`` filters like the grid's
    ``--peers`` (full names, or the part after the dash: efficient, cudnn)."""
    if no_peers or torch is None:
        return []
    peers = []
    try:
        import torch.nn.attention.flex_attention  # noqa: F401

        peers.append("flex")
    except Exception:  # noqa: BLE001
        pass
    peers += ["sdpa-efficient", "sdpa-cudnn"]
    if only:
        wanted = {p.strip() for p in only.split(",") if p.strip()}
        peers = [p for p in peers if p in wanted or p.split("-", 1)[-1] in wanted]
    return peers


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------

def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _failure(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return f"{NOT_IMPLEMENTED}: {_reason(exc)}"
    return "n/a: " + _reason(exc)


def _as_bshd(out, layout):
    out = out[0] if isinstance(out, tuple) else out
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return out.contiguous() if hasattr(out, "contiguous") else out


def _sync(torch):
    if torch is not None:
        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.Device().synchronize()


def measure_case(case: Case, impls: list, timer, torch, progress, make_inputs, relative_difference) -> dict:
    """Times every implementation on one case, forward and forward+backward. ``timer`` is the grid's
    ``Timer``; ``make_inputs`` / ``relative_difference`` the grid's helpers. Never raises for a peer."""
    fraction = visible_fraction(case)
    x = make_inputs(case, torch)
    data = CaseData(case, x, torch)
    results: dict = {}
    outputs: dict = {}
    for impl in impls:
        entry = results.setdefault(impl, {})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fns = MAKERS[impl](case, data, torch)
                layout = fns.pop("_layout", "bshd")
                if "_note" in fns:
                    entry["call_note"] = fns.pop("_note")
                t0 = time.perf_counter()
                out = fns["fwd"]()
                _sync(torch)
                entry["first_call_s"] = round(time.perf_counter() - t0, 3)
                outputs[impl] = _as_bshd(out, layout)
        except Exception as exc:  # noqa: BLE001 - reported in its cell, never fatal
            entry["note"] = _failure(exc)
            if isinstance(exc, NotImplementedError):
                entry["not_implemented"] = True
            for _ in MODES:
                progress.step(f"{case.name} {impl} n/a")
            continue
        for mode in MODES:
            progress.step(f"{case.name} {impl} {mode}")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if mode != "fwd":  # compile outside the timing (torch.compile of the backward, ...)
                        t0 = time.perf_counter()
                        fns[mode]()
                        _sync(torch)
                        entry[f"{mode}_first_call_s"] = round(time.perf_counter() - t0, 3)
                    ms = timer.cuda(fns[mode])
                entry[f"{mode}_ms"] = round(ms, 4)
                entry[f"{mode}_tflops"] = round(case.flops(mode, fraction) / (ms * 1e-3) / 1e12, 1)
            except Exception as exc:  # noqa: BLE001
                entry[f"{mode}_note"] = _failure(exc)
                if isinstance(exc, NotImplementedError):
                    entry[f"{mode}_not_implemented"] = True
        del fns
    check = {}
    if "cuflash" in outputs:
        for peer in ("flex", "sdpa-efficient", "sdpa-cudnn"):
            if peer in outputs:
                try:
                    check = {"against": peer, "relative_difference": round(
                        relative_difference(outputs["cuflash"], outputs[peer]), 5)}
                except Exception as exc:  # noqa: BLE001
                    check = {"against": peer, "note": _reason(exc)}
                break
    del x, data, outputs
    entry = {**dataclasses.asdict(case), "description": case.describe(), "visible_fraction": round(fraction, 6),
             "dense_flops_fwd": case.dense_flops("fwd"), "flops_fwd": case.flops("fwd", fraction),
             "flops_fwd_bwd": case.flops("fwd_bwd", fraction), "results": results, "output_check": check}
    if case.documents:
        entry["document_lengths"] = document_lengths(case).tolist()
    entry["ratios"] = ratios(entry)
    return entry


# --------------------------------------------------------------------------------------------
# Ratios and the table
# --------------------------------------------------------------------------------------------

def _tflops(entry: dict, impl: str, mode: str):
    value = entry["results"].get(impl, {}).get(f"{mode}_tflops")
    return value if isinstance(value, (int, float)) else None


def _best_sdpa(entry: dict, mode: str):
    """(TFLOPS, impl) of the faster SDPA backend that ran, or (None, None)."""
    found = [(v, i) for i in ("sdpa-efficient", "sdpa-cudnn") for v in [_tflops(entry, i, mode)] if v]
    return max(found) if found else (None, None)


def ratios(entry: dict) -> dict:
    """cuflash / Flex, cuflash / best SDPA, cuflash / the target's peer and whether the target is met,
    per mode (None where a side is missing)."""
    out = {}
    for mode in MODES:
        ours = _tflops(entry, "cuflash", mode)
        flex = _tflops(entry, "flex", mode)
        sdpa, sdpa_impl = _best_sdpa(entry, mode)
        peer = entry.get("target_peer")
        peer_value = _tflops(entry, peer, mode) if peer else None
        target_ratio = round(ours / peer_value, 3) if ours and peer_value else None
        target = entry.get("target")
        out[mode] = {
            "cf_over_flex": round(ours / flex, 3) if ours and flex else None,
            "cf_over_sdpa": round(ours / sdpa, 3) if ours and sdpa else None,
            "sdpa_best": sdpa_impl,
            "cf_over_target_peer": target_ratio,
            "target_met": (target_ratio >= target) if target and target_ratio is not None else None,
        }
    return out


def _cell(entry: dict, impl: str, mode: str, width: int) -> str:
    value = _tflops(entry, impl, mode)
    if value is not None:
        return f"{value:>{width}.0f}"
    result = entry["results"].get(impl)
    if result is None:
        return f"{'-':>{width}}"
    if result.get("not_implemented") or result.get(f"{mode}_not_implemented"):
        return f"{'n/i':>{width}}"
    return f"{'n/a':>{width}}"


def _ratio(value) -> str:
    return f"{value:>8.2f}x" if isinstance(value, (int, float)) else f"{'-':>9}"


def table(features: dict) -> str:
    """The features table (forward, then forward+backward) with notes; ``features`` as in the JSON."""
    impls = features["implementations"]
    labels = dict(IMPLS)
    cases = features["cases"]
    lines = ["features (bf16; useful TFLOPS = 4*B*H*S^2*D x visible fraction, fwd+bwd 3.5x; "
             "n/i = cuflash: not implemented, n/a = could not run, see notes)"]
    for mode, title in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
        head = f"{'case (' + title + ', TFLOPS)':40s}{'vis%':>6s}"
        head += "".join(f"{labels[i]:>11s}" for i in impls)
        head += f"{'cf/Flex':>9s}{'cf/SDPA':>9s}{'target':>17s}{'met':>5s}{'issue peer':>16s}"
        lines += [head, "-" * len(head)]
        for c in cases:
            r = (c.get("ratios") or ratios(c))[mode]
            row = f"{c['name']:40s}{100 * c['visible_fraction']:>6.1f}"
            row += "".join(" " + _cell(c, i, mode, 10) for i in impls)
            row += _ratio(r["cf_over_flex"]) + _ratio(r["cf_over_sdpa"])
            peer = c.get("target_peer")
            if c.get("target"):
                got = r["cf_over_target_peer"]
                target = f">={c['target']:.1f}x {PEER_LABELS.get(peer, peer)}"
                met = "-" if got is None else ("yes" if r["target_met"] else "no")
            else:
                target, met = "(reference)", "-"
            issue = c.get("issue")
            issue_text = f"{PEER_LABELS.get(peer, peer)} {issue[MODES.index(mode)]:.0f}" if issue and peer else "-"
            row += f"{target:>17s}{met:>5s}{issue_text:>16s}"
            lines.append(row)
        lines.append("")
    notes = sorted({f"{c['name']} {i}: {v}" for c in cases for i, e in c["results"].items()
                    for k, v in e.items() if k.endswith("note")})
    if notes:
        lines.append("features notes:")
        lines += [f"  {n}" for n in notes[:30]]
        if len(notes) > 30:
            lines.append(f"  ... {len(notes) - 30} more in the JSON")
    checked = [(c["output_check"]["relative_difference"], c["name"], c["output_check"]["against"])
               for c in cases if "relative_difference" in c.get("output_check", {})]
    if checked:
        worst = max(checked)
        lines.append(f"features output check (cuflash forward vs a peer's, relative difference): worst "
                     f"{worst[0]:.2e} in {worst[1]} vs {worst[2]}")
        bad = [f"{name} ({diff:.2e} vs {peer})" for diff, name, peer in checked if diff > 2e-2]
        if bad:
            lines.append("WARNING: cuflash's output differs from the peer's in: " + "; ".join(bad))
    lines.append("peers: " + "; ".join(f"{PEER_LABELS[p]} = {PEER_NOTES[p]}" for p in impls if p in PEER_NOTES))
    return "\n".join(lines)


def measured_anything(features: dict) -> bool:
    return any(_tflops(c, i, m) is not None for c in features["cases"] for i in c["results"] for m in MODES)


def meta() -> dict:
    return {
        "flops": "useful: 4*B*H*S^2*D (dense, never halved) x visible_fraction; fwd+bwd 3.5x fwd",
        "visible_fraction": "exact, counted on the host from the mask_mod FlexAttention gets",
        "peers": PEER_NOTES,
        "targets": "ratios.<mode>.cf_over_target_peer >= target (the issue's); issue = its peer TFLOPS (fwd, fwd_bwd)",
        "not_implemented": "cuflash raised NotImplementedError (shown n/i)",
    }
