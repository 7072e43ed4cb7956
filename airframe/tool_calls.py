"""Tool calls: finding them in a model's text, and the prompt side for templates that know no tools.

A template's own text says which format its model was taught (`call_format`): Qwen and Hermes
wrap each call in `<tool_call>...</tool_call>`, Llama 3.x writes a JSON object with "parameters"
(after `<|python_tag|>` or alone), Mistral writes `[TOOL_CALLS]` and a JSON list. Small models
drift from their format, so a bare JSON object (or a list of them), or a fenced ```json block,
naming a declared function is a call in every format. A call that does not parse or names no
declared function is not a call: the text stays the answer's content.

A template without tools (SmolLM2's, the built-in ChatML and Gemma formats) gets them as a system
message in the Hermes format (`plain_messages`), and its earlier calls and tool answers as text.

`CallStream` is the same parse over a stream: content is released as soon as it cannot be the
start of a call, the rest is held until the end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?```", re.DOTALL)
# Where a call may begin mid-text, per format (bare JSON only at the very start of the answer).
_MARKERS = {
    HERMES: ("<tool_call>", "```json", "```\n{"),
    LLAMA3: ("<|python_tag|>", "```json", "```\n{"),
    MISTRAL: ("[TOOL_CALLS]", "```json", "```\n{"),
}
_STARTS = ("{", "[")  # a bare call, or a list of calls, opens the answer


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Parsed:
    """An answer split into its content (text outside the calls; None if there is none) and calls."""

    content: str | None
    calls: list[ToolCall]
    start: int = 0  # where the calls begin in the text (the content before them ends here)
    after: str = ""  # text between and after the calls, also content


def call_format(template_source: str) -> str:
    """The tool-call format the template's model writes, read from the template's text."""
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<tool_call>" in template_source:
        return HERMES
    if "<|python_tag|>" in template_source or ("<|start_header_id|>" in template_source and "tools" in template_source):
        return LLAMA3
    return HERMES  # the format plain_messages teaches a template that has none


def knows_tools(template_source: str) -> bool:
    """The template renders `tools` itself (else plain_messages describes them in a system message)."""
    return re.search(r"\btools\b", template_source) is not None


# ---- parsing ----------------------------------------------------------------------------------


def parse(text: str, fmt: str, names: set[str]) -> Parsed:
    """The calls in `text` (an answer in format `fmt`) to the functions `names`; none: all content."""
    for find in (_FINDERS[fmt], _find_bare, _find_fenced):
        found = find(text, names)
        if found is not None:
            start, calls, after = found
            content = "\n".join(part for part in (text[:start].strip(), after.strip()) if part)
            return Parsed(content or None, calls, start, after)
    return Parsed(text, [], len(text))


def _call(obj, names: set[str]) -> ToolCall | None:
    """One call from a decoded JSON object, or None where it is not a call to a declared function."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))  # Llama 3.x names them "parameters"
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _calls(obj, names: set[str]) -> list[ToolCall] | None:
    """A call, or a non-empty list of calls, from decoded JSON; None unless every one is good."""
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(item, names) for item in items]
    return calls if calls and all(calls) else None


def _decode_all(text: str):
    """Every JSON value in `text`, one after another (separated by whitespace or ';'); None if
    anything else is there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            return None
        values.append(value)


def _find_hermes(text: str, names: set[str]):
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls, rest, pos = [], [], start
    while (i := text.find("<tool_call>", pos)) >= 0:
        rest.append(text[pos:i])
        end = text.find("</tool_call>", i)
        body = text[i + len("<tool_call>"):end if end >= 0 else len(text)]  # the last may lack its end tag
        found = _decode_all(body)
        if found is None or len(found) != 1 or (call := _call(found[0], names)) is None:
            return None
        calls.append(call)
        pos = len(text) if end < 0 else end + len("</tool_call>")
    rest.append(text[pos:])
    return start, calls, "".join(rest)


def _find_llama3(text: str, names: set[str]):
    tag = text.find("<|python_tag|>")
    start = tag if tag >= 0 else len(text) - len(text.lstrip())
    body = text[tag + len("<|python_tag|>"):] if tag >= 0 else text
    values = _decode_all(body.replace("<|eom_id|>", ""))
    if not values:
        return None
    calls = [c for v in values for c in (_calls(v, names) or [None])]
    return (start, calls, "") if all(calls) else None


def _find_mistral(text: str, names: set[str]):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    body = text[start + len("[TOOL_CALLS]"):]
    if "[ARGS]" in body:  # the newer format: [TOOL_CALLS]name[ARGS]{...}, repeated
        calls = []
        for part in body.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            values = _decode_all(args)
            call = _call({"name": name.strip(), "arguments": values[0]}, names) if values and len(values) == 1 else None
            if call is None:
                return None
            calls.append(call)
        return start, calls, ""
    values = _decode_all(body)
    if not values or len(values) != 1:
        return None
    calls = _calls(values[0], names)
    return (start, calls, "") if calls else None


def _find_bare(text: str, names: set[str]):
    """The whole answer is JSON: one call, a list of calls, or several calls in a row."""
    stripped = text.lstrip()
    if not stripped.startswith(_STARTS):
        return None
    values = _decode_all(stripped)
    if not values:
        return None
    calls = [c for v in values for c in (_calls(v, names) or [None])]
    return (len(text) - len(stripped), calls, "") if all(calls) else None


def _find_fenced(text: str, names: set[str]):
    """A fenced block (```json or ```) holding the calls; text around it is content."""
    match = FENCE.search(text)
    if match is None:
        return None
    values = _decode_all(match.group(1))
    if not values:
        return None
    calls = [c for v in values for c in (_calls(v, names) or [None])]
    return (match.start(), calls, text[match.end():]) if all(calls) else None


_FINDERS = {HERMES: _find_hermes, LLAMA3: _find_llama3, MISTRAL: _find_mistral}


# ---- streaming --------------------------------------------------------------------------------


class CallStream:
    """Text pieces in, content that cannot be part of a call out at once; at the end, `finish`
    parses the whole answer and returns what was held back: more content, and the calls."""

    def __init__(self, fmt: str, names: set[str]):
        self.fmt, self.names = fmt, names
        self.text = ""
        self.sent = 0  # characters of text already released as content
        self.holding = False  # a call may have begun: nothing more is released before finish

    def push(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        if self.sent == 0:
            head = self.text.lstrip()
            if not head:
                return ""  # leading whitespace: the answer may still open with a bare call
            if head.startswith(_STARTS):
                self.holding = True
                return ""
        cut = self._safe_end()
        out, self.sent = self.text[self.sent:cut], max(self.sent, cut)
        return out

    def _safe_end(self) -> int:
        """How far the text can be released: up to a call's marker, or a marker's possible start."""
        markers = _MARKERS[self.fmt]
        found = [i for m in markers if (i := self.text.find(m, self.sent)) >= 0]
        if found:
            self.holding = True
            return min(found)
        for keep in range(min(len(self.text) - self.sent, max(map(len, markers))), 0, -1):
            tail = self.text[len(self.text) - keep:]
            if any(m.startswith(tail) for m in markers):
                return len(self.text) - keep
        return len(self.text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet released, calls): the parse of the whole text."""
        parsed = parse(self.text, self.fmt, self.names)
        if not parsed.calls:
            return self.text[self.sent:], []
        before = self.text[self.sent:parsed.start].rstrip() if parsed.start > self.sent else ""
        after = parsed.after.strip()
        return before + ("\n" + after if before and after else after), parsed.calls


# ---- the prompt, for templates that know no tools ---------------------------------------------

_INSTRUCTIONS = ("You may call one or more functions to answer the user. The functions are described "
                 "as JSON schemas within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a "
                 "function, answer with a JSON object with the function's name and arguments within "
                 "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def hermes_call_text(call: dict) -> str:
    """An assistant message's call (OpenAI's {function: {name, arguments}}) as Hermes text."""
    function = call.get("function", call)
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI's JSON text, where a caller passes it on as it came
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def plain_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages a template without tools renders: the tools in the system message, earlier calls
    in the assistant's content, and each run of tool answers as one user turn."""
    out: list[dict] = []
    if tools:
        described = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append(dict(messages[0], content=f"{messages[0]['content']}\n\n{described}"))
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": described})
    for message in messages:
        if message["role"] == "tool":
            answer = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_answers"):
                out[-1] = dict(out[-1], content=f"{out[-1]['content']}\n{answer}")
            else:
                out.append({"role": "user", "content": answer, "tool_answers": True})
        elif message.get("tool_calls"):
            texts = [message["content"]] if message["content"] else []
            texts += [hermes_call_text(c) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(texts)})
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "tool_answers"} for m in out]


# ---- forcing a call -----------------------------------------------------------------------------


def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one call, {"name": ..., "arguments": {...}}, to `name` or to any tool."""
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}
