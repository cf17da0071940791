"""`diffuserve quantize`: a bf16/fp32 DiffusionGemma checkpoint to compressed-tensors FP8 or
NVFP4 (the formats LLM Compressor writes for its FP8_DYNAMIC and NVFP4A16 schemes), in numpy.

What is quantized is what LLM Compressor's recipe `targets="Linear"` with the router, the
vision tower and lm_head ignored quantizes: every attention, MLP and self-conditioning
projection, and every expert, written one linear per expert.
- fp8-dynamic: one scale per output channel, amax / 448; weights rounded to E4M3
  (nearest, ties to even); activations declared dynamic, per token.
- nvfp4: a global scale 448 * 6 / amax per tensor and an E4M3 scale per 16 inputs
  (global * group amax / 6, rounded to E4M3); weights rounded to E2M1 as compressed-tensors
  rounds them and packed two a byte; activations stay 16-bit (W4A16).
The arithmetic follows compressed-tensors step by step, so that an fp32 checkpoint
quantizes to LLM Compressor's bytes: tests/test_quantized.py checks it tensor for tensor.
The encoder's copies of the shared weights that LLM Compressor also writes (and a checkpoint
with an untied lm_head holds) are left out (the weights are tied; diffuserve and
transformers tie them back). The source is read as it is used and each linear quantized as
it is written, so that memory holds about one tensor at a time, not the checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Callable, Optional

import numpy as np

from . import _core
from ._checks import check_path
from .hub_cache import resolve_checkpoint
from .safetensors_io import LazyTensor, as_float32, read_safetensors, write_safetensors

FP8_MAX = 448.0
# The linears quantized: the decoder's, and an untied encoder's own (its copies of the decoder's are left out).
_LINEAR = re.compile(r"model\.(decoder\.(layers\.\d+\.(self_attn|mlp)\.\w+_proj|self_conditioning\.\w+_proj)|"
                     r"encoder\.language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj)\.weight$")


def fp8_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 values (|x| <= 448) to E4M3 bits, rounding to nearest, ties to even."""
    x = np.asarray(x, dtype=np.float32)
    sign = (np.signbit(x).astype(np.uint8)) << 7
    a = np.abs(x).astype(np.float64)
    exponent = np.floor(np.log2(np.maximum(a, 2.0 ** -6))).astype(np.int64)  # subnormals share 2^-6
    step = np.exp2(exponent - 3)  # spacing of representable values in this binade
    mantissa = np.rint(a / step).astype(np.int64)  # ties to even
    normal = a >= 2.0 ** -6
    carry = normal & (mantissa == 16)  # rounded up into the next binade
    exponent = np.where(carry, exponent + 1, exponent)
    mantissa = np.where(carry, 8, mantissa)
    promoted = ~normal & (mantissa == 8)  # the largest subnormal rounded up to 2^-6
    biased = np.where(normal | promoted, exponent + 7, 0)
    fraction = np.where(normal | promoted, mantissa - 8, mantissa)
    return (sign | (biased << 3).astype(np.uint8) | fraction.astype(np.uint8)).astype(np.uint8)


def _fp8_linear(w: np.ndarray):
    """A [out, in] weight as (E4M3 bits, fp32 per-channel scale) the way compressed-tensors
    computes them for an fp32 model (a bf16 source is quantized from its values in fp32)."""
    amax = np.maximum(np.abs(np.minimum(w.min(axis=1), 0)), np.maximum(w.max(axis=1), 0)).astype(np.float32)
    scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
    scale[scale == 0] = np.finfo(np.float32).eps
    q = np.clip(w / scale[:, None], -FP8_MAX, FP8_MAX)
    return ("F8_E4M3", fp8_e4m3_bits(q)), scale[:, None]


FP4_MAX = 6.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _round_fp4(v: np.ndarray) -> np.ndarray:
    """compressed-tensors' E2M1 rounding: fixed thresholds, then the sign put back (so a small
    negative value becomes -0.0, which is packed with its sign bit)."""
    a = np.abs(v)
    bounds = [(0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True)]
    code = np.zeros(a.shape, dtype=np.uint8)
    for i, (bound, inclusive_above) in enumerate(bounds):  # value i+1 from just past each bound
        code = np.where(a > bound if inclusive_above else a >= bound, i + 1, code)
    return E2M1[code] * np.sign(v)


def _absmax(w: np.ndarray) -> np.float32:
    return np.float32(max(abs(min(w.min(), 0)), max(w.max(), 0)))


def _nvfp4_linear(w: np.ndarray, amax: np.float32, group: int = 16):
    """A [out, in] weight as (packed E2M1, E4M3 group scales, fp32 global scale), the global
    scale from `amax` (the absmax of the weights that share it)."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"nvfp4 needs the input size ({cols}) to be a multiple of {group}")
    # torch evaluates `number / tensor` as reciprocal(tensor) * number: two roundings, kept.
    global_scale = (np.float32(1.0) / np.maximum(amax, np.finfo(np.float32).tiny)) * np.float32(FP8_MAX * FP4_MAX)
    if not np.isfinite(global_scale):
        global_scale = np.float32(1.0)
    groups = w.reshape(rows, cols // group, group)
    group_amax = np.maximum(np.abs(np.minimum(groups.min(axis=2), 0)), np.maximum(groups.max(axis=2), 0))
    scale_bits = fp8_e4m3_bits(np.clip(global_scale * (group_amax / np.float32(FP4_MAX)), -FP8_MAX, FP8_MAX))
    scale_bits[scale_bits == 0] = fp8_e4m3_bits(np.float32([0.125]))[0]  # a zero scale becomes the E4M3 eps
    scale = _E4M3[scale_bits]
    q = _round_fp4(np.clip(groups / (scale / global_scale)[:, :, None], -FP4_MAX, FP4_MAX)).reshape(rows, cols)
    codes = (np.searchsorted(E2M1, np.abs(q)).astype(np.uint8) | (np.signbit(q).astype(np.uint8) << 3))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # the even column in the low nibble
    return ("U8", packed), ("F8_E4M3", scale_bits), np.float32([global_scale])


def _e4m3_values() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint8)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    return np.where(bits & 0x80, -magnitude, magnitude).astype(np.float32)


_E4M3 = _e4m3_values()

SCHEMES = {
    "fp8-dynamic": {
        "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True}},
    "nvfp4": {
        "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                    "scale_dtype": "torch.float8_e4m3fn", "dynamic": False},
        "input_activations": None},
}


# Linears that inference engines fuse into one GEMM share NVFP4's global scale (as LLM
# Compressor links their observers): gate with up, and q with k and v, of one module.
_FUSED = {"gate_proj": "gate_up", "up_proj": "gate_up", "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv"}


def _fusion_group(prefix: str) -> tuple:
    parent, leaf = prefix.rsplit(".", 1)
    return (parent, _FUSED.get(leaf, leaf))


def _quantize_linears(linears: dict, scheme: str) -> dict:
    """prefix -> (shape [out, in], a function giving the fp32 weight), to the tensors of the
    scheme, each a LazyTensor: a linear is quantized when its first tensor is written, and
    its others (written next) take the same result."""
    last = {}  # the linear quantized last: prefix -> its tensors

    def quantized(prefix: str, compute) -> Callable:
        def tensors():
            if prefix not in last:
                last.clear()
                last[prefix] = compute()
            return last[prefix]
        return tensors

    out = {}
    if scheme == "fp8-dynamic":
        for prefix, ((rows, cols), weight) in linears.items():
            tensors = quantized(prefix, lambda weight=weight: _fp8_linear(weight()))
            out[prefix + ".weight"] = LazyTensor("F8_E4M3", (rows, cols), lambda t=tensors: t()[0][1])
            out[prefix + ".weight_scale"] = LazyTensor("F32", (rows, 1), lambda t=tensors: t()[1])
        return out
    group_amax = {}
    for prefix, (_, weight) in linears.items():
        key = _fusion_group(prefix)
        group_amax[key] = max(group_amax.get(key, np.float32(0)), _absmax(weight()))
    for prefix, ((rows, cols), weight) in linears.items():
        amax = group_amax[_fusion_group(prefix)]
        tensors = quantized(prefix, lambda weight=weight, amax=amax: _nvfp4_linear(weight(), amax))
        out[prefix + ".weight_packed"] = LazyTensor("U8", (rows, cols // 2), lambda t=tensors: t()[0][1])
        out[prefix + ".weight_scale"] = LazyTensor("F8_E4M3", (rows, cols // 16), lambda t=tensors: t()[1][1])
        out[prefix + ".weight_global_scale"] = LazyTensor("F32", (1,), lambda t=tensors: t()[2])
    return out


# compressed-tensors' names for a quantized linear's tensors other than its weight, and for a
# quantized KV cache's scales.
_QUANTIZATION_PARAMETERS = (".weight_packed", ".weight_scale", ".weight_global_scale", ".weight_zero_point",
                            ".weight_g_idx", ".input_scale", ".input_global_scale", ".input_zero_point",
                            ".k_scale", ".v_scale")


def _source_weight(src: str, name: str, dtype: str, arr: np.ndarray) -> np.ndarray:
    """A linear's stored weight as float32, refused where it holds NaN or infinities: E4M3 and
    E2M1 have no such values, and the scales would hide them (a NaN dropped from a group's
    absmax), where the source's logits show them."""
    w = as_float32(dtype, arr)
    if not np.isfinite(w).all():
        raise ValueError(f"{src}: tensor '{name}' holds NaN or infinite values, which cannot be quantized")
    return w


def _folder_holding(path: str, folder: str) -> Optional[str]:
    """The first of `path` (which need not exist) and the folders above it that is `folder`, as
    the file system says (links, and file systems that ignore letter case), or None."""
    path = os.path.realpath(path)
    while True:
        if os.path.exists(path) and os.path.samefile(path, folder):
            return path
        if (parent := os.path.dirname(path)) == path:
            return None
        path = parent


def quantize(src: str, dst: str, scheme: str = "fp8-dynamic") -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not supported (supported: {', '.join(SCHEMES)})")
    src = resolve_checkpoint(check_path("the source checkpoint", src))  # (a name not UTF-8 had failed in the native call)
    if not os.path.isdir(src):
        raise ValueError(f"{src}: no such checkpoint directory")
    # Into a new or empty directory only: over its source, or beside another checkpoint's
    # shards and index (which transformers, and so a load, would pass over for the new
    # model.safetensors), the copy would leave a directory holding two models.
    # Nor inside its source, whose folders the copy may take (additional_chat_templates).
    if (folder := _folder_holding(dst, src)) is not None:
        where = "is the source" if folder == os.path.realpath(dst) else "is inside the source"
        raise ValueError(f"{dst}: the output directory {where}; write the quantized copy elsewhere")
    # (Any file there may be one a load reads: a stale chat_template.jinja had won over the
    # source's template.)
    if os.path.isdir(dst) and (held := sorted(os.listdir(dst))):
        shown = ", ".join(held[:5]) + (f", and {len(held) - 5} more" if len(held) > 5 else "")
        raise ValueError(f"{dst} is not empty ({shown}): write the quantized copy to a new or empty directory")
    config_file = os.path.join(src, "config.json")
    with open(config_file) as f:
        try:
            config = json.load(f)
        except ValueError as e:  # json's message names no file
            raise ValueError(f"{config_file}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: top level must be a JSON object")
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized")
    # The files a load reads, checked as it checks them (model.safetensors, else the index's
    # shards): any other .safetensors file beside them (shards left from an earlier save, a
    # test's reference logits) is not the model's, and had been merged in.
    tensors = {}
    for path in _core.weight_files(src):
        tensors.update(read_safetensors(path, mapped=True))
    if not tensors:
        raise ValueError(f"{src}: its checkpoint holds no tensors")
    # Names as a load reads them: a base model's checkpoint (DiffusionGemmaModel.save_pretrained)
    # lacks the "model." a load puts before them (its linears had been left unquantized).
    base = not any(name.startswith("model.") for name in tensors)
    stored = {("model." + name if base else name): name for name in tensors}  # load's name -> the file's
    encoder, decoder = "model.encoder.language_model.", "model.decoder."

    linears, out = {}, {}
    for full, name in stored.items():
        dtype, arr = tensors[name]
        if full.startswith(encoder) and not full.endswith(".layer_scalar"):  # (those are the encoder's own)
            # The encoder's copy of a decoder weight (a checkpoint with an untied lm_head, or
            # LLM Compressor's output, holds them): left out, as a load ties it back. (Its
            # experts had been quantized and its linears not, and the copy failed to load.)
            twin = tensors.get(stored.get(decoder + full[len(encoder):], ""))
            if twin is not None and twin[0] == dtype and twin[1].shape == arr.shape and \
                    np.array_equal(twin[1].view(np.uint8), arr.view(np.uint8)):  # the bytes, as a load compares
                continue
        linear = _LINEAR.match(full)
        # A module's experts: their linears, stacked along out.
        parts = ("gate_proj", "up_proj") if name.endswith(".experts.gate_up_proj") else \
            ("down_proj",) if name.endswith(".experts.down_proj") else ()
        if linear or parts:
            # Shapes as the quantized copy's tensors are cut from them (the load of the copy
            # checks those against config.json). (A stack of odd height had lost a row, and a
            # tensor of fewer dimensions had been a traceback.)
            if arr.ndim != (3 if parts else 2) or (parts and arr.shape[1] % len(parts)):
                expected = ("[out, in]", "[experts, out, in]", "[experts, 2 x rows, in] (gate and up stacked)")
                raise ValueError(f"{src}: tensor '{name}' has shape {list(arr.shape)}, expected {expected[len(parts)]}")
            if dtype not in ("F32", "F16", "BF16"):
                raise ValueError(f"{src}: tensor '{name}' is {dtype}; a weight to quantize is F32, F16 or BF16")
            if scheme == "nvfp4" and arr.shape[-1] % 16:  # (named as stored: an expert stack, not one expert)
                raise ValueError(f"{src}: tensor '{name}' has {arr.shape[-1]} inputs; nvfp4 needs every linear's "
                                 f"input size to be a multiple of 16")
        if linear:
            linears[name[: -len(".weight")]] = (arr.shape, lambda name=name, dtype=dtype, arr=arr:
                                                _source_weight(src, name, dtype, arr))
        elif parts:
            prefix = name.rsplit(".", 1)[0]
            rows = arr.shape[1] // len(parts)
            for e in range(arr.shape[0]):
                for i, part in enumerate(parts):
                    linears[f"{prefix}.{e}.{part}"] = (
                        (rows, arr.shape[2]),
                        lambda name=name, dtype=dtype, w=arr[e, i * rows:(i + 1) * rows]:
                            _source_weight(src, name, dtype, w))
        elif dtype in ("U8", "F8_E4M3") or name.endswith(_QUANTIZATION_PARAMETERS):
            # (Copied through, it had made a copy that the load refused.)
            raise ValueError(f"{src}: tensor '{name}' ({dtype}) is a quantization parameter: the source is already "
                             f"quantized, though its config.json has no quantization_config")
        else:
            out[name] = (dtype, arr)
    out.update(_quantize_linears(linears, scheme))

    made = []  # the folders makedirs is to make, dst first
    folder = os.path.abspath(dst)
    while not os.path.lexists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(dst, exist_ok=True)
    try:  # (the weights are quantized as they are written: a refusal comes from here)
        write_safetensors(os.path.join(dst, "model.safetensors"), out)
    except BaseException:
        # The folders this made, empty again (write_safetensors leaves no partial file).
        with contextlib.suppress(OSError):  # (one not empty after all: the refusal still goes out)
            for folder in made:
                os.rmdir(folder)
        raise
    spec = SCHEMES[scheme]
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": spec["format"], "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": spec["format"], "weights": spec["weights"],
                                      "input_activations": spec["input_activations"], "output_activations": None}},
        "ignore": ["lm_head", "re:.*router.*", "re:.*vision.*", "re:.*embed_vision.*"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    # The tokenizer, the chat templates (named ones in their folder) and the generation config,
    # as they are. Other folders stay behind: a repository's may hold the weights again in
    # another format.
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name == "additional_chat_templates" and os.path.isdir(path):
            shutil.copytree(path, os.path.join(dst, name))
        elif (name != "config.json" and not name.endswith((".safetensors", ".safetensors.index.json"))
              and os.path.isfile(path)):
            shutil.copy(path, os.path.join(dst, name))
