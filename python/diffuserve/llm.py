"""LLM: offline generation over a loaded model.

    llm = ds.LLM(path)
    outs = llm.generate([[2, 17, 5], [2, 9]], ds.SamplingParams(max_new_tokens=64, seed=0))
    outs[0].token_ids, outs[0].finish_reason, outs[0].denoise_steps, outs[0].tokens_per_forward
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from . import _core
from .model import Model, _token_ids
from .sampling import SamplingParams


@dataclass
class RequestOutput:
    prompt_token_ids: List[int]
    token_ids: List[int]             # generated tokens, up to and including an EOS
    finish_reason: str               # "stop" (EOS) or "length" (max_new_tokens)
    denoise_steps: List[int]         # decoder passes of each block
    tokens_per_forward: float        # generated tokens (pad ids excluded) per decoder pass
    seed: int                        # the seed used (drawn fresh when none was given)
    text: Optional[str] = field(default=None)  # None: no tokenizer in this build yet


class LLM:
    """A model ready to generate. The whole denoise loop of a block runs in the runtime."""

    def __init__(self, path=None, device: str = "cpu", dtype: Optional[str] = None, num_threads: int = 0):
        if path is None:
            raise ValueError("no model path given, and the bundled default model is not part of this build yet")
        self.model = Model.load(path, device=device, dtype=dtype, num_threads=num_threads)

    def generate(self, prompts, params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> List[RequestOutput]:
        """prompts: a list of token-id lists (or one token-id list); params: one SamplingParams
        for all, or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], str)):
            raise ValueError("text prompts need a tokenizer, which this build does not have yet: pass token ids")
        if len(prompts) and not hasattr(prompts[0], "__len__"):
            prompts = [prompts]  # a single prompt given as one list of ids
        vocab = self.model.vocab_size
        ids = [_token_ids(p, f"prompt {i}", vocab).tolist() for i, p in enumerate(prompts)]
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        if params is None:
            params = SamplingParams()
        plist = [params] if isinstance(params, SamplingParams) else list(params)
        if len(plist) not in (1, len(ids)):
            raise ValueError(f"{len(plist)} SamplingParams for {len(ids)} prompts (give one, or one per prompt)")
        for i, p in enumerate(plist):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        native = [p._native(self.model._native.sampling_defaults()) for p in plist]
        outs = _core.generate(self.model._native, ids, native)
        return [RequestOutput(prompt_token_ids=prompt, token_ids=list(o.token_ids), finish_reason=o.finish_reason,
                              denoise_steps=list(o.denoise_steps), tokens_per_forward=o.tokens_per_forward, seed=o.seed)
                for prompt, o in zip(ids, outs)]
