"""A sampled token's logits reduced on the GPU to a few candidates, so that the host reads back a
few KB instead of the whole vocabulary and samples from a few hundred values (candidates.wgsl).

After the LM head, four dispatches apply the request's penalties in place, histogram the logits
by their order key, find the key above which at least `want` tokens lie, and gather those tokens
(of a constrained request only those its grammar allows: Reduction.allowed);
a fifth (draw.wgsl) draws the token from them and makes it the next forward's input. The host's
sampler (airframe/sampling.py, Sampler.sample_reduced) recomputes every step in float64 from the
model's own logits of the candidates, so the token is the one the full logits would give, and
checks the drawn one against it (sampled.py); when the candidates cannot decide it, or a logit is
not finite, the backend reads the full logits (`restore` puts back the values the penalties
overwrote). In a decode batch every sampled row gets the five dispatches over its own logits row
(BatchCandidates), its draw writing the row's next input: the host samples each row from what comes
back, and a batch step queued behind this one runs the drawn tokens (the backend's ChainedStep).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..sampling import Candidates, Reduction, positions
from . import pipelines as pl

SHADER, DRAW = "candidates", "draw"
PEN_MAX = pl.shader_constant(f"{SHADER}.wgsl", "PEN_MAX")  # penalty table rows
CAP = pl.shader_constant(f"{SHADER}.wgsl", "CAP")          # candidates written at most
PER_GROUP = pl.shader_constant(f"{SHADER}.wgsl", "PER")    # logits per histogram/gather workgroup
BINS = pl.shader_constant(f"{SHADER}.wgsl", "BINS")
MAX_WANT = CAP // 4  # the threshold's bin holds more than `want` tokens: leave it room
HEADER = 32          # struct Out before `raw`: count, threshold, non_finite, max, log-sum-exp, drawn, decided, pad
OUT_BYTES = HEADER + 4 * PEN_MAX + 8 * CAP


@dataclass
class CandidateOps:
    """The five dispatches and their buffers, made once at load."""

    dispatches: list[pl.Dispatch]
    table: object    # (PEN_MAX, 4) u32 penalty table, written per token
    allowed: object  # (mask_words(vocab),) u32 bitset of the tokens a grammar allows, written per token
    params: object   # uniform Params, written per token
    draw: object     # draw.wgsl's uniform Params, written per token
    out: object      # struct Out
    staging: list    # two MAP_READ copies of `out`, for alternate tokens of a chain (none for a batch row)
    n_groups: int
    row: int         # the logits row it reduces


def build_candidates(be, row: int = 0, tokens=None, staging: bool = True) -> CandidateOps:
    """candidates.wgsl over logits row `row` of the LM head, then draw.wgsl, which writes the drawn
    token to row `row` of the token-ids buffer; `tokens` is where the pending token is read (by
    default the token-ids buffer), `staging` whether it has read-back buffers of its own."""
    k = be.pipes
    vocab = be.config.vocab_size
    n_groups = pl.ceil_div(vocab, PER_GROUP)
    table = k.storage(PEN_MAX * 16, "penalty_table")
    allowed = k.storage(mask_words(vocab) * 4, "allowed_tokens")
    hist = k.storage(BINS * 4, "candidate_histogram")  # zero; stage 3 clears it after reading
    part = k.storage(n_groups * 16, "candidate_partials")
    out = k.storage(OUT_BYTES, "candidates")
    params = k.uniform(_pack(vocab, n_groups, 0, 1, 1.0, 0.0, 0.0, 0, 0, row), "candidate_params")
    logits = (be.scratch.logits, 0, (row + 1) * vocab * 4)
    group = k.bind(SHADER, [logits, table, allowed, hist, part, out, params, tokens or be.scratch.ids])
    grids = {1: pl.ceil_div(PEN_MAX, 256), 2: n_groups, 3: 1, 4: n_groups}
    dispatches = [pl.Dispatch(f"candidates#{stage}", k.pipeline(SHADER, shape={"CANDIDATES_STAGE": stage}),
                              group, (grid, 1, 1)) for stage, grid in grids.items()]
    draw_params = k.uniform(pl.pack_params(DRAW, top_k=0, top_p=1.0, min_p=0.0, temperature=0.0, u=0.0, row=row),
                            "draw_params")
    dispatches.append(pl.Dispatch(DRAW, k.pipeline(DRAW), k.bind(DRAW, [out, be.scratch.ids, draw_params]), (1, 1, 1)))
    readback = [k.readback(OUT_BYTES, f"candidates_readback#{i}") for i in range(2)] if staging else []
    return CandidateOps(dispatches, table, allowed, params, draw_params, out, readback, n_groups, row)


@dataclass
class BatchCandidates:
    """candidates.wgsl and draw.wgsl over each logits row of a decode batch, every row's `out`
    copied to its place in one of two read-back buffers (alternate steps, as the batch argmax's)."""

    rows: list[CandidateOps]
    staging: list  # two of (rows, OUT_BYTES)


def build_batch_candidates(be, rows: int) -> BatchCandidates:
    """Reductions of logits rows 0..rows-1 of a decode batch; a row's pending token is its input,
    which the batch argmax keeps apart (BatchArgmax.inputs): the ids buffer holds the next step's."""
    return BatchCandidates([build_candidates(be, r, be.batch_argmax.inputs, staging=False) for r in range(rows)],
                           [be.pipes.readback(rows * OUT_BYTES, f"batch_candidates_readback#{i}") for i in range(2)])


def mask_words(vocab: int) -> int:
    """u32 words of the allowed-token bitset over `vocab` logits."""
    return pl.ceil_div(vocab, 32)


def _pack(n: int, n_groups: int, n_pen: int, want: int, repeat: float, presence: float, frequency: float,
          pending: int, masked: int, row: int) -> bytes:
    return pl.pack_params(SHADER, n=n, n_groups=n_groups, n_pen=n_pen, want=want, repeat_penalty=repeat,
                          presence=presence, frequency=frequency, pending=pending, masked=masked, first=row * n)


def write_request(be, ops: CandidateOps, reduction: Reduction) -> None:
    """This token's penalty table, allowed tokens and parameters, ahead of its submit."""
    queue = be.ctx.device.queue
    n_pen = len(reduction.table)
    if n_pen:
        pl.write(queue, ops.table, np.ascontiguousarray(reduction.table))
    masked = reduction.allowed is not None
    if masked:
        pl.write(queue, ops.allowed, np.ascontiguousarray(reduction.allowed))
    pl.write(queue, ops.params, _pack(be.config.vocab_size, ops.n_groups, n_pen, reduction.want,
                                      reduction.repeat_penalty, reduction.presence, reduction.frequency,
                                      int(reduction.pending), int(masked), ops.row))
    pl.write(queue, ops.draw, pl.pack_params(DRAW, top_k=reduction.top_k, top_p=reduction.top_p, min_p=reduction.min_p,
                                             temperature=reduction.temperature, u=reduction.u, row=ops.row))


def record(be, ops: CandidateOps, slot: int = 0, forward: list[pl.Dispatch] = ()):
    """The command buffer of one reduction after the `forward` dispatches, then `out` copied to
    read-back buffer `slot` for the host."""
    encoder = be.ctx.device.create_command_encoder()
    pl.record(encoder, list(forward) + ops.dispatches)
    encoder.copy_buffer_to_buffer(ops.out, 0, ops.staging[slot], 0, OUT_BYTES)
    return encoder.finish()


@dataclass
class Found:
    """What the GPU wrote for one token, as read back."""

    candidates: Candidates | None  # None: too many for CAP, none allowed, or a logit was not finite
    raw: np.ndarray                # float32: the logits the penalties overwrote, by entry of `penalised`
    penalised: np.ndarray          # int64, ascending: the tokens whose logits the penalties rewrote
    drawn: int | None              # the token draw.wgsl picked; None: it could not


def read(be, ops: CandidateOps, reduction: Reduction, slot: int = 0, pending: int | None = None,
         index: int | None = None) -> Found:
    """Read-back buffer `slot` once the GPU has written it (submission `index`, pl.submit);
    `pending` is the token the GPU added to the penalties itself (reduction.pending), now known."""
    return parse(pl.read_after(be.ctx.device, ops.staging[slot], OUT_BYTES, np.uint8, index), reduction, pending)


def parse(data: np.ndarray, reduction: Reduction, pending: int | None = None) -> Found:
    """What candidates.wgsl wrote to one `out` (OUT_BYTES bytes) for `reduction`."""
    count, cut, non_finite, _, log_sum_exp, drawn, decided = struct.unpack_from("<4If2I", data, 0)
    n_pen = len(reduction.table)
    penalised = reduction.table[:, 0].astype(np.int64)
    raw = np.frombuffer(data, np.float32, n_pen + 1, HEADER)
    at = int(penalised.searchsorted(pending)) if reduction.pending else 0
    if reduction.pending and (at == n_pen or penalised[at] != pending):  # it had entry n_pen
        penalised = np.concatenate((penalised[:at], [pending], penalised[at:]))
        raw = np.concatenate((raw[:at], raw[n_pen:], raw[at:n_pen]))
    else:
        raw = raw[:n_pen].copy()
    if non_finite or count > CAP or count == 0:  # none: a mask allowed nothing, the host path reports it
        return Found(None, raw, penalised, None)
    pairs = np.frombuffer(data, np.uint32, 2 * count, HEADER + 4 * PEN_MAX).reshape(count, 2)
    pairs = pairs[pairs[:, 0].argsort(kind="stable")]
    ids = pairs[:, 0].astype(np.int64)
    logits = pairs[:, 1].view(np.float32)
    if penalised.size:  # the model's own logits where the penalties rewrote them
        at, hit = positions(ids, penalised)
        logits[hit] = raw[at]
    return Found(Candidates(ids, logits, key_floor(cut), log_sum_exp), raw, penalised,
                 int(drawn) if decided else None)


def key_floor(key: int) -> float:
    """The smallest float whose order key (order_key.wgsl) is at least `key`."""
    if key == 0:
        return -np.inf
    bits = key & 0x7FFFFFFF if key & 0x80000000 else ~key & 0xFFFFFFFF
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def restore(logits: np.ndarray, found: Found) -> np.ndarray:
    """Full logits read after a reduction, with the penalised tokens' own values put back."""
    if found.penalised.size:
        logits = logits.copy()
        logits[found.penalised] = found.raw
    return logits
