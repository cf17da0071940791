"""LLM: generation over a loaded model with continuous batching.

    llm = ds.LLM(path)
    outs = llm.generate([[2, 17, 5], [2, 9]], ds.SamplingParams(max_new_tokens=64, seed=0))
    outs[0].token_ids, outs[0].finish_reason, outs[0].denoise_steps, outs[0].tokens_per_forward
    outs = llm.generate(["Once upon a time"])   # text prompts when the checkpoint has a tokenizer
    outs[0].text

For serving, add_request / step / abort drive the same machinery one step at a time.
"""
from __future__ import annotations

import _thread
import contextlib
import functools
import itertools
import os
import signal
import threading
import weakref
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm

from . import _core
from ._checks import INT64_MAX, check_bool, check_encoded, check_int, check_token_ids
from .chat_template import EMPTY_CHAT_PROMPT, loops_over_content, names_role
from .model import Model
from .sampling import SamplingParams, check_stop_strings
from .scheduler import Scheduler
from .stop_strings import StopWatch
from .tokenizer import TEMPLATE_ARGUMENTS, Tokenizer, null_stop_eos


@contextlib.contextmanager
def _signals_held():
    """Python's signal handlers run at the block's end rather than within it, on the main
    thread (where Python runs them): an exception a handler raises (KeyboardInterrupt at
    Ctrl-C, a timeout's at SIGALRM) surfaces as the block ends. Raised within it, between the
    engine's work and the scheduler's bookkeeping of it, one had lost the outputs of the
    requests that finished, left ids the engine had dropped listed as running (every later
    step failing on them), or a request admitted by the engine still queued. (The engine's
    work does not look at signals, so nothing waits longer; each signal's handler runs
    once, in the order they came.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: handler for sig in signal.valid_signals() if callable(handler := signal.getsignal(sig))}
    caught = {}  # signal -> the frame it first came in, in arrival order
    for sig in handlers:
        signal.signal(sig, lambda signum, frame: caught.setdefault(signum, frame))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sig, frame in caught.items():
            handlers[sig](sig, frame)


@dataclass
class CompletionOutput:
    """vLLM's CompletionOutput: what RequestOutput.outputs holds (a request has one)."""
    index: int
    text: str
    token_ids: List[int]
    finish_reason: str
    stop_reason: Union[str, int, None] = None  # as RequestOutput's


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: List[int]
    token_ids: List[int]             # generated tokens, up to and including an EOS
    finish_reason: str               # "stop" (EOS), "length" (max_new_tokens, max_length) or "error" (see error)
    denoise_steps: List[int]         # decoder passes of each block
    tokens_per_forward: float        # generated tokens (pad ids excluded) per decoder pass, as transformers
                                     # counts them: the last block whole, past a max_new_tokens cut; the pad
                                     # id is generation_config.json's (none: past the EOS too)
    seed: int                        # the seed used (drawn fresh when none was given)
    text: str = ""  # the tokens decoded, EOS excluded; "" without a tokenizer (as vLLM's without one)
    error: Optional[str] = field(default=None)  # with finish_reason "error": why (its logits were not finite)
    prompt: Optional[str] = None  # the prompt's text, where it was given as text (vLLM's; None for token ids)
    # With finish_reason "stop", as vLLM's: the stop string that ended it, or the id that did
    # (None for the EOS: the tokenizer's, else the checkpoint's first).
    stop_reason: Union[str, int, None] = None

    @property
    def outputs(self) -> List[CompletionOutput]:
        """vLLM's form of the output, its one completion: code written for vLLM reads
        `output.outputs[0].text`."""
        return [CompletionOutput(index=0, text=self.text, token_ids=self.token_ids, finish_reason=self.finish_reason,
                                 stop_reason=self.stop_reason)]


class _Request(NamedTuple):
    """What the LLM keeps of a queued request for its output."""
    prompt_token_ids: List[int]
    prompt: Optional[str]  # its text, where given as text
    include_stop: bool  # its text ends with what ended it (include_stop_str_in_output)


class _TurnLock(_thread.RLock):
    """The LLM's lock, which a thread cannot take back while another waits for it: the waiting
    thread holds a turnstile that every thread passes to take the lock. A plain RLock let a
    thread stepping in a loop release it and take it again before a waiting thread woke, so
    that an abort() after interrupt() had waited a whole further slice of passes (4 of 20
    tries, 240 ms each on a small model). Its exit is RLock's own, in C: a signal handler's
    exception cannot come between a call's return value and the lock's release (with a
    Python __exit__, the SIGALRM test had lost a step's outputs in 2 of 13 runs)."""

    def __init__(self):
        super().__init__()
        # (Reentrant: a signal handler that calls the LLM runs within this thread's wait for the
        # lock, holding the turnstile.)
        self._turnstile = threading.RLock()

    def __enter__(self):  # (by a thread that does not hold the lock: _locked says why)
        try:
            with self._turnstile:
                self.acquire()
        except BaseException:  # a signal's exception (Ctrl-C) while waiting, or just after the lock came
            if self._is_owned():
                self.release()
            raise
        return self


def _locked(method):
    """The method, run holding the LLM's lock (LLM.__init__ says why)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._forked_in_use:
            raise ValueError("this LLM was in use by another thread when the process forked: in this process its "
                             "state is that call's, half done, and that thread does not exist; create the LLM again "
                             "here (or fork while no thread uses it)")
        if self._lock._is_owned():  # within this thread's own call (generate's steps): held already,
            return method(self, *args, **kwargs)  # and the turnstile may be another's, waiting for it
        with self._lock:
            return method(self, *args, **kwargs)
    return run


# The LLMs of this process, for the fork handler below.
_LLMS: "weakref.WeakSet[LLM]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A fork copies an LLM's lock as it is. In a child forked while another thread's call held
    it, that thread does not exist, the lock stays held for good (the child had waited forever)
    and the scheduler's state is that call's, half done: the LLM refuses every call there. The
    others get a new lock (a thread that was waiting for one holds its turnstile)."""
    for llm in list(_LLMS):
        if llm._lock.acquire(blocking=False):
            llm._lock.release()
        else:
            llm._forked_in_use = True
        llm._lock = _TurnLock()
        llm._claimed = set()  # (no AsyncLLM's thread is in the child: its step() returns them all)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _is_one_id(item) -> bool:
    """Whether a prompts list's item is one token id (the list is then one prompt): no sequence,
    or a 0-d array or tensor (list(tensor)'s items), which has __len__ but is an id; not a
    numpy string, 0-d too, but a text."""
    return not isinstance(item, (str, bytes)) and (not hasattr(item, "__len__") or getattr(item, "ndim", None) == 0)


# vLLM's engine arguments that have no equivalent here, and what takes their place: those of
# the LLM and the CLI's alike (the CLI's options are their names with dashes), then the LLM's own.
VLLM_ENGINE_ARGUMENTS = {
    "tensor_parallel_size": "one GPU runs the whole model (device cuda:N)",
    "pipeline_parallel_size": "one GPU runs the whole model (device cuda:N)",
    "trust_remote_code": "no checkpoint code runs: DiffusionGemma is built in",
    "enable_prefix_caching": "prefix caching is always on",
    "tokenizer": "the checkpoint's tokenizer.json is used",
    "enforce_eager": "CUDA graphs are switched off by DIFFUSERVE_CUDA_GRAPHS=0",
}
_VLLM_ARGUMENTS = {
    **VLLM_ENGINE_ARGUMENTS,
    "gpu_memory_utilization": "the KV cache is sized by kv_cache_memory_bytes (default on a GPU: 80% of what the "
                              "weights leave)",
    "seed": "each request's SamplingParams(seed=...) seeds it",
}


def _params_given(params, sampling_params):
    """generate's and chat's parameters, given by our name or by vLLM's (`sampling_params`)."""
    if params is not None and sampling_params is not None:
        raise ValueError("give params or sampling_params (vLLM's name for it), not both")
    return params if sampling_params is None else sampling_params


def _sampling_params(value, where: str) -> SamplingParams:
    """`value`, which must be a SamplingParams; `where` names it in the error."""
    if not isinstance(value, SamplingParams):
        raise ValueError(f"{where} must be a SamplingParams, got {type(value).__name__}")
    return value


class LLM:
    """A model with a KV cache and a scheduler. Limits are constructor arguments:

    kv_cache_memory_bytes: the paged KV cache (default: on the CPU a quarter of RAM, at most 4
    GiB; on a GPU 80% of what the weights leave free);
    max_num_seqs: requests running at once; max_num_batched_tokens: rows per forward pass
    (default max(4096, 4 canvases)); slice_steps: forward passes per engine step;
    fuse_commit: commit a block in the same forward as the next block's first step.
    load_format, quantization: as Model.load (random weights for benchmarks); activations: as
    Model.load ("float32", or "bfloat16" for bf16-rounded linear inputs, faster on the GPU);
    kv_cache_dtype: as Model.load ("auto": bf16 where activations are and the device allows);
    max_model_len: as Model.load (the longest sequence a request may reach; None: the model's).
    model: vLLM's name for path (LLM(model=...)); vLLM's other arguments are refused naming
    what takes their place.
    Threads may share an LLM: its calls run one at a time, and generate calls made at once
    run one after the other; a thread waiting for the LLM has it before a thread that just
    had it takes it again (a thread stepping in a loop lets another's abort in between steps).
    """

    def __init__(self, path=None, device: str = "cpu", dtype: Optional[str] = None, num_threads: int = 0,
                 kv_cache_memory_bytes: Optional[int] = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: Optional[int] = None, kv_block_size: int = 16, slice_steps: int = 8,
                 fuse_commit: bool = True, load_format: str = "auto", quantization: Optional[str] = None,
                 activations: str = "float32", kv_cache_dtype: str = "auto",
                 max_model_len: Optional[int] = None, *, model=None, **others):
        if others:  # (a TypeError as Python's own, naming what takes the place of vLLM's)
            name = next(iter(others))
            hint = _VLLM_ARGUMENTS.get(name)
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}" +
                            (f" (vLLM's: {hint})" if hint else ""))
        if path is not None and model is not None:
            raise ValueError("give path or model (vLLM's name for it), not both")
        path = path if model is None else model
        if path is None:  # the bundled Sudoku model
            from . import default_model
            path = default_model()
        # (Model.load checks the model's own arguments: kv_block_size, max_num_seqs, ...)
        slice_steps, fuse_commit = check_int("slice_steps", slice_steps, 1), check_bool("fuse_commit", fuse_commit)
        self.model = Model.load(path, device=device, dtype=dtype, num_threads=num_threads,
                                kv_cache_memory_bytes=kv_cache_memory_bytes, kv_block_size=kv_block_size,
                                max_num_seqs=max_num_seqs, load_format=load_format, quantization=quantization,
                                activations=activations, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len)
        canvas = self.model.canvas_length
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(4096, 4 * canvas)
        max_num_batched_tokens = check_int(f"max_num_batched_tokens (at least canvas_length, {canvas})",
                                           max_num_batched_tokens, canvas, INT64_MAX)
        self._engine = _core.Engine(self.model._native, fuse_commit)
        # The engine is used by one thread at a time: every call below holds this lock, and
        # generate holds it until its outputs are done (a step returns whichever requests
        # finished, so two generate loops must not share steps).
        self._lock = _TurnLock()
        self._forked_in_use = False  # (_after_fork_in_child)
        _LLMS.add(self)
        self.scheduler = Scheduler(self._engine, int(max_num_seqs), max_num_batched_tokens, slice_steps)
        self.tokenizer = Tokenizer.from_checkpoint(self.model.path)  # None when the checkpoint has no tokenizer.json
        generation = self.model.config["generation"]
        self._eos_token_id = null_stop_eos(self.tokenizer, generation["eos_token_ids"])  # (its stop_reason is None)
        self._pad_token_id = generation["pad_token_id"]
        self._ids = itertools.count()
        self._prompts = {}  # request id -> its _Request
        self._stops = {}  # request id -> (StopWatch, seed) of a request with stop strings
        self._held: List[RequestOutput] = []  # outputs a step saw finish that another caller is to get
        # Requests an AsyncLLM streams: only its own steps return their outputs (a plain step()
        # loop in another thread had taken them, and the AsyncLLM then failed every request).
        self._claimed: set = set()

    @_locked
    def add_request(self, prompt, params: Optional[SamplingParams] = None) -> int:
        """Queues one request (token ids, or text when the checkpoint has a tokenizer, or either
        as vLLM's {"prompt_token_ids": ids} / {"prompt": text}); returns its id."""
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:  # (vLLM's images beside a prompt: DiffusionGemma's vision tower)
                raise ValueError("this engine is text-only: a prompt's multi_modal_data (images) is not supported")
            if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} >= set(prompt):
                raise ValueError(f"a prompt given as a dict holds one of 'prompt' (text) or 'prompt_token_ids', got "
                                 f"the keys {sorted(map(str, prompt))}")
            [(key, prompt)] = prompt.items()
            # (The other kind had been taken silently: ids under "prompt", a text under
            # "prompt_token_ids" encoded.)
            if (key == "prompt") != isinstance(prompt, str):
                raise ValueError("a prompt given as a dict holds text under 'prompt' and token ids under "
                                 f"'prompt_token_ids', got {type(prompt).__name__} under {key!r}")
        if isinstance(prompt, (bytes, bytearray)):  # (numpy would read its characters as ids)
            raise ValueError("a prompt is text (str) or token ids, got bytes: decode them to str first")
        text = str(prompt) if isinstance(prompt, str) else None  # (numpy's string array gives np.str_)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this checkpoint has no tokenizer.json: "
                                 "pass token ids")
            prompt = check_encoded(self.tokenizer.encode(prompt), "prompt", self.model.vocab_size)
        ids = check_token_ids(prompt, "prompt", self.model.vocab_size).tolist()
        if not ids:
            raise ValueError("prompt is empty")
        params = _sampling_params(SamplingParams() if params is None else params, "params")
        native = params._native(self.model._native.sampling_defaults())
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        stop = check_stop_strings(params.stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings are looked for in the text, and this checkpoint has no tokenizer.json")
        if stop and native.seed is None:  # (drawn here, as the runtime would: an output stopped early reports it)
            native.seed = int.from_bytes(os.urandom(8), "little")
        request_id = next(self._ids)
        try:
            with _signals_held():
                self.scheduler.add(request_id, ids, native)
                self._prompts[request_id] = _Request(ids, text, params.include_stop_str_in_output)
                if stop:
                    self._stops[request_id] = StopWatch(self.tokenizer, stop, params.include_stop_str_in_output), \
                        native.seed
        except BaseException:  # refused, or a signal's exception as it was queued: the caller has no id to abort
            self.abort(request_id)
            raise
        return request_id

    @_locked
    def abort(self, request_id: int) -> None:
        """Cancels a request; its KV is freed at once (an id that is not running: nothing to do)."""
        check_int("request_id", request_id, 0, INT64_MAX)
        with _signals_held():
            self.scheduler.abort(request_id)
            self._prompts.pop(request_id, None)
            self._stops.pop(request_id, None)
            self._claimed.discard(request_id)
            # One that a generate call saw finish is dropped too (a later step had still returned it).
            self._held = [out for out in self._held if out.request_id != request_id]

    @_locked
    def has_unfinished(self) -> bool:
        return bool(self._held) or self.scheduler.has_unfinished()

    @_locked
    def generated(self, request_id: int) -> List[int]:
        """Tokens of the blocks a running request has finished so far (for streaming)."""
        return list(self._engine.generated(check_int("request_id", request_id, 0, INT64_MAX)))

    @_locked
    def denoise_steps(self, request_id: int) -> List[int]:
        """Denoise steps of each block a running request has finished so far."""
        return list(self._engine.denoise_steps(check_int("request_id", request_id, 0, INT64_MAX)))

    @_locked
    def draft(self, request_id: int) -> List[int]:
        """The argmax canvas of the block a request is refining, cut where max_new_tokens cuts
        the last block ([] between blocks, and where its latest logits held NaN or infinity:
        the request fails at its next step)."""
        return list(self._engine.draft(check_int("request_id", request_id, 0, INT64_MAX)))

    def interrupt(self) -> None:
        """Ends the step in progress after its current pass (or the next step after its
        first), so that another thread waiting to abort a request need not wait for the whole
        slice. Takes no lock: meant to be called while step() runs."""
        self._engine.interrupt()

    @_locked
    def step(self) -> List[RequestOutput]:
        """Runs one scheduler step; returns the requests that finished in it (and those of
        add_request that a generate call saw finish). Not those an AsyncLLM streams: it gets them."""
        return self._step_for(frozenset())

    def _step_for(self, claimant: frozenset) -> List[RequestOutput]:
        """step() for the caller whose claimed requests are `claimant` (an AsyncLLM's): the
        outputs of requests others claim are held for their next step."""
        others = self._claimed - claimant
        held, self._held, outputs = self._held, [], []
        try:
            with _signals_held():
                outputs = [self._output(request_id, out) for request_id, out in self.scheduler.step()]
                outputs += self._stopped()
                self._held.extend(out for out in held + outputs if out.request_id in others)
                # (Returned within the block: a signal's exception raised as it ends goes below.)
                return [out for out in held + outputs if out.request_id not in others]
        except BaseException:  # the step failed (its outputs go out with the next), or a signal's exception
            # (raised as the block ends, after it filed theirs): every output back, once.
            filed = {id(out) for out in held + outputs}
            self._held = held + outputs + [out for out in self._held if id(out) not in filed]
            raise

    @_locked
    def generate(self, prompts, params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> List[RequestOutput]:
        """prompts: a list of prompts, each token ids or text (or vLLM's dict of either: see
        add_request), or one such prompt; params (or vLLM's name for it, sampling_params): one
        SamplingParams for all, or one per prompt; use_tqdm: a progress bar of the prompts done,
        on stderr (vLLM's, which shows one by default). Returns the outputs in prompt order."""
        params = _params_given(params, sampling_params)
        check_bool("use_tqdm", use_tqdm)
        if hasattr(prompts, "__array__") and not isinstance(prompts, np.ndarray):
            # Another library's array (a torch tensor: transformers' input_ids, one prompt or a
            # batch's rows), as add_request takes one (it had been refused as no list).
            try:
                prompts = np.asarray(prompts)
            except (TypeError, RuntimeError, NotImplementedError) as e:  # (bf16, meta, on a GPU)
                raise ValueError(f"prompts: token ids must be integers numpy can read, got "
                                 f"{getattr(prompts, 'dtype', type(prompts).__name__)} ({e})") from None
        if not isinstance(prompts, (str, dict, list, tuple, np.ndarray)) or getattr(prompts, "ndim", 1) == 0:
            got = f"a 0-d array, {prompts!r}" if isinstance(prompts, np.ndarray) else type(prompts).__name__
            raise ValueError(f"prompts must be a list of prompts (token ids or text), got {got}")
        # Texts (one each), or an object array's items (texts, id lists: pandas' .values), not
        # one prompt of ids.
        if isinstance(prompts, np.ndarray) and prompts.dtype.kind in "USO":
            prompts = prompts.tolist()
        if isinstance(prompts, (str, dict)) or (len(prompts) and _is_one_id(prompts[0])) or \
                (isinstance(prompts, np.ndarray) and prompts.ndim == 1):  # (an empty one too: had returned [])
            prompts = [prompts]  # a single prompt: one text, or one list of ids
        plist = [params if params is not None else SamplingParams()] if not isinstance(params, (list, tuple)) \
            else list(params)
        if len(plist) not in (1, len(prompts)):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts (give one, or one per prompt)")
        for i, p in enumerate(plist):  # (a fault of params, not named after a prompt as add_request's would be)
            _sampling_params(p, f"params[{i}]" if isinstance(params, (list, tuple)) else "params")
        # Request id -> its prompt's index, in prompt order (a list's scans had made a call
        # quadratic in its prompts).
        index, done = {}, {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", unit="prompt", disable=not use_tqdm)
        try:
            for i, prompt in enumerate(prompts):
                with _signals_held():  # (the request's id filed as it is queued)
                    try:
                        index[self.add_request(prompt, plist[0] if len(plist) == 1 else plist[i])] = i
                    except ValueError as e:
                        raise ValueError(f"prompt {i}: {e}") from None
            while len(done) < len(index):
                with _signals_held():  # every output of the step filed before a signal's exception surfaces
                    outs = self.step()
                    for out in outs:
                        if out.request_id not in index:  # one queued by add_request: the next step returns it
                            self._held.append(out)
                        else:
                            done[out.request_id] = out
                            bar.update()
                failed = [out for out in outs if out.request_id in index and out.finish_reason == "error"]
                if failed:
                    raise _core.CheckpointError(f"prompt {index[failed[0].request_id]}: {failed[0].error}")
        except BaseException:  # a prompt or a step refused, or an interrupt: none of this call's requests stays queued
            with _signals_held():
                for request_id in index:
                    if request_id not in done:
                        self.abort(request_id)
            raise
        finally:
            bar.close()
        return [done[request_id] for request_id in index]

    def chat(self, messages, params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             chat_template: Optional[str] = None, add_generation_prompt: Optional[bool] = None,
             continue_final_message: Union[bool, str] = False, tools=None,
             chat_template_kwargs: Optional[dict] = None, *,
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False) -> List[RequestOutput]:
        """The model's turn in a conversation (a list of {"role", "content"} messages), or in each
        of a list of conversations, as vLLM's LLM.chat: the messages read as the server's chat
        reads them (OpenAI's roles; content a string or text parts; tool calls' JSON arguments),
        rendered by the chat template (Tokenizer.apply_chat_template, which takes the other
        arguments) and encoded without the tokenizer's own special tokens, which the template
        writes (its text given to generate would begin with a second <bos>). params (or
        sampling_params) and use_tqdm: as generate's."""
        params = _params_given(params, sampling_params)
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json, so no chat template: give generate token ids")
        if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a conversation (a list of message dicts) or a list of them, "
                             f"got {messages!r:.200}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r:.200}")
        taken = sorted(set(chat_template_kwargs or {}) & (TEMPLATE_ARGUMENTS | {"tools"}))
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: chat's own arguments")
        from .protocol import ApiError, TokenizeChatRequest, parse  # (the server's reading of messages)

        source = self.tokenizer.get_chat_template(chat_template, tools)
        names_developer, takes_parts = names_role(source, "developer"), loops_over_content(source)  # (once a call)
        prompts, texts = [], []
        for i, conversation in enumerate(conversations):
            try:  # the messages as the server's chat gives them to the template (text parts, roles, tool calls)
                read = parse(TokenizeChatRequest, {"messages": list(conversation)}).conversation(
                    names_developer, takes_parts)
            except ApiError as e:
                raise ValueError(f"conversation {i}: " + (f"{e.param}: " if e.param else "") + e.message) from None
            text = self.tokenizer.apply_chat_template(
                read, add_generation_prompt=add_generation_prompt, chat_template=source, tools=tools,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            if not text:
                raise ValueError(f"conversation {i}: {EMPTY_CHAT_PROMPT}")
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
            texts.append(text)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text  # (as vLLM's chat gives it: the rendered conversation)
        return outputs

    def get_tokenizer(self) -> Optional[Tokenizer]:
        """vLLM's name for `tokenizer` (None where the checkpoint has no tokenizer.json)."""
        return self.tokenizer

    @_locked
    def stats(self) -> dict:
        """Scheduler and KV-cache occupancy."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "preemptions": self.scheduler.preemptions, "forward_passes": self._engine.passes,
                **self.model.cache_stats()}

    def _output(self, request_id: int, out) -> RequestOutput:
        request = self._prompts.pop(request_id)
        token_ids = list(out.token_ids)
        ended_by = token_ids[-1] if out.finish_reason == "stop" else None  # the EOS id that ended it
        output = RequestOutput(request_id=request_id, prompt_token_ids=request.prompt_token_ids,
                               token_ids=token_ids, finish_reason=out.finish_reason,
                               denoise_steps=list(out.denoise_steps), tokens_per_forward=out.tokens_per_forward,
                               seed=out.seed,
                               text=self._text(token_ids[:-1] if ended_by is not None and not request.include_stop
                                               else token_ids),
                               error=out.error or None, prompt=request.prompt,
                               stop_reason=None if ended_by == self._eos_token_id else ended_by)
        watch, _ = self._stops.pop(request_id, (None, None))
        if watch is not None and out.finish_reason != "error":  # its last blocks' text may hold a stop string
            text_ids = token_ids[:-1] if ended_by is not None else token_ids
            through = watch.push(text_ids, final=True)
            if through is not None:
                output.token_ids, output.text = text_ids[:through], watch.text
                output.finish_reason, output.stop_reason = "stop", watch.stop_string
        return output

    def _stopped(self) -> List[RequestOutput]:
        """The running requests whose text so far holds one of their stop strings, each
        aborted and its output cut there (through the token that ends the stop string, as the
        server counts it)."""
        outputs = []
        for request_id, (watch, seed) in list(self._stops.items()):
            if request_id in self.scheduler.waiting:  # (no new tokens: 20,000 queued had cost 23 ms a step)
                continue
            tokens = list(self._engine.generated(request_id))
            through = watch.push(tokens) if len(tokens) > watch.fed else None
            if through is None:
                continue
            steps = list(self._engine.denoise_steps(request_id))
            request = self._prompts.pop(request_id)
            del self._stops[request_id]
            self.scheduler.abort(request_id)
            # Tokens per forward as the runtime counts them: the finished blocks whole, the pad id left out.
            counted = sum(token != self._pad_token_id for token in tokens)
            outputs.append(RequestOutput(
                request_id=request_id, prompt_token_ids=request.prompt_token_ids, token_ids=tokens[:through],
                finish_reason="stop", denoise_steps=steps, tokens_per_forward=counted / max(sum(steps), 1), seed=seed,
                text=watch.text, prompt=request.prompt, stop_reason=watch.stop_string))
        return outputs

    def _text(self, token_ids: List[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode_output(token_ids)
