"""The sampler chain on hand-made distributions: each step, their order, seeds, greedy, ranges."""

import math

import numpy as np
import pytest

from airframe.errors import ParameterError
from airframe.sampling import (History, Sampler, SamplingParams, build_chain, draw, log_softmax,
                               logit_bias, min_p, presence_frequency_penalty, repetition_penalty,
                               temperature, top_k, top_logprobs, top_p, uniform)

from gpu_helpers import reduce_reference  # noqa: E402

NO_HISTORY = History()


def after(n):
    """A history of n generated tokens (token 0): the draw of generated token n + 1 is next."""
    return History([0] * n)


def probs_of(logits):
    finite = np.where(np.isfinite(logits), logits, -np.inf)
    e = np.exp(finite - finite.max())
    return e / e.sum()


# ---- each step ---------------------------------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    step = repetition_penalty(2.0, 64)
    logits = np.array([4.0, -1.0, 3.0, -2.0])
    out = step(History([0, 1, 1], n_prompt=1), logits)
    assert out.tolist() == [2.0, -2.0, 3.0, -2.0]  # seen tokens 0 and 1 both lose ground
    assert logits.tolist() == [4.0, -1.0, 3.0, -2.0]  # pure: the input is untouched


def test_repetition_penalty_looks_only_at_the_last_n_tokens():
    step = repetition_penalty(2.0, 2)
    out = step(History([0, 1, 2]), np.array([4.0, 4.0, 4.0, 4.0]))
    assert out.tolist() == [4.0, 2.0, 2.0, 4.0]
    whole = repetition_penalty(2.0, -1)(History([0, 1, 2]), np.array([4.0, 4.0, 4.0, 4.0]))
    assert whole.tolist() == [2.0, 2.0, 2.0, 4.0]


def test_presence_and_frequency_penalties_are_additive_over_generated_tokens_only():
    step = presence_frequency_penalty(presence=0.5, frequency=0.25)
    history = History([3, 3, 1, 1, 1], n_prompt=2)  # token 3 only in the prompt
    out = step(history, np.zeros(4))
    assert out.tolist() == [0.0, -(0.5 + 3 * 0.25), 0.0, 0.0]


def test_logit_bias_adds_to_the_named_tokens():
    step = logit_bias({1: 5.0, "2": -100.0}, vocab_size=4)
    assert step(NO_HISTORY, np.zeros(4)).tolist() == [0.0, 5.0, -100.0, 0.0]


def test_top_k_picks_the_ids_of_the_k_largest():
    assert top_k(2)(np.array([1.0, 5.0, 3.0, 4.0])).tolist() == [1, 3]
    assert top_k(9)(np.array([1.0, 5.0])).tolist() == [0, 1]
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    out = Sampler(params, vocab_size=4).process(NO_HISTORY, np.array([1.0, 5.0, 3.0, 4.0]))
    assert out.tolist() == [-np.inf, 5.0, -np.inf, 4.0]


def test_sampling_from_the_candidates_equals_drawing_from_the_whole_vocabulary():
    logits = np.random.default_rng(5).normal(size=5000) * 3
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, seed=8)
    sampler = Sampler(params, vocab_size=5000)
    full = sampler.process(NO_HISTORY, logits)
    for n in range(30):
        assert sampler.sample(after(n), logits) == draw(full, uniform(8, n))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    assert np.isfinite(top_p(0.75)(NO_HISTORY, logits)).tolist() == [True, True, False, False]
    assert np.isfinite(top_p(0.81)(NO_HISTORY, logits)).tolist() == [True, True, True, False]
    assert np.isfinite(top_p(0.0)(NO_HISTORY, logits)).tolist() == [True, False, False, False]


def test_top_p_matches_a_full_sort_on_random_distributions():
    # top_p sorts only a head of the vocabulary when that head already reaches p
    rng = np.random.default_rng(42)
    for _ in range(100):
        logits = rng.normal(size=int(rng.integers(2, 20000))) * rng.uniform(0.1, 8.0)
        p = float(rng.uniform(0.0, 1.0))
        probs = probs_of(logits)
        order = np.argsort(-probs, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1
        kept = np.flatnonzero(np.isfinite(top_p(p)(NO_HISTORY, logits)))
        assert set(kept.tolist()) == set(order[:n_keep].tolist())


def test_top_p_keeps_the_lowest_ids_among_tied_tokens():
    logits = np.zeros(5000)
    logits[4000:] = 1.0  # 1,000 tied tokens share most of the mass; top-p keeps some of them
    kept = np.flatnonzero(np.isfinite(top_p(0.3)(NO_HISTORY, logits)))
    assert 0 < kept.size < 1000 and kept.tolist() == list(range(4000, 4000 + kept.size))


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    out = min_p(0.25)(NO_HISTORY, logits)  # threshold 0.125
    assert np.isfinite(out).tolist() == [True, True, True, False]


def test_temperature_scales_logits():
    out = temperature(0.5)(NO_HISTORY, np.array([1.0, -2.0]))
    assert out.tolist() == [2.0, -4.0]


def test_steps_that_change_nothing_are_left_out():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    chain = build_chain(params, vocab_size=10)
    assert (chain.penalties, chain.select, chain.truncation) == ([], None, [])


# ---- order -------------------------------------------------------------------------------------
def test_penalties_come_before_truncation():
    # The repeated token 0 would be the only survivor of top-k=1 without the penalty.
    params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=4.0)
    sampler = Sampler(params, vocab_size=3)
    out = sampler.process(History([0]), np.array([4.0, 2.0, 0.0]))
    assert np.isfinite(out).tolist() == [False, True, False]


def test_truncation_runs_on_untempered_logits():
    # A high temperature would flatten the distribution and let min-p keep everything if it ran first.
    params = SamplingParams(temperature=100.0, top_k=0, top_p=1.0, min_p=0.5)
    out = Sampler(params, vocab_size=3).process(NO_HISTORY, np.array([3.0, 0.0, 2.9]))
    assert np.isfinite(out).tolist() == [True, False, True]
    assert out[0] == pytest.approx(0.03)


def test_top_k_then_top_p_then_min_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.75, min_p=0.0)
    # after top-k the three left renormalise to 4/9, 3/9, 2/9 and top-p 0.75 keeps two of them;
    # on the full distribution (0.4 + 0.3 < 0.75) it would have kept three
    out = Sampler(params, vocab_size=4).process(NO_HISTORY, logits)
    assert np.isfinite(out).tolist() == [True, True, False, False]


# ---- drawing -----------------------------------------------------------------------------------
def test_greedy_equals_argmax_and_picks_the_lowest_id_among_ties():
    rng = np.random.default_rng(0)
    sampler = Sampler(SamplingParams(temperature=0.0), vocab_size=50)
    for _ in range(20):
        logits = rng.normal(size=50)
        assert sampler.sample(NO_HISTORY, logits) == int(np.argmax(logits))
    assert sampler.sample(NO_HISTORY, np.array([1.0, 3.0, 3.0, 3.0])) == 1


def test_greedy_still_applies_penalties_and_bias():
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={2: 10.0}), vocab_size=3)
    assert sampler.sample(NO_HISTORY, np.array([5.0, 1.0, 0.0])) == 2


def test_the_same_seed_gives_the_same_tokens():
    logits = np.random.default_rng(1).normal(size=1000)
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)

    def run():
        sampler = Sampler(params, vocab_size=1000)
        return [sampler.sample(after(n), logits) for n in range(50)]

    first = run()
    assert run() == first
    assert len(set(first)) > 10  # really random, not stuck on one token
    other = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=99), 1000)
    assert [other.sample(after(n), logits) for n in range(50)] != first


def test_the_random_numbers_are_uniform_and_exact_in_float32():
    u = np.array([uniform(5, n) for n in range(20000)])
    assert 0.0 <= u.min() and u.max() < 1.0
    assert np.histogram(u, bins=10, range=(0, 1))[0].min() > 1800  # 2,000 expected per tenth
    assert (u.astype(np.float32) == u).all()
    assert uniform(5, 3) != uniform(6, 3) and uniform(2**64 - 1, 2**40) < 1.0
    unseeded = [Sampler(SamplingParams(), 10).seed for _ in range(3)]
    assert len(set(unseeded)) == 3  # no seed: a fresh one per request


def test_draw_follows_the_distribution():
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    counts = np.bincount([draw(np.log(probs), uniform(7, n)) for n in range(8000)], minlength=4)
    assert np.allclose(counts / 8000, probs, atol=0.02)


def test_draw_never_picks_a_removed_token():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0])
    assert {draw(logits, uniform(3, n)) for n in range(200)} == {1, 3}


def test_logprobs_are_of_the_raw_distribution():
    logits = np.array([2.0, 0.0, 1.0, 2.0])
    logprobs = log_softmax(logits)
    assert np.exp(logprobs).sum() == pytest.approx(1.0)
    ids, values = top_logprobs(logits, 3)
    assert sorted(ids[:2].tolist()) == [0, 3] and ids[2] == 2
    assert values[2] == pytest.approx(1.0 - math.log(2 * math.e**2 + math.e + 1))


# ---- ranges ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.1, ">= 0.0"),
    ("temperature", math.inf, ">= 0.0"),
    ("top_k", -1, ">= 0"),
    ("top_k", 2.5, ">= 0"),
    ("top_p", 1.5, "0.0..1.0"),
    ("top_p", float("nan"), "0.0..1.0"),
    ("min_p", -0.5, "0.0..1.0"),
    ("repeat_penalty", 0.0, "> 0"),
    ("repeat_penalty", -1.0, "> 0"),
    ("repeat_last_n", -2, ">= -1"),
    ("presence_penalty", 2.5, "-2.0..2.0"),
    ("frequency_penalty", -3.0, "-2.0..2.0"),
    ("logit_bias", {5: 200.0}, "-100..100"),
    ("logit_bias", {-1: 1.0}, "an integer in 0.."),
    ("seed", -5, "0..18446744073709551615"),
    ("seed", "abc", "an integer"),
])
def test_out_of_range_parameters_are_refused_with_their_range(field, value, allowed):
    with pytest.raises(ParameterError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and allowed in str(info.value)


def test_a_logit_bias_token_outside_the_vocabulary_is_refused():
    params = SamplingParams(logit_bias={10: 1.0})
    with pytest.raises(ParameterError, match=r"0\.\.9"):
        Sampler(params, vocab_size=10)


# ---- sampling from a device's candidates -------------------------------------------------------
SETTINGS = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1),
    SamplingParams(temperature=0.0, repeat_penalty=1.3, seed=2),
    SamplingParams(temperature=1.3, top_k=5, top_p=1.0, min_p=0.0, seed=3),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, presence_penalty=0.5, seed=4),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, frequency_penalty=0.4, seed=5),
    SamplingParams(temperature=0.9, top_k=100, top_p=0.8, min_p=0.0, logit_bias={3: 5.0, 17: -100}, seed=6),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, repeat_penalty=0.8, repeat_last_n=-1, seed=7),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"seed{p.seed}")
def test_sampling_from_device_candidates_gives_the_full_logits_tokens(params):
    rng = np.random.default_rng(params.seed)
    vocab = 3000
    full, reduced = Sampler(params, vocab), Sampler(params, vocab)
    history = History(list(rng.integers(0, vocab, 20)), n_prompt=20)
    decided = 0
    for step in range(200):
        scale = 0.5 + 6 * rng.random()  # flat and peaked distributions
        logits = (scale * rng.standard_normal(vocab)).astype(np.float32)
        logits[rng.integers(0, vocab, 30)] = logits[5]  # ties
        want = full.sample(history, logits)
        got = reduced.sample_reduced(history, reduce_reference(logits, reduced.reduction(history, 1024, 512)))
        if got is None:  # the candidates cannot decide: the full logits
            got = reduced.sample(history, logits)
        else:
            decided += 1
        assert got == want, f"step {step}"
        history.tokens.append(want)
    assert decided >= 100, decided  # most tokens come from the candidates alone


def test_candidates_that_cannot_decide_ask_for_the_full_logits():
    flat = np.zeros(3000, dtype=np.float32)  # top-p 0.9 needs 2,700 tokens; 256 candidates hold less
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=0), 3000)
    found = reduce_reference(flat + np.float32(np.arange(3000) % 7) * 1e-3, sampler.reduction(History(), 1024, 512))
    assert sampler.sample_reduced(History(), found) is None
    wide = np.linspace(0, 1, 3000).astype(np.float32)  # min-p 0.2 keeps tokens far below 256 candidates
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=0), 3000)
    found = reduce_reference(wide, sampler.reduction(History(), 1024, 512))
    assert sampler.sample_reduced(History(), found) is None


def test_only_truncating_settings_are_reduced_and_large_requests_are_not():
    history = History(list(range(2000)), n_prompt=0)
    plain = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), 5000)
    assert plain.reduction(history, 1024, 512) is None  # every token can be drawn: all logits needed
    whole = Sampler(SamplingParams(repeat_penalty=1.1, repeat_last_n=-1), 5000)
    assert whole.reduction(history, 1024, 512) is None  # 2,000 penalised tokens: more than the table
    assert whole.reduction(History(list(range(100))), 1024, 512).table.shape == (100, 4)
    assert Sampler(SamplingParams(top_k=600), 5000).reduction(history, 1024, 512) is None
    r = Sampler(SamplingParams(top_k=40, presence_penalty=1.0, frequency_penalty=0.5, repeat_penalty=1.1,
                               repeat_last_n=2, logit_bias={9: 2.0}), 5000).reduction(
        History([4, 5, 6, 6, 8], n_prompt=2), 1024, 512)
    assert r.want == 40 + 16
    assert r.table[:, 0].tolist() == [6, 8, 9]  # window (6, 8), generated (6, 8), bias 9; 4 and 5 untouched
    assert r.table[:, 1].view(np.float32).tolist() == [0.0, 0.0, 2.0]
    assert r.table[:, 2].tolist() == [1, 1, 0] and r.table[:, 3].tolist() == [2, 1, 0]


# ---- overflow: a legal but extreme setting sends logits to +inf ---------------------------------
def test_a_repeat_penalty_that_overflows_still_samples_a_seen_token():
    # 5e-324 divides a seen token's positive logit to +inf; every step must still leave a candidate.
    logits = np.array([3.0, 1.0, -1.0, 2.0], dtype=np.float32)
    history = History([0, 3, 3], n_prompt=3)
    for top_k_value, expected in ((1, ({0}, {3})), (2, ({0, 3},)), (0, ({0, 3},))):
        samplers = [Sampler(SamplingParams(repeat_penalty=5e-324, top_k=top_k_value, temperature=0.7, seed=seed), 4)
                    for seed in range(40)]
        assert {sampler.sample(history, logits) for sampler in samplers} in expected


def test_top_p_and_min_p_keep_the_infinite_tokens():
    logits = np.array([np.inf, 1.0, np.inf, -np.inf])
    assert np.isposinf(top_p(0.9)(NO_HISTORY, logits)).tolist() == [True, False, True, False]
    assert np.isposinf(top_p(0.5)(NO_HISTORY, logits)).sum() == 1  # each +inf token holds half
    assert np.isposinf(min_p(0.5)(NO_HISTORY, logits)).tolist() == [True, False, True, False]
    removed = np.full(3, -np.inf)
    assert np.isneginf(top_p(0.5)(NO_HISTORY, removed)).all()


def test_a_tiny_temperature_is_greedy_not_an_overflow():
    logits = np.array([1.0, 2.0, 1.5])
    out = temperature(5e-324)(NO_HISTORY, logits)
    assert out[1] == 0.0 and np.isneginf(out[[0, 2]]).all()
    assert {draw(out, uniform(5, n)) for n in range(20)} == {1}
