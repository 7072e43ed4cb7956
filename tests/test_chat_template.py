"""Chat templates: the GGUF's own template as plain Jinja2 would render it, Gemma's built-in turn
format, and hostile templates refused by the sandbox."""

import datetime
import json
import os
import re
import time
from pathlib import Path

import jinja2
import pytest

from airframe import chat_template, tool_calls
from airframe.chat_template import ChatTemplate, ChatTemplateError, normalize_messages
from airframe.errors import ModelNotFoundError, ParameterError
from airframe.gguf_file import GGUFFile
from airframe.models import resolve_model

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def smollm2_file():
    return GGUFFile(resolve_model("smollm2-135m"))


def special(gf: GGUFFile, key: str) -> str:
    return gf.get("tokenizer.ggml.tokens")[gf.get(key)]


def plain_jinja(source: str, **context) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(source).render(**context)


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["system+user", "user only"])
def test_smollm2_template_renders_as_plain_jinja2_does(smollm2_file, messages):
    source = smollm2_file.get("tokenizer.chat_template")
    bos, eos = special(smollm2_file, "tokenizer.ggml.bos_token_id"), special(smollm2_file, "tokenizer.ggml.eos_token_id")
    template = ChatTemplate.for_model(source, "llama", bos, eos, "smollm2")
    ours = template.render(messages, add_generation_prompt=True)
    plain = plain_jinja(source, messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    assert ours == plain
    assert ours.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>\n" in ours


def test_gemma3_file_has_no_template_and_gets_the_gemma_turn_format():
    gf = GGUFFile(resolve_model("gemma3-270m"))
    assert gf.get("tokenizer.chat_template") is None
    template = ChatTemplate.for_model(None, "gemma3", "<bos>", "<eos>", "gemma3")
    messages = CONVERSATION + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    assert template.render(messages) == (
        "<bos><start_of_turn>user\nYou answer in one short sentence.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd Spain?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert template.render(CONVERSATION[1:], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n")


def test_gemma_refuses_turns_that_do_not_alternate():
    template = ChatTemplate.for_model(None, "gemma3", "<bos>", "<eos>", "gemma3")
    with pytest.raises(ParameterError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_family_without_a_known_format_falls_back_to_chatml():
    template = ChatTemplate.for_model(None, "llama", "<s>", "</s>", "test")
    assert template.render(CONVERSATION[1:]) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ self._TemplateReference__context }}",
    "{{ '{0.__class__}'.format(1) }}",
    "{% set l = [] %}{{ l.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_hostile_templates_are_refused_with_a_clear_error(source):
    with pytest.raises(ChatTemplateError, match="sandbox refused access to attribute"):
        ChatTemplate(source, origin="hostile").render(CONVERSATION)


def test_a_huge_range_is_refused():
    with pytest.raises(ChatTemplateError, match="went over a limit.*1000000000"):
        ChatTemplate("{% for i in range(10**9) %}x{% endfor %}", origin="hostile").render(CONVERSATION)


def test_a_broken_template_names_its_origin():
    with pytest.raises(ChatTemplateError, match="model.gguf.*cannot compile"):
        ChatTemplate("{% for %}", origin="model.gguf")


def test_template_helpers():
    source = ("{{ messages | tojson }}|{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}"
              "{% if add_generation_prompt %}|gen{% endif %}")
    out = ChatTemplate(source, "<s>", "</s>").render([{"role": "user", "content": "é <b>"}])
    text, year, rest = out.split("|", 2)
    assert json.loads(text) == [{"role": "user", "content": "é <b>"}]  # not HTML-escaped
    assert "é <b>" in text
    assert year == str(datetime.date.today().year)
    assert rest == "<s></s>|gen"


def test_raise_exception_becomes_a_parameter_error():
    with pytest.raises(ParameterError, match="refused the conversation: no tools here"):
        ChatTemplate("{{ raise_exception('no tools here') }}").render(CONVERSATION)


def test_messages_are_checked_and_content_parts_flattened():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert normalize_messages(parts)[0]["content"] == "ab"
    with pytest.raises(ParameterError, match="role 'wizard'"):
        normalize_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(ParameterError, match="non-empty list"):
        normalize_messages([])
    with pytest.raises(ParameterError, match="content part"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


# ---- render limits: a template is code from the file ----------------------------------------------
@pytest.fixture
def quick_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)


@pytest.mark.parametrize("source", [
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% set r = range(100000) | list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
], ids=["nested ranges", "nested lists", "branching recursion"])
def test_a_template_that_runs_too_long_is_stopped(quick_limit, source):
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="the model's chat template went over a limit: rendering took longer than 0.2 s"):
        ChatTemplate.for_model(source, "llama", "", "", "/models/private/model.gguf").render(CONVERSATION)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("source, found", [
    ('{{ "a" * 1000000000 }}', "a product of 1 items by 1000000000"),
    ("{{ [1, 2] * 100000000 }}", "a product of 2 items by 100000000"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a concatenation of 33554432 items"),
    ("{{ 10 ** 1000000 }}", "a power of about 4000000 bits"),
    ("{{ 'a' | center(1000000000) }}", "a call with the argument 1000000000"),
    ("{{ 'a'.ljust(1000000000) }}", "a call with the argument 1000000000"),
], ids=["string product", "list product", "doubling", "power", "filter width", "method width"])
def test_a_template_that_builds_too_much_is_refused_before_building_it(source, found):
    # compiling works (a product is not folded into a constant at compile time); rendering refuses
    template = ChatTemplate(source, origin="/models/private/model.gguf")
    with pytest.raises(ChatTemplateError, match=re.escape(found)) as info:
        template.render(CONVERSATION)
    assert "/models/private" not in str(info.value)


def test_endless_recursion_is_a_clear_error():
    source = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    with pytest.raises(ChatTemplateError, match="rendering failed: RecursionError"):
        ChatTemplate(source).render(CONVERSATION)


def test_a_template_that_cannot_compile_is_refused_at_load_naming_the_file():
    with pytest.raises(ChatTemplateError, match="model.gguf tokenizer.chat_template: cannot compile.*RecursionError"):
        ChatTemplate.for_model("{{" + "(" * 5000 + "1" + ")" * 5000 + "}}", "llama", "", "", "model.gguf")
    with pytest.raises(ChatTemplateError, match="model.gguf tokenizer.chat_template: a chat template of type list"):
        ChatTemplate.for_model(["{{ x }}"], "llama", "", "", "model.gguf")


def test_a_sandbox_refusal_does_not_show_the_file_path():
    template = ChatTemplate.for_model("{{ ''.__class__ }}", "llama", "", "", "/models/private/model.gguf")
    with pytest.raises(ChatTemplateError) as info:
        template.render(CONVERSATION)
    assert str(info.value).startswith("the model's chat template: the sandbox refused")
    assert "/models/private" not in str(info.value)


def test_the_output_size_is_limited(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_TEXT", 1000)
    with pytest.raises(ChatTemplateError, match="the rendered prompt is over 1000 characters"):
        ChatTemplate("{% for i in range(200) %}{{ messages[0]['content'] }}{% endfor %}").render(CONVERSATION)


# ---- markup and content told apart -----------------------------------------------------------------
def test_render_parts_joins_to_render_and_marks_only_content():
    template = ChatTemplate.for_model(None, "llama", "<s>", "</s>", "test")
    messages = [{"role": "user", "content": "  <|im_end|>hi  "}]
    parts = template.render_parts(messages)
    assert "".join(text for text, _ in parts) == template.render(messages)
    assert [text for text, is_content in parts if is_content] == ["<|im_end|>hi"]


def test_render_parts_follows_a_template_that_trims_content():
    template = ChatTemplate.for_model(None, "gemma3", "<bos>", "<eos>", "gemma3")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\n <end_of_turn> x \n"}]
    parts = template.render_parts(messages)
    assert "".join(text for text, _ in parts) == template.render(messages)
    assert [text for text, is_content in parts if is_content] == ["Be brief.", "<end_of_turn> x"]


def test_render_parts_gives_up_on_a_template_that_cuts_content():
    source = "{% for m in messages %}<|im_start|>{{ m['content'][:3] }}<|im_end|>{% endfor %}"
    assert ChatTemplate(source).render_parts([{"role": "user", "content": "abcdef"}]) is None


# ---- tools ----------------------------------------------------------------------------------------

TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
ANSWERED = {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1", "name": "get_weather"}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "</s>", "<end_of_turn>")


def qwen_template() -> ChatTemplate:
    try:
        path = resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError:
        pytest.skip("needs the Qwen2.5-Coder 0.5B model: airframe pull qwen2.5-coder-0.5b")
    gf = GGUFFile(path)
    return ChatTemplate.for_model(gf.get("tokenizer.chat_template"), "qwen2", "", "<|im_end|>", "qwen")


def smollm2_template() -> ChatTemplate:
    gf = GGUFFile(resolve_model("smollm2-135m"))
    return ChatTemplate.for_model(gf.get("tokenizer.chat_template"), "llama", special(gf, "tokenizer.ggml.bos_token_id"),
                                  special(gf, "tokenizer.ggml.eos_token_id"), "smollm2")


TOOL_TEMPLATES = {
    "qwen": qwen_template,
    "smollm2": smollm2_template,
    "gemma3": lambda: ChatTemplate.for_model(None, "gemma3", "<bos>", "<eos>", "gemma3"),
    "chatml": lambda: ChatTemplate.for_model(None, "llama", "", "", "chatml"),
    "llama3": lambda: ChatTemplate((TEMPLATES / "llama3_tools.jinja").read_text(), "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": lambda: ChatTemplate((TEMPLATES / "mistral_tools.jinja").read_text(), "<s>", "</s>"),
}
EXPECTED_FORMAT = {"qwen": tool_calls.HERMES, "smollm2": tool_calls.HERMES, "gemma3": tool_calls.HERMES,
                   "chatml": tool_calls.HERMES, "llama3": tool_calls.LLAMA3, "mistral": tool_calls.MISTRAL}


@pytest.fixture(params=list(TOOL_TEMPLATES))
def tool_template(request):
    return request.param, TOOL_TEMPLATES[request.param]()


def test_each_template_gets_its_tool_format(tool_template):
    name, template = tool_template
    assert template.tool_format == EXPECTED_FORMAT[name]
    assert template.knows_tools == (name in ("qwen", "llama3", "mistral"))


def test_the_tools_are_rendered_in_the_prompt(tool_template):
    _, template = tool_template
    prompt = template.render(ASKED, tools=[WEATHER])
    assert '"get_weather"' in prompt and "The current weather in a city." in prompt and '"city"' in prompt
    assert "What is the weather in Paris?" in prompt
    assert "get_weather" not in template.render(ASKED)  # no tools: not a word of them


def test_a_past_call_renders_in_the_format_its_parser_reads(tool_template):
    """The assistant's turn holding a call, cut out of the render, parses back to that call: the
    template teaches the model the format airframe reads."""
    _, template = tool_template
    before = template.render(ASKED, tools=[WEATHER])
    after = template.render(ASKED + [CALLED], add_generation_prompt=False, tools=[WEATHER])
    common = len(os.path.commonprefix([before, after]))
    turn = after[common:]
    for end in END_OF_TURN:
        turn = turn.replace(end, "")
    parsed = tool_calls.parse(turn, template.tool_format, {"get_weather"})
    assert parsed.calls == [tool_calls.ToolCall("get_weather", {"city": "Paris"})], turn


def test_a_tool_answer_is_rendered_after_the_call(tool_template):
    _, template = tool_template
    prompt = template.render(ASKED + [CALLED, ANSWERED], tools=[WEATHER])
    call_at = prompt.index("Paris", prompt.index("What is the weather in Paris?") + 30)
    assert prompt.index("sunny, 21 C") > call_at
    parts = template.render_parts(ASKED + [CALLED, ANSWERED], tools=[WEATHER])
    assert parts is not None and "".join(t for t, _ in parts) == prompt
    assert any(is_content and "sunny, 21 C" in t for t, is_content in parts)  # tokenized as plain text


def test_the_qwen_template_renders_tools_as_the_qwen_docs_show():
    template = qwen_template()
    prompt = template.render(ASKED + [CALLED, ANSWERED], tools=[WEATHER])
    assert prompt.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                             "\n\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n') in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_gemma_keeps_alternating_turns_with_tool_answers():
    template = TOOL_TEMPLATES["gemma3"]()
    second = {"role": "tool", "content": "windy", "tool_call_id": "call_2"}
    two_calls = dict(CALLED, tool_calls=CALLED["tool_calls"] * 2)
    prompt = template.render(ASKED + [two_calls, ANSWERED, second], tools=[WEATHER])
    assert prompt.count("<start_of_turn>user") == 2  # both answers in one user turn
    assert "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>" in prompt
