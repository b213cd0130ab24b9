"""cuflash: exact FlashAttention for NVIDIA GPUs.

CUDA kernels compiled at run time by NVRTC, behind a framework-neutral API over DLPack arrays
(CuPy, JAX, PyTorch). ``import cuflash`` needs no GPU and never imports torch or jax; the first
GPU call compiles (or loads from the disk cache) the kernels it launches.

    out = cuflash.attention(q, k, v, causal=True)
    out, lse = cuflash.attention_forward(q, k, v)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse)
    out = cuflash.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)   # packed sequences
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new)   # decoding

Framework adapters: ``cuflash.interop.jax`` and ``cuflash.interop.torch``. The float64 oracle:
``cuflash.reference``.
"""
from . import reference
from .api import (
    attention,
    attention_backward,
    attention_forward,
    backward_workspace,
    prepare,
)
from .kvcache import attention_with_kvcache, kvcache_workspace, prepare_kvcache
from .varlen import (
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
    varlen_backward_workspace,
    varlen_prepare,
)

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "backward_workspace",
    "prepare",
    "varlen_attention",
    "varlen_attention_forward",
    "varlen_attention_backward",
    "varlen_backward_workspace",
    "varlen_prepare",
    "attention_with_kvcache",
    "kvcache_workspace",
    "prepare_kvcache",
    "reference",
]
