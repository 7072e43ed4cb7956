"""The host cost of structured output per token over a real vocabulary: a grammar library's mask
for a JSON schema, and the whole step (mask, -inf applied to the logits, advance). No model runs:
the tokens are those of a fixed answer that keeps to the schema. llguidance runs through
airframe's Constraint (what a constrained request runs); outlines-core and xgrammar, when
installed, get the same token bytes, schema and tokens, for the comparison in docs/BENCHMARKS.md.

    PYTHONPATH=. python dev/constraint_mask_time.py smollm2-135m gemma3-270m
    PYTHONPATH=. python dev/constraint_mask_time.py --library xgrammar gemma3-270m
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import numpy as np

from airframe.constraint import Constraint, _VocabularyBytes, grammar_tokenizer, json_schema_grammar
from airframe.model import open_model
from airframe.tokenizer import GGUFTokenizer, load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], "address": {"city": "London", "zip": "W1"}}
ROUNDS = 5
XGRAMMAR_THREADS = 1  # the 2-core machine is shared; llguidance and outlines-core build on one thread too


def plain_tokens(tokenizer: GGUFTokenizer) -> list[bytes | None]:
    """Every token's raw bytes as llguidance reads them; None for the control, unknown and
    end-of-generation tokens, which no grammar text produces."""
    vocabulary = _VocabularyBytes(tokenizer)
    special = set(vocabulary.special_token_ids)
    return [None if i in special else token for i, token in enumerate(vocabulary.tokens)]


def unpacked(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """(vocab_size,) bool from a bitmask of 32-bit words, bit i % 32 of word i // 32 for token i."""
    bits = np.frombuffer(np.ascontiguousarray(words, dtype=np.int32).tobytes(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)


# ---- one small adapter per library: build(tokenizer) -> compile(built) -> matcher() --------------
# A matcher has allowed() (one bool per token), advance(token) and done.

class _LLGuidance:
    module = "llguidance"

    def __init__(self, tokenizer: GGUFTokenizer):
        self.tokenizer = tokenizer
        grammar_tokenizer(tokenizer)  # cached: every Constraint below reuses it

    def compile(self):
        grammar = json_schema_grammar(SCHEMA)  # llguidance compiles lazily, inside the first mask
        return lambda: Constraint(grammar, self.tokenizer)


class _OutlinesGuide:
    def __init__(self, guide, vocab_size: int):
        self.guide = guide
        self.vocab_size = vocab_size
        self.words = np.zeros(-(-vocab_size // 32), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        self.guide.write_mask_into(self.words.ctypes.data, self.words.size, self.words.itemsize)
        return unpacked(self.words, self.vocab_size)

    def advance(self, token: int) -> None:
        self.guide.advance(int(token), return_tokens=False)  # the list of next tokens would cost a mask

    @property
    def done(self) -> bool:
        return self.guide.is_finished()


class _OutlinesCore:
    module = "outlines_core"

    def __init__(self, tokenizer: GGUFTokenizer):
        import outlines_core
        self.library = outlines_core
        self.vocab_size = tokenizer.vocab_size
        ids: dict[bytes, list[int]] = {}
        for i, token in enumerate(plain_tokens(tokenizer)):
            if token:  # outlines-core takes no control tokens and no empty ones
                ids.setdefault(token, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_id, ids)

    def compile(self):
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(SCHEMA), "")  # "": no whitespace, like the others
        index = self.library.Index(regex, self.vocabulary)  # the regex's DFA crossed with the vocabulary
        return lambda: _OutlinesGuide(self.library.Guide(index), self.vocab_size)


class _XGrammarMatcher:
    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self.words)
        return unpacked(self.words, self.vocab_size)

    def advance(self, token: int) -> None:
        assert self.matcher.accept_token(int(token)), f"xgrammar rejected token {token}"

    @property
    def done(self) -> bool:
        return self.matcher.is_completed()


class _XGrammar:
    module = "xgrammar"

    def __init__(self, tokenizer: GGUFTokenizer):
        import xgrammar
        self.library = xgrammar
        self.vocab_size = tokenizer.vocab_size
        # xgrammar's special tokens are the empty ones, so the control tokens are given as b""
        encoded = [token or b"" for token in plain_tokens(tokenizer)]
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                                      stop_token_ids=sorted(tokenizer.eog_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=XGRAMMAR_THREADS, cache_enabled=False)

    def compile(self):
        compiled = self.compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":"))
        return lambda: _XGrammarMatcher(self.library.GrammarMatcher(compiled), self.vocab_size)


LIBRARIES = {"llguidance": _LLGuidance, "outlines-core": _OutlinesCore, "xgrammar": _XGrammar}


def _ms(seconds: list[float]) -> str:
    return f"median {1e3 * statistics.median(seconds):.3f} ms (max {1e3 * max(seconds):.3f})"


def measure(library: str, name: str) -> None:
    tokenizer = load_tokenizer(open_model(name).gguf)
    adapter = LIBRARIES[library]
    t = time.perf_counter()
    plain_tokens(tokenizer)  # timed alone: every library's build below reads the token bytes again
    started = time.perf_counter()
    importlib.import_module(adapter.module)  # timed apart: xgrammar's import is torch's
    t0 = time.perf_counter()
    built = adapter(tokenizer)
    t1 = time.perf_counter()
    new_matcher = built.compile()
    t2 = time.perf_counter()
    tokens = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special=False)
    logits = np.random.default_rng(0).normal(size=tokenizer.vocab_size).astype(np.float32)
    masks, steps = [], []
    for _ in range(ROUNDS):
        matcher = new_matcher()
        for token in tokens:
            s0 = time.perf_counter()
            allowed = matcher.allowed()
            s1 = time.perf_counter()
            np.where(matcher.allowed(), logits, -np.inf)  # the same mask again, applied: what the sampler runs
            matcher.advance(token)
            s2 = time.perf_counter()
            masks.append(s1 - s0)
            steps.append(s2 - s1)
            assert allowed[token], f"{library} masks token {token} of the answer"
        assert matcher.done, f"{library}: the answer does not complete the schema"
    print(f"{library} {name}: vocabulary {tokenizer.vocab_size}, token bytes read in {started - t:.2f} s, "
          f"imported in {t0 - started:.2f} s, "
          f"tokenizer built in {t1 - t0:.2f} s, "
          f"schema compiled in {t2 - t1:.2f} s, {len(tokens)} tokens x {ROUNDS}: mask {_ms(masks)}, "
          f"whole step {_ms(steps)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=sorted(LIBRARIES), default="llguidance")
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    args = parser.parse_args()
    for model in args.models:
        measure(args.library, model)
