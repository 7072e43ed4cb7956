"""`airframe run` and `airframe chat` check every flag before the model loads, in the flag's own
words; a prompt or -n too long for the context is refused before the prefill; --chat on a file
without a chat template says so; an error always starts a line of its own."""

import pytest

from airframe.cli import main
from airframe.commands.run import stream_to
from airframe.engine import Finish, Piece
from airframe.errors import NonFiniteError
from airframe.synthetic import write_synthetic_gguf


@pytest.fixture(scope="module")
def long_trained(tmp_path_factory):
    """A tiny model trained on 8192 positions: the backends' default context (4096) is shorter."""
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "long.gguf", "llama",
                                {"preset": "tiny", "ctx_train": 8192}, "F32")


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a backend fails the test: what is checked here is checked before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("airframe.engine.open_backend", refuse)


@pytest.mark.parametrize("flags,message", [
    (["-n", "-5"], "-n = -5, expected an integer >= 0, or -1 (until the context is full)"),
    (["-n", "100", "--ctx", "50"], "-n = 100, expected at most --ctx (50), or -1"),
    (["-n", str(10**12)], f"-n = {10**12}, expected at most the 8192 tokens the model was trained on"),
    (["--temp", "-1"], "--temp = -1.0, expected a finite number >= 0.0"),
    (["--top-k", "-2"], "--top-k = -2, expected an integer >= 0"),
    (["--top-p", "1.5"], "--top-p = 1.5, expected a number in 0.0..1.0"),
    (["--min-p", "-0.1"], "--min-p = -0.1, expected a number in 0.0..1.0"),
    (["--repeat-penalty", "0"], "--repeat-penalty = 0.0, expected a finite number > 0"),
    (["--repeat-last-n", "-3"], "--repeat-last-n = -3, expected an integer >= -1"),
    (["--seed", "-1"], "--seed = -1, expected an integer in 0.."),
    (["--ctx", "1"], "--ctx = 1, expected an integer >= 2"),
])
@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_bad_flag_is_refused_in_its_own_words_before_loading(command, flags, message, no_loading, capsys):
    args = [command, "smollm2-135m", *(["Hi"] if command == "run" else []), "--backend", "reference", *flags]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"airframe: error: {message}"), err


def test_n_beyond_the_default_context_is_refused_before_the_prefill(long_trained, capsys):
    assert main(["run", str(long_trained), "Hi", "--backend", "reference", "-n", "5000"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "airframe: error: -n = 5000, expected at most the context's 4096 tokens (--ctx)" in err


def test_without_n_the_answer_is_cut_to_the_context(long_trained, capsys):
    assert main(["run", str(long_trained), "Hi", "--backend", "reference", "--ctx", "8", "--temp", "0"]) == 0
    assert "generated" in capsys.readouterr().err  # -n's default of 256 does not outgrow --ctx 8


def test_a_prompt_longer_than_ctx_is_refused_before_loading(long_trained, no_loading, capsys):
    assert main(["run", str(long_trained), "one two three four five six seven eight nine ten",
                 "--backend", "reference", "--ctx", "8", "-n", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "the context holds 8: expected at most 7 prompt tokens" in err and "raise --ctx" in err


def test_a_prompt_longer_than_the_default_context_is_refused_before_it_is_echoed(long_trained, capsys):
    prompt = " ".join(["word"] * 4200)
    assert main(["run", str(long_trained), prompt, "--backend", "reference", "-n", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "the context holds 4096: expected at most 4095 prompt tokens" in err and "raise --ctx" in err


def test_chat_on_a_model_without_a_template_warns_before_loading(no_loading, capsys):
    with pytest.raises(AssertionError, match="loaded"):
        main(["run", "gemma3-270m", "Hi", "--chat", "--backend", "reference"])
    err = capsys.readouterr().err
    assert err.startswith("airframe: warning: gemma-3-270m-q4_k_m.gguf has no chat template")
    assert "most likely a base model" in err and "built-in gemma3 turn format" in err
    with pytest.raises(AssertionError, match="loaded"):
        main(["run", "smollm2-135m", "Hi", "--chat", "--backend", "reference"])
    assert "warning" not in capsys.readouterr().err  # SmolLM2 Instruct has its own template


class FailingEngine:
    """Streams one piece, then fails as a damaged model does."""

    def stream(self, prompt, params, cancel=None):
        def items():
            yield Piece(" and", [1], None)
            raise NonFiniteError("the logits at position 3 hold NaN")
            yield Finish("stop", 1, 1, 0.0, 0.0)

        return items()


def test_an_error_midway_ends_the_line_of_text_first(capsys):
    import sys

    with pytest.raises(NonFiniteError):
        stream_to(sys.stdout, FailingEngine(), "Hi", None, echo="Hi")
    assert capsys.readouterr().out == "Hi and\n"


def test_an_error_while_a_progress_bar_is_open_starts_its_own_line(monkeypatch, capsys):
    from tqdm import tqdm

    from airframe.errors import GGUFError

    def failing_load(model, options):
        bar = tqdm(total=3, desc="loading")
        bar.update(1)
        raise GGUFError("tensor blk.1.attn_q.weight is damaged")

    monkeypatch.setattr("airframe.reference.ReferenceBackend.load", failing_load)
    assert main(["run", "smollm2-135m", "Hi", "--backend", "reference"]) == 1
    err = capsys.readouterr().err
    assert "loading:  33%" in err and "\nairframe: error: tensor blk.1.attn_q.weight is damaged\n" in err
