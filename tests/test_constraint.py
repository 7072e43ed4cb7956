"""The grammar mask against a tiny vocabulary: which tokens it allows, how it advances and ends."""

import json

import numpy as np
import pytest

from airframe.constraint import Constraint, check_grammar, json_object_grammar, json_schema_grammar, text_grammar
from airframe.errors import ParameterError
from airframe.gguf_file import GGUFFile
from airframe.sampling import History, Sampler, SamplingParams
from airframe.tokenizer import load_tokenizer
from test_tokenizer import write_spm_gguf

# <unk> <s> </s>, then pieces that spell small JSON documents, then the 256 byte tokens
PIECES = ["{", "}", '"', "a", "b", "ab", ":", ",", "1", "2", "true", "[", "]", "x"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokens = ["<unk>", "<s>", "</s>", *PIECES]
    path = write_spm_gguf(tmp_path_factory.mktemp("vocab") / "tiny.gguf", tokens=tokens, scores=[0.0] * len(tokens))
    return load_tokenizer(GGUFFile(path))


def ids(tokenizer, *pieces):
    return [tokenizer.vocab.tokens.index(p) for p in pieces]


def allowed_pieces(constraint, tokenizer):
    return {tokenizer.vocab.tokens[i] for i in np.flatnonzero(constraint.allowed())}


def test_json_object_starts_with_a_brace_only(tiny):
    constraint = Constraint(json_object_grammar(), tiny)
    # the byte token <0x7B> spells "{" too, but llguidance keeps to canonical tokens
    assert allowed_pieces(constraint, tiny) == {"{"}


def test_enum_allows_only_its_values_then_only_the_end(tiny):
    constraint = Constraint(json_schema_grammar({"enum": ["ab", "b"]}), tiny)
    assert allowed_pieces(constraint, tiny) == {'"'}
    constraint.advance(ids(tiny, '"')[0])
    assert {"a", "ab", "b"} <= allowed_pieces(constraint, tiny) <= {"a", "ab", "b", "<0x61>", "<0x62>"}
    for token in ids(tiny, "ab", '"'):
        constraint.advance(token)
    assert constraint.done
    assert allowed_pieces(constraint, tiny) == {"</s>"}  # the end-of-generation id only


def test_mask_sets_disallowed_logits_to_minus_infinity(tiny):
    constraint = Constraint(json_schema_grammar({"type": "boolean"}), tiny)
    logits = np.arange(tiny.vocab_size + 3, dtype=np.float32)  # a model's vocabulary may be padded
    masked = constraint.mask(logits)
    allowed = np.flatnonzero(masked > -np.inf)
    assert ids(tiny, "true")[0] in allowed
    assert np.all(masked[allowed] == logits[allowed])
    assert np.all(allowed < tiny.vocab_size)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_picks_only_allowed_tokens_and_the_answer_validates(tiny, temperature):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 2}},
              "required": ["a"], "additionalProperties": False}
    constraint = Constraint(json_schema_grammar(schema), tiny)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=3),
                      tiny.vocab_size, constraint)
    history = History([1], n_prompt=1)
    logits = np.random.default_rng(0).normal(size=tiny.vocab_size).astype(np.float32)
    logits[ids(tiny, "x")[0]] = 50.0  # the model's favourite is never allowed
    while not constraint.done:
        token = sampler.sample(history, logits)
        assert token != ids(tiny, "x")[0]
        sampler.accept(history, token)  # the constraint advances with the history
        assert len(history.generated) < 40
    assert json.loads(b"".join(tiny.token_bytes(t) for t in history.generated)) in ({"a": 1}, {"a": 2})


@pytest.mark.parametrize("extra", [0, 3, 40])  # a model's vocabulary may be padded
def test_allowed_words_are_the_mask_as_a_bitset(tiny, extra):
    constraint = Constraint(json_schema_grammar({"enum": ["ab", "b"]}), tiny)
    constraint.advance(ids(tiny, '"')[0])
    n = tiny.vocab_size + extra
    words = constraint.allowed_words(n)
    assert words.dtype == np.uint32 and words.size == -(-n // 32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    assert bits[:tiny.vocab_size].tolist() == constraint.allowed().tolist() and not bits[tiny.vocab_size:].any()
    sampler = Sampler(SamplingParams(top_k=5, seed=1), n, constraint)
    assert sampler.reduction(History([1]), 64, 64).allowed.tolist() == words.tolist()  # what a device masks with


def test_gbnf_grammar_limits_the_tokens(tiny):
    constraint = Constraint(text_grammar('root ::= "x" ("1" | "2")'), tiny)
    assert allowed_pieces(constraint, tiny) == {"x"}
    constraint.advance(ids(tiny, "x")[0])
    assert {"1", "2"} <= allowed_pieces(constraint, tiny) <= {"1", "2", "<0x31>", "<0x32>"}
    constraint.advance(ids(tiny, "2")[0])
    assert constraint.done


@pytest.mark.parametrize("make, text", [
    (json_schema_grammar, {"type": "strng"}),
    (json_schema_grammar, {"type": "integer", "minimum": 5, "maximum": 1}),
    (json_schema_grammar, "{not json"),
    (json_schema_grammar, [1, 2]),
    (text_grammar, 'root ::= ("a"'),
    (text_grammar, "root ::= missing-rule"),
    (text_grammar, ""),
])
def test_bad_schemas_and_grammars_say_why(make, text):
    with pytest.raises(ParameterError, match="cannot be|expected|not valid"):
        make(text)


def test_checked_against_a_vocabulary(tiny):
    check_grammar(json_schema_grammar({"type": "array", "items": {"type": "integer"}, "maxItems": 2}), tiny)
