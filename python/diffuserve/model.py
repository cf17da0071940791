"""Model and Sequence: the stable Python surface over the native runtime.

Arguments are checked and converted here (token ids to int32, logits to float32), so a
mistake is a ValueError naming the argument; the work itself runs in C++ without the GIL.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import _core
from ._checks import INT64_MAX, check_int, check_path, check_token_ids
from .hub_cache import resolve_checkpoint


def _float32_logits(logits) -> np.ndarray:
    """Self-conditioning logits as a C-ordered float32 array of their own (checked, then read
    without the GIL: another thread's writes must not reach the runtime), else a ValueError
    naming the argument: real numbers only, each finite as float32 or -inf (a masked id)."""
    if hasattr(logits, "float") and hasattr(logits, "numpy"):  # a torch tensor (bf16 too, which numpy lacks)
        # (.float() would drop a complex tensor's imaginary part, and make a bool one 0/1 logits.)
        if getattr(logits, "is_complex", lambda: False)() or str(getattr(logits, "dtype", "")) == "torch.bool":
            raise ValueError(f"denoise: self_conditioning_logits must be real numbers, got dtype {logits.dtype}")
        try:
            logits = logits.detach().float().cpu().numpy()
        except (RuntimeError, NotImplementedError, TypeError) as e:  # a meta tensor, say: no values to read
            raise ValueError(f"denoise: self_conditioning_logits cannot be read as numbers: {e}") from None
    try:
        arr = np.asarray(logits)  # (the copy is the float32 one below)
    except (TypeError, ValueError) as e:
        raise ValueError(f"denoise: self_conditioning_logits must be an array of numbers: {e}") from None
    if arr.dtype.kind not in "iuf":  # (numpy files timedelta64 under integer)
        raise ValueError(f"denoise: self_conditioning_logits must be real numbers, got dtype {arr.dtype}")
    if np.ma.is_masked(logits):  # (numpy's copy drops the mask)
        raise ValueError("denoise: self_conditioning_logits must not hold masked values (a masked id is -inf)")
    with np.errstate(over="ignore"):
        out = np.array(arr, dtype=np.float32, order="C")
    overflow = np.isinf(out) & np.isfinite(arr)
    if overflow.any():
        at = tuple(int(i) for i in np.argwhere(overflow)[0])
        raise ValueError(f"denoise: self_conditioning_logits holds {arr[at]!r} at {at}, past float32's range")
    return out

_DTYPES = {None: "", "auto": "", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# The native side's dtype names (safetensors' spelling) as this API spells them.
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class Model:
    """A loaded DiffusionGemma checkpoint."""

    def __init__(self, native: _core.Model, path: str):
        self._native = native
        self.path = path
        self.config = native.config

    @classmethod
    def load(cls, path, device: str = "cpu", dtype: Optional[str] = None, num_threads: int = 0,
             kv_cache_memory_bytes: Optional[int] = None, kv_block_size: int = 16, max_num_seqs: int = 64,
             load_format: str = "auto", quantization: Optional[str] = None,
             activations: str = "float32", kv_cache_dtype: str = "auto",
             max_model_len: Optional[int] = None) -> "Model":
        """Loads a checkpoint directory (config.json + safetensors, single or sharded), or the
        model of a Hugging Face Hub id ("google/...") from the local Hugging Face cache.

        dtype: None takes config.json's dtype (torch_dtype), as transformers loads the weights,
        or where it names none the embedding's stored dtype; with load_format="dummy", bfloat16
        whatever config.json says (as the GPU keeps its weights); "float32", "bfloat16" or
        "float16" casts.
        The CPU backend computes in fp32 whatever the weight dtype.
        device: "cpu", "cuda" or "cuda:N" (CUDA builds; bf16 weights on the GPU).
        kv_cache_memory_bytes: size of the paged KV cache (None: on the CPU a quarter of RAM, at
        most 4 GiB; on a GPU 80% of the memory the weights left free).
        load_format: "auto" reads the safetensors; "dummy" makes random weights at the config's
        shapes (only config.json is read), for benchmarks.
        quantization: with load_format="dummy", None (plain weights), "fp8", "fp8-dynamic" or
        "nvfp4": the linears' random weights packed as such a checkpoint stores them (GPU: kept
        packed); "fp8-dynamic" also quantizes their inputs to FP8 per token (FP8_DYNAMIC).
        activations: "float32" (default): every product as in fp32, the reference's numbers (the
        GPU multiplies an input's bf16 hi and lo halves, two tensor-core products); "bfloat16":
        the inputs of the linears and experts with plain weights (lm_head included) rounded to
        bf16 first, as transformers computes in bf16: one product, about half the GPU's
        tensor-core work; logits then differ from fp32's by 1-18% of their range on small random
        test models (the argmax held). Attention's Q, K, V and probabilities are rounded too; the
        router, the softmax sums and the norms stay fp32.
        kv_cache_dtype: "auto" (default): the KV cache in bf16 where activations are "bfloat16"
        and the device's attention reads bf16 keys (the CPU; CUDA at head dims 256 and 512 on
        Hopper), as the attention rounds them to bf16 anyway: the same results in half the
        memory; else fp32. "float32" forces fp32; "bfloat16" is an error where "auto" would
        not choose it. Model.kv_cache_dtype says which.
        max_model_len: the longest sequence (prompt and generated tokens) a request may reach,
        as vLLM's (None: config.json's max_position_embeddings; more than that is an error);
        config["max_model_len"] says which.
        """
        path = resolve_checkpoint(check_path("path (a checkpoint directory)", path))
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (use None, 'float32', 'bfloat16' or 'float16')")
        if not isinstance(device, str):
            raise ValueError(f"device must be a string such as 'cpu', got {device!r}")
        num_threads = check_int("num_threads", num_threads, 0, 1024)
        if kv_cache_memory_bytes is not None:
            kv_cache_memory_bytes = check_int("kv_cache_memory_bytes", kv_cache_memory_bytes, 1, INT64_MAX)
        kv_block_size = check_int("kv_block_size", kv_block_size, 1)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        if not isinstance(load_format, str):  # other strings: the runtime names what it takes
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        if quantization is not None and not isinstance(quantization, str):
            raise ValueError(f"quantization must be None or a string such as 'fp8', got {quantization!r}")
        if activations not in ("float32", "bfloat16"):
            raise ValueError(f"activations must be 'float32' or 'bfloat16', got {activations!r}")
        if kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', got {kv_cache_dtype!r}")
        if max_model_len is not None:
            max_model_len = check_int("max_model_len", max_model_len, 1, INT64_MAX)
        try:
            native = _core.Model.load(path, device, _DTYPES[dtype], num_threads, kv_cache_memory_bytes or 0,
                                      kv_block_size, max_num_seqs, load_format, quantization or "", activations,
                                      kv_cache_dtype, max_model_len or 0)
        except MemoryError as e:  # the runtime's std::bad_alloc: say what was being allocated
            kv = "its default" if kv_cache_memory_bytes is None else f"{kv_cache_memory_bytes} bytes"
            raise MemoryError(f"loading {path}: out of memory for the weights or the KV cache "
                              f"(kv_cache_memory_bytes: {kv}), or for what config.json's sizes ask (a "
                              f"config far larger than its tensors): {e}") from None
        return cls(native, path)

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def canvas_length(self) -> int:
        return self.config["canvas_length"]

    @property
    def dtype(self) -> str:
        return _DTYPE_NAMES[self._native.dtype]

    @property
    def kv_cache_dtype(self) -> str:
        """How the KV cache stores keys and values: "float32" or "bfloat16"."""
        return _DTYPE_NAMES[self._native.kv_cache_dtype]

    @property
    def device(self) -> str:
        return self._native.device

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt and generated tokens) one request may reach: within
        max_position_embeddings, and what the whole KV cache holds at the model's canvas."""
        return self._native.max_sequence_tokens

    def cache_stats(self) -> dict:
        """KV cache occupancy: kv_blocks_total, kv_blocks_free, prefix_cache_queries/hits (tokens)."""
        return self._native.cache_stats()

    def sequence(self, canvas_length: Optional[int] = None) -> "Sequence":
        """A new, empty sequence with its own KV cache; canvas_length narrows its canvas."""
        return Sequence(self, canvas_length)

    def __repr__(self) -> str:
        return f"Model({self.path!r}, device={self.device!r}, dtype={self.dtype!r})"


class Sequence:
    """One sequence's KV cache and the three passes over it."""

    def __init__(self, model: Model, canvas_length: Optional[int] = None):
        if not isinstance(model, Model):
            raise ValueError(f"model must be a diffuserve Model, got {type(model).__name__}")
        if canvas_length is not None:
            canvas_length = check_int("canvas_length", canvas_length, 1)
        self.model = model
        self._native = model._native.sequence(canvas_length or 0)

    @property
    def canvas_length(self) -> int:
        return self._native.canvas_length

    def prefill(self, prompt_ids) -> None:
        """Causal encoder pass over the prompt (or a further chunk of it); appends KV."""
        self._native.prefill(check_token_ids(prompt_ids, "prefill", self.model.vocab_size))

    def denoise(self, canvas_ids, self_conditioning_logits=None) -> np.ndarray:
        """Bidirectional decoder pass over a canvas; returns softcapped fp32 logits [canvas, vocab].

        self_conditioning_logits: None on a block's first step, else the previous step's
        (temperature-processed) logits, [canvas, vocab].
        """
        canvas = check_token_ids(canvas_ids, "denoise", self.model.vocab_size)
        sc = None
        if self_conditioning_logits is not None:
            sc = _float32_logits(self_conditioning_logits)
            if sc.ndim == 3 and sc.shape[0] == 1:
                sc = sc[0]
            if sc.ndim != 2:  # (two dimensions of another shape: the native call names the canvas first)
                raise ValueError(f"denoise: self_conditioning_logits must have shape [{self.canvas_length}, "
                                 f"{self.model.vocab_size}], got {list(sc.shape)}")
        return self._native.denoise(canvas, sc)

    def commit(self, canvas_ids) -> None:
        """Causal encoder pass over a finished block; appends its KV."""
        self._native.commit(check_token_ids(canvas_ids, "commit", self.model.vocab_size))

    def kv(self, layer: int):
        """(keys, values, first_position) of one layer: [kv_heads, rows, head_dim] fp32 (their
        bf16 values where the model's kv_cache_dtype is "bfloat16").

        Sliding-window layers hold only the last sliding_window - 1 rows."""
        return self._native.kv(check_int("layer", layer, 0, self.model.config["num_layers"] - 1))

    def kv_blocks(self) -> dict:
        """KV blocks this sequence holds: {"full": ..., "sliding": ...}."""
        return self._native.kv_blocks()

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"Sequence(tokens={len(self)}, canvas_length={self.canvas_length}, model={self.model!r})"

    def __reduce__(self):
        # (A copy would share this sequence's KV cache, and commits to one would show in the
        # other.)
        raise TypeError("a Sequence cannot be copied or pickled: it is its KV cache on the model; prefill a new one")
