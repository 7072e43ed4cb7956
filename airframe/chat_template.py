"""Chat messages to a prompt string through the model's own Jinja template, in a sandbox.

A GGUF carries its chat template (`tokenizer.chat_template`) as Jinja source written by whoever
made the file, so it runs in Jinja2's ImmutableSandboxedEnvironment: no underscore attributes, no
mutating methods, capped ranges. Where the stock sandbox would quietly print nothing for a
forbidden attribute, ours raises at once, so a hostile template fails with a clear error instead
of rendering something subtly different. The environment mirrors what HF transformers gives
templates (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a
`tojson` that does not HTML-escape), so a template renders here as it does there.

A file without a template gets its family's known turn format (FAMILY_TEMPLATES), else ChatML
(llama.cpp's fallback too).

Rendering has limits, because a template is code from the file: RENDER_SECONDS of time (checked
at every loop iteration and every call) and MAX_TEXT characters for the output and for any string
or list a `*` or `+` builds; `**` may not build integers beyond MAX_INT_BITS. Going over one, and
any failure (MemoryError, RecursionError, ...), is a ChatTemplateError; at compile time too.

`render_parts` tells the template's own markup from the messages' content, so that the engine can
tokenize content as plain text: control tokens written in a message are not control tokens.

Tools (OpenAI's `tools` list) go to a template that renders them as the `tools` variable, with
assistant messages' `tool_calls` and `tool` messages as they are; a template that knows no tools
gets them, and the conversation's calls and answers, as text (tool_calls.plain_messages).
"""

from __future__ import annotations

import functools
import json
import secrets
import threading
import time
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import AirframeError, ParameterError
from .tool_calls import HERMES, call_format, knows_tools, plain_messages

# Gemma's turn format: there is no system role, so a system message becomes the start of the
# first user turn; the assistant is called "model".
GEMMA_TEMPLATE = """{{ bos_token }}
{%- set system = messages[0]['content'] ~ '\n\n' if messages and messages[0]['role'] == 'system' else '' -%}
{%- set turns = messages[1:] if system else messages -%}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 is even) -%}
{{ raise_exception('Gemma turns must alternate user, assistant, user, ...; message ' ~ loop.index ~ ' has role ' ~ message['role']) }}
{%- endif -%}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}
{{ system if loop.first else '' }}{{ message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}
"""

CHATML_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

FAMILY_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}
ROLES = ("system", "user", "assistant", "tool")

RENDER_SECONDS = 2.0  # a real template renders in milliseconds
MAX_TEXT = 16 * 2**20  # characters (or list items): far beyond any context's worth of text
MAX_INT_BITS = 4096
_LOOP_GUARD = "airframe_loop_guard"  # the global every for-loop's iterable is passed through


class ChatTemplateError(AirframeError):
    """A chat template is malformed, does something the sandbox forbids, or fails to render."""


class _LimitError(Exception):
    """A render went over one of the limits (caught and reported as a ChatTemplateError)."""


_deadline = threading.local()  # .at: time.monotonic() by which the render on this thread must end


def _check_time() -> None:
    at = getattr(_deadline, "at", None)
    if at is not None and time.monotonic() > at:
        raise _LimitError(f"rendering took longer than {RENDER_SECONDS:g} s, expected a template that ends")


def _loop_guard(iterable):
    for item in iterable:
        _check_time()
        yield item


def _check_call(args: tuple, kwargs: dict) -> None:
    """The time, and no count or width beyond MAX_TEXT (`ljust`, `center`...), before a call."""
    _check_time()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and value > MAX_TEXT:
            raise _LimitError(f"a call with the argument {value}, expected numbers up to {MAX_TEXT}")


def _guarded_filter(function):
    @functools.wraps(function)  # keeps Jinja's pass_context / pass_environment marks
    def guarded(*args, **kwargs):
        _check_call(args, kwargs)
        return function(*args, **kwargs)

    return guarded


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_binop(operator: str, left, right) -> None:
    """Refuse a `*`, `+` or `**` whose result would be over the limits, before it is built."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            size = _size(seq)
            if size is not None and isinstance(n, int) and size * n > MAX_TEXT:
                raise _LimitError(f"a product of {size} items by {n} = {size * n}, expected at most {MAX_TEXT}")
    elif operator == "+":
        a, b = _size(left), _size(right)
        if a is not None and b is not None and a + b > MAX_TEXT:
            raise _LimitError(f"a concatenation of {a + b} items, expected at most {MAX_TEXT}")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * left.bit_length() > MAX_INT_BITS:
            raise _LimitError(f"a power of about {right * left.bit_length()} bits, expected at most {MAX_INT_BITS}")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but a forbidden attribute raises instead of rendering as empty, with
    the time and size limits checked at every loop iteration, call and product."""

    intercepted_binops = frozenset({"*", "+", "**"})  # also keeps them out of compile-time folding

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of an object of type {type(obj).__name__!r}")

    def call_binop(self, context, operator: str, left, right):
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - the sandbox's own signature
        _check_call(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
        return tree


def _raise_exception(message: str):
    raise ParameterError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.filters.update({name: _guarded_filter(f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals[_LOOP_GUARD] = _loop_guard
    return env


class ChatTemplate:
    """One compiled template plus the special tokens it may print.

    `origin` (which may name the file) is for errors at load; errors while rendering a request
    name only `name`, so that a client never learns the server's paths.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "template",
                 name: str = "the chat template"):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        self.name = name
        if not isinstance(source, str):
            raise ChatTemplateError(f"{origin}: a chat template of type {type(source).__name__}, expected a string")
        try:
            self._template = make_environment().from_string(source)
        except Exception as e:  # TemplateSyntaxError, and MemoryError or RecursionError on hostile source
            raise ChatTemplateError(f"{origin}: cannot compile the chat template: {type(e).__name__}: {e}"[:500]) from None
        self.knows_tools = knows_tools(source)
        # A template without tools is taught the Hermes format by plain_messages.
        self.tool_format = call_format(source) if self.knows_tools else HERMES

    @classmethod
    def for_model(cls, source: str | None, family: str, bos_token: str, eos_token: str,
                  origin: str) -> "ChatTemplate":
        """The file's own template, or the family's known format when the file has none."""
        if source is not None and (not isinstance(source, str) or source):
            return cls(source, bos_token, eos_token, f"{origin} tokenizer.chat_template", "the model's chat template")
        fallback = FAMILY_TEMPLATES.get(family, CHATML_TEMPLATE)
        name = f"the built-in {family} chat format"
        return cls(fallback, bos_token, eos_token, name, name)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **extra) -> str:
        normal, extra = self._with_tools(normalize_messages(messages), tools, extra)
        return self._render(normal, add_generation_prompt, extra)

    def render_parts(self, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None) -> list[tuple[str, bool]] | None:
        """The rendered prompt as (text, is_content) runs: True where the text is a message's
        content, False for the template's own markup. None where the template transforms content
        in a way that loses track of it (then only render() is known)."""
        normal, extra = self._with_tools(normalize_messages(messages), tools, {})
        plain = self._render(normal, add_generation_prompt, extra)
        tag = secrets.token_hex(8)  # unguessable: a message cannot forge the marks
        start, end = f"\ue000{tag}\ue001", f"\ue002{tag}\ue003"
        marked = [dict(m, content=_mark(m["content"], start, end)) for m in normal]
        parts = _split_marked(self._render(marked, add_generation_prompt, extra), start, end)
        if parts is None or "".join(text for text, _ in parts) != plain:
            return None
        return parts

    def _with_tools(self, messages: list[dict], tools: list[dict] | None, extra: dict) -> tuple[list[dict], dict]:
        """The messages and variables to render: the tools as they are, or as text (plain_messages)."""
        if self.knows_tools:
            return messages, dict(extra, tools=tools) if tools else extra
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            return plain_messages(messages, tools), extra
        return messages, extra

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        context = dict(extra, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        _deadline.at = time.monotonic() + RENDER_SECONDS
        try:
            out, size = [], 0
            for chunk in self._template.generate(**context):
                size += len(chunk)
                if size > MAX_TEXT:
                    raise _LimitError(f"the rendered prompt is over {MAX_TEXT} characters, expected at most {MAX_TEXT}")
                out.append(chunk)
            return "".join(out)
        except ParameterError:
            raise
        except _LimitError as e:
            raise ChatTemplateError(f"{self.name} went over a limit: {e}") from None
        except SecurityError as e:
            raise ChatTemplateError(f"{self.name}: the sandbox refused {e}") from None
        except Exception as e:  # templates fail in many ways (TypeError, OverflowError, MemoryError, ...)
            raise ChatTemplateError(f"{self.name}: rendering failed: {type(e).__name__}: {e}"[:500]) from None
        finally:
            _deadline.at = None


def _mark(content: str, start: str, end: str) -> str:
    """Content between the marks, its leading and trailing whitespace outside them, so that a
    template's `trim` still removes exactly that whitespace."""
    core = content.strip()
    if not core:
        return content
    lead = content[:len(content) - len(content.lstrip())]
    trail = content[len(content.rstrip()):]
    return f"{lead}{start}{core}{end}{trail}"


def _split_marked(text: str, start: str, end: str) -> list[tuple[str, bool]] | None:
    """(text, is_content) runs of a render with marked content; None if the marks are not in pairs."""
    parts: list[tuple[str, bool]] = []
    pos = 0
    while (i := text.find(start, pos)) >= 0:
        j = text.find(end, i)
        if j < 0 or start in text[i + len(start):j] or end in text[pos:i]:
            return None
        parts += [(text[pos:i], False), (text[i + len(start):j], True)]
        pos = j + len(end)
    if end in text[pos:]:
        return None
    parts.append((text[pos:], False))
    return [(t, is_content) for t, is_content in parts if t]


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Check roles and flatten OpenAI content parts ([{type: text, text: ...}]) into one string."""
    if not isinstance(messages, list) or not messages:
        raise ParameterError(f"messages = {messages!r:.80}, expected a non-empty list of {{role, content}}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            found = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise ParameterError(f"message {i}: role {found!r}, expected one of {', '.join(ROLES)}")
        out.append(dict(message, content=_content_text(i, message.get("content"))))
    return out


def _content_text(i: int, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ParameterError(f"message {i}: content part {part!r:.80}, expected {{type: text, text: ...}}")
            texts.append(part["text"])
        return "".join(texts)
    raise ParameterError(f"message {i}: content {content!r:.80}, expected a string or a list of text parts")
