"""From a prompt to streamed text: tokenize, prefill, then sample, stop and detokenize token by token.

The engine knows nothing of HTTP and nothing of shaders: it drives any Backend through
`keep_prefix()` at the start of every request, `prefill()` for the prompt but its last chunk, then
`sample_stream()` for the sampled tokens (one forward each, or chained on the device), or, for a
plain greedy request to a backend with `greedy_on_device`, `greedy_stream()`. Either way the tokens
go through the same loop below.

The prompt cache (airframe/prompt_cache.py): the engine remembers which ids the backend's cache
holds after each request (the prompt, then the generated tokens that ran). A backend with
`keeps_prompt_cache` keeps the longest prefix the next prompt shares with them and prefills only
the rest; otherwise, with the cache off (RunOptions.prompt_cache, GenerationParams.cache_prompt) or
after a request that failed, the request starts with `reset()`. A backend with several slots
(RunOptions.slots) keeps one conversation per slot: each request runs in the slot whose cached
ids share the longest prefix with its prompt, else in the least recently used one (PromptSlots).
The engine assumes it alone drives its backend between requests; code that runs `engine.backend`
itself calls `forget_prompt_cache()`.

    engine = Engine.load("smollm2-135m", backend="reference")
    for item in engine.stream([{"role": "user", "content": "Hi"}], GenerationParams(max_tokens=20)):
        print(item.text if isinstance(item, Piece) else item.reason)

Generation ends with "stop" (an end-of-generation token of the model, an extra stop token id, a
stop string, or the request's grammar complete), "length" (max_tokens, or the context is full) or
"cancelled" (cancel() said so; it is asked before every token and every prefill chunk). Every sampled token counts as a
completion token, the one that stopped generation included; neither an end-of-generation token
nor a stop string is ever shown.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Generator, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from .backend import DEFAULT_BACKEND, Backend, open_backend, sample_next
from .chat_template import ChatTemplate, normalize_messages
from .constraint import Constraint, Grammar, check_grammar
from .errors import ContextOverflowError, ParameterError, UnsupportedError
from .family import ModelConfig
from .model import Model, open_model
from .models import KNOWN_MODELS, models_dir
from .options import RunOptions
from .prompt_cache import PromptCache, PromptSlots
from .sampling import History, Sampler, SamplingParams, greedy_blockers, log_softmax, top_logprobs
from .streaming import TextAssembler
from .tokenizer import GGUFTokenizer, load_tokenizer


@dataclass
class GenerationParams:
    max_tokens: int | None = 256  # None: until the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)  # stop strings
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and the top-k alternatives
    cache_prompt: bool = True  # False: this request keeps nothing of the cache and prefills its whole prompt
    grammar: Grammar | None = None  # structured output: every answer keeps to it (airframe/constraint.py)


@dataclass
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    bytes: list[int]
    top: list[tuple[str, int, float]]  # (text, id, logprob), most likely first


@dataclass
class Piece:
    """One streamed piece of text: only whole UTF-8 characters; may cover several tokens or none."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int  # sampled tokens, the one that stopped generation included
    prefill_seconds: float  # from the request to the first sampled token (time to first token)
    decode_seconds: float  # the other completion_tokens - 1 tokens (llama.cpp's "eval time")
    cached_tokens: int = 0  # prompt tokens whose K/V were kept from the request before, not computed


# (token, its logits or None), one per token generated; the host path computes each when asked
_TokenSource = Generator[tuple[int, np.ndarray | None], None, None]
_UNNAMED_EOG = -1  # an end-of-generation token the device chose without saying which


class Engine:
    backend: Backend
    tokenizer: GGUFTokenizer
    config: ModelConfig
    model_id: str
    n_ctx: int

    def __init__(self, backend: Backend, tokenizer: GGUFTokenizer, template: ChatTemplate, model_id: str,
                 progress: bool = False, prompt_cache: bool = True):
        self.backend = backend
        self.tokenizer = tokenizer
        self.template = template
        self.config = backend.config
        self.model_id = model_id
        self.n_ctx = backend.n_ctx
        self.eog_ids = set(tokenizer.eog_ids)  # EOS and the template's end-of-turn tokens
        self.progress = progress  # a bar over the prefill of a prompt longer than one chunk
        self.prompt_cache = prompt_cache  # off: every request starts with reset(), as RunOptions.prompt_cache
        self.slots = PromptSlots(backend.n_slots)

    @classmethod
    def load(cls, model: str | Path | Model, backend: str = DEFAULT_BACKEND, options: RunOptions | None = None,
             rope_scaling: str | None = None, rope_scale: float | None = None,
             parts: tuple[GGUFTokenizer, ChatTemplate] | None = None) -> "Engine":
        """Open a model (a path or a known name, or a Model already opened) once and load it in the
        named backend, with its tokenizer and template read from the same parsed file (or `parts`,
        prompt_parts of that Model, already read).

        options default to RunOptions.from_env(); rope_scaling and rope_scale replace the RoPE
        scaling the file declares (open_model; an opened Model has its own already).
        """
        if isinstance(model, Model):
            if rope_scaling is not None or rope_scale is not None:
                raise ParameterError("rope_scaling and rope_scale with an opened Model, expected them "
                                     "given to open_model instead")
            opened = model
        else:
            opened = open_model(model, rope_scaling, rope_scale)
        try:
            tokenizer, template = parts or prompt_parts(opened)
            options = options or RunOptions.from_env()
            loaded = _open_backend(backend, opened, options)
        except BaseException:
            opened.gguf.close()  # a file refused halfway is not left mapped
            raise
        return cls(loaded, tokenizer, template, _model_id(model, opened), options.progress, options.prompt_cache)

    # ---- prompts --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def tokenize_prompt(self, prompt: str | list[dict], parse_special_in_content: bool = False,
                        add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        """A string is a raw completion prompt; a list is chat messages rendered by the template
        (with `tools`, OpenAI's function descriptions, where given).

        Special tokens written in a raw prompt (`<|im_start|>`) are parsed as such; in chat messages
        only the template's own markup gives them, and message content is plain text unless
        `parse_special_in_content` is set. The model's BOS is added unless the text starts with it.
        """
        if isinstance(prompt, list):
            if not parse_special_in_content:
                return self._tokenize_chat(prompt, add_generation_prompt, tools)
            prompt = self.render_chat(prompt, add_generation_prompt, tools)
        if not isinstance(prompt, str):
            raise ParameterError(f"prompt of type {type(prompt).__name__}, expected a string or a list of messages")
        return list(self.tokenizer.encode(prompt, add_special=not self._starts_with_bos(prompt), parse_special=True))

    def _tokenize_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        self._check_tool_text(messages, tools)
        parts = self.template.render_parts(messages, add_generation_prompt, tools)
        if parts is None:  # the template rewrites content: safe only if no content holds control token text
            text = self.render_chat(messages, add_generation_prompt, tools)
            for i, message in enumerate(normalize_messages(messages)):
                found = self.tokenizer.special_in(message["content"])
                if found:
                    raise ParameterError(
                        f"message {i}: content holds the control token text {found!r}, which {self.template.name} "
                        f"does not let airframe keep as plain text; expected content without control tokens "
                        f"(or parse_special_in_content to read them as control tokens)")
            return list(self.tokenizer.encode(text, add_special=not self._starts_with_bos(text), parse_special=True))
        text = "".join(t for t, _ in parts)
        return self.tokenizer.encode_parts([(t, not is_content) for t, is_content in parts],
                                           add_special=not self._starts_with_bos(text))

    def _check_tool_text(self, messages: list[dict], tools: list[dict] | None) -> None:
        """Refuse control token text in the tools and tool calls, which a template that knows tools
        prints as its own markup (where it would be read as control tokens)."""
        if not self.template.knows_tools:
            return  # plain_messages makes them message content, tokenized as plain text
        found = [("tools", json.dumps(tools, ensure_ascii=False))] if tools else []
        found += [(f"message {i}", json.dumps([m.get("tool_calls"), m.get("tool_call_id"), m.get("name")],
                                              ensure_ascii=False)) for i, m in enumerate(messages) if isinstance(m, dict)]
        for where, text in found:
            token = self.tokenizer.special_in(text)
            if token:
                raise ParameterError(f"{where}: the tool calls or tools hold the control token text {token!r}; "
                                     f"expected none (or parse_special_in_content to read them as control tokens)")

    def _starts_with_bos(self, text: str) -> bool:
        bos = _special_text(self.tokenizer, self.tokenizer.bos_id)
        return bool(bos) and text.startswith(bos)

    def check_fits(self, n_prompt: int) -> None:
        check_fits(n_prompt, self.n_ctx)

    # ---- generation -----------------------------------------------------------------------------
    def prepare(self, prompt: str | list[dict], params: GenerationParams,
                parse_special_in_content: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Everything a request can get wrong, checked before any work: the parameters, the
        prompt's tokens (see tokenize_prompt) and their fit in the context. Returns the tokens."""
        _check_params(params)
        if params.grammar is not None:
            check_grammar(params.grammar, self.tokenizer)
        prompt_ids = self.tokenize_prompt(prompt, parse_special_in_content, tools=tools)
        self.check_fits(len(prompt_ids))
        return prompt_ids

    def stream(self, prompt: str | list[dict], params: GenerationParams,
               cancel: Callable[[], bool] | None = None) -> Iterator[Piece | Finish]:
        """Yield Pieces of text as they are decoded, then exactly one Finish.

        Bad parameters and a prompt that does not fit raise here, before the first item.
        """
        return self.stream_ids(self.prepare(prompt, params), params, cancel)

    def stream_ids(self, prompt_ids: list[int], params: GenerationParams,
                   cancel: Callable[[], bool] | None = None) -> Iterator[Piece | Finish]:
        """stream() for the tokens prepare() returned: the prompt is not rendered again.

        `cancel` is asked before every token and handed to the backend, which asks it between
        prefill chunks (and, where it says so, between on-device greedy steps)."""
        _check_params(params)
        self.check_fits(len(prompt_ids))
        if params.max_tokens is not None and params.max_tokens > self.n_ctx:
            raise ParameterError(f"max_tokens = {params.max_tokens}, expected at most the context's {self.n_ctx} "
                                 f"tokens, or null (until the context is full)")
        constraint = Constraint(params.grammar, self.tokenizer) if params.grammar is not None else None
        if self._greedy_on_device(params):
            source = partial(self._device_tokens, prompt_ids, params, cancel)
            timed = self.backend.greedy_first_token_timed
        else:
            sampler = Sampler(params.sampling, self.config.vocab_size, constraint)
            source = partial(self._host_tokens, prompt_ids, sampler, params.logprobs is not None, cancel,
                             stop_ids=sorted(self.eog_ids | set(params.stop_token_ids)))
            timed = True
        return self._generate(prompt_ids, params, source, timed, cancel, constraint)

    def forget_prompt_cache(self) -> None:
        """The next request starts from an empty cache (after code that ran the backend itself)."""
        self.slots.forget()

    def _take_slot(self, prompt_ids: list[int], params: GenerationParams) -> tuple[PromptCache, int]:
        """Select the backend's slot this request runs in (PromptSlots.choose); returns that slot's
        record and the leading prompt positions the request keeps from its cache."""
        reuse = self.prompt_cache and params.cache_prompt and self.backend.keeps_prompt_cache
        slot = self.slots.choose(prompt_ids, reuse)
        self.backend.select_slot(slot)
        cache = self.slots.use(slot)
        keep = cache.reusable(prompt_ids) if reuse else 0
        return cache, keep if keep <= self.backend.n_past else 0  # the backend was reset behind the engine's back

    def _greedy_on_device(self, params: GenerationParams) -> bool:
        """A backend that picks greedy tokens itself (the CUDA megakernel, WebGPU's argmax chain)
        does so when asking it changes nothing (plain_greedy)."""
        return self.backend.greedy_on_device and plain_greedy(params)

    def _host_tokens(self, prompt_ids: list[int], sampler: Sampler, with_logits: bool,
                     cancel: Callable[[], bool] | None, keep: int, stop_ids: Sequence[int] = ()) -> _TokenSource:
        """Tokens sampled by the host's sampler after the prompt (its first `keep` ids kept in the
        cache): the backend's sample_stream (told the ids the request stops at), or with the logits
        of each (logprobs) one forward per token (sample_next); logits holding NaN or inf raise
        NonFiniteError before they reach the sampler."""
        history = History(list(prompt_ids), n_prompt=len(prompt_ids))
        self.backend.keep_prefix(keep)
        tokens = self._prefill(prompt_ids[keep:], cancel)
        if tokens is None:
            return  # cancelled during the prefill
        if not with_logits:
            stream = self.backend.sample_stream(sampler, history, tokens, stop_ids)
            try:
                for token in stream:
                    yield token, None
            finally:
                stream.close()
            return
        while True:
            token, logits = sample_next(self.backend, sampler, history, tokens, with_logits=True)
            sampler.accept(history, token)
            yield token, logits
            if self.backend.n_past >= self.n_ctx:
                return  # the context is full: no room to run the last token
            tokens = [token]

    def _prefill(self, prompt_ids: list[int], cancel: Callable[[], bool] | None = None) -> list[int] | None:
        """All of the prompt's chunks of the backend's prefill_chunk tokens but the last through
        Backend.prefill (which asks `cancel`), with a progress bar on stderr when there is more than
        one and progress is on; returns the last chunk, whose logits the first token is sampled
        from, or None when cancelled."""
        chunk = self.backend.prefill_chunk
        last = (len(prompt_ids) - 1) // chunk * chunk
        with tqdm(total=len(prompt_ids), desc="prefill", unit="token", disable=not self.progress or last == 0,
                  leave=False) as bar:
            if not self.backend.prefill(prompt_ids[:last], cancel, bar.update):
                return None
        return prompt_ids[last:]

    def _device_tokens(self, prompt_ids: list[int], params: GenerationParams,
                       cancel: Callable[[], bool] | None, keep: int) -> _TokenSource:
        """Greedy tokens the backend picks on the device, taken from its batches one at a time."""
        limit = params.max_tokens if params.max_tokens is not None else self.n_ctx
        eos = sorted(self.eog_ids | set(params.stop_token_ids))
        asked = {"cancel": cancel} if self.backend.greedy_cancel else {}  # else asked between batches, by _consume
        if keep:  # only a backend with keeps_prompt_cache is ever given a prefix to keep
            asked["keep"] = keep
        batches = self.backend.greedy_stream(prompt_ids, limit, eos, **asked)
        try:
            for tokens, finish in batches:
                for token in tokens:
                    yield token, None
                if finish == "stop":
                    yield _UNNAMED_EOG, None
        finally:
            batches.close()

    def _generate(self, prompt_ids: list[int], params: GenerationParams, make_source: Callable[[int], _TokenSource],
                  timed: bool, cancel: Callable[[], bool] | None,
                  constraint: Constraint | None = None) -> Iterator[Piece | Finish]:
        """The one generation loop: pieces of the tokens from the source `make_source(keep)` gives
        (keep: prompt positions kept in the cache), then the Finish. Untimed (every token arrives at
        the end, with the prompt run in the same launches), prefill_seconds is 0."""
        pieces = _PieceBuilder(TextAssembler(self.tokenizer.token_bytes, params.stop), params.logprobs is not None)
        started = time.perf_counter()
        cache, keep = self._take_slot(prompt_ids, params)
        source = make_source(keep)
        ran = list(prompt_ids)  # then every token taken: what the cache holds up to the backend's n_past
        try:
            reason, n_sampled, first_token_at = yield from self._consume(source, params, pieces, cancel, ran, constraint)
        except BaseException:
            cache.forget()  # an error or an abandoned stream: what ran is not known
            source.close()
            raise
        source.close()  # a device source sets n_past back to the last token it kept
        cache.remember(ran, self.backend.n_past)
        if piece := pieces.finish():
            yield piece
        ended = time.perf_counter()
        first_token_at = (first_token_at or ended) if timed else started
        yield Finish(reason, len(prompt_ids), n_sampled, first_token_at - started, ended - first_token_at, keep)

    def _consume(self, source: _TokenSource, params: GenerationParams, pieces: _PieceBuilder,
                 cancel: Callable[[], bool] | None, ran: list[int],
                 constraint: Constraint | None = None) -> Generator[Piece, None, tuple[str, int, float | None]]:
        """Pieces until a stop (a `constraint` complete counts as one), max_tokens or the end of
        `source`, each token taken appended to `ran`; returns the finish reason, the number of tokens sampled (the one that stopped included) and
        when the first came."""
        taker = TokenTaker(self, params, pieces, ran, constraint)
        while taker.wants_more():
            if cancel is not None and cancel():
                return "cancelled", taker.n_sampled, taker.first_token_at
            step = next(source, None)  # asked only now: the host path runs the next forward here
            if step is None:
                if cancel is not None and cancel():  # the backend stopped early because of it
                    return "cancelled", taker.n_sampled, taker.first_token_at
                break
            if piece := taker.take(*step):
                yield piece
            if taker.reason:
                return taker.reason, taker.n_sampled, taker.first_token_at
        return "length", taker.n_sampled, taker.first_token_at

    def generate(self, prompt: str | list[dict], params: GenerationParams,
                 cancel: Callable[[], bool] | None = None) -> tuple[str, Finish, list[TokenLogprob] | None]:
        """The whole answer at once: exactly the concatenation of stream()."""
        texts: list[str] = []
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        finish = None
        for item in self.stream(prompt, params, cancel):
            if isinstance(item, Finish):
                finish = item
            else:
                texts.append(item.text)
                if logprobs is not None:
                    logprobs.extend(item.logprobs or [])
        return "".join(texts), finish, logprobs

    def _logprob(self, logits: np.ndarray, token: int, k: int) -> TokenLogprob:
        logprobs = log_softmax(logits)
        ids, values = top_logprobs(logits, k)
        top = [(self._text(int(i)), int(i), float(v)) for i, v in zip(ids, values)]
        raw = self.tokenizer.token_bytes(token)
        return TokenLogprob(self._text(token), token, float(logprobs[token]), list(raw), top)

    def _text(self, token: int) -> str:
        """A token's own text; a lone piece of a UTF-8 character shows as U+FFFD (its bytes say more)."""
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")


# ---- prompts before a backend ---------------------------------------------------------------------
def plain_greedy(params: GenerationParams) -> bool:
    """Whether a request's tokens are the argmax of the raw logits, which a backend may then pick
    itself: greedy, no penalties or bias, no logprobs, no grammar."""
    return params.logprobs is None and params.grammar is None and not greedy_blockers(params.sampling)


def prompt_parts(opened: Model) -> tuple[GGUFTokenizer, ChatTemplate]:
    """The tokenizer and chat template of an opened model: all a prompt needs, without the weights."""
    tokenizer = load_tokenizer(opened.gguf)
    template = ChatTemplate.for_model(
        opened.gguf.value("tokenizer.chat_template", "string"), opened.config.family,
        _special_text(tokenizer, tokenizer.bos_id), _special_text(tokenizer, tokenizer.eos_id), str(opened.path))
    return tokenizer, template


def encode_prompt(tokenizer: GGUFTokenizer, template: ChatTemplate, prompt: str | list[dict]) -> list[int]:
    """Engine.tokenize_prompt, for a model not loaded yet."""
    if isinstance(prompt, list):
        prompt = template.render(prompt)
    if not isinstance(prompt, str):
        raise ParameterError(f"prompt of type {type(prompt).__name__}, expected a string or a list of messages")
    bos = _special_text(tokenizer, tokenizer.bos_id)
    starts_with_bos = bool(bos) and prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special=not starts_with_bos, parse_special=True))


def check_fits(n_prompt: int, n_ctx: int) -> None:
    """ContextOverflowError when n_prompt tokens leave no room for one generated token in n_ctx."""
    if n_prompt + 1 > n_ctx:
        raise ContextOverflowError(
            f"the prompt has {n_prompt} tokens and the context holds {n_ctx}: "
            f"expected at most {n_ctx - 1} prompt tokens, to leave room for one generated token")
    if n_prompt == 0:
        raise ParameterError("the prompt is empty after tokenization, expected at least one token")


# ---- helpers ------------------------------------------------------------------------------------
class TokenTaker:
    """What happens to each token a request generates, whoever runs the model (the engine's loop,
    or the batch scheduler of airframe/batching.py): appended to `ran`, counted, checked against the
    stop ids, the stop strings and the grammar, turned into pieces with their logprobs."""

    def __init__(self, engine: Engine, params: GenerationParams, pieces: _PieceBuilder, ran: list[int],
                 constraint: Constraint | None = None):
        self.engine, self.params, self.pieces, self.ran, self.constraint = engine, params, pieces, ran, constraint
        self.stop_ids = engine.eog_ids | set(params.stop_token_ids) | {_UNNAMED_EOG}
        self.n_sampled = 0
        self.first_token_at: float | None = None
        self.reason: str | None = None  # "stop" once a token stopped generation

    def wants_more(self) -> bool:
        """No stop yet, and fewer than max_tokens tokens taken."""
        return self.reason is None and (self.params.max_tokens is None or self.n_sampled < self.params.max_tokens)

    def take(self, token: int, logits: np.ndarray | None) -> Piece | None:
        """One generated token (with its logits where logprobs are asked): the piece it completes, if any."""
        self.ran.append(token)
        self.n_sampled += 1
        self.first_token_at = self.first_token_at or time.perf_counter()
        if token in self.stop_ids:
            self.reason = "stop"
            return None
        params = self.params
        logprob = self.engine._logprob(logits, token, params.logprobs) if params.logprobs is not None else None
        piece = self.pieces.add(token, logprob)
        if self.pieces.assembler.stopped or (self.constraint is not None and self.constraint.done):
            self.reason = "stop"
        return piece


class _PieceBuilder:
    """Generated tokens (and their logprobs) waiting for the text they make to be released."""

    def __init__(self, assembler: TextAssembler, with_logprobs: bool):
        self.assembler = assembler
        self.with_logprobs = with_logprobs
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []

    def add(self, token: int, logprob: TokenLogprob | None) -> Piece | None:
        self.ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        text = self.assembler.push(token)
        return self._take(text) if text else None

    def finish(self) -> Piece | None:
        """What is left at the end: held-back text, or tokens whose text was empty or cut by a stop."""
        text = self.assembler.finish()
        return self._take(text) if text or self.ids else None

    def _take(self, text: str) -> Piece:
        piece = Piece(text, self.ids, self.logprobs if self.with_logprobs else None)
        self.ids, self.logprobs = [], []
        return piece


def _special_text(tokenizer: GGUFTokenizer, token_id: int | None) -> str:
    if token_id is None or token_id < 0:
        return ""
    return tokenizer.token_text(token_id)


def _model_id(asked: str | Path | Model, opened: Model) -> str:
    """The known name a model was asked by (or whose cached file it is), else its file's stem."""
    if isinstance(asked, str) and asked in KNOWN_MODELS:
        return asked
    for name, known in KNOWN_MODELS.items():
        if opened.path == models_dir() / known.filename:
            return name
    return opened.path.stem


def _open_backend(name: str, model: Model, options: RunOptions) -> Backend:
    try:
        return open_backend(name, model, options)
    except ImportError as e:
        raise UnsupportedError(f"the {name!r} backend cannot be used here: {e}; "
                               f"try --backend reference (numpy, slow)") from None


def _check_params(params: GenerationParams) -> None:
    if params.max_tokens is not None and (isinstance(params.max_tokens, bool)
                                          or not isinstance(params.max_tokens, int) or params.max_tokens < 0):
        raise ParameterError(f"max_tokens = {params.max_tokens!r}, expected an integer >= 0 or null")
    if params.logprobs is not None and (isinstance(params.logprobs, bool)
                                        or not isinstance(params.logprobs, int) or params.logprobs < 0):
        raise ParameterError(f"logprobs = {params.logprobs!r}, expected an integer >= 0 or null")
    if not isinstance(params.cache_prompt, bool):
        raise ParameterError(f"cache_prompt = {params.cache_prompt!r}, expected True or False")
    if not all(isinstance(s, str) for s in params.stop):
        raise ParameterError(f"stop = {params.stop!r}, expected a list of strings")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in params.stop_token_ids):
        raise ParameterError(f"stop_token_ids = {params.stop_token_ids!r}, expected a list of token ids")
