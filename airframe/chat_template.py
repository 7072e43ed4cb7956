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
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import AirframeError, ParameterError

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


class ChatTemplateError(AirframeError):
    """A chat template is malformed, does something the sandbox forbids, or fails to render."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but a forbidden attribute raises instead of rendering as empty."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of an object of type {type(obj).__name__!r}")


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
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template plus the special tokens it may print."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "template"):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = make_environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"{origin}: cannot compile the chat template: {e}") from None

    @classmethod
    def for_model(cls, source: str | None, family: str, bos_token: str, eos_token: str,
                  origin: str) -> "ChatTemplate":
        """The file's own template, or the family's known format when the file has none."""
        if source:
            return cls(source, bos_token, eos_token, f"{origin} tokenizer.chat_template")
        fallback = FAMILY_TEMPLATES.get(family, CHATML_TEMPLATE)
        return cls(fallback, bos_token, eos_token, f"built-in {family} chat format")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        context = dict(extra, messages=normalize_messages(messages),
                       add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self._template.render(**context)
        except ParameterError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"{self.origin}: the sandbox refused {e}") from None
        except Exception as e:  # templates fail in many ways (TypeError, OverflowError, ...)
            raise ChatTemplateError(f"{self.origin}: rendering failed: {type(e).__name__}: {e}") from None


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
