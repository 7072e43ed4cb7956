"""WebGPU measurements for `airframe bench`: prefill tokens/s of an N-token chunk at depth 0 and at
the largest context asked (llama-bench's pp512 and pp512 @ d4096 by default), the time to the first
token of a longer prompt, decode ms/token at several contexts (greedy chained on the GPU, and a sampled
request: drawn on the GPU from its candidates, sampled from the full logits, and constrained by a
JSON schema), where a token's and a chunk's GPU time goes per op class, and the share of the
bandwidth floor, against a streaming read measured in the same run.

GPU times come from timestamp queries at the start and end of compute passes where the adapter has
them (wall time around a submit otherwise). Every measurement starts after WARM_S seconds of GPU
work: GPUs lower their clocks when idle, and a probe right after a pause reads half the bandwidth.
One progress bar counts the timed steps of every phase; where the run would take longer than
SLOW_S (a CPU adapter such as lavapipe), it first says how long, from one timed token and chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import wgpu
from tqdm import tqdm

from ..backend import Pick, open_backend
from ..batching import Scheduler
from ..constraint import Constraint, json_schema_grammar
from ..engine import Engine, GenerationParams
from ..model import open_model
from ..options import RunOptions
from ..sampling import History, Sampler, SamplingParams
from ..tokenizer import load_tokenizer
from . import candidates as cand
from . import pipelines as pl
from .backend import WebGPUBackend
from .device import get_context
from .greedy import chain
from .sampled import ChainCounts

PROBE_BYTES = 1 << 30
PROBE_THREADS = 256 * 1024  # enough loads in flight to saturate an H200 (64K threads read half as fast)
WARM_S = 0.5
ROW_WARM_S = 0.2    # GPU-bound passes before each decode row: a host-bound row before lets the clocks drop
TTFT_TOKENS = 2000  # the long prompt of the time to first token, cut to the largest context asked
PROMPT_RUNS = 3     # timed runs of each prompt, after one that compiles its chunks' pipelines
SLOW_S = 60.0       # a run expected to take longer is announced with its length


class GpuTimer:
    """Seconds of GPU time of whole compute passes, from timestamp queries."""

    def __init__(self, ctx, n_passes: int = 64):
        self.ctx = ctx
        self.enabled = ctx.has_timestamps
        self.n_passes = n_passes
        self.used = 0
        self.fence = ctx.device.create_buffer(size=16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        if self.enabled:
            self.queries = ctx.device.create_query_set(type="timestamp", count=2 * n_passes)
            self.resolved = ctx.device.create_buffer(
                size=16 * n_passes, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)

    def writes(self) -> dict | None:
        """timestamp_writes for the next pass (None without timestamps)."""
        if not self.enabled:
            return None
        i, self.used = self.used, self.used + 1
        assert i < self.n_passes, "GpuTimer: more passes than queries"
        return {"query_set": self.queries, "beginning_of_pass_write_index": 2 * i, "end_of_pass_write_index": 2 * i + 1}

    def wait(self) -> None:
        """Until the GPU has done everything submitted (a read-back waits for the queue)."""
        self.ctx.device.queue.read_buffer(self.fence, 0, 16)

    def read_spans(self) -> np.ndarray:
        """(passes, 2) start and end of the passes since the last read, in seconds."""
        n, self.used = self.used, 0
        if not self.enabled or n == 0:
            return np.zeros((0, 2))
        encoder = self.ctx.device.create_command_encoder()
        encoder.resolve_query_set(self.queries, 0, 2 * n, self.resolved, 0)
        self.ctx.device.queue.submit([encoder.finish()])
        ticks = np.frombuffer(self.ctx.device.queue.read_buffer(self.resolved, 0, 16 * n), np.uint64)
        return ticks.astype(np.float64).reshape(n, 2) * 1e-9

    def read(self) -> list[float]:
        """The durations of the passes since the last read, in seconds."""
        spans = self.read_spans()
        return list(spans[:, 1] - spans[:, 0])


def time_passes(ctx, timer: GpuTimer, dispatches: list[pl.Dispatch], repeats: int, passes: int = 5) -> float:
    """Median seconds of one run of `dispatches`, each pass repeating them `repeats` times."""
    walls = []
    for _ in range(passes):
        encoder = ctx.device.create_command_encoder()
        pl.record(encoder, dispatches * repeats, timer.writes())
        started = time.perf_counter()
        ctx.device.queue.submit([encoder.finish()])
        timer.wait()
        walls.append(time.perf_counter() - started)
    gpu = timer.read() or walls
    return statistics.median(gpu) / repeats


def warm_up(ctx, timer: GpuTimer, dispatches: list[pl.Dispatch], seconds: float = WARM_S) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        time_passes(ctx, timer, dispatches, 1, passes=2)


def streaming_bandwidth(ctx, timer: GpuTimer | None = None) -> dict:
    """Bytes/s of a coalesced streaming read (stream_read.wgsl) after a warm-up: the median and the
    spread of 20 passes of 5 reads each."""
    timer = timer or GpuTimer(ctx)
    pipes = pl.Pipelines(ctx)
    n_bytes = min(PROBE_BYTES, ctx.max_binding, ctx.max_buffer) // 16 * 16
    src = pipes.storage(n_bytes, "probe_src")
    out = pipes.storage(PROBE_THREADS * 4, "probe_out")
    params = pipes.uniform(pl.pack_params("stream_read", n_vec4=n_bytes // 16, n_threads=PROBE_THREADS))
    dispatch = pl.Dispatch("stream_read", pipes.pipeline("stream_read"), pipes.bind("stream_read", [src, out, params]),
                           (PROBE_THREADS // 256, 1, 1))
    warm_up(ctx, timer, [dispatch])
    rates = sorted(n_bytes / time_passes(ctx, timer, [dispatch], 5, passes=1) for _ in range(20))
    return {"bytes_per_s": statistics.median(rates), "min": rates[0], "max": rates[-1], "probe_bytes": n_bytes}


# ---- what a model reads ---------------------------------------------------------------------
def weight_bytes_per_token(be: WebGPUBackend) -> int:
    """Bytes of weights one decode token reads: every layer buffer, the LM head, one embedding row."""
    layers = sum(p.n_words * 4 for p in be.layers)
    head = sum(c.size for c in be.output.chunks)
    return layers + head + be.token_embd.row_words * 4


def kv_bytes_per_token(be: WebGPUBackend, context: int) -> int:
    c = be.config
    return 2 * c.n_layers * c.n_head_kv * context * c.head_dim * 4


def _op_class(label: str) -> str:
    """blk.3.qkv@0 -> qkv; lm_head#1 -> lm_head."""
    return label.split(".")[-1].split("@")[0].split("#")[0]


def dispatch_times(ctx, dispatches: list[pl.Dispatch], runs: int = 5) -> list[float]:
    """GPU seconds of each dispatch where it stands in the pass: from the end of the one before to
    its own end (timestamps between dispatches, `timestamp-query-inside-passes`), median of runs."""
    n = len(dispatches) + 1
    queries = ctx.device.create_query_set(type="timestamp", count=n)
    resolved = ctx.device.create_buffer(size=8 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    samples = []
    for _ in range(runs):
        encoder = ctx.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute._write_timestamp(queries, 0)
        for i, d in enumerate(dispatches):
            compute.set_pipeline(d.pipeline)
            compute.set_bind_group(0, d.bind_group)
            compute.dispatch_workgroups(*d.workgroups)
            compute._write_timestamp(queries, i + 1)
        compute.end()
        encoder.resolve_query_set(queries, 0, n, resolved, 0)
        ctx.device.queue.submit([encoder.finish()])
        ticks = np.frombuffer(ctx.device.queue.read_buffer(resolved), np.uint64).astype(np.float64)
        samples.append(np.diff(ticks) * 1e-9)
    return list(np.median(np.stack(samples), axis=0))


def gpu_breakdown(be: WebGPUBackend, timer: GpuTimer, n_tokens: int, position: int, repeats: int) -> dict:
    """GPU ms of one forward of n_tokens at `position` (a decode token or a prefill chunk, with the
    LM head of one position), in all and per op class: where the adapter can write timestamps
    between dispatches, each dispatch as it runs in the token's pass ("in the pass"); otherwise
    each op class's dispatches alone, repeated. Leaves the cache dirty: reset after."""
    be.reset()
    be.n_past = position
    be.write_step(n_tokens)
    be.write_head_step(1, n_tokens - 1)
    work = be.token_dispatches(n_tokens)
    out = {"n_tokens": n_tokens, "position": position,
           "total_ms": 1000 * time_passes(be.ctx, timer, work, repeats), "ops_ms": {},
           "in_pass": "timestamp-query-inside-passes" in be.ctx.features}
    if out["in_pass"]:
        for d, seconds in zip(work, dispatch_times(be.ctx, work)):
            name = _op_class(d.label)
            out["ops_ms"][name] = out["ops_ms"].get(name, 0.0) + 1000 * seconds
    else:
        for name in dict.fromkeys(_op_class(d.label) for d in work):
            ops = [d for d in work if _op_class(d.label) == name]
            out["ops_ms"][name] = 1000 * time_passes(be.ctx, timer, ops, repeats)
    be.reset()
    return out


# ---- prefill --------------------------------------------------------------------------------
def prompt_seconds(be: WebGPUBackend, n_tokens: int, depth: int = 0, runs: int = PROMPT_RUNS, bar=None) -> float:
    """Seconds from a prompt of n_tokens after `depth` cached positions (their K/V contents do not
    change the speed) to the logits of its last position on the host, median of `runs`; `bar`
    (a tqdm) advances by one per run."""
    ids = np.random.default_rng(0).integers(0, be.config.vocab_size, n_tokens).tolist()  # ints, as a tokenizer's
    times = []
    for _ in range(runs + 1):  # the first run compiles the pipelines of this prompt's chunks
        be.reset()
        be.n_past = depth
        started = time.perf_counter()
        be.forward(ids)
        times.append(time.perf_counter() - started)
        if bar is not None:
            bar.update(1)
    be.reset()
    return statistics.median(times[1:])


# ---- decode ---------------------------------------------------------------------------------
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=0)
# the constrained row's answers: strings as long as the model makes them, as many as it likes
CONSTRAINED_SCHEMA = {"type": "array", "items": {"type": "string"}}


def sampled_decode_ms(be: WebGPUBackend, context: int, steps: int, on_gpu: bool = True,
                      constrain: Callable[[], Constraint] | None = None) -> float:
    """ms/token of a sampled request (SAMPLED) decoding `steps` tokens from position context - 1 as
    the engine does (sample_stream): drawn on the GPU and checked by the host a token behind
    (sampled.py), or (not on_gpu) one forward at a time sampled from the full logits read back.
    With `constrain` (a new answer's Constraint) each token keeps to a grammar; an answer it
    completes early is followed by another from the same position (another seed) until `steps`
    tokens are timed, an answer's first token (the host path) never."""
    reduces, be.reduces_on_device = be.reduces_on_device, be.reduces_on_device and on_gpu

    def answer(seed: int, limit: int) -> tuple[int, float]:
        """Up to `limit` tokens of one answer after its first: (how many, their seconds)."""
        be.reset()
        be.n_past = context - 1
        constraint = constrain() if constrain is not None else None
        sampler = Sampler(dataclasses.replace(SAMPLED, seed=seed), be.config.vocab_size, constraint)
        stream = be.sample_stream(sampler, History([1], n_prompt=1), [1])
        try:
            next(stream)  # the first token runs on the host path, and records the pipelines' first use
            started = time.perf_counter()
            n = 0
            while n < limit and not (constraint is not None and constraint.done):
                next(stream)
                n += 1
            return n, time.perf_counter() - started
        finally:
            stream.close()

    try:
        warmed, seed = 0, 0
        while warmed < 4 and seed < 16:  # the first use of its pipelines and calls: 4 tokens past a first
            warmed, seed = warmed + answer(seed, 4 - warmed)[0], seed + 1
        if on_gpu:
            be.chain_counts = ChainCounts()
        timed, seconds, answers = 0, 0.0, 0
        while timed < steps:
            n, s = answer(answers, steps - timed)
            timed, seconds, answers = timed + n, seconds + s, answers + 1
        return 1000 * seconds / steps
    finally:
        be.reduces_on_device = reduces
        be.reset()


def chained_decode_ms(be: WebGPUBackend, context: int, steps: int, runs: int = 3) -> float:
    """ms/token of `steps` greedy tokens chained on the GPU (greedy.py) from position context - 1,
    the ids read back in batches: median of `runs` whole chains, each timed to its last id."""
    times = []
    for _ in range(runs):
        be.reset()
        be.n_past = context - 1
        started = time.perf_counter()
        for _ in chain(be, 1, steps):
            pass
        times.append(time.perf_counter() - started)
    be.reset()
    return 1000 * statistics.median(times) / steps


def chained_gpu_timeline(be: WebGPUBackend, context: int, steps: int, timer: GpuTimer) -> dict:
    """One greedy chain with each token's pass timestamped: the median GPU time of a token's pass
    and of the gap between one token's pass and the next (the GPU waiting for the host)."""
    be.reset()
    be.n_past = context - 1
    for _ in chain(be, 1, min(steps, timer.n_passes), timestamps=timer.writes):
        pass
    spans = timer.read_spans()
    be.reset()
    if len(spans) < 2:
        return {}
    busy = spans[:, 1] - spans[:, 0]
    gaps = spans[1:, 0] - spans[:-1, 1]
    return {"pass_ms": 1000 * float(np.median(busy)), "gap_ms": 1000 * float(np.median(gaps))}


def record_ms(be: WebGPUBackend, repeats: int = 20) -> dict:
    """Host ms to record one decode token's compute pass (medians), without submitting it: making
    the list of dispatches, recording them, and finishing the command buffer."""
    parts = {"list": [], "record": [], "finish": []}
    for _ in range(repeats):
        started = time.perf_counter()
        dispatches = be.token_dispatches(1)
        listed = time.perf_counter()
        encoder = be.ctx.device.create_command_encoder()
        pl.record(encoder, dispatches)
        recorded = time.perf_counter()
        encoder.finish()
        done = time.perf_counter()
        for name, seconds in (("list", listed - started), ("record", recorded - listed), ("finish", done - recorded)):
            parts[name].append(seconds)
    return {name: 1000 * statistics.median(v) for name, v in parts.items()}


def sampled_host_ms(be: WebGPUBackend, repeats: int = 20) -> dict:
    """Host ms of one sampled token chained on the GPU (SAMPLED, sampled.py's fused step), medians,
    the GPU's work left out: the penalty table made and written ("table": Sampler.reduction and
    write_request), the token's forward, reduction and draw recorded ("record"), and its read-back
    parsed and sampled ("sample": parse and Sampler.sample_reduced). Beside record_ms, it says
    whether the host keeps ahead of the GPU on a sampled request. {} where reductions run on the
    host."""
    if not be.reduces_on_device:
        return {}
    sampler = Sampler(SAMPLED, be.config.vocab_size)
    n = min(64, be.n_ctx - 1)  # a repetition window of distinct tokens, run as a prompt for real logits
    history = History([(7 * i) % be.config.vocab_size for i in range(1, n + 1)], n_prompt=n)
    ops = be.candidates
    be.reset()
    try:
        be.forward_pending(history.tokens)
        reduction = sampler.reduction(history, *be.candidate_limits)
        be.read_candidates(reduction)
        data = pl.read_mapped(ops.staging[0], cand.OUT_BYTES, np.uint8)
        parts = {"table": [], "record": [], "sample": []}
        for _ in range(repeats):
            started = time.perf_counter()
            cand.write_request(be, ops, sampler.reduction(history, *be.candidate_limits, pending=True))
            tabled = time.perf_counter()
            cand.record(be, ops, 1, be.token_dispatches(1))
            recorded = time.perf_counter()
            found = cand.parse(data, reduction)
            if found.candidates is not None:
                sampler.sample_reduced(history, found.candidates)
            sampled = time.perf_counter()
            for name, seconds in (("table", tabled - started), ("record", recorded - tabled),
                                  ("sample", sampled - recorded)):
                parts[name].append(seconds)
        return {name: 1000 * statistics.median(v) for name, v in parts.items()}
    finally:
        be.reset()


def _decode_rows(be: WebGPUBackend, ctx_list: list[int], steps: int, bandwidth: float, weights: int,
                 timer: GpuTimer, bar) -> list[dict]:
    @functools.cache
    def grammar_and_tokenizer():  # made at the first constrained row: without llguidance that row alone fails
        return json_schema_grammar(CONSTRAINED_SCHEMA), load_tokenizer(be.gf)

    def constrain() -> Constraint:
        return Constraint(*grammar_and_tokenizer())

    rows = []
    for context in ctx_list:
        n_bytes = weights + kv_bytes_per_token(be, context)
        floor_ms = 1000 * n_bytes / bandwidth
        row = {"context": context, "bytes_per_token": n_bytes, "floor_ms": floor_ms}
        be.n_past = context - 1
        row["dispatches"] = be.dispatch_count(1) + len(be.argmax.dispatches)
        # (the row's key, the measurement, the key of its chain's counts)
        measures = (("chained_ms", chained_decode_ms, None), ("sampled_ms", sampled_decode_ms, "sampled_tokens"),
                    ("sampled_full_ms", lambda *a: sampled_decode_ms(*a, on_gpu=False), None),
                    ("constrained_ms", lambda *a: sampled_decode_ms(*a, constrain=constrain), "constrained_tokens"))
        for name, measure, counts in measures:
            warm_up(be.ctx, timer, be.token_dispatches(1), ROW_WARM_S)
            try:  # the other numbers must survive a failure here
                row[name] = measure(be, context, steps)
                if counts:
                    row[counts] = dataclasses.asdict(be.chain_counts)
            except Exception as e:  # noqa: BLE001 - reported in the result instead
                row[name + "_error"] = f"{type(e).__name__}: {e}"
            bar.update(1)
        if timer.enabled:
            warm_up(be.ctx, timer, be.token_dispatches(1), ROW_WARM_S)
            row["chained_gpu"] = chained_gpu_timeline(be, context, steps, timer)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Sizes:
    """The prompts one run times, from what was asked: an N-token chunk at depth 0 and at the largest
    context, and the time to the first token of a TTFT_TOKENS prompt cut to that context (None when
    that is no longer than the chunk: it would time the same prompt again)."""

    prefill: int
    depth: int
    ttft: int | None

    @classmethod
    def asked(cls, ctx_list: list[int], prefill: int) -> "Sizes":
        depth = max(ctx_list)
        ttft = min(TTFT_TOKENS, depth)
        return cls(prefill, depth, ttft if ttft > prefill else None)

    def n_ctx(self, ctx_list: list[int], steps: int) -> int:
        return max(max(ctx_list) + steps + 1, self.depth + self.prefill, self.ttft or 0)

    def chunks(self) -> list[tuple[int, int, int]]:
        """(tokens, position, repeats) of the chunks whose GPU time is broken down: at depth 0 and at depth."""
        return [(self.prefill, 0, 1)] + ([(self.prefill, self.depth, 1)] if self.depth > 1 else [])

    def prompts(self) -> list[tuple[int, int]]:
        """(tokens, depth) of every prompt timed: the chunk, the chunk at depth, the long prompt."""
        return [(self.prefill, 0), (self.prefill, self.depth)] + ([(self.ttft, 0)] if self.ttft else [])


def estimate_seconds(be: WebGPUBackend, sizes: Sizes, ctx_list: list[int], steps: int) -> float:
    """How long the measurements after the streaming read take, from one timed decode token and one
    short chunk (attention's growth with the context left out: a lower bound on long contexts)."""
    token_s = prompt_seconds(be, 1, runs=1)
    probe = min(sizes.prefill, 32)
    per_prompt_token = prompt_seconds(be, probe, runs=1) / probe
    prompt_tokens = (PROMPT_RUNS + 1) * sum(n for n, _ in sizes.prompts())
    prompt_tokens += 10 * sizes.prefill * len(sizes.chunks())  # a chunk's GPU breakdown: 5 passes, 5 timestamped runs
    tokens = len(ctx_list) * (105 + 7 * steps + 3)  # per context: the breakdown, then the decode runs
    return prompt_tokens * per_prompt_token + tokens * token_s


def bench_webgpu(path, ctx_list: list[int], steps: int = 64, prefill_tokens: int = 512, matmul: str = "auto",
                 progress: bool = True, slow_s: float = SLOW_S) -> dict:
    """All numbers of one run as a dict (format_result prints them). With `progress`, a bar on stderr
    counts the timed steps, and a run longer than `slow_s` seconds is announced there first."""
    ctx = get_context()
    sizes = Sizes.asked(ctx_list, prefill_tokens)
    options = RunOptions.from_env(n_ctx=sizes.n_ctx(ctx_list, steps), progress=progress, matmul=matmul)
    be = open_backend("webgpu", open_model(path), options)  # the context checked against memory first
    timer = GpuTimer(ctx)
    n_steps = 2 + len(sizes.prompts()) * (PROMPT_RUNS + 1) + len(ctx_list) + len(sizes.chunks()) + 4 * len(ctx_list)
    with tqdm(total=n_steps, desc="bench", unit="step", disable=not progress) as bar:
        bar.set_description("bench: streaming read")
        probe = streaming_bandwidth(ctx, timer)
        bar.update(1)
        bar.set_description("bench: estimating the run")
        estimate = estimate_seconds(be, sizes, ctx_list, steps)
        if progress and estimate > slow_s:
            bar.write(f"airframe: bench: this run will take about {_duration(estimate)} on {ctx.name}; "
                      f"--prefill, --ctx-list and --steps make it shorter", file=sys.stderr)
        bandwidth = probe["bytes_per_s"]
        weights = weight_bytes_per_token(be)
        result = {"backend": "webgpu", "adapter": ctx.name, "model": str(path), "matmul": be.pipes.matmul,
                  "bandwidth_GBps": bandwidth / 1e9, "bandwidth_spread_GBps": (probe["min"] / 1e9, probe["max"] / 1e9),
                  "gpu_timestamps": timer.enabled, "weight_bytes_per_token": weights, "record_ms": record_ms(be),
                  "sampled_host_ms": sampled_host_ms(be), "estimated_s": estimate}
        bar.update(1)
        bar.set_description(f"bench: prefill of {sizes.prefill} tokens")
        seconds = [prompt_seconds(be, n, depth, bar=bar) for n, depth in sizes.prompts()]
        result["prefill"] = {"tokens": sizes.prefill, "depth": sizes.depth,
                             "tokens_per_s": sizes.prefill / seconds[0],
                             "tokens_per_s_at_depth": sizes.prefill / seconds[1],
                             "ttft_tokens": sizes.ttft, "ttft_s": seconds[2] if sizes.ttft else None}
        bar.set_description("bench: GPU time per op class")
        warm_up(ctx, timer, be.token_dispatches(1), 0.2)
        result["gpu"] = []
        for n_tokens, position, repeats in [(1, c - 1, 20) for c in ctx_list] + sizes.chunks():
            result["gpu"].append(gpu_breakdown(be, timer, n_tokens, position, repeats))
            bar.update(1)
        bar.set_description("bench: decode")
        result["decode"] = _decode_rows(be, ctx_list, steps, bandwidth, weights, timer, bar)
    return result


SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.1, seed=1)


def bench_concurrency(path, levels: list[int], steps: int = 64, prompt_tokens: int = 128, matmul: str = "auto",
                      progress: bool = True) -> dict:
    """Decode of N conversations at once for each N of `levels` (airframe/batching.py's decode step):
    each of N slots holds a prompt of `prompt_tokens` random ids, then `steps` batched steps run,
    each one Backend.decode_batch_pick as the scheduler calls it: greedy (every row's id picked on
    the GPU), then sampled from the same prompts (SAMPLED: each row reduced to candidates on the
    GPU). Per level: the median wall ms of a step of each (each stream's ms/token), the aggregate
    greedy tokens/s, the time to first token of N requests that arrive together (through the
    Scheduler, as the server runs them), and the GPU ms of the step's dispatches with the share
    of each op class (timestamps, where the adapter has them); beside them, batch-1 greedy
    chained on the GPU at the same context, the fastest single stream."""
    top = max(levels)
    options = RunOptions.from_env(n_ctx=prompt_tokens + steps + 8, progress=progress, matmul=matmul, slots=top)
    engine = Engine.load(open_model(path), "webgpu", options)
    be = engine.backend
    timer = GpuTimer(be.ctx)
    rng = np.random.default_rng(0)
    vocab = be.config.vocab_size
    rows = []
    with tqdm(total=len(levels) * 2 * (steps + 2) + 1, desc="bench: concurrency", unit="step",
              disable=not progress) as bar:
        chained = chained_decode_ms(be, prompt_tokens + 1, steps, runs=3)  # the first run compiles
        bar.update(1)
        for n in levels:
            prompts = [rng.integers(0, vocab, prompt_tokens + 1).tolist() for _ in range(n)]
            ms = {}
            for kind, params in (("greedy", SamplingParams(temperature=0.0)), ("sampled", SAMPLED)):
                ms[kind] = _batch_steps_ms(be, timer, prompts, params, steps, bar)
            row = {"streams": n, "step_ms": ms["greedy"], "sampled_step_ms": ms["sampled"],
                   "tokens_per_s": 1000 * n / ms["greedy"], "first_token_ms": _first_tokens_ms(engine, prompts)}
            if timer.enabled:
                row.update(_batch_gpu_ms(be, timer, [(slot, p[-1]) for slot, p in enumerate(prompts)]))
            rows.append(row)
    base = rows[0]["tokens_per_s"] / rows[0]["streams"] if rows else 0.0
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    return {"adapter": get_context().name, "model": str(path), "prompt_tokens": prompt_tokens, "steps": steps,
            "sampled": dataclasses.asdict(SAMPLED), "chained_batch1_ms": chained, "levels": rows}


def _batch_steps_ms(be, timer: GpuTimer, prompts: list[list[int]], params: SamplingParams, steps: int, bar) -> float:
    """Median wall ms of a decode_batch_pick step of one stream per prompt (its last id the first to
    run), every row chosen by `params` (greedy: picked on the GPU), after ROW_WARM_S of GPU-bound
    passes (slot 0's next token, whose K/V the first step writes again)."""
    picks = []
    for slot, prompt in enumerate(prompts):
        be.select_slot(slot)
        be.reset()
        be.forward(prompt[:-1])
        picks.append(Pick(Sampler(params, be.config.vocab_size), History(list(prompt), n_prompt=len(prompt)),
                          greedy=params.temperature == 0.0))
    be.select_slot(0)
    warm_up(be.ctx, timer, be.token_dispatches(1), ROW_WARM_S)
    tokens = [prompt[-1] for prompt in prompts]
    times = []
    for step in range(steps + 2):  # the first two compile the batch's pipelines and warm the GPU
        started = time.perf_counter()
        picked = be.decode_batch_pick(list(enumerate(tokens)), picks)
        if step >= 2:
            times.append(time.perf_counter() - started)
        tokens = [p.token for p in picked]
        for pick, token in zip(picks, tokens):
            pick.sampler.accept(pick.history, token)
        bar.update(1)
    return 1000 * statistics.median(times)


def _first_tokens_ms(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Each request's ms from its arrival to its first token, fastest first, when one request per
    prompt arrives at once: the Scheduler reads a chunk's worth of their prompts per step."""
    engine.forget_prompt_cache()
    scheduler = Scheduler(engine)
    params = GenerationParams(max_tokens=1, sampling=SamplingParams(temperature=0.0), stop_token_ids=[],
                              cache_prompt=False)
    streams = [scheduler.submit(prompt, params) for prompt in prompts]
    scheduler.run()
    engine.forget_prompt_cache()
    return sorted(1000 * stream.finish().prefill_seconds for stream in streams)


def _batch_gpu_ms(be: WebGPUBackend, timer: GpuTimer, entries: list[tuple[int, int]]) -> dict:
    """GPU ms of one decode_batch forward of `entries`, and per op class as it runs in the pass
    where the adapter times dispatches inside a pass."""
    work = be.batch_dispatches(entries)[1]
    out = {"gpu_ms": 1000 * time_passes(be.ctx, timer, work, repeats=5)}
    if "timestamp-query-inside-passes" in be.ctx.features:
        ops: dict[str, float] = {}
        for d, seconds in zip(work, dispatch_times(be.ctx, work)):
            ops[_op_class(d.label)] = ops.get(_op_class(d.label), 0.0) + 1000 * seconds
        out["ops_ms"] = ops
    return out


def format_concurrency(r: dict) -> str:
    lines = [f"webgpu on {r['adapter']}: decode of N conversations at once, each after a {r['prompt_tokens']}-token "
             f"prompt, {r['steps']} steps (median)",
             f"model: {r['model']}",
             "  streams   ms/step (each stream's ms/token)   sampled ms/step   GPU ms/step   aggregate tokens/s"
             "   x one stream   first token ms (first / last)"]
    for row in r["levels"]:
        gpu = f"{row['gpu_ms']:>11.3f}" if "gpu_ms" in row else f"{'-':>11}"
        first = f"{row['first_token_ms'][0]:.1f} / {row['first_token_ms'][-1]:.1f}"
        lines.append(f"  {row['streams']:>7}   {row['step_ms']:>33.3f}   {row['sampled_step_ms']:>15.3f}   {gpu}   "
                     f"{row['tokens_per_s']:>18.1f}   {row['speedup']:>12.2f}   {first:>29}")
    p = r["sampled"]
    lines.append(f"  sampled: temperature {p['temperature']}, top-k {p['top_k']}, top-p {p['top_p']}, "
                 f"repeat penalty {p['repeat_penalty']}")
    lines.append(f"  one stream, greedy chained on the GPU: {r['chained_batch1_ms']:.3f} ms/token")
    for row in r["levels"]:
        if row.get("ops_ms"):
            ops = ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(row["ops_ms"].items(), key=lambda kv: -kv[1]))
            lines.append(f"  GPU ms by op, {row['streams']} streams: {ops}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def _decode_lines(r: dict) -> list[str]:
    lines = ["decode ms/token   chained greedy (share of floor)   sampled: chained on the GPU / full logits"
             " / constrained   floor ms   dispatches"]
    for d in r["decode"]:
        chained = (f"{d['chained_ms']:8.3f} ({100 * d['floor_ms'] / d['chained_ms']:5.1f}%)"
                   if "chained_ms" in d else f"FAILED ({d['chained_ms_error']})")
        sampled = " / ".join(f"{d[k]:8.3f}" if k in d else f"FAILED ({d[k + '_error']})"
                             for k in ("sampled_ms", "sampled_full_ms", "constrained_ms"))
        lines.append(f"  context {d['context']:>6}   {chained:>30}   {sampled:>56}   {d['floor_ms']:8.3f}   "
                     f"{d['dispatches']:>10}")
    for d in r["decode"]:
        for key, what in (("sampled_tokens", "sampled"), ("constrained_tokens", "constrained")):
            if c := d.get(key):
                lines.append(f"  context {d['context']:>6}: {what} tokens drawn on the GPU {c['drawn']}, through the "
                             f"host path {c['host']} (each answer's first, and after {c['restarts']} chains stopped)")
    return lines


def format_result(r: dict) -> str:
    p = r["prefill"]
    low, high = r["bandwidth_spread_GBps"]
    lines = [f"{r['backend']} on {r['adapter']} ({r['matmul']} matmuls)",
             f"model: {r['model']}",
             f"streaming read: {r['bandwidth_GBps']:.1f} GB/s (20 passes: {low:.1f} .. {high:.1f}); "
             f"weights per token {r['weight_bytes_per_token'] / 1e6:.1f} MB; recording a token: "
             + ", ".join(f"{k} {v:.3f}" for k, v in r["record_ms"].items()) + " ms"
             + ("; a sampled token's host work: " + ", ".join(f"{k} {v:.3f}" for k, v in host.items()) + " ms"
                if (host := r.get("sampled_host_ms")) else ""),
             f"prefill, {p['tokens']}-token chunk: {p['tokens_per_s']:.1f} tokens/s at depth 0, "
             f"{p['tokens_per_s_at_depth']:.1f} at depth {p['depth']}"
             + (f"; time to first token of a {p['ttft_tokens']}-token prompt: {p['ttft_s']:.3f} s"
                if p["ttft_tokens"] else "")]
    lines += _decode_lines(r)
    for d in r["decode"]:
        if g := d.get("chained_gpu"):
            lines.append(f"  context {d['context']:>6}: a chained greedy token's pass {g['pass_ms']:.3f} ms on the "
                         f"GPU, {g['gap_ms']:.3f} ms from one pass's end to the next one's start")
    timing = "GPU timestamps" if r["gpu_timestamps"] else "wall clock"
    for g in r["gpu"]:
        ops = ", ".join(f"{k} {v:.3f}" for k, v in g["ops_ms"].items())
        how = "in the pass" if g.get("in_pass") else "each class alone"
        lines.append(f"GPU ms ({timing}), {g['n_tokens']} token(s) at position {g['position']}: "
                     f"{g['total_ms']:.3f}; per op class ({how}): {ops}")
    return "\n".join(lines)
