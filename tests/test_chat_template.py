"""Chat templates: the GGUF's own template as plain Jinja2 would render it, Gemma's built-in turn
format, and hostile templates refused by the sandbox."""

import datetime
import json
import re
import time

import jinja2
import pytest

from airframe import chat_template
from airframe.chat_template import ChatTemplate, ChatTemplateError, normalize_messages
from airframe.errors import ParameterError
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
