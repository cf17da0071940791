"""Argument checks shared by the Python surface: each error names the argument and what it
may be. The runtime takes 32-bit ints and float32 values, so the checks bound ints to its
types and judge floats as float32 rounds them (1e-300 is 0 there, 1e300 infinite)."""
from __future__ import annotations

import math
import numbers
import os
from typing import List

import numpy as np

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_BOUND_TEXT = {INT32_MAX: "2**31 - 1", INT64_MAX: "2**63 - 1"}


def is_int(x) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_int(name: str, value, lo: int, hi: int = INT32_MAX) -> int:
    """value as an int in [lo, hi], else ValueError naming `name`."""
    if not is_int(value) or not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {_BOUND_TEXT.get(hi, hi)}], got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_unicode(name: str, text: str) -> str:
    """text, if it is valid Unicode (UTF-8 holds no lone surrogate, which a Python string
    may), else ValueError naming `name` and the character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: {e.reason} at character {e.start}") from None
    return text


def float32_value(name: str, value) -> float:
    """value as float32 rounds it, finite, else ValueError naming `name`."""
    try:  # an int past float's range overflows
        finite = (is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    with np.errstate(over="ignore"):
        rounded = float(np.float32(value))
    if not math.isfinite(rounded):
        raise ValueError(f"{name} must be a finite float32 (magnitude below 3.4e38), got {value!r}")
    return rounded


def check_float32(name: str, value, lo: float, strict: bool) -> float:
    """A finite value above lo (strict) or at least lo, as float32 rounds it."""
    rounded = float32_value(name, value)
    if not (rounded > lo if strict else rounded >= lo):
        relation = ">" if strict else ">="
        as_f32 = f" (float32 rounds it to {rounded!r})" if rounded != float(value) else ""
        raise ValueError(f"{name} must be a finite number {relation} {lo}, got {value!r}{as_f32}")
    return rounded


def check_path(name: str, value) -> str:
    """value (a str or os.PathLike) as a str without NUL characters that UTF-8 can write (the
    runtime's paths are UTF-8; a name of other bytes comes from os.fsdecode with surrogates),
    else ValueError naming `name`."""
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str) or "\0" in path:
        raise ValueError(f"{name} must be a str or os.PathLike without NUL characters, got {value!r}")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} {path!r} is not valid UTF-8, which the runtime needs of paths: rename it") from None
    return path


def check_encoded(ids: List[int], what: str, vocab_size: int) -> List[int]:
    """Token ids the checkpoint's tokenizer gave for `what`'s text, each in [0, vocab_size),
    else ValueError that blames the tokenizer, not the text: a tokenizer.json with ids past
    the model's vocabulary does not belong to this checkpoint's model (transformers would
    index past its embedding)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # (C loops: this runs on every text prompt)
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise ValueError(f"{what}: the checkpoint's tokenizer encodes this text to token id {bad}, past the model's "
                         f"vocabulary of {vocab_size} ids: its tokenizer.json does not match the model")
    return ids


def iter_once(value) -> bool:
    """Whether value is an iterator (a generator, say): iterating it uses it up."""
    try:
        return iter(value) is value
    except TypeError:
        return False


def check_token_ids(ids, what: str, vocab_size: int) -> np.ndarray:
    """1-D integer token ids as a contiguous int32 array of their own, each in [0, vocab_size),
    else ValueError naming `what` (and the id and its index). The array is a copy, checked
    after copying: the runtime reads it later without the GIL, and an id another thread
    wrote into the caller's array after the check had been read past the embedding."""
    if iter_once(ids):  # (numpy makes a 0-d object array of it: "got dtype object")
        raise ValueError(f"{what}: token ids must be a sequence (a list or an array), got an iterator "
                         f"({type(ids).__name__}): make it a list")
    if np.ma.is_masked(ids):  # (numpy's copy drops the mask: the masked ids would be read)
        raise ValueError(f"{what}: token ids must not hold masked values")
    if isinstance(ids, (list, tuple)):  # numpy takes True beside ints as the id 1
        at = next((i for i, x in enumerate(ids) if isinstance(x, (bool, np.bool_))), None)
        if at is not None:
            raise ValueError(f"{what}: token ids must be integers, got {ids[at]!r} at index {at}")
    try:
        arr = np.array(ids)  # a copy
    except ValueError:  # ragged: a list among the ids (numpy's own message names no index)
        items = list(ids)
        at = next((i for i, x in enumerate(items) if not is_int(x)), 0)
        raise ValueError(f"{what}: token ids must be a 1-D sequence of integers, got {type(items[at]).__name__} "
                         f"at index {at}") from None
    except (TypeError, RuntimeError, NotImplementedError) as e:  # a tensor numpy cannot read (bf16, meta)
        raise ValueError(f"{what}: token ids must be integers, got {getattr(ids, 'dtype', type(ids).__name__)} "
                         f"({e})") from None
    if arr.dtype.kind in "fO" and arr.ndim == 1 and not isinstance(ids, np.ndarray):
        # Python ints past int64 (numpy keeps them as objects), or ints numpy made floats (beside
        # a np.uint64, or past int64 beside smaller ones): checked, and taken, as the ints they are.
        items = list(ids)
        at = next((i for i, x in enumerate(items) if not is_int(x)), None)
        if at is not None and arr.dtype.kind == "O":  # (numpy's dtype names no item)
            raise ValueError(f"{what}: token ids must be integers, got {type(items[at]).__name__} at index {at}")
        if at is None:
            for i, x in enumerate(items):
                if not 0 <= int(x) < vocab_size:
                    raise ValueError(f"{what}: token id {int(x)} at index {i} is out of range [0, {vocab_size})")
            arr = np.array([int(x) for x in items], dtype=np.int64)
    if arr.dtype.kind not in "iu" and arr.size:  # (numpy files timedelta64 under integer)
        raise ValueError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim == 0:  # (one id where a sequence of them belongs: a batch's prompt, say)
        raise ValueError(f"{what}: token ids must be a 1-D sequence, got one {type(ids).__name__}, {ids}")
    if arr.ndim != 1:
        raise ValueError(f"{what}: token ids must be a 1-D sequence, got shape {tuple(arr.shape)}")
    if arr.size:
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{what}: token id {int(arr[i])} at index {i} is out of range [0, {vocab_size})")
    return np.ascontiguousarray(arr, dtype=np.int32)
