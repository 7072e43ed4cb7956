"""Perplexity of a model on a text, scored the way llama.cpp's `llama-perplexity` scores it.

The rule (tools/perplexity/perplexity.cpp, `perplexity()`, default stride 0):
1. The whole text is tokenised once, with the model's BOS when its tokenizer adds one, and
   without parsing special-token text.
2. It is cut into n_chunk = len(tokens) // n_ctx non-overlapping windows of n_ctx tokens; the
   tail that does not fill a window is dropped. At least two windows are needed.
3. Each window is scored from an empty K/V cache. When the model adds BOS, the first token of
   every window (not only the first window) is replaced by BOS.
4. Only the second half is scored: with first = n_ctx // 2, the logits at positions
   first .. n_ctx - 2 predict the tokens at first + 1 .. n_ctx - 1, so each window scores
   n_ctx - first - 1 tokens; the first half is context only.
5. nll = -log softmax(logits)[next token], summed in double precision over every scored token;
   PPL = exp(mean nll). The error is llama.cpp's: PPL * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)),
   the standard error of the mean nll carried through exp.

Here a window runs as two forward calls (its context half, then its scored half with all
logits), which gives the same logits as one call while holding only half of them in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from tqdm import tqdm

from .backend import check_finite
from .errors import ParameterError

MIN_CTX = 4


@dataclass
class PerplexityResult:
    ppl: float
    error: float  # one standard error of ppl
    n_scored: int
    n_windows: int
    running_ppl: list[float] = field(default_factory=list)  # PPL after each window, like llama.cpp's [i]x.xxxx


def cut_windows(tokens: Sequence[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """Non-overlapping windows of n_ctx tokens, each starting with BOS when bos_id is given."""
    if n_ctx < MIN_CTX:
        raise ParameterError(f"perplexity context {n_ctx}, expected at least {MIN_CTX} tokens")
    n_windows = len(tokens) // n_ctx
    if n_windows < 2:
        raise ParameterError(f"the text has {len(tokens)} tokens; a context of {n_ctx} needs at least "
                             f"{2 * n_ctx} (two windows), as llama.cpp requires")
    windows = []
    for i in range(n_windows):
        window = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            window[0] = bos_id
        windows.append(window)
    return windows


def scored_nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] in float64; logits (n, vocab), targets (n,)."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(x - top).sum(axis=-1)) + top[:, 0]
    return log_sum - x[np.arange(len(targets)), np.asarray(targets)]


def window_nll(backend, window: Sequence[int], number: int = 1) -> np.ndarray:
    """The nll of the scored half of one window (the `number`-th), from an empty cache;
    NonFiniteError naming the position when a logit is NaN or inf."""
    first = len(window) // 2
    backend.reset()
    backend.forward(window[:first])
    logits = backend.forward(window[first:], all_logits=True)  # positions first .. n_ctx - 1
    check_finite(logits, first, f" of window {number}")
    return scored_nll(logits[:-1], window[first + 1:])


def summarize(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its standard error) from per-token nll, with llama.cpp's formula."""
    count = len(nll)
    mean = float(np.sum(nll) / count)
    variance = float(np.sum(nll * nll) / count) - mean * mean
    ppl = math.exp(mean)
    error = ppl * math.sqrt(variance / (count - 1)) if variance > 0 and count > 1 else 0.0
    return ppl, error


def perplexity(backend, tokens: Sequence[int], n_ctx: int, bos_id: int | None = None,
               progress: bool = True) -> PerplexityResult:
    """Score `tokens` (already tokenised, BOS included when the model adds it) in windows of n_ctx."""
    if n_ctx > backend.n_ctx:
        raise ParameterError(f"perplexity context {n_ctx} exceeds the backend's context of {backend.n_ctx}")
    windows = cut_windows(tokens, n_ctx, bos_id)
    all_nll, running = [], []
    bar = tqdm(windows, desc="perplexity", unit="window", disable=not progress)
    for number, window in enumerate(bar, 1):
        all_nll.append(window_nll(backend, window, number))
        running.append(summarize(np.concatenate(all_nll))[0])
        bar.set_postfix(ppl=f"{running[-1]:.4f}")
    nll = np.concatenate(all_nll)
    ppl, error = summarize(nll)
    return PerplexityResult(ppl, error, len(nll), len(windows), running)
