"""candidates.wgsl against its numpy reference (tests/gpu_helpers.py), draw.wgsl against the host's
sampler, and the sampled path through them (chained on the GPU, and one token at a time): the
tokens equal sampling from the full logits on the host, on a synthetic model and both real models."""

import dataclasses
import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from airframe.constraint import json_schema_grammar
from airframe.engine import Engine, GenerationParams
from airframe.gpu import candidates as cand
from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from airframe.gpu.sampled import ChainCounts
from airframe.options import RunOptions
from airframe.sampling import History, Sampler, SamplingParams

from gpu_helpers import SAMPLED, both_ways, chained, reduce_reference

SETTINGS = SAMPLED + [SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, repeat_penalty=0.8,
                                     repeat_last_n=-1, seed=17)]


def make_reducer(vocab: int):
    """build_candidates on a bare logits buffer of `vocab` tokens."""
    ctx = get_context()
    pipes = pl.Pipelines(ctx)
    be = SimpleNamespace(pipes=pipes, ctx=ctx, config=SimpleNamespace(vocab_size=vocab),
                         scratch=SimpleNamespace(logits=pipes.storage(vocab * 4, "logits"), ids=pipes.storage(16, "ids")))
    ops = cand.build_candidates(be)

    def run(logits: np.ndarray, params: SamplingParams, history: History, pending: int | None = None,
            sampler: Sampler | None = None):
        """The reduction of `logits` after `history` (and, with `pending`, one more generated token
        the GPU adds itself), and what the GPU found and drew."""
        sampler = sampler or Sampler(params, vocab)
        reduction = sampler.reduction(history, cand.PEN_MAX - 1, cand.MAX_WANT, pending=pending is not None)
        ctx.device.queue.write_buffer(be.scratch.logits, 0, logits.astype(np.float32))
        ctx.device.queue.write_buffer(be.scratch.ids, 0, np.array([pending or 0], np.uint32))
        cand.write_request(be, ops, reduction)
        ctx.device.queue.submit([cand.record(be, ops)])
        return reduction, cand.read(be, ops, reduction, pending=pending)

    return run


@pytest.fixture(scope="module")
def reducer():
    """5,000 tokens: 3 workgroups, the last partial."""
    return make_reducer(5000)


class FixedMask:
    """A constraint (Sampler's constraint= interface) that allows the same tokens at every step."""

    def __init__(self, allowed: np.ndarray):
        self.allowed = allowed

    def allowed_words(self, n: int) -> np.ndarray:
        bits = np.zeros(-(-n // 32) * 32, dtype=bool)
        bits[:self.allowed.size] = self.allowed
        return np.packbits(bits, bitorder="little").view(np.uint32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return np.where(self.allowed, logits, -np.inf)

    def advance(self, token: int) -> None:
        assert self.allowed[token]


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


@pytest.mark.parametrize("top_k", [1, 40, 64])
def test_a_tie_at_the_top_k_cut(reducer, top_k):
    """120 logits equal to the 10th largest, so the top-k cut falls inside them: the candidates, and
    the token drawn, are the host's for several seeds."""
    rng = np.random.default_rng(top_k)
    logits = rng.standard_normal(5000).astype(np.float32)
    logits[rng.choice(5000, 120, replace=False)] = np.sort(logits)[-10]
    history = History(list(rng.integers(0, 5000, 20)), n_prompt=20)
    for seed in range(4):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, seed=seed)
        sampler = Sampler(params, 5000)
        reduction, found = reducer(logits, params, history, sampler=sampler)
        want = reduce_reference(logits, reduction)
        assert found.candidates.ids.tolist() == want.ids.tolist()
        assert found.drawn == sampler.sample_reduced(history, found.candidates) == sampler.sample(history, logits)


@pytest.mark.parametrize("vocab", [37, 4099, 5000])
@pytest.mark.parametrize("share", [0.002, 0.3, 1.0])
def test_masked_candidates_equal_the_numpy_reference(vocab, share):
    rng = np.random.default_rng(vocab)
    run = make_reducer(vocab)
    allowed = rng.random(vocab) < share
    allowed[[3, vocab - 1]] = True
    logits = (3 * rng.standard_normal(vocab)).astype(np.float32)
    logits[np.flatnonzero(~allowed)[:5]] = 40.0  # the model's favourites are not allowed
    history = History(list(rng.integers(0, vocab, 20)), n_prompt=10)
    params = dataclasses.replace(PENALTIES, logit_bias={vocab - 1: 3.0, 0: -100})
    sampler = Sampler(params, vocab, FixedMask(allowed))
    reduction, found = run(logits, params, history, sampler=sampler)
    want = reduce_reference(logits, reduction)
    got = found.candidates
    assert got.ids.tolist() == want.ids.tolist() and allowed[got.ids].all()
    assert len(got.ids) >= min(reduction.want, allowed.sum())
    assert got.logits.tolist() == want.logits.tolist()
    assert got.threshold == want.threshold
    assert got.log_sum_exp == pytest.approx(want.log_sum_exp, rel=1e-5)
    assert found.drawn == sampler.sample_reduced(history, got) == sampler.sample(history, logits)


def test_a_mask_that_allows_nothing_gives_no_candidates(reducer):
    logits = np.linspace(-4, 4, 5000).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0), 5000, FixedMask(np.zeros(5000, dtype=bool)))
    _, found = reducer(logits, sampler.chain.params, History(), sampler=sampler)
    assert found.candidates is None and found.drawn is None  # the host path takes the full logits


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"seed{p.seed}")
def test_the_gpu_draws_the_masked_token_of_the_host_sampler(reducer, params):
    """Against the host path: the full logits, masked to -inf before the sampler chain."""
    rng = np.random.default_rng(params.seed)
    history = History(list(rng.integers(0, 5000, 30)), n_prompt=30)
    drawn = 0
    for step in range(8):
        allowed = rng.random(5000) < rng.choice([0.005, 0.1, 0.9])
        sampler = Sampler(params, 5000, FixedMask(allowed))
        logits = ((0.5 + 5 * rng.random()) * rng.standard_normal(5000)).astype(np.float32)
        _, found = reducer(logits, params, history, sampler=sampler)
        want = sampler.sample_reduced(history, found.candidates)
        assert found.drawn == want, f"step {step}"
        if want is not None:
            drawn += 1
            assert want == sampler.sample(history, logits), f"step {step}"
        history.tokens.append(want if want is not None else int(rng.integers(0, 5000)))
    assert drawn >= 3


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"seed{p.seed}")
def test_the_gpu_draws_the_token_of_the_host_sampler(reducer, params):
    rng = np.random.default_rng(params.seed)
    sampler = Sampler(params, 5000)
    history = History(list(rng.integers(0, 5000, 30)), n_prompt=30)
    drawn = 0
    for step in range(12):
        logits = ((0.5 + 5 * rng.random()) * rng.standard_normal(5000)).astype(np.float32)
        logits[rng.integers(0, 5000, 40)] = logits[9]  # ties
        _, found = reducer(logits, params, history, sampler=sampler)
        want = sampler.sample_reduced(history, found.candidates)
        assert found.drawn == want, f"step {step}"  # None both: the candidates cannot decide
        drawn += want is not None
        history.tokens.append(want if want is not None else int(rng.integers(0, 5000)))
    assert drawn >= 4  # top-p without top-k cannot decide the flattest of these from 256 candidates


def test_the_gpu_adds_the_pending_token_to_the_penalties(reducer):
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal(5000)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.3, repeat_last_n=8, presence_penalty=0.5,
                            frequency_penalty=0.25, seed=3)
    known = History([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], n_prompt=4)
    top = int(np.argmax(logits))
    for pending in (6, top, 4999):  # falling out of the window, new, already penalised
        whole = History(known.tokens + [pending], n_prompt=4)
        _, ahead = reducer(logits, params, known, pending=pending)
        reduction, found = reducer(logits, params, whole)
        assert ahead.candidates.ids.tolist() == found.candidates.ids.tolist()
        assert ahead.candidates.logits.tolist() == found.candidates.logits.tolist()
        assert ahead.penalised.tolist() == reduction.table[:, 0].tolist()
        assert ahead.drawn == found.drawn == Sampler(params, 5000).sample_reduced(whole, found.candidates)


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
        want = chained(engine.backend, prompt, params, sampled_tokens, on_gpu=False)
        assert chained(engine.backend, prompt, params, sampled_tokens) == want
    assert decided >= 0.5 * sampled_tokens * len(SAMPLED)  # top-p / min-p without top-k may fall back


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama", "tiny", "Q8_0", vocab=5000)
    return Engine.load(path, backend="webgpu", options=RunOptions(n_ctx=64))


def test_the_engine_chains_sampled_tokens_and_says_the_same(tiny):
    params = GenerationParams(max_tokens=40, sampling=SamplingParams(temperature=0.9, top_k=20, seed=3,
                                                                     repeat_penalty=1.2))
    asked = []
    read_candidates = tiny.backend.read_candidates
    tiny.backend.read_candidates = lambda *a: asked.append(1) or read_candidates(*a)
    try:
        chained_text = tiny.generate("Hello there", params)
        tiny.backend.reduces_on_device = False  # the full logits every token
        full = tiny.generate("Hello there", params)
    finally:
        tiny.backend.reduces_on_device = True
        del tiny.backend.read_candidates
    assert chained_text[0] == full[0] and chained_text[1].completion_tokens == full[1].completion_tokens == 40
    assert len(asked) < 5  # the first token and the rare disagreement through the host path


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"seed{p.seed}")
def test_chained_sampling_gives_the_tokens_of_the_full_logits(tiny, params):
    prompt = [1, 15, 27, 300, 4000]
    want = chained(tiny.backend, prompt, params, 50, on_gpu=False)
    assert chained(tiny.backend, prompt, params, 50) == want
    assert len(want) == 50 and tiny.backend.n_past == len(prompt) + 49


def inject_faults(monkeypatch, wrong_every: int, undecided_every: int) -> dict:
    """Every `wrong_every`-th reduction written with a wrong random number (the GPU draws another
    token than the host), every `undecided_every`-th host check on candidates answering None."""
    write_request, sample_reduced = cand.write_request, Sampler.sample_reduced
    calls = {"write": 0, "sample": 0}

    def wrong_u(be, ops, reduction):
        calls["write"] += 1
        if calls["write"] % wrong_every == 0:
            reduction = dataclasses.replace(reduction, u=(reduction.u + 0.5) % 1.0)
        write_request(be, ops, reduction)

    def undecided(self, history, found):
        calls["sample"] += 1
        return None if calls["sample"] % undecided_every == 0 else sample_reduced(self, history, found)

    monkeypatch.setattr(cand, "write_request", wrong_u)
    monkeypatch.setattr(Sampler, "sample_reduced", undecided)
    return calls


def test_the_chain_keeps_the_hosts_token_where_the_gpu_drew_another(tiny, monkeypatch):
    """A wrong random number on the GPU for some tokens, and candidates the host says it cannot
    decide from for others: the tokens stay those of the full logits."""
    prompt = [1, 15, 27, 300, 4000]
    params = SamplingParams(temperature=1.2, top_k=30, repeat_penalty=1.1, seed=21)
    want = chained(tiny.backend, prompt, params, 40, on_gpu=False)
    from airframe.gpu import sampled
    chain = sampled._chain
    calls = inject_faults(monkeypatch, wrong_every=7, undecided_every=11)
    calls["chains"] = 0
    monkeypatch.setattr(sampled, "_chain", lambda *a: calls.__setitem__("chains", calls["chains"] + 1) or chain(*a))
    assert chained(tiny.backend, prompt, params, 40) == want
    assert calls["chains"] >= 5  # it started over after each disagreement


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


# ---- constrained requests: the grammar's mask on the GPU, the chain split in two submissions ----
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}
CONSTRAINED = [SamplingParams(temperature=0.0, seed=1),
               SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=2),
               SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0, presence_penalty=0.5, seed=3),
               SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.1, frequency_penalty=0.3, seed=4)]


def constrained(engine, params: SamplingParams, on_gpu: bool = True):
    """A request constrained by SCHEMA: (its text, finish, ChainCounts of the chained run), chained
    on the GPU or (not on_gpu) through the host path, the full logits masked on the host."""
    be = engine.backend
    be.chain_counts = ChainCounts()
    reduces, be.reduces_on_device = be.reduces_on_device, on_gpu
    try:
        text, finish, _ = engine.generate("Hello", GenerationParams(max_tokens=60, sampling=params,
                                                                    grammar=json_schema_grammar(SCHEMA)))
    finally:
        be.reduces_on_device = reduces
    return text, finish, be.chain_counts


def assert_chained_as_the_host_path(engine, params: SamplingParams) -> None:
    """The constrained answer chained on the GPU is the host path's, and it validates."""
    text, finish, counts = constrained(engine, params)
    host_text, host_finish, _ = constrained(engine, params, on_gpu=False)
    assert (text, finish.completion_tokens) == (host_text, host_finish.completion_tokens)
    assert finish.reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert counts.drawn >= finish.completion_tokens // 2  # chained, not one forward at a time


@pytest.mark.parametrize("params", CONSTRAINED, ids=lambda p: f"seed{p.seed}")
def test_a_constrained_chain_gives_the_tokens_of_the_host_path(tiny, params):
    assert_chained_as_the_host_path(tiny, params)


def test_a_constrained_chain_keeps_the_hosts_token_where_the_gpu_drew_another(tiny, monkeypatch):
    """A wrong random number on the GPU for some tokens, and candidates the host says it cannot
    decide from for others: the answer stays that of the host path."""
    params = SamplingParams(temperature=1.2, top_k=30, repeat_penalty=1.1, seed=21)
    host_text, host_finish, _ = constrained(tiny, params, on_gpu=False)
    inject_faults(monkeypatch, wrong_every=5, undecided_every=7)
    text, finish, counts = constrained(tiny, params)
    assert (text, finish.completion_tokens) == (host_text, host_finish.completion_tokens)
    assert counts.restarts >= 3 and counts.drawn >= 3


@pytest.mark.slow
def test_constrained_answers_of_a_real_model_are_those_of_the_host_path():
    engine = Engine.load("smollm2-135m", backend="webgpu", options=RunOptions(n_ctx=128))
    for params in CONSTRAINED[:2]:
        assert_chained_as_the_host_path(engine, params)
