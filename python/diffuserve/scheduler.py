"""Continuous batching: which requests run in each engine step (the policy; the runtime's
Engine carries it out).

Each step:
1. Running requests, oldest first, each get their pending tokens (prompt chunks, or the
   block to commit) and their canvas, within max_num_batched_tokens. When the KV cache
   cannot take a request's tokens, the newest running request is preempted (its KV freed,
   recomputed later; its output does not change) until it can.
2. Waiting requests are admitted first come, first served while a sequence slot, the
   token budget and the KV cache allow; a request that does not fit blocks those behind it.
3. The engine runs up to `slice_steps` passes: the first as planned, the later ones giving
   the rows that commits and denoise steps leave to the prompts' next chunks. New requests
   join only between steps, so one arriving now waits at most one slice.
"""
from __future__ import annotations

from collections import OrderedDict

from . import _core


class Scheduler:
    def __init__(self, engine: "_core.Engine", max_num_seqs: int, max_num_batched_tokens: int, slice_steps: int):
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slice_steps = slice_steps
        # In arrival order (a preempted request first); a dict, so that an abort from deep in a
        # long queue finds and drops it at once (a deque's scan had made 4,096 aborts from a queue
        # of 32,768 take 1.4 s of the engine thread).
        self.waiting: OrderedDict[int, None] = OrderedDict()
        self.running: list[int] = []  # in admission order
        self.finished: list = []  # (request_id, output) of a step that then failed, for the next to return
        self.preemptions = 0

    def add(self, request_id: int, prompt: list, params: "_core.SamplingParams") -> None:
        self.engine.add(request_id, prompt, params)
        self.waiting[request_id] = None

    def abort(self, request_id: int) -> None:
        """Drops a request wherever it is; its KV is freed at once."""
        if request_id in self.running:
            self.running.remove(request_id)
        elif request_id in self.waiting:
            del self.waiting[request_id]
        else:
            self.finished = [f for f in self.finished if f[0] != request_id]
            return
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.finished)

    def _fit(self, take, request_id: int, encode: int) -> int:
        """Tries `take(request_id, n)` for n = encode, then halves (a smaller prompt chunk
        needs fewer blocks at once) down to one canvas; returns the n that fitted, or -1."""
        floor = min(encode, self.engine.canvas_length(request_id))
        n = encode
        while True:
            if take(request_id, n):
                return n
            if n <= floor:
                return -1
            n = max(floor, n // 2)

    def _preempt(self, request_id: int) -> None:
        self.engine.preempt(request_id)
        self.running.remove(request_id)
        self.waiting[request_id] = None
        self.waiting.move_to_end(request_id, last=False)
        self.preemptions += 1

    def _rows(self, request_id: int, encode: int, pending: int, budget: int) -> int:
        """Rows a request takes this step: its encode, plus its canvas when the encode
        completes the pending tokens and both fit. Where only the encode fits, the engine
        encodes now and denoises next step (so a commit plus a canvas larger than the whole
        budget still makes progress)."""
        with_canvas = encode + (self.engine.canvas_length(request_id) if encode == pending else 0)
        return with_canvas if with_canvas <= budget or encode == 0 else encode

    def step(self) -> list:
        """Plans and runs one engine step; returns [(request_id, GenerationOutput)] of the
        requests that finished."""
        budget = self.max_num_batched_tokens
        plan = []
        for request_id in list(self.running):
            if request_id not in self.running or budget <= 0:
                continue  # preempted below to make room, or no rows left this step
            pending = self.engine.pending_tokens(request_id)
            encode = min(pending, budget)
            if encode:
                while (fitted := self._fit(self.engine.reserve, request_id, encode)) < 0:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim == request_id:
                        break
                if request_id not in self.running:
                    continue
                encode = fitted
            rows = self._rows(request_id, encode, pending, budget)
            if rows > budget:
                continue
            plan.append(_core.StepPlan(request_id, encode))
            budget -= rows

        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request_id = next(iter(self.waiting))
            encode = min(self.engine.pending_tokens(request_id), budget)
            fitted = self._fit(self.engine.admit, request_id, encode)
            if fitted < 0:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popitem(last=False)
            self.running.append(request_id)
            pending = self.engine.pending_tokens(request_id)  # less after a prefix-cache hit
            encode = min(pending, fitted)
            plan.append(_core.StepPlan(request_id, encode))
            budget -= self._rows(request_id, encode, pending, budget)

        if not plan and not self.running and self.waiting:
            # Nothing of ours holds KV, yet the head of the queue does not fit: the model's other
            # sequences (Model.sequence()) hold the cache, and every step would wait on them again.
            request_id = next(iter(self.waiting))
            raise ValueError(f"request {request_id}: the KV cache has no room for its next "
                             f"{self.engine.pending_tokens(request_id)} tokens while other sequences of this model "
                             "hold the rest (release them, or raise kv_cache_memory_bytes)")
        try:
            finished = self.engine.step(plan, self.slice_steps, self.max_num_batched_tokens) if plan else []
        except BaseException:
            # Requests that finished in the step's passes before it failed (out of memory, say)
            # are the engine's no more: their outputs go out with the next step.
            self.finished += self._retire(self.engine.take_finished())
            raise
        finished, self.finished = self.finished + self._retire(finished), []
        return finished

    def _retire(self, finished: list) -> list:
        for request_id, _ in finished:
            self.running.remove(request_id)
        return finished
