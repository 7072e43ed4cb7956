"""Choosing the next token from logits: a chain of small pure steps built once per request.

Each step is `(history, logits) -> logits` (float64; a removed token gets -inf) and checks its
own parameter when it is built. The penalties run over the whole vocabulary; top-k then picks
candidate ids and the steps after it run on those candidates only. The order follows llama.cpp's
default chain, so the same settings mean the same thing here and there:

    logit bias -> repetition penalty -> presence/frequency penalties
    -> top-k -> top-p -> min-p -> temperature -> draw

Temperature comes last: top-p and min-p cut on the model's own (bias- and penalty-adjusted)
distribution, and temperature only reshapes what survives. Temperature 0 is greedy: the argmax
of the biased and penalised logits, lowest id among ties; the truncation steps are then skipped
because they can never remove the argmax.
https://github.com/ggml-org/llama.cpp/blob/master/common/sampling.cpp (default sampler order)
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import ParameterError

MAX_SEED = 2**64 - 1
OPENAI_PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy (lowest id among ties)
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # -1 = the whole history, 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None

    def __post_init__(self):
        build_chain(self, vocab_size=None)  # refuse a bad value where it is made


# The values under which a step changes nothing once temperature is 0 (argmax): top-k, top-p and
# min-p keep the argmax, so only these can make a greedy pick differ from plain argmax.
GREEDY_NEUTRAL = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def greedy_blockers(params: SamplingParams) -> list[str]:
    """Which settings keep `params` from being plain greedy decoding (argmax of the raw logits):
    empty for a request that a backend choosing tokens itself (the CUDA megakernel) may serve."""
    blockers = [] if params.temperature == 0 else [f"temperature = {params.temperature}"]
    blockers += [f"{name} = {getattr(params, name)}" for name, neutral in GREEDY_NEUTRAL.items()
                 if getattr(params, name) != neutral]
    if params.logit_bias:
        blockers.append("logit_bias")
    return blockers


@dataclass
class History:
    """The tokens a step may look at: the prompt, then what was generated so far."""

    tokens: list[int] = field(default_factory=list)
    n_prompt: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]


Step = Callable[[History, np.ndarray], np.ndarray]


def positions(tokens: np.ndarray, ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Where `tokens` sit in a logits array: (positions, which of `tokens` are there). Over the
    whole vocabulary a token's position is its id; over candidates (`ids`, ascending) it is looked up."""
    if ids is None:
        return tokens, np.ones(tokens.size, dtype=bool)
    if not ids.size:
        return np.zeros(0, dtype=np.int64), np.zeros(tokens.size, dtype=bool)
    at = ids.searchsorted(tokens)
    np.minimum(at, ids.size - 1, out=at)
    found = ids[at] == tokens
    return at[found], found


_NONE = np.zeros(0, dtype=np.int64)  # no tokens (read-only: never written)
_NONE.flags.writeable = False


def _window(history: History, last_n: int) -> np.ndarray:
    """The distinct tokens among the last `last_n` (-1: all) of the history."""
    window = history.tokens if last_n == -1 else history.tokens[-last_n:]
    return np.array(sorted(set(window)), dtype=np.int64)


def _generated_counts(history: History) -> tuple[np.ndarray, np.ndarray]:
    """The distinct generated tokens and how often each was generated."""
    return np.unique(np.asarray(history.generated, dtype=np.int64), return_counts=True)


# ---- parameter checks ------------------------------------------------------------------------
def _number(name: str, value, low: float, high: float, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or math.isnan(value) \
            or not low <= value <= high:
        raise ParameterError(f"{name} = {value!r}, expected {allowed}")
    return float(value)


def _integer(name: str, value, low: int, high: int | None, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or value < low or (high is not None and value > high):
        raise ParameterError(f"{name} = {value!r}, expected {allowed}")
    return int(value)


# ---- the steps -------------------------------------------------------------------------------
def bias_terms(bias: dict[int, float] | None, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """OpenAI's `logit_bias` checked, as (token ids, amounts); ids may be given as digit strings (JSON keys)."""
    if not bias:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    if not isinstance(bias, dict):
        raise ParameterError(f"logit_bias = {bias!r}, expected a mapping of token id to a number")
    ids, amounts = [], []
    top = "vocabulary size - 1" if vocab_size is None else str(vocab_size - 1)
    for token, amount in bias.items():
        token = int(token) if isinstance(token, str) and token.lstrip("-").isdigit() else token
        _integer("logit_bias token id", token, 0, None if vocab_size is None else vocab_size - 1,
                 f"an integer in 0..{top}")
        _number(f"logit_bias[{token}]", amount, *LOGIT_BIAS_RANGE, "a number in -100..100")
        ids.append(int(token))
        amounts.append(float(amount))
    return np.array(ids, dtype=np.int64), np.array(amounts)


def logit_bias(bias: dict[int, float] | None, vocab_size: int | None) -> Step | None:
    """Add a fixed amount to chosen tokens (OpenAI `logit_bias`; -100 all but bans a token)."""
    ids_array, amounts_array = bias_terms(bias, vocab_size)
    if not ids_array.size:
        return None

    def step(history: History, logits: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        out = logits.copy()
        at, found = positions(ids_array, ids)
        np.add.at(out, at, amounts_array[found])
        return out

    return step


def repetition_penalty(penalty: float, last_n: int) -> Step | None:
    """Make tokens seen in the last `last_n` tokens (prompt included) less likely.

    A positive logit is divided by the penalty and a negative one multiplied by it, so with a
    penalty above 1 a seen token always loses ground (llama.cpp and HF do the same; dividing a negative logit, as the
    seed design says, would raise it).
    """
    allowed = "a finite number > 0 (1.0 = off)"
    penalty = _number("repeat_penalty", penalty, 0.0, math.inf, allowed)
    if penalty == 0.0 or math.isinf(penalty):
        raise ParameterError(f"repeat_penalty = {penalty!r}, expected {allowed}")
    last_n = _integer("repeat_last_n", last_n, -1, None, "an integer >= -1 (-1 = whole history, 0 = off)")
    if penalty == 1.0 or last_n == 0:
        return None

    def step(history: History, logits: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        seen, _ = positions(_window(history, last_n), ids)
        if not seen.size:
            return logits
        out = logits.copy()
        values = out[seen]
        with np.errstate(over="ignore"):  # a tiny penalty may overflow to +inf: the later steps take it
            out[seen] = np.where(values > 0, values / penalty, values * penalty)
        return out

    return step


def presence_frequency_penalty(presence: float, frequency: float) -> Step | None:
    """OpenAI's additive penalties over the generated tokens (the prompt does not count):
    logit -= frequency * count + presence * (count > 0)."""
    presence = _number("presence_penalty", presence, *OPENAI_PENALTY_RANGE, "a number in -2.0..2.0")
    frequency = _number("frequency_penalty", frequency, *OPENAI_PENALTY_RANGE, "a number in -2.0..2.0")
    if presence == 0.0 and frequency == 0.0:
        return None

    def step(history: History, logits: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        tokens, counts = _generated_counts(history)
        at, found = positions(tokens, ids)
        if not at.size:
            return logits
        out = logits.copy()
        out[at] -= frequency * counts[found] + presence
        return out

    return step


def top_k(k: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """Pick the k most likely tokens: their ids, ascending (ties at the cut: the lowest ids, so
    that the same logits give the same candidates over the whole vocabulary or a part of it).

    Unlike the other steps this one returns ids: every step after it runs on those k candidates
    only, which is what keeps sampling from a 262,144-token vocabulary at about a millisecond.
    """
    k = _integer("top_k", k, 0, None, "an integer >= 0 (0 = off)")
    if k == 0:
        return None

    def select(logits: np.ndarray) -> np.ndarray:
        if k >= logits.size:
            return np.arange(logits.size)
        cut = np.partition(logits, logits.size - k)[logits.size - k]  # the k-th largest
        above = (logits > cut).nonzero()[0]
        at_cut = (logits == cut).nonzero()[0][:k - above.size]
        return np.sort(np.concatenate([above, at_cut]))

    return select


def _probabilities(logits: np.ndarray) -> np.ndarray:
    top = logits.max()
    if top == math.inf:  # a penalty or bias overflowed: the +inf tokens share all the probability
        infinite = logits == math.inf
        return infinite / np.count_nonzero(infinite)
    shifted = np.exp(logits - top)
    return shifted / shifted.sum()


def top_p(p: float) -> Step | None:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p."""
    p = _number("top_p", p, 0.0, 1.0, "a number in 0.0..1.0 (1.0 = off)")
    if p == 1.0:
        return None

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        alive = (logits > -math.inf).nonzero()[0]  # +inf is a candidate too (an overflowed penalty)
        if alive.size == 0:
            return logits  # nothing left to cut: draw() reports it
        probs = _probabilities(logits[alive])
        order = _most_likely_reaching(probs, p)
        n_keep = _reaching(probs[order], p)
        out = np.full_like(logits, -np.inf)
        kept = alive[order[:n_keep]]
        out[kept] = logits[kept]
        return out

    return step


def _reaching(sorted_probs: np.ndarray, p: float) -> int:
    """How many of the most likely tokens (probabilities sorted down) top-p keeps: at least one;
    len + 1 when even all of them fall short of p."""
    return int(sorted_probs.cumsum().searchsorted(p, side="left")) + 1


def _most_likely_reaching(probs: np.ndarray, p: float) -> np.ndarray:
    """Indices of the n most likely entries, most likely first (the lowest index first among ties),
    for an n whose share reaches p.

    Sorting a 262,144-token vocabulary takes tens of ms; the head that reaches p is usually
    small, so grow a partial selection (O(vocab)) until it is big enough and sort only that.
    """
    n = 64
    while n <= probs.size // 8:  # beyond that a full sort is cheaper than another try
        cut = np.partition(probs, probs.size - n)[probs.size - n]  # the n-th largest
        head = np.flatnonzero(probs >= cut)  # ascending, with every tie at the cut: ties go to the lowest ids
        if probs[head].sum() >= p:
            return head[np.argsort(-probs[head], kind="stable")]
        n *= 8
    return np.argsort(-probs, kind="stable")


def min_p(p: float) -> Step | None:
    """Drop tokens less likely than p times the most likely one."""
    p = _number("min_p", p, 0.0, 1.0, "a number in 0.0..1.0 (0.0 = off)")
    if p == 0.0:
        return None
    log_p = math.log(p)

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        top = logits.max()
        if not math.isfinite(top):  # +inf: only the +inf tokens are within any share of it; -inf: none left
            return np.where(logits == top, logits, -np.inf)
        return np.where(logits - top >= log_p, logits, -np.inf)

    return step


def temperature(t: float) -> Step | None:
    """Divide the logits by t: below 1 sharpens, above 1 flattens (0 is greedy, handled apart)."""
    t = _number("temperature", t, 0.0, math.inf, "a finite number >= 0.0 (0 = greedy)")
    if math.isinf(t):
        raise ParameterError(f"temperature = {t!r}, expected a finite number >= 0.0 (0 = greedy)")
    if t == 0.0 or t == 1.0:
        return None

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            out = logits / t
        top = logits.max()
        if math.isfinite(top) and float(top) / t == math.inf:  # a tiny t overflowed: the same distribution, shifted
            with np.errstate(over="ignore"):
                out = (logits - top) / t
        return out

    return step


def check_seed(seed) -> int | None:
    if seed is None:
        return None
    return _integer("seed", seed, 0, MAX_SEED, f"an integer in 0..{MAX_SEED} or null")


@dataclass
class Chain:
    """The steps of one request, switched-off ones left out, in the order they run."""

    penalties: list[Step]  # over the whole vocabulary or candidates: they look tokens up by id
    select: Callable[[np.ndarray], np.ndarray] | None  # top-k: the candidate ids (None: all)
    truncation: list[Step]  # over the candidates only: top-p, min-p, temperature
    greedy: bool
    params: SamplingParams  # checked: what a device needs to apply the penalties itself
    bias: tuple[np.ndarray, np.ndarray]  # logit_bias as (token ids, amounts)


def build_chain(params: SamplingParams, vocab_size: int | None) -> Chain:
    penalties = [
        logit_bias(params.logit_bias, vocab_size),
        repetition_penalty(params.repeat_penalty, params.repeat_last_n),
        presence_frequency_penalty(params.presence_penalty, params.frequency_penalty),
    ]
    select = top_k(params.top_k)
    truncation = [top_p(params.top_p), min_p(params.min_p), temperature(params.temperature)]
    check_seed(params.seed)
    return Chain(penalties=[s for s in penalties if s is not None], select=select,
                 truncation=[s for s in truncation if s is not None], greedy=params.temperature == 0,
                 params=params, bias=bias_terms(params.logit_bias, vocab_size))


# ---- sampling from a device's candidates ----------------------------------------------------------
CANDIDATE_MARGIN = 16    # candidates beyond top-k: float32 rounding on the device cannot change the top k
OPEN_CANDIDATES = 256    # candidates asked for when top-k is off (top-p or min-p must then fit in them)


@dataclass
class Reduction:
    """What a device needs to reduce one token's logits to candidates: the penalty table, one row
    per token a penalty touches (id, logit bias as float32 bits, in the repetition window, times
    generated), the request's penalty amounts, and how many candidates to keep at least; and what it
    needs to draw the token from them itself: the truncation settings and this token's random number.
    With `pending` the table leaves out the token the device is about to run (it drew it and the
    host has not read it yet): the device counts that one as generated and in the window itself.
    A constrained request's `allowed` bitset (Constraint.allowed_words) leaves every other token out,
    as the host's -inf would."""

    table: np.ndarray  # (n, 4) uint32
    repeat_penalty: float  # 1.0 when the repetition penalty is off
    presence: float
    frequency: float
    want: int
    top_k: int
    top_p: float
    min_p: float
    temperature: float
    u: float
    pending: bool = False
    allowed: np.ndarray | None = None  # (ceil(vocab / 32),) uint32; None: every token


@dataclass
class Candidates:
    """A device's answer to a Reduction: every token whose penalised logit (float32) reaches
    `threshold`, with the logits the model gave them, and the log-sum-exp of the whole vocabulary
    after the penalties."""

    ids: np.ndarray     # int64, ascending
    logits: np.ndarray  # float32: the model's logits of `ids`, before any penalty
    threshold: float
    log_sum_exp: float


class Sampler:
    """The chain for one request and its seed (the same seed, the same tokens every time)."""

    def __init__(self, params: SamplingParams, vocab_size: int, constraint=None):
        self.chain = build_chain(params, vocab_size)
        self.vocab_size = vocab_size
        seed = check_seed(params.seed)
        self.seed = secrets.randbits(64) if seed is None else seed
        # a Constraint (airframe/constraint.py): masks the logits before the chain, on the host or
        # (Reduction.allowed) on the device; accept() advances it
        self.constraint = constraint

    def accept(self, history: History, token: int) -> None:
        """`token` taken: appended to `history`, and the constraint advanced by it."""
        history.tokens.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)

    def uniform(self, history: History, ahead: int = 0) -> float:
        """The random number that draws generated token len(history.generated) + ahead."""
        return uniform(self.seed, len(history.generated) + ahead)

    def penalised(self, history: History, logits: np.ndarray) -> np.ndarray:
        out = np.asarray(logits)  # float64 only when a penalty must change it: a copy costs ms
        for step in self.chain.penalties:
            out = step(history, out.astype(np.float64, copy=False))
        return out

    def candidates(self, history: History, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(ids, their logits after every step); ids None means the whole vocabulary in order."""
        out = self.penalised(history, logits)
        ids = self.chain.select(out) if self.chain.select else None
        out = (out if ids is None else out[ids]).astype(np.float64)
        for step in self.chain.truncation:
            out = step(history, out)
        return ids, out

    def process(self, history: History, logits: np.ndarray) -> np.ndarray:
        """The whole vocabulary after every step: -inf where a token was removed."""
        if self.chain.greedy:
            return self.penalised(history, logits)
        ids, out = self.candidates(history, logits)
        if ids is None:
            return out
        full = np.full(np.shape(logits), -np.inf)
        full[ids] = out
        return full

    def reduction(self, history: History, max_entries: int, max_want: int, pending: bool = False) -> Reduction | None:
        """The request for a device to reduce this token's logits to candidates, or None when the
        candidates could not decide the token (nothing truncates: top-k, top-p and min-p off) or
        the request is larger than the device takes. `pending`: the logits are those after one more
        token than `history` holds, which the device adds to the penalties itself (not with a
        constraint: its mask follows that token)."""
        chain, params = self.chain, self.chain.params
        assert not (pending and self.constraint is not None), "a constraint's mask needs the pending token"
        if chain.greedy:
            want = 1 + CANDIDATE_MARGIN
        elif params.top_k:
            want = params.top_k + CANDIDATE_MARGIN
        elif params.top_p < 1.0 or params.min_p > 0.0:
            want = OPEN_CANDIDATES
        else:
            return None
        if want > max_want:
            return None
        repeat = params.repeat_penalty != 1.0 and params.repeat_last_n != 0
        open_ai = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        last_n = params.repeat_last_n - pending if params.repeat_last_n > 0 else params.repeat_last_n
        window = _window(history, last_n) if repeat and last_n else _NONE
        generated, counts = _generated_counts(history) if open_ai else (_NONE, _NONE)
        bias_ids, amounts = chain.bias
        ids = window  # the usual request: a repetition penalty alone
        if generated.size or bias_ids.size:
            ids = np.union1d(np.union1d(window, generated), bias_ids)
        if ids.size > max_entries:
            return None
        table = np.zeros((ids.size, 4), dtype=np.uint32)
        table[:, 0] = ids
        if bias_ids.size:
            bias = np.zeros(ids.size, dtype=np.float32)
            np.add.at(bias, ids.searchsorted(bias_ids), amounts)
            table[:, 1] = bias.view(np.uint32)
        table[ids.searchsorted(window), 2] = 1
        table[ids.searchsorted(generated), 3] = counts
        allowed = self.constraint.allowed_words(self.vocab_size) if self.constraint is not None else None
        return Reduction(table, params.repeat_penalty if repeat else 1.0, params.presence_penalty,
                         params.frequency_penalty, want, params.top_k, params.top_p, params.min_p,
                         params.temperature, self.uniform(history, int(pending)), pending, allowed)

    @property
    def candidates_decide(self) -> bool:
        """Whether a device's candidates always decide the token (greedy, or a top-k: sample_reduced
        then needs nothing beyond them), so that a device may draw it and run the next forward
        before the host has checked it."""
        return self.chain.greedy or self.chain.select is not None

    def sample_reduced(self, history: History, found: Candidates) -> int | None:
        """The token sample() would pick from the full logits, from a device's candidates; None
        when they cannot decide it (top-p or min-p reach past them): then sample() from the full
        logits. Draws with the same random number as sample()."""
        ids = found.ids
        out = np.asarray(found.logits, dtype=np.float64)
        for step in self.chain.penalties:
            out = step(history, out, ids)
        if self.chain.greedy:
            return int(ids[np.argmax(out)])  # ids ascending: the lowest id among ties
        truncation = self.chain.truncation
        if self.chain.select:
            keep = self.chain.select(out)
            ids, out = ids[keep], out[keep]
        else:
            params = self.chain.params
            if params.top_p < 1.0:  # top-p over the whole vocabulary (the first truncation step)
                probs = np.exp(out - found.log_sum_exp)
                order = np.argsort(-probs, kind="stable")
                n_keep = _reaching(probs[order], params.top_p)
                if n_keep > ids.size:
                    return None
                kept = np.sort(order[:n_keep])
                ids, out = ids[kept], out[kept]
                truncation = truncation[1:]
            elif np.max(out) + math.log(params.min_p) <= found.threshold:
                return None  # min-p keeps tokens below the candidates
        for step in truncation:
            out = step(history, out)
        return int(ids[draw(out, self.uniform(history))])

    def sample(self, history: History, logits: np.ndarray) -> int:
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if self.chain.greedy:
            return int(np.argmax(self.penalised(history, logits)))  # first index among ties
        ids, out = self.candidates(history, logits)
        index = draw(out, self.uniform(history))
        return index if ids is None else int(ids[index])


def uniform(seed: int, n: int) -> float:
    """The n-th random number in [0, 1) of a request seeded `seed`: a hash of the two, so any token's
    number is known without drawing the ones before it (a device drawing ahead of the host uses the
    same). 24 bits, exact in float32."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + n.to_bytes(8, "little"), digest_size=4).digest()
    return (int.from_bytes(digest, "little") >> 8) / float(1 << 24)


def draw(logits: np.ndarray, u: float) -> int:
    """One token from softmax(logits) by inverting the cumulative distribution at u in [0, 1)."""
    alive = (logits > -math.inf).nonzero()[0]
    if alive.size == 0:
        raise ParameterError("every token was removed by the sampler (all logits are -inf)")
    probs = _probabilities(logits[alive])
    cumulative = probs.cumsum()
    index = int(cumulative.searchsorted(u * cumulative[-1], side="right"))
    return int(alive[min(index, alive.size - 1)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Natural-log probabilities of the model's raw distribution (what logprobs report)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - np.max(x)
    return shifted - math.log(np.exp(shifted).sum())


def top_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, logprobs) of the k most likely tokens, most likely first."""
    logprobs = log_softmax(logits)
    k = min(k, logprobs.size)
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    candidates = np.argpartition(-logprobs, k - 1)[:k]
    order = np.lexsort((candidates, -logprobs[candidates]))
    ids = candidates[order]
    return ids, logprobs[ids]
