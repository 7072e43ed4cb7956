"""Tool calling in /v1/chat/completions: from a request's `tools` and `tool_choice` to what the
template renders and what the answer is parsed for, and from the calls found to OpenAI's
`tool_calls` (a message's, or a stream's deltas).

`tool_choice` "auto" (the default with tools) lets the model answer or call; "none" renders no
tools and parses no calls; "required" or a named function constrain the answer with a JSON schema
of one call ({"name", "arguments"}, airframe/constraint.py), so a small model cannot miss the format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..constraint import Grammar, json_schema_grammar
from ..errors import ParameterError
from ..tool_calls import ToolCall, call_schema
from .errors import ApiError
from .schemas import ChatCompletionRequest, DeltaFunction, DeltaToolCall, FunctionOut, ToolCallOut


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools asks: the tools for the template, and how to read the answer."""

    tools: list[dict]  # OpenAI's shape, {"type": "function", "function": {...}}, as templates take it
    names: set[str]
    fmt: str  # the call format the template's model writes (tool_calls.call_format)
    forced: str | None  # "required", a function's name, or None (the model chooses)
    parallel: bool  # more than one call per answer

    def grammar(self) -> Grammar | None:
        """The constraint that makes the answer one call, for a forced choice."""
        if self.forced is None:
            return None
        name = None if self.forced == "required" else self.forced
        try:
            return json_schema_grammar(call_schema(self.tools, name))
        except ParameterError as e:
            raise ApiError(400, f"the tools' parameters cannot be used to force a call: {e}", param="tools",
                           code="invalid_value") from None

    def calls(self, found: list[ToolCall]) -> list[ToolCall]:
        return found if self.parallel else found[:1]


def _choice(req: ChatCompletionRequest, names: set[str]) -> str | None:
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return "required"
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, expected one of the tools: "
                       f"{', '.join(sorted(names))}", param="tool_choice", code="invalid_value")
    return choice.function.name


def plan(req: ChatCompletionRequest, fmt: str) -> ToolPlan | None:
    """The request's tool plan; None where no tools are to be offered (none given, or "none")."""
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise ApiError(400, f"tool_choice {_shown(req.tool_choice)} needs 'tools', expected the functions "
                       f"to choose from", param="tool_choice", code="invalid_value")
    if not req.tools or req.tool_choice == "none":
        return None
    names: set[str] = set()
    for i, tool in enumerate(req.tools):
        if tool.function.name in names:
            raise ApiError(400, f"tools.{i}: the function name {tool.function.name!r} is declared twice, expected "
                           f"each name once", param=f"tools.{i}.function.name", code="invalid_value")
        names.add(tool.function.name)
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
    for i, tool in enumerate(tools):
        _check_encodable(tool, f"tools.{i}")
    forced = _choice(req, names)
    if forced is not None and _constrained(req):
        raise ApiError(400, f"tool_choice {_shown(req.tool_choice)} and {_constrained(req)} given together, expected "
                       f"at most one constraint", param="tool_choice", code="invalid_value")
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(tools, names, fmt, forced, parallel)


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def _constrained(req: ChatCompletionRequest) -> str | None:
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return next((name for name in ("json_schema", "grammar") if getattr(req, name) is not None), None)


def call_messages(index: int, call) -> dict:
    """An assistant message's call as the template takes it: arguments decoded from their JSON."""
    text = call.function.arguments
    try:
        arguments = json.loads(text) if text.strip() else {}
    except (json.JSONDecodeError, RecursionError) as e:
        arguments = e
    if not isinstance(arguments, dict):
        found = f"not JSON ({arguments})" if isinstance(arguments, Exception) else f"a JSON {type(arguments).__name__}"
        raise ApiError(400, f"messages.{index}: the arguments of tool call {call.function.name!r} are {found}; "
                       f"expected the JSON text of an object", param=f"messages.{index}.tool_calls",
                       code="invalid_value")
    _check_encodable(arguments, f"messages.{index}.tool_calls")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _check_encodable(value, param: str) -> None:
    # JSON's "\ud800" escapes decode to lone UTF-16 surrogates, which no tokenizer can encode.
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: text with a lone UTF-16 surrogate at position {e.start} of its JSON; "
                       f"expected valid Unicode", param=param, code="invalid_value") from None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=_call_id(), function=FunctionOut(name=c.name, arguments=c.arguments_json())) for c in calls]


def tool_call_deltas(calls: list[ToolCall]) -> list[list[DeltaToolCall]]:
    """The stream's pieces of the calls, as OpenAI sends them: per call, its id and name with empty
    arguments, then the arguments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append([DeltaToolCall(index=index, id=_call_id(), type="function",
                                     function=DeltaFunction(name=call.name, arguments=""))])
        deltas.append([DeltaToolCall(index=index, function=DeltaFunction(arguments=call.arguments_json()))])
    return deltas
