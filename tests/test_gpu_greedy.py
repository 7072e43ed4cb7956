"""Greedy decoding chained on the GPU (airframe/gpu/greedy.py) gives exactly the tokens of the host's
greedy loop (logits read back, numpy argmax): on both real models through the engine, and on a tiny
synthetic model for end-of-generation tokens inside a batch, max_new_tokens, a full context and a
prompt longer than one prefill chunk."""

import numpy as np
import pytest

from airframe.engine import Engine, GenerationParams, Piece
from airframe.gpu.greedy import build_argmax
from airframe.gpu.backend import WebGPUBackend
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.sampling import SamplingParams
from airframe.synthetic import write_synthetic_gguf

GREEDY = SamplingParams(temperature=0.0)


def host_greedy(be: WebGPUBackend, prompt: list[int], n: int) -> list[int]:
    """The engine's plain loop: forward, argmax, feed it back, until n tokens or the context is full."""
    be.reset()
    logits = be.forward(prompt)
    out = [int(np.argmax(logits))]
    while len(out) < n and be.n_past < be.n_ctx:
        out.append(int(np.argmax(be.forward([out[-1]]))))
    return out


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_engine_greedy_on_the_gpu_equals_the_host_loop(model):
    engine = Engine.load(model, backend="webgpu", options=RunOptions(n_ctx=128))
    params = GenerationParams(max_tokens=16, sampling=GREEDY)
    prompt = "The three primary colours are"
    assert engine._greedy_on_device(params)
    chained = list(engine.stream(prompt, params))
    engine._greedy_on_device = lambda params: False  # the host path: logits read back every token
    plain = list(engine.stream(prompt, params))
    ids = [[t for p in items[:-1] for t in p.token_ids] for items in (chained, plain)]
    assert len(ids[0]) >= 8 and ids[0] == ids[1]
    assert [p.text for p in chained[:-1]] == [p.text for p in plain[:-1]]
    assert all(isinstance(p, Piece) for p in chained[:-1])
    a, b = chained[-1], plain[-1]
    assert (a.reason, a.prompt_tokens, a.completion_tokens) == (b.reason, b.prompt_tokens, b.completion_tokens)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """2 layers, a 5,000-token vocabulary (3 argmax workgroups); prefill chunks of 8 tokens."""
    path = write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", "tiny", "Q8_0", vocab=5000)
    be = WebGPUBackend.load(open_model(path), RunOptions(n_ctx=64, prefill_chunk=8))
    be.argmax = build_argmax(be, batch=4)  # many small batches
    return be


PROMPT = [7, 300, 4000, 12, 9, 2048, 77, 5, 1, 999, 3, 4321, 18]  # 13 tokens: two prefill chunks


def test_prompt_longer_than_a_chunk_and_max_new_tokens(tiny):
    want = host_greedy(tiny, PROMPT, 20)
    for n in (1, 2, 5, 20):
        assert tiny.generate_greedy(PROMPT, n) == (want[:n], "length")
        assert tiny.n_past == len(PROMPT) + n - 1
    assert tiny.generate_greedy(PROMPT, 0) == ([], "length")
    assert tiny.generate_greedy(PROMPT[:1], 6) == (host_greedy(tiny, PROMPT[:1], 6), "length")


def test_an_end_of_generation_token_inside_a_batch_stops_there(tiny):
    want = host_greedy(tiny, PROMPT, 24)
    firsts = [i for i, t in enumerate(want) if want.index(t) == i and i % 4 != 1]  # not a batch's first
    assert len(firsts) >= 2
    for cut in firsts[:3]:
        got, reason = tiny.generate_greedy(PROMPT, 24, eos=[want[cut], 4999999])
        assert (got, reason) == (want[:cut], "stop")
        assert tiny.n_past == len(PROMPT) + cut
        # what was computed past the stop is dropped: going on gives the host's next logits
        logits = tiny.forward([want[cut]])
        host_greedy(tiny, PROMPT, cut + 1)
        np.testing.assert_allclose(logits, tiny.forward([want[cut]]), atol=1e-5)


def test_the_context_filling_up_ends_with_length(tiny):
    prompt = list(range(100, 160))  # 60 of 64 positions
    want = host_greedy(tiny, prompt, 100)
    assert len(want) == 5
    assert tiny.generate_greedy(prompt, 100) == (want, "length")
    assert tiny.n_past == tiny.n_ctx


def test_streamed_batches_add_up_and_the_first_comes_alone(tiny):
    batches = list(tiny.greedy_stream(PROMPT, 11))
    assert [len(ids) for ids, _ in batches] == [1, 4, 4, 2]
    assert [finish for _, finish in batches] == [None, None, None, "length"]
    assert [t for ids, _ in batches for t in ids] == host_greedy(tiny, PROMPT, 11)


def test_a_batch_is_read_once_its_last_token_ran_not_the_tokens_queued_behind(tiny, monkeypatch):
    """Each read waits for the submission of its batch's last token: the READ_LAG tokens submitted
    after it keep the GPU busy while the host hands the batch on."""
    from airframe.gpu import pipelines as pl

    want = host_greedy(tiny, PROMPT, 11)  # before the spies: its prompt's logits are read after a submission too
    submitted, reads = [], []
    real_submit, real_read = pl.submit, pl.read_after

    def submit(queue, command_buffers):
        submitted.append(real_submit(queue, command_buffers))
        return submitted[-1]

    def read_after(device, buffer, n_bytes, dtype, index):
        reads.append((n_bytes // 4, submitted[-1] - index))  # (ids, tokens submitted after its last)
        return real_read(device, buffer, n_bytes, dtype, index)

    monkeypatch.setattr(pl, "submit", submit)
    monkeypatch.setattr(pl, "read_after", read_after)
    batches = list(tiny.greedy_stream(PROMPT, 11))
    assert [t for ids, _ in batches for t in ids] == want
    assert reads == [(1, 4), (4, 4), (4, 2), (2, 0)]  # batches of 1, 4, 4, 2; the last two at the end


def test_closing_the_stream_early_keeps_n_past_at_what_was_handed_out(tiny):
    stream = tiny.greedy_stream(PROMPT, 30)
    next(stream)
    next(stream)
    stream.close()
    assert tiny.n_past == len(PROMPT) + 5 - 1


def test_debug_raw_takes_the_host_loop_with_the_same_tokens(tiny, monkeypatch):
    want = host_greedy(tiny, PROMPT, 6)
    monkeypatch.setattr(tiny, "debug_raw", True)
    assert tiny.generate_greedy(PROMPT, 6) == (want, "length")
    assert tiny.generate_greedy(PROMPT, 6, eos=[want[3]]) == (want[:want.index(want[3])], "stop")


def test_cancel_stops_the_chain_and_the_prefill_at_once(tiny, monkeypatch):
    submitted = []
    write_step = tiny.write_step
    monkeypatch.setattr(tiny, "write_step", lambda n: submitted.append(n) or write_step(n))
    cancelled = []
    stream = tiny.greedy_stream(PROMPT, 30, cancel=lambda: bool(cancelled))
    first, _ = next(stream)
    at_cancel = len(submitted)
    cancelled.append(True)
    assert list(stream) == []  # nothing more is handed over ...
    assert len(submitted) == at_cancel  # ... and nothing more is submitted
    assert len(first) == 1
    submitted.clear()
    assert list(tiny.greedy_stream(PROMPT, 30, cancel=lambda: True)) == []
    assert submitted == []  # a cancelled request runs not even its prefill
