"""Sampled decoding chained on the GPU: draw.wgsl picks each token from its candidates and makes it
the next forward's input, and the host checks every token one step behind.

Token s's command buffer is the forward, the reduction to candidates, the draw and a copy of what
they wrote to read-back buffer s % 2. Before submitting it the host writes the penalty table as of
the tokens it knows, which are all but the one the GPU is about to run (candidates.wgsl adds that
one itself: Reduction.pending), and token s's random number. While the GPU runs s, the host reads
s - 1, runs its own sampler chain on the candidates in float64 (Sampler.sample_reduced) and keeps
the host's token: when the GPU drew another one (float32 rounding at a boundary of the cumulative
distribution), or could not draw, the chain stops after it and starts again from the host's token.
When the candidates cannot decide the token, that forward runs again on the host path (the full
logits). Either way the tokens are the host sampler's, the same as sampling the full logits.

A constrained request's draw needs the grammar's mask after the token before it, which the host
knows only once it has read that token: its steps are two submissions each (_Split). The forward
of s + 1 takes the token the GPU drew for s as its input and goes right after the reduction and
draw of s, which the host submits once it has written mask s; the host then reads token s, checks
it against the same masked candidates, advances the grammar and writes mask s + 1 while the GPU
runs that forward. The GPU waits only when the host's part of a token takes longer than a forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..backend import sample_next
from ..sampling import History, Sampler
from . import candidates as cand
from . import pipelines as pl


@dataclass
class ChainCounts:
    """How a backend's sampled tokens were made (`airframe bench` reports them)."""

    drawn: int = 0     # drawn on the GPU and confirmed by the host
    host: int = 0      # through the host path: the first after a prompt, and where a chain stopped
    restarts: int = 0  # chains stopped at a token the GPU drew otherwise or could not decide


def sample_stream(be, sampler: Sampler, history: History, tokens: Sequence[int]) -> Iterator[int]:
    """Backend.sample_stream with the tokens chained on the GPU; the first token after the prompt,
    and any the chain cannot decide, through the host path (sample_next)."""
    tokens = list(tokens)
    while True:
        token, _ = sample_next(be, sampler, history, tokens)
        be.chain_counts.host += 1
        sampler.accept(history, token)
        yield token
        if be.n_past >= be.n_ctx:
            return
        yield from _chain(be, sampler, history)
        if be.n_past >= be.n_ctx:
            return
        tokens = history.tokens[-1:]


def _chain(be, sampler: Sampler, history: History) -> Iterator[int]:
    """Tokens after history's last one, which runs at be.n_past, each the host's and taken by
    `sampler`; ends at the full context, at a token the GPU did not draw the same, or where the
    penalty table outgrows the GPU's, with n_past at the position of history's last token."""
    ops = be.candidates
    first = be.n_past
    room = be.n_ctx - first
    be.drop_prerecorded()
    be.ctx.device.queue.write_buffer(be.scratch.ids, 0, np.array([history.tokens[-1]], np.uint32))
    be.write_head_step(1, 0)
    plan = (_Split if sampler.constraint is not None else _Fused)(be)
    unread = deque()  # (step, reduction, submission index) submitted and not read, oldest first
    kept = 0          # steps whose tokens were taken: history's last token runs at first + kept
    try:
        for step in range(room + 1):
            if step < room:
                # the table as of history; with `pending` the GPU adds the token it drew for this step
                reduction = sampler.reduction(history, *be.candidate_limits, pending=plan.pending and step > 0)
                if reduction is None:
                    room = step
                else:
                    cand.write_request(be, ops, reduction)
                    unread.append((step, reduction, plan.submit(step, room)))
            # read the steps `plan.lag` behind this one (all that is left once nothing more is submitted)
            while unread and (unread[0][0] + plan.lag <= step or step >= room):
                done, reduction, index = unread.popleft()
                found = cand.read(be, ops, reduction, done % 2, history.tokens[-1] if reduction.pending else None, index)
                token = sampler.sample_reduced(history, found.candidates) if found.candidates is not None else None
                if token is None:
                    be.chain_counts.restarts += 1
                    return  # the host path runs this step again and samples the full logits
                kept += 1
                sampler.accept(history, token)
                if token != found.drawn:
                    be.chain_counts.restarts += 1
                    yield token
                    return  # the steps queued after it ran the GPU's token
                be.chain_counts.drawn += 1
                yield token
            if step >= room:
                return
    finally:
        be.n_past = first + kept


class _Fused:
    """Step s is one submission, the forward at first + s then the reduction and draw; the host
    reads it a step later, so the reduction of s + 1 counts the token it drew as pending."""

    lag, pending = 1, True

    def __init__(self, be):
        self.be, self.first = be, be.n_past
        self.commands = cand.record(be, be.candidates, 0, be.token_dispatches(1))

    def submit(self, step: int, room: int) -> int | None:
        be = self.be
        be.n_past = self.first + step
        be.write_step(1)
        index = pl.submit(be.ctx.device.queue, [self.commands])
        if step + 1 < room:  # recorded while the GPU runs this step
            be.n_past = self.first + step + 1
            self.commands = cand.record(be, be.candidates, (step + 1) % 2, be.token_dispatches(1))
        return index


class _Split:
    """Step s is the reduction and draw of forward s, submitted once its mask is written, then
    forward s + 1, whose input is the token that draw writes; the host reads step s at once."""

    lag, pending = 0, False

    def __init__(self, be):
        self.be, self.first = be, be.n_past
        be.write_step(1)
        self.forward = be._record_decode(read=False)

    def _record(self, step: int, room: int):
        """Forward `step`'s command buffer, if the context has room for it."""
        if step >= room:
            return None
        self.be.n_past = self.first + step
        return self.be._record_decode(read=False)

    def submit(self, step: int, room: int) -> int | None:
        be, queue = self.be, self.be.ctx.device.queue
        if step == 0:  # submitted once its reduction is known: a sampler that cannot reduce runs none
            pl.submit(queue, [self.forward])
            self.forward = self._record(1, room)
        index = pl.submit(queue, [cand.record(be, be.candidates, step % 2)])
        if step + 1 < room:
            be.n_past = self.first + step + 1
            be.write_step(1)
            pl.submit(queue, [self.forward])
            self.forward = self._record(step + 2, room)  # while the GPU runs the two before it
        return index
