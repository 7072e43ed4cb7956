"""One model, one GPU: a bounded FIFO of requests and a worker thread that serves them.

The HTTP side puts a `Job` (the prompt's token ids, from `engine.prepare`) in the queue and reads
its events from an asyncio queue; the worker thread hands every Piece and the Finish back to the
event loop. RequestQueue runs one job at a time through `engine.stream_ids`; BatchingQueue runs up
to one job per K/V slot together through the continuous-batching Scheduler. Cancelling a job that
is still waiting takes it out of the line at once; cancelling a running one makes the engine stop
before its next token or prefill chunk (the engine polls `job.cancelled`). `on_finish(finish, job)`
gets every Finish with its job: how long it waited in the line (`waited`) and when its first piece
of text went out (`first_piece`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Callable

from ..engine import Finish, Piece
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
        self.created = time.perf_counter()
        self.started: float | None = None  # when the engine or the scheduler took it
        self.first_piece: float | None = None  # when its first piece of text was passed on

    @property
    def waited(self) -> float:
        """Seconds from the request's arrival to the start of its generation (so far, if waiting)."""
        return (self.started or time.perf_counter()) - self.created

    def cancel(self) -> None:
        """Stop the job: a waiting one leaves the line now, a running one before its next token."""
        self._cancelled.set()
        if self._queue is not None:
            self._queue.withdraw(self)

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, item: Any) -> None:
        """Called from the worker thread: pass one event to the request's event loop."""
        if self.first_piece is None and isinstance(item, Piece):
            self.first_piece = time.perf_counter()
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down and nobody listens


class _Queue:
    """A FIFO of at most `max_waiting` jobs behind the `slots` that run; `_work` serves them."""

    slots = 1

    def __init__(self, engine, max_waiting: int, on_finish: Callable[[Finish, Job], None] | None = None,
                 on_skip: Callable[[Job], None] | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._on_finish = on_finish or (lambda finish, job: None)
        self._on_skip = on_skip or (lambda job: None)
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="airframe-generate", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting for their turn (not counting the ones that run)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise QueueFullError("the server is shutting down and takes no new requests")
            if len(self._active) >= self.slots and len(self._waiting) >= self.max_waiting:
                running = f"{len(self._active)} running" if self.slots > 1 else "the running one"
                raise QueueFullError(
                    f"the request queue is full: {len(self._waiting)} requests wait behind {running} "
                    f"and --max-queue is {self.max_waiting}; retry later"
                )
            job._queue = self
            if len(self._active) < self.slots:  # a free place: the job runs from now on
                self._active.append(job)
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
            for job in self._active:
                job._cancelled.set()
            self._cond.notify_all()
        for job in waiting:
            job._cancelled.set()
            job.emit(END)
        self._thread.join(timeout=5)

    def _done(self, job: Job) -> None:
        """`job` has ended: the head of the line takes its place in the same lock hold, so a job
        counts as waiting or as running at every moment and the bound is exact."""
        with self._cond:
            job.emit(END)
            self._active.remove(job)
            if self._waiting:
                self._active.append(self._waiting.popleft())

    def _wait_for_work(self) -> list[Job] | None:
        """The running jobs once there is one; None when the queue is closed (each job not
        finished gets its END)."""
        with self._cond:
            while not self._active and not self._closed:
                self._cond.wait()
            if self._closed:
                for job in self._active:
                    job.emit(END)
                return None
            return list(self._active)

    def _work(self) -> None:
        raise NotImplementedError


class RequestQueue(_Queue):
    """One job at a time, each through `engine.stream_ids` (the backend's fastest path for one
    stream: greedy decode chained on the GPU)."""

    def _work(self) -> None:
        while (jobs := self._wait_for_work()) is not None:
            self._run(jobs[0])
            self._done(jobs[0])

    def _run(self, job: Job) -> None:
        if job.cancelled():
            self._on_skip(job)
            return
        job.started = time.perf_counter()
        try:
            for event in self.engine.stream_ids(job.prompt, job.params, cancel=job.cancelled):
                if isinstance(event, Finish):
                    self._on_finish(event, job)
                job.emit(event)
        except Exception as e:  # noqa: BLE001 - the HTTP side turns it into an error response
            job.emit(e)


class BatchingQueue(_Queue):
    """Up to one job per K/V slot at once, stepped together by the Scheduler: a job that joins
    has its prompt read (at most a chunk's worth of prompts per step) while the others decode
    (airframe/batching.py).
    `on_step(batch)` gets each decode step's token count."""

    def __init__(self, engine, max_waiting: int, on_finish: Callable[[Finish, Job], None] | None = None,
                 on_skip: Callable[[Job], None] | None = None,
                 on_step: Callable[[int], None] | None = None):
        from ..batching import Scheduler

        self.slots = engine.backend.n_slots
        self._scheduler = Scheduler(engine, on_batch=on_step)
        super().__init__(engine, max_waiting, on_finish, on_skip)

    def _work(self) -> None:
        streams: dict[Job, tuple[Any, int]] = {}  # job -> (its Stream, items already emitted)
        while (jobs := self._wait_for_work()) is not None:
            for job in jobs:
                if job not in streams and not self._join(job, streams):
                    self._done(job)
            if not streams:
                continue
            self._scheduler.step()
            for job, (stream, sent) in list(streams.items()):
                for item in stream.items[sent:]:
                    if isinstance(item, Finish):
                        self._on_finish(item, job)
                    job.emit(item)
                streams[job] = (stream, len(stream.items))
                if stream.done:
                    if stream.error is not None:
                        job.emit(stream.error)
                    del streams[job]
                    self._done(job)

    def _join(self, job: Job, streams: dict) -> bool:
        """Hand a job that has just got its place to the scheduler; False if it never starts."""
        if job.cancelled():
            self._on_skip(job)
            return False
        job.started = time.perf_counter()
        try:
            streams[job] = (self._scheduler.submit(job.prompt, job.params, cancel=job.cancelled), 0)
        except Exception as e:  # noqa: BLE001 - the HTTP side turns it into an error response
            job.emit(e)
            return False
        return True
