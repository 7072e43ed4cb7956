"""airframe.perplexity: llama.cpp's windowing rule, the formula, and the command on SmolLM2."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from airframe.backend import open_backend
from airframe.cli import main
from airframe.errors import ParameterError
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.perplexity import cut_windows, perplexity, scored_nll, summarize

ENGLISH = Path(__file__).parent / "data" / "english.txt"


class FixedLogits:
    """A fake backend whose logits at every position are `table[token]`: each token predicts a fixed row."""

    def __init__(self, table: np.ndarray, n_ctx: int = 64):
        self.table, self.n_ctx, self.n_past = table, n_ctx, 0
        self.calls = []

    def reset(self):
        self.n_past = 0

    def forward(self, tokens, all_logits=False):
        self.calls.append((self.n_past, list(tokens)))
        self.n_past += len(tokens)
        rows = self.table[np.asarray(tokens)]
        return rows if all_logits else rows[-1]


def test_windows_follow_llama_cpp():
    tokens = list(range(100, 123))  # 23 tokens, windows of 8: two full windows, 7 tokens dropped
    windows = cut_windows(tokens, 8, bos_id=1)
    assert windows == [[1] + tokens[1:8], [1] + tokens[9:16]]
    assert cut_windows(tokens, 8, bos_id=None)[1] == tokens[8:16]
    with pytest.raises(ParameterError, match="23 tokens; a context of 12 needs at least 24"):
        cut_windows(tokens, 12, None)
    with pytest.raises(ParameterError, match="at least 4"):
        cut_windows(tokens, 2, None)


def test_uniform_logits_give_the_vocabulary_size():
    vocab = 50
    backend = FixedLogits(np.zeros((vocab, vocab), np.float32))
    result = perplexity(backend, list(range(40)), 16, progress=False)
    assert result.ppl == pytest.approx(vocab, rel=1e-12)
    assert result.error == 0.0
    assert result.n_windows == 2 and result.n_scored == 2 * (16 - 8 - 1)


def test_only_the_second_half_is_scored_from_an_empty_cache():
    rng = np.random.default_rng(0)
    vocab, n_ctx = 20, 10
    table = rng.standard_normal((vocab, vocab)).astype(np.float32)
    tokens = rng.integers(0, vocab, size=30).tolist()
    backend = FixedLogits(table)
    result = perplexity(backend, tokens, n_ctx, bos_id=3, progress=False)
    # Every window starts at position 0 with BOS, context half first, then the scored half.
    assert [c[0] for c in backend.calls] == [0, 5, 0, 5, 0, 5]
    assert [c[1][0] for c in backend.calls[::2]] == [3, 3, 3]
    expected = []
    for w in range(3):
        window = [3] + tokens[w * n_ctx + 1:(w + 1) * n_ctx]
        for j in range(5, 9):  # logits at j predict token j + 1
            logits = table[window[j]].astype(np.float64)
            expected.append(math.log(np.exp(logits).sum()) - logits[window[j + 1]])
    expected = np.array(expected)
    assert result.n_scored == len(expected) == 12
    assert result.ppl == pytest.approx(math.exp(expected.mean()), rel=1e-9)
    sd = math.sqrt((np.mean(expected ** 2) - expected.mean() ** 2) / (len(expected) - 1))
    assert result.error == pytest.approx(result.ppl * sd, rel=1e-6)
    assert result.running_ppl[-1] == result.ppl and len(result.running_ppl) == 3


def test_scored_nll_is_stable_for_large_logits():
    logits = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    assert scored_nll(logits, [0])[0] == pytest.approx(0.0, abs=1e-12)
    assert scored_nll(logits, [1])[0] == pytest.approx(1000.0)
    assert summarize(np.array([1.0, 1.0])) == (pytest.approx(math.e), 0.0)


def test_command_on_smollm2_matches_a_direct_computation(capsys):
    n_ctx = 64
    status = main(["perplexity", "smollm2-135m", "--file", str(ENGLISH), "--ctx", str(n_ctx),
                   "--backend", "reference", "--chunks", "2", "-q"])
    out = capsys.readouterr().out
    assert status == 0, out
    ppl, error = map(float, re.search(r"PPL = ([\d.]+) \+/- ([\d.]+)", out).groups())
    running = re.search(r"^\[1\]([\d.]+),\[2\]([\d.]+)$", out, re.M)
    assert float(running.group(2)) == ppl

    from airframe.tokenizer import load_tokenizer

    model = open_model("smollm2-135m")
    tokenizer = load_tokenizer(model.gguf)
    tokens = tokenizer.encode(ENGLISH.read_text(), add_special=True, parse_special=False)
    backend = open_backend("reference", model, RunOptions(n_ctx=n_ctx))
    nll = []
    for w in range(2):  # each window in one call this time, every logit kept
        window = tokens[w * n_ctx:(w + 1) * n_ctx]
        if tokenizer.add_bos:
            window[0] = tokenizer.bos_id
        backend.reset()
        logits = backend.forward(window, all_logits=True).astype(np.float64)
        for j in range(n_ctx // 2, n_ctx - 1):
            row = logits[j]
            nll.append(row.max() + math.log(np.exp(row - row.max()).sum()) - row[window[j + 1]])
    nll = np.array(nll)
    assert len(nll) == 2 * 31
    expected = math.exp(nll.mean())
    assert ppl == pytest.approx(expected, rel=2e-4)
    assert error == pytest.approx(expected * math.sqrt(nll.var() / (len(nll) - 1)), rel=2e-3, abs=1e-5)
    assert 1.0 < ppl < 200.0  # a small instruct model on plain English


def test_command_rejects_bad_input(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    assert main(["perplexity", "smollm2-135m", "--file", str(short), "--ctx", "64", "--backend", "reference"]) == 1
    assert "needs at least 128" in capsys.readouterr().err
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok \xff\xfe")
    assert main(["perplexity", "smollm2-135m", "--file", str(binary), "--backend", "reference"]) == 1
    assert "byte 3 is not UTF-8" in capsys.readouterr().err
    assert main(["perplexity", "smollm2-135m", "--file", str(tmp_path / "none.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["--ctx", "2"], "--ctx = 2, expected an integer >= 4"),
                                           (["--chunks", "1"], "--chunks = 1, expected an integer >= 2")])
def test_command_checks_its_flags_before_reading_anything(flags, message, tmp_path, capsys):
    missing = tmp_path / "none.txt"  # not read: the flags are refused first
    assert main(["perplexity", "no-such-model", "--file", str(missing), *flags]) == 1
    assert capsys.readouterr().err == f"airframe: error: {message}\n"
