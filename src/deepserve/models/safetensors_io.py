"""A minimal, deterministic safetensors writer (numpy only, so no torch is needed to make the tiny model).

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_ST_DTYPES = {np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the raw 16-bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write TENSORS (uint16 arrays are taken as bf16 bit patterns; float32 and int32 as they are) in sorted name
    order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        array = tensors[name]
        size = array.nbytes
        header[name] = {
            "dtype": _ST_DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name in sorted(tensors):
            out.write(np.ascontiguousarray(tensors[name]).astype(tensors[name].dtype.newbyteorder("<")).tobytes())
