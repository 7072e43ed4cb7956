"""Which token ids a backend's K/V cache holds, so the next request prefills only what is new.

Chat clients resend the whole conversation every turn. Position p of the cache holds the K/V of
the token run at p, which depends only on the tokens at 0..p, so a prompt that starts with the
tokens already run may keep those positions and run the rest. Sliding-window layers keep every
position too (the cache is [layer][kv_head][ctx][head_dim]; the window is a mask over absolute
positions), so the rule is the same for them.
"""

from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """The ids whose K/V are at positions 0.. of one backend's cache (llama-server's "slot")."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def reusable(self, prompt: Sequence[int]) -> int:
        """Positions a request for `prompt` can keep: the common prefix, but never the whole prompt,
        since the last prompt token must run to give the logits of the first new token."""
        return min(common_prefix(self.tokens, prompt), len(prompt) - 1)

    def remember(self, ran: Sequence[int], n_past: int) -> None:
        """After a request: the backend's first n_past positions hold `ran` (prompt then generated
        ids, in order) up to n_past; ids generated past n_past never ran, positions past the known
        ids (tokens the device ran that the engine never took) are not kept."""
        self.tokens = list(ran[:n_past])

    def forget(self) -> None:
        """A request failed or stopped midway: nothing in the cache is trusted."""
        self.tokens = []
