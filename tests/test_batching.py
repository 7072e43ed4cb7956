"""Continuous batching (airframe/batching.py): requests run together give what they give alone.

On both real models on lavapipe (WebGPU), eight mixed requests in one batch (prompts of different
lengths, greedy and seeded sampling, a grammar, a stop string, logprobs, one cancelled midway) give the same
text, finish and logprobs as each run alone through Engine.generate. On the reference backend with
a tiny model: more requests than slots wait their turn, a long prompt is read one chunk per step
while the others decode, short prompts that come together are read in one step, max_tokens = 0,
the prompt cache kept across batches, and a request whose logits are not finite fails alone."""

import numpy as np
import pytest

from airframe.batching import Scheduler
from airframe.constraint import json_schema_grammar
from airframe.engine import Engine, Finish, GenerationParams
from airframe.errors import NonFiniteError, ParameterError
from airframe.gpu.backend import ROW_CANDIDATES, ROW_ID, ROW_LOGITS
from airframe.options import RunOptions
from airframe.sampling import SamplingParams
from airframe.synthetic import write_synthetic_gguf

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.0, seed=11)
NAMED = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def mixed_requests():
    """(prompt, params) of eight requests; the last one is cancelled after its second piece."""
    return [
        ("The capital of France is", GenerationParams(max_tokens=12, sampling=GREEDY)),
        ([{"role": "user", "content": "Name three fruits."}], GenerationParams(max_tokens=16, sampling=GREEDY)),
        ("1, 2, 3, 4,", GenerationParams(max_tokens=14, sampling=GREEDY, stop=[" 7"])),
        ("Once upon a time", GenerationParams(max_tokens=10, sampling=SEEDED)),
        ("def add(a, b):", GenerationParams(max_tokens=9, sampling=SamplingParams(temperature=0.7, seed=3,
                                                                                 repeat_penalty=1.2))),
        ("The sky is", GenerationParams(max_tokens=8, sampling=GREEDY, logprobs=2)),
        ("A" * 3 + " long story about a cat who lived in a small house by the sea, as JSON:",
         GenerationParams(max_tokens=11, sampling=SamplingParams(temperature=0.8, top_k=40, seed=5),
                          grammar=json_schema_grammar(NAMED))),
        ("Water boils at", GenerationParams(max_tokens=20, sampling=GREEDY)),
    ]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_a_batch_of_eight_gives_what_each_gives_alone(model, monkeypatch):
    engine = Engine.load(model, backend="webgpu", options=RunOptions(n_ctx=160, slots=8))
    requests = mixed_requests()
    alone = []
    for prompt, params in requests:
        engine.forget_prompt_cache()
        alone.append(engine.generate(prompt, params))
    engine.forget_prompt_cache()
    kinds = set()  # what the batch rows read back: the sampled ones their candidates
    pick_rows = engine.backend._pick_rows
    monkeypatch.setattr(engine.backend, "_pick_rows", lambda e, p, k, *rest: kinds.update(k) or pick_rows(e, p, k, *rest))
    batches = []
    scheduler = Scheduler(engine, on_batch=batches.append)
    streams = []
    for prompt, params in requests:
        cancel = (lambda: len(streams[-1].items) >= 2) if len(streams) == len(requests) - 1 else None
        streams.append(scheduler.submit(engine.prepare(prompt, params), params, cancel))
    scheduler.run()
    assert max(batches) == 8 and kinds == {ROW_ID, ROW_CANDIDATES, ROW_LOGITS}
    for stream, (text, finish, logprobs) in zip(streams[:-1], alone[:-1]):
        got = stream.finish()
        assert stream.text() == text
        assert (got.reason, got.completion_tokens, got.prompt_tokens) == (finish.reason, finish.completion_tokens,
                                                                         finish.prompt_tokens)
        if logprobs is not None:
            assert [(p.token_id, p.logprob) for p in sum((i.logprobs for i in stream.items[:-1]), [])] == \
                   [(p.token_id, p.logprob) for p in logprobs]
    cancelled = streams[-1]
    assert cancelled.finish().reason == "cancelled" and alone[-1][0].startswith(cancelled.text())
    assert 0 < cancelled.finish().completion_tokens < alone[-1][1].completion_tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", "tiny", "Q8_0")
    return Engine.load(path, backend="reference", options=RunOptions(n_ctx=96, slots=3, prefill_chunk=8))


def ids(n: int, first: int) -> list[int]:
    return [(first + 7 * i) % 500 + 10 for i in range(n)]


def tokens_alone(engine: Engine, prompt: list[int], params: GenerationParams) -> list[int]:
    engine.forget_prompt_cache()
    return [t for item in engine.stream_ids(prompt, params) if not isinstance(item, Finish) for t in item.token_ids]


def test_more_requests_than_slots_wait_and_a_long_prompt_is_read_a_chunk_a_step(tiny):
    params = GenerationParams(max_tokens=6, sampling=GREEDY, stop_token_ids=[], cache_prompt=False)
    prompts = [ids(3, 1), ids(30, 2), ids(5, 3), ids(4, 4), ids(2, 5)]
    alone = [tokens_alone(tiny, p, params) for p in prompts]
    batches = []
    scheduler = Scheduler(tiny, on_batch=batches.append)
    streams = [scheduler.submit(p, params) for p in prompts]
    sizes = []
    while scheduler.step():
        sizes.append((len(scheduler.running), len(scheduler.waiting)))
    assert sizes[0] == (3, 2)  # three slots: two requests wait
    # the 30-token prompt takes steps 2-5 (3 chunks of 8, then 6 with logits) while the first
    # request decodes a token each step; at step 5 both decode
    assert batches[:5] == [1, 1, 1, 1, 2]
    for stream, want in zip(streams, alone):
        got = [t for item in stream.items[:-1] for t in item.token_ids]
        assert got == want and stream.finish().completion_tokens == len(want) == 6


def test_short_prompts_that_come_together_share_a_step(tiny):
    """A step reads at most a chunk's worth (8) of prompt tokens: 3 and 4 tokens in the first step,
    so both decode in it; the 5-token prompt no longer fits and joins in the second."""
    params = GenerationParams(max_tokens=4, sampling=GREEDY, stop_token_ids=[], cache_prompt=False)
    prompts = [ids(3, 11), ids(4, 12), ids(5, 13)]
    alone = [tokens_alone(tiny, p, params) for p in prompts]
    batches = []
    scheduler = Scheduler(tiny, on_batch=batches.append)
    streams = [scheduler.submit(p, params) for p in prompts]
    scheduler.run()
    assert batches[:2] == [2, 3]
    assert [[t for item in s.items[:-1] for t in item.token_ids] for s in streams] == alone


def test_no_tokens_asked_and_the_prompt_cache_across_batches(tiny):
    tiny.forget_prompt_cache()
    scheduler = Scheduler(tiny)
    none = scheduler.submit(ids(4, 9), GenerationParams(max_tokens=0))
    first = scheduler.submit(ids(20, 8), GenerationParams(max_tokens=3, sampling=GREEDY))
    scheduler.run()
    assert none.finish().reason == "length" and none.finish().completion_tokens == 0 and none.text() == ""
    generated = [t for item in first.items[:-1] for t in item.token_ids]
    again = scheduler.submit(ids(20, 8) + generated[:2] + [99], GenerationParams(max_tokens=2, sampling=GREEDY))
    scheduler.run()
    assert again.finish().cached_tokens == 22  # the prompt and the two tokens that ran


def test_bad_requests_are_refused_at_submit(tiny):
    scheduler = Scheduler(tiny)
    with pytest.raises(ParameterError):
        scheduler.submit(ids(4, 1), GenerationParams(max_tokens=-1))
    with pytest.raises(Exception, match="context"):
        scheduler.submit(ids(96, 1), GenerationParams())
    assert not scheduler.waiting


def test_a_request_with_damaged_logits_fails_alone(tiny, nan_model_path, monkeypatch):
    scheduler = Scheduler(tiny)
    good = scheduler.submit(ids(5, 1), GenerationParams(max_tokens=4, sampling=GREEDY, stop_token_ids=[]))
    bad = scheduler.submit(ids(6, 2), GenerationParams(max_tokens=4, sampling=GREEDY))
    decode_batch = tiny.backend.decode_batch

    def damaged(entries):
        rows = decode_batch(entries)
        slot = next((r.slot for r in scheduler.running if r.stream is bad), None)
        rows[[i for i, (s, _) in enumerate(entries) if s == slot]] = np.nan
        return rows

    monkeypatch.setattr(tiny.backend, "decode_batch", damaged)
    scheduler.run()
    assert isinstance(bad.error, NonFiniteError) and bad.done and bad.finish() is None
    assert good.error is None and good.finish().reason in ("length", "stop")


def test_the_batching_queue_bounds_its_line_and_serves_each_job_as_alone(tiny):
    import asyncio

    from airframe.server.queue import END, BatchingQueue, Job, QueueFullError

    params = GenerationParams(max_tokens=5, sampling=GREEDY, stop_token_ids=[], cache_prompt=False)
    prompts = [ids(3, 1), ids(12, 2), ids(5, 3), ids(4, 4)]
    alone = []
    for p in prompts:
        tiny.forget_prompt_cache()
        alone.append([t for item in tiny.stream_ids(p, params) if not isinstance(item, Finish) for t in item.token_ids])
    loop = asyncio.new_event_loop()
    finished, batches = [], []
    queue = BatchingQueue(tiny, max_waiting=1, on_finish=lambda finish, job: finished.append(job), on_step=batches.append)
    queue._cond.acquire()  # hold the worker back while the line fills
    try:
        jobs = [Job(p, params, loop) for p in prompts]
        for job in jobs:
            queue.submit(job)
        assert (queue.running, queue.depth) == (3, 1)  # three slots run, one waits
        with pytest.raises(QueueFullError, match="3 running"):
            queue.submit(Job(ids(2, 9), params, loop))
    finally:
        queue._cond.release()

    async def events(job):
        out = []
        while (item := await job.events.get()) is not END:
            out.append(item)
        return out

    async def all_events():
        return await asyncio.wait_for(asyncio.gather(*(events(j) for j in jobs)), 120)

    got = loop.run_until_complete(all_events())
    queue.close()
    loop.close()
    for items, want in zip(got, alone):
        assert [t for item in items[:-1] for t in item.token_ids] == want
        assert isinstance(items[-1], Finish) and items[-1].completion_tokens == 5
    assert len(finished) == 4 and max(batches) == 3 and sum(batches) == 4 * 4  # the first token of each comes from its prefill
    assert sorted(finished, key=id) == sorted(jobs, key=id)
    assert all(job.created <= job.started <= job.first_piece for job in jobs)
    assert jobs[3].waited > max(job.waited for job in jobs[:3])  # it waited for a slot to free
