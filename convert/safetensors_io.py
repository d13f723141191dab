"""A minimal, torch-free reader for `.safetensors` files.

File layout (https://github.com/huggingface/safetensors):

    8 bytes    little-endian uint64 N, the header length
    N bytes    JSON header: {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [b, e]},
                             "__metadata__": {...}}   (offsets relative to the data region)
    rest       the raw tensor bytes, row-major, little-endian

`SafetensorsFile` parses and validates the header eagerly (so a corrupt or truncated file is
refused before any conversion work starts) and hands out tensors as read-only `np.memmap` views:
nothing is read into memory until a tensor's bytes are touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype tag -> numpy dtype (little-endian). Only float types: model weights.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A `.safetensors` file is unreadable, corrupt or truncated; the message names the file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """Header of one `.safetensors` file plus lazy, memory-mapped access to its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._mmap: np.memmap | None = None
        self._parse_header()

    # ------------------------------------------------------------------------------ header
    def _fail(self, what: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: {what}")

    def _parse_header(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(f"not a safetensors file (only {size} bytes, no header length)")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise self._fail(
                        f"corrupt or truncated safetensors file: header length {n} but the file has "
                        f"{size} bytes")
                raw = f.read(n)
        except OSError as e:
            raise self._fail(f"cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"corrupt safetensors header (not valid JSON: {e})") from None
        if not isinstance(header, dict):
            raise self._fail("corrupt safetensors header (not a JSON object)")

        data_start = 8 + n
        data_len = size - data_start
        meta = header.pop("__metadata__", None) or {}
        self.metadata = dict(meta) if isinstance(meta, dict) else {}
        for name, entry in header.items():
            self.tensors[name] = self._check_entry(name, entry, data_start, data_len)

    def _check_entry(self, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._fail(f"corrupt safetensors header: entry for tensor {name!r} lacks "
                             "dtype/shape/data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            raise self._fail(f"corrupt safetensors header: bad shape {shape!r} or data_offsets "
                             f"{offsets!r} for tensor {name!r}")
        begin, end = offsets
        if end > data_len:
            raise self._fail(
                f"truncated or corrupt file: tensor {name!r} needs bytes [{begin}, {end}) of the data "
                f"region but it holds only {data_len} bytes")
        if dtype in DTYPES and (end - begin) != math.prod(shape) * DTYPES[dtype].itemsize:
            raise self._fail(
                f"corrupt safetensors header: tensor {name!r} ({dtype}{shape}) spans {end - begin} "
                f"bytes, expected {math.prod(shape) * DTYPES[dtype].itemsize}")
        return TensorInfo(name, str(dtype), tuple(shape), data_start + begin, data_start + end)

    # ----------------------------------------------------------------------------- tensors
    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """A read-only array view of tensor `name` (memory-mapped, not copied)."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise self._fail(f"tensor {name!r} has dtype {info.dtype}; supported: {', '.join(DTYPES)}")
        dtype = DTYPES[info.dtype]
        if info.end == info.begin:
            return np.zeros(info.shape, dtype)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[info.begin:info.end].view(dtype).reshape(info.shape)

    def close(self) -> None:
        self._mmap = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes numpy arrays as a `.safetensors` file (test fixtures; the inverse of the reader)."""
    tags = {v: k for k, v in DTYPES.items()}
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "np"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in tags:
            raise ValueError(f"{name}: dtype {arr.dtype} has no safetensors tag")
        header[name] = {"dtype": tags[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(arr.tobytes())
