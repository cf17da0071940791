"""SamplingParams: per-request generation parameters, with transformers' names.

Fields left as None take the checkpoint's generation_config.json value (or transformers'
global default). Every value is checked here, and again in the runtime once resolved,
so that a bad one is a ValueError naming the parameter.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from ._checks import (INT32_MAX, check_bool, check_float32, check_int, check_unicode, float32_value, is_int,
                      iter_once)


def _int_list(name: str, value, allow_empty: bool = False, ordered: bool = False) -> list:
    """ordered: the items' order means something (a set's would be its hash order)."""
    if value is None:
        return []
    if is_int(value):  # one id: named as given
        return [check_int(name, value, 0)]
    # (A dict had given its keys, and a set its hash order where the order counts.)
    if isinstance(value, (str, bytes, dict)) or (ordered and isinstance(value, (set, frozenset))):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of integers, got {value!r}") from None
    if not items and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    # Plain ints in range, checked in a few passes of C loops (a request's 262,144 allowed ids,
    # checked one by one for each of its choices, took seconds); else item by item, for the message.
    if all(type(x) is int for x in items) and (not items or (min(items) >= 0 and max(items) <= INT32_MAX)):
        return items
    return [check_int(f"{name}[{i}]", x, 0) for i, x in enumerate(items)]


def length_untold(max_new_tokens: Optional[int], length_given: bool, context: int) -> Optional[int]:
    """max_new_tokens, or where none is given, as vLLM without max_tokens: the checkpoint's
    length (None) where generation_config.json gives one, else the whole context (`context`
    tokens, at most the runtime's int32), which fit_to_context then cuts to the whole blocks
    that fit. (A context of 2^31 positions had been refused as a max_tokens the client never
    sent.)"""
    return min(context, INT32_MAX) if max_new_tokens is None and not length_given else max_new_tokens


def _comparable(value):
    """A field's value as equality compares it: ids in an array, a tuple or a range as a list."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return list(value) if isinstance(value, (tuple, range)) else value


@dataclass(eq=False)
class SamplingParams:
    """How one request is generated, by transformers' names (README: "SamplingParams"). A field
    left None takes the checkpoint's generation_config.json value, else transformers' default.
    Fields are checked when made and again when a request is queued; a name that is no field
    (vLLM's max_tokens, say) is a TypeError naming the equivalent."""
    max_new_tokens: Optional[int] = None
    # A cap on prompt + new tokens, applied by transformers' rule (the runtime's SamplingParams.max_length).
    # None: the checkpoint's, unless max_new_tokens is given: a request's own max_new_tokens wins.
    max_length: Optional[int] = None
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
    allowed_token_ids: Optional[Sequence[int]] = None  # only these may be sampled or accepted (pinned stay)
    # {token id: bias}, as vLLM's and OpenAI's logit_bias: added to the id's logit before the
    # temperature divides it (as a logits processor given to transformers' generate), so that
    # the argmax, the draws, the entropies and the self-conditioning all see it.
    logit_bias: Optional[Mapping[int, float]] = None
    # vLLM's: strings that end the output where its text first has one (the text is cut before
    # it, or with include_stop_str_in_output after it); the rest of the request is aborted.
    stop: Union[str, Sequence[str], None] = None
    include_stop_str_in_output: bool = False
    # vLLM's: only the prompt's last this many tokens are used (left truncation).
    truncate_prompt_tokens: Optional[int] = None
    self_conditioning: bool = True  # False: no step sees the previous step's logits (an ablation)
    # True: where the length limit would reach past max_position_embeddings or the whole KV
    # cache, generate the whole blocks that fit instead (vLLM's rule without max_tokens).
    fit_to_context: bool = False

    def __new__(cls, *args, **kwargs):
        for name in kwargs:  # (the dataclass's own TypeError names no equivalent)
            if name not in _FIELD_NAMES:
                raise TypeError(_unknown_parameter(name))
        return super().__new__(cls)

    def __setattr__(self, name, value):
        # A name that is no field (vLLM's max_tokens, say) had been kept and read by nothing: a
        # request given `params.max_tokens = 4` generated 256 tokens.
        if name not in _FIELD_NAMES:
            raise AttributeError(_unknown_parameter(name))
        super().__setattr__(name, value)

    def __post_init__(self):
        self._checked()

    def __eq__(self, other):
        # (The dataclass's own compared id arrays element by element, an error as a truth value.)
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return all(_comparable(getattr(self, f.name)) == _comparable(getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # (mutable, as the dataclass's)

    LIST_FIELDS = ("eos_token_id", "seed_canvas", "pinned_positions", "allowed_token_ids", "stop")

    def _read_iterators(self) -> None:
        """An iterator of ids or stop strings (given, or set since) is read once, into a list
        kept in its place: its check would otherwise use it up, and the runtime get none, or
        every request after the first sharing these params (a generator of EOS ids had
        switched EOS off)."""
        for name in self.LIST_FIELDS:
            value = getattr(self, name)
            if value is not None and not is_int(value) and iter_once(value):
                setattr(self, name, list(value))

    def _checked(self) -> dict:
        """The fields given (not None), checked by name and converted as the runtime takes them:
        ints, floats as float32 rounds them, int lists. (Also on every use: fields may have
        been set since construction.)"""
        self._read_iterators()
        v = {}
        for name, lo in (("max_new_tokens", 1), ("max_length", 1), ("max_denoising_steps", 1),
                         ("stability_threshold", 0), ("canvas_length", 1), ("truncate_prompt_tokens", 1)):
            if getattr(self, name) is not None:
                v[name] = check_int(name, getattr(self, name), lo, INT32_MAX)
        for name, lo, strict in (("t_min", 0.0, False), ("t_max", 0.0, True), ("entropy_bound", 0.0, True),
                                 ("confidence_threshold", 0.0, True)):
            if getattr(self, name) is not None:
                v[name] = check_float32(name, getattr(self, name), lo, strict)
        if "t_min" in v and "t_max" in v and v["t_max"] <= v["t_min"]:
            raise ValueError(f"t_max must be > t_min (as float32), got t_max={self.t_max!r} <= t_min={self.t_min!r}")
        if self.seed is not None:
            if not is_int(self.seed) or not 0 <= int(self.seed) < 2**64:
                raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
            v["seed"] = int(self.seed)
        if self.eos_token_id is not None:
            v["eos_token_id"] = _int_list("eos_token_id", self.eos_token_id, allow_empty=True)
        seed_canvas = v["seed_canvas"] = _int_list("seed_canvas", self.seed_canvas, ordered=True)
        pinned = v["pinned_positions"] = _int_list("pinned_positions", self.pinned_positions, allow_empty=True)
        v["allowed_token_ids"] = _int_list("allowed_token_ids", self.allowed_token_ids)
        v["logit_bias"] = _bias_pairs(self.logit_bias)
        v["self_conditioning"] = check_bool("self_conditioning", self.self_conditioning)
        v["fit_to_context"] = check_bool("fit_to_context", self.fit_to_context)
        v["stop"] = check_stop_strings(self.stop)
        v["include_stop_str_in_output"] = check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if pinned and not seed_canvas:
            raise ValueError("pinned_positions needs a seed_canvas to take the pinned tokens from")
        if len(set(pinned)) != len(pinned):
            raise ValueError("pinned_positions must not repeat a position")
        if seed_canvas and self.canvas_length is not None and len(seed_canvas) != self.canvas_length:
            raise ValueError(f"seed_canvas has {len(seed_canvas)} tokens but canvas_length is {self.canvas_length}")
        return v

    def _native(self, defaults: "_core.SamplingParams") -> "_core.SamplingParams":
        """The runtime's parameters: these values over the model's defaults."""
        v = self._checked()
        p = defaults
        for f in ("max_new_tokens", "max_length", "max_denoising_steps", "stability_threshold", "t_min", "t_max",
                  "entropy_bound", "confidence_threshold"):
            if f in v:
                setattr(p, f, v[f])
        if "max_new_tokens" in v and "max_length" not in v:
            p.max_length = 0  # the checkpoint's max_length would override a max_new_tokens of 256, or cut it short
        if not p.t_max > p.t_min:  # one end given, the other the checkpoint's: say which is which
            ends = {name: f"{name}={getattr(p, name):g}" + ("" if name in v else " (the checkpoint's default)")
                    for name in ("t_max", "t_min")}
            if "t_max" in v:
                raise ValueError(f"t_max must be > t_min, got {ends['t_max']} <= {ends['t_min']}")
            # The given end is named first (the server's 400 names it as its param).
            raise ValueError(f"t_min must be < t_max, got {ends['t_min']} >= {ends['t_max']}")
        if "eos_token_id" in v:
            p.eos_token_ids = v["eos_token_id"]
        p.seed = v.get("seed")
        p.canvas_length = v.get("canvas_length", 0)
        p.seed_canvas, p.pinned_positions = v["seed_canvas"], v["pinned_positions"]
        p.allowed_token_ids, p.self_conditioning = v["allowed_token_ids"], v["self_conditioning"]
        p.logit_bias = v["logit_bias"]
        p.fit_to_context = v["fit_to_context"]
        return p


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
# help() and editors read a class's signature from its __new__ where it has one: (*args, **kwargs).
SamplingParams.__signature__ = inspect.signature(SamplingParams.__init__).replace(
    parameters=list(inspect.signature(SamplingParams.__init__).parameters.values())[1:],
    return_annotation=inspect.Signature.empty)


def check_stop_strings(value) -> List[str]:
    """stop (one string or several) as a list of non-empty strings that UTF-8 can write."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, (bytes, Mapping)) or not isinstance(stops, Iterable):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r:.200}")
    stops = list(stops)
    for i, s in enumerate(stops):
        where = "stop" if isinstance(value, str) else f"stop[{i}]"
        if not isinstance(s, str):
            raise ValueError(f"{where} must be a string, got {s!r:.200}")
        if not s:
            raise ValueError(f"{where}: an empty string is not a stop string")
        check_unicode(where, s)
    return stops


def _bias_pairs(value) -> list:
    """logit_bias ({token id: bias}) as the runtime takes it: (id, bias) pairs in id order,
    each bias finite as float32 rounds it."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r:.200}")
    tokens, biases = list(value.keys()), list(value.values())
    # Plain ints and floats in range, checked in a few passes of C loops (a whole vocabulary's
    # 262,144 biases, checked one by one, took 0.8 s for each request); else item by item.
    if all(type(t) is int for t in tokens) and all(type(b) in (int, float) for b in biases) and \
            (not tokens or (min(tokens) >= 0 and max(tokens) <= INT32_MAX)):
        with np.errstate(over="ignore", invalid="ignore"):
            rounded = np.asarray(biases, dtype=np.float64).astype(np.float32)
        if np.isfinite(rounded).all():
            ids = np.asarray(tokens, dtype=np.int64)
            order = np.argsort(ids, kind="stable")
            return list(zip(ids[order].tolist(), rounded[order].astype(np.float64).tolist()))
    return sorted((check_int("logit_bias's token id", token, 0),
                   float32_value(f"logit_bias[{int(token) if is_int(token) else repr(token)}]", bias))
                  for token, bias in value.items())


# vLLM's names for what SamplingParams says otherwise, for the error that refuses them.
_VLLM_NAMES = {"max_tokens": "max_new_tokens",
               "temperature": "t_min and t_max (the ends of the denoise steps' temperature schedule)",
               "ignore_eos": "eos_token_id=[] (no EOS)", "stop_token_ids": "eos_token_id (the ids that end an output)",
               "n": "one request a seed (the server's n runs seed, seed + 1, ...)"}


def _unknown_parameter(name: str) -> str:
    hint = _VLLM_NAMES.get(name)
    return (f"SamplingParams has no parameter {name!r}" + (f" (vLLM's; here: {hint})" if hint else "") +
            f"; its parameters: {', '.join(f.name for f in fields(SamplingParams))}")
