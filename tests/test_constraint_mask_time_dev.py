"""dev/constraint_mask_time.py's helpers: the token bytes every library is given, and the bitmask
layout the outlines-core and xgrammar rows unpack."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from airframe.constraint import Constraint, json_schema_grammar
from test_constraint import ids, tiny  # noqa: F401 (tiny is a fixture)

SCRIPT = Path(__file__).resolve().parent.parent / "dev" / "constraint_mask_time.py"


@pytest.fixture(scope="module")
def mask_time():
    spec = importlib.util.spec_from_file_location("dev_constraint_mask_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_plain_tokens_leave_out_control_and_end_tokens(mask_time, tiny):  # noqa: F811
    tokens = mask_time.plain_tokens(tiny)
    assert len(tokens) == tiny.vocab_size
    assert tokens[:3] == [None, None, None]  # <unk> <s> </s>
    assert tokens[ids(tiny, "ab")[0]] == b"ab"
    assert tokens[ids(tiny, "<0x7B>")[0]] == b"{"  # a byte token is its one byte


def test_unpacked_reads_llguidance_bit_layout(mask_time, tiny):  # noqa: F811
    constraint = Constraint(json_schema_grammar({"enum": ["ab", "b"]}), tiny)
    constraint.advance(ids(tiny, '"')[0])
    words = constraint.allowed_words(tiny.vocab_size).view(np.int32)
    np.testing.assert_array_equal(mask_time.unpacked(words, tiny.vocab_size), constraint.allowed())
