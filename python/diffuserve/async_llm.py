"""AsyncLLM: an LLM driven by one thread, for asyncio callers (the server).

The LLM is not thread-safe, so a single engine thread owns it: it takes commands (add,
abort) from a queue, runs scheduler steps while there is work, and after each step
posts every request's progress to that request's asyncio queue. Callers only ever touch
the queues. Each step's heavy work runs in C++ without the GIL, so the event loop stays
responsive while the model computes.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import copy
import itertools
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import AsyncIterator, List, Optional

import numpy as np

from ._checks import iter_once
from .llm import LLM, RequestOutput
from .sampling import SamplingParams

# The longest the engine's thread takes commands (adds, aborts) before the running requests'
# next step.
_COMMAND_SECONDS = 0.02


@dataclass
class Progress:
    """One update of a request: the tokens of all its finished blocks so far, the argmax
    canvas of the block in progress (when drafts were asked for), and its RequestOutput
    once it has finished."""
    token_ids: List[int]
    draft: List[int] = field(default_factory=list)
    output: Optional[RequestOutput] = None
    denoise_steps: List[int] = field(default_factory=list)  # of the finished blocks
    # time.monotonic() at the start of the engine step that first ran the request (requests
    # join only between steps); None while it has not run.
    scheduled_at: Optional[float] = None


class EngineError(RuntimeError):
    """The engine could not finish the request (the server answers 503)."""


class EngineDead(EngineError):
    """The engine thread stopped (shutdown, or an internal error) before the request finished."""


class RequestFailed(EngineError):
    """The model could not finish the request (its logits were NaN or infinite); the engine
    goes on with the others."""


class StepFailed(EngineError):
    """A step could not run (out of GPU memory, say): every request the engine held, but those
    that finished before it failed, was aborted, their KV freed, and the engine goes on with
    the next ones."""


class _Updates:
    """A request's updates not yet read, kept in its event loop's thread. A Progress holds all
    the tokens so far, so one not yet read is replaced by the next: a caller that reads slowly
    (a server's client on a slow link) had had one queued a step, each with every token so far
    (860 MB for 24,000 tokens). The first, the engine's acceptance, and the last, with the
    output or an error, are never replaced."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._first = None  # the first item put

    def put(self, item) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, Progress) and isinstance(last, Progress) and last.output is None and \
                last is not self._first:
            self._items[-1] = item
        else:
            self._items.append(item)
        if self._first is None:
            self._first = item
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class _Request:
    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: List[int], params: SamplingParams, drafts: bool):
        self.loop, self.prompt, self.params, self.drafts = loop, prompt, params, drafts
        self.updates = _Updates()
        self.engine_id: Optional[int] = None
        self.sent = (0, ())  # (finished tokens, draft) last posted, to post only changes
        self.scheduled_at: Optional[float] = None  # (Progress.scheduled_at)

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put, item)
        except RuntimeError:
            pass  # the caller's event loop has closed: nobody is waiting


# Values a snapshot keeps as they are: none of them can change.
_UNCHANGING = (str, bytes, int, tuple, np.generic)


def _snapshot_ids(ids):
    """Token ids as they are now, cheaply, in a form add_request reads as it reads them: a list
    or an array copied (a tuple cannot change); another container (a tensor's row, an
    array.array) as the integer array its check makes of it, where numpy reads it so. An
    iterator, or anything else, stays as it is: the check names it, or reads it, as before."""
    if isinstance(ids, list):
        return list(ids)
    if isinstance(ids, np.ndarray):
        return ids.copy()  # (a masked array keeps its mask)
    if ids is None or isinstance(ids, _UNCHANGING) or iter_once(ids):
        return ids
    try:
        arr = np.array(ids)
    except Exception:  # (numpy cannot read it: the check says why)
        return ids
    return arr if arr.dtype.kind in "iu" and arr.ndim == 1 else ids


def _snapshot_prompt(prompt):
    """A prompt as it is now (the engine thread reads it later: a caller reusing its list had
    changed a queued request); vLLM's dict form, its ids or text within."""
    if isinstance(prompt, dict):
        return {key: _snapshot_ids(value) if key in ("prompt", "prompt_token_ids") else value
                for key, value in prompt.items()}
    return _snapshot_ids(prompt)


def _snapshot_params(params):
    """SamplingParams as they are now: a copy whose id lists are the caller's read as the check
    reads them (a list of theirs); an iterator is read once into the caller's params too, as
    the check reads one, so that params shared by requests keep their ids."""
    if not isinstance(params, SamplingParams):
        return params  # (add_request names what it is)
    params._read_iterators()
    snapshot = copy.copy(params)
    for name in SamplingParams.LIST_FIELDS:
        value = getattr(params, name)
        if not (value is None or isinstance(value, _UNCHANGING)):
            try:
                value = list(value)
            except TypeError:
                pass  # (not iterable: the check names it)
        setattr(snapshot, name, value)
    return snapshot


def _stop_engine(engine: "_EngineThread", pid: int, wait: bool) -> None:
    # (Not in a forked child, which has no engine thread: its locks may be held for good.)
    if os.getpid() == pid:
        engine.stop(wait)


# Every live engine thread, with the process that started it, stopped before the interpreter
# finalizes: a daemon thread inside a native step then had the process abort (SIGABRT) as it
# exited. (One hook for them all: an atexit hook each had stayed for the process's life.)
_ENGINES: "weakref.WeakKeyDictionary[_EngineThread, int]" = weakref.WeakKeyDictionary()


@atexit.register
def _stop_engines_at_exit() -> None:
    engines = [engine for engine, pid in list(_ENGINES.items()) if pid == os.getpid()]
    for engine in engines:  # all told first, so that their passes in progress end together
        engine.stop(wait=False)
    for engine in engines:
        try:
            engine.thread.join()
        except BaseException:  # (a Ctrl-C during one's wait must not leave the others running)
            traceback.print_exc()


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._keys = itertools.count()
        self._engine = engine = _EngineThread(llm)
        # The thread holds the engine's side alone, not this object: dropped without
        # shutdown(), this is collected and the thread stops, freeing the model and its KV
        # cache (the thread had held them until the process exited).
        weakref.finalize(self, _stop_engine, engine, os.getpid(), False).atexit = False
        _ENGINES[engine] = os.getpid()

    @property
    def stats(self) -> dict:
        """The engine's stats (LLM.stats()), refreshed by its thread after every command and step."""
        return self._engine.stats

    async def generate(self, prompt: List[int], params: SamplingParams, drafts: bool = False
                       ) -> AsyncIterator[Progress]:
        """Runs one request, yielding its progress: first an empty Progress once the engine
        has accepted the request (an invalid one raises ValueError instead), then one per
        change; the last carries the output. Closing the iterator early (the client went
        away) aborts the request, freeing its KV at once."""
        request = _Request(asyncio.get_running_loop(), _snapshot_prompt(prompt), _snapshot_params(params), drafts)
        key = next(self._keys)
        engine = self._engine
        with engine.lock:
            if engine.stopping or engine.error is not None:
                raise EngineDead("the engine has stopped" + (f": {engine.error!r}" if engine.error else ""))
            engine.commands.put(("add", key, request))
        finished = False  # the engine has ended the request: nothing to abort
        try:
            while True:
                item = await request.updates.get()
                if isinstance(item, BaseException):  # (the engine posts one only for a request it has dropped)
                    finished = True
                    raise item
                finished = item.output is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                engine.left.add(key)
                engine.commands.put(("abort", key, None))
                # The engine thread reads commands only between steps, and a step of
                # slice_steps passes over a large batch takes tens of seconds on a CPU: end
                # it after its current pass. (After the put: the step clears the interrupt
                # as it returns, and the thread then reads the abort.) A request the engine
                # refused, or has not yet taken, is in no step: the others' goes on (one it is
                # adding, it aborts as it has). One it has taken is, whether or not its caller
                # read that (a caller leaving before had waited for the whole step).
                if request.engine_id is not None:
                    self.llm.interrupt()

    @property
    def alive(self) -> bool:
        """Whether the engine thread still takes requests (not failed, not shut down)."""
        engine = self._engine
        return engine.error is None and not engine.stopping and engine.thread.is_alive()

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that stopped the engine thread, where one did (a bug: it takes no more requests)."""
        return self._engine.error

    @property
    def pass_seconds(self) -> float:
        """How long a forward pass of the engine's latest step took (0 before one ran): what
        ending the engine may wait for, as it ends after the pass in progress."""
        return self._engine.pass_seconds

    def shutdown(self) -> None:
        """Aborts what is still running and stops the engine thread (after the current pass of
        a step in progress). Calls after the first wait for the thread to have stopped."""
        self._engine.stop(wait=True)


class _EngineThread:
    """The engine thread and what it shares with its AsyncLLM's callers: the command queue,
    the stats it posts, and its state (stopping, failed)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.stats = llm.stats()  # refreshed after every command and step
        self.commands: queue.Queue = queue.Queue()
        self.error: Optional[BaseException] = None
        self.pass_seconds = 0.0
        self.stopping = False
        self.lock = threading.Lock()  # orders every "add" before the "stop" command
        # Keys whose caller left before the engine thread read their add: it passes the add
        # over, and drops the key at the abort that follows it. (Admitted, the adds of a
        # disconnected 4,096-choice request had run for minutes on a CPU before their aborts,
        # queued behind them, came through.)
        self.left: set = set()
        self.thread = threading.Thread(target=self._run, name="diffuserve-engine", daemon=True)
        self.thread.start()

    def stop(self, wait: bool) -> None:
        """Aborts what is still running and stops the thread after the current pass of a step
        in progress; `wait`: until it has stopped (not from the thread itself, where a
        collected AsyncLLM's finalizer may run)."""
        with self.lock:
            self.stopping = True
            self.commands.put(("stop", None, None))
        self.llm.interrupt()
        if wait and threading.current_thread() is not self.thread:
            self.thread.join()

    def _run(self) -> None:
        requests = {}  # key -> _Request
        try:
            while True:
                # Block for a command only when there is nothing to compute; with requests
                # running, take commands for _COMMAND_SECONDS at most before their next step
                # (1,024 adds of 2 MB allowed-id lists, queued at once, had kept a running
                # stream waiting 26 s).
                wait, deadline = not self._has_work(requests), None
                while deadline is None or time.monotonic() < deadline:
                    try:
                        command, key, request = self.commands.get(block=wait)
                    except queue.Empty:
                        break
                    if deadline is None:
                        deadline = time.monotonic() + _COMMAND_SECONDS
                    wait = False
                    if command == "stop":
                        self._abort_all(requests, EngineDead("the server is shutting down"))
                        return
                    if command == "add":
                        if key not in self.left:
                            self._add(requests, key, request)
                    else:
                        self.left.discard(key)
                        if key in requests:
                            self.llm.abort(requests.pop(key).engine_id)
                    self.stats = self.llm.stats()
                if self._has_work(requests):
                    try:
                        self._step(requests)
                    except (ValueError, MemoryError) as e:  # refused (InvalidArgument), or out of memory: not fatal
                        logging.getLogger(__name__).error("a step failed, and its requests with it: %s", e)
                        # (Those that finished before the step failed get their outputs from the next.)
                        # (And those another thread's step saw finish: their outputs are held for this engine.)
                        finished = frozenset(request_id for request_id, _ in self.llm.scheduler.finished) | \
                            frozenset(out.request_id for out in self.llm._held)
                        self._abort_all(requests, StepFailed(f"the engine could not run this request: {e}"), finished)
        except BaseException as e:  # a bug in the engine: fail every request instead of hanging them
            with self.lock:
                self.error = e
            self._abort_all(requests, EngineDead(f"the engine failed: {e!r}"))
            while not self.commands.empty():  # requests queued before the error was seen
                command, _, request = self.commands.get()
                if command == "add":
                    request.post(EngineDead(f"the engine failed: {e!r}"))
            raise

    def _add(self, requests: dict, key: int, request: _Request) -> None:
        try:
            with self.llm._lock:  # (claimed before another thread's step could see it finish)
                request.engine_id = self.llm.add_request(request.prompt, request.params)
                self.llm._claimed.add(request.engine_id)
        except Exception as e:  # refused (ValueError), or a failure of this request alone: the engine goes on
            request.post(e)
            return
        if key in self.left:  # its caller left while it was being added: before it interrupts no step
            self.llm.abort(request.engine_id)
            return
        requests[key] = request
        request.post(Progress([]))

    def _has_work(self, requests: dict) -> bool:
        """Whether to step: this engine's requests, or others' in the scheduler (another thread's
        add_request), wait for one. (Not outputs held for another thread's requests alone: a
        step would only hold them again.)"""
        with self.llm._lock:
            return bool(requests) or self.llm.scheduler.has_unfinished()

    def _step(self, requests: dict) -> None:
        # The LLM's lock held from the step to the last request's progress: another thread's
        # generate() between them had finished requests of this engine (their outputs held for
        # its next step), and asking for their tokens then failed every request in the engine.
        with self.llm._lock:
            started, passes = time.monotonic(), self.llm.stats()["forward_passes"]
            ours = frozenset(request.engine_id for request in requests.values())
            finished = {out.request_id: out for out in self.llm._step_for(ours)}
            # Outputs of requests another thread added (add_request, another AsyncLLM on this
            # LLM) are held for its next step, as generate() holds those it does not own.
            self.llm._held.extend(out for request_id, out in finished.items() if request_id not in ours)
            self.stats = self.llm.stats()  # before the outputs are posted: a caller reading stats then sees them gone
            if self.stats["forward_passes"] > passes:
                self.pass_seconds = (time.monotonic() - started) / (self.stats["forward_passes"] - passes)
            progress = []
            waiting = self.llm.scheduler.waiting
            for key, request in list(requests.items()):
                if request.scheduled_at is None and request.engine_id not in waiting:
                    request.scheduled_at = started
                output = finished.get(request.engine_id)
                if output is not None:
                    del requests[key]
                    self.llm._claimed.discard(request.engine_id)
                    failed = output.finish_reason == "error"
                    progress.append((request, RequestFailed(output.error) if failed
                                     else Progress(output.token_ids, output=output, scheduled_at=request.scheduled_at)))
                    continue
                if request.engine_id in waiting and not request.sent[1]:
                    continue  # queued, and no draft of a preempted block to clear: nothing new (asking
                    # 32,768 queued requests had taken 53 ms a step)
                tokens = self.llm.generated(request.engine_id)
                draft = self.llm.draft(request.engine_id) if request.drafts else []
                if (len(tokens), tuple(draft)) != request.sent:
                    request.sent = (len(tokens), tuple(draft))
                    progress.append((request, Progress(tokens, draft,
                                                       denoise_steps=self.llm.denoise_steps(request.engine_id),
                                                       scheduled_at=request.scheduled_at)))
        for request, item in progress:
            request.post(item)

    def _abort_all(self, requests: dict, error: BaseException, finished: frozenset = frozenset()) -> None:
        """Aborts every request but those of the engine ids `finished`, posting each a copy of
        `error` (one instance raised in every caller had gathered all their tracebacks and
        notes)."""
        aborted = []
        try:
            for key, request in list(requests.items()):
                if request.engine_id in finished:
                    continue
                del requests[key]
                aborted.append(request)
                self.llm.abort(request.engine_id)
            self.stats = self.llm.stats()
        finally:
            for request in aborted:
                request.post(type(error)(*error.args))
