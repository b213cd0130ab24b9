"""The numpy mirror of ``AttnParams`` (cuda_src/cuflash/params.cuh), built by reading that header.

The header is the single source of truth for the field order; the build layer passes this mirror's
size to every compile (``-DCUFLASH_PARAMS_BYTES``), and a ``static_assert`` there fails the build if
the two ever disagree. A size-1 structured array is passed to a kernel by value.
"""
from __future__ import annotations

import functools
import re

import numpy as np

from . import sources

# C type of a declaration -> numpy type of the mirror field (pointers travel as 64-bit integers).
_SCALAR_TYPES = {"long long": np.int64, "int": np.int32, "unsigned": np.uint32, "float": np.float32}
_DECLARATION = re.compile(
    r"^\s*(const\s+)?(void|float|long long|int|unsigned char|unsigned long long|unsigned)\s*(\*?)\s*([^;]+);")


def _fields_of(header: str) -> list:
    body = header.split("struct AttnParams {", 1)[1].split("};", 1)[0]
    fields = []
    for line in body.splitlines():
        line = line.split("//", 1)[0]
        match = _DECLARATION.match(line)
        if not match:
            continue
        _, ctype, pointer, names = match.groups()
        np_type = np.uint64 if pointer else _SCALAR_TYPES[ctype]
        for name in names.split(","):
            name = name.strip().lstrip("*").strip()
            fields.append((name, np_type))
    return fields


@functools.lru_cache(maxsize=1)
def params_dtype() -> np.dtype:
    """Structured dtype laid out exactly like the C struct (natural alignment)."""
    header = (sources.source_dir() / "cuflash" / "params.cuh").read_text()
    return np.dtype(_fields_of(header), align=True)


def pointer_fields() -> tuple:
    return tuple(name for name in params_dtype().names if params_dtype()[name] == np.uint64)


def new_params() -> np.ndarray:
    """A zeroed size-1 params block: every pointer null, every stride 0."""
    return np.zeros(1, dtype=params_dtype())
