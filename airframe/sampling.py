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

import math
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
def logit_bias(bias: dict[int, float] | None, vocab_size: int | None) -> Step | None:
    """Add a fixed amount to chosen tokens (OpenAI `logit_bias`; -100 all but bans a token)."""
    if not bias:
        return None
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
    ids_array = np.array(ids, dtype=np.int64)
    amounts_array = np.array(amounts)

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        np.add.at(out, ids_array, amounts_array)
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

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        window = history.tokens if last_n == -1 else history.tokens[-last_n:]
        if not window:
            return logits
        seen = np.unique(np.asarray(window, dtype=np.int64))
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

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        generated = history.generated
        if not generated:
            return logits
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        out = logits.copy()
        out[ids] -= frequency * counts + presence
        return out

    return step


def top_k(k: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """Pick the k most likely tokens: their ids, ascending (ties at the cut: argpartition's choice).

    Unlike the other steps this one returns ids: every step after it runs on those k candidates
    only, which is what keeps sampling from a 262,144-token vocabulary at about a millisecond.
    """
    k = _integer("top_k", k, 0, None, "an integer >= 0 (0 = off)")
    if k == 0:
        return None

    def select(logits: np.ndarray) -> np.ndarray:
        if k >= logits.size:
            return np.arange(logits.size)
        return np.sort(np.argpartition(logits, logits.size - k)[logits.size - k:])

    return select


def _probabilities(logits: np.ndarray) -> np.ndarray:
    top = np.max(logits)
    if np.isposinf(top):  # a penalty or bias overflowed: the +inf tokens share all the probability
        infinite = np.isposinf(logits)
        return infinite / np.count_nonzero(infinite)
    shifted = np.exp(logits - top)
    return shifted / shifted.sum()


def top_p(p: float) -> Step | None:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p."""
    p = _number("top_p", p, 0.0, 1.0, "a number in 0.0..1.0 (1.0 = off)")
    if p == 1.0:
        return None

    def step(history: History, logits: np.ndarray) -> np.ndarray:
        alive = np.flatnonzero(logits > -np.inf)  # +inf is a candidate too (an overflowed penalty)
        if alive.size == 0:
            return logits  # nothing left to cut: draw() reports it
        probs = _probabilities(logits[alive])
        order = _most_likely_reaching(probs, p)
        cumulative = np.cumsum(probs[order])
        n_keep = int(np.searchsorted(cumulative, p, side="left")) + 1  # at least one token
        out = np.full_like(logits, -np.inf)
        kept = alive[order[:n_keep]]
        out[kept] = logits[kept]
        return out

    return step


def _most_likely_reaching(probs: np.ndarray, p: float) -> np.ndarray:
    """Indices of the n most likely entries, most likely first, for an n whose share reaches p.

    Sorting a 262,144-token vocabulary takes tens of ms; the head that reaches p is usually
    small, so grow a partial selection (O(vocab)) until it is big enough and sort only that.
    """
    n = 64
    while n <= probs.size // 8:  # beyond that a full sort is cheaper than another try
        head = np.argpartition(-probs, n - 1)[:n]
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
        top = np.max(logits)
        if not np.isfinite(top):  # +inf: only the +inf tokens are within any share of it; -inf: none left
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
        top = np.max(logits)
        if np.isfinite(top) and np.isposinf(out).any():  # a tiny t overflowed: the same distribution, shifted
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

    penalties: list[Step]  # over the whole vocabulary: they look tokens up by id
    select: Callable[[np.ndarray], np.ndarray] | None  # top-k: the candidate ids (None: all)
    truncation: list[Step]  # over the candidates only: top-p, min-p, temperature
    greedy: bool


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
                 truncation=[s for s in truncation if s is not None], greedy=params.temperature == 0)


class Sampler:
    """The chain for one request and its random generator (seeded: the same tokens every time)."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.chain = build_chain(params, vocab_size)
        self.rng = np.random.default_rng(check_seed(params.seed))

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

    def sample(self, history: History, logits: np.ndarray) -> int:
        if self.chain.greedy:
            return int(np.argmax(self.penalised(history, logits)))  # first index among ties
        ids, out = self.candidates(history, logits)
        index = draw(out, self.rng)
        return index if ids is None else int(ids[index])


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One token from softmax(logits) by inverting the cumulative distribution."""
    alive = np.flatnonzero(logits > -np.inf)
    if alive.size == 0:
        raise ParameterError("every token was removed by the sampler (all logits are -inf)")
    probs = _probabilities(logits[alive])
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
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
