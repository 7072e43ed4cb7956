"""The OpenAI-compatible request and response bodies, as pydantic models.

Ranges that OpenAI documents are declared here (so they appear in the OpenAPI schema and are
checked before a request reaches the queue); unknown fields are ignored, as OpenAI does. Options
that parse but that airframe does not run (n > 1, the legacy `functions`) are refused in translate.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5


def _encodable(text: str) -> str:
    # JSON can carry a lone UTF-16 surrogate ("\ud800"), which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text has a lone UTF-16 surrogate at position {e.start}; expected valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]  # every string that reaches the tokenizer


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class ContentPart(_Lenient):
    type: str
    text: Text | None = None


class FunctionCall(_Lenient):
    name: Text
    arguments: Text = ""  # JSON text, as OpenAI sends it


class ToolCallIn(_Lenient):
    """A call in an assistant message sent back with the conversation."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[Text, list[ContentPart], None] = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call answered


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Lenient):
    """The fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: Union[Text, list[Text], None] = Field(default=None)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    # Extensions beyond OpenAI, named as llama-server and vLLM name them.
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    cache_prompt: bool = True  # false: prefill the whole prompt, keeping nothing of the prompt cache
    grammar: str | None = None  # GBNF or Lark: every answer keeps to it (as llama-server's `grammar`)
    json_schema: dict[str, Any] | bool | None = None  # as llama-server's `json_schema`


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_CHAT)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: Any = None
    # airframe's own: read control tokens written in message content (`<|im_end|>`) as control
    # tokens, as the template's markup is; off, content is plain text and cannot forge a turn.
    parse_special_in_content: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS_COMPLETION)
    response_format: ResponseFormat | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: Text | None = None
    content: Text | None = None  # llama-server's name for `prompt`
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn opening
    parse_special_in_content: bool = False  # with messages: as in ChatCompletionRequest


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


# ---- responses ----


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prompt cache, not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class FunctionOut(BaseModel):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of one call in a stream; `index` says which call the pieces build up."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class LegacyLogprobs(BaseModel):
    """The logprobs of /v1/completions: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "airframe"
    context_length: int
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    content: str


class Health(BaseModel):
    status: Literal["ok", "loading", "error"]
    model: str | None = None
    message: str | None = None
