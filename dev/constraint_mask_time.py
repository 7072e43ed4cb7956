"""The host cost of structured output per token: llguidance's mask for a JSON schema, and the
whole Constraint step airframe runs (mask, -inf applied to the logits, advance), over a real
vocabulary. No model runs: the tokens are those of a fixed answer that keeps to the schema.

    PYTHONPATH=. python dev/constraint_mask_time.py smollm2-135m gemma3-270m
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from airframe.constraint import Constraint, grammar_tokenizer, json_schema_grammar
from airframe.model import open_model
from airframe.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], "address": {"city": "London", "zip": "W1"}}
ROUNDS = 5


def measure(name: str) -> None:
    tokenizer = load_tokenizer(open_model(name).gguf)
    started = time.perf_counter()
    grammar_tokenizer(tokenizer)
    built = time.perf_counter() - started
    grammar = json_schema_grammar(SCHEMA)
    tokens = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special=False)
    logits = np.random.default_rng(0).normal(size=tokenizer.vocab_size).astype(np.float32)
    masks, steps = [], []
    for _ in range(ROUNDS):
        constraint = Constraint(grammar, tokenizer)
        for token in tokens:
            t0 = time.perf_counter()
            constraint.allowed()  # llguidance's bitmask, unpacked to one bool per token
            t1 = time.perf_counter()
            constraint.mask(logits)  # the same mask again, applied: what the sampler runs
            constraint.advance(token)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            steps.append(t2 - t1)
        assert constraint.done, "the answer does not complete the schema"
    print(f"{name}: vocabulary {tokenizer.vocab_size}, llguidance tokenizer built in {built:.2f} s, "
          f"{len(tokens)} tokens x {ROUNDS}: mask median {1e3 * statistics.median(masks):.3f} ms "
          f"(max {1e3 * max(masks):.3f}), whole step median {1e3 * statistics.median(steps):.3f} ms "
          f"(max {1e3 * max(steps):.3f})")


if __name__ == "__main__":
    for model in sys.argv[1:] or ["smollm2-135m", "gemma3-270m"]:
        measure(model)
