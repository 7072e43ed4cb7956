"""The backend seam: one check of token ids and context for every backend, and the backend by name."""

import numpy as np
import pytest

from airframe.backend import check_tokens, open_backend
from airframe.errors import ContextOverflowError, ParameterError
from airframe.model import open_model
from airframe.options import RunOptions


def test_ids_that_fit_come_back_as_int64():
    ids = check_tokens([3, np.uint32(4), 9], n_past=2, n_ctx=5, vocab_size=10)
    assert ids.dtype == np.int64 and ids.tolist() == [3, 4, 9]


@pytest.mark.parametrize("tokens,message", [
    ([], r"token ids of shape \(0,\), expected a non-empty 1-D sequence"),
    ([[1, 2]], r"token ids of shape \(1, 2\), expected a non-empty 1-D sequence"),
    ([[1], [2, 3]], "uneven nesting"),
    ([1.5], "token ids of type float64, expected integers"),
    ([True], "token ids of type bool, expected integers"),
    ([4, 10], "token id 10 is outside the vocabulary 0..9"),
    ([-2, 3], "token id -2 is outside the vocabulary 0..9"),
])
def test_bad_ids_are_parameter_errors(tokens, message):
    with pytest.raises(ParameterError, match=message) as raised:
        check_tokens(tokens, n_past=0, n_ctx=8, vocab_size=10)
    assert not isinstance(raised.value, ContextOverflowError)


def test_ids_that_do_not_fit_are_a_context_overflow():
    with pytest.raises(ContextOverflowError, match=r"5 cached \+ 4 new positions = 9 do not fit in the context of 8"):
        check_tokens([1, 2, 3, 4], n_past=5, n_ctx=8, vocab_size=10)


def test_an_unknown_backend_is_named(smollm2_path):
    with pytest.raises(ParameterError, match="unknown backend 'metal'; choose one of webgpu, reference, cuda"):
        open_backend("metal", open_model(smollm2_path), RunOptions())
