"""The WebGPU backend: a GGUF model on any WebGPU adapter, weights quantized in GPU memory.

Load packs the weights (pack.py), builds every pipeline, bind group, scratch buffer and the F32
K/V cache once. A forward over T tokens records one compute pass: embedding, then per layer
  QKV matmul (RMSNorm fused) -> QK-norm + RoPE + K/V write -> attention
  (a decode token's attention does the RoPE and K/V write itself, split along the cache, the
  last split of each K/V head to finish combining them)
  -> output projection (+ residual, or post-norm + residual) -> gate/up (+ norm, activation)
  -> down projection (+ residual, or post-norm + residual),
then the final norm and the LM head (chunked by rows). T = 1 uses gemv.wgsl, longer chunks gemm.wgsl.
Prompts are prefilled in chunks of `prefill_chunk` tokens; decode reads back only the logits.
Sampled requests draw each token on the GPU from a few candidates, feed it to the next forward
there and read back only the candidates, which the host checks the token with (candidates.py,
sampled.py), constrained ones (greedy too) with the grammar's mask applied to the candidates;
greedy requests read back only the ids (greedy.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from ..backend import (Backend, Pick, Picked, check_picks, check_tokens, default_context, kv_cache_bytes,
                       pick_row, slot_count)
from ..errors import ParameterError, UnsupportedError
from ..family import ModelConfig
from ..gguf_file import GGUFFile
from ..model import Model
from ..options import RunOptions
from ..rope_scaling import cos_sin, freq_factors
from ..sampling import Candidates, History, Reduction, Sampler
from . import candidates as cand
from . import pipelines as pl
from .device import get_context
from .greedy import NON_FINITE, build_argmax, build_batch_argmax, greedy_stream
from .sampled import ChainCounts, sample_stream
from .pack import LayerPack, pack_rows, pack_tensors
from .layer import LayerOps, build_globals, build_layer

log = logging.getLogger("airframe.gpu")
MAX_SPLITS = 256         # attention splits of a decode token: attention_decode.wgsl's MAX_SPLITS
SPLIT_WORKGROUPS = 512   # splits x K/V heads that keep a large GPU busy
WAVE_WORKGROUPS = 2 * pl.WAVE  # attention workgroups a large GPU runs at once: two an SM
MIN_SPLIT_LEN = 64       # K/V positions per split at least
LOGITS_BYTES = 64 << 20  # logits scratch: how many positions' logits one read-back holds
ROW_ID, ROW_CANDIDATES, ROW_LOGITS = range(3)  # what a decode batch row reads back


def split_length(kv_total: int, n_head_kv: int) -> int:
    """K/V positions per attention split of a decode token over kv_total cached positions: enough
    splits to keep SPLIT_WORKGROUPS workgroups busy, each of at least MIN_SPLIT_LEN positions, in
    multiples of 64, at most MAX_SPLITS of them; but twice MIN_SPLIT_LEN where splits that short
    would take more than one wave of workgroups (WAVE_WORKGROUPS): a second wave cost more than
    splits twice as long (H100: a layer's attention at 4,096 positions 24.6 us with 32 splits of
    128 against 33.4 with 64 of 64, docs/DECISIONS.md)."""
    wanted = pl.ceil_div(SPLIT_WORKGROUPS, n_head_kv)
    per_split = max(pl.ceil_div(kv_total, wanted), pl.ceil_div(kv_total, MAX_SPLITS), MIN_SPLIT_LEN)
    length = pl.ceil_div(per_split, 64) * 64
    if length == MIN_SPLIT_LEN and pl.ceil_div(kv_total, length) * n_head_kv > WAVE_WORKGROUPS:
        length = 2 * MIN_SPLIT_LEN
    return length


@dataclass
class Scratch:
    """Activation buffers sized for one prefill chunk of `tokens` positions."""

    tokens: int
    ids: object       # (tokens,) u32
    x: object         # (tokens, n_embd) the residual stream
    tmp: object       # (tokens, max(n_embd, n_q)) normed x / pre-norm projection outputs
    qkv: object       # (tokens, n_q + 2 n_kv)
    attn: object      # (tokens, n_q)
    ffn: object       # (tokens, n_ff), then from float ffn_stored on a gemv's tokens' rounded copy of it
    part: object      # (rows, part_bytes): decode tokens' attention partials (attention_decode.wgsl's head_part)
    arrived: object   # (rows, n_head_kv) u32: splits of a decode token's K/V head done (attention_decode.wgsl)
    rows: object      # (rows,) DecodeRow (decode_rows.wgsl): each decode token's slot, position and splits
    split: object     # (2, tokens, rows): a chunk matmul's K-split partials
    logits: object    # (logit_rows, vocab)
    staging: object   # MAP_READ copy of logits
    step: object      # uniform Step of the layers
    head_step: object # uniform Step of the LM head: its own token count and first position
    part_bytes: int   # of one decode row
    logit_rows: int
    split_width: int  # floats per token of `split`: the most a split matrix needs (splits x rows, pipes.gemm_splits)
    ffn_stored: int   # first float of ffn's rounded copy (gemv.wgsl's MODE_ROUND_OUT: 8 floats per 16 values)


class WebGPUBackend(Backend):
    """Backend protocol (airframe/backend.py) on WebGPU."""

    name = "webgpu"
    greedy_on_device = True  # greedy.py: the argmax feeds the next token on the GPU
    # attention reads positions up to the query's only: what lies past n_past is never seen
    keeps_prompt_cache = True

    def __init__(self, ctx, gf: GGUFFile, config: ModelConfig, n_ctx: int, options: RunOptions, n_slots: int = 1):
        self.ctx = ctx
        self.gf = gf
        self.config = config
        self.n_ctx = n_ctx
        self.n_past = 0
        self.prefill_chunk = options.prefill_chunk
        max_binding = options.max_binding  # lowered by tests of chunked tensors
        self.pipes = pl.Pipelines(ctx, options.matmul, options.reduce)
        _check_config(gf, config)
        bar = tqdm(total=config.n_layers + 2, desc="loading to GPU", unit="part", disable=not options.progress,
                   leave=False)
        self.token_embd = pack_rows(ctx, gf, "token_embd.weight", max_binding)
        self.output = self.token_embd if config.tied_embeddings else pack_rows(ctx, gf, "output.weight", max_binding)
        self.globals = pack_tensors(ctx, gf, ["output_norm.weight"], "globals")
        self.rope_table, self.table_offsets = self._rope_table()
        self.attention_shapes = pl.attention_shapes(config.n_head, config.n_head_kv, config.head_dim,
                                                    int(ctx.limits["max-compute-workgroup-storage-size"]),
                                                    self.pipes.half)
        bar.update(1)
        self.n_slots = n_slots
        self.scratch = self._scratch()
        self._group_partials = []  # the K-split partials of later QKV groups (group_partials)
        self.layers: list[LayerPack] = []
        for i in range(config.n_layers):
            names = [f"blk.{i}.{t}" for t in config.layer_tensors]
            self.layers.append(pack_tensors(ctx, gf, names, f"blk.{i}"))
            bar.update(1)
        # one K/V cache per slot, and the layers' bind groups built once for each: select_slot
        # only changes which list the next forward records. A layer's caches share one buffer
        # (`kv_group`) as far as one binding holds them, so one dispatch serves a batch's slots.
        self.slot_bytes = pl.ceil_div(2 * config.n_head_kv * n_ctx * config.head_dim * 4, 256) * 256
        self.group_slots = max(1, min(n_slots, ctx.max_binding // self.slot_bytes))  # slots per K/V buffer
        groups = [[self.pipes.storage(min(self.group_slots, n_slots - first) * self.slot_bytes,
                                      f"slots{first}+.blk.{i}.kv") for i in range(config.n_layers)]
                  for first in range(0, n_slots, self.group_slots)]
        self.slot_kv: list[list] = []
        self.slot_ops: list[list[LayerOps]] = []
        for slot in range(n_slots):
            self.kv_group = groups[slot // self.group_slots]
            at = self.kv_offset(slot) * 16
            self.kv = [(buffer, at, self.slot_bytes) for buffer in self.kv_group]
            self.slot_kv.append(self.kv)
            layers: list[LayerOps] = []
            for i in range(config.n_layers):
                layers.append(build_layer(self, i, layers[-1].carry if layers else None))
            self.slot_ops.append(layers)
        self.slot_past = [0] * n_slots  # each slot's n_past while another is selected
        self.kv, self.layer_ops = self.slot_kv[0], self.slot_ops[0]
        self.globals_ops = build_globals(self)
        self.argmax = build_argmax(self)
        self.batch_argmax = build_batch_argmax(self)
        self.candidates = cand.build_candidates(self)
        self.batch_candidates = cand.build_batch_candidates(self, min(self.scratch.logit_rows, n_slots))
        self.reduces_on_device = not config.final_logit_softcap  # soft-capping runs on the host, at read-back
        self._reduced: cand.Found | None = None  # the last forward's, for last_logits
        self.chain_counts = ChainCounts()  # sampled tokens by how they were made (sampled.py)
        bar.update(1)
        bar.close()
        self.debug_raw = options.debug_raw
        # decode: the next token's command buffer, recorded while the GPU runs the current one,
        # keyed by (attention splits, whether the logits are copied for the host)
        self._next_decode: tuple[tuple[int, bool], object] | None = None
        self._next_reduce = None  # the next reduction's command buffer, recorded while a forward runs
        # a full prefill chunk's first command buffer (embedding, first layer), recorded while the
        # GPU runs the chunk before, keyed by slot: what a long prompt's first chunk would wait for
        self._next_lead: tuple[int, object] | None = None
        self._token_lists: dict = {}  # (slot, n_tokens, n_splits): token_dispatches
        self._batch_lists: dict = {}  # _batch_work's key: its dispatches
        self._next_batch: tuple[tuple, object] | None = None  # a batch step recorded ahead, by key
        self._chained: ChainedStep | None = None  # a batch step queued behind the last one
        self._staging = 0  # which of the two read-back buffers the last batch step wrote
        self.trace_chunks = options.trace_prefill_chunks

    @classmethod
    def load(cls, model: Model, options: RunOptions) -> "WebGPUBackend":
        return cls(get_context(), model.gguf, model.config, default_context(model.config, options), options,
                   slot_count("webgpu", model.config, options))

    # ---- buffers made once -------------------------------------------------------------------
    def _rope_table(self):
        """cos/sin of every (position, pair) for each RoPE base, computed in float64: (bases, n_ctx, half, 2).
        RoPE scaling (airframe/rope_scaling.py) is in the table: its frequencies and YaRN's mscale."""
        c = self.config
        first_layer = {}  # base -> a layer using it (its scaling is every such layer's)
        for i in range(c.n_layers):
            first_layer.setdefault(c.layer_rope_base(i), i)
        bases = sorted(first_layer)
        freq = freq_factors(self.gf, c.rope_scaling, self.n_ctx)
        half = c.rope_dim // 2
        tables, offsets = [], {}
        for index, base in enumerate(bases):
            scaling = c.layer_rope_scaling(first_layer[base])
            cos, sin = cos_sin(np.arange(self.n_ctx), c.rope_dim, base, scaling, freq)
            tables.append(np.stack([cos, sin], axis=-1).astype(np.float32))
            offsets[base] = index * self.n_ctx * half * 2
        data = np.ascontiguousarray(np.stack(tables))
        buffer = self.pipes.storage(data.nbytes, "rope_table")
        self.ctx.device.queue.write_buffer(buffer, 0, data)
        return buffer, offsets

    def _scratch(self) -> Scratch:
        c = self.config
        t = min(self.prefill_chunk, self.n_ctx)
        # each K/V head's partials in whole 128-byte lines (attention_decode.wgsl's head_part)
        part_bytes = MAX_SPLITS * c.n_head * (c.head_dim + 4) * 4 + c.n_head_kv * 128
        logit_rows = max(1, min(t, min(LOGITS_BYTES, self.ctx.max_binding) // (c.vocab_size * 4)))
        k = self.pipes
        wide = max(c.n_embd, c.n_q)
        split_width = max(k.gemm_splits(rows, cols, False) * rows for rows, cols in  # QKV, output, down
                          ((c.n_q + 2 * c.n_kv, c.n_embd), (c.n_embd, c.n_q), (c.n_embd, c.n_ff)))
        return Scratch(
            tokens=t,
            ids=k.storage(t * 4, "ids"),
            x=k.storage(t * c.n_embd * 4, "x"),
            tmp=k.storage(t * wide * 4, "tmp"),
            qkv=k.storage(t * (c.n_q + 2 * c.n_kv) * 4, "qkv"),
            attn=k.storage(t * c.n_q * 4, "attn"),
            ffn=k.storage((t * c.n_ff + k.gemv_tokens * c.n_ff // 2) * 4, "ffn"),
            part=k.storage(self.n_slots * part_bytes, "attention_partials"),
            arrived=k.storage(self.n_slots * c.n_head_kv * 4, "attention_arrivals"),
            rows=k.storage(self.n_slots * pl.ROW_BYTES, "decode_rows"),
            split=k.storage(t * split_width * 4, "k_split_partials"),
            logits=k.storage(logit_rows * c.vocab_size * 4, "logits"),
            staging=k.readback(logit_rows * c.vocab_size * 4, "logits_readback"),
            step=k.uniform(pl.pack_step(0, 1), "step"),
            head_step=k.uniform(pl.pack_step(0, 1), "head_step"),
            part_bytes=part_bytes,
            logit_rows=logit_rows,
            split_width=split_width,
            ffn_stored=t * c.n_ff,
        )

    # ---- Backend protocol -------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every position; the cache is cleared so stale K/V can never be read."""
        self._touch_slot()
        self.n_past = 0
        encoder = self.ctx.device.create_command_encoder()
        for buffer, offset, size in self.kv:
            encoder.clear_buffer(buffer, offset, size)
        self.ctx.device.queue.submit([encoder.finish()])

    def keep_prefix(self, n: int) -> None:
        """Backend.keep_prefix; the decode token recorded ahead was for another position."""
        super().keep_prefix(n)
        self.drop_prerecorded()

    def kv_memory(self) -> int:
        return kv_cache_bytes(self.config, self.n_ctx, self.n_slots)

    def _switch_slot(self, i: int) -> None:
        """The decode token recorded ahead was bound to the other slot's cache."""
        self.kv, self.layer_ops = self.slot_kv[i], self.slot_ops[i]
        self._next_decode = None

    def check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        """The ids as an array, or ParameterError / ContextOverflowError if they cannot run at n_past."""
        return check_tokens(tokens, self.n_past, self.n_ctx, self.token_embd.rows)

    def prefill_part(self, tokens: Sequence[int], wait: bool) -> None:
        """One chunk of Backend.prefill into the K/V cache, computing no logits; submitted and, only
        if `wait`, waited for (else the host records the next chunk while the GPU runs this one)."""
        self._traced_chunk(self.check_tokens(tokens), all_logits=False, last=False)
        if wait:
            pl.wait_done(self.ctx.device, None)

    greedy_cancel = True  # greedy_stream asks cancel before each prefill chunk and each token

    def greedy_stream(self, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int] = (),
                      cancel=None, keep: int = 0) -> Iterator[tuple[list[int], str | None]]:
        """Greedy tokens after `prompt` in batches as they are read back: (ids, None) ... then
        (ids, reason), its first `keep` ids kept in the cache. The argmax runs on the GPU and feeds
        the next token there (greedy.py)."""
        return greedy_stream(self, prompt, max_new_tokens, eos, cancel, keep)

    def sample_stream(self, sampler: Sampler, history: History, tokens: Sequence[int],
                      stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Backend.sample_stream with each token drawn on the GPU, fed to the next forward there and
        checked by the host one token behind (sampled.py)."""
        if not self.reduces_on_device or self.debug_raw:
            return super().sample_stream(sampler, history, tokens, stop_ids)
        return sample_stream(self, sampler, history, tokens)

    candidate_limits = (cand.PEN_MAX - 1, cand.MAX_WANT)  # an entry left for the pending token

    def forward_pending(self, tokens: Sequence[int]) -> None:
        """forward() of `tokens` up to the last position's logits, submitted and not read: the host
        prepares the reduction while the GPU runs; then read_candidates() or last_logits()."""
        self._run(tokens, False, read=False)
        if self._next_reduce is None:
            self._next_reduce = cand.record(self, self.candidates)  # while the GPU runs the forward

    def read_candidates(self, reduction: Reduction) -> Candidates | None:
        """The last position's logits reduced on the GPU (candidates.py); None when the candidates
        are unusable (too many, or a logit is not finite): then last_logits()."""
        ops = self.candidates
        cand.write_request(self, ops, reduction)
        commands = self._next_reduce or cand.record(self, ops)
        self._next_reduce = None
        self.ctx.device.queue.submit([commands])
        found = cand.read(self, ops, reduction)
        self._reduced = found
        return found.candidates

    def last_logits(self) -> np.ndarray:
        """The full logits of the last position of the last forward, the model's own values."""
        encoder = self.ctx.device.create_command_encoder()
        self._copy_logits(encoder, 1)
        self.ctx.device.queue.submit([encoder.finish()])
        logits = self._read_logits(1)[0]
        if self._reduced is not None:
            logits = cand.restore(logits, self._reduced)
        return logits

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self._run(tokens, all_logits, read=True)

    def _run(self, tokens: Sequence[int], all_logits: bool, read: bool):
        ids = self.check_tokens(tokens)
        outputs = []
        step = self.scratch.tokens
        self._reduced = None
        for first in range(0, ids.size, step):
            out = self._traced_chunk(ids[first:first + step], all_logits, first + step >= ids.size, read)
            if out is not None:
                outputs.append(out)
        if all_logits:
            return np.concatenate(outputs, axis=0)
        return outputs[-1][0] if read else None

    # ---- one chunk ----------------------------------------------------------------------------
    def _traced_chunk(self, ids: np.ndarray, all_logits: bool, last: bool, read: bool = True) -> np.ndarray | None:
        """_chunk, its positions and time logged with trace_prefill_chunks."""
        started = time.perf_counter()
        self._touch_slot()
        out = self._chunk(ids, all_logits, last, read)
        if self.trace_chunks:
            log.warning("prefill chunk %d..%d (%d tokens): %.1f ms", self.n_past - ids.size,
                        self.n_past, ids.size, 1000 * (time.perf_counter() - started))
        return out

    def group_partials(self, g: int):
        """The K-split partials buffer of a layer's QKV group g: scratch split for the first, one
        more of its size for each later group (made when a model has one)."""
        if g == 0:
            return self.scratch.split
        while len(self._group_partials) < g:
            label = f"k_split_partials_{len(self._group_partials) + 1}"
            self._group_partials.append(self.pipes.storage(self.scratch.split.size, label))
        return self._group_partials[g - 1]

    def kv_offset(self, slot: int) -> int:
        """First vec4 of slot's K/V cache in its layer's K/V buffer (kv_group)."""
        return (slot % self.group_slots) * self.slot_bytes // 16

    def split_len(self, n_tokens: int, n_past: int | None = None) -> int:
        """K/V positions per attention split of a decode token at n_past (the current slot's by
        default): split_length of its cache."""
        return split_length((self.n_past if n_past is None else n_past) + n_tokens, self.config.n_head_kv)

    def layer_dispatches(self, n_tokens: int) -> list[pl.Dispatch]:
        """Every dispatch of a forward over n_tokens positions starting at n_past, LM head excluded."""
        n_splits = self.n_splits(n_tokens)
        out = self.globals_ops.embed(n_tokens)
        for ops in self.layer_ops:
            out += ops.dispatches(n_tokens, n_splits)
        return out

    def token_dispatches(self, n_tokens: int = 1) -> list[pl.Dispatch]:
        """A forward over n_tokens positions from n_past and the LM head of its last position (the
        same list for the same attention splits: do not change it)."""
        key = (self.slot, n_tokens, self.n_splits(n_tokens))  # each slot binds its own K/V cache
        if key not in self._token_lists:  # a decode token's list is built once, not per token
            if len(self._token_lists) > 64:  # a chunk of each length adds one
                self._token_lists.clear()
            self._token_lists[key] = (self.layer_dispatches(n_tokens) + self.globals_ops.final_norm(n_tokens)
                                      + self.globals_ops.lm_head(1))
        return self._token_lists[key]

    def dispatch_count(self, n_tokens: int = 1) -> int:
        """Dispatches recorded for one forward of n_tokens at the current position (LM head included)."""
        return len(self.token_dispatches(n_tokens))

    def write_step(self, n_tokens: int) -> None:
        """The layers' Step uniform for n_tokens positions from n_past, and decode row 0: the
        current slot's token at n_past."""
        split_len = self.split_len(n_tokens)
        queue = self.ctx.device.queue
        pl.write(queue, self.scratch.step, pl.pack_step(self.n_past, n_tokens, 0, split_len))
        pl.write(queue, self.scratch.rows, pl.pack_rows([(self.kv_offset(self.slot), self.n_past, split_len, 0)]))

    def write_head_step(self, n_tokens: int, first: int) -> None:
        """The LM head runs n_tokens positions from position `first` of the chunk."""
        pl.write(self.ctx.device.queue, self.scratch.head_step, pl.pack_step(self.n_past, n_tokens, first))

    def n_splits(self, n_tokens: int) -> int:
        """Attention splits of a forward over n_tokens positions from n_past (a prefill chunk: one)."""
        if n_tokens > 1:
            return 1
        return pl.ceil_div(self.n_past + n_tokens, self.split_len(n_tokens))

    def drop_prerecorded(self) -> None:
        """Forget the decode token recorded ahead (its position is no longer the next one): the
        selected slot's cache is about to change."""
        self._next_decode = None
        self._touch_slot()

    def _touch_slot(self) -> None:
        """The selected slot's cache or position changes outside a batch step: a step chained for it
        computed what no longer follows, and is never taken."""
        if self._chained is not None and self.slot in self._chained.slots:
            self._chained = None

    def _record_decode(self, read: bool):
        """The command buffer of one decode token at n_past: the whole model, then (`read`) its
        logits copied for the host."""
        encoder = self.ctx.device.create_command_encoder()
        pl.record(encoder, self.token_dispatches(1))
        if read:
            self._copy_logits(encoder, 1)
        return encoder.finish()

    def _decode(self, token: int, read: bool):
        """One token: write its id and the step, submit (pre-recorded when possible), read the
        logits if asked; the next token's commands are recorded while the GPU runs."""
        queue = self.ctx.device.queue
        pl.write(queue, self.scratch.ids, np.array([token], np.uint32))
        self.write_step(1)
        self.write_head_step(1, 0)
        key = (self.n_splits(1), read)
        ready = self._next_decode
        commands = ready[1] if ready is not None and ready[0] == key else self._record_decode(read)
        self._next_decode = None
        queue.submit([commands])
        self.n_past += 1
        if self.n_past < self.n_ctx:
            self._next_decode = ((self.n_splits(1), read), self._record_decode(read))
        return self._read_logits(1) if read else None

    def decode_batch(self, entries: Sequence[tuple[int, int]]) -> np.ndarray:
        """Backend.decode_batch: the slots that share a K/V buffer (kv_group) run as one forward, each
        weights read by workgroups of up to GEMV_GROUP tokens (gemv.wgsl)."""
        return np.stack(self._decode_batch(entries, None))

    def decode_batch_pick(self, entries: Sequence[tuple[int, int]], picks: Sequence[Pick]) -> list[Picked]:
        """Backend.decode_batch_pick: after the forward argmax.wgsl picks every row's id and
        candidates.wgsl reduces each sampled row that its sampler can reduce; only the ids, those
        candidates and the logits of the rows that need them (logprobs, a sampler that cannot
        reduce, candidates that cannot decide, a logit that is not finite) are read back."""
        if not self.reduces_on_device:  # soft-capped logits: the host caps, then picks
            return super().decode_batch_pick(entries, picks)
        return self._decode_batch(entries, check_picks(entries, picks))

    def _decode_batch(self, entries, picks: list[Pick] | None) -> list:
        """decode_batch_pick's rows, or with `picks` None every row's logits."""
        entries = self.check_batch(entries)
        self._next_decode = None
        self.slot_past[self.slot] = self.n_past  # with one slot, check_batch leaves it behind
        out: list = [None] * len(entries)
        rows_at_once = min(self.scratch.tokens, self.scratch.logit_rows)
        by_group: dict[int, list[int]] = {}
        for r, (slot, _) in enumerate(entries):
            by_group.setdefault(slot // self.group_slots, []).append(r)
        one_step = len(by_group) == 1 and len(entries) <= rows_at_once
        for rows in by_group.values():
            for first in range(0, len(rows), rows_at_once):
                part = rows[first:first + rows_at_once]
                asked = None if picks is None else [picks[r] for r in part]
                for r, row in zip(part, self._batch_step([entries[r] for r in part], asked, chain=one_step)):
                    out[r] = row
        self.n_past = self.slot_past[self.slot]
        return out

    def _batch_step(self, entries: list[tuple[int, int]], picks: list[Pick] | None, chain: bool = False) -> list:
        """One forward of decode tokens of slots in one K/V buffer: per row its Picked, or with
        `picks` None its logits. The command buffer of the same slots' next step is recorded while
        the GPU runs this one, for rows that read back the same way. With `chain` (the whole batch
        is this one step) and every row's token decided on the GPU (_chains), the next step is
        queued before this one is read, its inputs the ids this step's argmax and draws wrote, so
        the GPU runs it while the host reads, checks and hands the tokens on; the next call takes
        it when its slots, positions and tokens are the ones it ran (ChainedStep), else it is left
        unread (its K/V rows lie past each slot's n_past and are written again)."""
        n = len(entries)
        queue = self.ctx.device.queue
        chained, self._chained = self._chained, None
        if chained is not None and chained.runs(entries, picks, self.slot_past):  # queued already
            kinds, reductions, index, staging = chained.kinds, chained.reductions, chained.index, chained.staging
        else:
            kinds, reductions = self._row_kinds(picks)
            self._write_requests(reductions)
            staging = 1 - self._staging
            key, work = self.batch_dispatches(entries)
            index = pl.submit(queue, [self._prerecorded((key, kinds, staging, False), work, n, kinds)])
        self._staging = staging
        for slot, _ in entries:
            self.slot_past[slot] += 1
        room = all(self.slot_past[slot] < self.n_ctx for slot, _ in entries)
        ahead = self._chains(picks, kinds) if room and chain else None
        if ahead is not None:
            self._write_requests(ahead)
            key, work = self.batch_dispatches(entries, ids=False)
            positions = tuple(self.slot_past[slot] for slot, _ in entries)
            commands = self._prerecorded((key, kinds, 1 - staging, True), work, n, kinds)
            self._chained = ChainedStep(tuple(slot for slot, _ in entries), positions, kinds,
                                        pl.submit(queue, [commands]), 1 - staging, ahead)
            if all(p + 1 < self.n_ctx for p in positions):  # the step after it, recorded while both run
                key, work = self._batch_work(entries)
                self._next_batch = ((key, kinds, staging, True), self._record_batch(work, n, kinds, staging, True))
        elif room:
            key, work = self._batch_work(entries)
            self._next_batch = ((key, kinds, 1 - staging, False), self._record_batch(work, n, kinds, 1 - staging))
        if kinds is None:
            return list(self._read_logits(n))
        picked, ran = self._pick_rows(entries, picks, kinds, reductions, staging, index)
        if self._chained is not None:
            self._chained.tokens = None if None in ran else ran  # what the step queued behind runs
        return picked

    def _write_requests(self, reductions: list[Reduction | None]) -> None:
        """Each sampled row's reduction, for the batch step submitted next."""
        for r, reduction in enumerate(reductions):
            if reduction is not None:
                cand.write_request(self, self.batch_candidates.rows[r], reduction)

    def _row_kinds(self, picks: list[Pick] | None) -> tuple[tuple[int, ...] | None, list[Reduction | None]]:
        """How each row of a batch step reads back (None: every row's logits), and each sampled
        row's reduction to candidates."""
        reductions: list[Reduction | None] = [None] * (len(picks) if picks else 0)
        if picks is None:
            return None, reductions
        kinds = []
        for r, pick in enumerate(picks):
            if pick.with_logits:
                kinds.append(ROW_LOGITS)
            elif pick.greedy:
                kinds.append(ROW_ID)
            elif (reduction := pick.sampler.reduction(pick.history, *self.candidate_limits)) is not None:
                reductions[r] = reduction
                kinds.append(ROW_CANDIDATES)
            else:
                kinds.append(ROW_LOGITS)
        return tuple(kinds), reductions

    def _chains(self, picks: list[Pick] | None, kinds) -> list[Reduction | None] | None:
        """The reductions of the step after this one when it can be queued before this one is read:
        every row greedy, or sampled with a top-k (or greedy with penalties), so that its candidates
        always decide its token, without a grammar (whose mask follows the token); each counts the
        token this step draws as pending and draws with the random number one ahead. None: no."""
        if kinds is None or ROW_LOGITS in kinds:
            return None
        ahead: list[Reduction | None] = []
        for pick, kind in zip(picks, kinds):
            reduction = None
            if kind == ROW_CANDIDATES:
                sampler = pick.sampler
                if sampler.constraint is not None or not sampler.candidates_decide:
                    return None
                reduction = sampler.reduction(pick.history, *self.candidate_limits, pending=True)
                if reduction is None:
                    return None
            ahead.append(reduction)
        return ahead

    def _prerecorded(self, key: tuple, work: list[pl.Dispatch], n: int, kinds: tuple[int, ...] | None):
        """The batch step's command buffer recorded ahead for `key`, or recorded now."""
        ready, self._next_batch = self._next_batch, None
        if ready is not None and ready[0] == key:
            return ready[1]
        return self._record_batch(work, n, kinds, key[2], key[3])

    def _pick_rows(self, entries, picks: list[Pick], kinds: tuple[int, ...], reductions: list, staging: int,
                   index: int | None) -> tuple[list[Picked], list[int | None]]:
        """Each row's Picked from what batch step `index` read back (into read-back buffers
        `staging`): its id, its candidates or its logits; the logits of the rows that need them
        after all are copied again (still on the GPU). Beside them the token each row's next input
        holds: its argmax or its draw (None: a damaged or undecided row, or one read from its logits)."""
        n = len(entries)
        raw = pl.read_after(self.ctx.device, self.batch_argmax.staging[staging], n * 4, np.uint32, index)
        bad = (raw & NON_FINITE) != 0
        ids = (raw & ~np.uint32(NON_FINITE)).astype(np.int64)
        ran: list[int | None] = [None if kinds[r] != ROW_ID or bad[r] else int(ids[r]) for r in range(n)]
        wanted = [r for r in range(n) if kinds[r] == ROW_LOGITS]
        logits = dict(zip(wanted, self._read_logits(len(wanted)))) if wanted else {}
        out: list[Picked | None] = [None] * n
        found: dict[int, cand.Found] = {}
        if ROW_CANDIDATES in kinds:
            data = pl.read_after(self.ctx.device, self.batch_candidates.staging[staging], n * cand.OUT_BYTES, np.uint8,
                                 index)
            for r in range(n):
                if kinds[r] == ROW_CANDIDATES:
                    history = picks[r].history
                    pending = history.tokens[-1] if reductions[r].pending else None  # the token the step ran
                    found[r] = cand.parse(data[r * cand.OUT_BYTES:(r + 1) * cand.OUT_BYTES], reductions[r], pending)
                    ran[r] = found[r].drawn
                    if found[r].candidates is not None:
                        token = picks[r].sampler.sample_reduced(history, found[r].candidates)
                        if token is not None:
                            out[r] = Picked(token)
        again = [r for r in range(n) if out[r] is None and r not in logits and (kinds[r] != ROW_ID or bad[r])]
        if again and self._chained is not None:
            # rows read from their logits after all, in a step with another queued behind it, which
            # has overwritten the logits by now: their step runs again (the same K/V), read this time
            self._chained = None
            for r in again:
                self.slot_past[entries[r][0]] -= 1
            logits.update(zip(again, self._batch_step([entries[r] for r in again], None)))
        elif again:  # rare: a row the candidates could not decide, or a damaged one
            encoder = self.ctx.device.create_command_encoder()
            self._copy_rows(encoder, again)
            self.ctx.device.queue.submit([encoder.finish()])
            for r, row in zip(again, self._read_logits(len(again))):
                logits[r] = cand.restore(row, found[r]) if r in found else row
        for r, (slot, _) in enumerate(entries):
            if out[r] is None:
                out[r] = Picked(int(ids[r])) if r not in logits else pick_row(logits[r], picks[r], self.slot_past[slot] - 1)
        return out, ran

    def _record_batch(self, work: list[pl.Dispatch], n: int, kinds: tuple[int, ...] | None, staging: int = 0,
                      chained: bool = False):
        """A batch step's command buffer: the forward, then every row's logits copied for the host
        (kinds None), or the batch argmax and the sampled rows' reductions and draws (their output
        to read-back buffers `staging`), the rows whose logits are read copied, each as its kind
        says, and the next inputs they wrote kept in BatchArgmax.inputs. `chained`: the step's
        inputs are those, copied first."""
        encoder = self.ctx.device.create_command_encoder()
        if chained:
            encoder.copy_buffer_to_buffer(self.batch_argmax.inputs, 0, self.scratch.ids, 0, n * 4)
        if kinds is None:
            pl.record(encoder, work)
            self._copy_logits(encoder, n)
            return encoder.finish()
        ops = self.batch_argmax
        reduced = [r for r in range(n) if kinds[r] == ROW_CANDIDATES]
        rows = self.batch_candidates.rows
        pl.record(encoder, work + ops.dispatches[n] + [d for r in reduced for d in rows[r].dispatches])
        encoder.copy_buffer_to_buffer(ops.ids, 0, ops.staging[staging], 0, n * 4)
        for r in reduced:
            encoder.copy_buffer_to_buffer(rows[r].out, 0, self.batch_candidates.staging[staging], r * cand.OUT_BYTES,
                                          cand.OUT_BYTES)
        self._copy_rows(encoder, [r for r in range(n) if kinds[r] == ROW_LOGITS])
        encoder.copy_buffer_to_buffer(self.scratch.ids, 0, ops.inputs, 0, n * 4)
        return encoder.finish()

    def _copy_rows(self, encoder, rows: list[int]) -> None:
        """Logits rows `rows` packed one after another into the read-back buffer."""
        size = self.config.vocab_size * 4
        for at, r in enumerate(rows):
            encoder.copy_buffer_to_buffer(self.scratch.logits, r * size, self.scratch.staging, at * size, size)

    def batch_dispatches(self, entries: list[tuple[int, int]], ids: bool = True) -> tuple[tuple, list[pl.Dispatch]]:
        """The uniforms of one forward of (slot, token) decode tokens written: slots of one K/V
        buffer, each token at its slot's position (which this does not advance); with `ids` False
        the tokens are left to the GPU (a chained step). Returns _batch_work's key and dispatches."""
        n, s, queue = len(entries), self.scratch, self.ctx.device.queue
        if ids:  # a forward of its own (a bench times these dispatches too): no chained step follows
            self._chained = None
            pl.write(queue, s.ids, np.array([token for _, token in entries], np.uint32))
        pl.write(queue, s.step, pl.pack_step(0, n))
        pl.write(queue, s.head_step, pl.pack_step(0, n, 0))
        rows = []
        for r, (slot, _) in enumerate(entries):
            past = self.slot_past[slot]
            rows.append((self.kv_offset(slot), past, self.split_len(1, past), r * s.part_bytes // 4))
        pl.write(queue, s.rows, pl.pack_rows(rows))
        return self._batch_work(entries)

    def _batch_work(self, entries: list[tuple[int, int]]) -> tuple[tuple, list[pl.Dispatch]]:
        """(key, dispatches) of a forward of these slots' decode tokens at their positions: what the
        dispatches depend on is the key (the buffer's slots, the tokens, the most attention splits)."""
        n_splits = max(pl.ceil_div(self.slot_past[slot] + 1, self.split_len(1, self.slot_past[slot]))
                       for slot, _ in entries)
        key = (entries[0][0] // self.group_slots, len(entries), n_splits)
        if key not in self._batch_lists:
            n = len(entries)
            # any slot of the buffer: its decode attention binds the whole buffer, each row finds its cache
            work = self.globals_ops.embed(n)
            for ops in self.slot_ops[entries[0][0]]:
                work += ops.dispatches(n, n_splits, decode=True)
            self._batch_lists[key] = work + self.globals_ops.final_norm(n) + self.globals_ops.lm_head(n)
        return key, self._batch_lists[key]

    def _chunk(self, ids: np.ndarray, all_logits: bool, last: bool, read: bool = True) -> np.ndarray | None:
        n = ids.size
        if n == 1 and last and not all_logits and not self.debug_raw:
            return self._decode(int(ids[0]), read)
        device = self.ctx.device
        pl.write(device.queue, self.scratch.ids, ids.astype(np.uint32))
        self.write_step(n)
        self.write_head_step(1, n - 1)
        head = last and not all_logits  # the LM head of the last position
        work = self.token_dispatches(n) if head else self.layer_dispatches(n)
        full = n == self.scratch.tokens and not self.debug_raw  # a shorter chunk leaves the lead recorded ahead
        if self.debug_raw:
            self._run_debug(work)  # submits each dispatch alone
            parts = [[]]
        else:
            # the embedding and the first layer go first, so the GPU runs them while the host records
            # the rest (recording a 16-layer chunk takes about a millisecond)
            lead = len(self.globals_ops.embed_ops) + len(self.layer_ops[0].dispatches(n, self.n_splits(n)))
            parts = [work[:lead], work[lead:]]
            if full and self._next_lead is not None and self._next_lead[0] == self.slot:
                pl.submit(device.queue, [self._next_lead[1]])
                parts = parts[1:]
        for i, part in enumerate(parts):
            encoder = device.create_command_encoder()
            if part:
                pl.record(encoder, part)
            if i == len(parts) - 1 and head and read:
                self._copy_logits(encoder, 1)
            index = pl.submit(device.queue, [encoder.finish()])
        if full:  # the next full chunk's lead, recorded while the GPU runs this one
            encoder = device.create_command_encoder()
            pl.record(encoder, work[:lead])
            self._next_lead = (self.slot, encoder.finish())
        if all_logits:
            logits = self._all_logits(n)
        elif head and read:
            logits = self._read_logits(1, index)
        else:
            logits = None
        self.n_past += n
        return logits

    def _all_logits(self, n: int) -> np.ndarray:
        """Final norm over the chunk, then the LM head in groups of logit_rows positions."""
        device = self.ctx.device
        out = np.empty((n, self.config.vocab_size), dtype=np.float32)
        encoder = device.create_command_encoder()
        pl.record(encoder, self.globals_ops.final_norm(n))
        device.queue.submit([encoder.finish()])
        rows = self.scratch.logit_rows
        for first in range(0, n, rows):
            count = min(rows, n - first)
            self.write_head_step(count, first)
            encoder = device.create_command_encoder()
            pl.record(encoder, self.globals_ops.lm_head(count))
            self._copy_logits(encoder, count)
            device.queue.submit([encoder.finish()])
            out[first:first + count] = self._read_logits(count)
        return out

    def _copy_logits(self, encoder, rows: int) -> None:
        """The logits of `rows` positions into the read-back buffer."""
        encoder.copy_buffer_to_buffer(self.scratch.logits, 0, self.scratch.staging, 0,
                                      rows * self.config.vocab_size * 4)

    def _read_logits(self, rows: int, index: int | None = None) -> np.ndarray:
        """The logits copied for the host (_copy_logits), once submission `index` (pl.submit) has run;
        with none, once everything submitted has."""
        data = pl.read_after(self.ctx.device, self.scratch.staging, rows * self.config.vocab_size * 4, np.float32,
                             index)
        cap = self.config.final_logit_softcap
        if cap:  # Gemma 2's final soft-capping, on the CPU: the logits are read back anyway
            data = (np.float32(cap) * np.tanh(data / np.float32(cap))).astype(np.float32)
        return data.reshape(rows, self.config.vocab_size)

    def _run_debug(self, dispatches: list[pl.Dispatch]) -> None:
        """SHIMMY_DEBUG_RAW=1: submit each dispatch alone and log statistics of what it wrote."""
        device = self.ctx.device
        for d in dispatches:
            encoder = device.create_command_encoder()
            pl.record(encoder, [d])
            device.queue.submit([encoder.finish()])
            if d.output is None:
                continue
            buffer, floats = d.output
            values = np.frombuffer(device.queue.read_buffer(buffer, 0, floats * 4), dtype=np.float32)
            finite = values[np.isfinite(values)]
            log.warning("%-28s min %+.4g max %+.4g mean %+.4g absmax %.4g nan %d",
                        d.label, finite.min(initial=0), finite.max(initial=0),
                        finite.mean() if finite.size else 0.0, np.abs(finite).max(initial=0),
                        int(np.isnan(values).sum()))


@dataclass
class ChainedStep:
    """A batch step queued behind the one before it, its inputs that step's argmax and draws: the
    slots, positions, read-back buffers and reductions it ran with, its submission, and (once the
    step before is read) the tokens it ran."""

    slots: tuple[int, ...]
    positions: tuple[int, ...]
    kinds: tuple[int, ...]
    index: int | None
    staging: int
    reductions: list[Reduction | None]  # its sampled rows' (pending: the token the step before drew)
    tokens: list[int] | None = None

    def runs(self, entries: list[tuple[int, int]], picks: list[Pick] | None, slot_past: list[int]) -> bool:
        """Whether this is the step `entries` and `picks` ask for: the same slots at the same
        positions, with the tokens the step before picked, each row read back as it was (greedy
        rows their id; the others their candidates, reduced with this step's own penalty table
        and random number, as the step before made them)."""
        return (self.tokens is not None and picks is not None
                and self.slots == tuple(slot for slot, _ in entries)
                and self.positions == tuple(slot_past[slot] for slot, _ in entries)
                and self.tokens == [token for _, token in entries]
                and all(not pick.with_logits and pick.greedy == (kind == ROW_ID) for pick, kind in zip(picks, self.kinds)))


def _check_config(gf: GGUFFile, c: ModelConfig) -> None:
    if c.head_dim_v != c.head_dim:
        raise UnsupportedError(f"{gf.path}: value head size {c.head_dim_v} differs from key head size "
                               f"{c.head_dim}; the WebGPU runtime expects them equal")
    if c.head_dim > 256 or c.head_dim % 4:
        raise UnsupportedError(f"{gf.path}: head_dim {c.head_dim}, expected a multiple of 4 up to 256")
    group = c.n_head // c.n_head_kv
    if group > 8:
        raise UnsupportedError(f"{gf.path}: {group} query heads per K/V head; the attention programs expect at most 8")
    if c.n_embd % 4 or c.n_ff % 4:
        raise UnsupportedError(f"{gf.path}: n_embd {c.n_embd} / n_ff {c.n_ff}, expected multiples of 4")
