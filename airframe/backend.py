"""What every backend (reference, webgpu, cuda) offers the engine.

A backend holds one model and one K/V cache. `forward` runs tokens at consecutive positions,
appending their K/V to the cache, and returns logits; `reset` empties the cache between requests.
A backend whose cache positions stay valid from one request to the next says so with
`keeps_prompt_cache`: the engine then keeps a shared prompt prefix with `keep_prefix(n)` instead of
`reset` (airframe/prompt_cache.py). Such a backend may hold `n_slots` K/V caches, all allocated at
load: `select_slot(i)` makes cache i the one forward, reset and keep_prefix use (n_past is per slot).
A backend that can also pick greedy tokens on the device says so with `greedy_on_device` and
overrides `greedy_stream`; one that reduces a sampled token's logits to candidates on the device
says so with `reduces_on_device` and overrides `forward_pending`, `read_candidates` and `last_logits`;
one that chains sampled tokens on the device overrides `sample_stream`, keeping to the tokens the
host's sampler gives from the full logits. The engine asks those flags, it never probes for methods.

Cancellation, the hook's contract: `cancel` is a callable without arguments, cheap to call from
the thread that runs the backend, that turns True once the request's client has left and stays
True. The engine asks it before every token it takes and hands it to the backend:
- `prefill(tokens, cancel)` is the one prompt loop: chunks of `prefill_chunk` tokens, cancel asked
  before each and after the last; with a cancel hook a chunk has finished running before the next
  question, so at most one chunk runs after the client left.
- `greedy_stream(..., cancel=cancel)` is called so only where `greedy_cancel` is True; such a
  backend asks it before each prefill chunk and before each token (or launch) it queues on the
  device, with at most two tokens queued and unfinished (so at most two run after the client
  left), and simply ends its batches (the last one may carry reason None). Elsewhere the engine
  asks it between batches only.
- `sample_stream` is not given it: the engine asks before taking each token, so a backend that
  chains sampled tokens keeps at most one token queued ahead of the one it yields.
A backend never raises because of it; the engine reports the finish as "cancelled".
"""

from __future__ import annotations

from typing import Callable, Generator, Iterator, Sequence

import dataclasses
import os
import resource

import numpy as np

from .errors import ContextOverflowError, NonFiniteError, ParameterError, UnsupportedError
from .family import ModelConfig
from .model import Model
from .options import RunOptions
from .sampling import Candidates, History, Reduction, Sampler
from .rope_scaling import MAX_POSITIONS

BACKENDS = ("webgpu", "reference", "cuda")
DEFAULT_BACKEND = "webgpu"
DEFAULT_CTX = 4096  # K/V positions when no context is asked for (or the trained context, if shorter)
KV_BYTES = 4  # the K/V caches of the reference and WebGPU backends are F32
DEFAULT_SLOTS = 2  # K/V caches when none are asked for: two conversations kept warm, fewer where memory is short
ACTIVATIONS = "prefill activations"  # the part of memory_needed that does not grow with the context

GreedyBatches = Generator[tuple[list[int], str | None], None, None]  # (ids, finish reason or None)


class Backend:
    """The base every backend derives from: what it must implement raises NotImplementedError here,
    and on-device greedy decoding is off unless a backend turns it on."""

    name: str
    config: ModelConfig
    n_ctx: int  # capacity of the K/V cache in positions
    n_past: int  # positions already in the cache
    greedy_on_device = False  # True: greedy_stream picks tokens on the device
    # False where greedy_stream hands every token over at the end, the prompt run in the same
    # launches (CUDA): the time to the first token is unknown and the engine reports it as 0.
    greedy_first_token_timed = True
    greedy_cancel = False  # True: greedy_stream takes cancel= and asks it before each device step
    prefill_chunk = 512  # prompt tokens per pass of prefill(), and per cancel check (RunOptions.prefill_chunk)
    keeps_prompt_cache = False  # True: positions below n_past stay valid across requests (keep_prefix)
    n_slots = 1  # K/V caches held; more only where keeps_prompt_cache is set
    slot = 0  # the one forward, reset and keep_prefix use

    @classmethod
    def load(cls, model: Model, options: RunOptions) -> "Backend":
        """The backend holding `model`, with the options that concern it (airframe/options.py)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every position: the next forward starts at position 0."""
        raise NotImplementedError

    def keep_prefix(self, n: int) -> None:
        """Keep positions 0..n-1 of the cache and forget the rest: the next forward runs at n.
        keep_prefix(0) is reset(); more only where keeps_prompt_cache is set."""
        if n == 0:
            self.reset()
            return
        if not self.keeps_prompt_cache:
            raise UnsupportedError(f"the {self.name} backend does not keep its cache across requests; "
                                   f"expected keep_prefix(0)")
        if not 0 < n <= self.n_past:
            raise ParameterError(f"keep_prefix({n}) with {self.n_past} positions in the cache, "
                                 f"expected 0..{self.n_past}")
        self.n_past = n

    def select_slot(self, i: int) -> None:
        """Make K/V cache i the one forward, reset and keep_prefix use; n_past becomes its own."""
        if not 0 <= i < self.n_slots:
            raise ParameterError(f"slot {i}, expected 0..{self.n_slots - 1} (the {self.name} backend holds "
                                 f"{self.n_slots} K/V caches)")
        if i != self.slot:
            self.slot_past[self.slot] = self.n_past
            self._switch_slot(i)
            self.slot, self.n_past = i, self.slot_past[i]

    def kv_memory(self) -> int | None:
        """Bytes of the K/V caches of every slot, where the backend allocates them itself."""
        return None

    def _switch_slot(self, i: int) -> None:
        """select_slot's work for a backend with n_slots > 1 (which keeps each slot's n_past in
        slot_past): its cache i becomes the current one."""
        raise NotImplementedError

    def decode_batch(self, entries: Sequence[tuple[int, int]]) -> np.ndarray:
        """One decode step of several slots: for each (slot, token), `token` at that slot's next
        position. Returns their logits (len(entries), vocab) in order and advances each slot's
        n_past; the selected slot stays selected. Here one forward per slot in turn; a backend may
        run them together (WebGPU: one forward that reads each weight once for all of them)."""
        entries = self.check_batch(entries)
        current = self.slot
        out = []
        for slot, token in entries:
            self.select_slot(slot)
            out.append(self.forward([token]))
        self.select_slot(current)
        return np.stack(out)

    def decode_batch_pick(self, entries: Sequence[tuple[int, int]], picks: Sequence[Pick]) -> list[Picked]:
        """decode_batch, and each row's next token chosen as its Pick says (the sampler is asked, not
        advanced: the caller accepts the token). Here every row's logits are read and sampled on the
        host; a backend may pick greedy ids and reduce sampled rows to candidates on the device and
        read only those (WebGPU), keeping to the tokens the host gives from the full logits."""
        picks = check_picks(entries, picks)
        logits = self.decode_batch(entries)
        return [pick_row(row, pick, self.slot_n_past(slot) - 1) for (slot, _), row, pick in zip(entries, logits, picks)]

    def slot_n_past(self, slot: int) -> int:
        """n_past of K/V cache `slot`, selected or not."""
        return self.n_past if slot == self.slot or self.n_slots == 1 else self.slot_past[slot]

    def check_batch(self, entries: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """decode_batch's entries as (slot, token) ints, or ParameterError / ContextOverflowError
        naming the first that cannot run: no entries, a slot outside 0..n_slots-1 or twice, a token
        outside the vocabulary, a slot whose cache is full. Saves the selected slot's n_past."""
        entries = [(int(slot), int(token)) for slot, token in entries]
        if not entries:
            raise ParameterError("a decode batch of no tokens, expected at least one (slot, token)")
        if self.n_slots > 1:
            self.slot_past[self.slot] = self.n_past
        seen = set()
        for slot, token in entries:
            if not 0 <= slot < self.n_slots:
                raise ParameterError(f"slot {slot} in a decode batch, expected 0..{self.n_slots - 1}")
            if slot in seen:
                raise ParameterError(f"slot {slot} twice in one decode batch, expected each slot at most once")
            seen.add(slot)
            past = self.slot_past[slot] if self.n_slots > 1 else self.n_past
            check_tokens([token], past, self.n_ctx, self.config.vocab_size)
        return entries

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions n_past.. and advance n_past.

        Returns float32 logits of the last position, shape (vocab,), or of every position,
        shape (len(tokens), vocab), when all_logits is set.
        """
        raise NotImplementedError

    reduces_on_device = False  # True: read_candidates reduces the logits to candidates on the device
    candidate_limits = (0, 0)  # (penalty table rows, candidates wanted) read_candidates takes at most

    def forward_pending(self, tokens: Sequence[int]) -> None:
        """forward() of `tokens` started on the device, its logits kept there: then read_candidates
        or last_logits (the host prepares the reduction while the device runs)."""
        raise UnsupportedError(f"the {self.name} backend does not reduce logits on the device")

    def read_candidates(self, reduction: Reduction) -> Candidates | None:
        """The last forward's logits reduced on the device as `reduction` asks (airframe/sampling.py);
        None when the result is unusable: then last_logits()."""
        raise UnsupportedError(f"the {self.name} backend does not reduce logits on the device")

    def last_logits(self) -> np.ndarray:
        """The full logits (vocab,) of the last position of the last forward_pending, the model's own."""
        raise UnsupportedError(f"the {self.name} backend does not reduce logits on the device")

    def sample_stream(self, sampler: Sampler, history: History, tokens: Sequence[int],
                      stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Tokens sampled after `tokens` (not yet run: the prompt's last chunk), each taken by the
        sampler (Sampler.accept: appended to `history`, its constraint advanced) before it is
        yielded, until the context is full or the caller stops: the tokens sampler.sample() gives
        from the full logits. Here one forward and one sample per token (sample_next); a backend
        may chain tokens on the device if it keeps to the same tokens, and stop after one of
        `stop_ids` (the caller stops there)."""
        tokens = list(tokens)
        while True:
            token, _ = sample_next(self, sampler, history, tokens)
            sampler.accept(history, token)
            yield token
            if self.n_past >= self.n_ctx:
                return  # the context is full: no room to run the last token
            tokens = [token]

    def prefill(self, tokens: Sequence[int], cancel: Callable[[], bool] | None = None,
                progress: Callable[[int], object] | None = None) -> bool:
        """Run a prompt's `tokens` into the cache in chunks of prefill_chunk, their logits unused,
        asking `cancel` before each chunk and after the last: False once it says stop (the chunks
        before ran), else True. `progress(n)` is told the size of each chunk run."""
        for first in range(0, len(tokens), self.prefill_chunk):
            if cancel is not None and cancel():
                return False
            chunk = tokens[first:first + self.prefill_chunk]
            self.prefill_part(chunk, wait=cancel is not None)
            if progress is not None:
                progress(len(chunk))
        return cancel is None or not cancel()

    def prefill_part(self, tokens: Sequence[int], wait: bool) -> None:
        """One chunk of prefill(); `wait`: return only once it has run (forward() always does)."""
        self.forward(tokens)

    def greedy_stream(self, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int] = (),
                      cancel: Callable[[], bool] | None = None, keep: int = 0) -> GreedyBatches:
        """Greedy tokens after `prompt` (which starts a new request), in batches as the device hands
        them over: (ids, None) ..., then (ids, reason), reason "stop" at an `eos` id (not included)
        or "length" at max_new_tokens or the full context. Only where greedy_on_device is set;
        `cancel` is passed only where greedy_cancel is set (the module docstring says how), `keep`
        (the first `keep` ids of `prompt` are already at positions 0.. of the cache: keep_prefix)
        only where keeps_prompt_cache is set and it is above 0."""
        raise UnsupportedError(f"the {self.name} backend does not pick greedy tokens on the device; "
                               f"expected a backend with greedy_on_device set")

    def generate_greedy(self, prompt: Sequence[int], max_new_tokens: int,
                        eos: Sequence[int] = ()) -> tuple[list[int], str]:
        """greedy_stream's batches joined: all the tokens and the finish reason."""
        out, reason = [], "length"
        for ids, finish in self.greedy_stream(prompt, max_new_tokens, eos):
            out += ids
            reason = finish or reason
        return out, reason


def check_tokens(tokens: Sequence[int], n_past: int, n_ctx: int, vocab_size: int) -> np.ndarray:
    """`tokens` as an int64 array when they can run at positions n_past..: ParameterError for no ids
    or ids outside the vocabulary, ContextOverflowError when they do not fit in the context."""
    try:
        ids = np.asarray(tokens)
    except ValueError:  # ragged nesting
        raise ParameterError("token ids of uneven nesting, expected a non-empty 1-D sequence") from None
    if ids.ndim != 1 or ids.size == 0:
        raise ParameterError(f"token ids of shape {ids.shape}, expected a non-empty 1-D sequence")
    if ids.dtype.kind not in "iu":
        raise ParameterError(f"token ids of type {ids.dtype}, expected integers")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise ParameterError(f"token id {int(outside[0])} is outside the vocabulary 0..{vocab_size - 1}")
    end = n_past + ids.size
    if end > n_ctx:
        raise ContextOverflowError(f"{n_past} cached + {ids.size} new positions = {end} do not fit "
                                   f"in the context of {n_ctx} tokens")
    return ids.astype(np.int64)


def check_finite(logits: np.ndarray, position: int, step: str = "") -> None:
    """NonFiniteError naming the position of the first row of `logits` (one row, or one per position
    from `position` on) that holds NaN or inf; `step` adds what that position's logits were for."""
    finite = np.isfinite(logits)
    if finite.all():
        return
    row = int(np.flatnonzero(~np.atleast_2d(finite).all(axis=-1))[0])
    bad = np.atleast_2d(logits)[row]
    n_nan = int(np.isnan(bad).sum())
    n_inf = bad.size - n_nan - int(np.isfinite(bad).sum())
    raise NonFiniteError(f"the logits at position {position + row}{step} hold {n_nan} NaN and {n_inf} infinite "
                         f"values of {bad.size}, expected finite values: the model's weights or an activation "
                         f"are damaged")


@dataclasses.dataclass
class Pick:
    """How decode_batch_pick chooses a row's token: `sampler` on `history`'s logits, or with
    `greedy` (a plain greedy request: engine.plain_greedy) the argmax of the raw logits, which the
    device may pick itself."""

    sampler: Sampler
    history: History
    greedy: bool = False
    with_logits: bool = False  # the row's logits come back too (logprobs)


@dataclasses.dataclass
class Picked:
    """A decode batch row's next token, or the error that stopped it (logits not finite)."""

    token: int | None
    logits: np.ndarray | None = None  # where Pick.with_logits asked for them
    error: Exception | None = None


def check_picks(entries: Sequence, picks: Sequence[Pick]) -> list[Pick]:
    """decode_batch_pick's picks as a list, one per entry, or ParameterError."""
    picks = list(picks)
    if len(picks) != len(entries):
        raise ParameterError(f"{len(picks)} picks for a decode batch of {len(entries)} tokens, expected one each")
    return picks


def pick_row(logits: np.ndarray, pick: Pick, position: int) -> Picked:
    """The token `pick` chooses from the full logits of the token run at `position`."""
    try:
        check_finite(logits, position, f" (for generated token {len(pick.history.generated) + 1})")
    except NonFiniteError as e:
        return Picked(None, error=e)
    token = int(np.argmax(logits)) if pick.greedy else pick.sampler.sample(pick.history, logits)
    return Picked(token, logits if pick.with_logits else None)


def default_context(config: ModelConfig, options: RunOptions) -> int:
    """The K/V positions a backend allocates: the asked-for context, else the trained one up to DEFAULT_CTX."""
    return options.n_ctx or min(config.ctx_train, DEFAULT_CTX)


def kv_bytes_per_position(config: ModelConfig) -> int:
    return config.n_layers * config.n_head_kv * (config.head_dim + config.head_dim_v) * KV_BYTES


def slot_count(name: str, config: ModelConfig, options: RunOptions) -> int:
    """The K/V caches a backend allocates: options.slots, or where that is None (airframe serve's
    default) DEFAULT_SLOTS where they fit in the memory available, else one; one for the CUDA
    backend and without the prompt cache."""
    if options.slots is not None:
        return options.slots
    if name == "cuda" or not options.prompt_cache:
        return 1
    n_ctx = default_context(config, options)
    fits = sum(memory_needed(name, config, n_ctx, options, DEFAULT_SLOTS).values()) <= available_memory()
    return DEFAULT_SLOTS if fits else 1


def memory_needed(name: str, config: ModelConfig, n_ctx: int, options: RunOptions, slots: int = 1) -> dict[str, int]:
    """Bytes a backend allocates that grow with the context, the slots and the prefill chunk: the
    K/V caches (one per slot), WebGPU's RoPE tables (built in float64 on the host, one per RoPE
    base) and one prefill chunk's activations and logits. The weights, already mapped, are not counted."""
    parts = {"K/V cache": kv_cache_bytes(config, n_ctx, slots)}
    if name == "webgpu":
        bases = len({config.layer_rope_base(i) for i in range(config.n_layers)})
        parts["RoPE tables"] = bases * n_ctx * (config.rope_dim // 2) * 2 * 8
        chunk = min(options.prefill_chunk, n_ctx)
        width = 3 * config.n_embd + 2 * config.n_ff + config.n_q + 2 * config.n_kv + config.vocab_size
        parts[ACTIVATIONS] = chunk * width * 4
    return parts


def check_memory(name: str, config: ModelConfig, options: RunOptions) -> None:
    """ParameterError, before anything is allocated, when the context is beyond the positions a
    backend can index, when more slots are asked of the CUDA backend than its one, or when what
    the context and slots need is more than the memory available, stating both."""
    n_ctx = default_context(config, options)
    slots = slot_count(name, config, options)
    if n_ctx > MAX_POSITIONS:
        raise ParameterError(f"context = {n_ctx:,} positions, expected at most {MAX_POSITIONS:,} (int32 positions)")
    if name == "cuda":  # its plan sizes its buffers on the device, whose memory is not visible here
        if slots > 1:
            raise ParameterError(f"{slots} slots with the cuda backend, expected 1: it keeps one K/V cache "
                                 f"and no prompt cache")
        return
    parts = memory_needed(name, config, n_ctx, options, slots)
    needed, available = sum(parts.values()), available_memory()
    if needed > available:
        shown = " + ".join(f"{format_bytes(v)} {k}" for k, v in parts.items())
        asked = f"{slots} slots of {n_ctx:,} positions" if slots > 1 else f"a context of {n_ctx:,} positions"
        raise ParameterError(f"{asked} need{'s' if slots == 1 else ''} {format_bytes(needed)} ({needed:,} bytes: "
                             f"{shown}) but {format_bytes(available)} ({available:,} bytes) of memory are "
                             f"available; expected {_what_fits(name, config, options, n_ctx, slots, available)}")


def settle_slots(name: str, config: ModelConfig, options: RunOptions) -> RunOptions:
    """`options` with the slot count decided (slot_count), once it and the context fit in memory
    (check_memory): decided once, so the check and the allocation agree."""
    options = dataclasses.replace(options, slots=slot_count(name, config, options))
    check_memory(name, config, options)
    return options


def _what_fits(name: str, config: ModelConfig, options: RunOptions, n_ctx: int, slots: int, available: int) -> str:
    """The largest context (for these slots) or, with several slots, the most slots (for this
    context) that fit in `available` bytes, for check_memory's message."""
    one = memory_needed(name, config, 1, options)
    fixed = one.get(ACTIVATIONS, 0)
    per_position = sum(v for k, v in one.items() if k != ACTIVATIONS)
    per_slot_position = kv_bytes_per_position(config)
    shared = per_position - per_slot_position  # RoPE tables: once, whatever the slots
    most_ctx = max(0, (available - fixed) // (shared + slots * per_slot_position))
    if slots == 1:
        return f"a context of at most {most_ctx:,} positions"
    most_slots = max(0, (available - fixed - shared * n_ctx) // (per_slot_position * n_ctx))
    return f"at most {most_slots:,} slots of {n_ctx:,} positions, or a context of at most {most_ctx:,} positions"


def kv_cache_bytes(config: ModelConfig, n_ctx: int, slots: int) -> int:
    """The F32 K/V caches of the reference and WebGPU backends: one per slot, each of n_ctx positions."""
    return slots * n_ctx * kv_bytes_per_position(config)


def available_memory() -> int:
    """Bytes this process can still allocate: the system's available memory (MemAvailable), or
    less under an address-space limit (ulimit -v)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            used = 0
        available = min(available, max(0, limit - used))
    return available


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def open_backend(name: str, model: Model, options: RunOptions) -> Backend:
    """Load an opened model into the named backend, once the context fits in memory (and, with
    options.check_tensors, once every weight is finite)."""
    from .rope_scaling import warn_beyond_training

    if name not in BACKENDS:
        raise ParameterError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    options = settle_slots(name, model.config, options)
    if options.check_tensors:
        from .tensor_check import check_tensors

        check_tensors(model.gguf, options.progress)
    if name == "reference":
        from .reference import ReferenceBackend

        backend = ReferenceBackend.load(model, options)
    elif name == "webgpu":
        from .gpu.backend import WebGPUBackend

        backend = WebGPUBackend.load(model, options)
    else:
        if model.rope_override is not None:
            raise ParameterError("the cuda backend takes no rope scaling override; "
                                 "expected rope_scaling=None with --backend cuda")
        from .megakernel.cuda.backend import CudaBackend

        return CudaBackend.load(model, options)  # its context is fixed by its plan
    warn_beyond_training(backend.config, backend.n_ctx)
    return backend


def sample_next(backend: Backend, sampler: Sampler, history: History, tokens: list[int],
                with_logits: bool = False) -> tuple[int, np.ndarray | None]:
    """Run `tokens` and sample the next one: from the candidates a backend reduces the logits to on
    the device where it can and no logits are wanted (logprobs), else from the full logits.
    Returns (token, its logits or None)."""
    step = f" (for generated token {len(history.generated) + 1})"
    if not backend.reduces_on_device or with_logits:
        logits = backend.forward(tokens)
        check_finite(logits, backend.n_past - 1, step)
        return sampler.sample(history, logits), logits
    backend.forward_pending(tokens)  # the device runs while the host prepares the reduction
    reduction = sampler.reduction(history, *backend.candidate_limits)
    if reduction is not None:
        found = backend.read_candidates(reduction)
        token = sampler.sample_reduced(history, found) if found is not None else None
        if token is not None:
            return token, None
    logits = backend.last_logits()
    check_finite(logits, backend.n_past - 1, step)
    return sampler.sample(history, logits), logits
