"""The OpenAI-compatible HTTP server: /v1/models (and /v1/models/{name}), /v1/completions, /v1/chat/completions
(plain JSON or server-sent events), vLLM's /tokenize and /detokenize, /health and /metrics.

A request becomes one engine request per choice (n choices per prompt). Each choice turns
its tokens into text as whole blocks finish (incremental detokenization, stop strings)
and, with stream_drafts, also reports the draft of the block being refined. A client that
goes away (its stream closed, or its connection dropped while waiting for a plain
response) aborts its engine requests, which frees their KV at once.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import __version__
from ._checks import check_encoded, check_token_ids, check_unicode
from .async_llm import AsyncLLM, EngineError
from .chat_template import EMPTY_CHAT_PROMPT, loops_over_content, names_role, render_budget
from .detokenizer import IncrementalDetokenizer, until_eos
from .tokenizer import null_stop_eos
from .protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                       TokenizeCompletionRequest, invalid_value, parse, parse_json)
from .metrics import CONTENT_TYPE, Metrics
from .sampling import SamplingParams
from .stop_strings import StopStringFilter, TokensThrough


# The server's log (serve() gives the package's logger uvicorn's handlers, so its lines read as
# uvicorn's and follow --log-level).
_log = logging.getLogger(__name__)

# The most denoise steps a request may ask of each block, unless the server is told otherwise: a
# block of a model that never converges runs all its steps, and one request of 2^31 steps had
# held its engine slots for as long as its client waited.
MAX_DENOISING_STEPS_LIMIT = 1024
# The largest request body taken, unless the server is told otherwise: room for a batch of
# thousands of long prompts, well short of what reading and decoding a body could exhaust (the
# decoded JSON takes several times its bytes, and the event loop waits while it is decoded).
MAX_REQUEST_BYTES = 64 << 20


@dataclass
class ChoiceEvent:
    """What one choice adds to the response: new text, the current draft, or its end."""
    index: int
    text: str = ""
    draft: Optional[str] = None
    finish_reason: Optional[str] = None
    # vLLM's: with finish_reason "stop", the stop string or the stop token's id that ended the
    # choice (null for the tokenizer's EOS: _GenerationRequest.stop_reason)
    stop_reason: Union[str, int, None] = None
    token_ids: List[int] = field(default_factory=list)  # the output's new tokens (return_token_ids)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    denoise_steps: int = 0  # decoder passes, summed over blocks and choices

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "denoise_steps": self.denoise_steps}


class _Choice:
    """One engine request and the text it produces."""

    def __init__(self, server: "_Server", index: int, prompt: List[int], params: SamplingParams,
                 stop: List[str], drafts: bool, usage: Usage, counts_prompt: bool, names: Dict[str, str],
                 ids_follow_text: bool, stop_reason: Callable[[int], Optional[int]] = lambda token_id: None,
                 include_stop: bool = False):
        self.server, self.index, self.prompt, self.usage = server, index, prompt, usage
        self.arrived = time.monotonic()  # (when its request's body had been read and checked)
        self.first_block_seconds: Optional[float] = None  # from arrival to its first committed block
        self.queue_seconds: Optional[float] = None  # from arrival to the engine step that first ran it
        # The ids given out (token_ids) go with the text given out, not past it: they are sent
        # (return_token_ids), or counted in each chunk's usage (continuous_usage_stats).
        self.ids_follow_text = ids_follow_text
        self.names = names  # the request's names for the engine's parameters (invalid_value)
        self.counts_prompt = counts_prompt  # OpenAI counts a prompt once however many choices it has
        # The checkpoint's EOS ends the text, unless the request ignores it (ignore_eos: the
        # engine then generates past it, and the ids are text like any other).
        self.eos = server.eos_token_ids if params.eos_token_id is None else list(params.eos_token_id)
        self._updates = server.engine.generate(prompt, params, drafts)
        self._stop = stop
        self._stop_reason = stop_reason  # of the id that ended the output (an EOS or a stop token)
        self._include_stop = include_stop  # the text ends with what ended it (include_stop_str_in_output)
        self._through = TokensThrough(server.tokenizer) if stop else None  # stop strings need a tokenizer
        self.text = ""
        self.token_ids: List[int] = []  # generated (an EOS included), through a stop string's end
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[str, int, None] = None
        # How /metrics counts the choice where it ends without a finish reason: the client
        # left, or "error" where the engine could not finish its request (a 503).
        self.ended = "abort"

    async def start(self) -> None:
        """Waits until the engine has accepted the request; an invalid one is an ApiError."""
        try:
            await self._updates.__anext__()
        except ValueError as e:
            raise invalid_value(e, self.names) from None
        except EngineError:  # a 503 (the engine has stopped): counted as one that fails later is
            self._record("error", 0, [])
            raise

    async def close(self) -> None:
        await self._updates.aclose()  # aborts the request when it has not finished

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        tokenizer = self.server.tokenizer  # None: token ids alone (return_token_ids), no text
        detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        stops = StopStringFilter(self._stop, self._include_stop)
        done, generated, denoise_steps = 0, 0, []
        decoded = 0  # characters the detokenizer has given (the decode of the ids before its held-back tail)
        try:
            async for progress in self._updates:
                output = progress.output
                token_ids = until_eos(progress.token_ids, self.eos)
                ended_by = progress.token_ids[len(token_ids)] if len(token_ids) < len(progress.token_ids) else None
                # The id that ended the output, where its text goes out too (include_stop_str_in_output),
                # is decoded by the same detokenizer, after the text before it: a byte token that
                # completes a character gives that character. The stop strings' search takes all
                # the text before it (the detokenizer's held-back tail too), not what the id adds
                # (as vLLM: the stop token, not a stop string in its text, ended the output).
                stop_token = ended_by is not None and self._include_stop and detokenizer is not None
                piece = stop_text = ""
                if detokenizer is not None:
                    piece = detokenizer.push(token_ids[done:])
                    decoded += len(piece)
                    if stop_token:
                        rest = detokenizer.push([ended_by]) + detokenizer.finish()
                        before = (await asyncio.to_thread(tokenizer.decode_output, token_ids))[decoded:]
                        common = os.path.commonprefix([before, rest])
                        piece, stop_text = piece + common, rest[len(common):]
                    elif output:
                        piece += detokenizer.finish()
                done, generated = len(token_ids), len(progress.token_ids)
                if generated and self.first_block_seconds is None:
                    self.first_block_seconds = time.monotonic() - self.arrived
                if progress.scheduled_at is not None and self.queue_seconds is None:
                    self.queue_seconds = progress.scheduled_at - self.arrived
                event = ChoiceEvent(self.index, stops.push(piece, final=output is not None))
                if stop_token and not stops.stopped:
                    event.text += stop_text
                # A draft is of the block after the text so far: past a stop string, it is
                # text the output will never have.
                if progress.draft and tokenizer is not None and not stops.stopped:
                    event.draft = tokenizer.decode_output(until_eos(progress.draft, self.eos))
                denoise_steps = output.denoise_steps if output is not None else progress.denoise_steps
                if stops.stopped:
                    event.finish_reason = "stop"  # leaving the loop closes the request: it is aborted
                    event.stop_reason = stops.stop_string
                    # The output, and its usage, end with the token that ends the stop string.
                    generated = await asyncio.to_thread(self._through, token_ids, stops.stop_end, output is not None)
                elif output is not None:
                    event.finish_reason = output.finish_reason
                    if output.finish_reason == "stop" and ended_by is not None:
                        event.stop_reason = self._stop_reason(ended_by)
                # Ids go out with the text: where a stop string may still cut the output, only
                # those through the text given out so far (the detokenizer and the stop filter
                # hold text back, and ids sent past a stop that then ends the text could not be
                # taken back).
                through = generated
                if self._stop and self.ids_follow_text and not event.finish_reason:
                    through = await asyncio.to_thread(self._through, token_ids, len(self.text) + len(event.text))
                event.token_ids = progress.token_ids[len(self.token_ids):through]
                self.token_ids += event.token_ids
                self.text += event.text
                yield event
                if event.finish_reason:
                    self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
                    return
        except EngineError:
            self.ended = "error"
            raise
        finally:
            await self.close()
            self.usage.prompt_tokens += self._prompt_tokens()
            self.usage.completion_tokens += generated
            self.usage.denoise_steps += sum(denoise_steps)
            self._record(self.finish_reason or self.ended, generated, denoise_steps)

    def _prompt_tokens(self) -> int:
        return len(self.prompt) if self.counts_prompt else 0

    def _record(self, ended: str, generated: int, denoise_steps: List[int]) -> None:
        self.server.metrics.record(ended, self._prompt_tokens(), generated, denoise_steps,
                                   time.monotonic() - self.arrived, self.first_block_seconds, self.queue_seconds)


class _Server:
    def __init__(self, engine: AsyncLLM, model_name: str,
                 max_denoising_steps_limit: int = MAX_DENOISING_STEPS_LIMIT, max_prompt_chars: Optional[int] = None,
                 chat_template: Optional[str] = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # None without a tokenizer.json: token ids in and out alone
        self.model_name = model_name
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("a chat template was given, but the model has no tokenizer.json to encode what it "
                                 "renders")
            self.tokenizer.compiled_chat_template(chat_template)  # (a ValueError where it does not compile)
        self.chat_template = chat_template  # None: the checkpoint's
        self.max_denoising_steps_limit = max_denoising_steps_limit
        config = engine.llm.model.config
        generation = config["generation"]
        # The limit holds for the checkpoint's own default too, which requests that ask no
        # number of steps run (a generation_config.json asking 2^31 - 1 steps a block had every
        # such request run for days).
        if generation["max_denoising_steps"] > max_denoising_steps_limit:
            raise ValueError(f"the checkpoint's default max_denoising_steps ({generation['max_denoising_steps']}, "
                             f"from generation_config.json) exceeds the limit of {max_denoising_steps_limit} a block "
                             f"that requests may run (--max-denoising-steps-limit): raise the limit to serve it")
        self.eos_token_ids = list(generation["eos_token_ids"])
        # The EOS whose stop_reason is null (vLLM's: the tokenizer's; without one, the first).
        self.eos_token_id = null_stop_eos(self.tokenizer, self.eos_token_ids)
        self.defaults = {"t_min": generation["t_min"], "t_max": generation["t_max"],
                         "length_given": generation["length_given"], "context": config["max_model_len"],
                         "eos_token_ids": self.eos_token_ids, "vocab_size": config["vocab_size"]}
        self.metrics = Metrics(lambda: self.engine.stats)
        # The longest prompt text taken: by default max_model_len tokens of the vocabulary's
        # longest entry, more than any prompt that fits has (unless its tokens swallow
        # characters: a token with lstrip takes any run of spaces before it; then raise it).
        # Longer ones are refused before they are encoded, which takes hundreds of bytes a
        # token (a 20 MB text of one-character tokens had taken 11 GB and a minute to refuse).
        self.max_sequence_tokens = engine.llm.model.max_sequence_tokens
        if max_prompt_chars is None and self.tokenizer is not None:
            max_prompt_chars = self.max_sequence_tokens * self.tokenizer.longest_token_chars
        self.max_prompt_chars = max_prompt_chars or None  # 0: no limit

    def returns_token_ids(self, body) -> bool:
        """Whether each choice carries its token ids: as asked (return_token_ids), else where the
        model has no tokenizer and so no text."""
        return body.return_token_ids if body.return_token_ids is not None else self.tokenizer is None

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_model_first(self, raw) -> None:  # the wrong model is a 404 whatever else the request holds
        if isinstance(raw, dict) and isinstance(raw.get("model"), str):
            self.check_model(raw["model"])

    def check_prompt_chars(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ApiError(400, f"{param}: {chars} characters of text, more than this server takes "
                                f"({self.max_prompt_chars}, --max-prompt-chars: by default max_model_len tokens of "
                                f"the vocabulary's longest entry)", param=param)

    def check_prompt_ids_length(self, prompt, param: str) -> None:
        """Refuses a prompt of token ids longer than max_model_len before the engine's checks,
        which read every id on the engine thread (10 million ids had held every request's steps
        for 6 s, to be refused in the end)."""
        if not isinstance(prompt, str) and len(prompt) > self.max_sequence_tokens:
            raise ApiError(400, f"{param}: {len(prompt)} tokens, more than this model's max_model_len "
                                f"({self.max_sequence_tokens}) takes", param=param, code="invalid_value")

    def check_message_chars(self, body) -> None:
        """Refuses a chat request whose messages' text as sent is past --max-prompt-chars (even
        where the template would trim it), or that has more messages, or more content parts,
        than a prompt has tokens (a turn's markup is one at least; a part past that many is
        no prompt a client means), before it is validated and rendered, which take seconds for
        hundreds of thousands of messages or parts, on the event loop: every other request
        waits (the rendered prompt is checked again)."""
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list):
            return
        if len(messages) > self.max_sequence_tokens:
            raise ApiError(400, f"messages: {len(messages)} messages, more than a prompt of this model has tokens "
                                f"({self.max_sequence_tokens})", param="messages")
        contents = [message.get("content") if isinstance(message, dict) else None for message in messages]
        parts = sum(len(content) for content in contents if isinstance(content, list))
        if parts > self.max_sequence_tokens:
            raise ApiError(400, f"messages: {parts} content parts, more than a prompt of this model has tokens "
                                f"({self.max_sequence_tokens})", param="messages")
        chars = 0
        for content in contents:
            for part in content if isinstance(content, list) else [content]:  # a text, or {"text": ...} parts
                text = part.get("text") if isinstance(part, dict) else part
                chars += len(text) if isinstance(text, str) else 0
        self.check_prompt_chars(chars, "messages")

    async def prompt_ids(self, prompt, param: str = "prompt", add_special_tokens: bool = True) -> List[int]:
        """A prompt's token ids: given, or its text encoded (text that is not valid Unicode: a 400).
        The encoding runs in a worker thread: a text of megabytes takes seconds, which the
        event loop spends serving the others."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json, so it takes no text: send the prompt as token ids",
                           param=param, code="no_tokenizer")
        self.check_prompt_chars(len(prompt), param)
        try:
            check_unicode(param, prompt)  # (the tokenizer's own message would name "text")
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=add_special_tokens)
            return check_encoded(ids, param, self.engine.llm.model.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None

    async def chat_prompt_ids(self, body, add_special_tokens: bool = False) -> List[int]:
        """A chat request's messages rendered by the checkpoint's chat template, as token ids
        (the template writes the special tokens: add_special_tokens adds the tokenizer's too)."""
        options = body.template_options()
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json, so no chat template: send token ids to "
                           "/v1/completions", param="messages", code="no_tokenizer")
        try:
            source = self.tokenizer.get_chat_template(self.chat_template, tools=options.get("tools"))
        except ValueError as e:  # no chat template
            raise ApiError(400, str(e), param="messages", code="no_chat_template") from None

        def render():  # (in a worker thread, as encoding: a long conversation takes a while)
            conversation = body.conversation(names_role(source, "developer"), loops_over_content(source))
            with render_budget(self.max_prompt_chars):  # (JSON the template writes is prompt text)
                return self.tokenizer.apply_chat_template(conversation, chat_template=source, **options)

        try:
            text = await asyncio.to_thread(render)
        except ValueError as e:  # the template's own refusal or failure, or bad tools or documents
            argument = getattr(e, "argument", None)  # (ChatTemplateError's: tools or documents, which the kwargs set)
            raise ApiError(400, str(e), param=f"chat_template_kwargs.{argument}" if argument else "messages") from None
        if not text:  # (the engine's "the prompt is empty" would not say why)
            raise ApiError(400, EMPTY_CHAT_PROMPT, param="messages")
        return await self.prompt_ids(text, "messages", add_special_tokens=add_special_tokens)

    async def run(self, request: Request, body, prompts: List[List[int]], max_tokens: Optional[int], fmt):
        if body.truncate_prompt_tokens is not None:  # (before anything counts them: usage counts what ran)
            prompts = [prompt[-body.truncate_prompt_tokens:] for prompt in prompts]
        # In a worker thread, as the prompts' encoding: n choices each check the request's lists
        # (200,000 allowed ids and n = 128 had kept /health waiting 50 s).
        params = await asyncio.to_thread(body.sampling_params, self.defaults, max_tokens,
                                         self.max_denoising_steps_limit, len(prompts))
        stop = body.stop_strings()
        if stop and self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json, so no text to find stop strings in", param="stop",
                           code="no_tokenizer")
        if body.stream_drafts and self.tokenizer is None:  # (a draft is text: it would never be sent)
            raise ApiError(400, "this model has no tokenizer.json, so no text to stream its drafts as",
                           param="stream_drafts", code="no_tokenizer")
        usage = Usage()
        choices = []
        include_usage = body.stream and body.stream_options is not None and bool(body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options.continuous_usage_stats)

        def stop_reason(token_id: int) -> Optional[int]:
            return body.stop_reason(token_id, self.eos_token_ids, self.eos_token_id)
        for p, prompt in enumerate(prompts):
            names = body.parameter_names()
            if len(prompts) > 1:  # the engine's "prompt: ..." names which of the batch's prompts
                names["prompt"] = _prompt_name(p, len(prompts))
            for i, choice_params in enumerate(params):
                choices.append(_Choice(self, p * len(params) + i, prompt, choice_params, stop, body.stream_drafts,
                                       usage, counts_prompt=i == 0, names=names,
                                       ids_follow_text=fmt.token_ids or continuous,
                                       stop_reason=stop_reason, include_stop=body.include_stop_str_in_output))
        # Every choice asks the engine without waiting for the others, so that it takes them in
        # few turns (one by one, a request of hundreds of prompts took a step each to be
        # admitted); _TURN choices a turn of the event loop, which serves other requests
        # between. Each start ends before any choice is closed. A client that leaves meanwhile
        # ends the starts: the engine takes new requests only between its steps, so thousands
        # of choices take seconds to start, and they had all been started, and hundreds run,
        # for a client that had left.
        starts = []

        async def start_all():
            async for choice in _in_turns(choices):
                starts.append(asyncio.ensure_future(choice.start()))
            return await asyncio.gather(*starts, return_exceptions=True)
        try:
            started = await _unless_disconnected(request, start_all())
            failed = next((r for r in started if isinstance(r, BaseException)), None)
        except BaseException as e:  # cancelled, or the client left
            failed = e
        if failed is not None:
            # Where the client left, the choices the engine had taken count as aborted, as those
            # cancelled later do (events() records them).
            left = _client_left(failed)
            _log_early_end(fmt.request_id, failed)

            async def close():
                # (Read in the step that cancels the rest: a start may end in the turns between.)
                taken = [choice for choice, start in zip(choices, starts)
                         if start.done() and not start.cancelled() and start.exception() is None] if left else []
                for start in starts:
                    start.cancel()  # (a start cancelled after asking the engine aborts its request)
                await asyncio.gather(*starts, return_exceptions=True)
                async for choice in _in_turns(choices):
                    await choice.close()
                for choice in taken:
                    choice._record("abort", 0, [])
            await _to_the_end(close())
            raise failed
        if body.stream:
            return StreamingResponse(self._sse(choices, fmt, usage, include_usage, continuous),
                                     media_type="text/event-stream")
        try:
            await _unless_disconnected(request, _drain(_merged(choices)))
        except (ApiError, EngineError) as e:  # (a 499 goes to a closed connection, which uvicorn does not log)
            _log_early_end(fmt.request_id, e)
            raise
        return fmt.response(choices, usage.body())

    async def _sse(self, choices, fmt, usage: Usage, include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        """The stream's chunks; with include_usage the usage at its end, and with continuous
        (vLLM's continuous_usage_stats) each chunk's choice's usage so far in the chunk, as
        vLLM gives it: its prompt's tokens and the tokens given out so far."""
        def with_usage(chunk: dict, choice: _Choice) -> dict:
            if continuous:
                prompt, completion = len(choice.prompt), len(choice.token_ids)
                chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                  "total_tokens": prompt + completion}
            return chunk

        for choice in choices:
            opening = fmt.opening_chunk(choice.index)
            if opening is not None:
                yield _sse(with_usage(opening, choice), include_usage)
        try:
            async for event in _merged(choices):
                if event.text or event.draft is not None or event.finish_reason or (fmt.token_ids and event.token_ids):
                    yield _sse(with_usage(fmt.chunk(event), choices[event.index]), include_usage)
        except EngineError as e:
            _log_early_end(fmt.request_id, e)
            yield _sse(ApiError(503, str(e), type="server_error").body(), False)
        except Exception:  # a bug of the server's: the stream still ends as a stream (it had been cut off)
            _log.exception("%s: the streamed response failed", fmt.request_id)
            yield _sse(_INTERNAL_ERROR.body(), False)
        except BaseException as e:  # (cancelled, or closed: the client left mid-stream; its choices are aborted)
            _log_early_end(fmt.request_id, e)
            raise
        if include_usage:
            yield _sse({**fmt.chunk_base(), "choices": [], "usage": usage.body()}, False)
        yield "data: [DONE]\n\n"


# Characters that JSON leaves raw but line readers (Python's splitlines, httpx's iter_lines)
# end a line at: escaped, so that a chunk stays one line (the same JSON).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(payload: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in payload:
        payload["usage"] = None
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def _merged(choices: List[_Choice]) -> AsyncIterator[ChoiceEvent]:
    """The events of all choices, as they happen. Cancelling the consumer cancels every
    choice, which aborts their engine requests."""
    if len(choices) == 1:  # no tasks needed
        async for event in choices[0].events():
            yield event
        return
    events: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(choice):
        try:
            async for event in choice.events():
                await events.put(event)
        except Exception as e:
            await events.put(e)
        finally:
            events.put_nowait(finished)

    tasks = []
    try:
        async for choice in _in_turns(choices):
            tasks.append(asyncio.create_task(pump(choice)))
        for _ in range(len(tasks)):
            while (item := await events.get()) is not finished:
                if isinstance(item, Exception):
                    if isinstance(item, EngineError):  # the request fails: its other choices end with it
                        for choice in choices:
                            choice.ended = "error"
                    raise item
                yield item
    finally:
        async def cancel():
            async for task in _in_turns(tasks):  # each cancelled choice aborts its request
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await _to_the_end(cancel())


# Cleanups running on after their caller was cancelled (the loop keeps only weak references).
_CLEANUPS = set()


async def _to_the_end(cleanup) -> None:
    """Runs the coroutine `cleanup` to its end, as a task of its own that the caller's
    cancellation does not reach. A streamed response runs in an anyio cancel scope, which
    cancels its task again at every await once its client has left: a cleanup awaited there
    ended at its first await (a stream's choices past the first _TURN ran on to their ends for
    nobody, holding their KV)."""
    task = asyncio.ensure_future(cleanup)
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)
    await asyncio.shield(task)


# Choices started, merged or cancelled in one turn of the event loop: a request's choices, up
# to MAX_CHOICES, take several turns, and other requests are served between. (128,000 choices
# started in one turn had kept /health waiting 21 s, and their cancellation 11 s; in turns,
# 1.4 s and 1.1 s remained, garbage collection's passes over their objects: hence MAX_CHOICES.)
_TURN = 128


async def _in_turns(items: list):
    """The items, with a turn of the event loop after every _TURN of them, in which the tasks the
    caller created or cancelled for those run (and other requests are served)."""
    for k, item in enumerate(items):
        if k and k % _TURN == 0:
            await asyncio.sleep(0)
        yield item


async def _drain(events: AsyncIterator) -> None:
    async for _ in events:
        pass


async def _unless_disconnected(request: Request, work):
    """`work`'s result, awaited while the client stays connected; if it leaves first, cancels
    the work (which aborts its engine requests) and raises a 499."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, listener = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, listener], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        # (A cancelled task is done only once it has run its cancellation: with several
        # choices that takes a turn of the loop, and result() had raised InvalidStateError.)
        await asyncio.gather(task, listener, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "the client closed the request", code="client_closed_request")
    return task.result()


@dataclass
class _Format:
    """How a response of one endpoint looks."""
    model: str
    chat: bool
    token_ids: bool = False  # each choice's token ids too (vLLM's return_token_ids)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the client's X-Request-Id, where it sends one
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def request_id(self) -> str:
        """The response's id, as the log names the request."""
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def chunk_base(self) -> dict:
        return {"id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def opening_chunk(self, index: int) -> Optional[dict]:
        if not self.chat:
            return None
        return {**self.chunk_base(), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None, "stop_reason": None}]}

    def chunk(self, event: ChoiceEvent) -> dict:
        if self.chat:
            delta = {"content": event.text} if event.text else {}
            if event.draft is not None:
                delta["draft"] = event.draft
            choice = {"index": event.index, "delta": delta}
        else:
            choice = {"index": event.index, "text": event.text}
            if event.draft is not None:
                choice["draft"] = event.draft
        if self.token_ids:
            choice["token_ids"] = event.token_ids
        return {**self.chunk_base(), "choices": [{**choice, "logprobs": None, "finish_reason": event.finish_reason,
                                                  "stop_reason": event.stop_reason}]}

    def response(self, choices: List[_Choice], usage: dict) -> dict:
        body = {**self.chunk_base(), "usage": usage}
        if self.chat:
            body["object"] = "chat.completion"
        body["choices"] = []
        for c in choices:
            text = {"message": {"role": "assistant", "content": c.text}} if self.chat else {"text": c.text}
            ids = {"token_ids": c.token_ids} if self.token_ids else {}
            body["choices"].append({"index": c.index, **text, **ids, "logprobs": None, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
        return body


def _client_left(e: BaseException) -> bool:
    """Whether `e` ended a request because its client left: cancelled, the 499, or a stream closed."""
    return isinstance(e, (asyncio.CancelledError, GeneratorExit)) or (isinstance(e, ApiError) and e.status == 499)


def _log_early_end(request_id: str, e: BaseException) -> None:
    """Logs a request that `e` ended before its response did, where its client left or the
    engine could not finish it (uvicorn's access line says neither)."""
    if isinstance(e, EngineError):
        _log.error("%s failed: %s", request_id, e)
    elif _client_left(e):
        _log.info("%s aborted: the client left", request_id)


def _client_id(request: Request) -> dict:
    """The client's X-Request-Id as the response's id (cmpl-<id>), as vLLM takes it, for its
    logs and ours to name the same request: printable ASCII, up to 128 characters, else ignored."""
    given = request.headers.get("x-request-id", "")
    return {"id": given} if 0 < len(given) <= 128 and given.isascii() and given.isprintable() else {}


def _prompt_name(i: int, count: int) -> str:
    """What errors call prompt i of a request's `count`: its place where they are a batch."""
    return f"prompt[{i}]" if count > 1 else "prompt"


async def _json_body(request: Request, max_bytes: Optional[int]):
    # A JSON body, as its Content-Type says (or with none, as FastAPI, so vLLM, takes it): a
    # browser's page may send text/plain to any server without asking first (a CORS "simple
    # request"), and such requests had run, whatever --allowed-origins said.
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";")[0].strip().lower()
    if media and not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
        raise ApiError(415, f"the request body's Content-Type {content_type!r} is not JSON: send the body as "
                       "application/json")
    # A compressed body had been parsed as it came ("not valid JSON: 'utf-8' codec can't decode
    # byte 0x8b"), and an uncompressed one labelled gzip taken as it was.
    encoding = request.headers.get("content-encoding", "identity")
    if encoding.strip().lower() != "identity":
        raise ApiError(415, f"the request body's Content-Encoding {encoding!r} is not supported: send the body "
                       "uncompressed, without a Content-Encoding header")
    # A body past max_bytes is a 413 before it is read, or as soon as it is past (a body of
    # gigabytes had been read whole into memory and then decoded on the event loop).
    def too_large(body: str):
        return ApiError(413, f"{body} more than this server takes ({max_bytes} bytes, --max-request-bytes)",
                        code="request_too_large")
    length = request.headers.get("content-length", "")
    if max_bytes is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large(f"the request body is {int(length)} bytes,")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise too_large("the request body is")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was in: nothing to answer, nothing to log
        raise ApiError(400, "the client disconnected while sending the request body") from None
    # In a worker thread, as validation (parse): a body of tens of megabytes of token ids takes
    # seconds, which had kept /health and every stream waiting.
    return await asyncio.to_thread(parse_json, b"".join(chunks), "the request body")


def check_api_key(api_key: Optional[str]) -> None:
    """Refuses a key no client could send in its Authorization header, or an empty one (KEY= in
    an environment file), which would lock every client out unannounced."""
    if api_key is not None and not (api_key and api_key.isascii() and api_key.isprintable() and
                                    api_key == api_key.strip()):
        raise ValueError("the API key must be printable ASCII, not empty and without surrounding spaces: an HTTP "
                         "header carries it")


def build_app(engine: AsyncLLM, model_name: str, api_key: Optional[str] = None,
              max_denoising_steps_limit: int = MAX_DENOISING_STEPS_LIMIT,
              allowed_origins: Sequence[str] = ("*",), max_prompt_chars: Optional[int] = None,
              max_request_bytes: Optional[int] = None, chat_template: Optional[str] = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`. The app owns the engine: its
    shutdown aborts what is still running and stops the engine thread. max_prompt_chars: the
    longest prompt text taken (None: max_model_len tokens of the vocabulary's longest entry;
    0: any). max_request_bytes: the largest request body taken (None: MAX_REQUEST_BYTES; 0: any).
    chat_template: the template chat requests are rendered with (None: the checkpoint's)."""
    check_api_key(api_key)
    if max_request_bytes is None:
        max_request_bytes = MAX_REQUEST_BYTES
    if max_request_bytes < 0:
        raise ValueError(f"max_request_bytes must be 0 (no limit) or more, not {max_request_bytes}")
    max_body = max_request_bytes or None

    @asynccontextmanager
    async def lifespan(app):
        yield
        served = app.state.diffuserve_server
        served.engine.shutdown()
        served.engine = None  # (the model freed at once, whoever still holds the app)

    app = FastAPI(title="diffuserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # The endpoints (and the lifespan) find the server through the app: FastAPI caches
    # endpoints process-wide (its lru_caches keyed by them), where a closure over the server had
    # kept its engine and model for the process's life (a model for every app built and driven
    # without its lifespan, as tests over ASGI do). So the app is mounted whole (app.mount),
    # not its routes copied into another.
    app.state.diffuserve_server = _Server(engine, model_name, max_denoising_steps_limit, max_prompt_chars,
                                          chat_template)
    app.add_middleware(_InternalErrors)
    if api_key is not None:
        app.add_middleware(_RequireKey, api_key=api_key)
    # Browsers' clients (a chat page served elsewhere) ask before each call: as vLLM, any origin
    # unless told which (--allowed-origins). (Added last, so outermost: its preflight answers
    # need no key, and the key's 401 carries its headers.)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(_CountResponses)  # (outermost: every response counted, a 401 or a preflight too)
    v1 = APIRouter(prefix="/v1")

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        if e.status == 413:  # the body's unread rest must not be taken for the next request
            return _error(e, {"Connection": "close"})
        return _error(e)  # (the API key's 401 is _RequireKey's, before routing)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # its headers kept: a 405's Allow had been dropped
        return _error(ApiError(e.status_code, str(e.detail), code=None), e.headers)

    @app.exception_handler(EngineError)
    async def engine_error(request, e: EngineError):  # (run() logged it, naming the request)
        return _error(ApiError(503, str(e), type="server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers' checks may send HEAD)
    async def health(request: Request):  # 503 once the engine has failed: no request could be served
        return Response(status_code=200 if _server_of(request).engine.alive else 503)

    @app.api_route("/ping", methods=["GET", "POST"])  # (vLLM's, for SageMaker's health checks: /health's answer)
    async def ping(request: Request):
        return await health(request)

    @app.get("/version")  # (vLLM's)
    async def version():
        return {"version": __version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # (as /health: a scraper's check may send HEAD)
    async def metrics(request: Request):
        return Response(_server_of(request).metrics.exposition(), media_type=CONTENT_TYPE)

    # As vLLM's card: max_model_len sizes clients' context windows, so it is what one request
    # can reach (a KV cache smaller than the positions allow bounds it).
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "diffuserve",
            "root": model_name, "parent": None, "max_model_len": engine.llm.model.max_sequence_tokens}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model:path}")  # a served name may hold slashes ("google/...")
    async def model(model: str, request: Request):
        _server_of(request).check_model(model)
        return card

    @v1.post("/completions")
    async def completions(request: Request):
        server = _server_of(request)
        raw = await _json_body(request, max_body)
        server.check_model_first(raw)
        body = await asyncio.to_thread(parse, CompletionRequest, raw)  # (its model, a string, is the one checked above)
        batch = body.prompts()
        names = [_prompt_name(i, len(batch)) for i in range(len(batch))]
        for p, name in zip(batch, names):  # (every id prompt's length before any text is encoded)
            server.check_prompt_ids_length(p, name)
        prompts = [await server.prompt_ids(p, name) for p, name in zip(batch, names)]
        return await server.run(request, body, prompts, body.max_tokens,
                                _Format(model_name, chat=False, token_ids=server.returns_token_ids(body),
                                        **_client_id(request)))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        server = _server_of(request)
        raw = await _json_body(request, max_body)
        server.check_model_first(raw)
        server.check_message_chars(raw)
        body = await asyncio.to_thread(parse, ChatCompletionRequest, raw)  # (its model, a string, is the one checked above)
        prompt = await server.chat_prompt_ids(body)
        return await server.run(request, body, [prompt], body.max_new_tokens(),
                                _Format(model_name, chat=True, token_ids=server.returns_token_ids(body),
                                        **_client_id(request)))

    # vLLM's tokenizer endpoints, outside /v1 as vLLM serves them (behind the API key too): a
    # text's or a conversation's ids as the completions would run them, and ids' text.
    @app.post("/tokenize")
    async def tokenize(request: Request):
        server = _server_of(request)
        raw = await _json_body(request, max_body)
        server.check_model_first(raw)
        if isinstance(raw, dict) and raw.get("messages") is not None:  # (null: not given, as everywhere)
            server.check_message_chars(raw)
            body = await asyncio.to_thread(parse, TokenizeChatRequest, raw)
            ids = await server.chat_prompt_ids(body, body.add_special_tokens)
        else:
            body = await asyncio.to_thread(parse, TokenizeCompletionRequest, raw)
            ids = await server.prompt_ids(body.prompt, add_special_tokens=body.add_special_tokens)
        # The strings and the JSON in a worker thread: hundreds of thousands of tokens take
        # seconds of the event loop (FastAPI's encoder walks a returned dict value by value).
        strings = await asyncio.to_thread(server.tokenizer.token_strings, ids) if body.return_token_strs else None
        return await asyncio.to_thread(JSONResponse, {"count": len(ids), "max_model_len": card["max_model_len"],
                                                      "tokens": ids, "token_strs": strings})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server = _server_of(request)
        raw = await _json_body(request, max_body)
        server.check_model_first(raw)
        body = await asyncio.to_thread(parse, DetokenizeRequest, raw)
        if server.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json, so no text for token ids", param="tokens",
                           code="no_tokenizer")
        try:
            ids = check_token_ids(body.tokens, "tokens", server.engine.llm.model.vocab_size).tolist()
        except ValueError as e:
            raise ApiError(400, str(e), param="tokens") from None
        try:  # (an id of the model's that the tokenizer lacks: a padded embedding's)
            text = await asyncio.to_thread(server.tokenizer.decode, ids, skip_special_tokens=False)
        except ValueError as e:
            raise ApiError(400, str(e), param="tokens") from None
        return {"prompt": text}

    app.include_router(v1)
    return app


def _server_of(request: Request) -> _Server:
    server = request.app.state.diffuserve_server
    if server.engine is None:  # (a request that comes after the lifespan's end)
        raise ApiError(503, "the server has shut down", type="server_error")
    return server


_INTERNAL_ERROR = ApiError(500, "internal server error (the server's log has its details)", type="server_error")


class _InternalErrors:
    """ASGI middleware, the innermost: an exception no handler took is the 500 here, inside
    CORS, so that a browser's client reads it (Starlette's own 500 is answered outside every
    middleware, without CORS headers: a browser saw a failed CORS check instead). The message
    is generic; the exception is raised on, so that uvicorn logs its traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if scope["type"] == "http" and not started:
                await _error(_INTERNAL_ERROR)(scope, receive, send)
            raise


# The endpoints /metrics counts responses of by name; any other path is "other".
_HANDLERS = ("/health", "/ping", "/version", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
             "/tokenize", "/detokenize")
_METHODS = ("GET", "HEAD", "POST", "OPTIONS")


class _CountResponses:
    """ASGI middleware, the outermost: each response's status and duration, by endpoint and
    method, into /metrics (diffuserve_http_requests_total and
    diffuserve_http_request_duration_seconds, as vLLM's http_requests_total and
    http_request_duration_seconds)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/") or "/"
        handler = path if path in _HANDLERS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        method = scope["method"] if scope["method"] in _METHODS else "other"

        metrics = scope["app"].state.diffuserve_server.metrics

        async def sending(message):
            if message["type"] == "http.response.start":
                metrics.http_requests.labels(handler, method, str(message["status"])).inc()
            await send(message)

        start = time.monotonic()
        try:  # (the app returns once the response's last byte is sent, or the client has gone)
            await self.app(scope, receive, sending)
        finally:
            metrics.http_duration.labels(handler, method).observe(time.monotonic() - start)


# What the API key guards beside /v1/...: /health and /metrics stay open to probes and scrapers.
_KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")


class _RequireKey:
    """ASGI middleware: every /v1 request needs the API key, checked before routing, so that an
    unknown path or method is a 401 too (as vLLM's), not a 404 or 405 telling a caller without
    the key what exists."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        # (A path with slashes after it, which the router redirects to the path, is the path's.)
        if scope["type"] == "http" and (scope["path"].rstrip("/") in _KEYED_PATHS or scope["path"].startswith("/v1/")):
            scheme, _, key = Request(scope).headers.get("authorization", "").strip().partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())):
                error = ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                 code="invalid_api_key")
                await _error(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve(app: FastAPI, engine: AsyncLLM, sock: socket.socket, log_level: str,
          shutdown_timeout: float, access_log: bool = True, ssl_certfile: Optional[str] = None,
          ssl_keyfile: Optional[str] = None) -> Optional[BaseException]:
    """Runs `app` (serving `engine`) with uvicorn on the listening socket `sock` until Ctrl-C /
    SIGTERM, then lets running requests finish for shutdown_timeout seconds. Before that runs
    out (a second and two passes of the engine before: it ends after the pass in progress), or
    at a second signal, the engine ends what still runs: its clients get an error event and
    [DONE] (a stream) or a 503, where the end of uvicorn's grace period (or its forced exit)
    would drop their connections mid-response. A third signal forces the exit. access_log:
    uvicorn's line a response (off: the package's own lines, errors and aborts, stay).
    ssl_certfile (with the key in it, or in ssl_keyfile): HTTPS instead of HTTP. An engine that
    fails ends the server too, and its error is returned, for the process to exit with (as
    vLLM's: a process manager restarts it, where /health had answered 503 for ever)."""
    import uvicorn

    signals, left = 0, threading.Event()

    def end_engine_in_time():
        deadline = time.monotonic() + shutdown_timeout
        # (A pass on a CPU may take seconds: a fixed second had been too short, and every stream was cut off.)
        while time.monotonic() < deadline - 1.0 - 2 * engine.pass_seconds:
            if left.wait(0.05):
                return
        engine.shutdown()

    # (Daemon: a server whose requests all finish in time exits without waiting for it.)
    ending = threading.Thread(target=end_engine_in_time, name="diffuserve-shutdown", daemon=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                # As SIGINT: uvicorn raises the signal it held back again once it has shut
                # down, and SIGTERM's own action would then end the process by that signal
                # (status 143, which process managers report as a failure, and no `finally`
                # run), where the shutdown was an orderly one.
                super().handle_exit(signal.SIGINT, frame)
                ending.start()
            elif signals == 2:  # (off the event loop: the engine's pass in progress ends first)
                threading.Thread(target=engine.shutdown, daemon=True).start()
            else:  # (uvicorn forces it at a second SIGINT alone)
                self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            self.should_exit = self.should_exit or engine.error is not None
            return await super().on_tick(counter)

    # A log line that cannot be written (the reader of stdout has left: `serve | head -1`) is
    # dropped, not a traceback on stderr for every request.
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        host, port = sock.getsockname()[:2]  # (for uvicorn's log lines)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                                timeout_graceful_shutdown=shutdown_timeout,  # (which sets up uvicorn's loggers)
                                ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
        # The package's lines (the server's, a failed engine step's) through uvicorn's handler and
        # level: they had gone to Python's last-resort handler, bare and at any --log-level.
        # ("uvicorn.error" has the level, and hands its lines to "uvicorn"'s handler.)
        package_log = logging.getLogger("diffuserve")
        package_log.handlers, package_log.propagate = list(logging.getLogger("uvicorn").handlers), False
        package_log.setLevel(logging.getLogger("uvicorn.error").level)
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the signal it held back once it has shut down (as uvicorn.run)
        pass
    finally:
        left.set()  # (its waiting thread holds the engine)
        logging.raiseExceptions = raise_exceptions
    return engine.error


def _error(e: ApiError, headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
