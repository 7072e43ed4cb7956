"""candidates.wgsl against its numpy reference (tests/gpu_helpers.py), and the sampled path through
it: the tokens equal sampling from the full logits on the host, on both real models."""

from types import SimpleNamespace

import numpy as np
import pytest

from airframe.engine import Engine, GenerationParams
from airframe.gpu import candidates as cand
from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from airframe.options import RunOptions
from airframe.sampling import History, Sampler, SamplingParams

from gpu_helpers import SAMPLED, both_ways, reduce_reference


@pytest.fixture(scope="module")
def reducer():
    """build_candidates on a bare logits buffer of 5,000 tokens (3 workgroups, the last partial)."""
    ctx = get_context()
    pipes = pl.Pipelines(ctx)
    vocab = 5000
    be = SimpleNamespace(pipes=pipes, ctx=ctx, config=SimpleNamespace(vocab_size=vocab),
                         scratch=SimpleNamespace(logits=pipes.storage(vocab * 4, "logits")))
    ops = cand.build_candidates(be)

    def run(logits: np.ndarray, params: SamplingParams, history: History):
        reduction = Sampler(params, vocab).reduction(history, cand.PEN_MAX, cand.MAX_WANT)
        ctx.device.queue.write_buffer(be.scratch.logits, 0, logits.astype(np.float32))
        cand.write_request(be, ops, reduction)
        ctx.device.queue.submit([cand.record(be, ops)])
        return reduction, cand.read(ops, reduction)

    return run


PENALTIES = SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.25, logit_bias={4999: 3.0, 0: -100})


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_candidates_equal_the_numpy_reference(reducer, scale):
    rng = np.random.default_rng(int(scale * 100))
    logits = (scale * rng.standard_normal(5000)).astype(np.float32)
    logits[rng.integers(0, 5000, 50)] = logits[7]  # ties
    logits[-3:] = -logits[-3:]
    history = History(list(rng.integers(0, 5000, 40)), n_prompt=30)
    reduction, found = reducer(logits, PENALTIES, history)
    want = reduce_reference(logits, reduction)
    got = found.candidates
    assert got.ids.tolist() == want.ids.tolist() and len(got.ids) >= reduction.want
    assert got.logits.tolist() == want.logits.tolist()  # the model's own values, penalised ones included
    assert got.threshold == want.threshold
    assert got.log_sum_exp == pytest.approx(want.log_sum_exp, rel=1e-5)
    table_ids = reduction.table[:, 0].astype(np.int64)
    assert found.raw.tolist() == logits[table_ids].tolist()


def test_every_token_is_a_candidate_when_the_vocabulary_is_smaller_than_wanted(reducer):
    logits = np.zeros(5000, dtype=np.float32)  # one bin holds everything
    reduction, found = reducer(logits, SamplingParams(top_k=300), History())
    assert found.candidates is None  # 5,000 candidates: more than CAP, so the full logits are read
    logits = np.linspace(-4, 4, 5000).astype(np.float32)
    reduction, found = reducer(logits, SamplingParams(top_k=300), History())
    assert found.candidates.ids.tolist() == reduce_reference(logits, reduction).ids.tolist()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_logit_gives_no_candidates(reducer, bad):
    logits = np.linspace(-4, 4, 5000).astype(np.float32)
    logits[4321] = bad
    _, found = reducer(logits, SamplingParams(top_k=10), History())
    assert found.candidates is None
    _, found = reducer(np.linspace(-4, 4, 5000).astype(np.float32), SamplingParams(top_k=10), History())
    assert found.candidates is not None  # the flag and the histogram start clean every token


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_sampled_path_gives_the_tokens_of_the_full_logits(model, sampled_tokens):
    """--sampled-tokens 200 runs the full check (minutes per model on lavapipe)."""
    engine = Engine.load(model, backend="webgpu", options=RunOptions(n_ctx=64 + sampled_tokens))
    prompt = engine.tokenize_prompt("Once upon a time, in a small village by the sea,")
    decided = 0
    for params in SAMPLED:
        decided += both_ways(engine.backend, prompt, params, sampled_tokens)[0]
    assert decided >= 0.5 * sampled_tokens * len(SAMPLED)  # top-p / min-p without top-k may fall back


def test_the_engine_samples_from_candidates_and_says_the_same(tmp_path):
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", "tiny", "Q8_0", vocab=5000)
    engine = Engine.load(path, backend="webgpu", options=RunOptions(n_ctx=64))
    params = GenerationParams(max_tokens=24, sampling=SamplingParams(temperature=0.9, top_k=20, seed=3,
                                                                     repeat_penalty=1.2))
    asked = []
    read_candidates = engine.backend.read_candidates
    engine.backend.read_candidates = lambda *a: asked.append(1) or read_candidates(*a)
    reduced = engine.generate("Hello there", params)
    assert len(asked) == reduced[1].completion_tokens
    engine.backend.reduces_on_device = False  # the full logits every token
    full = engine.generate("Hello there", params)
    assert len(asked) == reduced[1].completion_tokens
    assert reduced[0] == full[0] and reduced[1].completion_tokens == full[1].completion_tokens


def test_nan_logits_are_reported_on_the_greedy_chain_and_never_sampled(tmp_path):
    from airframe.errors import NonFiniteError
    from airframe.gpu.backend import WebGPUBackend
    from airframe.model import open_model
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", "tiny", "Q8_0", vocab=5000)
    be = WebGPUBackend.load(open_model(path), RunOptions(n_ctx=64))
    be.ctx.device.queue.write_buffer(be.globals.buffer, 0, np.full(be.globals.n_words, np.nan, np.float32))
    with pytest.raises(NonFiniteError, match="generated token 1 "):
        be.generate_greedy([5, 6, 7], 4)
    sampler = Sampler(SamplingParams(top_k=40, seed=0), 5000)
    be.reset()
    be.forward_pending([5, 6, 7])
    assert be.read_candidates(sampler.reduction(History([5, 6, 7]), *be.candidate_limits)) is None
    assert np.isnan(be.last_logits()).all()
