"""Greedy decoding chained on the GPU: each token's argmax becomes the next token's input without
the host in between.

argmax.wgsl (two dispatches after the LM head) writes the chosen id into the token-ids buffer that
the next token's embedding reads, and into a ring of ids by position. The host submits one command
buffer per token without waiting for it (the step uniform's write before each submit is ordered
with the submits) and records the next while the GPU runs. The ids are copied out in batches: the
first batch is the first token alone (time to first token), then `batch` tokens each; a batch is
read back only once READ_LAG more tokens are queued behind it, waiting for its own last token alone
(pipelines.read_after), so the GPU runs those while the host reads and hands the batch on. Tokens
computed past an end-of-generation token are dropped and n_past set back: their K/V rows are
overwritten later. With a cancel hook (a server request) the host asks it before each submit and,
before it, waits for the token CANCEL_AHEAD steps back to finish: at most that many tokens are
queued and unfinished, so at most that many run after the client left, while the GPU still has the
next token queued when it finishes one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import NonFiniteError, ParameterError
from . import pipelines as pl

NON_FINITE = pl.shader_constant("argmax.wgsl", "NON_FINITE")  # set in a ring id: a logit was NaN or infinite
GREEDY_BATCH = 16     # ids read back together after the first token
READ_LAG = 4          # tokens queued behind a batch's last one before the host waits for that batch
CANCEL_AHEAD = 2      # with a cancel hook: tokens submitted and maybe unfinished at most
ARGMAX_PER_GROUP = 2048  # logits per stage-1 workgroup of argmax.wgsl (WG * ITEMS there)


@dataclass
class ArgmaxOps:
    """The two argmax dispatches, the ring of chosen ids (one per position) and two read-back buffers."""

    dispatches: list[pl.Dispatch]
    ring: object        # (n_ctx,) u32: the id chosen from position p's logits at p
    staging: list       # two MAP_READ buffers of `batch` ids, used by alternate batches
    batch: int


def build_argmax(be, batch: int = GREEDY_BATCH) -> ArgmaxOps:
    """argmax.wgsl over logits row 0, writing the ids buffer and the ring; made once at load."""
    k = be.pipes
    vocab = be.config.vocab_size
    n_groups = pl.ceil_div(vocab, ARGMAX_PER_GROUP)
    candidates = k.storage(n_groups * 16, "argmax_candidates")  # vec4 per stage-1 workgroup
    ring = k.storage(be.n_ctx * 4, "greedy_ring")
    params = k.uniform(pl.pack_params("argmax", n=vocab, n_groups=n_groups, ring_len=be.n_ctx), "argmax")
    logits = (be.scratch.logits, 0, vocab * 4)
    group = k.bind("argmax", [logits, candidates, be.scratch.ids, ring, params, be.scratch.step])
    dispatches = [pl.Dispatch(f"argmax#{stage}", k.pipeline("argmax", shape={"ARGMAX_STAGE": stage}), group, grid)
                  for stage, grid in ((1, (n_groups, 1, 1)), (2, (1, 1, 1)))]
    staging = [k.readback(batch * 4, f"greedy_readback#{i}") for i in range(2)]
    return ArgmaxOps(dispatches, ring, staging, batch)


@dataclass
class BatchArgmax:
    """argmax.wgsl over every logits row of a decode batch: each row's id (with NON_FINITE where a
    logit was not finite) in `ids` and in the token ids buffer (the next step's input; a sampled
    row's draw writes its own there after it), copied to one of two `staging` buffers for the host
    (alternate steps: a step queued behind another writes the other one while the host reads).
    `inputs` keeps the next step's input ids apart from the ids buffer, which a forward of another
    slot may overwrite before that step runs, and which its own argmax overwrites before its
    reductions read their pending tokens."""

    dispatches: dict  # rows: the two dispatches
    ids: object
    staging: list
    inputs: object


def build_batch_argmax(be) -> BatchArgmax:
    """argmax.wgsl over logits rows 0.. of a decode batch (the step uniform's n_past is 0 there, so row
    r's id goes to ids[r]); made once at load, dispatches per batch size."""
    k = be.pipes
    vocab, rows = be.config.vocab_size, be.scratch.logit_rows
    n_groups = pl.ceil_div(vocab, ARGMAX_PER_GROUP)
    ids = k.storage(rows * 4, "batch_argmax_ids")
    params = k.uniform(pl.pack_params("argmax", n=vocab, n_groups=n_groups, ring_len=rows), "batch_argmax")
    candidates = k.storage(rows * n_groups * 16, "batch_argmax_candidates")
    group = k.bind("argmax", [(be.scratch.logits, 0, rows * vocab * 4), candidates, be.scratch.ids, ids, params,
                              be.scratch.step])
    stages = [k.pipeline("argmax", shape={"ARGMAX_STAGE": stage}) for stage in (1, 2)]
    dispatches = {n: [pl.Dispatch("argmax#1", stages[0], group, (n_groups, n, 1)),
                      pl.Dispatch("argmax#2", stages[1], group, (1, n, 1))] for n in range(1, rows + 1)}
    return BatchArgmax(dispatches, ids, [k.readback(rows * 4, f"batch_argmax_readback#{i}") for i in range(2)],
                       k.storage(rows * 4, "batch_inputs"))


def batch_bounds(total: int, batch: int) -> list[tuple[int, int]]:
    """Token steps [lo, hi) read back together: the first token alone, then `batch` at a time."""
    bounds = [(0, min(1, total))] if total else []
    lo = 1
    while lo < total:
        bounds.append((lo, min(total, lo + batch)))
        lo += batch
    return bounds


def chain(be, token: int, max_new_tokens: int, eos: Sequence[int] = (), timestamps=None,
          cancel: Callable[[], bool] | None = None) -> Iterator[tuple[list[int], str | None]]:
    """Greedy tokens after `token`, fed at position be.n_past: yields (ids, None) per batch and ends
    with (ids, "stop") at an `eos` id (not included) or (ids, "length") at max_new_tokens or the
    full context; once `cancel()` is True it submits nothing more and ends (at most CANCEL_AHEAD
    tokens submitted before still run). n_past ends after the last token run whose output was kept.
    `timestamps` (a callable giving each token's pass its timestamp_writes) times the tokens on the
    GPU (bench)."""
    first = be.n_past
    total = max(0, min(max_new_tokens, be.n_ctx - first))
    if total == 0:
        yield [], "length"
        return
    ops: ArgmaxOps = be.argmax
    stops = {int(t) for t in eos}
    bounds = batch_bounds(total, ops.batch)
    queue = be.ctx.device.queue
    be.drop_prerecorded()
    queue.write_buffer(be.scratch.ids, 0, np.array([token], np.uint32))
    be.write_head_step(1, 0)
    in_flight: deque[tuple[int, int | None]] = deque()  # (batch, its last token's submission) not read
    unfinished: deque[int | None] = deque()  # with a cancel hook: submission indices not waited for
    lag = min(READ_LAG, ops.batch)     # at most two batches unread: two read-back buffers
    kept, b = 0, 0
    try:
        commands = _record(be, ops, first, bounds, 0, timestamps)
        for step in range(total):
            if cancel is not None:
                if len(unfinished) == CANCEL_AHEAD:
                    pl.wait_done(be.ctx.device, unfinished.popleft())
                if cancel():
                    return
            be.n_past = first + step
            be.write_step(1)
            index = pl.submit(queue, [commands])
            if cancel is not None:
                unfinished.append(index)
            if step + 1 < total:
                be.n_past = first + step + 1
                commands = _record(be, ops, first, bounds, step + 1, timestamps)
            if step == bounds[b][1] - 1:
                in_flight.append((b, index))
                b += 1
            # wait for a batch only once `lag` more tokens are queued behind it: the GPU stays busy
            while in_flight and (step - (bounds[in_flight[0][0]][1] - 1) >= lag or step == total - 1):
                done, done_index = in_flight.popleft()
                lo, hi = bounds[done]
                ids = _read(be, ops, done, hi - lo, done_index)
                damaged = next((i for i, t in enumerate(ids) if t & NON_FINITE), None)
                if damaged is not None:
                    kept = lo + damaged
                    if damaged:
                        yield ids[:damaged], None
                    raise NonFiniteError(f"the logits of generated token {lo + damaged + 1} (position "
                                         f"{first + lo + damaged}) are not finite: NaN or infinity, "
                                         f"expected numbers; the model's weights may be damaged")
                hit = next((i for i, t in enumerate(ids) if t in stops), None)
                if hit is not None:
                    kept = lo + hit + 1
                    yield ids[:hit], "stop"
                    return
                kept = hi
                yield ids, "length" if hi == total else None
    finally:
        be.n_past = first + kept


def _record(be, ops: ArgmaxOps, first: int, bounds: list[tuple[int, int]], step: int, timestamps=None):
    """The command buffer of token step `step` at be.n_past; the last step of a batch copies the
    batch's ids to its read-back buffer."""
    encoder = be.ctx.device.create_command_encoder()
    pl.record(encoder, be.token_dispatches(1) + ops.dispatches, timestamps() if timestamps else None)
    b = 0 if step == 0 else 1 + (step - 1) // ops.batch
    lo, hi = bounds[b]
    if step == hi - 1:
        encoder.copy_buffer_to_buffer(ops.ring, (first + lo) * 4, ops.staging[b % 2], 0, (hi - lo) * 4)
    return encoder.finish()


def _read(be, ops: ArgmaxOps, b: int, count: int, index: int | None) -> list[int]:
    """Batch b's ids once submission `index` (its last token) has run: the tokens queued behind it
    keep the GPU busy while the host reads."""
    return [int(t) for t in pl.read_after(be.ctx.device, ops.staging[b % 2], count * 4, np.uint32, index)]


def greedy_stream(be, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int] = (),
                  cancel: Callable[[], bool] | None = None, keep: int = 0) -> Iterator[tuple[list[int], str | None]]:
    """A new request: keep the cache's first `keep` positions (the prompt's first ids; 0: reset),
    prefill the rest of `prompt` but its last token (Backend.prefill, which asks `cancel`), then
    chain()."""
    if max_new_tokens < 0:
        raise ParameterError(f"max_new_tokens = {max_new_tokens}, expected >= 0")
    if not 0 <= keep < max(len(prompt), 1):
        raise ParameterError(f"keep = {keep} of a prompt of {len(prompt)} tokens, expected 0..{len(prompt) - 1} "
                             f"(the last prompt token always runs)")
    be.keep_prefix(keep)
    new = [int(t) for t in be.check_tokens(prompt[keep:])]
    if max_new_tokens == 0:
        yield [], "length"
        return
    if be.debug_raw:  # SHIMMY_DEBUG_RAW=1 logs every op of forward(): take the host's loop
        yield from _host_loop(be, new, max_new_tokens, eos)
        return
    if not be.prefill(new[:-1], cancel):
        return
    yield from chain(be, new[-1], max_new_tokens, eos, cancel=cancel)


def _host_loop(be, prompt: list[int], max_new_tokens: int, eos: Sequence[int]):
    """The same tokens one at a time through forward() and numpy's argmax."""
    token = int(np.argmax(be.forward(prompt)))
    for n in range(1, max_new_tokens + 1):
        if token in eos:
            yield [], "stop"
            return
        if n == max_new_tokens or be.n_past >= be.n_ctx:
            yield [token], "length"
            return
        yield [token], None
        token = int(np.argmax(be.forward([token])))
