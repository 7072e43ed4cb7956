"""What the shader tests share: a tolerance scaled to the output, random quantized weights, the
numpy reference of candidates.wgsl, a sampled decode checked against the full logits (also
run on the GPU machine by dev/webgpu/check_candidates.py), and an adapter without shader-f16."""

import math

import numpy as np

from airframe.gguf_file import dequantize_rows
from airframe.gpu.pack import relayout
from airframe.gpu.candidates import key_floor
from airframe.quantize import quantize
from airframe.sampling import Candidates, History, Reduction, Sampler, SamplingParams


class WithoutF16:
    """A context as an adapter without shader-f16 would show it: the programs' f32 forms."""

    has_f16 = False

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def close(got, want, rtol):
    """got within rtol times the largest |want| (at least 1) of want, everywhere."""
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(1.0, float(np.abs(want).max())))


def quantized(rng, rows, cols, qtype):
    """(words, float32 weights the GPU must reproduce) of a random matrix."""
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return relayout(raw, qtype), dequantize_rows(raw, qtype)


def reduce_reference(logits: np.ndarray, reduction: Reduction, bin_bits: int = 12) -> Candidates:
    """What candidates.wgsl returns, in numpy: float32 penalties, a histogram of order keys, every
    token whose key's bin reaches `want` from the top, and the log-sum-exp after the penalties; with
    `reduction.allowed`, over the allowed tokens only."""
    pen = logits.astype(np.float32).copy()
    repeat = np.float32(reduction.repeat_penalty)
    for token, bias, in_window, count in reduction.table:
        v = pen[token] + np.uint32(bias).view(np.float32)
        if in_window:
            v = v / repeat if v > 0 else v * repeat
        presence = np.float32(reduction.presence if count else 0.0)
        pen[token] = v - (np.float32(reduction.frequency) * np.float32(count) + presence)
    bits = np.where(pen == 0, 0, pen.view(np.uint32)).astype(np.uint32)  # -0.0 ties with +0.0
    keys = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    allowed = allowed_tokens(reduction.allowed, logits.size)
    from_top = np.bincount(keys[allowed] >> (32 - bin_bits), minlength=1 << bin_bits)[::-1].cumsum()
    top_bin = (1 << bin_bits) - 1 - int(np.searchsorted(from_top, reduction.want))
    cut = max(top_bin, 0) << (32 - bin_bits)  # fewer tokens than wanted: all of them
    ids = np.flatnonzero((keys >= cut) & allowed)
    m = float(pen[allowed].max())
    return Candidates(ids, logits[ids].astype(np.float32), key_floor(cut),
                      m + math.log(np.exp(pen[allowed].astype(np.float64) - m).sum()))


def allowed_tokens(words: np.ndarray | None, n: int) -> np.ndarray:
    """(n,) bool of an allowed-token bitset (Reduction.allowed); None: every token."""
    if words is None:
        return np.ones(n, dtype=bool)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)


# six settings of the sampled path: temperature, top-k, top-p, min-p, each penalty, greedy with penalties
SAMPLED = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=11),
    SamplingParams(temperature=1.5, top_k=8, top_p=1.0, min_p=0.0, seed=12),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, seed=13),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=14),
    SamplingParams(temperature=0.9, top_k=50, presence_penalty=0.8, frequency_penalty=0.4, seed=15),
    SamplingParams(temperature=0.0, repeat_penalty=1.3, logit_bias={13: 4.0}, seed=16),
]


def both_ways(be, prompt: list[int], params: SamplingParams, n: int) -> tuple[int, int]:
    """n tokens, each sampled from the GPU's candidates and, with a twin sampler, from the full logits
    of the same forward: they must agree. Returns (tokens from candidates, fallbacks)."""
    vocab = be.config.vocab_size
    reduced, full = Sampler(params, vocab), Sampler(params, vocab)
    history = History(list(prompt), n_prompt=len(prompt))
    be.reset()
    tokens, decided, fallbacks = prompt, 0, 0
    for step in range(n):
        reduction = reduced.reduction(history, *be.candidate_limits)
        assert reduction is not None, "a setting the GPU cannot reduce"
        be.forward_pending(tokens)
        found = be.read_candidates(reduction)
        token = reduced.sample_reduced(history, found) if found is not None else None
        logits = be.last_logits()
        want = full.sample(history, logits)
        if token is None:
            token = reduced.sample(history, logits)
            fallbacks += 1
        else:
            decided += 1
        assert token == want, f"token {step}"
        history.tokens.append(token)
        tokens = [token]
    return decided, fallbacks


def chained(be, prompt: list[int], params: SamplingParams, n: int, on_gpu: bool = True) -> list[int]:
    """n tokens after `prompt` from the backend's sample_stream: chained on the GPU, or (not on_gpu)
    sampled on the host from the full logits of every forward."""
    sampler = Sampler(params, be.config.vocab_size)
    history = History(list(prompt), n_prompt=len(prompt))
    be.reset()
    reduces, be.reduces_on_device = be.reduces_on_device, on_gpu
    try:
        stream = be.sample_stream(sampler, history, prompt)
        tokens = [token for _, token in zip(range(n), stream)]
        stream.close()
    finally:
        be.reduces_on_device = reduces
    assert history.generated == tokens
    return tokens
