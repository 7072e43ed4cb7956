"""Which token ids a backend's K/V cache holds, so the next request prefills only what is new.

Chat clients resend the whole conversation every turn. Position p of the cache holds the K/V of
the token run at p, which depends only on the tokens at 0..p, so a prompt that starts with the
tokens already run may keep those positions and run the rest. Sliding-window layers keep every
position too (the cache is [layer][kv_head][ctx][head_dim]; the window is a mask over absolute
positions), so the rule is the same for them.

A backend may hold several caches ("slots", llama-server's word), each keeping one conversation
warm; PromptSlots picks the one a request runs in.
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


# a slot counts as holding a request's conversation only when the request shares more than this
# fraction of the slot's cached ids: a common system prompt alone does not pull a new conversation
# into another's slot (llama-server's --slot-prompt-similarity, default 0.5)
SIMILARITY = 0.5


class PromptSlots:
    """One PromptCache per slot of a backend, and which slot a request goes to."""

    def __init__(self, n_slots: int) -> None:
        self.caches = [PromptCache() for _ in range(n_slots)]
        self.last_used = [0] * n_slots  # the request count when each slot last ran one
        self.requests = 0

    def choose(self, prompt: Sequence[int], reuse: bool = True, busy: Sequence[int] = ()) -> int:
        """llama-server's rule: the slot whose cached ids share the longest prefix with `prompt`,
        counting only a slot whose cached ids are shared for more than SIMILARITY of their length,
        else (or not `reuse`) the least recently used one. Among equals, the least recently used:
        another conversation kept warm is the last to be overwritten. Never one of the `busy` slots
        (running another request), which must leave one free."""
        def rank(i: int) -> tuple[int, int]:
            cache = self.caches[i]
            shared = cache.reusable(prompt) if reuse else 0
            similar = shared > SIMILARITY * len(cache.tokens)
            return shared if similar else 0, -self.last_used[i]
        free = [i for i in range(len(self.caches)) if i not in busy]
        return max(free, key=rank)

    def use(self, slot: int) -> PromptCache:
        """Mark `slot` as running the current request; returns its record."""
        self.requests += 1
        self.last_used[slot] = self.requests
        return self.caches[slot]

    def forget(self) -> None:
        for cache in self.caches:
            cache.forget()
