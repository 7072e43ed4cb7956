"""Tokens drawn inside the CUDA megakernel, on a machine without a GPU: the launch settings a
request becomes (megakernel/cuda/sampling.py), and the numpy picture of the kernel's drawing
(KernelDraw: each LM_HEAD slot's top-k, the top-k of those, the chain, the state it advances)
against the host's sampler over many steps. scripts/megakernel_device_check.py checks the kernel
itself against the host's sampler on a GPU (its `sampled` sections)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from airframe.megakernel.cuda import sampling as ks
from airframe.sampling import History, Sampler, SamplingParams

VOCAB = 300
SLOTS = [(0, 70), (70, 64), (134, 90), (224, 76)]  # uneven LM_HEAD tasks, each with top_k rows or more
PROMPT = [3, 9, 9, 27, 81, 3, 150]
CHAINS = {
    "default+repeat": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1),
    "top_k 64": dict(temperature=1.0, top_k=64, top_p=1.0, min_p=0.0, seed=2),
    "top_p 0.5": dict(temperature=0.7, top_k=20, top_p=0.5, min_p=0.0, seed=3),
    "min_p, presence, frequency": dict(temperature=1.3, top_k=50, top_p=1.0, min_p=0.1, presence_penalty=0.5,
                                       frequency_penalty=0.3, seed=4),
    "greedy+repeat": dict(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16, seed=5),
    "bias, whole-history repeat": dict(temperature=0.9, top_k=30, repeat_penalty=1.2, repeat_last_n=-1,
                                       logit_bias={5: 4.0, 6: -100.0, "7": 2.5}, seed=6),
    "tiny temperature": dict(temperature=1e-3, top_k=10, seed=7),
    "short window, negative presence": dict(temperature=1.0, top_k=8, repeat_penalty=1.5, repeat_last_n=3,
                                            presence_penalty=-0.5, min_p=0.2, seed=8),
}


def step_logits(rng: np.random.Generator, ties: bool) -> np.ndarray:
    logits = rng.normal(scale=3.0, size=VOCAB).astype(np.float32)
    if ties:  # coarse values: many equal logits, and ties at every cut
        logits = np.round(logits * 2) / 2
    return logits


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("name", CHAINS)
def test_kernel_drawing_gives_the_host_samplers_tokens(name, ties):
    rng = np.random.default_rng(zlib.crc32(name.encode()) + ties)
    host = Sampler(SamplingParams(**CHAINS[name]), VOCAB)
    kernel = Sampler(SamplingParams(**CHAINS[name]), VOCAB)
    host_history = History(list(PROMPT), n_prompt=len(PROMPT))
    history = History(list(PROMPT), n_prompt=len(PROMPT))
    made = 0
    for launch in range(3):  # three launches: the state starts again from the history each time
        n_draws = 40
        draw = ks.draw_settings(kernel, history, n_draws, VOCAB)
        first = 5  # the launch's first drawing step (its given tokens before it)
        picture = ks.KernelDraw(draw, SLOTS, first)
        for j in range(n_draws):
            logits = step_logits(rng, ties)
            want = host.sample(host_history, logits)
            got = picture.token(first + j, logits)
            assert got == want, f"launch {launch}, token {j}"
            host.accept(host_history, want)
            kernel.accept(history, got)
            picture.advance(first + j, got)
            made += 1
    assert history.tokens == host_history.tokens and made == 120


def test_settings_name_the_steps_that_run():
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.0, repeat_penalty=1.2, repeat_last_n=4,
                            presence_penalty=0.5, logit_bias={5: 4.0, "5": 1.0}, seed=11)
    sampler = Sampler(params, VOCAB)
    history = History([1, 2, 3, 2, 4, 4, 4], n_prompt=5)
    draw = ks.draw_settings(sampler, history, 6, VOCAB)
    h = draw.header[0]
    assert h["flags"] == ks.BIAS | ks.REPEAT | ks.COUNTS | ks.TOP_P | ks.TEMPERATURE
    assert (h["top_k"], h["last_n"], h["hist_len"], h["n_prompt"]) == (30, 4, 7, 5)
    assert draw.bias[5] == 5.0 and np.count_nonzero(draw.bias) == 1
    assert draw.win[[2, 4]].tolist() == [1, 3] and draw.win.sum() == 4  # the last 4 tokens
    assert draw.gen[4] == 2 and draw.gen.sum() == 2  # the generated ones only
    assert h["u"][:6].tolist() == [sampler.uniform(history, j) for j in range(6)] and h["u"][6] == 0
    greedy = ks.draw_settings(Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1), VOCAB), history, 3, VOCAB)
    assert greedy.header["flags"][0] == ks.GREEDY | ks.REPEAT and greedy.top_k == 1


def test_what_the_kernel_leaves_to_the_host():
    assert ks.kernel_refuses(Sampler(SamplingParams(top_k=40), VOCAB)) is None
    assert ks.kernel_refuses(Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.0), VOCAB)) is None
    assert "top_k = 0" in ks.kernel_refuses(Sampler(SamplingParams(top_k=0, top_p=0.9), VOCAB))
    assert "64" in ks.kernel_refuses(Sampler(SamplingParams(top_k=65), VOCAB))
    masked = Sampler(SamplingParams(top_k=40), VOCAB, constraint=object())  # (any Constraint: it masks on the host)
    assert "grammar" in ks.kernel_refuses(masked)


def test_shared_memory_holds_a_key_per_row_or_candidate():
    assert ks.sample_floats(132, 972) == ks.SAMPLE_SHARED_FLOATS + 2 * 132 * ks.SAMPLE_K
    assert ks.sample_floats(20, 6413) == ks.SAMPLE_SHARED_FLOATS + 2 * 6413
