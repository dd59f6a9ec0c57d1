"""A safetensors file written one tensor at a time.

`safetensors.numpy.save_file` takes every tensor at once, contiguous and in its final
dtype, so an export would hold a second copy of the model beside the restored one. The
format is simple enough to stream: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the bytes in that order. Here each
tensor (possibly a transposed view) is made contiguous and cast only while it is
written, so the writer's extra memory is one tensor.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
               np.dtype(np.float16): "F16", np.dtype(np.int32): "I32"}


def nbytes(tensor: np.ndarray, dtype: np.dtype) -> int:
  """Bytes `tensor` takes in the file when written as `dtype`."""
  return math.prod(tensor.shape) * np.dtype(dtype).itemsize


def write(path: str, tensors: Mapping[str, np.ndarray], dtype: np.dtype,
          metadata: Mapping[str, str]) -> None:
  """Writes `tensors` (in order, each cast to `dtype`) as the safetensors file `path`."""
  dtype = np.dtype(dtype)
  header: dict = {"__metadata__": dict(metadata)}
  offset = 0
  for name, tensor in tensors.items():
    size = nbytes(tensor, dtype)
    header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(tensor.shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)   # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for tensor in tensors.values():
      f.write(np.ascontiguousarray(tensor, dtype=dtype).tobytes())
