"""SamplingParams: per-request generation parameters, with transformers' names.

Fields left as None take the checkpoint's generation_config.json value (or transformers'
global default). Every value is checked here, and again in the runtime once resolved,
so that a bad one is a ValueError naming the parameter.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from . import _core


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_list(name: str, value, allow_empty: bool = False) -> list:
    if value is None:
        return []
    if _is_int(value):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of integers, got {value!r}") from None
    if not items and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    for i, x in enumerate(items):
        if not _is_int(x) or int(x) < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative integer, got {x!r}")
    return [int(x) for x in items]


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = None
    max_denoising_steps: Optional[int] = None
    t_min: Optional[float] = None
    t_max: Optional[float] = None
    entropy_bound: Optional[float] = None
    stability_threshold: Optional[int] = None
    confidence_threshold: Optional[float] = None
    eos_token_id: Union[int, Sequence[int], None] = None
    seed: Optional[int] = None
    # Diffusion options:
    canvas_length: Optional[int] = None  # a narrower canvas for this request
    seed_canvas: Optional[Sequence[int]] = None  # initial tokens of the first block
    pinned_positions: Optional[Sequence[int]] = None  # first-block positions held at their seed_canvas token
    allowed_token_ids: Optional[Sequence[int]] = None  # only these may be sampled, accepted or output
    self_conditioning: bool = True  # False: no step sees the previous step's logits (an ablation)

    def __post_init__(self):
        def integer(name, lo):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or int(v) < lo):
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")

        def number(name, lo, strict):
            v = getattr(self, name)
            if v is None:
                return
            if _is_int(v) or isinstance(v, float):
                v = float(v)
                if math.isfinite(v) and (v > lo if strict else v >= lo):
                    return
            raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {lo}, got {getattr(self, name)!r}")

        integer("max_new_tokens", 1)
        integer("max_denoising_steps", 1)
        integer("stability_threshold", 0)
        integer("canvas_length", 1)
        number("t_min", 0.0, strict=False)
        number("t_max", 0.0, strict=True)
        number("entropy_bound", 0.0, strict=True)
        number("confidence_threshold", 0.0, strict=True)
        if self.t_min is not None and self.t_max is not None and self.t_max <= self.t_min:
            raise ValueError(f"t_max must be > t_min, got t_max={self.t_max} <= t_min={self.t_min}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= int(self.seed) < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        _int_list("eos_token_id", self.eos_token_id, allow_empty=True)
        seed_canvas = _int_list("seed_canvas", self.seed_canvas)
        pinned = _int_list("pinned_positions", self.pinned_positions, allow_empty=True)
        _int_list("allowed_token_ids", self.allowed_token_ids)
        if not isinstance(self.self_conditioning, bool):
            raise ValueError(f"self_conditioning must be True or False, got {self.self_conditioning!r}")
        if pinned and not seed_canvas:
            raise ValueError("pinned_positions needs a seed_canvas to take the pinned tokens from")
        if len(set(pinned)) != len(pinned):
            raise ValueError("pinned_positions must not repeat a position")
        if seed_canvas and self.canvas_length is not None and len(seed_canvas) != self.canvas_length:
            raise ValueError(f"seed_canvas has {len(seed_canvas)} tokens but canvas_length is {self.canvas_length}")

    def _native(self, defaults: "_core.SamplingParams") -> "_core.SamplingParams":
        """The runtime's parameters: these values over the model's defaults."""
        p = defaults
        for f in ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "entropy_bound",
                  "stability_threshold", "confidence_threshold"):
            if getattr(self, f) is not None:
                setattr(p, f, getattr(self, f))
        if self.eos_token_id is not None:
            p.eos_token_ids = _int_list("eos_token_id", self.eos_token_id, allow_empty=True)
        p.seed = None if self.seed is None else int(self.seed)
        p.canvas_length = int(self.canvas_length or 0)
        p.seed_canvas = _int_list("seed_canvas", self.seed_canvas)
        p.pinned_positions = _int_list("pinned_positions", self.pinned_positions, allow_empty=True)
        p.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
        p.self_conditioning = self.self_conditioning
        return p

