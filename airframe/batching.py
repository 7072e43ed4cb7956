"""Continuous batching: many requests on one backend at once, each in its own K/V slot.

Requests wait in a queue until a slot is free; the prompt cache's rule picks the slot (PromptSlots,
the busy ones left out), so a conversation that comes back keeps its prefix. Each `step()` then
does two things: at most one prefill chunk's worth of prompt tokens (one chunk of the oldest request
still reading its prompt, or as many whole short prompts as fit, in the order they came; a prompt's
last chunk gives its first token), and one decode step of every request with a token to run, all of
them in one Backend.decode_batch (WebGPU: one forward that reads each weight once for the whole
batch). Requests that join thus delay the running ones by at most one chunk per step, and each of
them still gets a token every step.

Every token goes through the engine's TokenTaker, so stop ids, stop strings, max_tokens, grammars,
logprobs and cancellation behave as for a request alone. A plain greedy request (no penalties,
bias, logprobs or grammar) takes the argmax the backend picks for its row; every other takes the
token its Sampler gives from its row's logits (Backend.decode_batch_pick; WebGPU: the ids picked
and a sampled row reduced to candidates on the GPU, only those read back, the full row only where
the candidates cannot decide the token), the tokens every backend's own sampling path keeps to. A
slot's logits in a batch are the ones it gets alone: a request gives the same tokens either way.

    scheduler = Scheduler(engine)
    streams = [scheduler.submit(engine.prepare(p, params), params) for p in prompts]
    scheduler.run()
    texts = ["".join(i.text for i in s.items if isinstance(i, Piece)) for s in streams]
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .backend import Pick, Picked, pick_row
from .constraint import Constraint
from .engine import Engine, Finish, GenerationParams, Piece, TokenTaker, _PieceBuilder, _check_params, plain_greedy
from .errors import ParameterError
from .prompt_cache import PromptCache
from .sampling import History, Sampler
from .streaming import TextAssembler


@dataclass
class Stream:
    """One request's output: Pieces, then one Finish, appended as the scheduler makes them; or, if
    it failed (logits not finite), `error`. `done` once either is there."""

    prompt_ids: list[int]
    params: GenerationParams
    cancel: Callable[[], bool] | None = None
    items: list = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def text(self) -> str:
        return "".join(item.text for item in self.items if isinstance(item, Piece))

    def finish(self) -> Finish | None:
        return self.items[-1] if self.items and isinstance(self.items[-1], Finish) else None


@dataclass
class _Running:
    """A request in its slot: the prompt left to read, then the token to run next."""

    stream: Stream
    slot: int
    cache: PromptCache
    keep: int
    todo: list[int]             # prompt ids not run yet; the last chunk gives the first token
    sampler: Sampler
    history: History
    taker: TokenTaker
    greedy: bool                # the argmax of the raw logits is its token: the backend may pick it
    next_token: int | None = None


class Scheduler:
    """Requests of one engine, run together (see the module docstring). One thread drives it: the
    caller of submit() and step() owns the engine's backend while any request is unfinished."""

    def __init__(self, engine: Engine, on_batch: Callable[[int], None] | None = None):
        self.engine = engine
        self.backend = engine.backend
        self.waiting: deque[Stream] = deque()
        self.running: list[_Running] = []
        self.on_batch = on_batch or (lambda n: None)  # gets each decode step's token count

    def submit(self, prompt_ids: list[int], params: GenerationParams,
               cancel: Callable[[], bool] | None = None) -> Stream:
        """Queue a request (tokens from Engine.prepare); bad parameters raise here, as in Engine.stream_ids."""
        engine = self.engine
        _check_params(params)
        engine.check_fits(len(prompt_ids))
        if params.max_tokens is not None and params.max_tokens > engine.n_ctx:
            raise ParameterError(f"max_tokens = {params.max_tokens}, expected at most the context's {engine.n_ctx} "
                                 f"tokens, or null (until the context is full)")
        stream = Stream(list(prompt_ids), params, cancel)
        self.waiting.append(stream)
        return stream

    def run(self) -> None:
        """Step until every request submitted has finished."""
        while self.step():
            pass

    def step(self) -> bool:
        """Admit what fits, at most one prefill chunk's tokens, one decode step; True while requests remain."""
        self._admit()
        self._prefill()
        self._decode_all()
        return bool(self.waiting or self.running)

    # ---- the three parts of a step ------------------------------------------------------------
    def _admit(self) -> None:
        engine, backend = self.engine, self.backend
        while self.waiting and len(self.running) < backend.n_slots:
            stream = self.waiting.popleft()
            params = stream.params
            reuse = engine.prompt_cache and params.cache_prompt and backend.keeps_prompt_cache
            slot = engine.slots.choose(stream.prompt_ids, reuse, busy=[r.slot for r in self.running])
            backend.select_slot(slot)
            cache = engine.slots.use(slot)
            keep = cache.reusable(stream.prompt_ids) if reuse else 0
            keep = keep if keep <= backend.n_past else 0  # the backend was reset behind the engine's back
            backend.keep_prefix(keep)
            constraint = Constraint(params.grammar, engine.tokenizer) if params.grammar is not None else None
            pieces = _PieceBuilder(TextAssembler(engine.tokenizer.token_bytes, params.stop), params.logprobs is not None)
            taker = TokenTaker(engine, params, pieces, list(stream.prompt_ids), constraint)
            run = _Running(stream, slot, cache, keep, stream.prompt_ids[keep:],
                           Sampler(params.sampling, engine.config.vocab_size, constraint),
                           History(list(stream.prompt_ids), n_prompt=len(stream.prompt_ids)), taker,
                           plain_greedy(params))
            self.running.append(run)
            if not taker.wants_more():  # max_tokens = 0
                self._finish(run, "length")

    def _prefill(self) -> None:
        """Prompts in the order they came, one chunk's worth of tokens in all: whole short prompts
        while they fit (a burst of requests gets its first tokens in one step), else one chunk of
        the first."""
        backend = self.backend
        budget = chunk = backend.prefill_chunk
        for run in [r for r in self.running if r.todo]:
            if self._cancelled(run):
                continue
            if len(run.todo) > budget:
                if budget == chunk:  # as Engine._prefill: every chunk but the last without logits
                    backend.select_slot(run.slot)
                    backend.prefill_part(run.todo[:chunk], wait=False)
                    run.todo = run.todo[chunk:]
                return
            backend.select_slot(run.slot)
            tokens, run.todo = run.todo, []
            budget -= len(tokens)
            try:
                logits = backend.forward(tokens)
            except Exception as e:
                self._fail(run, e)
                continue
            self._take(run, logits)

    def _decode_all(self) -> None:
        ready = [r for r in list(self.running) if r.next_token is not None and not self._cancelled(r)]
        if not ready:
            return
        picks = [Pick(r.sampler, r.history, greedy=r.greedy, with_logits=r.stream.params.logprobs is not None)
                 for r in ready]
        try:
            rows = self.backend.decode_batch_pick([(r.slot, r.next_token) for r in ready], picks)
        except Exception as e:
            for run in ready:
                self._fail(run, e)
            return
        self.on_batch(len(ready))
        for run, picked in zip(ready, rows):
            self._took(run, picked)

    # ---- one request --------------------------------------------------------------------------
    def _take(self, run: _Running, logits: np.ndarray) -> None:
        """The token sampled from the logits of the request's last position, through its TokenTaker."""
        try:
            picked = pick_row(logits, Pick(run.sampler, run.history, with_logits=True),
                              self.backend.slot_n_past(run.slot) - 1)
        except Exception as e:
            picked = Picked(None, error=e)
        self._took(run, picked)

    def _took(self, run: _Running, picked: Picked) -> None:
        if picked.error is not None:
            self._fail(run, picked.error)
        else:
            self._take_token(run, picked.token, picked.logits)

    def _take_token(self, run: _Running, token: int, logits: np.ndarray | None = None) -> None:
        """A token of the request (drawn from its logits, or its greedy token picked by the backend)."""
        run.next_token = None
        taker = run.taker
        run.sampler.accept(run.history, token)
        if piece := taker.take(token, logits):
            run.stream.items.append(piece)
        if taker.reason:
            self._finish(run, taker.reason)
        elif not taker.wants_more() or self.backend.slot_n_past(run.slot) >= self.backend.n_ctx:
            self._finish(run, "length")  # max_tokens, or no room in the context to run the token
        else:
            run.next_token = token

    def _cancelled(self, run: _Running) -> bool:
        cancel = run.stream.cancel
        if cancel is not None and cancel():
            self._finish(run, "cancelled")
            return True
        return False

    def _finish(self, run: _Running, reason: str) -> None:
        taker, stream = run.taker, run.stream
        run.cache.remember(taker.ran, self.backend.slot_n_past(run.slot))
        if piece := taker.pieces.finish():
            stream.items.append(piece)
        ended = time.perf_counter()
        first = taker.first_token_at or ended
        stream.items.append(Finish(reason, len(stream.prompt_ids), taker.n_sampled, first - stream.submitted,
                                   ended - first, run.keep))
        self._leave(run)

    def _fail(self, run: _Running, error: BaseException) -> None:
        run.cache.forget()
        run.stream.error = error
        self._leave(run)

    def _leave(self, run: _Running) -> None:
        run.stream.done = True
        run.todo, run.next_token = [], None
        self.running.remove(run)
