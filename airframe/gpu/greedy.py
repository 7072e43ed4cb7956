"""Greedy decoding chained on the GPU: each token's argmax becomes the next token's input without
the host in between.

argmax.wgsl (two dispatches after the LM head) writes the chosen id into the token-ids buffer that
the next token's embedding reads, and into a ring of ids by position. The host submits command
buffers without waiting for them and records the next while the GPU runs. A command buffer carries
up to CHAIN_SLOTS consecutive tokens: each token of it runs on a slot, the model's ops built again
on step uniforms of their own (`chain_slots`), and every slot's position is written before the
submit (writes are ordered with the submits). Fewer, larger submissions leave the GPU fewer gaps:
on the H200 an empty submit and read-back costs ~0.5 ms, a chain of one token per submit ran at
1.63 ms/token against 1.19 ms of GPU work. The ids are copied out in batches: the
first batch is the first token alone (time to first token), then `batch` tokens each; a batch is
read back only once READ_LAG more tokens are queued behind it, so the GPU does not wait for the host
while it reads. Tokens computed past an end-of-generation token are dropped and n_past set back:
their K/V rows are overwritten later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np
import wgpu

from ..errors import ParameterError
from . import kernels as K
from .runtime_ops import GlobalOps, LayerOps, build_globals, build_layer

GREEDY_BATCH = 16     # ids read back together after the first token
CHAIN_SLOTS = 4       # tokens per command buffer (a divisor of GREEDY_BATCH)
READ_LAG = 4          # tokens queued behind a batch's last one before the host waits for that batch
ARGMAX_PER_GROUP = 2048  # logits per stage-1 workgroup of argmax.wgsl (WG * ITEMS there)


@dataclass
class ArgmaxOps:
    """The two argmax dispatches, the ring of chosen ids (one per position) and two read-back buffers."""

    dispatches: list[K.Dispatch]
    ring: object        # (n_ctx,) u32: the id chosen from position p's logits at p
    staging: list       # two MAP_READ buffers of `batch` ids, used by alternate batches
    batch: int
    candidates: object  # stage 1's (value, id) per workgroup
    params: object      # the argmax uniform


@dataclass
class ChainSlot:
    """One token's place in a chain command buffer: the model's ops bound to this slot's step uniforms."""

    layer_ops: list[LayerOps]
    globals_ops: GlobalOps
    argmax: list[K.Dispatch]
    step: object
    head_step: object


def build_argmax(be, batch: int = GREEDY_BATCH) -> ArgmaxOps:
    """argmax.wgsl over logits row 0, writing the ids buffer and the ring; made once at load."""
    k = be.kernels
    vocab = be.config.vocab_size
    n_groups = K.ceil_div(vocab, ARGMAX_PER_GROUP)
    candidates = k.storage(n_groups * 8, "argmax_candidates")
    ring = k.storage(be.n_ctx * 4, "greedy_ring")
    params = k.uniform(K.pack_params("argmax", n=vocab, n_groups=n_groups, ring_len=be.n_ctx), "argmax")
    staging = [be.ctx.device.create_buffer(label=f"greedy_readback#{i}", size=max(16, batch * 4),
                                           usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
               for i in range(2)]
    ops = ArgmaxOps([], ring, staging, batch, candidates, params)
    ops.dispatches = _argmax_dispatches(be, ops, be.scratch.step)
    return ops


def _argmax_dispatches(be, ops: ArgmaxOps, step) -> list[K.Dispatch]:
    """The two argmax dispatches, reading the position from `step`."""
    k = be.kernels
    vocab = be.config.vocab_size
    n_groups = K.ceil_div(vocab, ARGMAX_PER_GROUP)
    group = k.bind("argmax", [(be.scratch.logits, 0, vocab * 4), ops.candidates, be.scratch.ids, ops.ring,
                              ops.params, step])
    return [K.Dispatch(f"argmax#{stage}", k.pipeline("argmax", shape={"ARGMAX_STAGE": stage}), group, grid)
            for stage, grid in ((1, (n_groups, 1, 1)), (2, (1, 1, 1)))]


def chain_slots(be, n: int | None = None) -> list[ChainSlot]:
    """Slot 0 is the backend's own ops; slots 1.. are the same ops built again on step uniforms of
    their own (once, on first use), so that one command buffer can run n (CHAIN_SLOTS) consecutive
    tokens."""
    n = n or CHAIN_SLOTS
    if be.chain_slots is None or len(be.chain_slots) != n:
        base = be.scratch
        slots = [ChainSlot(be.layer_ops, be.globals_ops, be.argmax.dispatches, base.step, base.head_step)]
        try:
            for k in range(1, n):
                be.scratch = replace(base, step=be.kernels.uniform(K.pack_step(0, 1), f"step#{k}"),
                                     head_step=be.kernels.uniform(K.pack_step(0, 1), f"head_step#{k}"))
                layer_ops = [build_layer(be, i) for i in range(be.config.n_layers)]
                slots.append(ChainSlot(layer_ops, build_globals(be), _argmax_dispatches(be, be.argmax, be.scratch.step),
                                       be.scratch.step, be.scratch.head_step))
        finally:
            be.scratch = base
        be.chain_slots = slots
    return be.chain_slots


def token_groups(bounds: list[tuple[int, int]], slots: int) -> list[tuple[int, int]]:
    """Token steps [lo, hi) of each command buffer: at most `slots`, never across a read-back batch."""
    return [(lo, min(end, lo + slots)) for start, end in bounds for lo in range(start, end, slots)]


def batch_bounds(total: int, batch: int) -> list[tuple[int, int]]:
    """Token steps [lo, hi) read back together: the first token alone, then `batch` at a time."""
    bounds = [(0, min(1, total))] if total else []
    lo = 1
    while lo < total:
        bounds.append((lo, min(total, lo + batch)))
        lo += batch
    return bounds


def chain(be, token: int, max_new_tokens: int, eos: Sequence[int] = ()) -> Iterator[tuple[list[int], str | None]]:
    """Greedy tokens after `token`, fed at position be.n_past: yields (ids, None) per batch and ends
    with (ids, "stop") at an `eos` id (not included) or (ids, "length") at max_new_tokens or the
    full context. n_past ends after the last token run whose output was kept."""
    first = be.n_past
    total = max(0, min(max_new_tokens, be.n_ctx - first))
    if total == 0:
        yield [], "length"
        return
    ops: ArgmaxOps = be.argmax
    slots = chain_slots(be)
    stops = {int(t) for t in eos}
    bounds = batch_bounds(total, ops.batch)
    groups = token_groups(bounds, len(slots))
    queue = be.ctx.device.queue
    be._next_decode = None
    queue.write_buffer(be.scratch.ids, 0, np.array([token], np.uint32))
    for slot in slots:
        queue.write_buffer(slot.head_step, 0, K.pack_step(first, 1, 0))
    in_flight: deque[int] = deque()  # batches submitted, not read
    lag = min(READ_LAG, ops.batch)     # at most two batches unread: two read-back buffers
    kept, b = 0, 0
    try:
        commands = _record(be, slots, ops, first, bounds, groups[0])
        for g, (lo, hi) in enumerate(groups):
            _write_steps(be, slots, first, lo, hi)
            queue.submit([commands])
            if g + 1 < len(groups):
                commands = _record(be, slots, ops, first, bounds, groups[g + 1])
            step = hi - 1
            if step == bounds[b][1] - 1:
                in_flight.append(b)
                b += 1
            # wait for a batch only once `lag` more tokens are queued behind it: the GPU stays busy
            while in_flight and (step - (bounds[in_flight[0]][1] - 1) >= lag or step == total - 1):
                done = in_flight.popleft()
                lo_b, hi_b = bounds[done]
                ids = _read(ops, done, hi_b - lo_b)
                hit = next((i for i, t in enumerate(ids) if t in stops), None)
                if hit is not None:
                    kept = lo_b + hit + 1
                    yield ids[:hit], "stop"
                    return
                kept = hi_b
                yield ids, "length" if hi_b == total else None
    finally:
        be.n_past = first + kept


def _write_steps(be, slots: list[ChainSlot], first: int, lo: int, hi: int) -> None:
    """Each token of the group [lo, hi) at its position, in its slot's step uniform."""
    for slot, step in zip(slots, range(lo, hi)):
        be.n_past = first + step
        be.ctx.device.queue.write_buffer(slot.step, 0, K.pack_step(be.n_past, 1, 0, be.split_len(1)))


def _record(be, slots: list[ChainSlot], ops: ArgmaxOps, first: int, bounds: list[tuple[int, int]],
            group: tuple[int, int]):
    """The command buffer of token steps [lo, hi), one slot each; the last step of a read-back
    batch copies the batch's ids to its read-back buffer."""
    encoder = be.ctx.device.create_command_encoder()
    for slot, step in zip(slots, range(*group)):
        be.n_past = first + step
        n_splits = be._n_splits(1)
        work = slot.globals_ops.embed(1)
        for layer in slot.layer_ops:
            work += layer.dispatches(1, n_splits)
        K.record(encoder, work + slot.globals_ops.final_norm(1) + slot.globals_ops.lm_head(1) + slot.argmax)
        b = 0 if step == 0 else 1 + (step - 1) // ops.batch
        lo, hi = bounds[b]
        if step == hi - 1:
            encoder.copy_buffer_to_buffer(ops.ring, (first + lo) * 4, ops.staging[b % 2], 0, (hi - lo) * 4)
    return encoder.finish()


def _read(ops: ArgmaxOps, b: int, count: int) -> list[int]:
    staging = ops.staging[b % 2]
    staging.map_sync(wgpu.MapMode.READ, 0, count * 4)
    ids = np.frombuffer(staging.read_mapped(0, count * 4, copy=True), dtype=np.uint32)
    staging.unmap()
    return [int(t) for t in ids]


def greedy_stream(be, prompt: Sequence[int], max_new_tokens: int,
                  eos: Sequence[int] = ()) -> Iterator[tuple[list[int], str | None]]:
    """A new request: reset, prefill all of `prompt` but its last token (no logits), then chain()."""
    if max_new_tokens < 0:
        raise ParameterError(f"max_new_tokens = {max_new_tokens}, expected >= 0")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ParameterError("an empty prompt, expected at least one token")
    be.reset()
    be.check_tokens(prompt)
    if max_new_tokens == 0:
        yield [], "length"
        return
    if be.debug_raw:  # SHIMMY_DEBUG_RAW=1 logs every op of forward(): take the host's loop
        yield from _host_loop(be, prompt, max_new_tokens, eos)
        return
    if len(prompt) > 1:
        be.prefill(prompt[:-1])
    yield from chain(be, prompt[-1], max_new_tokens, eos)


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
