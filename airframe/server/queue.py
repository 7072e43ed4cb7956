"""One model, one GPU: a bounded FIFO of requests served one at a time by a worker thread.

The HTTP side puts a `Job` (the prompt's token ids, from `engine.prepare`) in the queue and reads
its events from an asyncio queue; the worker thread runs `engine.stream_ids` for the job at the
head and hands every Piece and the Finish back to the event loop. Cancelling a job that is still
waiting takes it out of the line at once; cancelling the running job makes the engine stop before
its next token or prefill chunk (the engine polls `job.cancelled`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Callable

from ..engine import Finish
from ..errors import AirframeError

END = object()  # put after a job's last event (its Finish, or the exception it raised)


class QueueFullError(AirframeError):
    """Every place in the request queue is taken."""


class Job:
    """One request on its way through the queue: the prompt's ids, the params and the events back."""

    def __init__(self, prompt: Any, params: Any, loop: asyncio.AbstractEventLoop):
        self.prompt = prompt
        self.params = params
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()
        self._queue: RequestQueue | None = None  # set by submit

    def cancel(self) -> None:
        """Stop the job: a waiting one leaves the line now, a running one before its next token."""
        self._cancelled.set()
        if self._queue is not None:
            self._queue.withdraw(self)

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, item: Any) -> None:
        """Called from the worker thread: pass one event to the request's event loop."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down and nobody listens


class RequestQueue:
    """A FIFO of at most `max_waiting` jobs behind the one that runs."""

    def __init__(self, engine, max_waiting: int, on_finish: Callable[[Any], None] | None = None,
                 on_skip: Callable[[Job], None] | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._on_finish = on_finish or (lambda finish: None)
        self._on_skip = on_skip or (lambda job: None)
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="airframe-generate", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting for their turn (not counting the one that runs)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise QueueFullError("the server is shutting down and takes no new requests")
            if self._running is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError(
                    f"the request queue is full: {len(self._waiting)} requests wait behind the "
                    f"running one and --max-queue is {self.max_waiting}; retry later"
                )
            job._queue = self
            if self._running is None:  # an idle worker: the job is the running one from now on
                self._running = job
            else:
                self._waiting.append(job)
            self._cond.notify()

    def withdraw(self, job: Job) -> None:
        """Take a cancelled job out of the line if it is still waiting (Job.cancel calls this)."""
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                removed = True
            else:
                removed = False
        if removed:
            self._on_skip(job)
            job.emit(END)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            if self._running is not None:
                self._running._cancelled.set()
            self._cond.notify_all()
        for job in waiting:
            job._cancelled.set()
            job.emit(END)
        self._thread.join(timeout=5)

    def _next(self, finished: Job | None) -> Job | None:
        """The job to run after `finished`: the head of the line takes its place in the same lock
        hold, so a job counts as waiting or as running at every moment and the bound is exact."""
        with self._cond:
            if finished is not None:
                finished.emit(END)
                self._running = self._waiting.popleft() if self._waiting else None
            while self._running is None and not self._closed:
                self._cond.wait()
            if self._closed:
                if self._running is not None:  # handed over but never started
                    self._running.emit(END)
                return None
            return self._running

    def _work(self) -> None:
        job = None
        while (job := self._next(job)) is not None:
            self._run(job)

    def _run(self, job: Job) -> None:
        if job.cancelled():
            self._on_skip(job)
            return
        try:
            for event in self.engine.stream_ids(job.prompt, job.params, cancel=job.cancelled):
                if isinstance(event, Finish):
                    self._on_finish(event)
                job.emit(event)
        except Exception as e:  # noqa: BLE001 - the HTTP side turns it into an error response
            job.emit(e)
