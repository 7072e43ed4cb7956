"""The server's counters and histograms, rendered in the Prometheus text format (version 0.0.4).

A handful of metrics do not justify a dependency: counters and histograms are dicts under a lock,
and `render` writes the exposition format by hand.
https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Prefill and decode of one request, in seconds: from a few milliseconds on a GPU to minutes on
# a CPU Vulkan driver.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# One token of one stream: from a millisecond on a GPU to seconds on a CPU Vulkan driver.
TOKEN_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens in one decode step of a batching server
RATE_WINDOW_SECONDS = 10.0  # the aggregate tokens/s gauge counts the decode steps of this last span


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, escaped)) + "}"


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, labels
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items()) or ([((), 0.0)] if not self.label_names else [])
        for labels, v in items:
            lines.append(f"{self.name}{_labels(self.label_names, labels)} {v:g}")
        return lines


class Gauge:
    """A value read at scrape time from a callable (queue depth, running requests)."""

    def __init__(self, name: str, help: str, read: Callable[[], float]):
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {self.read():g}"]


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = SECONDS_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = 0
        for bound, n in zip((*self.buckets, float("inf")), counts):
            cumulative += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{self.name}_sum {total:g}", f"{self.name}_count {cumulative}"]
        return lines


class Rate:
    """Events per second over the last `window` seconds, read at scrape time."""

    def __init__(self, name: str, help: str, window: float = RATE_WINDOW_SECONDS):
        self.name, self.help, self.window = name, help, window
        self._events: deque[tuple[float, float]] = deque()  # (when, amount)
        self._lock = threading.Lock()

    def add(self, amount: float) -> None:
        with self._lock:
            self._events.append((time.monotonic(), amount))

    def value(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window:
                self._events.popleft()
            return sum(amount for _, amount in self._events) / self.window

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {self.value():g}"]


class Metrics:
    """Everything /metrics reports."""

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float],
                 slots: Callable[[], float]):
        self.requests = Counter(
            "airframe_requests_total", "HTTP requests answered, by endpoint and status code.",
            ("endpoint", "status"),
        )
        self.prompt_tokens = Counter("airframe_prompt_tokens_total", "Prompt tokens of answered requests.")
        self.prompt_tokens_cached = Counter("airframe_prompt_tokens_cached_total",
                                            "Prompt tokens whose K/V were kept from the request before (prompt cache).")
        self.prompt_tokens_computed = Counter("airframe_prompt_tokens_computed_total",
                                              "Prompt tokens prefilled: not found in the prompt cache.")
        self.completion_tokens = Counter("airframe_completion_tokens_total", "Tokens generated.")
        self.cancelled = Counter(
            "airframe_requests_cancelled_total",
            "Generations stopped because their client went away (waiting or running).",
        )
        self.prefill_seconds = Histogram("airframe_prefill_seconds", "Prefill time of one request.")
        self.decode_seconds = Histogram("airframe_decode_seconds", "Decode time of one request.")
        self.queue_wait_seconds = Histogram("airframe_queue_wait_seconds",
                                            "Time a request waited in the queue before it started.")
        self.time_to_first_token = Histogram(
            "airframe_time_to_first_token_seconds",
            "From a request's arrival to its first piece of text, queue wait included.")
        self.time_per_output_token = Histogram(
            "airframe_time_per_output_token_seconds",
            "A request's decode time over its tokens after the first.", TOKEN_SECONDS_BUCKETS)
        self.queue_depth = Gauge("airframe_queue_depth", "Requests waiting behind the running ones.", queue_depth)
        self.running = Gauge("airframe_requests_running", "Requests generating now (at most one per slot).", running)
        self.slots = Gauge("airframe_slots", "Requests the server generates at once (K/V slots it batches).", slots)
        self.batch_size = Histogram("airframe_decode_batch_size", "Tokens decoded together in one step.",
                                    BATCH_BUCKETS)
        self.decode_rate = Rate("airframe_decode_tokens_per_second",
                                f"Tokens decoded per second, all requests together, over the last "
                                f"{RATE_WINDOW_SECONDS:g} s.")

    def observe_step(self, batch: int) -> None:
        """Record one decode step of `batch` tokens (called from a batching worker thread)."""
        self.batch_size.observe(batch)
        self.decode_rate.add(batch)

    def observe_finish(self, finish, job) -> None:
        """Record one engine Finish and the queue's times of its job (called from the worker thread)."""
        self.prompt_tokens.inc(amount=finish.prompt_tokens)
        self.prompt_tokens_cached.inc(amount=finish.cached_tokens)
        self.prompt_tokens_computed.inc(amount=finish.prompt_tokens - finish.cached_tokens)
        self.completion_tokens.inc(amount=finish.completion_tokens)
        self.prefill_seconds.observe(finish.prefill_seconds)
        self.decode_seconds.observe(finish.decode_seconds)
        self.queue_wait_seconds.observe(job.waited)
        if job.first_piece is not None:
            self.time_to_first_token.observe(job.first_piece - job.created)
        if finish.completion_tokens > 1:
            self.time_per_output_token.observe(finish.decode_seconds / (finish.completion_tokens - 1))
        if finish.reason == "cancelled":
            self.cancelled.inc()

    def render(self) -> str:
        parts = (
            self.requests, self.prompt_tokens, self.prompt_tokens_cached, self.prompt_tokens_computed,
            self.completion_tokens, self.cancelled,
            self.prefill_seconds, self.decode_seconds, self.queue_wait_seconds, self.time_to_first_token,
            self.time_per_output_token, self.queue_depth, self.running,
            self.slots, self.batch_size, self.decode_rate,
        )
        return "\n".join(line for metric in parts for line in metric.render()) + "\n"
