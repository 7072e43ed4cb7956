"""From a prompt to streamed text: tokenize, prefill, then sample, stop and detokenize token by token.

The engine knows nothing of HTTP and nothing of shaders: it drives any Backend through
`reset()` (at the start of every request, so K/V never leaks between requests) and `forward()`,
or, for a plain greedy request to a backend with `greedy_on_device`, through `greedy_stream()`.
Either way the tokens go through the same loop below.

    engine = Engine.load("smollm2-135m", backend="reference")
    for item in engine.stream([{"role": "user", "content": "Hi"}], GenerationParams(max_tokens=20)):
        print(item.text if isinstance(item, Piece) else item.reason)

Generation ends with "stop" (an end-of-generation token of the model, an extra stop token id or
a stop string), "length" (max_tokens, or the context is full) or "cancelled" (cancel() said so;
it is asked before every token). Every sampled token counts as a completion token, the one that
stopped generation included; neither an end-of-generation token nor a stop string is ever shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Iterator

import numpy as np

from .backend import DEFAULT_BACKEND, Backend, open_backend
from .chat_template import ChatTemplate
from .errors import ContextOverflowError, ParameterError, UnsupportedError
from .family import ModelConfig
from .model import Model, open_model
from .models import KNOWN_MODELS
from .options import RunOptions
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


# (token, its logits or None), one per token generated; the host path computes each when asked
_TokenSource = Generator[tuple[int, np.ndarray | None], None, None]
_UNNAMED_EOG = -1  # an end-of-generation token the device chose without saying which


class Engine:
    backend: Backend
    tokenizer: GGUFTokenizer
    config: ModelConfig
    model_id: str
    n_ctx: int

    def __init__(self, backend: Backend, tokenizer: GGUFTokenizer, template: ChatTemplate, model_id: str):
        self.backend = backend
        self.tokenizer = tokenizer
        self.template = template
        self.config = backend.config
        self.model_id = model_id
        self.n_ctx = backend.n_ctx
        self.eog_ids = set(tokenizer.eog_ids)  # EOS and the template's end-of-turn tokens

    @classmethod
    def load(cls, model: str | Path, backend: str = DEFAULT_BACKEND, options: RunOptions | None = None,
             rope_scaling: str | None = None, rope_scale: float | None = None) -> "Engine":
        """Open a model (a path or a known name) once and load it in the named backend, with its
        tokenizer and template read from the same parsed file.

        options default to RunOptions.from_env(); rope_scaling and rope_scale replace the RoPE
        scaling the file declares (open_model).
        """
        opened = open_model(model, rope_scaling, rope_scale)
        try:
            tokenizer = load_tokenizer(opened.gguf)
            template = ChatTemplate.for_model(
                opened.gguf.value("tokenizer.chat_template", "string"), opened.config.family,
                _special_text(tokenizer, tokenizer.bos_id), _special_text(tokenizer, tokenizer.eos_id),
                str(opened.path))
            loaded = _open_backend(backend, opened, options or RunOptions.from_env())
        except BaseException:
            opened.gguf.close()  # a file refused halfway is not left mapped
            raise
        return cls(loaded, tokenizer, template, model_id=model if model in KNOWN_MODELS else opened.path.stem)

    # ---- prompts --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def tokenize_prompt(self, prompt: str | list[dict]) -> list[int]:
        """A string is a raw completion prompt; a list is chat messages rendered by the template.

        Special tokens written in the text (`<|im_start|>`) are parsed as such, and the model's BOS
        is added unless the text already starts with it.
        """
        if isinstance(prompt, list):
            prompt = self.render_chat(prompt)
        if not isinstance(prompt, str):
            raise ParameterError(f"prompt of type {type(prompt).__name__}, expected a string or a list of messages")
        bos = _special_text(self.tokenizer, self.tokenizer.bos_id)
        starts_with_bos = bool(bos) and prompt.startswith(bos)
        return list(self.tokenizer.encode(prompt, add_special=not starts_with_bos, parse_special=True))

    def check_fits(self, n_prompt: int) -> None:
        if n_prompt + 1 > self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {n_prompt} tokens and the context holds {self.n_ctx}: "
                f"expected at most {self.n_ctx - 1} prompt tokens, to leave room for one generated token")
        if n_prompt == 0:
            raise ParameterError("the prompt is empty after tokenization, expected at least one token")

    # ---- generation -----------------------------------------------------------------------------
    def stream(self, prompt: str | list[dict], params: GenerationParams,
               cancel: Callable[[], bool] | None = None) -> Iterator[Piece | Finish]:
        """Yield Pieces of text as they are decoded, then exactly one Finish.

        Bad parameters and a prompt that does not fit raise here, before the first item.
        """
        _check_params(params)
        prompt_ids = self.tokenize_prompt(prompt)
        self.check_fits(len(prompt_ids))
        if self._greedy_on_device(params):
            source = self._device_tokens(prompt_ids, params)
            timed = self.backend.greedy_first_token_timed
        else:
            source = self._host_tokens(prompt_ids, Sampler(params.sampling, self.config.vocab_size))
            timed = True
        return self._generate(prompt_ids, params, source, timed, cancel)

    def _greedy_on_device(self, params: GenerationParams) -> bool:
        """A backend that picks greedy tokens itself (the CUDA megakernel, WebGPU's argmax chain)
        does so when asking it changes nothing: greedy, no penalties or bias, no logprobs."""
        return (self.backend.greedy_on_device and params.logprobs is None
                and not greedy_blockers(params.sampling))

    def _host_tokens(self, prompt_ids: list[int], sampler: Sampler) -> _TokenSource:
        """Tokens sampled on the host from the logits forward() reads back, one per request for the next."""
        history = History(list(prompt_ids), n_prompt=len(prompt_ids))
        self.backend.reset()
        logits = self.backend.forward(prompt_ids)
        while True:
            token = sampler.sample(history, logits)
            history.tokens.append(token)
            yield token, logits
            if self.backend.n_past >= self.n_ctx:
                return  # the context is full: no room to run the last token
            logits = self.backend.forward([token])

    def _device_tokens(self, prompt_ids: list[int], params: GenerationParams) -> _TokenSource:
        """Greedy tokens the backend picks on the device, taken from its batches one at a time."""
        limit = params.max_tokens if params.max_tokens is not None else self.n_ctx
        eos = sorted(self.eog_ids | set(params.stop_token_ids))
        batches = self.backend.greedy_stream(prompt_ids, limit, eos)
        try:
            for tokens, finish in batches:
                for token in tokens:
                    yield token, None
                if finish == "stop":
                    yield _UNNAMED_EOG, None
        finally:
            batches.close()

    def _generate(self, prompt_ids: list[int], params: GenerationParams, source: _TokenSource, timed: bool,
                  cancel: Callable[[], bool] | None) -> Iterator[Piece | Finish]:
        """The one generation loop: pieces of the tokens from `source`, then the Finish. Untimed (every
        token arrives at the end, with the prompt run in the same launches), prefill_seconds is 0."""
        pieces = _PieceBuilder(TextAssembler(self.tokenizer.token_bytes, params.stop), params.logprobs is not None)
        started = time.perf_counter()
        try:
            reason, n_sampled, first_token_at = yield from self._consume(source, params, pieces, cancel)
        finally:
            source.close()
        if piece := pieces.finish():
            yield piece
        ended = time.perf_counter()
        first_token_at = (first_token_at or ended) if timed else started
        yield Finish(reason, len(prompt_ids), n_sampled, first_token_at - started, ended - first_token_at)

    def _consume(self, source: _TokenSource, params: GenerationParams, pieces: _PieceBuilder,
                 cancel: Callable[[], bool] | None) -> Generator[Piece, None, tuple[str, int, float | None]]:
        """Pieces until a stop, max_tokens or the end of `source`; returns the finish reason, the
        number of tokens sampled (the one that stopped included) and when the first came."""
        stop_ids = self.eog_ids | set(params.stop_token_ids) | {_UNNAMED_EOG}
        n_sampled, first_token_at = 0, None
        while params.max_tokens is None or n_sampled < params.max_tokens:
            if cancel is not None and cancel():
                return "cancelled", n_sampled, first_token_at
            step = next(source, None)  # asked only now: the host path runs the next forward here
            if step is None:
                break
            token, logits = step
            n_sampled += 1
            first_token_at = first_token_at or time.perf_counter()
            if token in stop_ids:
                return "stop", n_sampled, first_token_at
            logprob = self._logprob(logits, token, params.logprobs) if params.logprobs is not None else None
            if piece := pieces.add(token, logprob):
                yield piece
            if pieces.assembler.stopped:
                return "stop", n_sampled, first_token_at
        return "length", n_sampled, first_token_at

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


# ---- helpers ------------------------------------------------------------------------------------
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
    if not all(isinstance(s, str) for s in params.stop):
        raise ParameterError(f"stop = {params.stop!r}, expected a list of strings")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in params.stop_token_ids):
        raise ParameterError(f"stop_token_ids = {params.stop_token_ids!r}, expected a list of token ids")
