"""The OpenAI request bodies the server accepts, checked strictly, and their translation
into SamplingParams.

Every field is declared; anything else is refused with a 400 that names it, so a client
never believes a parameter took effect when it did not. A few OpenAI parameters are
accepted only at the value that means "off" (top_p 1, penalties 0, logprobs false, ...),
because common clients send those defaults explicitly; and any parameter given as null is
taken as not given, as OpenAI takes it.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, FailFast, Field, ValidationError, field_validator

from ._checks import check_unicode
from .sampling import SamplingParams, length_untold
from .tokenizer import TEMPLATE_ARGUMENTS

# Value at which an OpenAI parameter we do not implement changes nothing (older LangChain sent
# best_of 1 with every request).
# vLLM's sampling extras too, which clients written for it send at their defaults (top_k -1, or
# 0 in its newer releases).
_NEUTRAL = {"top_p": (1,), "frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (False,),
            "top_logprobs": (0,), "best_of": (1,), "response_format": ({"type": "text"},),
            "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "min_tokens": (0,),
            "skip_special_tokens": (True,),
            "spaces_between_special_tokens": (True,)}


def _is_neutral(value, neutrals) -> bool:
    """Whether `value` is one of the field's neutral ones, of its own type: a bool is no number
    here (top_p true), nor a number a bool (legacy completions' logprobs 0 still asks for the
    sampled token's log-probability)."""
    def equal(neutral):
        if isinstance(neutral, bool) or isinstance(value, bool):
            return value is neutral
        if isinstance(neutral, dict):
            return value == neutral
        return isinstance(value, (int, float)) and value == neutral
    return any(equal(neutral) for neutral in neutrals)


# The coldest scale `temperature` gives the checkpoint's schedule: 0 and every temperature
# below this one sample with it (the sampler needs T > 0).
_COLDEST_SCALE = 1e-3

# The most choices (prompts times n) one request may ask for. Each is an engine request with
# its own state on the event loop, and the engine runs a few dozen at a time (--max-num-seqs):
# more are better sent as several requests. (2,000 prompts with n = 64, 128,000 choices, had
# kept /health waiting 21 s while they were admitted, and each garbage collection 1.6 s.)
MAX_CHOICES = 4096
# The most stop strings a request may give, and their most characters in all: each is looked
# for in every piece of text, from its length before the piece on.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 65536
# The most distinct stop_token_ids a request may give: the engine looks for each in every block.
MAX_STOP_TOKEN_IDS = 4096
# The most allowed_token_ids a request's choices hold in all: each choice keeps its own
# (2 MB a choice at a 262,144-token vocabulary, and 24 ms of the engine's thread to take:
# 4,096 choices of a 2 MB body had asked for 8 GB).
MAX_ALLOWED_IDS = 2**24

# OpenAI's range of a logit_bias value: -100 bans a token in effect, 100 makes it the only choice.
MAX_LOGIT_BIAS = 100

# Lists whose items pydantic checks one by one stop at the first bad item: it had described
# every one (2 million bad items in a 10 MiB body took 58 s and 8.5 GB to refuse).
class _FailFast(FailFast):
    __hash__ = object.__hash__  # (typing hashes a Union's members; pydantic's dataclass is unhashable)


Ids = Annotated[List[int], _FailFast()]
Texts = Annotated[List[str], _FailFast()]


class ApiError(Exception):
    """An error answered with OpenAI's error body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None  # null: not given, as at the top level
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: Optional[bool] = None


class _GenerationRequest(_Strict):
    """What completions and chat completions share: OpenAI's sampling parameters and the
    diffusion extensions."""
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    # OpenAI's seed is a signed 64-bit integer: a negative one is taken modulo 2**64.
    seed: Optional[int] = Field(None, ge=-2**63, lt=2**64)
    stop: Union[str, Texts, None] = Field(None)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # Sent by clients to identify their end users: it does not affect generation, but is a
    # string, as OpenAI's (a dict or a number had been accepted).
    user: Optional[str] = None
    # OpenAI's: token ids (as strings, JSON's keys) -> a bias added to their logits. Its values are
    # checked by token_bias, which stops at the first bad one (pydantic described every one: a
    # 72 MiB body of bad values had taken 45 s and 8 GB to refuse).
    logit_bias: Optional[Dict[str, Any]] = None
    # Diffusion extensions (SamplingParams' names).
    canvas_length: Optional[int] = Field(None, ge=1)
    max_denoising_steps: Optional[int] = Field(None, ge=1)
    entropy_bound: Optional[float] = Field(None, gt=0)
    t_min: Optional[float] = Field(None, ge=0)
    t_max: Optional[float] = Field(None, gt=0)
    stability_threshold: Optional[int] = Field(None, ge=0)
    confidence_threshold: Optional[float] = Field(None, gt=0)
    seed_canvas: Optional[Ids] = None
    pinned_positions: Optional[Ids] = None
    allowed_token_ids: Optional[Ids] = None
    self_conditioning: bool = True
    stream_drafts: bool = False  # stream the argmax canvas of the block being refined
    # vLLM's: each choice's token ids beside its text (null: where the model has no tokenizer).
    return_token_ids: Optional[bool] = None
    # vLLM's: generation runs on past the checkpoint's EOS tokens, to max_tokens (benchmarks
    # send it for outputs of a fixed length).
    ignore_eos: bool = False
    # vLLM's: ids that end a choice as the checkpoint's EOS does (with ignore_eos too), each
    # choice's stop_reason naming the one that ended it.
    stop_token_ids: Optional[Ids] = None
    # vLLM's: the text ends with the stop string, or the text of the stop token, that ended it.
    include_stop_str_in_output: bool = False
    # vLLM's: only each prompt's last this many tokens are used (left truncation).
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)

    def stop_strings(self) -> List[str]:
        # (At most MAX_STOP_STRINGS: parse refuses more before validating them.)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stop:  # (as vLLM: an empty string would stop everywhere, or, skipped, not at all)
            raise ApiError(400, "stop: an empty string is not a stop string", param="stop")
        chars = sum(map(len, stop))
        if chars > MAX_STOP_CHARS:
            raise ApiError(400, f"stop: {chars} characters of stop strings, more than a request may give "
                                f"({MAX_STOP_CHARS})", param="stop")
        for i, s in enumerate(stop):  # (a lone surrogate would never match the text, which is valid Unicode)
            _check_unicode(s, f"stop[{i}]" if isinstance(self.stop, list) else "stop")
        return stop

    def sampling_params(self, defaults: dict, max_tokens: Optional[int], max_steps: int,
                        prompts: int = 1) -> List[SamplingParams]:
        """One SamplingParams per choice (n). With a seed, choice i uses seed + i, so the
        choices differ and the whole response is reproducible.

        temperature scales both ends of the checkpoint's temperature schedule (t_max at the
        first step, t_min at the last): 1 keeps it, 0 makes it near-greedy (a 1e-3 scale, as
        any temperature below it does; the sampler needs T > 0) and deterministic, as OpenAI's 0
        is: every choice takes the seed
        (0 where none is given), since the canvas's noise would otherwise still vary the text.
        An explicit t_min / t_max sets that end directly instead. Without max_tokens, the
        length generation_config.json gives, or where it gives none the whole context, is cut
        to the whole blocks that fit the context and the KV cache (as vLLM does).
        max_steps: the server's limit on max_denoising_steps; prompts: how many the request
        has (each takes the n choices)."""
        fit = max_tokens is None
        eos = self.eos_token_ids(defaults["eos_token_ids"], defaults["vocab_size"])
        max_tokens = length_untold(max_tokens, defaults["length_given"], defaults["context"])
        if self.temperature is not None and (self.t_min is not None or self.t_max is not None):
            raise ApiError(400, "give either temperature or t_min/t_max, not both", param="temperature")
        scale = None if self.temperature is None else max(self.temperature, _COLDEST_SCALE)
        t_min = self.t_min if scale is None else defaults["t_min"] * scale
        t_max = self.t_max if scale is None else defaults["t_max"] * scale
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.stream_drafts and not self.stream:
            raise ApiError(400, "stream_drafts is only allowed when stream is true", param="stream_drafts")
        if self.max_denoising_steps is not None and self.max_denoising_steps > max_steps:
            raise ApiError(400, f"max_denoising_steps {self.max_denoising_steps} exceeds this server's limit of "
                           f"{max_steps} a block (diffuserve serve --max-denoising-steps-limit)",
                           param="max_denoising_steps", code="invalid_value")
        # Each id once: the runtime takes them as a set (a list of a million copies, checked for each
        # of n choices, had taken minutes).
        allowed = None if self.allowed_token_ids is None else sorted(set(self.allowed_token_ids))
        if allowed is not None and prompts * self.n * len(allowed) > MAX_ALLOWED_IDS:
            raise ApiError(400, f"allowed_token_ids: {len(allowed)} ids for each of {prompts * self.n} choices, "
                                f"more than a request's choices may hold in all ({MAX_ALLOWED_IDS}): send fewer "
                                "choices a request", param="allowed_token_ids")
        if prompts * self.n * len(self.logit_bias or ()) > MAX_ALLOWED_IDS:
            raise ApiError(400, f"logit_bias: {len(self.logit_bias)} ids for each of {prompts * self.n} choices, "
                                f"more than a request's choices may hold in all ({MAX_ALLOWED_IDS}): send fewer "
                                "choices a request", param="logit_bias")
        bias = self.token_bias(defaults["vocab_size"])
        greedy = scale == _COLDEST_SCALE  # (a temperature of 1e-9 samples as 0 does, so is as reproducible)
        params = []
        for i in range(self.n):
            if greedy:  # every choice the same seed
                seed = (self.seed or 0) % 2**64
            else:
                seed = None if self.seed is None else (self.seed + i) % 2**64
            try:
                params.append(SamplingParams(
                    max_new_tokens=max_tokens, max_denoising_steps=self.max_denoising_steps, t_min=t_min,
                    t_max=t_max, entropy_bound=self.entropy_bound, stability_threshold=self.stability_threshold,
                    confidence_threshold=self.confidence_threshold, seed=seed, canvas_length=self.canvas_length,
                    seed_canvas=self.seed_canvas, pinned_positions=self.pinned_positions,
                    allowed_token_ids=allowed, logit_bias=bias, self_conditioning=self.self_conditioning,
                    eos_token_id=eos, fit_to_context=fit))
            except ValueError as e:
                raise invalid_value(e, self.parameter_names()) from None
        return params

    def token_bias(self, vocab_size: int) -> Optional[Dict[int, float]]:
        """logit_bias with its keys read as token ids (decimal digits, within the vocabulary)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # (At most ten digits: int() of a longer one could take long, and past 4,300 raises.)
            if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= vocab_size:
                raise ApiError(400, f"logit_bias: {key[:40]!r} is not a token id (an integer in [0, {vocab_size}) as a "
                                    "string)", param="logit_bias", code="invalid_value")
            if int(key) in bias:
                raise ApiError(400, f"logit_bias names token {int(key)} twice", param="logit_bias",
                               code="invalid_value")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ApiError(400, f"invalid value for 'logit_bias.{key}': a bias is a number from "
                                    f"{-MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}, got {json.dumps(value)[:40]}",
                               param=f"logit_bias.{key}", code="invalid_value")
            bias[int(key)] = value
        return bias

    def eos_token_ids(self, checkpoint_eos: List[int], vocab_size: int) -> Optional[List[int]]:
        """The ids that end each choice (None: the checkpoint's EOS alone): the checkpoint's EOS,
        unless ignore_eos, and the request's stop_token_ids."""
        stop_ids = sorted(set(self.stop_token_ids or []))
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ApiError(400, f"stop_token_ids: {len(stop_ids)} distinct ids, more than a request may give "
                                f"({MAX_STOP_TOKEN_IDS})", param="stop_token_ids")
        for i, token in enumerate(self.stop_token_ids or []):
            if not 0 <= token < vocab_size:
                raise ApiError(400, f"stop_token_ids[{i}] = {token} is out of range [0, {vocab_size})",
                               param="stop_token_ids", code="invalid_value")
        if not stop_ids:
            return [] if self.ignore_eos else None
        return ([] if self.ignore_eos else list(checkpoint_eos)) + stop_ids

    def stop_reason(self, token_id: int, checkpoint_eos: List[int], eos: Optional[int]) -> Optional[int]:
        """What stop_reason says of a choice that `token_id` ended, as vLLM: null for the EOS
        (`eos`, the tokenizer's), the id for one of stop_token_ids or for the checkpoint's other
        EOS ids (generation_config.json's, which vLLM makes stop tokens; <end_of_turn>, say)."""
        if self.ignore_eos:
            return token_id if token_id in (self.stop_token_ids or ()) else None
        if token_id == eos:
            return None
        return token_id if token_id in (self.stop_token_ids or ()) or token_id in checkpoint_eos else None

    def parameter_names(self) -> Dict[str, str]:
        """This request's names for what SamplingParams and the engine call otherwise."""
        return {"max_new_tokens": "max_tokens"}


def _check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise ApiError(400, f"a request may ask for at most {MAX_CHOICES} choices (prompts times n); this one asks "
                       f"for {prompts} x {n} = {prompts * n}: send the prompts in several requests", param="prompt",
                       code="invalid_value")


class CompletionRequest(_GenerationRequest):
    prompt: Union[str, Ids, Annotated[List[Union[str, Ids]], _FailFast()]]  # one prompt, or a batch
    echo: Literal[False] = False

    @field_validator("echo", mode="before")
    @classmethod
    def _echo_is_false_itself(cls, value):  # (0, which equals False, would pass the Literal)
        if value is not False:
            raise ValueError("only false is supported")
        return value

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts of this request: one text or token-id list, or a batch of them."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        _check_choices(len(self.prompt), self.n)
        return list(self.prompt)


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) reach the chat template as they are.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Annotated[List[Dict[str, Any]], _FailFast()], None] = None


class _Conversation(_Strict):
    """A chat request's messages and chat template controls (chat completions', and /tokenize's
    chat form, which renders them the same way)."""
    messages: Annotated[List[ChatMessage], _FailFast()] = Field(min_length=1)
    # vLLM's chat template controls: the prompt ends with a new assistant turn's header (the
    # default), or with continue_final_message inside the final message, for the model to go on
    # with it (a prefilled answer); chat_template_kwargs reach the template as variables (a
    # Gemma template's enable_thinking).
    add_generation_prompt: Optional[bool] = None
    continue_final_message: bool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    def template_options(self) -> Dict[str, Any]:
        """apply_chat_template's keyword arguments beside the conversation."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt exclude each other: the one "
                           "continues the final message, the other starts a new one", param="continue_final_message")
        variables = self.chat_template_kwargs or {}
        taken = sorted(set(variables) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)}: apply_chat_template's own "
                           "arguments (add_generation_prompt and continue_final_message are parameters of their own)",
                           param="chat_template_kwargs", code="invalid_value")
        for name, value in variables.items():  # (else the rendered prompt's error would blame the messages)
            _check_strings_unicode(name, "chat_template_kwargs")
            _check_strings_unicode(value, f"chat_template_kwargs.{name}")
        return {**variables, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def conversation(self, template_names_developer: bool = True, template_takes_parts: bool = False) -> List[dict]:
        """The messages as the chat template sees them, as vLLM passes them: content given as
        text parts is a list of {"type": "text", "text": ...} for a template that loops over
        content parts (chat_template.loops_over_content), else one string, the texts joined by
        newlines; a developer message is a system one for a template that does not name the
        developer role (as llama.cpp does)."""
        out = []
        for i, message in enumerate(self.messages):
            content = message.content
            if content is None:  # the template would print it as "None"
                if message.role != "assistant":  # an assistant's turn of tool calls alone may have none
                    raise ApiError(400, f"a {message.role} message needs content", param=f"messages[{i}].content")
                content = ""
            if isinstance(content, str):
                _check_unicode(content, f"messages[{i}].content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text":
                        raise ApiError(400, f"content part of type {part.get('type')!r} is not supported: this "
                                       "server takes text only", param=f"messages[{i}].content[{j}]")
                    if not isinstance(part.get("text"), str):
                        raise ApiError(400, "a content part of type 'text' needs a string 'text' field",
                                       param=f"messages[{i}].content[{j}]")
                    _check_unicode(part["text"], f"messages[{i}].content[{j}]")
                    texts.append(part["text"])
                content = [{"type": "text", "text": text} for text in texts] if template_takes_parts else "\n".join(texts)
            # (OpenAI's newer name for system, which coding agents send: Gemma-style templates refuse it.)
            role = "system" if message.role == "developer" and not template_names_developer else message.role
            out.append({**message.model_dump(), "role": role, "content": content})
            if out[-1].get("tool_calls") is not None:
                if message.role != "assistant":
                    raise ApiError(400, f"a {message.role} message has no tool_calls: an assistant's turn makes them",
                                   param=f"messages[{i}].tool_calls")
                out[-1]["tool_calls"] = _parsed_tool_calls(out[-1]["tool_calls"], f"messages[{i}].tool_calls")
        return out


class ChatCompletionRequest(_Conversation, _GenerationRequest):  # (the generation fields first: of a body's
    # errors, the first field's is named, as before the conversation's were a class of their own)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    def max_new_tokens(self) -> Optional[int]:
        """max_completion_tokens, OpenAI's newer name, wins where both are given (as in vLLM)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def parameter_names(self) -> Dict[str, str]:
        return {"max_new_tokens": "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens",
                "prompt": "messages"}


class TokenizeCompletionRequest(_Strict):
    """vLLM's /tokenize for a text: its ids, and with return_token_strs the tokens' strings."""
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Conversation):
    """vLLM's /tokenize for messages: the prompt chat completions would run, as ids (the
    template writes the special tokens: add_special_tokens adds the tokenizer's own again)."""
    model: Optional[str] = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids to text, special tokens kept."""
    model: Optional[str] = None
    tokens: Ids


def parse_json(text, what: str, param: Optional[str] = None):
    """JSON text (str or bytes) as Python values, strictly: NaN and Infinity (Python's, not
    JSON's) and integers of thousands of digits are refused; else a 400 naming `what`."""
    def refuse_constant(name: str):
        raise ValueError(f"{name} is not a JSON value")

    def parse_int(digits: str) -> int:
        # (Python's own refusal of longer ones names an interpreter setting the client cannot change.)
        if len(digits.lstrip("-")) > 4300:
            raise ValueError(f"a number of {len(digits.lstrip('-'))} digits is past any parameter's range")
        return int(digits)

    try:
        return json.loads(text, parse_constant=refuse_constant, parse_int=parse_int)
    except ValueError as e:
        raise ApiError(400, f"{what} is not valid JSON: {e}", param=param) from None
    except RecursionError:
        raise ApiError(400, f"{what} is JSON nested too deeply", param=param) from None


def _parsed_tool_calls(calls: Any, param: str) -> list:
    """An assistant's tool calls, a list of {"function": {"name": ..., "arguments": ...}, ...} as
    OpenAI's are (the template would otherwise iterate a string's characters, or meet a call
    without its name), with each function's arguments, which OpenAI clients send as JSON text,
    as the object it holds (as vLLM passes them, and tool-use templates iterate them; none or
    "" is {})."""
    if not isinstance(calls, list):
        raise ApiError(400, f"tool_calls must be a list of tool calls, got {type(calls).__name__}", param=param)
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, 'a tool call is an object whose "function" is an object with a string "name"',
                           param=f"{param}[{j}]")
        if isinstance(function.get("arguments") or "", str):
            arguments = parse_json(function.get("arguments") or "{}", "a tool call's arguments",
                                   param=f"{param}[{j}].function.arguments")
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def _check_unicode(text: str, param: str):
    """A message's text as valid Unicode: the error names the message and the character
    within it, not a place in the templated prompt."""
    try:
        check_unicode(param, text)
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None


def _check_strings_unicode(value, param: str):
    """Every string in JSON data (keys too) as valid Unicode, else a 400 naming `param`. A loop,
    not recursion: the data may nest deeper than Python's stack."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            _check_unicode(item, param)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def _first_unknown_name_alone(body: dict, model: type) -> dict:
    """The body with the first name `model` does not know and none after it (the error names
    that one): pydantic describes every one (a million names, 10 MB, had taken 6 s and 1.3 GB)."""
    first = next((name for name in body if name not in model.model_fields), None)
    return body if first is None else {name: value for name, value in body.items()
                                       if name in model.model_fields or name == first}


def parse(model: type, body: Any):
    """Validates a decoded JSON body into `model`, or raises the ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    # OpenAI's parameters are nullable, null meaning the default (the openai client sends an explicit
    # None as null): n or stream as null, or logit_bias, had been refused.
    body = {name: value for name, value in body.items() if value is not None}
    for name in body:  # (pydantic names no field for a name it cannot read: "invalid value for ''")
        try:
            check_unicode("a parameter's name", name)
        except ValueError as e:
            raise ApiError(400, f"{e}: {name!r}") from None
    for name, neutrals in _NEUTRAL.items():
        if name in body and _is_neutral(body[name], neutrals):
            del body[name]  # the value that changes nothing
    body = _first_unknown_name_alone(body, model)
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = _first_unknown_name_alone(body["stream_options"], StreamOptions)
    # A batch of more prompts than a request's choices, or more stop strings than it may give,
    # is set aside before pydantic reads its items (it builds every one: 15 million one-id
    # prompts, a 59 MiB body, had taken 100 s and 6.8 GB), and refused once the rest is valid.
    prompts = stops = 0  # those set aside
    prompt, stop = body.get("prompt"), body.get("stop")
    if model is CompletionRequest and isinstance(prompt, list) and len(prompt) > MAX_CHOICES and \
            isinstance(prompt[0], (str, list)):
        prompts, body["prompt"] = len(prompt), [prompt[0]]
    if "stop" in model.model_fields and isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        stops, body["stop"] = len(stop), []
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        # The error that got farthest into the value: of a union's branches, the one it was meant
        # for (a content list's bad part had been named by the string branch: "a valid string").
        error = max(e.errors(), key=lambda each: len(each["loc"]))
        param = _param_path(error["loc"])
        if error["type"] == "extra_forbidden":
            if param in ("logprobs", "top_logprobs"):  # (chat's logprobs is a bool, completions' a count)
                hint = " (log-probabilities are not returned)"
            elif param in ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"):
                hint = (" (no parser turns the model's text into tool_calls; a chat template that renders tools "
                        "takes them as chat_template_kwargs.tools)")
            elif param in _NEUTRAL:
                hint = f" (only {' or '.join(json.dumps(v) for v in _NEUTRAL[param])} is accepted)"
            else:
                hint = ""
            raise ApiError(400, f"unsupported parameter: {param!r}{hint}", param=param,
                           code="unsupported_parameter") from None
        if error["type"] == "missing":
            raise ApiError(400, f"missing required parameter: {param!r}", param=param,
                           code="missing_required_parameter") from None
        if model is CompletionRequest and error["loc"][:1] == ("prompt",):  # (a union of four forms, whose
            # branches' errors say little)
            raise ApiError(400, "invalid value for 'prompt': a prompt is a string or a list of token ids "
                           "(integers), and a batch a list of those", param="prompt", code="invalid_value") from None
        message = error["msg"].removeprefix("Value error, ")  # (pydantic's prefix to a validator's own words)
        if error["type"] == "model_type":  # (its "a valid dictionary or instance of ChatMessage" names a class)
            message = "must be a JSON object"
        raise ApiError(400, f"invalid value for {param!r}: {message}", param=param, code="invalid_value") from None
    if prompts:
        _check_choices(prompts, request.n)
    if stops:  # (OpenAI's 4 would refuse what tools written for vLLM send)
        raise ApiError(400, f"stop may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    return request


def _param_path(loc) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union branch names are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = part
        elif "[" not in part and "-" not in part and part not in ("str", "int", "list"):
            path += f".{part}"
    return path


def invalid_value(error: ValueError, renames: Optional[Dict[str, str]] = None) -> ApiError:
    """A ValueError from SamplingParams or the engine, whose message starts with the name of
    the offending parameter ("seed_canvas has ...", "SamplingParams.canvas_length must ...",
    "prompt: ..."), as a 400 naming that parameter; `renames` (the request's
    parameter_names) gives the request's name for a SamplingParams one."""
    message = str(error)
    match = re.match(r"(?:SamplingParams\.)?(\w*)", message)  # (a renamed one may be "prompt[1]")
    name = match.group(1)
    if renames and name in renames:
        name = renames[name]
    message = name + message[match.end():]  # the request's name, without the class's
    return ApiError(400, message, param=name if name.split("[")[0] in _PARAMS else None, code="invalid_value")


_PARAMS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
