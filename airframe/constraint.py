"""Constrained decoding: a JSON schema, any JSON object, or a grammar, enforced token by token.

A `Grammar` is what a request asks for, turned into llguidance's grammar text; a `Constraint` is
that grammar's state for one answer. Before the sampler chain runs, the constraint masks every
token the grammar does not allow next (-inf), so greedy and sampled requests alike can only pick
allowed tokens; each accepted token advances it; once the grammar is complete (`done`) the answer
ends with finish_reason "stop". A device that reduces the logits to candidates applies the same
mask there, as a bitset (`allowed_words`): the WebGPU backend chains constrained tokens on the GPU
(airframe/gpu/sampled.py); elsewhere the host masks the full logits.

llguidance (https://github.com/guidance-ai/llguidance, used by llama.cpp and vLLM) computes the
masks: it reads the vocabulary as raw token bytes, so the GGUF's own tokens are the tokenizer.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np

from .errors import ParameterError
from .tokenizer import GGUFTokenizer, TokenType

try:
    import llguidance as llg
except ImportError:  # the rest of airframe runs without it; a constrained request says why not
    llg = None

SPECIAL_MARK = b"\xff"  # llguidance's prefix for a control token: no grammar text can produce one


@dataclass(frozen=True)
class Grammar:
    """A request's constraint as llguidance grammar text; `kind` says where it came from."""

    kind: str  # "json_schema" | "json_object" | "grammar"
    text: str

    @property
    def what(self) -> str:
        """The kind in an error message's words."""
        return self.kind.replace("_", " ")


def _library():
    if llg is None:
        raise ParameterError("structured output needs the llguidance package; expected it installed "
                             "(pip install llguidance)")
    return llg


def json_schema_grammar(schema) -> Grammar:
    """The grammar of the JSON documents `schema` (a dict, or its JSON text) allows."""
    lib = _library()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ParameterError(f"JSON schema is not valid JSON: {e}") from None
    if schema is True:  # JSON Schema's "anything"
        schema = {}
    if not isinstance(schema, dict):
        raise ParameterError(f"JSON schema {schema!r:.40}, expected a JSON object (or true)")
    try:
        # compact JSON unless the schema's x-guidance says otherwise: no whitespace runs to loop in
        text = lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise ParameterError(f"JSON schema cannot be compiled: {e}") from None
    return _checked(Grammar("json_schema", text))


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's response_format json_object)."""
    grammar = json_schema_grammar({"type": "object"})
    return Grammar("json_object", grammar.text)


def text_grammar(text: str) -> Grammar:
    """A GBNF grammar (llama.cpp's format, `root ::= ...`) or a Lark grammar (llguidance's)."""
    lib = _library()
    if not isinstance(text, str) or not text.strip():
        raise ParameterError(f"grammar = {text!r}, expected GBNF or Lark grammar text")
    try:
        grammar = Grammar("grammar", lib.grammar_from("grammar", text))
    except (ValueError, TypeError) as e:
        raise ParameterError(f"grammar cannot be parsed: {e}") from None
    return _checked(grammar)


def _checked(grammar: Grammar, tokenizer: GGUFTokenizer | None = None) -> Grammar:
    """`grammar` once llguidance compiles it: for any vocabulary, or for `tokenizer`'s."""
    vocabulary = () if tokenizer is None else (grammar_tokenizer(tokenizer),)
    error = _library().LLMatcher.validate_grammar(grammar.text, *vocabulary)
    if error:
        raise ParameterError(f"{grammar.what} cannot be compiled: {error}")
    return grammar


# ---- the vocabulary as llguidance sees it ----------------------------------------------------------
_TOKENIZERS: dict[int, object] = {}
_TOKENIZERS_LOCK = threading.Lock()


class _VocabularyBytes:
    """What llguidance.TokenizerWrapper reads from a tokenizer: every token's bytes (control tokens
    marked), the end-of-generation ids, and a way to tokenize text."""

    def __init__(self, tokenizer: GGUFTokenizer):
        special = set(tokenizer.vocab.ids_of_type(TokenType.CONTROL, TokenType.UNKNOWN)) | set(tokenizer.eog_ids)
        self.tokens = [SPECIAL_MARK + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


def grammar_tokenizer(tokenizer: GGUFTokenizer):
    """llguidance's tokenizer for `tokenizer`, built once (about a second for 262,144 tokens)."""
    lib = _library()
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(id(tokenizer))
        if found is None or found[0] is not tokenizer:
            wrapper = lib.TokenizerWrapper(_VocabularyBytes(tokenizer))
            found = (tokenizer, lib.LLTokenizer(wrapper, eos_token=sorted(tokenizer.eog_ids)))
            _TOKENIZERS[id(tokenizer)] = found
        return found[1]


def check_grammar(grammar: Grammar, tokenizer: GGUFTokenizer) -> None:
    """ParameterError with llguidance's reason when `grammar` does not compile for this vocabulary."""
    _checked(grammar, tokenizer)


class Constraint:
    """One answer's place in a grammar: the mask of the tokens allowed next, advanced per token."""

    def __init__(self, grammar: Grammar, tokenizer: GGUFTokenizer):
        lib = _library()
        self.grammar = grammar
        self._matcher = lib.LLMatcher(grammar_tokenizer(tokenizer), grammar.text, log_level=0)
        self._raise_on_error()
        self.vocab_size = tokenizer.vocab_size

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise ParameterError(f"{self.grammar.what}: {self._matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def allowed_words(self, n: int) -> np.ndarray:
        """(ceil(n / 32),) uint32: bit i % 32 of word i // 32 set where the grammar allows token i
        next, over n logits (ids past the vocabulary never)."""
        words = np.zeros(-(-n // 32), dtype=np.uint32)
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32)[:words.size]
        words[:bits.size] = bits
        end = min(n, self.vocab_size)  # no token at or past it
        words[-(-end // 32):] = 0
        if end % 32:
            words[end // 32] &= np.uint32((1 << (end % 32)) - 1)
        return words

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with -inf for every token not allowed next (ids past the vocabulary too)."""
        allowed = np.zeros(np.shape(logits)[-1], dtype=bool)
        allowed[:self.vocab_size] = self.allowed()[:allowed.size]
        return np.where(allowed, logits, -np.inf)

    def advance(self, token: int) -> None:
        """Take the token the sampler picked (always one the mask allowed)."""
        if not self._matcher.consume_token(int(token)):
            self._raise_on_error()

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but an end-of-generation token may follow."""
        return self._matcher.is_stopped()
