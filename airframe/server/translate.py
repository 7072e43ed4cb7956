"""From OpenAI request bodies to the engine's prompt and GenerationParams, and from the engine's
TokenLogprobs back to OpenAI's two logprob shapes.

Fields left out of a request take the engine's defaults (SamplingParams), as llama-server does,
not OpenAI's temperature 1.0 / top_p 1.0.
"""

from __future__ import annotations

from typing import Callable

from ..constraint import Grammar, json_object_grammar, json_schema_grammar, text_grammar
from ..engine import GenerationParams, TokenLogprob
from ..errors import ParameterError
from ..sampling import SamplingParams
from . import tools
from .errors import ApiError
from .schemas import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    LegacyLogprobs,
    ResponseFormat,
    TokenLogprobOut,
    TopLogprob,
    _Sampling,
)

_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def _check_common(req: _Sampling) -> None:
    if req.n not in (None, 1):
        raise _unsupported("n", f"n={req.n} is not supported: airframe generates exactly one choice (n=1)")


def check_chat(req: ChatCompletionRequest) -> None:
    """Refuse options that parse but that airframe does not run."""
    _check_common(req)
    if req.functions:
        raise _unsupported("functions", "the legacy 'functions' are not supported; expected 'tools'")
    if req.function_call not in (None, "none", "auto"):
        raise _unsupported("function_call", f"'function_call'={req.function_call!r} is not supported; "
                                            f"expected 'tool_choice'")
    if req.modalities and set(req.modalities) != {"text"}:
        raise _unsupported("modalities", f"modalities {req.modalities} are not supported; only ['text']")
    if req.audio is not None:
        raise _unsupported("audio", "audio output is not supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")


def check_completion(req: CompletionRequest) -> None:
    _check_common(req)
    if req.echo:
        raise _unsupported("echo", "echo=true is not supported: the answer holds only the completion")
    if req.suffix:
        raise _unsupported("suffix", "'suffix' (fill-in-the-middle) is not supported")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", f"best_of={req.best_of} is not supported; only 1")


def completion_prompt(req: CompletionRequest) -> str:
    """The one prompt string of a completion request (a string, or a list of one string)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt and all(isinstance(p, str) for p in prompt):
        raise _unsupported("prompt", f"a list of {len(prompt)} prompts is not supported; send one prompt per request")
    if not prompt:
        raise ApiError(400, "'prompt' is an empty list; expected a string or a list of one string", param="prompt")
    raise _unsupported("prompt", "token-id prompts are not supported; send the prompt as a string")


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text":
            raise _unsupported(f"messages.{index}.content", f"content part of type {part.type!r} is not supported; only 'text'")
        if part.text is None:
            raise ApiError(400, "a content part of type 'text' has no 'text' field", param=f"messages.{index}.content")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them: role and plain-text content, an assistant's
    tool calls (arguments decoded), a tool answer's call id and function name."""
    out, called = [], {}  # called: call id -> function name, for tool answers that do not say
    for i, message in enumerate(messages):
        if message.role == "function":
            raise _unsupported(f"messages.{i}.role", "messages with the legacy role 'function' are not supported; "
                                                     "expected role 'tool'")
        role = "system" if message.role == "developer" else message.role
        item = {"role": role, "content": _message_text(message, i)}
        if message.tool_calls and role == "assistant":
            item["tool_calls"] = [tools.call_messages(i, call) for call in message.tool_calls]
            called.update((call.id, call.function.name) for call in message.tool_calls if call.id)
        if role == "tool":
            item["tool_call_id"] = message.tool_call_id
            name = message.name or called.get(message.tool_call_id)
            if name:
                item["name"] = name
        out.append(item)
    return out


def _stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"'stop' has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES} are allowed", param="stop")
    return [s for s in stops if s]


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id; expected an integer in [0, {vocab_size})", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise ApiError(400, f"logit_bias token id {token} is out of range; the vocabulary has ids [0, {vocab_size})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias value {value} for token {token} is out of range [-100, 100]", param="logit_bias")
        out[token] = float(value)
    return out


def _max_tokens(value: int | None, param: str, n_ctx: int) -> int | None:
    """max_tokens up to the whole context (a longer prompt then ends at the full context, with
    finish_reason "length", as llama-server does); more can never be generated: a 400, as OpenAI's."""
    if value is not None and value > n_ctx:
        raise ApiError(400, f"{param} = {value}, expected at most {n_ctx}, the context of this server "
                       f"(prompt and completion together)", param=param, code="invalid_value")
    return value


def sampling_params(req: _Sampling, vocab_size: int) -> SamplingParams:
    if req.top_k is not None and req.top_k > vocab_size:
        raise ApiError(400, f"top_k = {req.top_k}, expected an integer in 0..{vocab_size} (the vocabulary size; 0 = off)",
                       param="top_k", code="invalid_value")
    given = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    seed = None if req.seed is None else req.seed % 2**64  # a negative seed is taken modulo 2**64
    try:
        return SamplingParams(**given, logit_bias=_logit_bias(req.logit_bias, vocab_size), seed=seed)
    except ParameterError as e:
        raise ApiError(400, str(e), code="invalid_value") from None


def _response_format(fmt: ResponseFormat | None) -> Grammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_object_grammar()
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema, the JSON schema",
                           param="response_format", code="invalid_value")
        return json_schema_grammar(fmt.json_schema.schema_)
    raise _unsupported("response_format", f"response_format type {fmt.type!r} is not supported; "
                                          f"expected 'text', 'json_object' or 'json_schema'")


def grammar(req: _Sampling) -> Grammar | None:
    """The constraint a request asks for: response_format, or llama-server's json_schema or grammar."""
    given = [(name, value) for name, value in (("response_format", getattr(req, "response_format", None)),
                                               ("json_schema", req.json_schema), ("grammar", req.grammar))
             if value is not None and not (name == "response_format" and value.type == "text")]
    if len(given) > 1:
        raise ApiError(400, f"{' and '.join(n for n, _ in given)} given together, expected at most one constraint",
                       param=given[1][0], code="invalid_value")
    if not given:
        return None
    name, value = given[0]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "json_schema":
            return json_schema_grammar(value)
        return text_grammar(value)
    except ParameterError as e:
        raise ApiError(400, str(e), param=name, code="invalid_value") from None


def chat_params(req: ChatCompletionRequest, vocab_size: int, n_ctx: int,
                plan: tools.ToolPlan | None = None) -> GenerationParams:
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    forced = plan.grammar() if plan is not None else None
    return GenerationParams(
        max_tokens=_max_tokens(getattr(req, param), param, n_ctx),
        sampling=sampling_params(req, vocab_size),
        stop=_stop(req.stop),
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        cache_prompt=req.cache_prompt,
        grammar=forced or grammar(req),
    )


def completion_params(req: CompletionRequest, vocab_size: int, n_ctx: int) -> GenerationParams:
    return GenerationParams(
        max_tokens=_max_tokens(req.max_tokens, "max_tokens", n_ctx),
        sampling=sampling_params(req, vocab_size),
        stop=_stop(req.stop),
        logprobs=req.logprobs,
        cache_prompt=req.cache_prompt,
        grammar=grammar(req),
    )


def _alternative(token_bytes: Callable[[int], bytes], token_id: int) -> tuple[str, list[int]]:
    """An alternative's text and bytes from its id: the tokenizer's bytes, not the vocabulary
    entry (whose byte-level marks such as 'Ġ' are not text)."""
    raw = token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(items: list[TokenLogprob], token_bytes: Callable[[int], bytes]) -> list[TokenLogprobOut]:
    """OpenAI chat shape: one entry per token with its bytes and top alternatives."""
    out = []
    for t in items:
        top = []
        for _, token_id, logprob in t.top:
            text, raw = _alternative(token_bytes, token_id)
            top.append(TopLogprob(token=text, logprob=logprob, bytes=raw))
        out.append(TokenLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.bytes), top_logprobs=top))
    return out


def legacy_logprobs(items: list[TokenLogprob], token_bytes: Callable[[int], bytes], offset: int = 0) -> LegacyLogprobs:
    """The /v1/completions shape; text_offset counts characters from the start of the completion."""
    offsets, tops = [], []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
        tops.append({_alternative(token_bytes, token_id)[0]: logprob for _, token_id, logprob in t.top})
    return LegacyLogprobs(
        tokens=[t.token for t in items],
        token_logprobs=[t.logprob for t in items],
        top_logprobs=tops,
        text_offset=offsets,
    )
