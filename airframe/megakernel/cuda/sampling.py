"""The host's half of drawing sampled tokens inside the megakernel (worker_sample.cuh).

A launch that samples gets its request's chain as settings (af_sampling), the random number of
every token it may draw (Sampler.uniform: the same numbers the host draws with), and the state the
penalties look at: how often each token is in the repetition window and how often it was
generated, and the request's tokens so far, which the kernel extends as it draws. The kernel then
computes what Sampler.sample() computes, in float64 over the same float32 logits, so the tokens
are the host's; what it cannot do exactly (a grammar, top-k off or above 64) stays on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...sampling import History, Sampler, bias_terms

SAMPLE_K = 64  # AF_SAMPLE_K: top_k at most
# AF_SAMPLE_SHARED_FLOATS: the histogram, 4 words, and the per-candidate arrays of draw_token
SAMPLE_SHARED_FLOATS = 256 + 4 + 3 * 2 * SAMPLE_K + 3 * SAMPLE_K
# af_sampling.flags (AF_S_*)
BIAS, REPEAT, COUNTS, TOP_P, MIN_P, TEMPERATURE, GREEDY = 1, 2, 4, 8, 16, 32, 64

SAMPLING_DTYPE = np.dtype([
    ("top_k", "<u4"), ("flags", "<u4"), ("last_n", "<u4"), ("hist_len", "<u4"), ("n_prompt", "<u4"),
    ("reserved", "<u4", 3),
    ("top_p", "<f8"), ("log_min_p", "<f8"), ("temperature", "<f8"), ("repeat_penalty", "<f8"),
    ("presence", "<f8"), ("frequency", "<f8"),
    ("bias", "<u8"), ("win", "<u8"), ("gen", "<u8"), ("hist", "<u8"), ("cand", "<u8"),
    ("u", "<f4", 64),
])
assert SAMPLING_DTYPE.itemsize == 376


def sample_floats(lm_parts: int, lm_rows: int) -> int:
    """Shared memory (floats from the worker's sm) that drawing needs: the fixed arrays, then an
    8-byte key per row of the largest LM_HEAD task or per candidate of a step."""
    return SAMPLE_SHARED_FLOATS + 2 * max(lm_rows, lm_parts * SAMPLE_K)


def kernel_refuses(sampler: Sampler) -> str | None:
    """Why the kernel cannot draw this request's tokens exactly as the host would (None: it can)."""
    params = sampler.chain.params
    if sampler.constraint is not None:
        return "a grammar or JSON schema masks the logits on the host"
    if sampler.chain.greedy:
        return None
    if params.top_k == 0:
        return "top_k = 0: top-p and min-p then reach over the whole vocabulary"
    if params.top_k > SAMPLE_K:
        return f"top_k = {params.top_k}: the kernel keeps {SAMPLE_K} candidates at most"
    return None


@dataclass
class DrawSettings:
    """One launch's af_sampling (pointers left for the runtime) and the arrays it points at."""

    header: np.ndarray        # one SAMPLING_DTYPE record
    bias: np.ndarray | None   # float64 (vocab), with BIAS
    win: np.ndarray           # uint32 (vocab): times each token is in the repetition window
    gen: np.ndarray           # uint32 (vocab): times each token was generated
    hist: np.ndarray          # uint32: the request's tokens so far

    @property
    def top_k(self) -> int:
        return int(self.header["top_k"][0])


def draw_settings(sampler: Sampler, history: History, n_draws: int, vocab: int) -> DrawSettings:
    """The settings of a launch that draws up to n_draws tokens after `history`, whose last token
    is the one its last given step runs."""
    assert kernel_refuses(sampler) is None and 0 < n_draws <= 64
    params = sampler.chain.params
    h = np.zeros(1, dtype=SAMPLING_DTYPE)
    tokens = np.asarray(history.tokens, dtype=np.int64)
    flags = 0
    bias = None
    ids, amounts = bias_terms(params.logit_bias, vocab)
    if ids.size:
        flags |= BIAS
        bias = np.zeros(vocab)
        np.add.at(bias, ids, amounts)
    win = np.zeros(vocab, dtype=np.uint32)
    if params.repeat_penalty != 1.0 and params.repeat_last_n != 0:
        flags |= REPEAT
        window = tokens if params.repeat_last_n == -1 else tokens[-params.repeat_last_n:]
        np.add.at(win, window, 1)
        h["last_n"] = 0 if params.repeat_last_n == -1 else params.repeat_last_n
        h["repeat_penalty"] = params.repeat_penalty
    gen = np.zeros(vocab, dtype=np.uint32)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        flags |= COUNTS
        np.add.at(gen, tokens[history.n_prompt:], 1)
        h["presence"], h["frequency"] = params.presence_penalty, params.frequency_penalty
    if sampler.chain.greedy:
        flags |= GREEDY
        h["top_k"] = 1
    else:
        h["top_k"] = params.top_k
        if params.top_p < 1.0:
            flags |= TOP_P
            h["top_p"] = params.top_p
        if params.min_p > 0.0:
            flags |= MIN_P
            h["log_min_p"] = math.log(params.min_p)
        if params.temperature != 1.0:
            flags |= TEMPERATURE
            h["temperature"] = params.temperature
        h["u"][0, :n_draws] = [sampler.uniform(history, j) for j in range(n_draws)]
    h["flags"] = flags
    h["hist_len"] = tokens.size
    h["n_prompt"] = history.n_prompt
    return DrawSettings(h, bias, win, gen, tokens.astype(np.uint32))


# ---- the kernel's drawing in numpy ------------------------------------------------------------------
def penalised(draw: DrawSettings, win: np.ndarray, gen: np.ndarray, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """worker_sample.cuh's penalised(): the float32 logits of `ids` after the bias and penalties,
    in float64 and the host's order."""
    h = draw.header[0]
    p = np.asarray(logits, dtype=np.float32).astype(np.float64)
    if h["flags"] & BIAS:
        p = p + draw.bias[ids]
    if h["flags"] & REPEAT:
        seen = win[ids] > 0
        p[seen] = np.where(p[seen] > 0, p[seen] / h["repeat_penalty"], p[seen] * h["repeat_penalty"])
    if h["flags"] & COUNTS:
        g = gen[ids].astype(np.float64)
        counted = g > 0
        p[counted] -= h["frequency"] * g[counted] + h["presence"]
    return p


class KernelDraw:
    """What worker_sample.cuh does over one launch, in numpy: each LM_HEAD slot's top_k, the top_k
    of those, the host's chain over them (sampling.py's own steps, which the kernel repeats in
    float64), and the state of the two buffers that advance_state keeps. `slots`: (first row, rows)
    of each LM_HEAD task."""

    def __init__(self, draw: DrawSettings, slots: list[tuple[int, int]], first: int):
        self.draw, self.slots, self.first = draw, slots, first  # first: the first drawing step
        self.win = [draw.win.copy(), draw.win.copy()]
        self.gen = [draw.gen.copy(), draw.gen.copy()]
        self.hist = [int(t) for t in draw.hist]

    def token(self, done: int, logits: np.ndarray) -> int:
        """The token step `done` draws from its logits (vocab,)."""
        from ...sampling import draw as draw_index
        from ...sampling import temperature, top_p

        h, state = self.draw.header[0], done & 1
        k = int(h["top_k"])

        def best(ids: np.ndarray) -> np.ndarray:  # the k largest, lowest ids among ties
            values = penalised(self.draw, self.win[state], self.gen[state], ids, logits[ids])
            return ids[np.lexsort((ids, -values))[:k]]

        ids = np.sort(best(np.concatenate([best(np.arange(r0, r0 + n)) for r0, n in self.slots])))
        values = penalised(self.draw, self.win[state], self.gen[state], ids, logits[ids])
        if h["flags"] & GREEDY:
            return int(ids[np.argmax(values)])
        if h["flags"] & TOP_P:
            values = top_p(float(h["top_p"]))(None, values)
        if h["flags"] & MIN_P:  # sampling.min_p with its logarithm as the kernel is given it
            top = values.max()
            keep = values - top >= h["log_min_p"] if math.isfinite(top) else values == top
            values = np.where(keep, values, -np.inf)
        if h["flags"] & TEMPERATURE:
            values = temperature(float(h["temperature"]))(None, values)
        return int(ids[draw_index(values, float(h["u"][done - self.first]))])

    def advance(self, done: int, token: int) -> None:
        """advance_state(): the state step done + 1 reads gets the token step done ran (past the
        first drawing step) and the one it drew."""
        h = self.draw.header[0]
        win, gen = self.win[(done + 1) & 1], self.gen[(done + 1) & 1]
        at = int(h["hist_len"]) + done - self.first
        self.hist.append(token)
        assert len(self.hist) == at + 1
        for i in range(at - 1 if done > self.first else at, at + 1):
            x = self.hist[i]
            win[x] += 1
            if h["last_n"] and i >= h["last_n"]:
                win[self.hist[i - int(h["last_n"])]] -= 1
            if i >= h["n_prompt"]:
                gen[x] += 1
