"""Reading and writing safetensors files with numpy alone (numpy has no bfloat16 or fp8:
such tensors travel as their raw bits, with the dtype name beside them)."""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Callable, NamedTuple, Tuple

import numpy as np

_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


class LazyTensor(NamedTuple):
    """A tensor write_safetensors computes only as it writes it (`make()`: the array of its raw
    bits), so that a checkpoint's outputs need not all be in memory at once."""
    dtype: str
    shape: Tuple[int, ...]
    make: Callable[[], np.ndarray]


def write_safetensors(path: str, tensors: dict) -> None:
    """tensors: name -> np.ndarray, a (safetensors dtype name, array of its raw bits) pair, or a
    LazyTensor. Each is written as it comes, none copied whole."""
    plain = {np.float32: "F32", np.float16: "F16"}
    entries, header, offset = [], {}, 0
    for name, value in tensors.items():
        if isinstance(value, LazyTensor):
            dtype, shape, make = value
        else:
            dtype, arr = value if isinstance(value, tuple) else (plain[value.dtype.type], value)
            shape, make = arr.shape, (lambda arr=arr: arr)
        size = math.prod(shape) * np.dtype(_NUMPY[dtype]).itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        entries.append((name, tuple(shape), size, make))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned
    # Into a file of its own, renamed when whole: a tensor that fails to come out leaves no
    # truncated file where the checkpoint's goes.
    partial = os.fspath(path) + ".partial"
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for name, shape, size, make in entries:
                arr = np.asarray(make())
                if arr.shape != shape or arr.nbytes != size:
                    raise ValueError(f"{path}: tensor '{name}' came out {arr.shape}, {arr.nbytes} bytes, not {shape}, "
                                     f"{size}")
                f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise


def _check_coverage(path: str, header: dict, data_bytes: int) -> None:
    """The tensors' byte ranges, in order, tile the data section exactly, as safetensors' own
    reader (and the C++ loader) requires: shared bytes would alias weights, and bytes no tensor
    claims mean a header entry is missing (a tensor named twice keeps one of its entries)."""
    spans = sorted((tuple(e["data_offsets"]), name) for name, e in header.items() if name != "__metadata__")
    at = 0
    for (begin, end), name in spans:
        if begin < at:
            raise ValueError(f"{path}: tensor '{name}' [{begin}, {end}) overlaps the tensor before it")
        if begin > at:
            raise ValueError(f"{path}: data section bytes [{at}, {begin}) before tensor '{name}' belong to no "
                             f"tensor (a header entry missing, or a tensor named twice)")
        at = end
    if at != data_bytes:
        raise ValueError(f"{path}: data section bytes [{at}, {data_bytes}) at its end belong to no tensor (a "
                         f"header entry missing, or a tensor named twice)")


def _is_size(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(path: str, name: str, entry, data_bytes: int) -> None:
    """One header entry names a known dtype, a shape and byte offsets inside the data section
    that hold exactly that many elements, as the C++ loader checks it."""
    where = f"{path}: tensor '{name}': "
    if not isinstance(entry, dict):
        raise ValueError(where + "header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _NUMPY:
        raise ValueError(where + f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise ValueError(where + '"shape" must be a list of non-negative integers')
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets):
        raise ValueError(where + '"data_offsets" must be two non-negative integers [begin, end]')
    begin, end = offsets
    if begin > end:
        raise ValueError(where + f"data_offsets [{begin}, {end}) end before they begin")
    if end > data_bytes:
        raise ValueError(where + f"data_offsets [{begin}, {end}) run past the end of the data section ({data_bytes} "
                         "bytes): the file is truncated or the offsets are out of range")
    needed = math.prod(shape) * np.dtype(_NUMPY[dtype]).itemsize
    if needed != end - begin:
        raise ValueError(where + f"shape {shape} of dtype {dtype} needs {needed} bytes but data_offsets give "
                         f"{end - begin}")


def read_safetensors(path: str, mapped: bool = False) -> dict:
    """name -> (safetensors dtype name, np.ndarray of the stored values or raw bits). A
    malformed file is a ValueError naming it (and the tensor at fault). `mapped`: the arrays
    are views of the file mapped read-only, read from disk as they are used (the file must
    then stay as it is while they live)."""
    if mapped and os.path.getsize(path) >= 8:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    else:
        with open(path, "rb") as f:
            data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: file is {len(data)} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    if length > len(data) - 8:
        raise ValueError(f"{path}: bad header length {length}: only {len(data) - 8} bytes follow it (truncated, or "
                         "not a safetensors file)")
    try:
        header = json.loads(bytes(data[8:8 + length]))
    except ValueError as e:  # also bytes that are not UTF-8
        raise ValueError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data_bytes = len(data) - 8 - length
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, data_bytes)
    _check_coverage(path, header, data_bytes)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_NUMPY[entry["dtype"]])
        raw = np.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=8 + length + begin)
        out[name] = (entry["dtype"], raw.reshape(entry["shape"]))
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bfloat16 (nearest even), as uint16 bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def as_float32(dtype: str, arr: np.ndarray) -> np.ndarray:
    """A stored F32, F16 or BF16 tensor as float32."""
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype in ("F32", "F16"):
        return arr.astype(np.float32)
    raise ValueError(f"expected a float tensor, got {dtype}")
